"""Stage `ppo`: PPO of the SFT model against a reward model or the math verifier (SPEC PPO-1..5, PIPE-5).

    python -m stages.ppo [--params params.yaml]

Reads the `common` and `ppo` sections of params.yaml and

    models/sft/                     the policy's starting point (a value head is added on its trunk)
                                    and the frozen reference
    models/reward/                  the reward model (a model directory with a "reward" head), used
                                    when ppo.reward_source is rm
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
from llm.config import CommonConfig, PPOConfig, fingerprint, load_sections
from llm.fileio import atomic_write_json, sha256_file
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
    from llm.artifacts import load_model_dir, save_model_dir
    from llm.ppo import PPO
    from llm.rl import (MathPrompts, check_final_kl, heldout_eval, read_problems, rm_reward, run_rl,
                        step_generator, summarize, verifier_reward)

    seed = derive_seed(common.seed, STAGE)
    policy, tok, sft_meta = load_model_dir(sft, device=rt.device, heads=("lm",))
    policy.add_head("value", seed=derive_seed(seed, "value_head"))
    ref, _, _ = load_model_dir(sft, device=rt.device, heads=("lm",))
    inputs = {"sft": sft_meta.get("fingerprint", "")}
    if cfg.reward_source == "rm":
        rm_model, rm_tok, rm_meta = load_model_dir(rm, device=rt.device, heads=("reward",))
        if rm_tok.sha256() != tok.sha256():
            raise ValueError(f"{rm}: its tokenizer differs from {sft}'s; the reward model must share the policy's"
                             f" tokenizer (retrain it from {sft})")
        rm_model.eval().requires_grad_(False)
        reward_fn = rm_reward(rm_model, tok)
        inputs["reward"] = rm_meta.get("fingerprint", "")
    else:
        reward_fn = verifier_reward(tok, correct_reward=cfg.correct_reward, format_reward=cfg.format_reward)
    seq_len = policy.config.seq_len
    train_path, val_path = data / "train.jsonl", data / "val.jsonl"
    pool = MathPrompts(read_problems(train_path), tok, seq_len=seq_len, max_new_tokens=cfg.max_new_tokens,
                       where=str(train_path))
    pool.pool(cfg.levels)
    val = read_problems(val_path, cfg.eval_problems)[: cfg.eval_problems] if cfg.eval_problems else []
    inputs.update({"train": sha256_file(train_path), "val": sha256_file(val_path)})
    fp = fingerprint(common, cfg, inputs)
    print(f"{STAGE}: reward from {'the reward model ' + str(rm) if cfg.reward_source == 'rm' else 'the verifier'};"
          f" {sum(len(v) for v in pool.by_level.values())} train problems ({pool.dropped} too long), {len(val)}"
          f" held-out; {policy.summary()}", flush=True)

    def prompts_fn(step: int):
        return pool.sample(cfg.rollout_prompts, cfg.levels, step_generator(seed, "prompts", step))

    algo = PPO(policy, ref, cfg, prompts_fn=prompts_fn, reward_fn=reward_fn, stop_ids=(tok.end_id, tok.eot_id),
               pad_id=tok.pad_id, seed=seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    samples: list[dict] = []

    def eval_fn(model) -> dict:
        row, s = heldout_eval(model, ref, tok, val, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              seed=seed, reward_fn=reward_fn)
        samples[:] = s[:3]
        return row

    result = run_rl(algo, cfg, rt, stage=STAGE, run_dir=run_dir, fingerprint=fp, eval_fn=eval_fn if val else None,
                    tsv_path=plots / f"{STAGE}.tsv", png_path=plots / f"{STAGE}.png", tb_dir=run_dir / "tb",
                    progress=progress)
    metrics = summarize(result)
    final_kl = result.val_history[-1]["kl"] if result.val_history else metrics["kl_train_end"]
    metrics.update({"final_kl": final_kl, "max_kl": cfg.max_kl, "reward_source": cfg.reward_source,
                    "kl_coef_final": algo.kl_ctl.value, "kl_alerts": algo.alert.alerts,
                    "train_problems": sum(len(v) for v in pool.by_level.values()), "dropped_prompts": pool.dropped,
                    "resumed_from": result.resumed_from, "math_samples": samples})
    check_final_kl(final_kl, cfg.max_kl, STAGE)
    save_model_dir(model_out, policy.cpu(), tok, {"stage": STAGE, "fingerprint": fp, "inputs": inputs,
                                                  "parent": str(sft), "steps": result.step})
    atomic_write_json(metrics_path, metrics)
    return metrics


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
