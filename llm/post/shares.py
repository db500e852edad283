"""The data-parallel bookkeeping of an RL step, written once so that PPO and GRPO read as their papers.

    share = Shares.of(len(prompts), group_size, rt)     # this rank's rows [lo, hi) of the global batch
    stats = update_epochs(updater, share, rows, loss_fn, epochs=..., minibatch_size=..., seed=..., step=...)

Data parallel (common.nproc > 1, under torchrun): every rank draws the step's global prompt
list from the same generator and takes an equal, contiguous share of its rows (a GRPO group
is never split); it samples its rows with the whole batch's random numbers
(llm.sample.generate.generate's row_offset), so each row's tokens are those one process would
sample. Each rank's loss is its rows' part of the global loss (its numerator over the global
denominator), the Updater sums the gradients over the ranks, and every statistic (advantage
whitening, the KL controller, the gates, every logged number) is taken on the global batch
(`Shares.sums`, `Shares.gather`, `Mean`). Minibatches are a permutation of the global batch,
so minibatch k holds the same rows as in one process; a rank with none of them still joins
the update (`update_epochs`). The result is one process's trajectory up to the order of
floating-point sums; in one process every helper here is the identity.

Sampling randomness is counter-based (`step_generator`: a torch.Generator seeded from
(seed, what, step)), so a resumed run repeats the uninterrupted one exactly on the CPU.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from llm.data.batching import derive_seed
from llm.runtime import Runtime, all_gather_object, all_reduce
from llm.train.loop import Updater


def step_generator(seed: int, what: str, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one use at one step: nothing to save in a checkpoint."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, what, step))


def minibatches(n: int, size: int, generator: torch.Generator) -> list[Tensor]:
    """A shuffled partition of range(n) into chunks of `size` (the last may be shorter)."""
    perm = torch.randperm(n, generator=generator)
    return list(perm.split(size))


@dataclass
class Shares:
    """This rank's contiguous share of a global batch of `total` rows: rows [lo, hi)."""
    lo: int
    hi: int
    total: int
    rt: Runtime | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, n_items: int, rows_per_item: int, rt: Runtime | None) -> "Shares":
        """Items (prompts; each rows_per_item rows, a GRPO group) shared out equally over the ranks."""
        rank, world = (rt.rank, rt.world_size) if rt is not None else (0, 1)
        if n_items % world:
            raise ValueError(f"{n_items} prompts per step cannot be shared equally by {world} processes")
        per = n_items // world * rows_per_item
        return cls(rank * per, (rank + 1) * per, n_items * rows_per_item, rt)

    def local(self, idx: Tensor) -> Tensor:
        """The rows of global indices `idx` that are this rank's, as local indices (in idx's order)."""
        return idx[(idx >= self.lo) & (idx < self.hi)] - self.lo

    def gather(self, x: Tensor) -> Tensor:
        """Every rank's (n, ...) rows of x concatenated in rank order: the global batch's (on CPU)."""
        return torch.cat([t for t in all_gather_object(x.detach().cpu(), self.rt)])

    def sums(self, *values: float | Tensor) -> list[float]:
        """Each value summed over the ranks (float64; the values themselves in one process)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if self.rt is not None and self.rt.distributed:
            t = all_reduce(t.to(self.rt.device), self.rt)
        return t.tolist()

    def reduce(self, t: Tensor) -> Tensor:
        """A tensor summed over the ranks, in place (itself in one process): llm.nn.losses.whiten's `reduce`."""
        return all_reduce(t, self.rt) if self.rt is not None else t


class Mean:
    """Running means of named floats over minibatches (minibatch statistics -> one row).

    `add` takes numbers every rank holds alike (the gradient norm); `add_share` takes this
    rank's share of a global number (its rows' part of the minibatch loss), summed over the
    ranks by `result(rt)`. Every rank must call both for the same minibatches and keys."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.shares: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, **values: float | Tensor) -> None:
        for k, v in values.items():
            self.sums[k] += float(v)
            self.counts[k] += 1

    def add_share(self, **values: float | Tensor) -> None:
        for k, v in values.items():
            self.shares[k] += float(v)
            self.counts[k] += 1

    def result(self, rt: Runtime | None = None) -> dict[str, float]:
        keys = sorted(self.shares)
        if keys and rt is not None and rt.distributed:
            summed = all_reduce(torch.tensor([self.shares[k] for k in keys], dtype=torch.float64, device=rt.device),
                                rt).tolist()
            shares = dict(zip(keys, summed))
        else:
            shares = dict(self.shares)
        return {k: (self.sums[k] if k in self.sums else shares[k]) / self.counts[k] for k in self.counts}


# loss_fn(local, idx, w) -> (this rank's part of minibatch idx's loss, its shares of the statistics)
MinibatchLoss = Callable[[Tensor, Tensor, float], tuple[Tensor, dict[str, float | Tensor]]]

# A minibatch none of whose rows carries a loss on any rank still logs these (GRPO, beta = 0)
NO_LOSS_STATS = ("loss", "policy_loss")


def update_epochs(updater: Updater, share: Shares, rows: Tensor, loss_fn: MinibatchLoss, *, lengths: Tensor,
                  epochs: int, minibatch_size: int, seed: int, step: int, device: torch.device | str,
                  stat_keys: Sequence[str], carries_loss: Tensor | None = None) -> dict[str, float]:
    """`epochs` passes over shuffled minibatches of the global rows `rows` (global indices), one
    optimizer step per minibatch that every rank takes together; returns the statistics' means
    over the minibatches, on the global batch (Mean.result).

    loss_fn(local, idx, w): this rank's part of the loss of minibatch `idx` (global indices,
    every rank's rows) and its shares of the statistics `stat_keys`, computed on its rows `local`
    (local indices, never empty) of the rows that carry a loss (all of idx, or those where
    `carries_loss`, a (total,) bool, is true). `w` is this rank's share of those rows' response
    tokens (`lengths`: the global batch's (total,) response lengths), exactly 1 in one process:
    a token mean over its rows times w is its part of the minibatch's token mean.

    A rank with none of the rows still joins the step (the gradient sum over the ranks waits for
    it) with a zero loss over every parameter and zero shares. A minibatch with no row that
    carries a loss on any rank is a zero step too (AdamW's moments still move, as on the full
    batch) that logs only NO_LOSS_STATS.
    """
    stats = Mean()
    for epoch in range(epochs):
        g = step_generator(seed, f"minibatch-{epoch}", step)
        for mb in minibatches(len(rows), minibatch_size, g):
            idx = rows[mb].to(device)
            kept = idx if carries_loss is None else idx[carries_loss[idx]]
            local = share.local(kept)
            if len(kept) == 0:
                loss, shares = _zero_loss(updater), dict.fromkeys(NO_LOSS_STATS, 0.0)
            elif len(local) == 0:
                loss, shares = _zero_loss(updater), dict.fromkeys(stat_keys, 0.0)
            else:
                w = float(lengths[local + share.lo].sum()) / max(float(lengths[kept].sum()), 1.0)
                loss, shares = loss_fn(local, idx, w)
            applied, gnorm = updater.minimize(loss)
            stats.add(grad_norm=gnorm, skipped=float(not applied))
            stats.add_share(**shares)
    return stats.result(share.rt)


def _zero_loss(updater: Updater) -> Tensor:
    """A loss of exactly 0 that reaches every parameter, so that backward gives each a (zero) gradient."""
    return sum(p.sum() for p in updater.params) * 0.0


def rollout_stats(share: Shares, ro, reward_stats: dict[str, float]) -> tuple[dict[str, float], float]:
    """The rollouts' row numbers on the global batch: response_length and stop_rate (means over the
    responses), the reward function's statistics (`reward_stats`: this rank's means, e.g. accuracy),
    and the number of tokens sampled and scored (prompts included: for tokens_per_s)."""
    B = len(ro)
    len_sum, stop_sum, n_tokens, *rvals = share.sums(ro.lengths.sum(), ro.stopped.sum(), ro.attention_mask.sum(),
                                                     *(v * B for v in reward_stats.values()))
    row = {"response_length": len_sum / share.total, "stop_rate": stop_sum / share.total,
           **{k: v / share.total for k, v in zip(reward_stats, rvals)}}
    return row, n_tokens
