"""The one training loop, shared by pretrain, SFT, reward model and DPO.

A stage brings three things and calls `train(...)`:

    batches   a batch source: next_batch() -> dict of CPU tensors, state_dict(), load_state_dict()
              (llm.batching.WindowSampler, llm.batching.ExampleBatches, or your own)
    loss_fn   loss_fn(model, batch) -> (loss_sum, weight) or (loss_sum, weight, extras):
              the loss *summed* over the batch's `weight` units (target tokens, pairs...),
              and optional extras {name: summed tensor} reported as sum / weight
              (e.g. {"accuracy": n_correct}). `lm_loss` is the language-model one.
    val_batches  a fixed list of batches, evaluated every eval_every steps

Per optimizer step the loop takes grad_accum micro-batches, counts each one's weight
*before* any forward (`batch_weight`: batch["weight"], else the targets that are not
-100), all-reduces the total W over ranks, and back-propagates loss_sum * world / W for
each micro-batch (DDP averages over ranks), so k micro-batches on N ranks give the
gradients of one big batch of the same examples. DDP gradient sync happens only on the
last micro-batch (`no_sync`; FSDP: `set_requires_gradient_sync`).

Before `optimizer.step()` the loss and the global grad norm are checked; a non-finite one
either raises (`nonfinite_policy: raise`, naming the step) or skips the update
(`skip`): no parameter, moment or schedule step changes; the skip is counted and
`nonfinite_budget` bounds them. Dropout's RNG is reseeded from (seed, rank, step) at every
step, and samplers are counter-based, so a run resumed from a checkpoint reproduces the
uninterrupted run bit for bit on CPU. SIGTERM/SIGINT finish the current step, write a
checkpoint and exit with 128 + signal number.

Distributed: under torchrun (WORLD_SIZE > 1) `setup_runtime` initialises the process group
(gloo on CPU, nccl on CUDA); `train` wraps the model in DDP, or FSDP2 (`fully_shard`) with
distributed="fsdp"; only rank 0 writes files.

`stage_main` is the `main()` of every stage that trains or generates on a device: argparse,
params, the torchrun re-exec, runtime setup/teardown and the one-line error or summary.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llm.batching import IGNORE_INDEX, derive_seed
from llm.checkpoint import CheckpointError, checkpoint_path, find_resume, quarantine_stale, save_checkpoint
from llm.config import CommonConfig, ConfigError, TrainConfig
from llm.fileio import DataError
from llm.losses import cross_entropy_sum
from llm.monitor import Monitor, cuda_memory, peak_flops
from llm.optim import build_optimizer, lr_for, set_lr

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], tuple]


class BatchSource(Protocol):
    def next_batch(self) -> Batch: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm under `nonfinite_policy: raise`, or the skip budget spent."""


# ---------------------------------------------------------------------------
# Device, dtype, processes

@dataclass
class Runtime:
    """Where this process trains: device, compute dtype, and its place among the ranks."""
    device: torch.device
    dtype: torch.dtype = torch.float32  # autocast dtype; float32 = no autocast
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def resolve_device(common: CommonConfig, local_rank: int = 0) -> torch.device:
    """common.device: "auto" -> cuda:<local_rank> when available, else cpu."""
    if common.device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if common.device == "cuda":
        raise RuntimeError("common.device: cuda, but torch.cuda.is_available() is False (no GPU, or a"
                           " CPU-only torch build); set common.device: auto or cpu")
    return torch.device("cpu")


def resolve_dtype(common: CommonConfig, device: torch.device) -> torch.dtype:
    """Compute dtype: fp32 on CPU; on CUDA "auto" = bf16 where supported, else fp16."""
    want = common.dtype
    if device.type != "cuda":
        if want in ("bf16", "fp16"):
            raise RuntimeError(f"common.dtype: {want} needs a CUDA device (CPU training is fp32);"
                               f" set common.dtype: auto or fp32")
        return torch.float32
    if want == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if want == "bf16" and not torch.cuda.is_bf16_supported():
        raise RuntimeError(f"common.dtype: bf16, but {torch.cuda.get_device_name(device)} has no bf16;"
                           f" use fp16 (with GradScaler) or auto")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[want]


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup_runtime(common: CommonConfig) -> Runtime:
    """Threads, device, dtype; under torchrun (WORLD_SIZE > 1) also the process group."""
    if common.num_threads:
        torch.set_num_threads(common.num_threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(common, local_rank)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Runtime(device=device, dtype=resolve_dtype(common, device), rank=rank,
                   local_rank=local_rank, world_size=world)


def teardown_runtime() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Model wrapping

def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under torch.compile and DDP wrappers (FSDP2 modules are their own)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the longest ModuleList whose members share one type."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(b) for b in m}) == 1:
            best = list(m)
    return best


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each block's activations in backward instead of storing them; returns #blocks.

    Patches `forward` (non-reentrant torch.utils.checkpoint, RNG preserved) instead of
    wrapping, so state-dict keys do not change.
    """
    from torch.utils.checkpoint import checkpoint
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(f"activation_checkpointing: found no nn.ModuleList of blocks in {type(model).__name__}")
    for b in blocks:
        inner = b.forward
        b.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(inner)
    return len(blocks)


def wrap_model(model: nn.Module, rt: Runtime, strategy: str = "ddp",
               find_unused_parameters: bool = False) -> nn.Module:
    """DDP or FSDP2 when distributed, else the model itself."""
    if not rt.distributed:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard
        if rt.dtype == torch.float16:
            raise RuntimeError("fp16 with FSDP is not supported by this trainer; use bf16")
        for b in _blocks(model):
            fully_shard(b)
        fully_shard(model)
        return model
    if strategy != "ddp":
        raise ValueError(f"distributed strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    ids = [rt.device.index] if rt.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                               find_unused_parameters=find_unused_parameters)


def full_model_state(model: nn.Module, rt: Runtime) -> dict[str, torch.Tensor] | None:
    """The whole (unsharded) state dict on CPU on rank 0, None on other ranks.

    Every rank must call it: under FSDP it gathers the shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=rt.distributed)
    state = get_model_state_dict(unwrap(model), options=opts)
    return {k: v.detach().to("cpu") for k, v in state.items()} if rt.is_main else None


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
                   f" for llm.trainer.train must say how many loss units each batch holds")


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


def _all_reduce(t: torch.Tensor, rt: Runtime, op=None) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


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
        counts = _all_reduce(counts.to(rt.device), rt)
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
    sums = _all_reduce(torch.stack([loss_total] + [extra_sums[k] for k in keys]), rt)
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
    vec = _all_reduce(torch.cat([total, torch.stack(extra_vec) if keys else total.new_zeros(0)]), rt).tolist()
    model.train(was_training)
    w = max(vec[1], 1.0)
    loss = vec[0] / w
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
    if bytes_per_token:
        out["val_bpb"] = loss / math.log(2) / bytes_per_token
    out.update({f"val_{k}": v / w for k, v in zip(keys, vec[2:])})
    return out


def _seed_step(rt: Runtime, seed: int) -> None:
    """Seed the global RNG that dropout draws from, for this device only.

    (torch.manual_seed would also queue lazy seeding for CUDA/XPU/MTIA, capturing a stack
    trace each time: ~1 ms per step on a CPU-only machine.)
    """
    torch.default_generator.manual_seed(seed)
    if rt.device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device; CUDA is initialised by now


# ---------------------------------------------------------------------------
# Signals

class StopFlag:
    """SIGTERM/SIGINT set a flag that the loop checks between steps; a second signal aborts."""

    def __init__(self):
        self.signum = 0
        self._old: dict[int, Any] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum:  # second signal: stop now
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborting without a checkpoint")
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------
# The loop

@dataclass
class TrainResult:
    step: int                          # optimizer steps done
    metrics: dict[str, Any]            # final numbers (see train())
    train_history: list[dict] = field(default_factory=list)  # one row per optimizer step
    val_history: list[dict] = field(default_factory=list)    # one row per evaluation
    resumed_from: int | None = None    # step of the checkpoint resumed, if any


def train(model: nn.Module, cfg: TrainConfig, rt: Runtime, *, stage: str, seed: int,
          batches: BatchSource, loss_fn: LossFn = lm_loss, val_batches: Sequence[Batch] | None = None,
          run_dir: str | Path, fingerprint: str, tsv_path: str | Path | None = None,
          png_path: str | Path | None = None, tb_dir: str | Path | None = None,
          bytes_per_token: float | None = None, distributed: str = "ddp",
          find_unused_parameters: bool = False, progress: bool = True) -> TrainResult:
    """Train `model` for cfg.max_steps optimizer steps, resuming from `run_dir` if it can.

    model: on any device; moved to rt.device. Pass the unwrapped module; `loss_fn`
    receives the wrapped one (DDP/FSDP/compiled): call it (forward) rather than other
    methods so gradient sync works, and use `unwrap(model)` for anything else.
    seed: derive it from (common.seed, stage); dropout and nothing else uses the global RNG.
    run_dir: checkpoints (ckpt-<step>/), resumed from when their fingerprint matches.
    Returns a TrainResult; metrics has train_loss (mean of the last log_every steps),
    val_loss / val_ppl / val_bpb / val_<extra> (last evaluation), tokens_seen,
    tokens_per_s, mfu (None where the device peak is unknown), nonfinite_skips,
    amp_overflows, train_time_s, and mem_*_gb on CUDA.
    """
    run_dir = Path(run_dir)
    say = (lambda m: print(m, flush=True)) if rt.is_main else (lambda m: None)
    raw = model.to(rt.device)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(raw)
    wrapped = wrap_model(raw, rt, distributed, find_unused_parameters)
    ddp = wrapped if isinstance(wrapped, nn.parallel.DistributedDataParallel) else None
    fsdp = rt.distributed and distributed == "fsdp"
    optimizer = build_optimizer(raw, cfg, rt.device)
    scaler = torch.amp.GradScaler(rt.device.type) if rt.dtype == torch.float16 else None
    if cfg.compile:
        wrapped = torch.compile(wrapped)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    sd_opts = StateDictOptions(full_state_dict=True, cpu_offload=fsdp)

    # --- resume -------------------------------------------------------------------------
    step, skips, overflows, tokens_seen, train_time, elapsed0 = 0, 0, 0, 0, 0.0, 0.0
    resumed_from: int | None = None
    saved = -1  # step of the last checkpoint written by this session
    train_hist: list[dict] = []
    val_hist: list[dict] = []
    ck, stale = find_resume(run_dir, fingerprint, warn=say)
    if ck is not None:
        set_model_state_dict(raw, ck.model_state, options=StateDictOptions(full_state_dict=True, strict=True))
        set_optimizer_state_dict(raw, optimizer, ck.train_state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        ts = ck.train_state
        if scaler is not None and ts.get("scaler"):
            scaler.load_state_dict(ts["scaler"])
        batches.load_state_dict(ts["batches"])
        step, skips, overflows = ts["step"], ts["nonfinite_skips"], ts["amp_overflows"]
        tokens_seen, train_time, elapsed0 = ts["tokens_seen"], ts["train_time_s"], ts.get("elapsed_s", 0.0)
        train_hist, val_hist = list(ts["train_history"]), list(ts["val_history"])
        resumed_from = ck.step
        say(f"{stage}: resumed from {ck.path} (step {step})")
        ck = None  # free the loaded tensors
    if rt.distributed:
        dist.barrier()  # every rank has read run_dir before rank 0 moves anything in it
    if stale and rt.is_main:
        dest = quarantine_stale(run_dir, stale)
        say(f"{stage}: {'' if resumed_from is not None else 'fresh start: '}{len(stale)} checkpoint(s) in"
            f" {run_dir} come from a run with different params or inputs (fingerprint differs); never"
            f" resumed, moved to {dest}")
    if rt.distributed:
        dist.barrier()

    flops_tok = raw.flops_per_token() if hasattr(raw, "flops_per_token") else None
    peak = peak_flops(rt.device, rt.dtype)
    mon = Monitor(stage, max_steps=cfg.max_steps, start_step=step, enabled=rt.is_main, tsv_path=tsv_path,
                  png_path=png_path, tb_dir=tb_dir, progress=progress, train_history=train_hist,
                  val_history=val_hist)
    params = [p for p in raw.parameters() if p.requires_grad]

    def checkpoint(at: int) -> Path | None:
        # every rank joins (FSDP gathers shards); rank 0 writes
        model_state = get_model_state_dict(raw, options=sd_opts)
        optim_state = get_optimizer_state_dict(raw, optimizer, options=sd_opts)
        path = None
        if rt.is_main:
            state = {"step": at, "optimizer": optim_state, "batches": batches.state_dict(),
                     "scaler": scaler.state_dict() if scaler is not None else None,
                     "nonfinite_skips": skips, "amp_overflows": overflows, "tokens_seen": tokens_seen,
                     "train_time_s": train_time, "elapsed_s": elapsed0 + time.perf_counter() - t_start,
                     "train_history": train_hist, "val_history": val_hist,
                     "schedule": {"lr": cfg.lr, "min_lr": cfg.min_lr, "warmup_steps": cfg.warmup_steps,
                                  "max_steps": cfg.max_steps},
                     "seed": seed, "world_size": rt.world_size}
            path = save_checkpoint(run_dir, at, model_state=model_state, train_state=state,
                                   fingerprint=fingerprint, keep=cfg.keep_checkpoints)
        if rt.distributed:
            dist.barrier()
        nonlocal saved
        saved = at
        return path

    def run_eval(at: int) -> None:
        if not val_batches:
            return
        row = {"step": at, **evaluate(wrapped, val_batches, loss_fn, rt, bytes_per_token)}
        val_hist.append(row)
        mon.log_eval(row)

    def sync_ctx(last: bool):
        """Gradient all-reduce only on the last micro-batch of a step."""
        if fsdp:
            raw.set_requires_gradient_sync(last)
        if ddp is not None and not last:
            return ddp.no_sync()
        return contextlib.nullcontext()

    wrapped.train()
    checked_weights = False
    t_start = time.perf_counter()  # elapsed_s: loop wall time (evals, checkpoints included), over sessions
    try:
        with StopFlag() as stop:
            if step == 0 and val_batches and not val_hist:
                run_eval(0)  # the untrained baseline
            while step < cfg.max_steps:
                # --- stop requested? (all ranks agree, or collectives would hang) -----------
                signum = stop.signum
                if rt.distributed:
                    flag = torch.tensor([signum], device=rt.device)
                    signum = int(_all_reduce(flag, rt, dist.ReduceOp.MAX).item())
                if signum:
                    path = checkpoint_path(run_dir, step) if saved == step else checkpoint(step)
                    mon.print(f"{stage}: {signal.Signals(signum).name} at step {step}: checkpoint {path}; exiting")
                    raise SystemExit(128 + signum)

                t0 = time.perf_counter()
                _seed_step(rt, derive_seed(seed, "dropout", rt.rank, step))
                lr = lr_for(step, cfg)
                set_lr(optimizer, lr)
                micro = [batches.next_batch() for _ in range(cfg.grad_accum)]
                stats, ekeys = accumulate_gradients(wrapped, micro, loss_fn, rt, scaler=scaler,
                                                    sync=sync_ctx, check_weights=not checked_weights)
                checked_weights = True
                if scaler is not None:
                    scaler.unscale_(optimizer)
                gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
                if hasattr(gnorm, "full_tensor"):  # FSDP2: a DTensor
                    gnorm = gnorm.full_tensor()
                # the step's one host sync
                loss_v, w_global, tok_global, *extra_v, gnorm_v = torch.cat(
                    [stats, gnorm.detach().double().reshape(1).to(stats.device)]).tolist()

                # --- non-finite policy, before anything changes ------------------------
                if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
                    if scaler is not None and math.isfinite(loss_v) and scaler.get_scale() > 1.0:
                        # fp16 overflow: the scaler skips the update and halves the scale; not a
                        # policy skip. Once the scale is down to 1 the gradients are really non-finite.
                        scaler.step(optimizer)
                        scaler.update()
                        optimizer.zero_grad(set_to_none=True)
                        overflows += 1
                        continue
                    what = (f"{stage}: step {step + 1}: non-finite "
                            f"{'loss' if not math.isfinite(loss_v) else 'gradient norm'}"
                            f" (loss={loss_v}, grad_norm={gnorm_v})")
                    if cfg.nonfinite_policy == "raise":
                        raise NonFiniteError(what + f"; no update was applied. Set {stage}.nonfinite_policy:"
                                             f" skip to skip such steps, or lower {stage}.lr")
                    optimizer.zero_grad(set_to_none=True)
                    if scaler is not None:
                        scaler.update()
                    skips += 1
                    mon.print(what + f"; update skipped ({skips}/{cfg.nonfinite_budget} of the budget)")
                    if skips > cfg.nonfinite_budget:
                        raise NonFiniteError(f"{stage}: {skips} non-finite steps, above"
                                             f" {stage}.nonfinite_budget={cfg.nonfinite_budget}; last: {what}")
                    continue

                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                dt = time.perf_counter() - t0
                train_time += dt
                tokens_seen += int(tok_global)
                row = {"step": step, "loss": loss_v, "lr": lr, "grad_norm": gnorm_v,
                       "weight": w_global,  # loss units (target tokens, pairs) in the step, all ranks
                       "tokens_per_s": tok_global / dt, "tokens_seen": tokens_seen,
                       "elapsed_s": elapsed0 + time.perf_counter() - t_start}
                if flops_tok and peak:
                    row["mfu"] = flops_tok * tok_global / dt / (peak * rt.world_size)
                row.update(dict(zip(ekeys, extra_v)))
                row.update(cuda_memory(rt.device))  # host-side counters: no sync
                show = step % cfg.log_every == 0 or step == cfg.max_steps
                train_hist.append(row)
                mon.step(row, show)
                if step % cfg.eval_every == 0 or step == cfg.max_steps:
                    run_eval(step)
                if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
                    checkpoint(step)
    finally:
        mon.close(train_hist, val_hist)

    recent = [r["loss"] for r in train_hist[-cfg.log_every:]]
    metrics: dict[str, Any] = {
        "train_loss": sum(recent) / len(recent) if recent else None,
        **({k: v for k, v in val_hist[-1].items() if k != "step"} if val_hist else {}),
        "steps": step, "tokens_seen": tokens_seen,
        "tokens_per_s": tokens_seen / train_time if train_time else None,
        "mfu": (flops_tok * tokens_seen / train_time / (peak * rt.world_size)
                if (flops_tok and peak and train_time) else None),
        "nonfinite_skips": skips, "amp_overflows": overflows, "train_time_s": train_time,
        "world_size": rt.world_size, "device": str(rt.device), "dtype": str(rt.dtype).replace("torch.", ""),
        **cuda_memory(rt.device),
    }
    return TrainResult(step=step, metrics=metrics, train_history=train_hist, val_history=val_hist,
                       resumed_from=resumed_from)


# ---------------------------------------------------------------------------
# A stage's main()

# What a user or an input file can cause; anything else is a bug and keeps its traceback.
STAGE_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError, ValueError, FileNotFoundError,
                                             CheckpointError, NonFiniteError)


def _stage_error(stage: str, e: Exception) -> int:
    msg = str(e)  # some messages (llm.rl's quality gates) already start with the stage's name
    print(msg if msg.startswith(f"{stage}: ") else f"{stage}: {msg}", file=sys.stderr)
    return 1


def stage_main(stage: str, doc: str, argv: list[str] | None, *, load: Callable[[str], dict],
               work: Callable[[argparse.Namespace, Any, Any, Runtime], str | None], torchrun: bool = False,
               errors: tuple[type[Exception], ...] = (),
               options: Callable[[argparse.ArgumentParser], object] | None = None) -> int:
    """`python -m stages.<stage> [--params params.yaml]`: the whole main() of a stage; returns the exit status.

    doc       the stage's docstring: its first paragraph is --help's description, all of it the epilog
    load      load(params_path) -> {"common": CommonConfig, stage: <its config>}; the stage's own
              `load_sections([...])` call, so the sections it reads are visible in its file
    work      work(args, common, cfg, rt) -> the summary line to print, or None (ranks > 0)
    torchrun  with common.nproc > 1, re-exec under `torchrun --standalone` (the trainer's stages);
              without, say that the stage runs in one process
    errors    exceptions besides STAGE_ERRORS that end the stage with a message (quality gates)
    options   options(parser) adds the stage's own command-line options

    A ConfigError from `load`, or STAGE_ERRORS + `errors` from `work`, prints "<stage>: <message>"
    on stderr and returns 1. The process group is torn down whatever happens.
    """
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    ap.add_argument("--params", default="params.yaml")
    if options is not None:
        options(ap)
    args = ap.parse_args(argv)
    try:
        sections = load(args.params)
    except ConfigError as e:
        return _stage_error(stage, e)
    common, cfg = sections["common"], sections[stage]
    if common.nproc > 1 and not torchrun:
        print(f"{stage}: runs in one process (common.nproc={common.nproc} applies to the pretrain/SFT/RM/DPO"
              f" trainer)", flush=True)
    elif common.nproc > 1 and not under_torchrun():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={common.nproc}",
               "-m", f"stages.{stage}", *argv]
        print(f"{stage}: common.nproc={common.nproc}: re-running under torchrun: {' '.join(cmd[1:])}", flush=True)
        os.execv(sys.executable, cmd)  # does not return
    rt = setup_runtime(common)
    try:
        summary = work(args, common, cfg, rt)
    except (*STAGE_ERRORS, *errors) as e:
        return _stage_error(stage, e)
    finally:
        teardown_runtime()
    if summary is not None:
        print(summary)
    return 0
