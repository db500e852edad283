"""The run skeleton of every training stage: one loop for pretrain, SFT, the reward model, DPO, PPO and GRPO.

    updater = Updater(model, cfg, rt, stage="sft")
    result = run_loop(body, updater, cfg, rt, stage="sft", model=model, run_dir=Path("runs/sft"),
                      fingerprint=fp, evaluate=lambda step: {...}, plots=Plots(...))

A stage brings a *step body*: an object whose `step(step, updater)` does one training step's
work (forward, backward, one or more `updater.apply`) and returns the step's row of numbers,
or None when no update happened (a skipped non-finite step: the step is then retried). Its
`state_dict()` / `load_state_dict()` hold what it needs to resume (a batch sampler's cursor,
the KL controller). The supervised body lives in llm/train/trainer.py; PPO and GRPO (llm/post/ppo.py,
llm/post/grpo.py) are bodies too. Everything else is here, written once:

- resume: the newest checkpoint in `run_dir` that verifies and whose fingerprint (params +
  input hashes) matches is loaded (model, optimizer, step, the body's state, histories); the
  others are moved aside (llm/train/checkpoint.py), never resumed;
- checkpoints every `checkpoint_every` steps and at the last one, and on SIGTERM/SIGINT: the
  current step finishes, a checkpoint is written and the process exits with 128 + signal
  (a second signal aborts at once);
- evaluation before the first step and every `eval_every` steps (`evaluate(step)`);
- an early end (`stop_early`): a body that can tell the run is going nowhere (GRPO with no
  informative group for a while) ends it after a step; the stage's gates then fail it through
  llm/train/finish.py like every other gate, so its numbers land in failed_metrics.json;
- progress and monitoring (llm/train/monitor.py): a bar, TensorBoard (under `<tb_dir>/<the
  fingerprint's first 12 hex digits>`: one run per params and inputs), per-step TSV curves and
  a PNG (the stages keep them in the run directory and publish them to metrics/plots once the
  run has passed its gates, so a failed run never replaces the curves of the last good one);
- the optimizer step (`Updater`): the learning-rate schedule (linear warmup, then cosine to
  `min_lr`; `min_lr == lr` keeps it constant), gradient clipping at `grad_clip`, fp16 loss
  scaling, and the non-finite policy, checked on the loss and the gradient norm before
  `optimizer.step()`: `raise` stops naming the step; `skip` drops the update (no parameter,
  moment or schedule step changes) and counts it against `nonfinite_budget`.

Under torchrun every rank runs the loop; rank 0 alone writes files, and ranks agree on
stopping (a signal on any rank stops all of them at the same step).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from llm.config import LoopConfig
from llm.errors import CheckpointError, NonFiniteError
from llm.nn.optim import build_optimizers, lr_for, set_lr
from llm.runtime import Runtime, all_gather_object, all_reduce, barrier
from llm.threads import auto_tuner, check_counts, stage_candidates, usable_cpus
from llm.train.checkpoint import checkpoint_path, find_resume, quarantine_stale, save_checkpoint
from llm.train.monitor import Monitor, Plots


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
# The optimizer step

APPLIED, SKIPPED, OVERFLOW = "applied", "skipped", "overflow"


class Updater:
    """The optimizers over the model's trainable parameters (AdamW, or Muon and AdamW: cfg.optimizer),
    the schedule, clipping and the non-finite policy.

    After a backward (`backward(loss)` scales it for fp16), `apply(stats)` unscales, clips at
    cfg.grad_clip, reads `stats` (a 1-D tensor whose first entry is the loss) and the gradient
    norm in one host sync, then steps or, if either is non-finite, applies the policy. Returns
    (outcome, stats as floats, grad norm before clipping); outcome is APPLIED, SKIPPED (the
    policy dropped the update) or OVERFLOW (an fp16 overflow: the scaler halves its scale and
    the update is dropped, which is not the policy's business).
    """

    def __init__(self, model: nn.Module, cfg: LoopConfig, rt: Runtime, *, stage: str,
                 say: Callable[[str], None] = lambda m: print(m, flush=True), sum_gradients: bool = False):
        self.cfg, self.stage, self.say, self.rt = cfg, stage, say, rt
        self.sum_gradients = sum_gradients and rt.distributed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizers = build_optimizers(model, cfg, rt.device, key=stage)
        self.scaler = torch.amp.GradScaler(rt.device.type) if rt.dtype == torch.float16 else None
        self.skips = 0      # updates dropped by the non-finite policy
        self.overflows = 0  # fp16 overflows (the scaler's business)
        self.step = 0       # the step being run, for messages

    def set_step(self, step: int) -> float:
        """Set and return the learning rate of step `step` (0-based)."""
        self.step = step
        lr = lr_for(step, self.cfg)
        set_lr(self.optimizers, lr)
        return lr

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def apply(self, stats: torch.Tensor) -> tuple[str, list[float], float]:
        if self.sum_gradients:
            stats = self._sum_over_ranks(stats)
        if self.scaler is not None:
            for opt in self.optimizers:
                self.scaler.unscale_(opt)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        if hasattr(gnorm, "full_tensor"):  # FSDP2: a DTensor
            gnorm = gnorm.full_tensor()
        # the update's one host sync
        *values, gnorm_v = torch.cat([stats.detach().double().reshape(-1),
                                      gnorm.detach().double().reshape(1).to(stats.device)]).tolist()
        loss_v = values[0]
        if math.isfinite(loss_v) and math.isfinite(gnorm_v):
            for opt in self.optimizers:
                if self.scaler is not None:
                    self.scaler.step(opt)
                else:
                    opt.step()
            if self.scaler is not None:
                self.scaler.update()
            self.zero_grad()
            return APPLIED, values, gnorm_v
        if self.scaler is not None and math.isfinite(loss_v) and self.scaler.get_scale() > 1.0:
            # fp16 overflow: the scaler skips the update and halves the scale. Once the scale is
            # down to 1 the gradients are really non-finite, and the policy below decides.
            for opt in self.optimizers:
                self.scaler.step(opt)
            self.scaler.update()
            self.zero_grad()
            self.overflows += 1
            return OVERFLOW, values, gnorm_v
        self.zero_grad()
        if self.scaler is not None:
            self.scaler.update()
        stage = self.stage
        what = (f"{stage}: step {self.step + 1}: non-finite {'loss' if not math.isfinite(loss_v) else 'gradient norm'}"
                f" (loss={loss_v}, grad_norm={gnorm_v})")
        if self.cfg.nonfinite_policy == "raise":
            raise NonFiniteError(what + f"; no update was applied. Set {stage}.nonfinite_policy: skip to skip such"
                                 f" updates, or lower {stage}.lr")
        self.skips += 1
        if self.skips > self.cfg.nonfinite_budget:
            raise NonFiniteError(f"{stage}: {self.skips} non-finite updates, above {stage}.nonfinite_budget="
                                 f"{self.cfg.nonfinite_budget}; last: {what}")
        self.say(what + f"; update skipped ({self.skips}/{self.cfg.nonfinite_budget} of the budget)")
        return SKIPPED, values, gnorm_v

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _sum_over_ranks(self, stats: torch.Tensor) -> torch.Tensor:
        """Sum every rank's gradients and `stats` in one all-reduce (a parameter this rank's loss
        did not reach counts as zero); returns the summed stats. For a model trained without
        DDP's hooks (the RL policy runs `hidden_states` and its heads, not `forward`): each rank's
        loss is its rows' share of the global loss (its numerator over the global denominator),
        so the sum is the gradient of the global loss, whatever the number of ranks."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [stats.detach().reshape(-1).to(grads[0].dtype)])
        all_reduce(flat, self.rt)
        offset = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
        return flat[offset:].to(stats.dtype)

    def minimize(self, loss: torch.Tensor) -> tuple[bool, float]:
        """backward(loss), then apply: one optimizer step on one loss (the RL minibatch update).
        Returns (whether the update was applied, the gradient norm before clipping). With
        sum_gradients, `loss` is this rank's share: every rank calls this once per update."""
        self.backward(loss)
        outcome, _, gnorm = self.apply(loss.reshape(1))
        return outcome == APPLIED, gnorm

    def state_dict(self) -> dict:
        return {"nonfinite_skips": self.skips, "amp_overflows": self.overflows,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.skips, self.overflows = state["nonfinite_skips"], state["amp_overflows"]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


# ---------------------------------------------------------------------------
# The loop

class StepBody(Protocol):
    """A stage's step body (the module docstring): the supervised one (llm/train/trainer.py), PPO and GRPO.

    `model` is the module its steps run (PPO's policy with its value head; the supervised body's
    may be wrapped by DDP or FSDP). The loop reads only the three methods and checkpoints the
    unwrapped module it is given as `run_loop(model=...)`; `model` is for the stage around it
    (llm/post/rl.py trains and writes the RL bodies' `model`)."""
    model: nn.Module

    def step(self, step: int, updater: Updater) -> dict[str, Any] | None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class LoopResult:
    step: int                                              # steps done
    history: list[dict] = field(default_factory=list)      # one row per step
    val_history: list[dict] = field(default_factory=list)  # one row per evaluation
    resumed_from: int | None = None                        # step of the checkpoint resumed, if any
    nonfinite_skips: int = 0
    amp_overflows: int = 0
    train_time_s: float = 0.0                              # in steps that counted
    eval_time_s: float = 0.0
    threads_steps: dict[str, int] = field(default_factory=dict)  # {"<torch threads>": steps run}, this session
    threads_probe: dict | None = None  # under auto: the thread counts checked and kept (check_thread_counts)


def run_loop(body: StepBody, updater: Updater, cfg: LoopConfig, rt: Runtime, *, stage: str, model: nn.Module,
             run_dir: str | Path, fingerprint: str, evaluate: Callable[[int], dict] | None = None,
             plots: Plots | None = None, log_every: int = 1, progress: bool = True,
             step_context: Callable[[], Any] = contextlib.nullcontext,
             stop_early: Callable[[], bool] | None = None) -> LoopResult:
    """Run cfg.max_steps steps of `body`, resuming from `run_dir` when a checkpoint of this fingerprint is there.

    model: the unwrapped module whose state is checkpointed (FSDP2 shards are gathered).
    evaluate(step) -> {name: float}: held-out numbers, before the first step, every
    cfg.eval_every steps and after the last one. plots: where the curves go (llm/train/monitor.py).
    log_every: progress bar and TensorBoard every this many steps (the TSV gets every step).
    step_context: a context around each step (the RL stages run theirs under autocast).
    stop_early() -> bool: asked after each step; True ends the run there (no evaluation or
    checkpoint beyond those already due), and the result's `step` is below cfg.max_steps. Every
    rank must get the same answer (read numbers the ranks share), or the collectives hang.

    One function on purpose, longer than most here: resume, the periodic and on-signal
    checkpoints and the step loop share the same few counters (step, times, histories), which
    the nested `checkpoint` and `run_eval` update in place; in one piece, what a checkpoint
    holds and what a resume restores read side by side.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    run_dir = Path(run_dir)
    say = (lambda m: print(m, flush=True)) if rt.is_main else (lambda m: None)
    optimizers = updater.optimizers  # one state dict for all of them, keyed by parameter name
    sd_opts = StateDictOptions(full_state_dict=True, cpu_offload=rt.distributed)

    # --- resume -------------------------------------------------------------------------
    step, train_time, eval_time, elapsed0 = 0, 0.0, 0.0, 0.0
    resumed_from: int | None = None
    hist: list[dict] = []
    val_hist: list[dict] = []
    ck, stale = find_resume(run_dir, fingerprint, warn=say)
    if rt.distributed:  # every rank must resume the same checkpoint, or the collectives below diverge
        seen = all_gather_object(ck.step if ck is not None else None, rt)
        if len(set(seen)) > 1:
            raise CheckpointError(f"{stage}: the processes see different checkpoints in {run_dir} (step per rank:"
                                  f" {seen}); every machine must see the same run directory: put the repository"
                                  f" on a filesystem that all of them share")
    if ck is not None:
        set_model_state_dict(model, ck.model_state, options=StateDictOptions(full_state_dict=True, strict=True))
        ts = ck.train_state
        set_optimizer_state_dict(model, optimizers, ts["optimizer"], options=StateDictOptions(full_state_dict=True))
        updater.load_state_dict(ts["updater"])
        body.load_state_dict(ts["body"])
        step, train_time, eval_time, elapsed0 = ts["step"], ts["train_time_s"], ts["eval_time_s"], ts["elapsed_s"]
        hist, val_hist = list(ts["history"]), list(ts["val_history"])
        resumed_from = ck.step
        was = ts.get("world_size", 1)
        say(f"{stage}: resumed from {ck.path} (step {step})"
            + (f"; written by {was} process(es), continuing on {rt.world_size} from the same global sample"
               if was != rt.world_size else ""))
        ck = None  # free the loaded tensors
    barrier(rt)  # every rank has read run_dir before rank 0 moves anything in it
    if stale and rt.is_main:
        dest = quarantine_stale(run_dir, stale)
        say(f"{stage}: {'' if resumed_from is not None else 'fresh start: '}{len(stale)} checkpoint(s) in"
            f" {run_dir} come from a run with different params or inputs (fingerprint differs); never"
            f" resumed, moved to {dest}")
    barrier(rt)

    if plots is not None and plots.tb_dir is not None:
        # one TensorBoard run per fingerprint (the params fingerprint in the model's meta.json), so
        # experiments with other params never write into each other's events
        plots = replace(plots, tb_dir=Path(plots.tb_dir) / fingerprint[:12])
        say(f"{stage}: TensorBoard events in {plots.tb_dir}")
    # common.num_threads: auto: pretrain's steps move between the thread counts that give its step
    # one thread's bits on this machine (checked here, before the first step), measuring which is
    # fastest; evaluation and every other stage stay on one thread (llm/threads.py). A fixed count
    # stays as set.
    tuner, threads_probe = None, None
    if rt.auto_threads and rt.device.type == "cpu":
        candidates = stage_candidates(stage, usable_cpus())
        if rt.distributed:  # every rank must run the same check steps, or their collectives hang
            candidates = sorted(set.intersection(*map(set, all_gather_object(candidates, rt))))
        if len(candidates) > 1 and step < cfg.max_steps:
            threads_probe = check_thread_counts(candidates, body, updater, model, rt, step=step,
                                                step_context=step_context)
            candidates = threads_probe["kept"]
            say(f"threads: {stage}: {threads_probe['kept']} of {threads_probe['checked']} threads train one thread's"
                f" bits on this CPU ({threads_probe['cpu']}; one step each, {threads_probe['seconds']:.1f} s)")
        tuner = auto_tuner(stage, say, candidates)
    threads_steps: dict[str, int] = {}
    mon = Monitor(stage, max_steps=cfg.max_steps, start_step=step, enabled=rt.is_main, plots=plots,
                  progress=progress, train_history=hist, val_history=val_hist)
    saved = -1  # step of the last checkpoint written by this session
    t_start = time.perf_counter()  # elapsed_s: loop wall time (evals, checkpoints included), over sessions

    def checkpoint(at: int) -> Path | None:
        nonlocal saved
        # every rank joins (FSDP gathers shards); rank 0 writes
        model_state = get_model_state_dict(model, options=sd_opts)
        optim_state = get_optimizer_state_dict(model, optimizers, options=sd_opts)
        path = None
        if rt.is_main:
            state = {"step": at, "optimizer": optim_state, "updater": updater.state_dict(), "body": body.state_dict(),
                     "train_time_s": train_time, "eval_time_s": eval_time,
                     "elapsed_s": elapsed0 + time.perf_counter() - t_start,
                     "history": hist, "val_history": val_hist, "world_size": rt.world_size}
            path = save_checkpoint(run_dir, at, model_state=model_state, train_state=state,
                                   fingerprint=fingerprint, keep=cfg.keep_checkpoints)
        barrier(rt)
        saved = at
        return path

    def run_eval(at: int) -> None:
        nonlocal eval_time
        if evaluate is None:
            return
        if tuner is not None:
            tuner.release()  # evaluations run on one thread under auto: their numbers never depend on the load
        t0 = time.perf_counter()
        row = {"step": at, **evaluate(at)}
        eval_time += time.perf_counter() - t0
        val_hist.append(row)
        mon.log_eval(row)

    try:
        with StopFlag() as stop:
            if not val_hist:
                run_eval(step)  # the starting model
            while step < cfg.max_steps:
                # --- stop requested? (all ranks agree, or collectives would hang) -----------
                signum = stop.signum
                if rt.distributed:
                    signum = int(all_reduce(torch.tensor([signum], device=rt.device), rt, dist.ReduceOp.MAX).item())
                if signum:
                    path = checkpoint_path(run_dir, step) if saved == step else checkpoint(step)
                    mon.print(f"{stage}: {signal.Signals(signum).name} at step {step}: checkpoint {path}; exiting")
                    raise SystemExit(128 + signum)

                n_threads = tuner.before_step() if tuner is not None else torch.get_num_threads()
                t0 = time.perf_counter()
                lr = updater.set_step(step)
                with step_context():
                    row = body.step(step, updater)
                dt = time.perf_counter() - t0
                if tuner is not None:
                    tuner.after_step(dt)
                threads_steps[str(n_threads)] = threads_steps.get(str(n_threads), 0) + 1
                if row is None:  # no update happened (non-finite, skipped): the same step again
                    continue
                step += 1
                train_time += dt
                row = {"step": step, **row, "lr": lr, "step_s": dt, "num_threads": n_threads,
                       "elapsed_s": elapsed0 + time.perf_counter() - t_start}
                hist.append(row)
                mon.step(row, show=step % log_every == 0 or step == cfg.max_steps)
                if stop_early is not None and stop_early():
                    mon.print(f"{stage}: stopped early at step {step}")
                    break
                if step % cfg.eval_every == 0 or step == cfg.max_steps:
                    run_eval(step)
                if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
                    checkpoint(step)
    finally:
        mon.close(hist, val_hist)
        if tuner is not None:
            tuner.release()
    return LoopResult(step=step, history=hist, val_history=val_hist, resumed_from=resumed_from,
                      nonfinite_skips=updater.skips, amp_overflows=updater.overflows, train_time_s=train_time,
                      eval_time_s=eval_time, threads_probe=threads_probe,
                      threads_steps=dict(sorted(threads_steps.items(), key=lambda kv: int(kv[0]))))


def check_thread_counts(candidates: list[int], body: StepBody, updater: Updater, model: nn.Module, rt: Runtime, *,
                        step: int, step_context: Callable[[], Any] = contextlib.nullcontext) -> dict:
    """Which of `candidates` give step `step` of `body` one thread's bits here (llm/threads.py
    check_counts): the step runs once at each count from the same saved state (the model, the
    optimizers, the updater, the body's state and the global RNG), which is restored after each,
    so the run goes on exactly as if nothing had run. The bits compared are the model's state and
    the optimizers' (Adam's moments and Muon's momentum hold the gradient's bits). Under torchrun
    every rank keeps only the counts that every rank kept."""
    optimizers = updater.optimizers
    saved = copy.deepcopy({"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                           "updater": updater.state_dict(), "body": body.state_dict()})
    rng = torch.get_rng_state()

    def step_state(n: int) -> bytes | None:
        try:
            updater.set_step(step)
            with step_context():
                row = body.step(step, updater)
            trained = list(model.state_dict().values()) + [
                t for o in optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            return None if row is None else state_digest(trained)
        finally:
            model.load_state_dict(saved["model"])
            for o, state in zip(optimizers, saved["optimizers"]):
                o.load_state_dict(copy.deepcopy(state))
            updater.load_state_dict(copy.deepcopy(saved["updater"]))
            body.load_state_dict(copy.deepcopy(saved["body"]))
            torch.set_rng_state(rng)

    probe = check_counts(candidates, step_state)
    if rt.distributed:
        probe["kept"] = sorted(set.intersection(*map(set, all_gather_object(probe["kept"], rt))))
    return probe


def state_digest(tensors) -> bytes:
    """sha256 of the raw bytes of `tensors`, in order: equal digests mean bit-identical tensors
    (unlike ==, which calls 0.0 and -0.0 equal). A sharded tensor (FSDP2) counts by its local shard."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def seed_step(rt: Runtime, seed: int) -> None:
    """Seed the global RNG that dropout draws from, for this device only.

    (torch.manual_seed would also queue lazy seeding for CUDA/XPU/MTIA, capturing a stack
    trace each time: ~1 ms per step on a CPU-only machine.)
    """
    torch.default_generator.manual_seed(seed)
    if rt.device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device; CUDA is initialised by now
