"""Reading preference pairs, whoever made them: records, encoding, batches.

Shared by the reward model (llm/nn/reward_model.py), DPO (llm/post/dpo.py) and their stages. A pair record
(data/prepared/prefs, data/pairs) is

    {"id", "prompt": [{"role", "content"}, ...], "chosen": str, "rejected": str, "kind": str, ...}

and each answer is rendered with the chat template as `render_prompt(prompt) + answer + <|end|>`
(the same tokens `llm.data.template.render` gives the conversation prompt + [assistant answer]). The
response mask is True on the answer tokens and the closing <|end|>: what DPO scores.

Batches stack the B chosen sequences and then the B rejected ones into one right-padded
(2B, T) batch, so one forward pass scores both sides; `weight` = B pairs (the trainer's
loss unit). The held-out numbers of a scorer on pairs (accuracy, margins, per pair kind) are
llm/nn/reward_model.py's `pair_metrics`. How the pipeline makes its own pairs from the SFT model's
samples is llm/post/pairs.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from llm.data.batching import BucketBatchSampler, ExampleBatches, pad_right
from llm.data.template import ROLE_TOKENS, render_prompt
from llm.fileio import MAX_RECORD_BYTES, DataError, read_jsonl

Batch = dict[str, Tensor]


# ---------------------------------------------------------------------------
# Records and encoding

def validate_pair(obj: Any) -> str | None:
    """Why a JSON object is not a usable preference pair, or None (for `read_jsonl(validate=...)`)."""
    if not isinstance(obj, dict):
        return "expected a JSON object"
    prompt = obj.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return "'prompt' must be a non-empty list of messages"
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or m.get("role") not in ROLE_TOKENS or not isinstance(m.get("content"), str):
            return f"prompt[{i}] must be {{'role': system|user|assistant, 'content': str}}"
    for k in ("chosen", "rejected"):
        if not isinstance(obj.get(k), str):
            return f"'{k}' must be a string"
    if obj["chosen"] == obj["rejected"]:
        return "'chosen' and 'rejected' are the same text"
    return None


@dataclass
class EncodedPair:
    """Token ids of one pair: prompt + answer + <|end|> for each side, sharing the prompt."""
    chosen: list[int]
    rejected: list[int]
    prompt_len: int   # the response starts at this position in both sequences
    kind: str = ""

    @property
    def length(self) -> int:
        return max(len(self.chosen), len(self.rejected))


def encode_response(prompt_ids: Sequence[int], response: str, tokenizer) -> list[int]:
    """prompt ids (ending with <|assistant|>) + the response's tokens + <|end|>."""
    return [*prompt_ids, *tokenizer.encode(response, allowed_special="none"), tokenizer.end_id]


def encode_pairs(records: Sequence[dict], tokenizer, max_tokens: int) -> tuple[list[EncodedPair], list[int], int]:
    """Encode pair records; those longer than max_tokens (the model's seq_len) are dropped.

    Returns (pairs, the record index of each pair, number dropped). Truncating instead would
    cut the end of an answer, where the reward is read and where the two answers differ.
    """
    out, kept, dropped = [], [], 0
    for i, r in enumerate(records):
        p = render_prompt(r["prompt"], tokenizer)
        c, j = encode_response(p, r["chosen"], tokenizer), encode_response(p, r["rejected"], tokenizer)
        if max(len(c), len(j)) > max_tokens:
            dropped += 1
            continue
        out.append(EncodedPair(c, j, len(p), str(r.get("kind", ""))))
        kept.append(i)
    return out, kept, dropped


@dataclass
class PairSplits:
    """The train and val pairs of a pair directory, encoded (`load_pair_splits`)."""
    train: list[EncodedPair]
    val: list[EncodedPair]
    val_records: list[dict]   # every val record, as read
    val_kept: list[int]       # the record index of each val pair
    dropped_train: int        # records longer than seq_len, left out
    dropped_val: int
    seq_len: int

    @property
    def dropped(self) -> int:
        return self.dropped_train + self.dropped_val

    def summary(self) -> str:
        return (f"{len(self.train)} train / {len(self.val)} val pairs ({self.dropped_train} + {self.dropped_val}"
                f" dropped: longer than seq_len={self.seq_len})")


def load_pair_splits(data: str | Path, tokenizer, seq_len: int) -> PairSplits:
    """Read data/{train,val}.jsonl (each record checked by `validate_pair`) and encode them with
    `encode_pairs`. Raises DataError when no train or no val pair fits in seq_len."""
    data = Path(data)
    train_recs = list(read_jsonl(data / "train.jsonl", validate=validate_pair, max_line_bytes=MAX_RECORD_BYTES))
    val_recs = list(read_jsonl(data / "val.jsonl", validate=validate_pair, max_line_bytes=MAX_RECORD_BYTES))
    train, _, dropped_train = encode_pairs(train_recs, tokenizer, seq_len)
    val, val_kept, dropped_val = encode_pairs(val_recs, tokenizer, seq_len)
    if not train or not val:
        raise DataError(f"{data}: no {'train' if not train else 'val'} pair fits in seq_len={seq_len}"
                        f" ({dropped_train} train and {dropped_val} val pairs are longer)")
    return PairSplits(train=train, val=val, val_records=val_recs, val_kept=val_kept, dropped_train=dropped_train,
                      dropped_val=dropped_val, seq_len=seq_len)


def collate_pairs(pairs: Sequence[EncodedPair], *, pad_id: int, ref_chosen: Tensor | None = None,
                  ref_rejected: Tensor | None = None) -> Batch:
    """One batch of B pairs: rows 0..B-1 chosen, B..2B-1 rejected.

    Returns idx (2B, T) long, attention_mask (2B, T) bool, response_mask (2B, T) bool,
    weight () float = B, and with reference log-probs (B,) each also ref_chosen, ref_rejected.
    """
    if not pairs:
        raise ValueError("collate_pairs: empty batch")
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    lens = [p.prompt_len for p in pairs] * 2
    idx, mask, resp = pad_right(seqs, pad_id, lens)
    batch = {"idx": idx, "attention_mask": mask, "response_mask": resp,
             "weight": torch.tensor(float(len(pairs)))}
    if ref_chosen is not None:
        batch["ref_chosen"], batch["ref_rejected"] = ref_chosen.float(), ref_rejected.float()
    return batch


def pair_batches(pairs: Sequence[EncodedPair], *, batch_size: int, bucket_width: int, seed: int, pad_id: int,
                 rank: int = 0, world_size: int = 1, ref: tuple[Tensor, Tensor] | None = None) -> ExampleBatches:
    """An endless, resumable batch source over pairs, bucketed by length (llm/data/batching.py)."""
    sampler = BucketBatchSampler([p.length for p in pairs], batch_size=batch_size, bucket_width=bucket_width,
                                 seed=seed, rank=rank, world_size=world_size)
    return ExampleBatches(sampler, _maker(pairs, pad_id, ref))


def fixed_pair_batches(pairs: Sequence[EncodedPair], *, batch_size: int, pad_id: int, n_batches: int | None = None,
                       ref: tuple[Tensor, Tensor] | None = None) -> list[Batch]:
    """Validation batches: the pairs in order (the first n_batches * batch_size; None = all)."""
    n = len(pairs) if n_batches is None else min(len(pairs), n_batches * batch_size)
    make = _maker(pairs, pad_id, ref)
    return [make(list(range(i, min(i + batch_size, n)))) for i in range(0, n, batch_size)]


def _maker(pairs, pad_id, ref) -> Callable[[list[int]], Batch]:
    def make(ix: list[int]) -> Batch:
        sel = [pairs[i] for i in ix]
        if ref is None:
            return collate_pairs(sel, pad_id=pad_id)
        t = torch.as_tensor(ix, dtype=torch.long)
        return collate_pairs(sel, pad_id=pad_id, ref_chosen=ref[0][t], ref_rejected=ref[1][t])
    return make
