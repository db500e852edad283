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
`evaluate_continuations` is what the eval stage reports of one model on the held-out passages:
the judge's mean, the win rate against SFT's continuation of the same passage, the reward model's
mean, KL to SFT, repetition and the base model's bits per byte on the continuation (a win that
stops reading like the works it continues shows there).

Where each runs: the eval stage calls `evaluate_continuations`; the rankers stage draws SFT's
continuations and calls `proxy_table` (the best-of-n curve); the reward stage calls
`agreement_on_samples`.
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

SHOWN = 5   # passages whose continuations (the model's beside SFT's) the eval stage keeps as text


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


def base_bits_per_byte(base, tok, passages: Sequence[str], texts: Sequence[str], *, batch_size: int,
                       rt=None) -> dict:
    """How well the base model (pretrained on the works, never tuned) reads each continuation as
    the next lines of its passage: its loss on the continuation's tokens given the passage and a
    newline, in bits per UTF-8 byte of the continuation, pooled over the non-empty ones
    ({"bpb", "continuations"}; "bpb" None where every one is empty). A continuation that wins the
    judge with words no verse would hold scores high here."""
    import math

    import torch

    from llm.eval.evaluate import lm_eval

    rows, n_bytes = [], 0
    for passage, text in zip(passages, texts):
        cont = tok.encode(text)
        if not cont:
            continue
        ids = (tok.encode(passage + "\n") + cont)[-(base.config.seq_len + 1):]
        start = len(ids) - len(cont)                 # the first continuation token's position
        rows.append((ids, start))
        n_bytes += len(tok.decode(ids[max(start, 1):]).encode("utf-8"))
    if not rows:
        return {"bpb": None, "continuations": 0}
    batches = []
    for at in range(0, len(rows), batch_size):
        chunk = rows[at:at + batch_size]
        width = max(len(ids) for ids, _ in chunk) - 1
        idx = torch.full((len(chunk), width), tok.pad_id, dtype=torch.long)
        targets = torch.full((len(chunk), width), -100, dtype=torch.long)
        for r, (ids, start) in enumerate(chunk):
            idx[r, :len(ids) - 1] = torch.tensor(ids[:-1])
            scored = torch.tensor(ids[1:])
            scored[:max(start, 1) - 1] = -100         # the passage is given, not scored
            targets[r, :len(ids) - 1] = scored
        batches.append({"idx": idx, "targets": targets})
    m = lm_eval(base, batches, rt=rt)
    return {"bpb": m["val_loss"] * m["val_tokens"] / math.log(2) / max(n_bytes, 1), "continuations": len(rows)}


def evaluate_continuations(policy, ref, rm, base, tok, items: Sequence[dict], *, max_new_tokens: int,
                           temperature: float, seed: int, batch_size: int, confidence: float,
                           rt=None) -> tuple[dict, list[dict], list[dict]]:
    """One model on the held-out passages (prepare's continue/test.jsonl): one continuation of each
    passage sampled at `temperature` (llm/post/heldout.py `continuation_heldout`, the draws PPO's
    evaluations make), and the same of `ref` (SFT) with the same seed. Returns (metrics, items,
    shown): `continuation_gold` (the judge's mean), `continuation_win_rate` with its Wilson
    interval (the judge prefers this model's continuation to SFT's of the same passage; ties,
    e.g. two empty ones, count half; 0.5 for SFT itself), `continuation_rm`, `continuation_kl`
    (per token) and `continuation_kl_seq` (per continuation), `continuation_repetition`,
    `continuation_not_continuation` (the judge's floor: too short, not English, repeated),
    `continuation_words`, and `continuation_base_bpb` beside `continuation_base_bpb_sft` (the
    base model's bits per byte on each model's continuations); the per-passage outcome records
    {"set": "continuation", "id", "score": gold} that the report pairs; the first SHOWN passages'
    texts, this model's continuation beside SFT's."""
    from llm.eval.evaluate import win_rate
    from llm.post.heldout import continuation_heldout

    def draw(model):
        return continuation_heldout(model, ref, rm, tok, items, max_new_tokens=max_new_tokens,
                                    temperature=temperature, seed=seed, batch_size=batch_size, rt=rt)

    numbers, rows = draw(policy)
    ref_rows = rows if policy is ref else draw(ref)[1]
    texts = [r["text"] for r in rows]
    ref_texts = [r["text"] for r in ref_rows]
    wr = win_rate([r["gold"] for r in rows], [r["gold"] for r in ref_rows],
                  ties=[a == b for a, b in zip(texts, ref_texts)], confidence=confidence)
    passages = [it["passage"] for it in items]
    bpb = base_bits_per_byte(base, tok, passages, texts, batch_size=batch_size, rt=rt)
    bpb_ref = bpb if policy is ref else base_bits_per_byte(base, tok, passages, ref_texts, batch_size=batch_size,
                                                          rt=rt)
    m = {**numbers, "continuation_items": len(items),
         "continuation_win_rate": wr["win_rate"], "continuation_win_rate_lo": wr["win_rate_lo"],
         "continuation_win_rate_hi": wr["win_rate_hi"],
         "continuation_not_continuation": float(np.mean([r["gold"] == FLOOR for r in rows])),
         "continuation_words": float(np.mean([len(words(t)) for t in texts]))}
    for key, b in (("continuation_base_bpb", bpb), ("continuation_base_bpb_sft", bpb_ref)):
        if b["bpb"] is not None:     # None where every continuation is empty: left out, not a metric
            m[key] = b["bpb"]
    outcomes = [{"set": "continuation", "id": it.get("id", str(i)), "score": r["gold"]}
                for i, (it, r) in enumerate(zip(items, rows))]
    shown = [{"passage": it["passage"], "reference": it.get("reference", ""), "response": r["text"],
              "gold": r["gold"], "sft_response": q["text"], "sft_gold": q["gold"]}
             for it, r, q in list(zip(items, rows, ref_rows))[:SHOWN]]
    return m, outcomes, shown
