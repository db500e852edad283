"""The glue of the RL stages (stages/ppo.py, stages/grpo.py) around their algorithm: set-up, run, finish.

    setup = setup_rl_stage("grpo", common, cfg, rt.device, sft=..., data=..., levels=...)
    algo = GRPO(setup.policy, setup.ref, cfg, ...)      # llm/post/grpo.py or llm/post/ppo.py: one RL step each
    metrics = finish_rl_stage(setup, algo, cfg, rt, run_dir=..., model=..., metrics=..., plots=...,
                              extra_metrics=lambda result: {...})

An RL step (one rollout batch: sample, score, update) is the algorithm's business, and its
data-parallel bookkeeping is llm/post/shares.py's; the algorithm is a step body of the run
skeleton (llm/train/loop.py), which does what every training stage does: resume, checkpoints
(policy with its value head, AdamW moments, the algorithm's state such as the KL
coefficient), signals, the optimizer step with clipping and the non-finite policy. Here:
`setup_rl_stage` (models, reward, the prompts of llm/sample/prompts.py, fingerprint),
`finish_rl_stage` (train, held-out evaluation with llm/post/heldout.py, the final-KL gate, the
stage's outputs through llm.train.finish.finish_stage) and `summarize` (start-vs-end numbers for
the metrics file).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from llm.config import CommonConfig, RLConfig, fingerprint
from llm.data.batching import derive_seed
from llm.eval.paired import linear_trend
from llm.fileio import sha256_file
from llm.nn.artifacts import load_model_dir
from llm.eval.evaluate import win_rate
from llm.post.heldout import continuation_heldout, heldout_eval, heldout_reward_change, heldout_rewards
from llm.runtime import Runtime
from llm.sample.prompts import MathPrompts, PassagePrompts, read_passages, read_problems
from llm.sample.rewards import RewardFn, rm_reward, rm_verifier_reward, verifier_reward, with_continuations
from llm.train.finish import Gate, finish_stage, run_plots
from llm.train.loop import LoopResult, StepBody, Updater, run_loop
from llm.train.monitor import Plots


RL_PANELS = [("reward", [("train", "reward", "reward (rollouts)"), ("val", "reward", "reward (held-out)")]),
             ("KL to the reference", [("train", "kl", "kl (train, per token)"),
                                      ("val", "kl", "kl (held-out, exact per token)")]),
             ("held-out exact match", [("val", "math_exact_match", "math exact match (greedy)")]),
             ("held-out continuations", [("val", "continuation_gold", "gold judge"),
                                         ("val", "continuation_rm", "reward model"),
                                         ("val", "continuation_win", "win rate against the reference")])]


def summarize(result: LoopResult, *, window: int = 5, trend_after: int = 0) -> dict[str, Any]:
    """Start-vs-end numbers and the time split from a run's histories (for metrics/<stage>.json):
    reward_start / reward_end (the means of the first and last `window` steps), reward_trend
    (how much the least-squares line through every step's reward moves over the run, with its
    95% interval: llm.eval.paired.linear_trend) over the steps after `trend_after` (a curriculum's
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
        for key in ("math_exact_match", "reward", "rm_score", "continuation_gold", "continuation_rm",
                    "continuation_kl"):
            if key in first:
                out[f"{name.get(key, key)}_start"] = first[key]
                out[f"{name.get(key, key)}_delta"] = last[key] - first[key]
    return out


def run_rl(algo: StepBody, cfg: RLConfig, rt: Runtime, *, stage: str, run_dir: str | Path, fingerprint: str,
           evaluate: Callable[[int], dict] | None = None, plots: Plots | None = None,
           progress: bool = True, stop_early: Callable[[], bool] | None = None) -> LoopResult:
    """Train `algo` for cfg.max_steps RL steps in the run skeleton (llm.train.loop.run_loop): the policy in
    eval mode (no dropout: the ratio pi / pi_old must compare the same function, as in TRL),
    AdamW over its trainable parameters, each step under the runtime's autocast. Under torchrun
    the Updater sums the ranks' gradients (no DDP wrapper: the policy is trained through
    `hidden_states` and its heads, whose calls DDP's forward hooks would not see). `stop_early`:
    run_loop's (GRPO's `stalled`)."""
    algo.model.eval()
    say = (lambda m: print(m, flush=True)) if rt.is_main else (lambda m: None)
    updater = Updater(algo.model, cfg, rt, stage=stage, say=say, sum_gradients=True)
    return run_loop(algo, updater, cfg, rt, stage=stage, model=algo.model, run_dir=run_dir, fingerprint=fingerprint,
                    evaluate=evaluate, plots=plots, progress=progress, step_context=rt.autocast,
                    stop_early=stop_early)


def summary_line(stage: str, m: dict[str, Any], model: Path, metrics: Path) -> str:
    """The line an RL stage prints at the end: reward, final KL, held-out exact match, what it wrote."""
    held = (f" (held-out {m['heldout_reward_start']:.3f} -> {m['heldout_reward']:.3f})"
            if "heldout_reward" in m else "")
    ctl = f" (kl_coef {m['kl_coef_final']:.4f}, {m['kl_alerts']} alerts)" if "kl_coef_final" in m else ""
    em = m.get("math_exact_match")
    math = (f"; held-out math exact match {m['math_exact_match_start']:.1%} -> {em:.1%}"
            f" [{m['math_exact_match_lo']:.1%}, {m['math_exact_match_hi']:.1%}]" if em is not None else "")
    gold = (f"; held-out continuations: gold judge {m['continuation_gold_start']:+.3f} ->"
            f" {m['continuation_gold']:+.3f}, win rate {m['continuation_win']:.1%}, KL {m['continuation_kl']:.4f}"
            if "continuation_gold" in m else "")
    return (f"{stage}: reward {m['reward_start']:.3f} -> {m['reward_end']:.3f}{held}; final KL {m['final_kl']:.4f}"
            f"{ctl}{math}{gold}; wrote {model}/ and {metrics}")


def rl_stage_main(stage: str, doc: str, run: Callable[..., dict | None], argv: list[str] | None, *,
                  inputs: dict[str, str], outputs: dict[str, str],
                  variants: dict[str, dict[str, Any]] | None = None) -> int:
    """The main() of an RL stage: `run(common, cfg, rt, name=..., **paths, progress=...)` on every
    rank (several under torchrun), then rank 0 prints summary_line. `variants` (llm.stage.stage_main):
    `--variant NAME` runs it as NAME, with cfg's keys forced (ppo_rm: ppo with the RM alone)."""
    from llm.runtime import setup_runtime
    from llm.stage import stage_main

    def work(args, common: CommonConfig, cfg: RLConfig, rt: Runtime) -> str | None:
        name = getattr(args, "variant", stage)
        m = run(common, cfg, rt, name=name, **{k: getattr(args, k) for k in (*inputs, *outputs)},
                progress=not args.no_progress)
        return summary_line(name, m, args.model, args.metrics) if rt.is_main else None

    return stage_main(stage, doc, argv, inputs=inputs, outputs=outputs, work=work, setup=setup_runtime,
                      torchrun=True, variants=variants)


def final_kl_gate(kl: float, max_kl: float, stage: str) -> Gate:
    """Quality gate: the policy moved too far from the reference to be trusted."""
    return Gate("final KL to the reference", kl, "max", f"{stage}.max_kl", max_kl,
                detail="mean per-token KL on held-out prompts; the policy drifted too far",
                advice=f"Lower {stage}.lr, raise the KL penalty, or run fewer steps")


# ---------------------------------------------------------------------------
# What stages/grpo.py and stages/ppo.py share around their algorithm

@dataclass
class RLSetup:
    """An RL stage's starting point, from `setup_rl_stage`; the stage builds its algorithm on it."""
    stage: str                # the name it runs as: its files, messages and checkpoints
    sft: Path                 # the SFT model directory (the policy's parent)
    policy: nn.Module         # the SFT model (LM head; PPO adds a value head): the model being trained
    ref: nn.Module            # a second copy of it: the reference for KL
    tokenizer: Any
    reward_fn: RewardFn       # from reward_source: the RM, the verifier, or both
    pool: MathPrompts         # training prompts, by level
    val: list[dict]           # held-out problems
    inputs: dict[str, str]    # what the run was made from: model fingerprints, data hashes
    fingerprint: str          # params + inputs: checkpoints resume only under the same one
    seed: int                 # derive_seed(common.seed, section)
    section: str = ""         # its params section, when it is a variant of another stage (ppo_rm: ppo)
    overrides: dict[str, Any] = field(default_factory=dict)   # the keys the variant forces
    rm: nn.Module | None = None              # the reward model, where it was loaded
    passages: PassagePrompts | None = None   # passages to continue, for the rollouts
    passages_test: list[dict] = field(default_factory=list)   # held-out passages, for the evaluation

    @property
    def train_problems(self) -> int:
        return sum(len(v) for v in self.pool.by_level.values())


def setup_rl_stage(stage: str, common: CommonConfig, cfg: RLConfig, device: torch.device | str, *, sft: Path,
                   data: Path, levels: Sequence[Sequence[int]], reward_source: str = "verifier",
                   rm: Path | None = None, section: str | None = None,
                   overrides: dict[str, Any] | None = None, continuation: Path | None = None,
                   continuation_share: float = 0.0, continuation_eval: int = 0) -> RLSetup:
    """Load the SFT model twice (policy and reference), the prompts of data/train.jsonl and the
    first cfg.eval_problems of data/val.jsonl, and the reward: `reward_source` "verifier", "rm"
    (the reward model in `rm`, which must share the policy's tokenizer) or "rm+verifier" (its
    score plus the verifier's). Each of `levels` (the level lists the stage will sample from) is
    checked for a usable problem now rather than at the step that first samples it.

    A variant (`stage` ppo_rm of `section` ppo, with `overrides` forced into cfg) draws from the
    section's seed: the same prompts and first samples as the stage it varies, so the two runs
    differ by what the overrides change (and cfg, in the fingerprint, tells them apart).

    Passages to continue (`continuation`: a directory with prepare's continue/train.jsonl and
    test.jsonl): with `continuation_share` > 0 the rollouts draw passages too (`passages`) and
    the reward is `with_continuations` (the reward model on them, `reward_source` on math); with
    `continuation_eval` > 0 that many held-out passages are measured at every evaluation. Both
    need the reward model, whatever `reward_source` says; at 0 neither file is read."""
    policy, tok, sft_meta = load_model_dir(sft, device=device, heads=("lm",))
    ref, _, _ = load_model_dir(sft, device=device, heads=("lm",))
    inputs = {"sft": sft_meta.get("fingerprint", "")}
    uses_passages = continuation_share > 0 or continuation_eval > 0
    rm_model = None
    if reward_source != "verifier" or uses_passages:
        if rm is None:
            why = (f"reward_source {reward_source!r}" if reward_source != "verifier" else
                   f"passages to continue ({section or stage}.continuation_share / continuation_eval)")
            raise ValueError(f"{stage}: {why} needs a reward model directory (--rm)")
        rm_model, rm_tok, rm_meta = load_model_dir(rm, device=device, heads=("reward",))
        if rm_tok.sha256() != tok.sha256():
            raise ValueError(f"{rm}: its tokenizer differs from {sft}'s; the reward model must share the policy's"
                             f" tokenizer (retrain it from {sft})")
        rm_model.eval().requires_grad_(False)
        inputs["reward"] = rm_meta.get("fingerprint", "")
    if reward_source == "verifier":
        reward_fn = verifier_reward(tok, correct_reward=cfg.correct_reward, format_reward=cfg.format_reward)
    else:
        reward_fn = (rm_reward(rm_model, tok) if reward_source == "rm" else
                     rm_verifier_reward(rm_model, tok, correct_reward=cfg.correct_reward,
                                        format_reward=cfg.format_reward))
    passages, passages_test = None, []
    if uses_passages:
        if continuation is None:
            raise ValueError(f"{stage}: {section or stage}.continuation_share / continuation_eval need the"
                             f" passages' directory (--continuation: prepare's continue/)")
        if continuation_share > 0:
            path = continuation / "train.jsonl"
            passages = PassagePrompts(read_passages(path), tok, seq_len=policy.config.seq_len,
                                      max_new_tokens=cfg.max_new_tokens, where=str(path))
            reward_fn = with_continuations(reward_fn, rm_model, tok)
            inputs["continuation_train"] = sha256_file(path)
        if continuation_eval > 0:
            path = continuation / "test.jsonl"
            passages_test = read_passages(path, continuation_eval)
            if not passages_test:
                raise ValueError(f"{path}: no held-out passage to continue; raise prepare.continuation_test or set"
                                 f" {section or stage}.continuation_eval: 0")
            inputs["continuation_test"] = sha256_file(path)
    train_path, val_path = data / "train.jsonl", data / "val.jsonl"
    pool = MathPrompts(read_problems(train_path), tok, seq_len=policy.config.seq_len,
                       max_new_tokens=cfg.max_new_tokens, where=str(train_path))
    for lv in levels:
        pool.pool(lv)
    val = read_problems(val_path, cfg.eval_problems)[: cfg.eval_problems] if cfg.eval_problems else []
    inputs.update({"train": sha256_file(train_path), "val": sha256_file(val_path)})
    return RLSetup(stage=stage, sft=sft, policy=policy, ref=ref, tokenizer=tok, reward_fn=reward_fn, pool=pool,
                   val=val, inputs=inputs, fingerprint=fingerprint(common, cfg, inputs),
                   seed=derive_seed(common.seed, section or stage),
                   section=section if section and section != stage else "", overrides=dict(overrides or {}),
                   rm=rm_model, passages=passages, passages_test=passages_test)


def finish_rl_stage(setup: RLSetup, algo: StepBody, cfg: RLConfig, rt: Runtime, *, run_dir: Path, model: Path,
                    metrics: Path, plots: Path, extra_metrics: Callable[[LoopResult], dict[str, Any]],
                    progress: bool = True, trend_after: int = 0, stop_early: Callable[[], bool] | None = None,
                    gates: Callable[[LoopResult], list[Gate]] = lambda result: []) -> dict[str, Any]:
    """Train `algo` (llm.train.loop.run_loop, held-out evaluation on setup.val), then end the stage
    (llm.train.finish.finish_stage: the algorithm's `gates(result)`, then the final-KL gate; the policy
    to `model`, the curves to `plots`, the metrics to `metrics`); returns the metrics. A run that
    `stop_early` ended (llm.train.loop.run_loop) ends here too, and one of its gates fails it.

    The metrics are `summarize`'s (the reward's trend fitted after step `trend_after`), the
    final KL (held-out, else the last training steps') and its gate, `extra_metrics(result)`
    (the algorithm's own numbers), the prompt counts, the step resumed from and three held-out
    samples; with a reward on held-out problems, each problem's reward at the start (the
    reference's sample) and at the end, and the paired interval of the mean change
    (heldout_reward_delta_lo / _hi). Under torchrun every rank trains and evaluates (a share of
    each held-out batch) and rank 0 alone writes."""
    stage = setup.stage
    samples: list[dict] = []
    reference_gold: list[float] = []   # the reference's continuations, judged once: the win rate's baseline

    def continuations(model) -> tuple[dict, list[dict]]:
        return continuation_heldout(model, setup.ref, setup.rm, setup.tokenizer, setup.passages_test,
                                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=setup.seed,
                                    rt=rt)

    def eval_fn(model) -> dict:
        row, s = heldout_eval(model, setup.ref, setup.tokenizer, setup.val, max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, seed=setup.seed, reward_fn=setup.reward_fn, rt=rt)
        samples[:] = s[:3]
        if setup.passages_test:
            if not reference_gold:
                reference_gold[:] = [r["gold"] for r in continuations(setup.ref)[1]]
            numbers, rows = continuations(model)
            row.update(numbers, continuation_win=win_rate([r["gold"] for r in rows], reference_gold)["win_rate"])
        return row

    def evaluate(step: int) -> dict:
        with rt.autocast():
            return eval_fn(algo.model)

    result = run_rl(algo, cfg, rt, stage=stage, run_dir=run_dir, fingerprint=setup.fingerprint,
                    evaluate=evaluate if setup.val else None, plots=run_plots(stage, run_dir, RL_PANELS),
                    progress=progress, stop_early=stop_early)
    if setup.val and not samples:
        # resumed from a checkpoint at the last step: no held-out evaluation ran in this process,
        # so the samples come from one more (seeded, hence identical) evaluation of the final policy
        with rt.autocast():
            eval_fn(setup.policy)
    out = summarize(result, trend_after=trend_after)
    if setup.val and setup.reward_fn is not None:
        out.update(_heldout_reward_change(setup, cfg, rt))
    final_kl = result.val_history[-1]["kl"] if result.val_history else out["kl_train_end"]
    variant = {"variant_of": setup.section, "overrides": setup.overrides} if setup.section else {}
    out.update({"final_kl": final_kl, "max_kl": cfg.max_kl, **extra_metrics(result), **variant,
                "train_problems": setup.train_problems, "dropped_prompts": setup.pool.dropped,
                "resumed_from": result.resumed_from, "math_samples": samples})
    return finish_stage(stage, gates=[*gates(result), final_kl_gate(final_kl, cfg.max_kl, stage)], run_dir=run_dir,
                        model=model,
                        weights=setup.policy.cpu() if rt.is_main else setup.policy, tokenizer=setup.tokenizer,
                        meta={"stage": stage, "fingerprint": setup.fingerprint, "inputs": setup.inputs,
                              "parent": str(setup.sft), "steps": result.step, **variant},
                        plots=plots, metrics=metrics, numbers=out, write=rt.is_main)


def _heldout_reward_change(setup: RLSetup, cfg: RLConfig, rt: Runtime) -> dict[str, Any]:
    """The held-out reward's change with an interval: each problem's reward under the final policy
    against under the reference (the start; the same seed, so the same draws as the first
    held-out evaluation), paired by problem."""
    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=setup.seed,
              reward_fn=setup.reward_fn, rt=rt)
    with rt.autocast():
        start = heldout_rewards(setup.ref, setup.ref, setup.tokenizer, setup.val, **kw)
        end = heldout_rewards(setup.policy, setup.ref, setup.tokenizer, setup.val, **kw)
    ch = heldout_reward_change(start, end, seed=derive_seed(setup.seed, "heldout_boot"))
    return {"heldout_reward_delta_lo": ch["lo"], "heldout_reward_delta_hi": ch["hi"],
            "heldout_rewards_start": start, "heldout_rewards_end": end}  # lists: the run file
