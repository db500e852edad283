"""Held-out numbers of an RL policy: exact match, KL to the reference, and the reward of its samples.

    row, samples = heldout_eval(policy, ref, tokenizer, problems, max_new_tokens=64, temperature=1.0,
                                seed=s, reward_fn=reward_fn)

`heldout_eval` is what PPO and GRPO measure before the first step, every eval_every steps and
at the end: greedy exact match (llm.eval.evaluate.math_eval), the exact per-token KL to the
reference at the states of the policy's own samples (llm.sample.rollout.sampled_kl), and the reward
of those samples. `heldout_rewards` gives those samples' rewards problem by problem, and
`heldout_reward_change` the paired interval of the mean change between two model states.
`continuation_heldout` is the same for passages to continue: the gold judge's and the reward
model's mean score of one sampled continuation per held-out passage, and the KL there.

Definition used everywhere here: `kl` is the mean over response tokens of KL(pi || ref)
per token (TRL GRPO's `kl`); `kl_seq` is its sum over a response, averaged over responses
(TRL PPO's `objective/kl`). Held-out `kl` is exact per token (summed over the vocabulary at
each sampled state), so it has no estimator noise; training-time `kl` uses the stage's
estimator (k1 or k3) on the sampled tokens.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from llm.data.batching import derive_seed
from llm.data.template import user_prompt
from llm.eval.evaluate import math_eval
from llm.eval.paired import bootstrap_mean
from llm.runtime import Runtime
from llm.sample.rewards import RewardFn
from llm.sample.rollout import sampled_kl


@torch.no_grad()
def heldout_eval(policy: nn.Module, ref: nn.Module, tokenizer, problems: Sequence[dict], *, max_new_tokens: int,
                 temperature: float, seed: int, batch_size: int = 64, reward_fn: RewardFn | None = None,
                 confidence: float = 0.95, rt: Runtime | None = None) -> tuple[dict[str, float], list[dict]]:
    """Held-out numbers for one model state, and a few sample answers.

    - math exact match (greedy; llm.eval.evaluate.math_eval) with its Wilson interval;
    - `kl`: exact per-token KL(policy || ref) at the states of the policy's own samples
      (llm.sample.rollout.sampled_kl at `temperature`, a fixed seed: the same draws every evaluation
      for the same policy);
    - `reward`: mean reward_fn score of those samples (e.g. the RM), if given; with a combined
      reward (rm_verifier_reward) also its RM part alone, `rm_score`.
    A distributed `rt` shares the batches out over the ranks; every rank returns the numbers.
    """
    ev = math_eval(policy, tokenizer, problems, max_new_tokens=max_new_tokens, batch_size=batch_size,
                   confidence=confidence, rt=rt)
    out = {k: v for k, v in ev.items() if k != "samples" and isinstance(v, (int, float))}

    def score(ro, ix: list[int]) -> tuple[float, int, float | None]:
        r, stats = reward_fn(ro, [problems[i] for i in ix])
        return float(r.double().sum()), len(ix), stats.get("rm_score")

    kl = _heldout_samples(policy, ref, tokenizer, problems, max_new_tokens=max_new_tokens, temperature=temperature,
                          seed=seed, batch_size=batch_size, visit=score if reward_fn is not None else None, rt=rt)
    out["kl"] = kl.per_token
    if kl.visits:
        out["reward"] = sum(v[0] for v in kl.visits) / sum(v[1] for v in kl.visits)
        with_rm = [v for v in kl.visits if v[2] is not None]
        if with_rm:
            out["rm_score"] = sum(v[2] * v[1] for v in with_rm) / sum(v[1] for v in with_rm)
    return out, ev["samples"]


def _heldout_samples(policy, ref, tokenizer, problems, *, max_new_tokens, temperature, seed, batch_size, visit, rt):
    """The policy's samples for the held-out problems (one seed: the same draws every call for the
    same policy) and the exact KL to `ref` at their states; `visit` sees each batch's rollouts."""
    return sampled_kl(policy, ref, [user_prompt(p["question"], tokenizer) for p in problems],
                      max_new_tokens=max_new_tokens, temperature=temperature,
                      stop_ids=(tokenizer.end_id, tokenizer.eot_id), pad_id=tokenizer.pad_id,
                      seed=derive_seed(seed, "heldout"), batch_size=batch_size, visit=visit, rt=rt)


@torch.no_grad()
def heldout_rewards(policy: nn.Module, ref: nn.Module, tokenizer, problems: Sequence[dict], *, max_new_tokens: int,
                    temperature: float, seed: int, reward_fn: RewardFn, batch_size: int = 64,
                    rt: Runtime | None = None) -> list[float]:
    """The reward of `policy`'s sample for each held-out problem, in problem order: the samples
    `heldout_eval` draws (the same seed and batches), so their mean is its `reward`."""
    def score(ro, ix: list[int]) -> list[tuple[int, float]]:
        r, _ = reward_fn(ro, [problems[i] for i in ix])
        return list(zip(ix, r.double().tolist()))

    kl = _heldout_samples(policy, ref, tokenizer, problems, max_new_tokens=max_new_tokens, temperature=temperature,
                          seed=seed, batch_size=batch_size, visit=score, rt=rt)
    out = [0.0] * len(problems)
    for i, r in (x for batch in kl.visits for x in batch):
        out[i] = r
    return out


def heldout_reward_change(start: Sequence[float], end: Sequence[float], *, seed: int, confidence: float = 0.95,
                          n_boot: int = 10000) -> dict[str, float]:
    """The change of the mean held-out reward from `start` to `end` (per-problem rewards of the same
    problems and sampling seed), with the percentile bootstrap interval of the paired mean
    difference: {"delta", "lo", "hi"}."""
    d = np.asarray(end, dtype=np.float64) - np.asarray(start, dtype=np.float64)
    lo, hi = bootstrap_mean(d, confidence=confidence, n_boot=n_boot, rng=np.random.default_rng(seed))
    return {"delta": float(d.mean()), "lo": lo, "hi": hi}


@torch.no_grad()
def continuation_heldout(policy: nn.Module, ref: nn.Module, rm: nn.Module, tokenizer, items: Sequence[dict], *,
                         max_new_tokens: int, temperature: float, seed: int, batch_size: int = 64,
                         rt: Runtime | None = None) -> tuple[dict[str, float], list[dict]]:
    """The continuation preference on held-out passages (prepare's continue/test.jsonl), for one
    model state: one continuation of each passage sampled at `temperature` with a fixed seed (the
    same draws every call for the same policy), and ({"continuation_kl": exact per-token KL to
    `ref` at those samples' states, "continuation_kl_seq": the same summed over each continuation,
    "continuation_rm": the reward model's mean score, "continuation_gold": the gold judge's mean
    (llm/sample/gold.py), "continuation_repetition": the mean share of repeated word trigrams},
    one row per passage in item order: {"gold", "rm", "repetition", "text"}). The gold never
    reaches the policy: it is what the reward model is measured by."""
    from llm.nn.reward_model import reward
    from llm.sample.gold import gold_score, repetition_rate

    def visit(ro, ix: list[int]) -> list[tuple[int, float, float, float, str]]:
        r = reward(rm, ro.tokens, ro.attention_mask).float().cpu().tolist()
        texts = [tokenizer.decode(ids) for ids in ro.response_ids()]
        return [(i, rr, gold_score(t, items[i]["passage"]), repetition_rate(t, items[i]["passage"]), t)
                for i, rr, t in zip(ix, r, texts)]

    kl = sampled_kl(policy, ref, [user_prompt(it["prompt"], tokenizer) for it in items],
                    max_new_tokens=max_new_tokens, temperature=temperature,
                    stop_ids=(tokenizer.end_id, tokenizer.eot_id), pad_id=tokenizer.pad_id,
                    seed=derive_seed(seed, "continuation"), batch_size=batch_size, visit=visit, rt=rt)
    rows = [{"gold": g, "rm": r, "repetition": x, "text": t}
            for _, r, g, x, t in sorted(x for batch in kl.visits for x in batch)]
    return ({"continuation_kl": kl.per_token, "continuation_kl_seq": kl.per_sequence,
             "continuation_rm": float(np.mean([r["rm"] for r in rows])),
             "continuation_gold": float(np.mean([r["gold"] for r in rows])),
             "continuation_repetition": float(np.mean([r["repetition"] for r in rows]))}, rows)
