"""Stage `grpo`: group-relative policy optimisation of the SFT model on verifiable math.

    dvc repro grpo        (dvc.yaml passes the paths: `python -m stages.grpo --help`)

Reads the `common` and `grpo` sections of params.yaml and

    --sft     the policy's starting point and the frozen reference
    --data    train.jsonl: math problems for rollouts ({"question", "answer", "level"});
              val.jsonl: held-out problems (the first grpo.eval_problems)

Each step samples grpo.prompts_per_step problems (grpo.curriculum_levels for the first
grpo.curriculum_steps steps, then grpo.levels), grpo.group_size completions each, scores them
with the safe verifier (llm.sample.rewards.math_reward: correct_reward + format_reward, capped) and
updates the policy with the clipped surrogate + beta * k3 KL (llm/post/grpo.py). With
grpo.oversample k > 1 it samples k times as many problems and trains on the first
prompts_per_step groups whose rewards differ (dynamic sampling). With
`common.nproc` > 1 it runs under torchrun: each rank rolls out and scores whole groups of
the step's prompts, and the trajectory is one process's up to the order of float sums
(llm/post/shares.py). Held-out exact
match (greedy), held-out reward and KL to the reference are measured before the first step,
every grpo.eval_every steps and at the end.

`--variant grpo_random` (dvc.yaml's stage grpo_random) runs it as `grpo_random` with
grpo.reward_control forced to shuffled and everything else from the `grpo` section (the same
seed, so the same prompts): a control whose rewards are each step's real ones given to random
samples (llm/post/grpo.py), so that the report can tell how much of GRPO's change the verifier's
information explains. Its metrics and meta.json record the variant and what it forces; the
forced value is in its fingerprint. `dvc exp run -S grpo.reward_control=shuffled` runs the
control as `grpo` itself.

Quality gates (the stage exits 1 with a message, writes no model and leaves the run's numbers in
<run dir>/failed_metrics.json): no informative group for grpo.max_zero_std_steps consecutive
steps (the run ends there); final held-out KL above grpo.max_kl.

Writes the GRPO model directory (LM head only), its metrics (reward and exact match at start
vs end with a 95% Wilson interval, `reward_trend`: the change of the line fitted to the rewards
of the steps after the curriculum, with its 95% interval, final KL, time split), the curves
(grpo{.tsv,_val.tsv,.png}) and the run directory (checkpoints and TensorBoard events; a
persisted DVC out, so a killed run resumes).
"""
from __future__ import annotations

from pathlib import Path

from llm.config import CommonConfig, GRPOConfig
from llm.runtime import Runtime
from llm.stage import training_outputs

STAGE = "grpo"
INPUTS = {"sft": "the SFT model directory (the policy's start and the frozen reference)",
          "data": "math problems: train.jsonl (rollout prompts), val.jsonl (held out)"}
OUTPUTS = training_outputs("the GRPO model directory")
VARIANTS = {"grpo_random": {"reward_control": "shuffled"}}   # name: the keys of the grpo section it forces


def run(common: CommonConfig, cfg: GRPOConfig, rt: Runtime, *, sft: Path, data: Path, run_dir: Path, model: Path,
        metrics: Path, plots: Path, progress: bool = True, name: str = STAGE) -> dict:
    from llm.post.grpo import GRPO
    from llm.post.rl import finish_rl_stage, setup_rl_stage
    from llm.post.shares import step_generator

    # both level lists are checked now, not at step curriculum_steps
    setup = setup_rl_stage(name, common, cfg, rt.device, sft=sft, data=data,
                           levels=(cfg.levels, cfg.curriculum_levels), section=STAGE, overrides=VARIANTS.get(name))
    policy, tok = setup.policy, setup.tokenizer
    if rt.is_main:
        control = "; rewards shuffled across each step's samples (a control)" if cfg.reward_control != "none" else ""
        print(f"{name}: {setup.train_problems} train problems ({setup.pool.dropped} too long for"
              f" seq_len={policy.config.seq_len}), {len(setup.val)} held-out; {policy.summary()};"
              f" {rt.world_size} process(es){control}", flush=True)

    def prompts_fn(step: int):
        levels = cfg.curriculum_levels if step < cfg.curriculum_steps else cfg.levels
        n = cfg.prompts_per_step * cfg.oversample
        return setup.pool.sample(n, levels, step_generator(setup.seed, "prompts", step))

    algo = GRPO(policy, setup.ref if cfg.beta > 0 else None, cfg, prompts_fn=prompts_fn, reward_fn=setup.reward_fn,
                stop_ids=(tok.end_id, tok.eot_id), pad_id=tok.pad_id, seed=setup.seed, tokenizer=tok, rt=rt)

    def extra_metrics(result) -> dict:
        zero_std = [r["frac_reward_zero_std"] for r in result.history]
        return {"frac_reward_zero_std_mean": sum(zero_std) / max(len(zero_std), 1),
                "reward_control": cfg.reward_control}

    # the reward's trend is fitted to the steps on grpo.levels: the curriculum's easier prompts
    # before them would read as a fall
    return finish_rl_stage(setup, algo, cfg, rt, run_dir=run_dir, model=model, metrics=metrics,
                           plots=plots, extra_metrics=extra_metrics, progress=progress,
                           trend_after=cfg.curriculum_steps if cfg.curriculum_steps < cfg.max_steps else 0,
                           stop_early=algo.stalled, gates=lambda result: [algo.zero_std_gate(result.history)])


def main(argv: list[str] | None = None) -> int:
    from llm.post.rl import rl_stage_main
    return rl_stage_main(STAGE, __doc__, run, argv, inputs=INPUTS, outputs=OUTPUTS, variants=VARIANTS)


if __name__ == "__main__":
    raise SystemExit(main())
