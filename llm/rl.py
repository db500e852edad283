"""What PPO and GRPO share around their step: prompts, held-out evaluation, the stage's set-up and finish.

    setup = setup_rl_stage("grpo", common, cfg, rt.device, sft=..., data=..., levels=...)
    algo = GRPO(setup.policy, setup.ref, cfg, ...)      # llm/grpo.py or llm/ppo.py: one RL step each
    metrics = finish_rl_stage(setup, algo, cfg, rt, run_dir=..., model_out=..., metrics_path=..., plots=...)

An RL step (one rollout batch: sample, score, update) is the algorithm's business; the
algorithm is a step body of the run skeleton (llm/loop.py), which does what every training
stage does: resume, checkpoints (policy with its value head, AdamW moments, the algorithm's
state such as the KL coefficient), signals, the optimizer step with clipping and the
non-finite policy. Sampling randomness is counter-based (`step_generator`: a torch.Generator
seeded from (seed, what, step)), so a resumed run repeats the uninterrupted one exactly on
the CPU.

Data parallel (common.nproc > 1, under torchrun; `Shares`): every rank draws the step's
global prompt list from the same generator and takes an equal, contiguous share of its rows
(a GRPO group is never split); it samples its rows with the whole batch's random numbers
(llm.generate.generate's row_offset), so each row's tokens are those one process would
sample. Each rank's loss is its rows' part of the global loss (its numerator over the
global denominator), the Updater sums the gradients over the ranks, and every statistic
(advantage whitening, the KL controller, the gates, every logged number) is taken on the
global batch. Minibatches are a permutation of the global batch, so minibatch k holds the
same rows as in one process; a rank with none of them still joins the update. The result
is one process's trajectory up to the order of floating-point sums.

Also here: `MathPrompts` (prompt pools by level, sampled per step), `heldout_eval` (greedy exact
match via llm.evaluate.math_eval, plus KL to the reference on the policy's own samples via
llm.rollout.sampled_kl, and the reward of those samples), `summarize` (start-vs-end numbers
for the metrics file) and `check_final_kl` (the quality gate on the final KL).

Definition used everywhere here: `kl` is the mean over response tokens of KL(pi || ref)
per token (TRL GRPO's `kl`); `kl_seq` is its sum over a response, averaged over responses
(TRL PPO's `objective/kl`). Held-out `kl` is exact per token (summed over the vocabulary at
each sampled state), so it has no estimator noise; training-time `kl` uses the stage's
estimator (k1 or k3) on the sampled tokens.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from llm.artifacts import load_model_dir, save_model_dir
from llm.batching import derive_seed
from llm.chat import user_prompt
from llm.config import CommonConfig, RLConfig, fingerprint
from llm.errors import QualityGateError
from llm.evaluate import math_eval
from llm.fileio import read_jsonl, sha256_file
from llm.loop import LoopResult, Updater, run_loop
from llm.metrics import write_metrics
from llm.monitor import Plots, publish_curves
from llm.paired import bootstrap_mean, linear_trend
from llm.rewards import RewardFn, rm_reward, rm_verifier_reward, to_number, verifier_reward
from llm.rollout import sampled_kl
from llm.runtime import Runtime, all_gather_object, all_reduce


def step_generator(seed: int, what: str, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one use at one step: nothing to save in a checkpoint."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, what, step))


def minibatches(n: int, size: int, generator: torch.Generator) -> list[Tensor]:
    """A shuffled partition of range(n) into chunks of `size` (the last may be shorter)."""
    perm = torch.randperm(n, generator=generator)
    return list(perm.split(size))


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


@dataclass
class Shares:
    """This rank's contiguous share of a global batch of `total` rows: rows [lo, hi)."""
    lo: int
    hi: int
    total: int

    @classmethod
    def of(cls, n_items: int, rows_per_item: int, rt: Runtime | None) -> "Shares":
        """Items (prompts; each rows_per_item rows, a GRPO group) shared out equally over the ranks."""
        rank, world = (rt.rank, rt.world_size) if rt is not None else (0, 1)
        if n_items % world:
            raise ValueError(f"{n_items} prompts per step cannot be shared equally by {world} processes")
        per = n_items // world * rows_per_item
        return cls(rank * per, (rank + 1) * per, n_items * rows_per_item)

    def local(self, idx: Tensor) -> Tensor:
        """The rows of global indices `idx` that are this rank's, as local indices (in idx's order)."""
        return idx[(idx >= self.lo) & (idx < self.hi)] - self.lo


def gather_rows(x: Tensor, rt: Runtime | None) -> Tensor:
    """Every rank's (n, ...) rows of x concatenated in rank order: the global batch's (on CPU)."""
    return torch.cat([t for t in all_gather_object(x.detach().cpu(), rt)])


def global_sums(values: list[float | Tensor], rt: Runtime | None) -> list[float]:
    """Each value summed over the ranks (float64; the values themselves in one process)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if rt is not None and rt.distributed:
        t = all_reduce(t.to(rt.device), rt)
    return t.tolist()


class Algorithm(Protocol):
    """A step body of llm/loop.py that trains `model` (checkpointed whole, with a value head)."""
    model: nn.Module

    def step(self, step: int, updater: Updater) -> dict[str, float]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


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


@torch.no_grad()
def heldout_eval(policy: nn.Module, ref: nn.Module, tokenizer, problems: Sequence[dict], *, max_new_tokens: int,
                 temperature: float, seed: int, batch_size: int = 64, reward_fn: RewardFn | None = None,
                 confidence: float = 0.95, rt: Runtime | None = None) -> tuple[dict[str, float], list[dict]]:
    """Held-out numbers for one model state, and a few sample answers.

    - math exact match (greedy; llm.evaluate.math_eval) with its Wilson interval;
    - `kl`: exact per-token KL(policy || ref) at the states of the policy's own samples
      (llm.rollout.sampled_kl at `temperature`, a fixed seed: the same draws every evaluation
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


RL_PANELS = [("reward", [("train", "reward", "reward (rollouts)"), ("val", "reward", "reward (held-out)")]),
             ("KL to the reference", [("train", "kl", "kl (train, per token)"),
                                      ("val", "kl", "kl (held-out, exact per token)")]),
             ("held-out exact match", [("val", "math_exact_match", "math exact match (greedy)")])]


def summarize(result: LoopResult, *, window: int = 5, trend_after: int = 0) -> dict[str, Any]:
    """Start-vs-end numbers and the time split from a run's histories (for metrics/<stage>.json):
    reward_start / reward_end (the means of the first and last `window` steps), reward_trend
    (how much the least-squares line through every step's reward moves over the run, with its
    95% interval: llm.paired.linear_trend) over the steps after `trend_after` (a curriculum's
    easier first steps would otherwise read as a fall; reward_trend_first_step then says where it
    starts), the held-out rows' first and last values."""
    h, v = result.history, result.val_history
    k = max(1, min(window, len(h) // 2 or 1))

    def mean(rows, key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    out: dict[str, Any] = {"steps": result.step, "reward_start": mean(h[:k], "reward"),
                           "reward_end": mean(h[-k:], "reward")}
    if out["reward_start"] is not None and out["reward_end"] is not None:
        out["reward_delta"] = out["reward_end"] - out["reward_start"]
    # the whole curve's trend, not only its two ends: each step draws its own prompts, so one
    # step's mean reward is noisy and the first and last few steps can differ by chance
    fit = [r for r in h if r.get("reward") is not None and r["step"] > trend_after]
    trend = linear_trend([r["step"] for r in fit], [r["reward"] for r in fit])
    if trend is not None:
        out.update({"reward_trend": trend["change"], "reward_trend_lo": trend["lo"], "reward_trend_hi": trend["hi"]})
        if trend_after:
            out["reward_trend_first_step"] = fit[0]["step"]
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


def run_rl(algo: Algorithm, cfg: RLConfig, rt: Runtime, *, stage: str, run_dir: str | Path, fingerprint: str,
           evaluate: Callable[[int], dict] | None = None, plots: Plots | None = None,
           progress: bool = True) -> LoopResult:
    """Train `algo` for cfg.max_steps RL steps in the run skeleton (llm.loop.run_loop): the policy in
    eval mode (no dropout: the ratio pi / pi_old must compare the same function, as in TRL),
    AdamW over its trainable parameters, each step under the runtime's autocast. Under torchrun
    the Updater sums the ranks' gradients (no DDP wrapper: the policy is trained through
    `hidden_states` and its heads, whose calls DDP's forward hooks would not see)."""
    algo.model.eval()
    say = (lambda m: print(m, flush=True)) if rt.is_main else (lambda m: None)
    updater = Updater(algo.model, cfg, rt, stage=stage, say=say, sum_gradients=True)
    return run_loop(algo, updater, cfg, rt, stage=stage, model=algo.model, run_dir=run_dir, fingerprint=fingerprint,
                    evaluate=evaluate, plots=plots, progress=progress, step_context=rt.autocast)


def summary_line(stage: str, m: dict[str, Any], model: Path, metrics: Path) -> str:
    """The line an RL stage prints at the end: reward, final KL, held-out exact match, what it wrote."""
    held = (f" (held-out {m['heldout_reward_start']:.3f} -> {m['heldout_reward']:.3f})"
            if "heldout_reward" in m else "")
    ctl = f" (kl_coef {m['kl_coef_final']:.4f}, {m['kl_alerts']} alerts)" if "kl_coef_final" in m else ""
    em = m.get("math_exact_match")
    math = (f"; held-out math exact match {m['math_exact_match_start']:.1%} -> {em:.1%}"
            f" [{m['math_exact_match_lo']:.1%}, {m['math_exact_match_hi']:.1%}]" if em is not None else "")
    return (f"{stage}: reward {m['reward_start']:.3f} -> {m['reward_end']:.3f}{held}; final KL {m['final_kl']:.4f}"
            f"{ctl}{math}; wrote {model}/ and {metrics}")


def check_final_kl(kl: float, max_kl: float, stage: str) -> None:
    """Quality gate: the policy moved too far from the reference to be trusted."""
    if not math.isfinite(kl) or kl > max_kl:
        raise QualityGateError(f"{stage}: quality gate failed: final KL to the reference {kl:.4f} is above"
                               f" {stage}.max_kl={max_kl} (mean per-token KL on held-out prompts); the policy drifted"
                               f" too far. Lower {stage}.lr, raise the KL penalty, or run fewer steps;"
                               f" no model was written")


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


def finish_rl_stage(setup: RLSetup, algo: Algorithm, cfg: RLConfig, rt: Runtime, *, run_dir: Path, model: Path,
                    metrics: Path, plots: Path, extra_metrics: Callable[[LoopResult], dict[str, Any]],
                    progress: bool = True, trend_after: int = 0) -> dict[str, Any]:
    """Train `algo` (llm.loop.run_loop, held-out evaluation on setup.val), apply the final-KL gate, then write
    the policy to `model`, the metrics to `metrics` and the curves to `plots`; returns the metrics.

    The metrics are `summarize`'s (the reward's trend fitted after step `trend_after`), the
    final KL (held-out, else the last training steps') and its gate, `extra_metrics(result)`
    (the algorithm's own numbers), the prompt counts, the step resumed from and three held-out
    samples; with a reward on held-out problems, each problem's reward at the start (the
    reference's sample) and at the end, and the paired interval of the mean change
    (heldout_reward_delta_lo / _hi). A failed gate raises QualityGateError before the model and
    the metrics are written. Under torchrun every rank trains and evaluates (a share of each
    held-out batch) and rank 0 alone writes."""
    stage = setup.stage
    samples: list[dict] = []

    def eval_fn(model) -> dict:
        row, s = heldout_eval(model, setup.ref, setup.tokenizer, setup.val, max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, seed=setup.seed, reward_fn=setup.reward_fn, rt=rt)
        samples[:] = s[:3]
        return row

    def evaluate(step: int) -> dict:
        with rt.autocast():
            return eval_fn(algo.model)

    curves = run_dir / "plots"  # copied to `plots` once the gate passes
    result = run_rl(algo, cfg, rt, stage=stage, run_dir=run_dir, fingerprint=setup.fingerprint,
                    evaluate=evaluate if setup.val else None,
                    plots=Plots(tsv=curves / f"{stage}.tsv", png=curves / f"{stage}.png", tb_dir=run_dir / "tb",
                                panels=RL_PANELS),
                    progress=progress)
    if setup.val and not samples:
        # resumed from a checkpoint at the last step: no held-out evaluation ran in this process,
        # so the samples come from one more (seeded, hence identical) evaluation of the final policy
        with rt.autocast():
            eval_fn(setup.policy)
    out = summarize(result, trend_after=trend_after)
    if setup.val and setup.reward_fn is not None:
        # the held-out reward's change with an interval: each problem's reward under the final
        # policy against under the reference (the start; the same seed, so the same draws as
        # the first held-out evaluation), paired by problem
        kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=setup.seed,
                  reward_fn=setup.reward_fn, rt=rt)
        with rt.autocast():
            start = heldout_rewards(setup.ref, setup.ref, setup.tokenizer, setup.val, **kw)
            end = heldout_rewards(setup.policy, setup.ref, setup.tokenizer, setup.val, **kw)
        ch = heldout_reward_change(start, end, seed=derive_seed(setup.seed, "heldout_boot"))
        out.update({"heldout_reward_delta_lo": ch["lo"], "heldout_reward_delta_hi": ch["hi"],
                    "heldout_rewards_start": start, "heldout_rewards_end": end})  # lists: the run file
    final_kl = result.val_history[-1]["kl"] if result.val_history else out["kl_train_end"]
    out.update({"final_kl": final_kl, "max_kl": cfg.max_kl, **extra_metrics(result),
                "train_problems": setup.train_problems, "dropped_prompts": setup.pool.dropped,
                "resumed_from": result.resumed_from, "math_samples": samples})
    check_final_kl(final_kl, cfg.max_kl, stage)  # the same numbers on every rank: all fail together
    if not rt.is_main:
        return out
    save_model_dir(model, setup.policy.cpu(), setup.tokenizer,
                   {"stage": stage, "fingerprint": setup.fingerprint, "inputs": setup.inputs,
                    "parent": str(setup.sft), "steps": result.step})
    publish_curves(curves, plots, stage)
    write_metrics(metrics, out)
    return out
