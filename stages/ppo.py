"""Stage `ppo`: PPO of the SFT model against a reward model or the math verifier.

    python -m stages.ppo [--params params.yaml]

Reads the `common` and `ppo` sections of params.yaml and

    models/sft/                     the policy's starting point (a value head is added on its trunk)
                                    and the frozen reference
    models/reward/                  the reward model (a model directory with a "reward" head), used
                                    when ppo.reward_source is rm, or rm+verifier (its score
                                    plus the verifier's reward, llm.rl.rm_verifier_reward)
    data/prepared/rl/train.jsonl    math problems whose questions are the rollout prompts (ppo.levels)
    data/prepared/rl/val.jsonl      held-out problems (the first ppo.eval_problems)

Each step samples ppo.rollout_prompts prompts, one response each, scores them (RM or verifier),
adds the per-token KL penalty (ppo.kl_estimator, coefficient from the adaptive KL controller),
runs GAE and ppo.epochs passes of clipped-surrogate + clipped-value + entropy updates over
minibatches (llm/ppo.py). A KL outside [kl_alert_low, kl_alert_high] is reported as an ALERT.
Held-out exact match (greedy), held-out reward (sampled responses scored the same way) and KL
to the reference are measured before the first step, every ppo.eval_every steps and at the end.

Quality gate (the stage exits 1 with a message and writes no model): final held-out KL above
ppo.max_kl.

Writes models/ppo/ (LM and value heads), metrics/ppo.json (reward and exact match at start vs
end, final KL, KL coefficient, alerts, time split), metrics/plots/ppo{.tsv,_val.tsv,.png},
runs/ppo/ (checkpoints and TensorBoard events; a persisted DVC out, so a killed run resumes).
"""
from __future__ import annotations

import sys
from pathlib import Path

from llm.batching import derive_seed
from llm.config import CommonConfig, PPOConfig, load_sections
from llm.trainer import Runtime, stage_main

STAGE = "ppo"
SFT = Path("models/sft")
RM = Path("models/reward")
DATA = Path("data/prepared/rl")
RUN_DIR = Path("runs/ppo")
MODEL_OUT = Path("models/ppo")
METRICS = Path("metrics/ppo.json")
PLOTS = Path("metrics/plots")


def run(common: CommonConfig, cfg: PPOConfig, rt: Runtime, *, sft: Path = SFT, rm: Path = RM, data: Path = DATA,
        run_dir: Path = RUN_DIR, model_out: Path = MODEL_OUT, metrics_path: Path = METRICS, plots: Path = PLOTS,
        progress: bool = True) -> dict:
    from llm.ppo import PPO
    from llm.rl import finish_rl_stage, setup_rl_stage, step_generator

    setup = setup_rl_stage(STAGE, common, cfg, rt.device, sft=sft, data=data, levels=(cfg.levels,),
                           reward_source=cfg.reward_source, rm=rm)
    policy, tok = setup.policy, setup.tokenizer
    policy.add_head("value", seed=derive_seed(setup.seed, "value_head"))
    source = {"rm": f"the reward model {rm}", "verifier": "the verifier",
              "rm+verifier": f"the reward model {rm} plus the verifier"}[cfg.reward_source]
    print(f"{STAGE}: reward from {source};"
          f" {setup.train_problems} train problems ({setup.pool.dropped} too long), {len(setup.val)}"
          f" held-out; {policy.summary()}", flush=True)

    def prompts_fn(step: int):
        return setup.pool.sample(cfg.rollout_prompts, cfg.levels, step_generator(setup.seed, "prompts", step))

    algo = PPO(policy, setup.ref, cfg, prompts_fn=prompts_fn, reward_fn=setup.reward_fn,
               stop_ids=(tok.end_id, tok.eot_id), pad_id=tok.pad_id, seed=setup.seed,
               log=lambda m: print(m, file=sys.stderr, flush=True))
    return finish_rl_stage(setup, algo, cfg, rt, run_dir=run_dir, model_out=model_out, metrics_path=metrics_path,
                           plots=plots, progress=progress,
                           extra_metrics=lambda result: {"reward_source": cfg.reward_source,
                                                         "kl_coef_final": algo.kl_ctl.value,
                                                         "kl_alerts": algo.alert.alerts})


def main(argv: list[str] | None = None) -> int:
    from llm.rl import QualityGateError

    def work(args, common: CommonConfig, cfg: PPOConfig, rt: Runtime) -> str:
        m = run(common, cfg, rt)
        em = m.get("math_exact_match")
        held = (f" (held-out {m['heldout_reward_start']:.3f} -> {m['heldout_reward']:.3f})"
                if "heldout_reward" in m else "")
        return (f"{STAGE}: reward {m['reward_start']:.3f} -> {m['reward_end']:.3f}{held}; final KL {m['final_kl']:.4f}"
                f" (kl_coef {m['kl_coef_final']:.4f}, {m['kl_alerts']} alerts)"
                + (f"; held-out math exact match {m['math_exact_match_start']:.1%} -> {em:.1%}"
                   f" [{m['math_exact_match_lo']:.1%}, {m['math_exact_match_hi']:.1%}]" if em is not None else "")
                + f"; wrote {MODEL_OUT}/ and {METRICS}")

    return stage_main(STAGE, __doc__, argv, load=lambda params: load_sections(["common", STAGE], params),
                      work=work, errors=(QualityGateError,))


if __name__ == "__main__":
    raise SystemExit(main())
