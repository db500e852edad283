"""What PPO and GRPO share: the outer RL loop, the update step, checkpoints, KL control, gates, rewards.

    algo = PPO(...) or GRPO(...)          # llm/ppo.py, llm/grpo.py: one RL step each
    result = run_rl(algo, cfg, rt, stage="grpo", run_dir=Path("runs/grpo"), fingerprint=fp,
                    eval_fn=lambda model: heldout_eval(model, ref, ...), tsv_path=..., tb_dir=...)

An RL step (one rollout batch) is the algorithm's business: sample, score, update. Around
it `run_rl` does what every training stage does, reusing the
trainer's pieces rather than copying them:

- optimizer: `llm.optim.build_optimizer` with the RL section's lr / weight_decay / betas;
  lr warms up linearly over `warmup_steps` RL steps, then stays at `lr` (`llm.optim.lr_at`
  with min_lr = lr);
- `Updater.apply(loss)`: backward, global grad-norm clip (`max_grad_norm`), then the
  non-finite policy on the loss and the grad norm *before* `optimizer.step()`: `raise`
  names the step; `skip` drops the update (no parameter or moment changes) and counts it
  against `nonfinite_budget`;
- checkpoints (`llm.checkpoint`): policy weights (with a value head), AdamW moments, the
  algorithm's state (KL coefficient, gate counters), histories; fingerprinted with params +
  input hashes, so a killed run resumes and a stale one never does. Sampling randomness is
  counter-based (a torch.Generator seeded from (seed, stage, what, step)), so a resumed run
  repeats the uninterrupted one exactly on the CPU;
- SIGTERM/SIGINT finish the current step, write a checkpoint and exit 128 + signal;
- per-step rows with TRL's metric names to `metrics/plots/<stage>.tsv`, held-out rows to
  `<stage>_val.tsv`, TensorBoard (llm.monitor.Monitor), and a PNG of the curves.

Also here: `KLController` (fixed or adaptive, Ziegler et al. 2019), `KLAlert` (the
KL band), `QualityGateError`, `MathPrompts` (prompt pools by level, sampled per
step), reward functions (the verifier of llm/rewards.py or a reward model), and
`heldout_eval` (exact match via llm.evaluate.math_eval, plus KL to the reference measured
on the policy's own samples).

Definition used everywhere here: `kl` is the mean over response tokens of KL(pi || ref)
per token (TRL GRPO's `kl`); `kl_seq` is its sum over a response, averaged over responses
(TRL PPO's `objective/kl`). Held-out `kl` is exact per token (summed over the vocabulary at
each sampled state), so it has no estimator noise; training-time `kl` uses the stage's
estimator (k1 or k3) on the sampled tokens. RL runs in one process (common.nproc is for
the pretrain/SFT/RM/DPO trainer).
"""
from __future__ import annotations

import io
import math
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor, nn

from llm.artifacts import load_model_dir, save_model_dir
from llm.batching import derive_seed
from llm.chat import user_prompt
from llm.checkpoint import find_resume, quarantine_stale, save_checkpoint
from llm.config import CommonConfig, RLConfig, fingerprint
from llm.evaluate import math_eval
from llm.fileio import atomic_write_bytes, atomic_write_json, read_jsonl, sha256_file
from llm.monitor import Monitor
from llm.optim import build_optimizer, lr_at, set_lr
from llm.rewards import math_reward, parse_answer, to_number
from llm.rollout import Rollout, exact_kl, response_forward, rollout
from llm.trainer import NonFiniteError, Runtime, StopFlag

RewardFn = Callable[[Rollout, list[dict]], tuple[Tensor, dict[str, float]]]


class QualityGateError(RuntimeError):
    """The stage's output would be unusable; the message says which gate and why."""


def step_generator(seed: int, what: str, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one use at one step: nothing to save in a checkpoint."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, what, step))


# ---------------------------------------------------------------------------
# KL control and alerts

class KLController:
    """The per-token KL penalty coefficient.

    Adaptive (Ziegler et al. 2019, as TRL's AdaptiveKLController): after each rollout batch
        coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon
    with n_steps the batch's number of rollouts. Fixed: coef stays init_kl_coef.
    """

    def __init__(self, init_kl_coef: float, *, adaptive: bool, target: float, horizon: int):
        if adaptive and target <= 0:
            raise ValueError(f"adaptive KL control needs kl_target > 0, got {target}")
        self.value, self.adaptive, self.target, self.horizon = init_kl_coef, adaptive, target, horizon

    def update(self, kl: float, n_steps: int) -> None:
        if not self.adaptive:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class KLAlert:
    """Reports when KL leaves [low, high].

    The KL checked is the mean of the last `window` steps, so one noisy batch near a bound
    does not flip the state back and forth. KL starts at 0 (policy = reference), so being
    below `low` is only an alert after KL has once been inside the band; above `high` is
    always one. Each change of side is reported once. `finish()` at the end of a run reports
    a KL that never reached the band at all (the policy barely left the reference).
    """

    def __init__(self, low: float, high: float, window: int = 5):
        self.low, self.high, self.window = low, high, window
        self.recent: list[float] = []
        self.side = "start"
        self.entered = False
        self.alerts = 0

    def check(self, kl: float, step: int) -> str | None:
        self.recent = (self.recent + [kl])[-self.window:]
        kl = sum(self.recent) / len(self.recent)
        side = "low" if kl < self.low else "high" if kl > self.high else "ok"
        msg = None
        if side == "ok":
            self.entered = True
        elif side != self.side and (side == "high" or self.entered):
            self.alerts += 1
            bound = f"above kl_alert_high={self.high}" if side == "high" else f"below kl_alert_low={self.low}"
            msg = f"ALERT step {step}: kl {kl:.4f} (mean of the last {len(self.recent)} steps) is {bound}"
        self.side = side
        return msg

    def finish(self, step: int) -> str | None:
        """After the last step: an alert if KL stayed below the band for the whole run."""
        if self.entered or self.side != "low":
            return None
        self.alerts += 1
        kl = sum(self.recent) / len(self.recent)
        return (f"ALERT step {step}: kl {kl:.4f} (mean of the last {len(self.recent)} steps) stayed below"
                f" kl_alert_low={self.low} for the whole run: the policy barely moved from the reference")

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "side": self.side, "entered": self.entered, "alerts": self.alerts}

    def load_state_dict(self, state: dict) -> None:
        self.recent = [float(x) for x in state["recent"]]
        self.side, self.entered, self.alerts = state["side"], bool(state["entered"]), int(state["alerts"])


# ---------------------------------------------------------------------------
# The update step with the non-finite policy

class Updater:
    """AdamW over the policy's trainable parameters, one `apply(loss)` per minibatch."""

    def __init__(self, model: nn.Module, cfg: RLConfig, device: torch.device, stage: str):
        self.cfg, self.stage = cfg, stage
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, cfg, device)
        self.skips = 0
        self.step = 0  # RL step being run (for messages)

    def set_step(self, step: int) -> float:
        """LR for RL step `step` (0-based): linear warmup, then constant."""
        self.step = step
        lr = lr_at(step, lr=self.cfg.lr, min_lr=self.cfg.lr, warmup_steps=self.cfg.warmup_steps,
                   max_steps=self.cfg.steps)
        set_lr(self.optimizer, lr)
        return lr

    def apply(self, loss: Tensor) -> tuple[bool, float]:
        """Backward, clip, check, step. Returns (applied, grad_norm before clipping)."""
        loss.backward()
        clip = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        loss_v, gnorm_v = torch.stack([loss.detach().float(), gnorm.detach().float()]).tolist()
        if math.isfinite(loss_v) and math.isfinite(gnorm_v):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return True, gnorm_v
        self.optimizer.zero_grad(set_to_none=True)
        bad = "loss" if not math.isfinite(loss_v) else "gradient norm"
        what = f"{self.stage}: step {self.step + 1}: non-finite {bad} (loss={loss_v}, grad_norm={gnorm_v})"
        if self.cfg.nonfinite_policy == "raise":
            raise NonFiniteError(what + f"; no update was applied. Set {self.stage}.nonfinite_policy: skip to"
                                 f" skip such updates, or lower {self.stage}.lr")
        self.skips += 1
        if self.skips > self.cfg.nonfinite_budget:
            raise NonFiniteError(f"{self.stage}: {self.skips} non-finite updates, above {self.stage}.nonfinite_budget="
                                 f"{self.cfg.nonfinite_budget}; last: {what}")
        print(what + f"; update skipped ({self.skips}/{self.cfg.nonfinite_budget} of the budget)", flush=True)
        return False, gnorm_v


def minibatches(n: int, size: int, generator: torch.Generator) -> list[Tensor]:
    """A shuffled partition of range(n) into chunks of `size` (the last may be shorter)."""
    perm = torch.randperm(n, generator=generator)
    return list(perm.split(size))


class Mean:
    """Running means of named floats (minibatch statistics -> one row)."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, **values: float | Tensor) -> None:
        for k, v in values.items():
            self.sums[k] += float(v)
            self.counts[k] += 1

    def result(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


# ---------------------------------------------------------------------------
# The loop

class Algorithm(Protocol):
    model: nn.Module        # the policy being trained (checkpointed whole, incl. a value head)

    def step(self, step: int, updater: Updater) -> dict[str, float]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class RLResult:
    step: int
    history: list[dict] = field(default_factory=list)       # one row per RL step
    val_history: list[dict] = field(default_factory=list)   # one row per held-out evaluation
    resumed_from: int | None = None
    nonfinite_skips: int = 0
    train_time_s: float = 0.0
    eval_time_s: float = 0.0


def run_rl(algo: Algorithm, cfg: RLConfig, rt: Runtime, *, stage: str, run_dir: str | Path, fingerprint: str,
           eval_fn: Callable[[nn.Module], dict] | None = None, tsv_path: str | Path | None = None,
           png_path: str | Path | None = None, tb_dir: str | Path | None = None,
           progress: bool = True) -> RLResult:
    """Run cfg.steps RL steps of `algo`, resuming from `run_dir` when a checkpoint of this
    fingerprint is there. Held-out evaluation (`eval_fn(model) -> {name: float}`) runs before
    the first step (the starting model), every eval_every steps and after the last one."""
    run_dir = Path(run_dir)
    model = algo.model
    updater = Updater(model, cfg, rt.device, stage)
    step, train_time, eval_time, elapsed0 = 0, 0.0, 0.0, 0.0
    hist: list[dict] = []
    val_hist: list[dict] = []
    resumed_from = None
    ck, stale = find_resume(run_dir, fingerprint, warn=lambda m: print(m, flush=True))
    if ck is not None:
        model.load_state_dict({k: v.to(rt.device) for k, v in ck.model_state.items()}, strict=True)
        ts = ck.train_state
        updater.optimizer.load_state_dict(ts["optimizer"])
        algo.load_state_dict(ts["algorithm"])
        step, updater.skips = ts["step"], ts["nonfinite_skips"]
        train_time, eval_time, elapsed0 = ts["train_time_s"], ts["eval_time_s"], ts["elapsed_s"]
        hist, val_hist = list(ts["history"]), list(ts["val_history"])
        resumed_from = ck.step
        print(f"{stage}: resumed from {ck.path} (step {step})", flush=True)
        ck = None
    if stale:
        dest = quarantine_stale(run_dir, stale)
        print(f"{stage}: {len(stale)} checkpoint(s) in {run_dir} come from a run with different params or inputs;"
              f" never resumed, moved to {dest}", flush=True)

    mon = Monitor(stage, max_steps=cfg.steps, start_step=step, tsv_path=tsv_path, png_path=None, tb_dir=tb_dir,
                  progress=progress, train_history=hist, val_history=val_hist)
    t_start = time.perf_counter()

    def checkpoint(at: int) -> Path:
        state = {"step": at, "optimizer": updater.optimizer.state_dict(), "algorithm": algo.state_dict(),
                 "nonfinite_skips": updater.skips, "train_time_s": train_time, "eval_time_s": eval_time,
                 "elapsed_s": elapsed0 + time.perf_counter() - t_start, "history": hist, "val_history": val_hist}
        return save_checkpoint(run_dir, at, model_state={k: v.detach() for k, v in model.state_dict().items()},
                               train_state=state, fingerprint=fingerprint, keep=cfg.keep_checkpoints)

    def run_eval(at: int) -> None:
        nonlocal eval_time
        if eval_fn is None:
            return
        t0 = time.perf_counter()
        with rt.autocast():
            row = {"step": at, **eval_fn(model)}
        eval_time += time.perf_counter() - t0
        val_hist.append(row)
        mon.log_eval(row)

    model.eval()  # no dropout in RL: the ratio pi/pi_old must compare the same function (as TRL)
    saved = -1
    try:
        with StopFlag() as stop:
            if not val_hist:
                run_eval(0)
            while step < cfg.steps:
                if stop.signum:
                    path = checkpoint(step) if saved != step else run_dir / f"ckpt-{step:08d}"
                    mon.print(f"{stage}: {signal.Signals(stop.signum).name} at step {step}: checkpoint {path}; exiting")
                    raise SystemExit(128 + stop.signum)
                t0 = time.perf_counter()
                lr = updater.set_step(step)
                with rt.autocast():
                    row = algo.step(step, updater)
                dt = time.perf_counter() - t0
                step += 1
                train_time += dt
                row = {"step": step, **row, "lr": lr, "step_s": dt,
                       "elapsed_s": elapsed0 + time.perf_counter() - t_start}
                hist.append(row)
                mon.step(row, show=True)
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    run_eval(step)
                if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                    checkpoint(step)
                    saved = step
    finally:
        mon.close()
        if png_path and hist:
            write_rl_png(png_path, stage, hist, val_hist)
    return RLResult(step=step, history=hist, val_history=val_hist, resumed_from=resumed_from,
                    nonfinite_skips=updater.skips, train_time_s=train_time, eval_time_s=eval_time)


def check_final_kl(kl: float, max_kl: float, stage: str) -> None:
    """Quality gate: the policy moved too far from the reference to be trusted."""
    if not math.isfinite(kl) or kl > max_kl:
        raise QualityGateError(f"{stage}: quality gate failed: final KL to the reference {kl:.4f} is above"
                               f" {stage}.max_kl={max_kl} (mean per-token KL on held-out prompts); the policy drifted"
                               f" too far. Lower {stage}.lr, raise the KL penalty, or run fewer steps;"
                               f" no model was written")


def summarize(result: RLResult, *, window: int = 5) -> dict[str, Any]:
    """Start-vs-end numbers and the time split from a run's histories (for metrics/<stage>.json)."""
    h, v = result.history, result.val_history
    k = max(1, min(window, len(h) // 2 or 1))

    def mean(rows, key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    out: dict[str, Any] = {"steps": result.step, "reward_start": mean(h[:k], "reward"),
                           "reward_end": mean(h[-k:], "reward")}
    if out["reward_start"] is not None and out["reward_end"] is not None:
        out["reward_delta"] = out["reward_end"] - out["reward_start"]
    out["kl_train_end"] = mean(h[-k:], "kl")
    times = {key: sum(r.get(key, 0.0) for r in h) for key in ("rollout_s", "scoring_s", "update_s", "step_s")}
    out.update({f"{key}_total": t for key, t in times.items()})
    out["generation_fraction"] = times["rollout_s"] / times["step_s"] if times["step_s"] else None
    out["train_time_s"], out["eval_time_s"] = result.train_time_s, result.eval_time_s
    out["nonfinite_skips"] = result.nonfinite_skips
    if v:  # held-out rows: math_* as math_eval names them, kl and reward as heldout_kl / heldout_reward
        first, last = v[0], v[-1]
        name = {"kl": "heldout_kl", "reward": "heldout_reward"}
        for key, val in last.items():
            if key != "step":
                out[name.get(key, key)] = val
        for key in ("math_exact_match", "reward", "rm_score"):
            if key in first:
                out[f"{name.get(key, key)}_start"] = first[key]
                out[f"{name.get(key, key)}_delta"] = last[key] - first[key]
    return out


def write_rl_png(path: str | Path, stage: str, hist: list[dict], val_hist: list[dict]) -> None:
    """Reward, KL and held-out exact match against step, written atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    steps = [r["step"] for r in hist]
    axes[0].plot(steps, [r["reward"] for r in hist], lw=0.8, label="reward (rollouts)")
    if val_hist and "reward" in val_hist[0]:
        axes[0].plot([r["step"] for r in val_hist], [r["reward"] for r in val_hist], "o-", label="reward (held-out)")
    axes[0].set_ylabel("reward")
    axes[0].set_title(f"{stage}: RL curves")
    axes[1].plot(steps, [r["kl"] for r in hist], lw=0.8, color="tab:red", label="kl (train, per token)")
    if val_hist and "kl" in val_hist[0]:
        axes[1].plot([r["step"] for r in val_hist], [r["kl"] for r in val_hist], "o-", color="tab:purple",
                     label="kl (held-out, exact)")
    axes[1].set_ylabel("KL to reference")
    if val_hist and "math_exact_match" in val_hist[0]:
        axes[2].plot([r["step"] for r in val_hist], [r["math_exact_match"] for r in val_hist], "o-",
                     color="tab:green", label="held-out math exact match")
    axes[2].set_ylabel("exact match")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


# ---------------------------------------------------------------------------
# Prompts and rewards

def read_problems(path: str | Path, limit: int | None = None) -> list[dict]:
    """Math problems {"question", "answer", "level", ...} from a JSONL file (data/prepared/rl/*.jsonl)."""
    def validate(obj: Any) -> str | None:
        if not isinstance(obj.get("question"), str) or not obj["question"].strip():
            return "missing or empty 'question'"
        if not isinstance(obj.get("answer"), str) or to_number(obj["answer"]) is None:
            return f"'answer' must be a number as a string, got {obj.get('answer')!r}"
        if not isinstance(obj.get("level", 0), int):
            return f"'level' must be an int, got {obj.get('level')!r}"
        return None
    out = []
    for obj in read_jsonl(path, validate=validate):
        out.append(obj)
        if limit is not None and len(out) >= limit:
            break
    return out


class MathPrompts:
    """Math problems as chat prompts, grouped by level, sampled with replacement per step.

    Problems whose prompt leaves fewer than max_new_tokens positions in the context are
    dropped (and counted in `dropped`).
    """

    def __init__(self, problems: Sequence[dict], tokenizer, *, seq_len: int, max_new_tokens: int, where: str = ""):
        self.by_level: dict[int, list[tuple[list[int], dict]]] = defaultdict(list)
        self.dropped = 0
        for p in problems:
            ids = user_prompt(p["question"], tokenizer)
            if len(ids) + max_new_tokens > seq_len:
                self.dropped += 1
                continue
            self.by_level[int(p.get("level", 0))].append((ids, p))
        self.where = where

    def pool(self, levels: Sequence[int]) -> list[tuple[list[int], dict]]:
        out = [x for lvl in sorted(set(levels)) for x in self.by_level.get(lvl, [])]
        if not out:
            raise ValueError(f"{self.where or 'math prompts'}: no usable problem at levels {sorted(set(levels))}"
                             f" (levels present: {sorted(self.by_level)}; {self.dropped} dropped as too long)")
        return out

    def sample(self, n: int, levels: Sequence[int], generator: torch.Generator) -> tuple[list[list[int]], list[dict]]:
        pool = self.pool(levels)
        idx = torch.randint(len(pool), (n,), generator=generator).tolist()
        return [pool[i][0] for i in idx], [pool[i][1] for i in idx]


def math_stats(texts: Sequence[str], problems: Sequence[dict]) -> dict[str, float]:
    """Fraction correct and fraction in the `#### N` format (when problems carry answers)."""
    if not problems or "answer" not in problems[0]:
        return {}
    parsed = [parse_answer(t) for t in texts]
    correct = [v is not None and v == to_number(p["answer"]) for (v, _), p in zip(parsed, problems)]
    return {"accuracy": sum(correct) / len(texts), "format_rate": sum(f for _, f in parsed) / len(texts)}


def verifier_reward(tokenizer, *, correct_reward: float, format_reward: float) -> RewardFn:
    """Reward = llm.rewards.math_reward of each decoded response against its problem's answer."""
    def reward(ro: Rollout, problems: list[dict]) -> tuple[Tensor, dict[str, float]]:
        texts = [tokenizer.decode(ids) for ids in ro.response_ids()]
        r = [math_reward(t, p["answer"], correct_reward, format_reward) for t, p in zip(texts, problems)]
        return torch.tensor(r, dtype=torch.float32), math_stats(texts, problems)
    return reward


def rm_reward(rm: nn.Module, tokenizer) -> RewardFn:
    """Reward = the reward model's score of prompt + response (read at the last real token:
    the closing <|end|> of a finished response)."""
    @torch.no_grad()
    def reward(ro: Rollout, problems: list[dict]) -> tuple[Tensor, dict[str, float]]:
        r = rm.reward(ro.tokens, ro.attention_mask).float().cpu()          # (B,)
        texts = [tokenizer.decode(ids) for ids in ro.response_ids()]
        return r, math_stats(texts, problems)
    return reward


def rm_verifier_reward(rm: nn.Module, tokenizer, *, correct_reward: float, format_reward: float) -> RewardFn:
    """Reward = the reward model's score + the verifier's (ppo.reward_source: rm+verifier).

    A learned RM that checks arithmetic imperfectly can be climbed by drifting towards the
    answers it misjudges; the verifier term pays for the right final number, so the policy
    gains nothing by trading correctness for RM score. Both parts are logged (rm_score,
    verifier_reward) so a run shows whether the RM score itself rose.
    """
    ver_fn = verifier_reward(tokenizer, correct_reward=correct_reward, format_reward=format_reward)

    @torch.no_grad()
    def reward(ro: Rollout, problems: list[dict]) -> tuple[Tensor, dict[str, float]]:
        r_rm = rm.reward(ro.tokens, ro.attention_mask).float().cpu()       # (B,), as rm_reward
        r_ver, stats = ver_fn(ro, problems)                                 # decodes each response once
        return r_rm + r_ver, {**stats, "rm_score": float(r_rm.mean()), "verifier_reward": float(r_ver.mean())}
    return reward


@torch.no_grad()
def heldout_eval(policy: nn.Module, ref: nn.Module, tokenizer, problems: Sequence[dict], *, max_new_tokens: int,
                 temperature: float, seed: int, batch_size: int = 64, reward_fn: RewardFn | None = None,
                 confidence: float = 0.95) -> tuple[dict[str, float], list[dict]]:
    """Held-out numbers for one model state, and a few sample answers.

    - math exact match (greedy; llm.evaluate.math_eval) with its Wilson interval;
    - `kl`: exact per-token KL(policy || ref) at the states of the policy's own samples
      (temperature, a fixed seed: the same draws every evaluation for the same policy);
    - `reward`: mean reward_fn score of those samples (e.g. the RM), if given; with a combined
      reward (rm_verifier_reward) also its RM part alone, `rm_score`.
    """
    ev = math_eval(policy, tokenizer, problems, max_new_tokens=max_new_tokens, batch_size=batch_size,
                   confidence=confidence)
    out = {k: v for k, v in ev.items() if k != "samples" and isinstance(v, (int, float))}
    device = next(policy.parameters()).device
    g = torch.Generator(device=device).manual_seed(derive_seed(seed, "heldout"))
    stop = (tokenizer.end_id, tokenizer.eot_id)
    kl_sum, n_tok, rewards, rm_sum, rm_n = 0.0, 0, [], 0.0, 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        prompts = [user_prompt(p["question"], tokenizer) for p in chunk]
        room = policy.config.seq_len - max(map(len, prompts))
        ro = rollout(policy, prompts, max_new_tokens=min(max_new_tokens, room), temperature=temperature,
                     stop_ids=stop, pad_id=tokenizer.pad_id, generator=g)
        pl = response_forward(policy, ro, temperature, keep_logits=True).logits
        rl = response_forward(ref, ro, temperature, keep_logits=True).logits
        n = int(ro.response_mask.sum())
        kl_sum += float(exact_kl(pl, rl, ro.response_mask)) * n
        n_tok += n
        if reward_fn is not None:
            r, stats = reward_fn(ro, list(chunk))
            rewards.append(r)
            if "rm_score" in stats:
                rm_sum, rm_n = rm_sum + stats["rm_score"] * len(chunk), rm_n + len(chunk)
    out["kl"] = kl_sum / max(n_tok, 1)
    if rewards:
        out["reward"] = float(torch.cat(rewards).mean())
    if rm_n:
        out["rm_score"] = rm_sum / rm_n
    return out, ev["samples"]


# ---------------------------------------------------------------------------
# What stages/grpo.py and stages/ppo.py share around their algorithm

@dataclass
class RLSetup:
    """An RL stage's starting point, from `setup_rl_stage`; the stage builds its algorithm on it."""
    stage: str
    sft: Path                 # the SFT model directory (the policy's parent)
    policy: nn.Module         # the SFT model (LM head; PPO adds a value head): the model being trained
    ref: nn.Module            # a second copy of it: the reference for KL
    tokenizer: Any
    reward_fn: RewardFn       # from reward_source: the RM, the verifier, or both
    pool: MathPrompts         # training prompts, by level
    val: list[dict]           # held-out problems
    inputs: dict[str, str]    # what the run was made from: model fingerprints, data hashes
    fingerprint: str          # params + inputs: checkpoints resume only under the same one
    seed: int                 # derive_seed(common.seed, stage)

    @property
    def train_problems(self) -> int:
        return sum(len(v) for v in self.pool.by_level.values())


def setup_rl_stage(stage: str, common: CommonConfig, cfg: RLConfig, device: torch.device | str, *, sft: Path,
                   data: Path, levels: Sequence[Sequence[int]], reward_source: str = "verifier",
                   rm: Path | None = None) -> RLSetup:
    """Load the SFT model twice (policy and reference), the prompts of data/train.jsonl and the
    first cfg.eval_problems of data/val.jsonl, and the reward: `reward_source` "verifier", "rm"
    (the reward model in `rm`, which must share the policy's tokenizer) or "rm+verifier" (its
    score plus the verifier's). Each of `levels` (the level lists the stage will sample from) is
    checked for a usable problem now rather than at the step that first samples it."""
    policy, tok, sft_meta = load_model_dir(sft, device=device, heads=("lm",))
    ref, _, _ = load_model_dir(sft, device=device, heads=("lm",))
    inputs = {"sft": sft_meta.get("fingerprint", "")}
    if reward_source == "verifier":
        reward_fn = verifier_reward(tok, correct_reward=cfg.correct_reward, format_reward=cfg.format_reward)
    else:
        if rm is None:
            raise ValueError(f"{stage}: reward_source {reward_source!r} needs a reward model directory")
        rm_model, rm_tok, rm_meta = load_model_dir(rm, device=device, heads=("reward",))
        if rm_tok.sha256() != tok.sha256():
            raise ValueError(f"{rm}: its tokenizer differs from {sft}'s; the reward model must share the policy's"
                             f" tokenizer (retrain it from {sft})")
        rm_model.eval().requires_grad_(False)
        reward_fn = (rm_reward(rm_model, tok) if reward_source == "rm" else
                     rm_verifier_reward(rm_model, tok, correct_reward=cfg.correct_reward,
                                        format_reward=cfg.format_reward))
        inputs["reward"] = rm_meta.get("fingerprint", "")
    train_path, val_path = data / "train.jsonl", data / "val.jsonl"
    pool = MathPrompts(read_problems(train_path), tok, seq_len=policy.config.seq_len,
                       max_new_tokens=cfg.max_new_tokens, where=str(train_path))
    for lv in levels:
        pool.pool(lv)
    val = read_problems(val_path, cfg.eval_problems)[: cfg.eval_problems] if cfg.eval_problems else []
    inputs.update({"train": sha256_file(train_path), "val": sha256_file(val_path)})
    return RLSetup(stage=stage, sft=sft, policy=policy, ref=ref, tokenizer=tok, reward_fn=reward_fn, pool=pool,
                   val=val, inputs=inputs, fingerprint=fingerprint(common, cfg, inputs),
                   seed=derive_seed(common.seed, stage))


def finish_rl_stage(setup: RLSetup, algo: Algorithm, cfg: RLConfig, rt: Runtime, *, run_dir: Path, model_out: Path,
                    metrics_path: Path, plots: Path, extra_metrics: Callable[[RLResult], dict[str, Any]],
                    progress: bool = True) -> dict[str, Any]:
    """Train `algo` (run_rl, held-out evaluation on setup.val), apply the final-KL gate, then write
    the policy to `model_out` and the metrics to `metrics_path`; returns the metrics.

    The metrics are `summarize`'s, the final KL (held-out, else the last training steps') and
    its gate, `extra_metrics(result)` (the algorithm's own numbers), the prompt counts, the
    step resumed from and three held-out samples. A failed gate raises QualityGateError
    before the model and the metrics are written."""
    stage = setup.stage
    samples: list[dict] = []

    def eval_fn(model) -> dict:
        row, s = heldout_eval(model, setup.ref, setup.tokenizer, setup.val, max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, seed=setup.seed, reward_fn=setup.reward_fn)
        samples[:] = s[:3]
        return row

    result = run_rl(algo, cfg, rt, stage=stage, run_dir=run_dir, fingerprint=setup.fingerprint,
                    eval_fn=eval_fn if setup.val else None, tsv_path=plots / f"{stage}.tsv",
                    png_path=plots / f"{stage}.png", tb_dir=run_dir / "tb", progress=progress)
    if setup.val and not samples:
        # resumed from a checkpoint at the last step: no held-out evaluation ran in this process,
        # so the samples come from one more (seeded, hence identical) evaluation of the final policy
        with rt.autocast():
            eval_fn(setup.policy)
    metrics = summarize(result)
    final_kl = result.val_history[-1]["kl"] if result.val_history else metrics["kl_train_end"]
    metrics.update({"final_kl": final_kl, "max_kl": cfg.max_kl, **extra_metrics(result),
                    "train_problems": setup.train_problems, "dropped_prompts": setup.pool.dropped,
                    "resumed_from": result.resumed_from, "math_samples": samples})
    check_final_kl(final_kl, cfg.max_kl, stage)
    save_model_dir(model_out, setup.policy.cpu(), setup.tokenizer,
                   {"stage": stage, "fingerprint": setup.fingerprint, "inputs": setup.inputs,
                    "parent": str(setup.sft), "steps": result.step})
    atomic_write_json(metrics_path, metrics)
    return metrics
