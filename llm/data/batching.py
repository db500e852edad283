"""Batches for the training loop: token windows for pretraining, length buckets for examples.

Every sampler here is a *batch source* for `llm.train.trainer.train`: `next_batch()` returns
a dict of CPU tensors, `state_dict()` / `load_state_dict()` capture the cursor in plain
JSON, so a resumed run sees exactly the batches it would have seen.

Randomness is counter-based: the batch for a given position is drawn from a
`torch.Generator` seeded by (seed, group index), never from a generator whose state has
to be saved. The samplers define a *global* sequence of micro-batches, the same whatever
the number of processes: with N processes, rank r's d-th micro-batch is global micro-batch
d * N + r, so an optimizer step of grad_accum micro-batches holds the same samples on 1
process (grad_accum in a row) as on N (grad_accum / N each). The cursor in `state_dict()`
is a global position (micro-batches taken by all ranks), so a run checkpointed on N
processes resumes on M and continues from the same sample.

1. Pretraining (`data/tokens/{train,val}.bin`, uint16 or uint32 memmaps):
   - `WindowSampler`: random windows of seq_len+1 tokens -> {"idx": (B, T), "targets": (B, T)}.
   - `fixed_windows`: evenly spaced windows for validation, the same every evaluation.
2. Variable-length examples (SFT, reward model, DPO; stages bring their own examples):
   - `BucketBatchSampler`: batches of indices whose lengths fall in the same bucket of
     `bucket_width` tokens (less padding), shuffled per epoch, resumable.
   - `pad_collate`: right-pads token lists into idx / targets / attention_mask, with
     targets = -100 (IGNORE_INDEX) where the loss mask is off or on padding.
   - `ExampleBatches`: a bucket sampler + a function building a batch from indices.
   - `ReplayBatches`: example batches with windows of pretraining text appended, a set share
     of each batch's rows (SFT's `replay_fraction`).
   - `conversation_batches`, `fixed_conversation_batches`: SFT's training source (buckets, with
     replay when asked) and its fixed validation batches, over (ids, loss_mask) examples.
   - `upsample_sources`: which examples to train on when a small source is to be repeated
     up to a minimum count (SFT's `min_source_examples`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from llm.kernels import IGNORE_INDEX


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any JSON-able parts, e.g. derive_seed(common.seed, "pretrain", step)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & ((1 << 63) - 1)


def _generator(*parts: Any) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


# ---------------------------------------------------------------------------
# Token memmaps

def open_tokens(path: str | Path, dtype: str) -> np.memmap:
    """A read-only memmap of a token shard; `dtype` is meta.json's ("uint16" or "uint32")."""
    path = Path(path)
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"{path}: token dtype must be uint16 or uint32 (from meta.json), got {dtype!r}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: token shard not found; run `dvc repro tokenize` first")
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0 or size % itemsize:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} tokens (truncated file?)")
    return np.memmap(path, dtype=dtype, mode="r")


def _windows(tokens: np.ndarray, offsets: Sequence[int], seq_len: int) -> dict[str, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[o:o + seq_len + 1]) for o in offsets]).astype(np.int64)  # (B, T+1)
    rows = torch.from_numpy(rows)
    # two separate tensors: a stage masking targets in place must not touch idx
    return {"idx": rows[:, :-1].contiguous(), "targets": rows[:, 1:].contiguous()}  # (B, T) each


class WindowSampler:
    """Random windows of `seq_len + 1` tokens from a token array, as a resumable batch source.

    Optimizer step g draws grad_accum * batch_size window offsets from a generator seeded by
    (seed, g); global micro-batch m of that step is the slice [m * B, (m + 1) * B). Rank r of
    world_size takes global micro-batches r, r + world_size, ... (grad_accum must be a multiple
    of world_size), so every number of processes sees the same windows in every step.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, grad_accum: int = 1,
                 seed: int, rank: int = 0, world_size: int = 1):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"token array has {len(tokens)} tokens; need more than seq_len + 1 = {seq_len + 1}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if grad_accum % world_size:
            raise ValueError(f"grad_accum={grad_accum} micro-batches per step cannot be shared by {world_size}"
                             f" processes; use a multiple of {world_size}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.grad_accum, self.seed, self.rank, self.world_size = grad_accum, seed, rank, world_size
        self.draws = 0  # micro-batches taken by this rank so far

    def offsets(self, draw: int) -> list[int]:
        """The window starts of this rank's micro-batch number `draw`."""
        group, micro = divmod(draw * self.world_size + self.rank, self.grad_accum)
        n = self.grad_accum * self.batch_size
        high = len(self.tokens) - (self.seq_len + 1) + 1  # last valid start + 1
        offs = torch.randint(0, high, (n,), generator=_generator("windows", self.seed, group))
        return offs[micro * self.batch_size:(micro + 1) * self.batch_size].tolist()

    def next_batch(self) -> dict[str, torch.Tensor]:
        """{"idx": (B, T) int64, "targets": (B, T) int64}; targets are idx shifted by one."""
        batch = _windows(self.tokens, self.offsets(self.draws), self.seq_len)
        self.draws += 1
        return batch

    def state_dict(self) -> dict:
        """position: global micro-batches taken (every rank's), valid between optimizer steps."""
        return {"position": self.draws * self.world_size, "seed": self.seed, "grad_accum": self.grad_accum,
                "batch_size": self.batch_size, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "grad_accum", "batch_size", "seq_len"):
            if state.get(k) != getattr(self, k):
                raise ValueError(f"WindowSampler state: {k}={state.get(k)!r} in the checkpoint,"
                                 f" {getattr(self, k)!r} now; resuming would change the data order")
        self.draws = _local_draws(int(state["position"]), self.world_size, "WindowSampler")


def _local_draws(position: int, world_size: int, who: str) -> int:
    """This rank's draws at a global position (taken between optimizer steps, so it divides)."""
    if position % world_size:
        raise ValueError(f"{who} state: global position {position} is not a multiple of {world_size}"
                         f" processes; the checkpoint was not taken between optimizer steps")
    return position // world_size


def fixed_windows(tokens: np.ndarray, *, seq_len: int, batch_size: int, n_batches: int,
                  ) -> list[dict[str, torch.Tensor]]:
    """`n_batches` validation batches of evenly spaced windows (the same on every call).

    They cover the array from start to end; if it is too short for non-overlapping
    windows they overlap.
    """
    if len(tokens) < seq_len + 1:
        raise ValueError(f"validation tokens: {len(tokens)}, fewer than one window of seq_len + 1 = {seq_len + 1}")
    n = batch_size * n_batches
    last = len(tokens) - (seq_len + 1)
    offsets = np.linspace(0, last, n).round().astype(np.int64).tolist()
    return [_windows(tokens, offsets[i * batch_size:(i + 1) * batch_size], seq_len) for i in range(n_batches)]


# ---------------------------------------------------------------------------
# Variable-length examples

def upsample_sources(sources: Sequence[str], minimum: int) -> tuple[list[int], dict[str, int]]:
    """The example indices to train on, and the repeat factor of each source that got one.

    Every example appears once; a source with fewer than `minimum` examples appears as many
    whole times as it takes to reach `minimum` (every example of it equally often), appended
    after the originals in their own order. `minimum` 0 keeps the list as it is. Repeating
    the examples of a rare source is the usual way to keep it from being drowned out by the
    large ones in a mixture without drawing new data."""
    if minimum < 0:
        raise ValueError(f"upsample_sources: minimum must be >= 0, got {minimum}")
    by_source: dict[str, list[int]] = {}
    for i, s in enumerate(sources):
        by_source.setdefault(s, []).append(i)
    indices, factors = list(range(len(sources))), {}
    for s, ix in by_source.items():
        if len(ix) < minimum:
            factors[s] = -(-minimum // len(ix))
            indices += ix * (factors[s] - 1)
    return indices, factors


class BucketBatchSampler:
    """Length-bucketed batches of example indices, shuffled per epoch; endless and resumable.

    Each epoch (generator seeded by (seed, epoch)): indices are shuffled, grouped by
    `length // bucket_width`, each bucket cut into batches of batch_size (its last one may be
    shorter), and the batches shuffled. Every epoch has the same number of batches. Rank r of
    world_size takes global batches r, r + world_size, ... (whole batches: a micro-batch is
    never split), so the sequence of batches does not depend on the number of processes.
    `state_dict()` is the global position (batches taken by every rank).
    """

    def __init__(self, lengths: Sequence[int], *, batch_size: int, bucket_width: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if len(lengths) == 0:
            raise ValueError("BucketBatchSampler: no examples")
        if bucket_width < 1 or batch_size < 1:
            raise ValueError(f"bucket_width and batch_size must be >= 1, got {bucket_width}, {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.bucket_width, self.seed = batch_size, bucket_width, seed
        self.rank, self.world_size = rank, world_size
        sizes = np.bincount(self.lengths // bucket_width)
        self.per_epoch = int(sum(-(-int(n) // batch_size) for n in sizes if n))  # batches in every epoch
        self.draws = 0  # batches taken by this rank
        self._epoch: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of `epoch`, in order."""
        g = _generator("buckets", self.seed, epoch)
        order = torch.randperm(len(self.lengths), generator=g).numpy()
        buckets: dict[int, list[int]] = {}
        for i in order:
            buckets.setdefault(int(self.lengths[i]) // self.bucket_width, []).append(int(i))
        size = self.batch_size
        batches = [b[s:s + size] for _, b in sorted(buckets.items()) for s in range(0, len(b), size)]
        perm = torch.randperm(len(batches), generator=g).tolist()
        return [batches[p] for p in perm]

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.per_epoch

    def next_indices(self) -> list[int]:
        """This rank's example indices for the next batch."""
        epoch, pos = divmod(self.draws * self.world_size + self.rank, self.per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, self.epoch_batches(epoch))
        self.draws += 1
        return self._epoch[1][pos]

    def __iter__(self):
        while True:
            yield self.next_indices()

    def state_dict(self) -> dict:
        return {"position": self.draws * self.world_size, "seed": self.seed, "batch_size": self.batch_size,
                "bucket_width": self.bucket_width, "n_examples": len(self.lengths)}

    def load_state_dict(self, state: dict) -> None:
        now = self.state_dict()
        for k in ("seed", "batch_size", "bucket_width", "n_examples"):
            if state.get(k) != now[k]:
                raise ValueError(f"BucketBatchSampler state: {k}={state.get(k)!r} in the checkpoint,"
                                 f" {now[k]!r} now; resuming would change the data order")
        self.draws = _local_draws(int(state["position"]), self.world_size, "BucketBatchSampler")


def pad_collate(sequences: Sequence[Sequence[int]], *, pad_id: int,
                loss_masks: Sequence[Sequence[bool]] | None = None, shift: bool = True,
                ) -> dict[str, torch.Tensor]:
    """Right-pad token lists into one batch.

    shift=True (language-model loss): for a sequence s of length L, idx = s[:-1] and
    targets = s[1:], with targets = IGNORE_INDEX where loss_masks[i][1:] is False and on
    padding; T = max(L) - 1. Returns idx (B, T) int64, targets (B, T) int64,
    attention_mask (B, T) bool (True on real tokens).
    shift=False (reward model, whole sequences): idx (B, T) and attention_mask (B, T), T = max(L).
    """
    if len(sequences) == 0:
        raise ValueError("pad_collate: empty batch")
    if loss_masks is not None and len(loss_masks) != len(sequences):
        raise ValueError(f"pad_collate: {len(sequences)} sequences but {len(loss_masks)} loss masks")
    cut = 1 if shift else 0
    lengths = [len(s) - cut for s in sequences]
    if min(lengths) < 1:
        raise ValueError(f"pad_collate: every sequence needs at least {1 + cut} tokens")
    B, T = len(sequences), max(lengths)
    idx = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.bool)
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(sequences):
        s = torch.as_tensor(s, dtype=torch.long)
        if loss_masks is not None and len(loss_masks[i]) != len(s):
            raise ValueError(f"pad_collate: sequence {i} has {len(s)} tokens but a loss mask of {len(loss_masks[i])}")
        n = len(s) - cut
        idx[i, :n] = s[:n]
        attention_mask[i, :n] = True
        if shift:
            tgt = s[1:].clone()
            if loss_masks is not None:
                keep = torch.as_tensor(loss_masks[i], dtype=torch.bool)[1:]
                tgt[~keep] = IGNORE_INDEX
            targets[i, :n] = tgt
    out = {"idx": idx, "attention_mask": attention_mask}
    if shift:
        out["targets"] = targets
    return out


class ExampleBatches:
    """A batch source over a stage's own examples: `make_batch(indices) -> dict of tensors`.

    Example (SFT):
        sampler = BucketBatchSampler([len(ids) for ids, _ in data], batch_size=16, bucket_width=50, seed=s)
        source = ExampleBatches(sampler, lambda ix: pad_collate([data[i][0] for i in ix], pad_id=tok.pad_id,
                                                               loss_masks=[data[i][1] for i in ix]))
    """

    def __init__(self, sampler: BucketBatchSampler, make_batch: Callable[[list[int]], dict[str, torch.Tensor]]):
        self.sampler, self.make_batch = sampler, make_batch

    def next_batch(self) -> dict[str, torch.Tensor]:
        return self.make_batch(self.sampler.next_indices())

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def replay_rows(batch_size: int, fraction: float) -> int:
    """Rows of pretraining text to add to a batch of `batch_size` examples so that they are
    `fraction` of its rows: round(batch_size * fraction / (1 - fraction))."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"replay fraction must be in [0, 1), got {fraction}")
    return round(batch_size * fraction / (1.0 - fraction))


class ReplayBatches:
    """Example batches with windows of pretraining text appended: SFT that keeps the base model's language.

    Each batch of B examples from `inner` (idx, targets, attention_mask: (B, T)) gets
    `replay_rows(B, fraction)` more rows, each a window of T + 1 tokens of `tokens` (the shape
    the batch already has, so replay adds no padding) with every target scored and every
    position attended. Since a conversation's loss covers only its answers, the text's share
    of the scored tokens is above its share of the rows. Window starts come from a generator
    seeded by (seed, the global position of the batch), so the batches do not depend on the
    number of processes and a resumed run sees the same text; the cursor is `inner`'s.
    """

    def __init__(self, inner: ExampleBatches, tokens: np.ndarray, *, fraction: float, seed: int):
        if len(tokens) < 2:
            raise ValueError(f"replay: the token array has {len(tokens)} tokens; it needs at least 2")
        replay_rows(1, fraction)  # checks the fraction
        self.inner, self.tokens, self.fraction, self.seed = inner, tokens, fraction, seed

    def next_batch(self) -> dict[str, torch.Tensor]:
        sampler = self.inner.sampler
        position = sampler.draws * sampler.world_size + sampler.rank  # this batch's global index
        batch = self.inner.next_batch()
        B, T = batch["idx"].shape
        r = replay_rows(B, self.fraction)
        if r == 0:
            return batch
        if len(self.tokens) < T + 1:
            raise ValueError(f"replay: a batch of {T + 1} tokens is longer than the {len(self.tokens)} tokens"
                             f" of pretraining text")
        offsets = torch.randint(0, len(self.tokens) - T, (r,), generator=_generator("replay", self.seed, position))
        text = _windows(self.tokens, offsets.tolist(), T)  # idx, targets: (r, T)
        return {"idx": torch.cat([batch["idx"], text["idx"]]),                    # (B + r, T)
                "targets": torch.cat([batch["targets"], text["targets"]]),        # (B + r, T)
                "attention_mask": torch.cat([batch["attention_mask"], torch.ones((r, T), dtype=torch.bool)])}

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def _masked_batch(examples: Sequence[tuple[Sequence[int], Sequence[bool]]], pad_id: int
                  ) -> Callable[[list[int]], dict[str, torch.Tensor]]:
    return lambda ix: pad_collate([examples[i][0] for i in ix], pad_id=pad_id, loss_masks=[examples[i][1] for i in ix])


def conversation_batches(examples: Sequence[tuple[Sequence[int], Sequence[bool]]], *, pad_id: int, batch_size: int,
                         bucket_width: int, seed: int, rank: int = 0, world_size: int = 1,
                         replay: np.ndarray | None = None,
                         replay_fraction: float = 0.0) -> ExampleBatches | ReplayBatches:
    """The training batch source of (ids, loss_mask) examples (SFT's rendered conversations):
    length buckets, padded by `pad_collate`, and with `replay` (a token array) windows of
    pretraining text appended, `replay_fraction` of each batch's rows (`ReplayBatches`)."""
    sampler = BucketBatchSampler([len(ids) for ids, _ in examples], batch_size=batch_size, bucket_width=bucket_width,
                                 seed=seed, rank=rank, world_size=world_size)
    batches = ExampleBatches(sampler, _masked_batch(examples, pad_id))
    if replay is None:
        return batches
    return ReplayBatches(batches, replay, fraction=replay_fraction, seed=seed)


def fixed_conversation_batches(examples: Sequence[tuple[Sequence[int], Sequence[bool]]], *, pad_id: int,
                               batch_size: int, n_batches: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Fixed validation batches: a seeded sample of n_batches * batch_size examples (shortest-first
    would pick only the short ones, SFT's instruction tasks), sorted by length within the sample
    to pad less."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(examples), generator=g)[: n_batches * batch_size].tolist()
    ordered = sorted((examples[i] for i in pick), key=lambda x: len(x[0]))
    make = _masked_batch(ordered, pad_id)
    return [make(list(range(i, min(i + batch_size, len(ordered))))) for i in range(0, len(ordered), batch_size)]


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, prompt_lens: Sequence[int] | None = None
              ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Right-pad token lists: idx (N, T) long, attention_mask (N, T) bool and, given the prompt
    lengths, response_mask (N, T) bool (True from prompt_len to the end of each sequence)."""
    N, T = len(seqs), max(len(s) for s in seqs)
    idx = torch.full((N, T), pad_id, dtype=torch.long)
    mask = torch.zeros((N, T), dtype=torch.bool)
    resp = torch.zeros((N, T), dtype=torch.bool) if prompt_lens is not None else None
    for i, s in enumerate(seqs):
        idx[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, :len(s)] = True
        if resp is not None:
            resp[i, prompt_lens[i]:len(s)] = True
    return idx, mask, resp
