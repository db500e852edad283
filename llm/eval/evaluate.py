"""Evaluation: perplexity, math exact match (English and Chinese) and pass@k, instruction
tasks, bare arithmetic, second turns of conversations, out-of-scope requests, RM score and
win rate, KL to a reference, confidence intervals.

- `wilson_interval(k, n, confidence)`: the Wilson score interval for a proportion; it
  stays inside [0, 1] and is sensible at k = 0 or k = n, unlike the normal approximation.
- `pass_at_k(n, c, k)`: the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).
- `bootstrap_interval(values)`: percentile bootstrap of a mean, seeded.
- `lm_eval(model, batches, bytes_per_token)`: mean token loss, perplexity and bits per byte,
  beside the bits per byte of a uniform guess over the vocabulary.
- `math_eval(model, tokenizer, problems, ...)`: greedy answers to held-out problems,
  scored by the safe parser of llm/sample/rewards.py; per-level and per-language accuracy, the
  `#### N` format rate; sample outputs.
- `score_tasks(tasks, responses)`: instruction tasks, right only when the response is exactly
  the answer; per kind.
- `score_multiturn(items, responses)`: the second turn of a two-exchange conversation, right
  as a math answer or a task answer is; per kind and language.
- `score_scope(items, responses)`: requests outside the model's skills: the share of answers
  with no math template (`has_math_template`: no `####`, no `a op b = c`) and the share that
  is exactly the taught statement of what the model can do.
- `context_items(questions, scope, tasks)` and `score_context(name, items, alone, outcomes)`:
  the same held-out questions asked again in the contexts a chat brings (`CONTEXTS`: after an
  out-of-scope request, after an instruction task, under system messages), each context's
  exact match beside the questions' alone, per language, and the drop in points between them
  with a paired bootstrap interval.
- `rate(key, outcomes)`: a proportion and its Wilson interval under `key`, `key_lo`, `key_hi`.
- `rm_scores(rm, tokenizer, questions, responses)`: the reward model's score of each answer,
  read at the closing <|end|> of the rendered conversation (as the RM is trained).
- `win_rate(scores, ref_scores, ties)`: wins + ties/2 over n, with a Wilson interval.
- KL to a reference: llm.sample.rollout.sampled_kl (sample from the model at temperature 1, exact
  per-token KL over the vocabulary at each sampled state), as `kl` in nats per token and
  `kl_seq` in nats per response.
- `evaluate_model(model, tokenizer, cfg, ...)`: all of the above for one model, as flat
  metrics (numbers only, for `dvc metrics diff`) plus samples, timings and the outcome of
  every item (`ITEM_SETS`) kept apart; the report pairs those outcomes with the parent
  model's to test each change (llm/eval/paired.py).

Library code only: the `eval` stage decides which models, data and params.
"""
from __future__ import annotations

import contextlib
import math
import re
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from llm.config import EvalConfig
from llm.data.batching import derive_seed, pad_collate
from llm.data.template import render, render_prompt, user_prompt
from llm.nn.reward_model import reward
from llm.runtime import sharded_map
from llm.sample.generate import generate
from llm.sample.rewards import is_correct, parse_answer, task_correct
from llm.sample.rollout import sampled_kl

_Z = {0.9: 1.6448536269514722, 0.95: 1.959963984540054, 0.99: 2.5758293035489004}


def z_score(confidence: float) -> float:
    """Two-sided normal quantile for a confidence level (exact for 0.9/0.95/0.99, else computed)."""
    if confidence in _Z:
        return _Z[confidence]
    # Inverse of the normal CDF by bisection on erf: no SciPy needed for one number.
    target = 0.5 + confidence / 2
    lo, hi = 0.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for k successes out of n trials."""
    if n == 0:
        return 0.0, 1.0
    z = z_score(confidence)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # exact at the edges: centre - half is 0 in exact arithmetic when k = 0, 1e-17 in floats
    lo = 0.0 if k <= 0 else max(0.0, centre - half)
    hi = 1.0 if k >= n else min(1.0, centre + half)
    return lo, hi


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (out of n drawn, c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def bootstrap_interval(values: Sequence[float], confidence: float = 0.95, n_boot: int = 2000,
                       seed: int = 0, counts: Sequence[float] | None = None) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (for averaged scores like pass@k); with `counts`,
    of sum(values) / sum(counts) over whole items resampled (a per-token mean of per-sequence
    sums: KL in nats per token, each response resampled with its length)."""
    if not values:
        return 0.0, 0.0
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(len(values), (n_boot, len(values)), generator=g)
    if counts is None:
        means = x[idx].mean(1).sort().values
    else:
        n = torch.tensor(counts, dtype=torch.float64)
        means = (x[idx].sum(1) / n[idx].sum(1).clamp(min=1)).sort().values
    lo = means[int((1 - confidence) / 2 * n_boot)].item()
    hi = means[min(n_boot - 1, int((1 + confidence) / 2 * n_boot))].item()
    return lo, hi


@torch.no_grad()
def generate_answers(model, tokenizer, questions: Sequence[str], *, max_new_tokens: int, batch_size: int,
                     temperature: float = 0.0, seed: int | None = None, rt=None) -> tuple[list[str], list[int]]:
    """The model's answer to each question (chat template, stop at <|end|> or <|endoftext|>),
    in input order: (texts, generated token counts incl. the stop token).

    Prompts are batched by length: similar prompts have similar answer lengths here (a level-4
    problem is long and so is its solution), and a batch decodes until its longest answer ends.
    Sampling (temperature > 0) needs `seed`: batch b draws from a generator seeded by (seed, b),
    so its answers do not depend on the batches before it. With a distributed `rt` the batches
    are shared out over the ranks and gathered (llm.runtime.sharded_map): every rank gets the
    answers one process would give.
    """
    return generate_replies(model, tokenizer, [user_prompt(q, tokenizer) for q in questions],
                            max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature, seed=seed,
                            rt=rt)


@torch.no_grad()
def generate_replies(model, tokenizer, prompts: Sequence[list[int]], *, max_new_tokens: int, batch_size: int,
                     temperature: float = 0.0, seed: int | None = None, rt=None) -> tuple[list[str], list[int]]:
    """`generate_answers` for prompts already rendered (llm.data.template.render_prompt: a whole
    conversation ending in <|assistant|>), e.g. the second turn of a conversation."""
    if temperature > 0 and seed is None:
        raise ValueError("generate_answers: sampling (temperature > 0) needs a seed")
    model.eval()
    device = model.wte.weight.device
    stop = (tokenizer.special["<|end|>"], tokenizer.special["<|endoftext|>"])
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # stable: repeats stay together
    chunks = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]

    def one(b: int) -> list[tuple[str, int]]:
        chunk = [prompts[i] for i in chunks[b]]
        room = model.config.seq_len - max(map(len, chunk))
        if room < 1:
            raise ValueError(f"a prompt of {max(map(len, chunk))} tokens leaves no room in seq_len"
                             f" {model.config.seq_len}: raise pretrain.model.seq_len in params.yaml")
        g = torch.Generator(device).manual_seed(derive_seed(seed, "batch", b)) if temperature > 0 else None
        gen = generate(model, chunk, min(max_new_tokens, room), temperature=temperature, stop_ids=stop,
                       pad_id=tokenizer.pad_id, generator=g)
        return [(tokenizer.decode(r), n) for r, n in zip(gen.responses(), gen.response_mask.sum(-1).tolist())]

    texts: list[str] = [""] * len(prompts)
    counts: list[int] = [0] * len(prompts)
    for ix, answers in zip(chunks, sharded_map(one, len(chunks), rt)):
        for i, (text, n) in zip(ix, answers):
            texts[i], counts[i] = text, n
    return texts, counts


def answer_questions(model, tokenizer, questions: Sequence[str], *, max_new_tokens: int, batch_size: int,
                     temperature: float = 0.0, seed: int | None = None, rt=None) -> list[str]:
    """The model's answer text for each question (see `generate_answers`)."""
    return generate_answers(model, tokenizer, questions, max_new_tokens=max_new_tokens, batch_size=batch_size,
                            temperature=temperature, seed=seed, rt=rt)[0]


def rate(key: str, outcomes: Sequence[bool], confidence: float = 0.95) -> dict:
    """{key: share of True, key_lo, key_hi}: a proportion with its Wilson interval."""
    n, k = len(outcomes), sum(map(bool, outcomes))
    lo, hi = wilson_interval(k, n, confidence)
    return {key: k / max(n, 1), f"{key}_lo": lo, f"{key}_hi": hi}


def _by(records: Sequence[dict], outcomes: Sequence[bool], field: str) -> dict[Any, list[bool]]:
    """Outcomes grouped by a record field, in sorted key order; records without it are left out."""
    groups: dict[Any, list[bool]] = defaultdict(list)
    for r, c in zip(records, outcomes):
        if field in r:
            groups[r[field]].append(c)
    return dict(sorted(groups.items()))


def score_math(problems: Sequence[dict], answers: Sequence[str], confidence: float = 0.95,
               n_samples_kept: int = 5) -> dict:
    """Exact match of `answers` against problems ({"question", "answer", "level", "lang"}):
    overall, per level and per language ("math_exact_match_en", "_zh"), each with a Wilson
    interval; the share ending in a `#### N` line, with its interval; a few samples."""
    correct = [is_correct(a, p["answer"]) for a, p in zip(answers, problems)]
    formatted = [parse_answer(a)[1] for a in answers]
    out = {**rate("math_exact_match", correct, confidence), "math_n": len(problems),
           **rate("math_format_rate", formatted, confidence)}
    for level, cs in _by([{"level": int(p.get("level", 0))} for p in problems], correct, "level").items():
        out.update(rate(f"math_exact_match_level{level}", cs, confidence))
    for lang, cs in _by(problems, correct, "lang").items():
        out.update(rate(f"math_exact_match_{lang}", cs, confidence))
        out[f"math_n_{lang}"] = len(cs)
    out["samples"] = [{"question": p["question"], "answer": p["answer"], "response": a, "correct": c}
                      for p, a, c in list(zip(problems, answers, correct))[:n_samples_kept]]
    return out


def score_tasks(tasks: Sequence[dict], responses: Sequence[str], confidence: float = 0.95) -> tuple[dict, list[bool]]:
    """Exact match on instruction tasks ({"prompt", "answer", "kind"}): overall and per kind,
    with Wilson intervals -> (metrics, per-task outcomes)."""
    correct = [task_correct(r, t["answer"]) for t, r in zip(tasks, responses)]
    out = {**rate("task_exact_match", correct, confidence), "task_n": len(tasks)}
    for kind, cs in _by(tasks, correct, "kind").items():
        out.update(rate(f"task_exact_match_{kind}", cs, confidence))
    return out, correct


def score_multiturn(items: Sequence[dict], responses: Sequence[str], confidence: float = 0.95
                    ) -> tuple[dict, list[bool]]:
    """Exact match of the answers to the second turn of two-exchange conversations ({"messages",
    "answer", "kind", "lang"}; llm/data/generators.py multiturn_conversation): a task after a sum
    right only when the response is exactly the task's answer, the math kinds (a follow-up on
    the last result, a new problem) by the `#### N` parser. Overall, per kind and per language
    of the first turn, with Wilson intervals -> (metrics, per-item outcomes)."""
    correct = [task_correct(r, c["answer"]) if c["kind"] == "task_after_sum" else is_correct(r, c["answer"])
               for c, r in zip(items, responses)]
    out = {**rate("multiturn_exact_match", correct, confidence), "multiturn_n": len(items)}
    for field in ("kind", "lang"):
        for group, cs in _by(items, correct, field).items():
            out.update(rate(f"multiturn_exact_match_{group}", cs, confidence))
    return out, correct


# A worked calculation, "12 + 7 = 19", in the form the math answers take.
_CALCULATION = re.compile(r"\d+(?:\.\d+)?\s*[-+*/×÷]\s*\d+(?:\.\d+)?\s*=\s*-?\d+")


def has_math_template(response: str) -> bool:
    """Whether a response is shaped as a math answer: a `####` line or a worked calculation
    `a op b = c` (what SFT without out-of-scope training writes to any request)."""
    return "####" in response or _CALCULATION.search(response) is not None


def score_scope(items: Sequence[dict], responses: Sequence[str], confidence: float = 0.95
                ) -> tuple[dict, list[bool]]:
    """Answers to requests outside the model's skills ({"prompt", "answer", "lang", and
    "history" when asked after a first exchange}): the share with no math template
    (`has_math_template`), overall, per language and (where some have a history) per turn, and
    the share that is exactly the taught statement of what the model can do, with Wilson
    intervals -> (metrics, per-item no-math outcomes)."""
    no_math = [not has_math_template(r) for r in responses]
    exact = [r.strip() == c["answer"].strip() for c, r in zip(items, responses)]
    out = {**rate("scope_no_math_rate", no_math, confidence), **rate("scope_exact_match", exact, confidence),
           "scope_n": len(items)}
    second = [bool(c.get("history")) for c in items]
    if any(second):  # asked after a first exchange: reported apart, as well as in the whole
        for name, turn in (("first_turn", False), ("second_turn", True)):
            pick = [k for k, s in zip(no_math, second) if s == turn]
            out.update({**rate(f"scope_no_math_rate_{name}", pick, confidence), f"scope_n_{name}": len(pick)})
    for lang, cs in _by(items, no_math, "lang").items():
        out.update(rate(f"scope_no_math_rate_{lang}", cs, confidence))
    return out, no_math


# The contexts `context_items` asks a held-out question in, beside asking it alone: after an
# out-of-scope request answered with the taught statement of what the model can do, after an
# instruction task answered, and under three system messages: a short one, the one most chat
# clients send (in English whatever the user's language), and one that no training conversation
# has (llm/data/generators.py SYSTEM_MESSAGES holds the first two and not the third), which says
# whether what SFT learned holds for a message it never saw.
CONTEXT_SYSTEM = {"system_short": {"en": "You are terse.", "zh": "请简洁回答。"},
                  "system_helpful": {"en": "You are a helpful assistant.", "zh": "You are a helpful assistant."},
                  "system_unseen": {"en": "You are a careful assistant who checks every step.",
                                    "zh": "你是一个认真的助手，每一步都要检查。"}}
CONTEXTS = ("after_scope", "after_task", *CONTEXT_SYSTEM)


def context_items(questions: Sequence[dict], scope: Sequence[dict] = (), tasks: Sequence[dict] = ()) -> list[dict]:
    """Every question ({"id", "question", "lang"}) asked in each context of `CONTEXTS` that has
    what it needs, as [{"context", "index" (of the question), "lang", "messages"}] ready for
    `render_prompt`, in context order. The openings are the evaluation's own held-out items,
    answered as taught (the model reads the ideal answer, not its own), assigned by position so
    that every model gets the same conversations: the i-th question in language L follows the
    (i mod k)-th of the k requests of `scope` in L (of all of them when none is in L) and the
    (i mod m)-th of the m `tasks`; without scope requests or tasks that context is left out."""
    by_lang: dict[str, list[dict]] = defaultdict(list)
    for r in scope:
        by_lang[r.get("lang", "en")].append(r)
    seen: dict[str, int] = defaultdict(int)  # questions so far in each language
    out: list[dict] = []
    for i, q in enumerate(questions):
        lang = q.get("lang", "en")
        user = {"role": "user", "content": q["question"]}
        pool = by_lang.get(lang) or list(scope)
        openings = {"after_scope": pool[seen[lang] % len(pool)] if pool else None,
                    "after_task": tasks[i % len(tasks)] if tasks else None}
        seen[lang] += 1
        for ctx in CONTEXTS:
            if ctx in CONTEXT_SYSTEM:
                messages = [{"role": "system", "content": CONTEXT_SYSTEM[ctx][lang if lang == "zh" else "en"]}, user]
            elif openings[ctx] is None:
                continue
            else:
                o = openings[ctx]
                messages = [{"role": "user", "content": o["prompt"]}, {"role": "assistant", "content": o["answer"]},
                            user]
            out.append({"context": ctx, "index": i, "lang": lang, "messages": messages})
    out.sort(key=lambda c: CONTEXTS.index(c["context"]))  # stable: question order within a context
    return out


def score_context(name: str, questions: Sequence[dict], alone: Sequence[bool], items: Sequence[dict],
                  outcomes: Sequence[bool], confidence: float = 0.95, seed: int = 0) -> dict:
    """The metrics of `questions` (their "lang") asked alone (outcomes `alone`) and in the contexts
    of `items` (`context_items`, outcomes `outcomes`), under `context_<name>_`: `_n`; `_alone`
    and each context's exact match, overall and per language, with Wilson intervals; and
    `_<context>_drop`, the exact match alone minus in that context (points lost to the context,
    negative when it helps), with a percentile bootstrap interval of the paired differences."""
    p = f"context_{name}"
    out: dict = {f"{p}_n": len(questions)}

    def rates(key: str, oks: Sequence[bool], langs: Sequence[str]) -> None:
        out.update(rate(key, oks, confidence))
        for lang, cs in _by([{"lang": lg} for lg in langs], oks, "lang").items():
            out.update(rate(f"{key}_{lang}", cs, confidence))

    rates(f"{p}_alone", alone, [q.get("lang", "en") for q in questions])
    for ctx in CONTEXTS:
        pick = [(c["index"], k) for c, k in zip(items, outcomes) if c["context"] == ctx]
        if not pick:
            continue
        rates(f"{p}_{ctx}", [k for _, k in pick], [questions[i].get("lang", "en") for i, _ in pick])
        diffs = [float(alone[i]) - float(k) for i, k in pick]
        lo, hi = bootstrap_interval(diffs, confidence, seed=derive_seed(seed, name, ctx))
        out.update({f"{p}_{ctx}_drop": _mean(diffs), f"{p}_{ctx}_drop_lo": lo, f"{p}_{ctx}_drop_hi": hi})
    return out


def math_eval(model, tokenizer, problems: Sequence[dict], *, max_new_tokens: int, batch_size: int,
              confidence: float = 0.95, n_samples_kept: int = 5, rt=None) -> dict:
    """Greedy exact match on problems ({"question", "answer", "level"}), with a Wilson interval."""
    answers = answer_questions(model, tokenizer, [p["question"] for p in problems],
                               max_new_tokens=max_new_tokens, batch_size=batch_size, rt=rt)
    return score_math(problems, answers, confidence, n_samples_kept)


def math_pass_at_k(model, tokenizer, problems: Sequence[dict], *, k: int, temperature: float,
                   max_new_tokens: int, batch_size: int, seed: int, confidence: float = 0.95, rt=None) -> dict:
    """pass@k with n = k samples per problem, and the sampled accuracy (the share of all k
    samples that are right: pass@1 at this temperature), each with a bootstrap interval over
    problems; "correct_counts" holds each problem's number of right samples."""
    questions = [p["question"] for p in problems for _ in range(k)]
    answers = answer_questions(model, tokenizer, questions, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, temperature=temperature, seed=seed, rt=rt)
    counts = [sum(is_correct(a, p["answer"]) for a in answers[i * k:(i + 1) * k]) for i, p in enumerate(problems)]
    per_problem = [pass_at_k(k, c, k) for c in counts]
    accuracy = [c / k for c in counts]
    lo, hi = bootstrap_interval(per_problem, confidence)
    a_lo, a_hi = bootstrap_interval(accuracy, confidence, seed=1)
    return {f"math_pass_at_{k}": sum(per_problem) / max(len(per_problem), 1),
            f"math_pass_at_{k}_lo": lo, f"math_pass_at_{k}_hi": hi,
            "math_sample_accuracy": sum(accuracy) / max(len(accuracy), 1),
            "math_sample_accuracy_lo": a_lo, "math_sample_accuracy_hi": a_hi, "correct_counts": counts}


@torch.no_grad()
def lm_eval(model, batches: Sequence[dict], bytes_per_token: float | None = None, rt=None) -> dict:
    """Mean next-token loss over `batches` ({"idx", "targets"}: (B, T) long, -100 = unscored),
    its perplexity, and, given the bytes per token of the text, its bits per byte:

        val_bpb          = loss / ln 2 / bytes_per_token
        val_bpb_uniform  = log2(vocab_size) / bytes_per_token

    The eval stage passes held-out pretraining text (the Shakespeare works no stage trains on),
    so `val_bpb` says how well a model still reads plain English, lower is better, for every
    model alike: the base model learned it; fine-tuning on conversations can unlearn it.
    `val_bpb_uniform` is what a guess spread evenly over the vocabulary scores; a model above it
    predicts the text worse than knowing nothing. A distributed `rt` shares the batches out over
    the ranks (the sum runs in batch order either way)."""
    was_training = model.training
    model.eval()
    device = model.wte.weight.device

    def one(i: int) -> tuple[float, int]:
        b = batches[i]
        logits = model(b["idx"].to(device))                      # (B, T, V) float32
        targets = b["targets"].to(device)                         # (B, T)
        return (F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                reduction="sum").item(), int((targets != -100).sum()))

    total, n = 0.0, 0
    try:
        for loss_sum, count in sharded_map(one, len(batches), rt):
            total += loss_sum
            n += count
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("lm_eval: no scored tokens in the batches")
    loss = total / n
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": n}
    if bytes_per_token:
        out["val_bpb"] = loss / math.log(2) / bytes_per_token
        out["val_bpb_uniform"] = math.log2(model.config.vocab_size) / bytes_per_token
    return out


@torch.no_grad()
def rm_scores(rm, tokenizer, questions: Sequence[str], responses: Sequence[str], *, batch_size: int,
              rt=None) -> list[float]:
    """The reward model's score of each (question, response): the conversation is rendered with
    the chat template (llm/data/template.py render: BOS, user turn, assistant turn, closing <|end|>),
    cut to the RM's seq_len, and read at its last real token (llm.nn.reward_model.reward)."""
    if len(questions) != len(responses):
        raise ValueError(f"rm_scores: {len(questions)} questions but {len(responses)} responses")
    rm.eval()
    device = rm.wte.weight.device
    seqs = []
    for i, (q, r) in enumerate(zip(questions, responses)):
        rendered = render([{"role": "user", "content": q}, {"role": "assistant", "content": r}], tokenizer,
                          max_tokens=rm.config.seq_len)
        if rendered is None:
            raise ValueError(f"rm_scores: question {i} alone fills the RM's seq_len={rm.config.seq_len}")
        seqs.append(rendered[0])
    starts = range(0, len(seqs), batch_size)

    def one(b: int) -> list[float]:
        batch = pad_collate(seqs[starts[b]:starts[b] + batch_size], pad_id=tokenizer.pad_id, shift=False)
        return reward(rm, batch["idx"].to(device), batch["attention_mask"].to(device)).tolist()  # (B,)

    return [r for part in sharded_map(one, len(starts), rt) for r in part]


def win_rate(scores: Sequence[float], ref_scores: Sequence[float], ties: Sequence[bool] | None = None,
             confidence: float = 0.95) -> dict:
    """Share of prompts where `scores` beat `ref_scores`, ties counting half, with a Wilson
    interval (on the half-integer count). `ties[i]` forces a tie (e.g. identical responses,
    whose scores could differ in the last bit through different padding)."""
    if len(scores) != len(ref_scores):
        raise ValueError(f"win_rate: {len(scores)} scores but {len(ref_scores)} reference scores")
    wins = tied = losses = 0
    for i, (a, b) in enumerate(zip(scores, ref_scores)):
        if (ties is not None and ties[i]) or a == b:
            tied += 1
        elif a > b:
            wins += 1
        else:
            losses += 1
    n = len(scores)
    k = wins + 0.5 * tied
    lo, hi = wilson_interval(k, n, confidence)
    return {"win_rate": k / max(n, 1), "win_rate_lo": lo, "win_rate_hi": hi,
            "wins": wins, "ties": tied, "losses": losses}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / max(len(xs), 1)


# The per-item outcome records of `evaluate_model` (extras["items"]), one per scored item, in
# a stable order; llm/eval/paired.py pairs two models' records by (set, id). No texts: a few
# hundred bytes per model per item set, so the files stay small enough to commit every run
# (extras["item_samples"] keeps the texts of the first few items of each group).
#   math          greedy answer to a held-out problem: correct, formatted (ends in `#### N`),
#                 level, lang
#   task          greedy answer to an instruction task: correct, kind
#   arithmetic    greedy answer to a bare calculation: correct, op, lang
#   multiturn     greedy answer to the second turn of a two-exchange conversation: correct, kind, lang
#   scope         greedy answer to a request outside the model's skills: correct (no math template), lang
#   context       greedy answer to a held-out math problem or bare calculation asked in a context
#                 (`CONTEXTS`): correct, of ("math" | "arithmetic"), context, lang; id "<of>:<context>:<id>"
#   math_sampled  the share of cfg.pass_k samples at cfg.temperature that are right: score
#   rm            the reward model's score of the greedy answer: score
#   continuation  the gold judge's score of one sampled continuation of a held-out passage: score
#                 (written by the eval stage: llm/post/continuation.py evaluate_continuations)
ITEM_SETS = ("math", "task", "arithmetic", "multiturn", "scope", "context", "math_sampled", "rm", "continuation")


def _first_of_each_group(shown: Sequence[tuple], n: int) -> list[dict]:
    """The first n of each (item set, group) of (set, group, prompt, answer, response, correct),
    with their texts: every model keeps the same items, so the report shows them side by side."""
    count: dict[tuple[str, str], int] = defaultdict(int)
    out = []
    for item_set, group, prompt, answer, response, ok in shown:
        if count[item_set, group] < n:
            count[item_set, group] += 1
            out.append({"set": item_set, "group": group, "prompt": prompt, "answer": answer, "response": response,
                        "correct": ok})
    return out


class _Results:
    """What one evaluation accumulates: metrics, extras, per-item outcomes, per-part timings."""

    def __init__(self):
        self.metrics: dict[str, Any] = {}
        self.extras: dict[str, Any] = {}
        self.items: list[dict] = []
        self.timing: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, part: str):
        t = time.perf_counter()
        yield
        self.timing[part] = round(time.perf_counter() - t, 3)


def evaluate_model(model, tokenizer, cfg: EvalConfig, *, seed: int, problems: Sequence[dict],
                   tasks: Sequence[dict] = (), arithmetic: Sequence[dict] = (),
                   multiturn: Sequence[dict] = (), scope: Sequence[dict] = (),
                   val_batches: Sequence[dict] = (), bytes_per_token: float | None = None,
                   ref=None, rm=None, toxicity: Callable[[list[str]], list[float]] | None = None,
                   toxicity_threshold: float = 0.5, n_samples_kept: int = 5, rt=None) -> tuple[dict, dict]:
    """Every measurement of one model -> (metrics, extras).

    metrics: flat, numbers only except `"toxicity": "unavailable"` when no scorer is given.
    extras: sample generations, math samples, per-part timings (seconds) and "items", the
    outcome of every scored item (see `ITEM_SETS`): what is not a metric, so `dvc metrics diff`
    stays clean and two runs compare equal.

    problems: held-out math ({"id", "question", "answer", "level", "lang"}); the first
    cfg.math_problems are answered greedily, the first cfg.pass_k_problems sampled cfg.pass_k
    times at cfg.temperature, the first cfg.rm_prompts scored by `rm` against `ref`'s greedy
    answers, the first cfg.kl_prompts sampled for KL to `ref`. tasks ({"id", "prompt",
    "answer", "kind"}) and arithmetic ({"id", "question", "answer", "op", "lang"}) are answered
    greedily, all of them, and so are the second turns of `multiturn` ({"id", "messages": the
    first three turns, "answer", "kind", "lang"}) and the requests of `scope` ({"id", "prompt",
    "answer", "lang"}): their metrics (`score_multiturn`, `score_scope`) appear only when they
    have items. `ref` is the SFT model; pass `ref=model` when evaluating SFT itself
    (KL 0, win rate 0.5 by definition, nothing recomputed); None skips win rate and KL. `rm`
    None skips the RM metrics. Sampling uses generators seeded from (seed, part, batch), so
    the same seed gives the same numbers. A distributed `rt` (the eval stage under torchrun)
    shares every batch loop out over the ranks, and every rank returns what one process would
    (llm.runtime.sharded_map).
    """
    res = _Results()
    if val_batches:
        with res.timed("ppl"):
            res.metrics.update(lm_eval(model, val_batches, bytes_per_token, rt=rt))
    answers = _greedy_sets(res, model, tokenizer, cfg, problems, tasks, arithmetic, n_samples_kept, rt)
    _conversation_sets(res, model, tokenizer, cfg, multiturn, scope, n_samples_kept, rt)
    if cfg.context_items:
        _context_sets(res, model, tokenizer, cfg, problems, arithmetic, scope, tasks, seed, n_samples_kept, rt)
    if cfg.pass_k_problems:
        _sampled_math(res, model, tokenizer, cfg, problems, derive_seed(seed, "eval", "pass_k"), rt)
    if rm is not None and cfg.rm_prompts:
        _rm_scores(res, model, ref, rm, tokenizer, cfg, problems, answers, seed, n_samples_kept, rt)
    kl_texts = _kl_to_ref(res, model, ref, tokenizer, cfg, problems, seed, rt) if ref is not None and cfg.kl_prompts \
        else []

    with res.timed("samples"):
        sample_answers = answer_questions(model, tokenizer, list(cfg.sample_prompts), max_new_tokens=cfg.max_new_tokens,
                                          batch_size=cfg.batch_size, rt=rt) if cfg.sample_prompts else []
    res.extras["sample_prompts"] = [{"prompt": p, "response": a} for p, a in zip(cfg.sample_prompts, sample_answers)]

    if toxicity is None:
        res.metrics["toxicity"] = "unavailable"
    else:
        with res.timed("toxicity"):
            tox = toxicity(answers + sample_answers + kl_texts)
        res.metrics.update({"toxicity_rate": sum(t > toxicity_threshold for t in tox) / max(len(tox), 1),
                            "toxicity_mean": _mean(tox), "toxicity_n": len(tox)})
    res.extras["timing_s"] = {**res.timing, "total": round(sum(res.timing.values()), 3)}
    res.extras["items"] = res.items
    return res.metrics, res.extras


def _greedy_sets(res: _Results, model, tokenizer, cfg: EvalConfig, problems, tasks, arithmetic,
                 n_samples_kept: int, rt) -> list[str]:
    """Greedy answers to the held-out math, the instruction tasks and the bare arithmetic, scored;
    returns the math answers (the RM and toxicity parts reuse them)."""
    metrics, items = res.metrics, res.items
    math_set = list(problems[:cfg.math_problems])
    with res.timed("math"):
        answers, n_tokens = generate_answers(model, tokenizer, [p["question"] for p in math_set],
                                             max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, rt=rt)
    scored = score_math(math_set, answers, cfg.confidence, n_samples_kept)
    res.extras["math_samples"] = scored.pop("samples")
    metrics.update(scored)
    metrics["math_response_tokens_mean"] = _mean(n_tokens)
    math_items = [{"set": "math", "id": p.get("id", str(i)), "level": int(p.get("level", 0)), "lang": p.get("lang", ""),
                   "correct": is_correct(a, p["answer"]), "formatted": parse_answer(a)[1]}
                  for i, (p, a) in enumerate(zip(math_set, answers))]
    items += math_items
    shown = [("math", p.get("lang", ""), p["question"], p["answer"], a, r["correct"])
             for p, a, r in zip(math_set, answers, math_items)]

    if tasks:
        with res.timed("tasks"):
            task_answers = answer_questions(model, tokenizer, [t["prompt"] for t in tasks],
                                            max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, rt=rt)
        scored_tasks, task_ok = score_tasks(tasks, task_answers, cfg.confidence)
        metrics.update(scored_tasks)
        items += [{"set": "task", "id": t.get("id", str(i)), "kind": t["kind"], "correct": c}
                  for i, (t, c) in enumerate(zip(tasks, task_ok))]
        shown += [("task", t["kind"], t["prompt"], t["answer"], a, c) for t, a, c in zip(tasks, task_answers, task_ok)]
    if arithmetic:
        with res.timed("arithmetic"):
            arith_answers = answer_questions(model, tokenizer, [q["question"] for q in arithmetic],
                                             max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, rt=rt)
        arith_ok = [is_correct(a, q["answer"]) for q, a in zip(arithmetic, arith_answers)]
        metrics.update({**rate("arithmetic_exact_match", arith_ok, cfg.confidence), "arithmetic_n": len(arithmetic)})
        items += [{"set": "arithmetic", "id": q.get("id", str(i)), "op": q.get("op", ""), "lang": q.get("lang", ""),
                   "correct": c} for i, (q, c) in enumerate(zip(arithmetic, arith_ok))]
        shown += [("arithmetic", "", q["question"], q["answer"], a, c)
                  for q, a, c in zip(arithmetic, arith_answers, arith_ok)]
    res.extras["item_samples"] = _first_of_each_group(shown, n_samples_kept)
    return answers


def _conversation_sets(res: _Results, model, tokenizer, cfg: EvalConfig, multiturn, scope, n_samples_kept: int,
                       rt) -> None:
    """Greedy answers to the second turns of two-exchange conversations and to requests outside
    the model's skills, scored; nothing is added for a set without items."""
    shown = []
    if multiturn:
        with res.timed("multiturn"):
            replies = generate_replies(model, tokenizer, [render_prompt(c["messages"], tokenizer) for c in multiturn],
                                       max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, rt=rt)[0]
        scored, ok = score_multiturn(multiturn, replies, cfg.confidence)
        res.metrics.update(scored)
        res.items += [{"set": "multiturn", "id": c.get("id", str(i)), "kind": c["kind"], "lang": c.get("lang", ""),
                       "correct": k} for i, (c, k) in enumerate(zip(multiturn, ok))]
        shown += [("multiturn", c["kind"], " / ".join(m["content"] for m in c["messages"] if m["role"] == "user"),
                   c["answer"], a, k) for c, a, k in zip(multiturn, replies, ok)]
    if scope:
        with res.timed("scope"):
            # a request asked after a first exchange carries it as "history": the whole conversation is the prompt
            prompts = [render_prompt([*c.get("history", []), {"role": "user", "content": c["prompt"]}], tokenizer)
                       for c in scope]
            replies = generate_replies(model, tokenizer, prompts, max_new_tokens=cfg.max_new_tokens,
                                       batch_size=cfg.batch_size, rt=rt)[0]
        scored, ok = score_scope(scope, replies, cfg.confidence)
        res.metrics.update(scored)
        res.items += [{"set": "scope", "id": c.get("id", str(i)), "lang": c.get("lang", ""),
                       "turn": 2 if c.get("history") else 1, "correct": k} for i, (c, k) in enumerate(zip(scope, ok))]
        shown += [("scope", c.get("lang", "") + (", second turn" if c.get("history") else ""),
                   " / ".join([m["content"] for m in c.get("history", []) if m["role"] == "user"] + [c["prompt"]]),
                   c["answer"], a, k) for c, a, k in zip(scope, replies, ok)]
    if shown:
        res.extras["item_samples"] += _first_of_each_group(shown, n_samples_kept)


def _context_sets(res: _Results, model, tokenizer, cfg: EvalConfig, problems, arithmetic, scope, tasks, seed: int,
                  n_samples_kept: int, rt) -> None:
    """The first cfg.context_items math problems (no more than cfg.math_problems) and bare
    calculations asked again in every context (`context_items`), greedily, all in one batched
    pass; each scored beside the same items' outcomes alone (the math and arithmetic sets,
    already in `res.items`)."""
    n = min(cfg.context_items, cfg.math_problems)  # of the math, those answered alone (math_problems)
    sets = {"math": list(problems[:n]), "arithmetic": list(arithmetic[:cfg.context_items])}
    asked, prompts = {}, []
    for name, qs in sets.items():
        # a conversation that leaves the answer less than max_new_tokens of the context is not
        # asked (a cut answer would count as wrong); how many were left out is in the metrics
        every = context_items(qs, scope, tasks)
        rendered = [render_prompt(c["messages"], tokenizer) for c in every]
        fits = [len(ids) + cfg.max_new_tokens <= model.config.seq_len for ids in rendered]
        res.metrics[f"context_{name}_too_long"] = fits.count(False)
        if any(fits):
            asked[name] = [c for c, f in zip(every, fits) if f]
            prompts += [ids for ids, f in zip(rendered, fits) if f]
    flat = [(name, c) for name, cs in asked.items() for c in cs]
    with res.timed("context"):
        replies = generate_replies(model, tokenizer, prompts, max_new_tokens=cfg.max_new_tokens,
                                   batch_size=cfg.batch_size, rt=rt)[0]
    shown = []
    for name, cs in asked.items():
        qs = sets[name]
        mine = [a for (n, _), a in zip(flat, replies) if n == name]
        ok = [is_correct(a, qs[c["index"]]["answer"]) for c, a in zip(cs, mine)]
        alone = [bool(r["correct"]) for r in res.items if r["set"] == name][:len(qs)]
        res.metrics.update(score_context(name, qs, alone, cs, ok, cfg.confidence, derive_seed(seed, "eval", "context")))
        res.items += [{"set": "context", "id": f"{name}:{c['context']}:{qs[c['index']].get('id', c['index'])}",
                       "of": name, "context": c["context"], "lang": c["lang"], "correct": k} for c, k in zip(cs, ok)]
        shown += [(name, c["context"], " / ".join(m["content"] for m in c["messages"] if m["role"] != "assistant"),
                   qs[c["index"]]["answer"], a, k) for c, a, k in zip(cs, mine, ok)]
    res.extras["context_samples"] = _first_of_each_group(shown, n_samples_kept)


def _sampled_math(res: _Results, model, tokenizer, cfg: EvalConfig, problems, seed: int, rt) -> None:
    """pass@k and the accuracy of single samples at cfg.temperature on the first cfg.pass_k_problems."""
    with res.timed("pass_k"):
        pk = math_pass_at_k(model, tokenizer, problems[:cfg.pass_k_problems], k=cfg.pass_k,
                            temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            batch_size=cfg.batch_size, seed=seed, confidence=cfg.confidence, rt=rt)
    k = cfg.pass_k
    res.metrics.update({"math_pass_at_k": pk[f"math_pass_at_{k}"], "math_pass_at_k_lo": pk[f"math_pass_at_{k}_lo"],
                        "math_pass_at_k_hi": pk[f"math_pass_at_{k}_hi"], "math_pass_k": k,
                        "math_pass_k_problems": min(cfg.pass_k_problems, len(problems)),
                        **{key: pk[key] for key in ("math_sample_accuracy", "math_sample_accuracy_lo",
                                                    "math_sample_accuracy_hi")}})
    res.items += [{"set": "math_sampled", "id": p.get("id", str(i)), "score": c / k}
                  for i, (p, c) in enumerate(zip(problems, pk["correct_counts"]))]


def _rm_scores(res: _Results, model, ref, rm, tokenizer, cfg: EvalConfig, problems, answers: list[str], seed: int,
               n_samples_kept: int, rt) -> None:
    """The reward model's mean score of the greedy answers to the first cfg.rm_prompts problems
    and, with a reference, the win rate against the reference's answers."""
    rm_set = list(problems[:cfg.rm_prompts])
    qs = [p["question"] for p in rm_set]
    with res.timed("rm"):
        mine = answers[:len(rm_set)]
        if len(mine) < len(rm_set):
            mine += answer_questions(model, tokenizer, qs[len(mine):], max_new_tokens=cfg.max_new_tokens,
                                     batch_size=cfg.batch_size, rt=rt)
        scores = rm_scores(rm, tokenizer, qs, mine, batch_size=cfg.batch_size, rt=rt)
        lo, hi = bootstrap_interval(scores, cfg.confidence, seed=derive_seed(seed, "eval", "rm_boot"))
        res.metrics.update({"rm_score": _mean(scores), "rm_score_lo": lo, "rm_score_hi": hi,
                            "rm_prompts": len(rm_set)})
        res.items += [{"set": "rm", "id": p.get("id", str(i)), "score": round(sc, 6)}
                      for i, (p, sc) in enumerate(zip(rm_set, scores))]
        if ref is None:
            return
        if ref is model:
            theirs, ref_scores = mine, scores
        else:
            theirs = answer_questions(ref, tokenizer, qs, max_new_tokens=cfg.max_new_tokens,
                                      batch_size=cfg.batch_size, rt=rt)
            ref_scores = rm_scores(rm, tokenizer, qs, theirs, batch_size=cfg.batch_size, rt=rt)
        wr = win_rate(scores, ref_scores, [a == b for a, b in zip(mine, theirs)], cfg.confidence)
        if ref is model:  # 0.5 by definition, not an estimate: no interval around it
            wr["win_rate_lo"] = wr["win_rate_hi"] = 0.5
        res.metrics.update({"rm_score_sft": _mean(ref_scores), "win_rate_vs_sft": wr["win_rate"],
                            "win_rate_vs_sft_lo": wr["win_rate_lo"], "win_rate_vs_sft_hi": wr["win_rate_hi"],
                            "win_rate_wins": wr["wins"], "win_rate_ties": wr["ties"],
                            "win_rate_losses": wr["losses"]})
        res.extras["rm_samples"] = [{"question": q, "response": a, "score": s, "sft_response": b, "sft_score": t}
                                    for q, a, s, b, t in list(zip(qs, mine, scores, theirs, ref_scores))[:n_samples_kept]]


def _kl_to_ref(res: _Results, model, ref, tokenizer, cfg: EvalConfig, problems, seed: int, rt) -> list[str]:
    """KL to the reference on responses sampled at temperature 1: `kl` in nats per token (the
    unit of every other KL here: PPO's, GRPO's and DPO's metrics and curves), `kl_seq` in nats
    per response, each with its interval; returns the sampled texts (the toxicity part scores them)."""
    n_prompts = min(cfg.kl_prompts, len(problems))
    if ref is model:  # the same weights: every log-ratio is exactly 0
        res.metrics.update({k: 0.0 for k in ("kl", "kl_lo", "kl_hi", "kl_seq", "kl_seq_lo", "kl_seq_hi")}
                           | {"kl_prompts": n_prompts})
        return []
    questions = [p["question"] for p in problems[:cfg.kl_prompts]]

    def decode(ro, ix: list[int]) -> list[tuple[int, str, int]]:
        lengths = ro.response_mask.sum(1).tolist()                        # (B,) response tokens, stop included
        return [(i, tokenizer.decode(ids), n) for i, ids, n in zip(ix, ro.response_ids(), lengths)]

    with res.timed("kl"):
        kl = sampled_kl(model, ref, [user_prompt(q, tokenizer) for q in questions],
                        max_new_tokens=cfg.max_new_tokens, temperature=1.0,
                        stop_ids=(tokenizer.end_id, tokenizer.eot_id), pad_id=tokenizer.pad_id,
                        seed=derive_seed(seed, "eval", "kl"), batch_size=cfg.batch_size, visit=decode, rt=rt)
    texts, lengths = [""] * len(questions), [0] * len(questions)
    for i, text, n in (x for batch in kl.visits for x in batch):
        texts[i], lengths[i] = text, n
    boot = derive_seed(seed, "eval", "kl_boot")
    lo, hi = bootstrap_interval(kl.sequences, cfg.confidence, seed=boot, counts=lengths)
    seq_lo, seq_hi = bootstrap_interval(kl.sequences, cfg.confidence, seed=boot)
    res.metrics.update({"kl": kl.per_token, "kl_lo": lo, "kl_hi": hi,
                        "kl_seq": kl.per_sequence, "kl_seq_lo": seq_lo, "kl_seq_hi": seq_hi,
                        "kl_response_tokens_mean": kl.tokens / max(len(questions), 1),
                        "kl_prompts": n_prompts})
    return texts
