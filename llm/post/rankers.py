"""Which score picks the right answer among the SFT model's own samples: math rankers, measured.

    cands = draw_candidates(sft, tok, problems, n=16, temperature=1.0, max_new_tokens=64, batch_size=64, seed=s)
    scores = {"likelihood": [...], "reward model": [...], ...}   # one float per candidate
    table = ranker_table(cands, scores, confidence=0.95, seed=s)  # pair accuracy, best-of-n per ranker

A ranker orders answers to the same problem; the verifier (llm/sample/rewards.py `is_correct`) is
the gold. Measured on each problem's `n` answers sampled from SFT at `temperature` plus its greedy
answer (`draw_candidates`), for the rankers a user would try first (`RANKERS`):

  likelihood     log pi_SFT(answer | problem), summed over the answer's tokens
  per token      the same divided by the answer's length
  reward model   the reward model's score (its head reads SFT's trunk and likelihood)
  DPO implicit   log pi_DPO - log pi_SFT: the reward DPO's loss fits, dpo.beta times this (a
                 positive factor, which changes no order)
  agreement      how many of the problem's other samples end in the same final number (self-
                 consistency; a majority vote picks the answer most others agree with)
  generative verifier
                 the SFT model taught (stage verifier, llm/post/verifier.py) to answer "Is the answer
                 right?" after an answer: log p(Yes) - log p(No), a score that reads the whole answer
                 before it judges (scored by verifier.py's `candidate_scores`)

Two measures per ranker:
- pair accuracy: over every (right, wrong) pair of distinct answers to one problem, the share the
  ranker orders right (ties count half), and the same on the greedy-wrong slice, the pairs whose
  wrong answer is SFT's own greedy answer: only those can change what greedy decoding says, the
  share a reward would have to fix to move greedy accuracy;
- best-of-n: for n = 1..`n`, the share of problems whose highest-ranked answer among n samples is
  right, computed exactly over the random n-subsets of the samples (`best_of_n`), beside pass@n
  (the best any ranker could do) and a random pick (sampled accuracy).
Intervals: percentile bootstrap over problems (pairs of one problem move together).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import numpy as np

from llm.data.batching import derive_seed
from llm.data.template import user_prompt
from llm.eval.evaluate import generate_replies, pass_at_k
from llm.sample.rewards import is_correct, parse_answer

RANKERS = ("likelihood", "per token", "reward model", "DPO implicit", "agreement", "generative verifier")


def draw_candidates(policy, tok, problems: Sequence[dict], *, n: int, temperature: float, max_new_tokens: int,
                    batch_size: int, seed: int, rt=None) -> list[dict]:
    """Per problem {"prompt_ids", "answer", "greedy": text, "samples": [n texts], "greedy_right",
    "right": [bool per sample]}: the greedy answer and n answers at `temperature` (sample s drawn
    with seed (seed, s): llm/eval/evaluate.py generate_replies)."""
    prompts = [user_prompt(p["question"], tok) for p in problems]
    kw = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, rt=rt)
    greedy, _ = generate_replies(policy, tok, prompts, **kw)
    drawn = [generate_replies(policy, tok, prompts, temperature=temperature, seed=derive_seed(seed, "rankers", s),
                              **kw)[0] for s in range(n)]
    return [{"prompt_ids": prompts[i], "answer": p["answer"], "greedy": greedy[i],
             "samples": [d[i] for d in drawn], "greedy_right": is_correct(greedy[i], p["answer"]),
             "right": [is_correct(d[i], p["answer"]) for d in drawn]} for i, p in enumerate(problems)]


def _pairs(c: dict, scores: Sequence[float], greedy_score: float | None) -> tuple[list[float], list[float]]:
    """(outcomes of every (right, wrong) pair of distinct sample texts, outcomes of the pairs (right
    sample, greedy answer) when greedy is wrong): 1 ranked right, 0.5 tie, 0 wrong."""
    right = {t: s for t, s, ok in zip(c["samples"], scores, c["right"]) if ok}
    wrong = {t: s for t, s, ok in zip(c["samples"], scores, c["right"]) if not ok}
    cmp = lambda a, b: 1.0 if a > b else 0.5 if a == b else 0.0  # noqa: E731
    every = [cmp(a, b) for a in right.values() for b in wrong.values()]
    slice_ = [cmp(a, greedy_score) for a in right.values()] if (not c["greedy_right"] and greedy_score is not None) \
        else []
    return every, slice_


def best_of_n(cands: Sequence[dict], scores: Sequence[Sequence[float]]) -> np.ndarray:
    """(problems, n) array: the chance that the highest-scored of k samples drawn at random without
    replacement from a problem's n (k = 1..n) is right, exactly. With the samples sorted by score,
    the one at rank r (0 = highest) is the top of a random k-subset with probability
    C(n - 1 - r, k - 1) / C(n, k); samples with equal scores are picked among at random, so each
    counts the share of its tie group that is right."""
    n = len(cands[0]["samples"]) if cands else 0
    out = np.zeros((len(cands), n))
    for i, (c, sc) in enumerate(zip(cands, scores)):
        ok, sc = np.asarray(c["right"], dtype=float), np.asarray(sc, dtype=float)
        order = np.argsort(-sc, kind="stable")
        sorted_sc, sorted_ok = sc[order], ok[order]
        group_mean = np.array([sorted_ok[sorted_sc == v].mean() for v in sorted_sc])
        for k in range(1, n + 1):
            top = np.array([math.comb(n - 1 - r, k - 1) for r in range(n)], dtype=float) / math.comb(n, k)
            out[i, k - 1] = float((group_mean * top).sum())
    return out


def _boot(per_problem: Sequence[Sequence[float]], confidence: float, rng: np.random.Generator,
          n_boot: int = 2000) -> tuple[float | None, float | None, float | None]:
    """(mean over every outcome, lo, hi): outcomes grouped by problem, problems resampled."""
    groups = [np.asarray(g, dtype=float) for g in per_problem if len(g)]
    if not groups:
        return None, None, None
    sums, counts = np.array([g.sum() for g in groups]), np.array([len(g) for g in groups])
    ix = rng.integers(0, len(groups), size=(n_boot, len(groups)))
    draws = sums[ix].sum(1) / counts[ix].sum(1)
    a = (1 - confidence) / 2
    lo, hi = np.quantile(draws, [a, 1 - a])
    return float(sums.sum() / counts.sum()), float(lo), float(hi)


def ranker_table(cands: Sequence[dict], scores: dict[str, list[list[float]]], greedy_scores: dict[str, list[float]],
                 *, confidence: float, seed: int) -> dict:
    """Per ranker {"pair_accuracy", _lo, _hi, "pairs", "greedy_wrong_accuracy", _lo, _hi,
    "greedy_wrong_pairs", "best_of_n": [k = 1..n], "best_of_n_lo"/"_hi" at n, and paired over the
    problems "best_of_n_vs_greedy" (its best of n less greedy decoding's accuracy) and
    "best_of_n_vs_likelihood" (less the likelihood's best of n), each with _lo/_hi}; and the reference
    curves "pass_at_n" and "random" (the mean sampled accuracy) with the counts of problems."""
    out: dict = {"rankers": {}, "problems": len(cands),
                 "greedy_accuracy": float(np.mean([c["greedy_right"] for c in cands])) if cands else None}
    tops: dict[str, np.ndarray] = {}   # per ranker, each problem's best of n (n = all the samples)
    for name, sc in scores.items():
        rng = np.random.default_rng([seed, *name.encode()])
        every, sliced = zip(*(_pairs(c, s, g) for c, s, g in zip(cands, sc, greedy_scores.get(name, [None] * len(cands)))))
        acc, lo, hi = _boot(every, confidence, rng)
        gacc, glo, ghi = _boot(sliced, confidence, rng)
        bon = best_of_n(cands, sc)
        _, blo, bhi = _boot([[x] for x in bon[:, -1]], confidence, rng)
        out["rankers"][name] = {"pair_accuracy": acc, "pair_accuracy_lo": lo, "pair_accuracy_hi": hi,
                                "pairs": sum(map(len, every)), "greedy_wrong_accuracy": gacc,
                                "greedy_wrong_accuracy_lo": glo, "greedy_wrong_accuracy_hi": ghi,
                                "greedy_wrong_pairs": sum(map(len, sliced)),
                                "best_of_n": bon.mean(0).tolist(), "best_of_n_lo": blo, "best_of_n_hi": bhi}
        tops[name] = bon[:, -1]
    # paired over problems: each ranker's best of n against greedy decoding and against the likelihood's
    greedy = np.array([float(c["greedy_right"]) for c in cands])
    for name, top in tops.items():
        rng = np.random.default_rng([seed, *name.encode(), 1])
        for key, ref in (("greedy", greedy), ("likelihood", tops.get("likelihood"))):
            if ref is None or (key == "likelihood" and name == "likelihood"):
                continue
            d, lo, hi = _boot([[x] for x in top - ref], confidence, rng)
            out["rankers"][name] |= {f"best_of_n_vs_{key}": d, f"best_of_n_vs_{key}_lo": lo,
                                     f"best_of_n_vs_{key}_hi": hi}
    n = len(cands[0]["samples"]) if cands else 0
    ok = np.array([c["right"] for c in cands], dtype=float).reshape(len(cands), n)
    c_right = ok.sum(1)
    out["pass_at_n"] = [float(np.mean([pass_at_k(n, int(c), k) for c in c_right])) for k in range(1, n + 1)]
    out["random"] = [float(ok.mean())] * n
    return out


def score_all(cands: Sequence[dict], tok, *, sft, rm, dpo, batch_size: int, device,
              rt=None) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
    """Every ranker's score of every sample and of each greedy answer but the generative verifier's
    (llm/post/verifier.py `candidate_scores`): ({ranker: [[per sample] per problem]}, {ranker:
    [greedy score per problem]}). dpo None leaves the DPO ranker out."""
    from llm.data.preference import encode_response
    from llm.nn.reward_model import score_sequences
    from llm.post.pairs import add_likelihoods

    texts = [[*c["samples"], c["greedy"]] for c in cands]   # the greedy answer last
    pids = [c["prompt_ids"] for c in cands]

    def likelihoods(model) -> tuple[list[list[float]], list[list[float]]]:
        rows = [[{"text": t} for t in ts] for ts in texts]
        add_likelihoods(rows, pids, model, tok, batch_size=batch_size, device=device, rt=rt)
        return [[x["logp"] for x in r] for r in rows], [[x["logp_mean"] for x in r] for r in rows]

    logp, per_token = likelihoods(sft)
    seq_len = rm.config.seq_len
    seqs = [encode_response(p, t, tok)[-seq_len:] for p, ts in zip(pids, texts) for t in ts]
    flat = score_sequences(rm, seqs, pad_id=tok.pad_id, batch_size=batch_size, device=device, rt=rt).tolist()
    width = len(texts[0]) if texts else 0
    rows = {"likelihood": logp, "per token": per_token,
            "reward model": [flat[i * width:(i + 1) * width] for i in range(len(texts))]}
    if dpo is not None:
        dpo_logp, _ = likelihoods(dpo)
        rows["DPO implicit"] = [[d - s for d, s in zip(dr, sr)] for dr, sr in zip(dpo_logp, logp)]
    rows["agreement"] = [agreement_with(ts[:-1], ts) for ts in texts]
    return {k: [r[:-1] for r in v] for k, v in rows.items()}, {k: [r[-1] for r in v] for k, v in rows.items()}


def agreement_with(samples: Sequence[str], texts: Sequence[str]) -> list[float]:
    """Per text, how many of `samples` other than itself end in the same final number (0 for an
    unparsed text): a sample is not counted as agreeing with itself, the greedy answer (not one
    of the samples) is counted against all of them."""
    values = Counter(v for v in (parse_answer(t)[0] for t in samples) if v is not None)
    out = []
    for j, t in enumerate(texts):
        v = parse_answer(t)[0]
        own = 1 if j < len(samples) else 0
        out.append(float(values[v] - own) if v is not None else 0.0)
    return out
