"""Math by difficulty tier: where RL can move a model, and whether it extends or only sharpens it.

    metrics, extras = evaluate_tiers(model, tokenizer, cfg, problems, seed=seed)
    metrics["tier_edge_exact_match"]        # greedy accuracy on the edge tier, with _lo/_hi
    metrics["tier_edge_pass_at_16"]         # the unbiased pass@k estimate at k = 16
    extras["items"]                         # per-problem outcomes for llm/eval/paired.py

The tiers come from stage `prepare` (tiers/test.jsonl, llm/data/splits.py `tier_levels`): in
distribution (levels the model trained on and mostly solves), the edge (trained levels it solves
about half the time: where reinforcement learning with a verifier has something to reinforce)
and harder (levels nothing trains on). Per tier, on the first `eval.tier_problems` problems:

- greedy exact match, with a Wilson interval: what a user of the model sees;
- on the first `eval.tier_pass_k_problems` of them, n = `eval.tier_pass_k` samples at
  `eval.temperature`: the pass@k curve for k = 1..n by the unbiased estimator
  1 - C(n - c, k) / C(n, k) (c right of n; Chen et al. 2021), majority vote of the first
  `MAJORITY_OF` samples, and `greedy_wrong_pass`: the share of problems whose greedy answer is
  wrong while one of the n samples is right. That share bounds what sharpening alone (making
  the model choose an answer it already samples) can add to greedy accuracy; a model that
  gains more on a tier has learnt something it did not sample before.

Items (one record per problem, no texts): set "tier" (greedy: correct, tier, level, lang) and set
"tier_sampled" (score: the share of the n samples that are right), so llm/eval/paired.py
compares two models on the same problems of each tier.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Sequence

from llm.config import EvalConfig
from llm.data.batching import derive_seed
from llm.eval.evaluate import bootstrap_interval, generate_answers, pass_at_k, rate
from llm.eval.paired import TIER_LABELS
from llm.sample.rewards import is_correct, parse_answer

TIERS = tuple(TIER_LABELS)   # report order; llm/data/splits.py `tier_levels` draws them
MAJORITY_OF = 8


def by_tier(problems: Sequence[dict], n: int) -> dict[str, list[dict]]:
    """The first n problems of each tier, tiers in report order (unknown tier names after them)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for p in problems:
        if len(out[p["tier"]]) < n:
            out[p["tier"]].append(p)
    order = [t for t in TIERS if t in out] + sorted(t for t in out if t not in TIERS)
    return {t: out[t] for t in order}


def majority_correct(answers: Sequence[str], answer: str) -> bool:
    """Whether the most common parsed final answer among `answers` is right (unparsed answers do
    not vote; a tie goes to the value seen first)."""
    votes = Counter(v for v, _ in map(parse_answer, answers) if v is not None)
    if not votes:
        return False
    top = votes.most_common(1)[0][0]
    return is_correct(f"#### {top}", answer)


def evaluate_tiers(model, tokenizer, cfg: EvalConfig, problems: Sequence[dict], *, seed: int,
                   rt=None) -> tuple[dict, dict]:
    """Every tier measurement of one model -> (metrics, extras with "items", "pass_curves" and
    "timing_s"). `problems`: tiers/test.jsonl records ({"id", "question", "answer", "level",
    "lang", "tier"})."""
    metrics: dict = {}
    items: list[dict] = []
    curves: dict[str, list[float]] = {}
    timing: dict[str, float] = {}
    tiers = by_tier(problems, cfg.tier_problems)
    n = cfg.tier_pass_k
    for tier, probs in tiers.items():
        t0 = time.perf_counter()
        greedy, _ = generate_answers(model, tokenizer, [p["question"] for p in probs],
                                     max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, rt=rt)
        ok = [is_correct(a, p["answer"]) for p, a in zip(probs, greedy)]
        metrics.update(rate(f"tier_{tier}_exact_match", ok, cfg.confidence))
        metrics[f"tier_{tier}_n"] = len(probs)
        items += [{"set": "tier", "id": p["id"], "tier": tier, "level": int(p.get("level", 0)),
                   "lang": p.get("lang", ""), "correct": c} for p, c in zip(probs, ok)]
        sampled = probs[:cfg.tier_pass_k_problems]
        if sampled:
            answers, _ = generate_answers(model, tokenizer, [p["question"] for p in sampled for _ in range(n)],
                                          max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                          temperature=cfg.temperature, seed=derive_seed(seed, "tiers", tier), rt=rt)
            per = [answers[i * n:(i + 1) * n] for i in range(len(sampled))]
            counts = [sum(is_correct(a, p["answer"]) for a in mine) for p, mine in zip(sampled, per)]
            curve = [sum(pass_at_k(n, c, k) for c in counts) / len(counts) for k in range(1, n + 1)]
            curves[tier] = curve
            at_n = [float(c > 0) for c in counts]
            lo, hi = bootstrap_interval(at_n, cfg.confidence)
            metrics.update({f"tier_{tier}_pass_at_1": curve[0], f"tier_{tier}_pass_at_{n}": curve[-1],
                            f"tier_{tier}_pass_at_{n}_lo": lo, f"tier_{tier}_pass_at_{n}_hi": hi,
                            f"tier_{tier}_sampled_n": len(sampled)})
            k_maj = min(MAJORITY_OF, n)
            metrics[f"tier_{tier}_maj_at_{k_maj}"] = sum(
                majority_correct(mine[:k_maj], p["answer"]) for p, mine in zip(sampled, per)) / len(sampled)
            metrics[f"tier_{tier}_greedy_wrong_pass"] = sum(
                (not g) and c > 0 for g, c in zip(ok, counts)) / len(sampled)
            items += [{"set": "tier_sampled", "id": p["id"], "tier": tier, "score": c / n}
                      for p, c in zip(sampled, counts)]
        timing[tier] = round(time.perf_counter() - t0, 3)
    if tiers:
        metrics["tier_pass_k"] = n
    return metrics, {"items": items, "pass_curves": curves, "timing_s": timing}
