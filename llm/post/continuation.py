"""The continuation preference, measured: a model's continuations of held-out passages against the
gold judge (llm/sample/gold.py), and how well a reward model stands in for that judge.

    cands = draw_continuations(model, tok, items, n=16, temperature=1.0, max_new_tokens=40,
                               batch_size=64, seed=s)                 # items: continue/test.jsonl records
    gold = gold_of(cands)                                              # the judge's score of every sample
    rm = reward_scores(rm_model, tok, cands, batch_size=64, device="cpu")   # the reward model's
    proxy_table(cands, gold, rm, margin=0.1)  # how the RM ranks what the judge ranks, best-of-n

`proxy_table` measures a reward model as a stand-in for the gold judge on samples of one model:
- pair accuracy: over every two continuations of one passage whose gold scores differ by more
  than `margin` (the comparisons the samples stage labels), the share the RM orders as the judge
  does (ties half);
- Spearman's rank correlation between the RM's and the judge's scores of single continuations
  (pooled over passages);
- best-of-n: for n = 1..N, the judge's mean score of the continuation the RM ranks highest among
  n drawn at random from a passage's N, exactly over the n-subsets (llm/post/rankers.py
  `best_of_n`), beside the judge picking its own best (the ceiling) and n = 1 (the mean).
`continuation_stats` is what to report of one model's continuations: the judge's mean, the
share not a continuation (the judge's floor), the repetition rate, the mean length.
`agreement_on_samples` is the reward stage's check of its model against the judge.

Of these, only `agreement_on_samples` (and `reward_scores` under it) runs in a stage so far; the
best-of-n and pair-accuracy figures of docs/log.md (2026-12-07) came from calling
`draw_continuations`, `gold_of`, `reward_scores` and `proxy_table` by hand on a scratch run. The
evaluation stage does not call them yet: that is the preference's next step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from llm.data.batching import derive_seed
from llm.data.template import user_prompt
from llm.eval.evaluate import generate_replies
from llm.eval.paired import spearman
from llm.post.rankers import best_of_n
from llm.sample.gold import FLOOR, gold_score, repetition_rate, words


def draw_continuations(model, tok, items: Sequence[dict], *, n: int, temperature: float, max_new_tokens: int,
                       batch_size: int, seed: int, rt=None) -> list[dict]:
    """Per item {"prompt_ids", "passage", "samples": [n texts]}: sample s drawn with seed (seed, s)."""
    prompts = [user_prompt(it["prompt"], tok) for it in items]
    drawn = [generate_replies(model, tok, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                              temperature=temperature, seed=derive_seed(seed, "continuation", s), rt=rt)[0]
             for s in range(n)]
    return [{"prompt_ids": prompts[i], "passage": it["passage"], "samples": [d[i] for d in drawn]}
            for i, it in enumerate(items)]


def gold_of(cands: Sequence[dict]) -> list[list[float]]:
    """The gold judge's score of every sample of every candidate set."""
    return [[gold_score(t, c["passage"]) for t in c["samples"]] for c in cands]


def reward_scores(rm, tok, cands: Sequence[dict], *, batch_size: int, device, autocast=None,
                  rt=None) -> list[list[float]]:
    """The reward model's score of every sample, read as PPO reads it (prompt + answer + <|end|>)."""
    from llm.data.preference import encode_response
    from llm.nn.reward_model import score_sequences

    seq_len = rm.config.seq_len
    seqs = [encode_response(c["prompt_ids"], t, tok)[-seq_len:] for c in cands for t in c["samples"]]
    flat = score_sequences(rm, seqs, pad_id=tok.pad_id, batch_size=batch_size, device=device, autocast=autocast,
                           rt=rt).tolist()
    out, at = [], 0
    for c in cands:
        out.append(flat[at:at + len(c["samples"])])
        at += len(c["samples"])
    return out


def proxy_table(cands: Sequence[dict], gold: Sequence[Sequence[float]], proxy: Sequence[Sequence[float]],
                *, margin: float) -> dict:
    """How `proxy` (a reward model's scores) ranks what the judge ranks: module docstring."""
    outcomes = []
    for g, p in zip(gold, proxy):
        for i in range(len(g)):
            for j in range(len(g)):
                if g[i] - g[j] > margin:
                    outcomes.append(1.0 if p[i] > p[j] else 0.5 if p[i] == p[j] else 0.0)
    flat_g = [x for row in gold for x in row]
    flat_p = [x for row in proxy for x in row]
    valued = [dict(c, right=g) for c, g in zip(cands, gold)]      # best_of_n averages "right": here the gold
    return {"passages": len(cands), "samples": len(flat_g), "comparisons": len(outcomes),
            "pair_accuracy": float(np.mean(outcomes)) if outcomes else None,
            "spearman": spearman(flat_g, flat_p),
            "best_of_n_proxy": best_of_n(valued, proxy).mean(0).tolist() if cands else [],
            "best_of_n_gold": best_of_n(valued, gold).mean(0).tolist() if cands else []}


def continuation_stats(cands: Sequence[dict], gold: Sequence[Sequence[float]]) -> dict:
    """The judge's mean, the share at its floor (not a continuation), the repetition rate and the
    mean length in words of every sample."""
    texts = [(t, c["passage"]) for c in cands for t in c["samples"]]
    flat = [x for row in gold for x in row]
    return {"gold_mean": float(np.mean(flat)) if flat else None,
            "not_continuation": float(np.mean([x == FLOOR for x in flat])) if flat else None,
            "repetition_rate": float(np.mean([repetition_rate(t, p) for t, p in texts])) if texts else None,
            "words": float(np.mean([len(words(t)) for t, _ in texts])) if texts else None}


def agreement_on_samples(rm, samples_file: Path, tok, *, batch_size: int, device, autocast=None) -> dict:
    """What the reward stage reports of a reward model against the gold judge: Spearman's rank
    correlation of its score of each single continuation with the judge's, over the samples
    stage's continuations of its val-split passages (each with the judge's score, "verifier"):
    {"continuation_spearman", "continuation_samples"}; {} where the samples hold none."""
    from llm.data.template import render_prompt
    from llm.fileio import read_jsonl

    if not samples_file.is_file():
        return {}
    held = [p for p in read_jsonl(samples_file) if p.get("check") == "gold" and p.get("split") == "val"]
    if not held:
        return {}
    cands = [{"prompt_ids": render_prompt(p["prompt"], tok), "samples": [x["text"] for x in p["samples"]]}
             for p in held]
    scores = reward_scores(rm, tok, cands, batch_size=batch_size, device=device, autocast=autocast)
    gold = [x["verifier"] for p in held for x in p["samples"]]
    return {"continuation_spearman": spearman(gold, [s for row in scores for s in row]),
            "continuation_samples": len(gold)}
