"""Supervised training: the step body that pretrain, SFT, the reward model and DPO share.

A stage brings three things and calls `train(...)`:

    batches   a batch source: next_batch() -> dict of CPU tensors, state_dict(), load_state_dict()
              (llm.data.batching.WindowSampler, llm.data.batching.ExampleBatches, or your own)
    loss_fn   loss_fn(model, batch) -> (loss_sum, weight) or (loss_sum, weight, extras):
              the loss *summed* over the batch's `weight` units (target tokens, pairs...),
              and optional extras {name: summed tensor} reported as sum / weight
              (e.g. {"accuracy": n_correct}). `lm_loss` is the language-model one.
    val_batches  a fixed list of batches, evaluated every eval_every steps

`train` wraps the model (DDP or FSDP2 under torchrun, llm/runtime.py) and runs the run
skeleton of llm/train/loop.py (resume, checkpoints, signals, evaluation, monitoring, the optimizer
step and the non-finite policy) with `SupervisedStep` as the step body:

An optimizer step is cfg.grad_accum micro-batches over all ranks: each of N ranks takes
grad_accum / N of them (the batch sources hand rank r the global micro-batches r, r + N, ...,
llm/data/batching.py), so the global batch and its samples do not depend on N. The body counts
each micro-batch's weight *before* any forward (`batch_weight`: batch["weight"], else the
targets that are not -100), all-reduces the total W over ranks, and back-propagates
loss_sum * world / W for each micro-batch (DDP averages over ranks), so k micro-batches on N
ranks give the gradients of one big batch of the same examples. DDP gradient sync happens
only on the last micro-batch (`no_sync`; FSDP: `set_requires_gradient_sync`). Dropout's RNG
is reseeded from (seed, step, global micro-batch) before every micro-batch, and samplers are
counter-based, so a run resumed from a checkpoint reproduces the uninterrupted run bit for
bit on CPU, and one resumed on another number of processes continues from the same sample
with the same dropout masks.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from llm.config import TrainConfig
from llm.data.batching import IGNORE_INDEX, derive_seed
from llm.nn.losses import cross_entropy_sum
from llm.runtime import Runtime, all_reduce, enable_activation_checkpointing, wrap_model
from llm.train.loop import APPLIED, Updater, run_loop, seed_step
from llm.train.monitor import Plots, cuda_memory, peak_flops

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], tuple]


class BatchSource(Protocol):
    def next_batch(self) -> Batch: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


# ---------------------------------------------------------------------------
# Loss and batch helpers

def lm_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over targets != -100: (loss_sum, n_target_tokens)."""
    mask = batch.get("attention_mask")
    logits = model(batch["idx"], attention_mask=mask) if mask is not None else model(batch["idx"])  # (B, T, V)
    targets = batch["targets"]  # (B, T)
    # the logits never leave this function: the backward may reuse their memory for the gradient
    loss_sum = cross_entropy_sum(logits.flatten(0, 1).float(), targets.flatten(), overwrite_logits=True)
    return loss_sum, (targets != IGNORE_INDEX).sum()


def supervised_lm_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm_loss` with the logits computed only at the supervised positions (targets != -100).

    The same loss up to float rounding; for batches where most targets are masked (SFT's
    prompts and padding), it skips most of the vocabulary product and its backward. Indexing
    with a boolean mask makes the host wait for the device (twice a micro-batch: hidden states
    and targets), so pretraining, which masks nothing, keeps `lm_loss`.
    """
    targets = batch["targets"]  # (B, T)
    keep = targets != IGNORE_INDEX
    logits = model(batch["idx"], attention_mask=batch.get("attention_mask"), logits_at=keep)  # (N, V)
    loss_sum = cross_entropy_sum(logits.float(), targets[keep], overwrite_logits=True)
    return loss_sum, keep.sum()


def batch_weight(batch: Batch) -> float:
    """How many loss units a batch holds, known before any forward pass.

    batch["weight"] if given (e.g. the number of preference pairs), else the count of
    targets != -100.
    """
    if "weight" in batch:
        return float(batch["weight"])
    if "targets" in batch:
        return float((batch["targets"] != IGNORE_INDEX).sum())
    raise KeyError(f"batch has neither 'weight' nor 'targets' (keys: {sorted(batch)}); a batch source"
                   f" for llm.train.trainer.train must say how many loss units each batch holds")


def batch_tokens(batch: Batch) -> int:
    """Tokens processed (for tokens/s): real tokens if there is a mask, else idx.numel()."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return batch["idx"].numel() if "idx" in batch else 0


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _split_loss(out: tuple) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise TypeError("loss_fn must return (loss_sum, weight) or (loss_sum, weight, extras)")
    return out[0], out[1], (out[2] if len(out) == 3 else {})


def accumulate_gradients(model: nn.Module, micro: Sequence[Batch], loss_fn: LossFn, rt: Runtime, *,
                         scaler: torch.amp.GradScaler | None = None,
                         sync: Callable[[bool], Any] | None = None,
                         check_weights: bool = False) -> tuple[torch.Tensor, list[str]]:
    """Forward + backward k micro-batches; .grad ends up as the gradient of one big batch.

    Each micro-batch's weight is counted first (`batch_weight`), summed over micro-batches
    and ranks into W, and each backward runs on loss_sum * world_size / W (DDP/FSDP then
    average over ranks), so the accumulated gradient is d(sum of all losses / W). `sync(last)`
    returns the context for each micro-batch (DDP no_sync on all but the last).
    Returns (stats, extra_keys) without a host sync: stats = float64 [mean loss, W,
    tokens, *extras / W] over all ranks, on rt.device.
    """
    weights = [batch_weight(b) for b in micro]
    counts = torch.tensor([sum(weights), float(sum(batch_tokens(b) for b in micro))], dtype=torch.float64)
    if rt.distributed:
        counts = all_reduce(counts.to(rt.device), rt)
    denom = counts[0].clamp(min=1.0)  # an all-masked step has zero loss and zero gradient
    scale = (rt.world_size / denom).to(device=rt.device, dtype=torch.float32)
    loss_total = torch.zeros((), dtype=torch.float64, device=rt.device)
    extra_sums: dict[str, torch.Tensor] = {}
    for j, b in enumerate(micro):
        ctx = sync(j == len(micro) - 1) if sync is not None else contextlib.nullcontext()
        with ctx:
            with rt.autocast():
                loss_sum, w, extras = _split_loss(loss_fn(model, _to_device(b, rt.device)))
            if check_weights and float(w) != weights[j]:
                raise ValueError(f"loss_fn says the batch holds weight {float(w)}, but batch_weight() counted"
                                 f" {weights[j]} before the forward; put the right count in batch['weight']")
            scaled = loss_sum * scale
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_total += loss_sum.detach().double()
        for k, v in extras.items():
            extra_sums[k] = extra_sums.get(k, 0) + v.detach().double()
    keys = sorted(extra_sums)
    sums = all_reduce(torch.stack([loss_total] + [extra_sums[k] for k in keys]), rt)
    denom = denom.to(sums.device)
    stats = torch.cat([sums[:1] / denom, counts.to(sums.device), sums[1:] / denom])
    return stats, keys


# ---------------------------------------------------------------------------
# Evaluation

@torch.no_grad()
def evaluate(model: nn.Module, val_batches: Sequence[Batch], loss_fn: LossFn, rt: Runtime,
             bytes_per_token: float | None = None) -> dict[str, float]:
    """Mean validation loss (and perplexity, bits per byte, extras) in eval mode under no_grad.

    Batches are shared out over ranks; every rank runs the same number of forwards
    (FSDP needs that), with weight 0 for the padding ones.
    """
    was_training = model.training
    model.eval()
    n, world = len(val_batches), rt.world_size
    sums: dict[str, torch.Tensor] = {}
    keys: list[str] = []
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)  # (loss_sum, weight)
    for r in range(math.ceil(n / world)):
        j = r * world + rt.rank
        real = j < n
        with rt.autocast():
            loss_sum, weight, extras = _split_loss(loss_fn(model, _to_device(val_batches[j if real else 0], rt.device)))
        keys = sorted(extras)
        if real:
            total += torch.stack([loss_sum.detach().double(), torch.as_tensor(weight, device=rt.device).double()])
            for k, v in extras.items():
                sums[k] = sums.get(k, 0) + v.detach().double()
    extra_vec = [torch.as_tensor(sums.get(k, 0.0), device=rt.device).double() for k in keys]
    vec = all_reduce(torch.cat([total, torch.stack(extra_vec) if keys else total.new_zeros(0)]), rt).tolist()
    model.train(was_training)
    w = max(vec[1], 1.0)
    loss = vec[0] / w
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
    if bytes_per_token:
        out["val_bpb"] = loss / math.log(2) / bytes_per_token
    out.update({f"val_{k}": v / w for k, v in zip(keys, vec[2:])})
    return out


# ---------------------------------------------------------------------------
# The step body and the loop

LOSS_PANELS = [("loss (nats/token)", [("train", "loss", "train loss"), ("val", "val_loss", "val loss")]),
               ("lr", [("train", "lr", "lr")])]


class SupervisedStep:
    """One optimizer step over grad_accum micro-batches, grad_accum / world of them on this rank
    (the step body of `train`)."""

    def __init__(self, wrapped: nn.Module, batches: BatchSource, loss_fn: LossFn, rt: Runtime, *, seed: int,
                 grad_accum: int, sync: Callable[[bool], Any], flops_per_token: int | None, peak: float | None):
        assert grad_accum % rt.world_size == 0, "checked by train()"
        self.model, self.batches, self.loss_fn, self.rt = wrapped, batches, loss_fn, rt
        self.seed, self.grad_accum, self.sync = seed, grad_accum, sync
        self.flops_per_token, self.peak = flops_per_token, peak
        self.tokens_seen = 0
        self.checked_weights = False

    def step(self, step: int, updater: Updater) -> dict[str, Any] | None:
        rt = self.rt
        t0 = time.perf_counter()
        mine = self.grad_accum // rt.world_size
        micro = [self.batches.next_batch() for _ in range(mine)]
        # dropout masks keyed by the global micro-batch (j-th of this rank = j * world + rank), so
        # they do not depend on how many processes share the step
        seeds = iter(derive_seed(self.seed, "dropout", step, j * rt.world_size + rt.rank) for j in range(mine))

        def loss_fn(model: nn.Module, batch: Batch):
            seed_step(rt, next(seeds))
            return self.loss_fn(model, batch)

        stats, ekeys = accumulate_gradients(self.model, micro, loss_fn, rt, scaler=updater.scaler,
                                            sync=self.sync, check_weights=not self.checked_weights)
        self.checked_weights = True
        outcome, values, gnorm = updater.apply(stats)
        if outcome != APPLIED:
            return None
        loss_v, w_global, tok_global, *extra_v = values
        dt = time.perf_counter() - t0
        self.tokens_seen += int(tok_global)
        row = {"loss": loss_v, "grad_norm": gnorm,
               "weight": w_global,  # loss units (target tokens, pairs) in the step, all ranks
               "tokens_per_s": tok_global / dt, "tokens_seen": self.tokens_seen}
        if self.flops_per_token and self.peak:
            row["mfu"] = self.flops_per_token * tok_global / dt / (self.peak * rt.world_size)
        row.update(dict(zip(ekeys, extra_v)))
        row.update(cuda_memory(rt.device))  # host-side counters: no sync
        return row

    def state_dict(self) -> dict:
        return {"batches": self.batches.state_dict(), "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state["batches"])
        self.tokens_seen = state["tokens_seen"]


@dataclass
class TrainResult:
    step: int                          # optimizer steps done
    metrics: dict[str, Any]            # final numbers (see train())
    train_history: list[dict] = field(default_factory=list)  # one row per optimizer step
    val_history: list[dict] = field(default_factory=list)    # one row per evaluation
    resumed_from: int | None = None    # step of the checkpoint resumed, if any


def train(model: nn.Module, cfg: TrainConfig, rt: Runtime, *, stage: str, seed: int,
          batches: BatchSource, loss_fn: LossFn = lm_loss, val_batches: Sequence[Batch] | None = None,
          run_dir: str | Path, fingerprint: str, plots: Plots | None = None,
          bytes_per_token: float | None = None, find_unused_parameters: bool = False,
          progress: bool = True) -> TrainResult:
    """Train `model` for cfg.max_steps optimizer steps, resuming from `run_dir` if it can.

    model: on any device; moved to rt.device. Pass the unwrapped module; `loss_fn`
    receives the wrapped one (DDP/FSDP/compiled): call it (forward) rather than other
    methods so gradient sync works, and use `unwrap(model)` for anything else.
    cfg.distributed: DDP or FSDP2 when rt.world_size > 1; cfg.grad_accum must be a multiple of
    rt.world_size (the micro-batches of a step are shared out over the ranks).
    seed: derive it from (common.seed, stage); dropout and nothing else uses the global RNG.
    run_dir: checkpoints (ckpt-<step>/), resumed from when their fingerprint matches.
    plots: where the curves go (panels default to loss and lr).
    Returns a TrainResult; metrics has train_loss (mean of the last log_every steps),
    val_loss / val_ppl / val_bpb / val_<extra> (last evaluation), tokens_seen,
    tokens_per_s, mfu (None where the device peak is unknown), nonfinite_skips,
    amp_overflows, train_time_s, and mem_*_gb on CUDA.
    """
    if cfg.grad_accum % rt.world_size:
        raise ValueError(f"{stage}.grad_accum: {cfg.grad_accum} micro-batches per step cannot be shared by"
                         f" {rt.world_size} processes; set it to a multiple of {rt.world_size}")
    raw = model.to(rt.device)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(raw)
    wrapped = wrap_model(raw, rt, cfg.distributed, find_unused_parameters)
    ddp = wrapped if isinstance(wrapped, nn.parallel.DistributedDataParallel) else None
    fsdp = rt.distributed and cfg.distributed == "fsdp"
    say = (lambda m: print(m, flush=True)) if rt.is_main else (lambda m: None)
    updater = Updater(raw, cfg, rt, stage=stage, say=say)
    if cfg.compile:
        wrapped = torch.compile(wrapped)

    def sync_ctx(last: bool):
        """Gradient all-reduce only on the last micro-batch of a step."""
        if fsdp:
            raw.set_requires_gradient_sync(last)
        if ddp is not None and not last:
            return ddp.no_sync()
        return contextlib.nullcontext()

    flops_tok = raw.flops_per_token() if hasattr(raw, "flops_per_token") else None
    peak = peak_flops(rt.device, rt.dtype)
    body = SupervisedStep(wrapped, batches, loss_fn, rt, seed=seed, grad_accum=cfg.grad_accum, sync=sync_ctx,
                          flops_per_token=flops_tok, peak=peak)
    if plots is not None and not plots.panels:
        plots.panels = LOSS_PANELS

    def run_eval(step: int) -> dict:
        return evaluate(wrapped, val_batches, loss_fn, rt, bytes_per_token)

    wrapped.train()
    res = run_loop(body, updater, cfg, rt, stage=stage, model=raw, run_dir=run_dir, fingerprint=fingerprint,
                   evaluate=run_eval if val_batches else None, plots=plots, log_every=cfg.log_every,
                   progress=progress)
    hist, val_hist, tokens_seen, train_time = res.history, res.val_history, body.tokens_seen, res.train_time_s
    recent = [r["loss"] for r in hist[-cfg.log_every:]]
    metrics: dict[str, Any] = {
        "train_loss": sum(recent) / len(recent) if recent else None,
        **({k: v for k, v in val_hist[-1].items() if k != "step"} if val_hist else {}),
        "steps": res.step, "tokens_seen": tokens_seen,
        "tokens_per_s": tokens_seen / train_time if train_time else None,
        "mfu": (flops_tok * tokens_seen / train_time / (peak * rt.world_size)
                if (flops_tok and peak and train_time) else None),
        "nonfinite_skips": res.nonfinite_skips, "amp_overflows": res.amp_overflows, "train_time_s": train_time,
        "world_size": rt.world_size, "device": str(rt.device), "dtype": str(rt.dtype).replace("torch.", ""),
        "num_threads": torch.get_num_threads(), "threads_steps": res.threads_steps,
        "threads_probe": res.threads_probe, **cuda_memory(rt.device),
    }
    return TrainResult(step=res.step, metrics=metrics, train_history=hist, val_history=val_hist,
                       resumed_from=res.resumed_from)
