"""Stage `grpo`: group-relative policy optimisation of the SFT model on verifiable math (SPEC GRPO-1..4, PIPE-5).

    python -m stages.grpo [--params params.yaml]

Reads the `common` and `grpo` sections of params.yaml and

    models/sft/                     the policy's starting point and the frozen reference
    data/prepared/rl/train.jsonl    math problems for rollouts ({"question", "answer", "level"})
    data/prepared/rl/val.jsonl      held-out problems (the first grpo.eval_problems)

Each step samples grpo.prompts_per_step problems (grpo.curriculum_levels for the first
grpo.curriculum_steps steps, then grpo.levels), grpo.group_size completions each, scores them
with the safe verifier (llm.rewards.math_reward: correct_reward + format_reward, capped) and
updates the policy with the clipped surrogate + beta * k3 KL (llm/grpo.py). Held-out exact
match (greedy), held-out reward and KL to the reference are measured before the first step,
every grpo.eval_every steps and at the end.

Quality gates (the stage exits 1 with a message and writes no model): no informative group
for grpo.max_zero_std_steps consecutive steps; final held-out KL above grpo.max_kl.

Writes models/grpo/ (LM head only), metrics/grpo.json (reward and exact match at start vs
end with a 95% Wilson interval, final KL, time split), metrics/plots/grpo{.tsv,_val.tsv,.png},
runs/grpo/ (checkpoints and TensorBoard events; a persisted DVC out, so a killed run resumes).
"""
from __future__ import annotations

from pathlib import Path

from llm.batching import derive_seed
from llm.config import CommonConfig, GRPOConfig, fingerprint, load_sections
from llm.fileio import atomic_write_json, sha256_file
from llm.trainer import Runtime, stage_main

STAGE = "grpo"
SFT = Path("models/sft")
DATA = Path("data/prepared/rl")
RUN_DIR = Path("runs/grpo")
MODEL_OUT = Path("models/grpo")
METRICS = Path("metrics/grpo.json")
PLOTS = Path("metrics/plots")


def run(common: CommonConfig, cfg: GRPOConfig, rt: Runtime, *, sft: Path = SFT, data: Path = DATA,
        run_dir: Path = RUN_DIR, model_out: Path = MODEL_OUT, metrics_path: Path = METRICS, plots: Path = PLOTS,
        progress: bool = True) -> dict:
    from llm.artifacts import load_model_dir, save_model_dir
    from llm.grpo import GRPO
    from llm.rl import (MathPrompts, check_final_kl, heldout_eval, read_problems, run_rl, step_generator,
                        summarize, verifier_reward)

    policy, tok, sft_meta = load_model_dir(sft, device=rt.device, heads=("lm",))
    ref, _, _ = load_model_dir(sft, device=rt.device, heads=("lm",))
    seq_len = policy.config.seq_len
    train_path, val_path = data / "train.jsonl", data / "val.jsonl"
    pool = MathPrompts(read_problems(train_path), tok, seq_len=seq_len, max_new_tokens=cfg.max_new_tokens,
                       where=str(train_path))
    pool.pool(cfg.levels), pool.pool(cfg.curriculum_levels)  # fail now, not at step curriculum_steps
    val = read_problems(val_path, cfg.eval_problems)[: cfg.eval_problems] if cfg.eval_problems else []
    inputs = {"sft": sft_meta.get("fingerprint", ""), "train": sha256_file(train_path), "val": sha256_file(val_path)}
    fp = fingerprint(common, cfg, inputs)
    seed = derive_seed(common.seed, STAGE)
    print(f"{STAGE}: {sum(len(v) for v in pool.by_level.values())} train problems ({pool.dropped} too long for"
          f" seq_len={seq_len}), {len(val)} held-out; {policy.summary()}", flush=True)

    def prompts_fn(step: int):
        levels = cfg.curriculum_levels if step < cfg.curriculum_steps else cfg.levels
        return pool.sample(cfg.prompts_per_step, levels, step_generator(seed, "prompts", step))

    reward_fn = verifier_reward(tok, correct_reward=cfg.correct_reward, format_reward=cfg.format_reward)
    algo = GRPO(policy, ref if cfg.beta > 0 else None, cfg, prompts_fn=prompts_fn, reward_fn=reward_fn,
                stop_ids=(tok.end_id, tok.eot_id), pad_id=tok.pad_id, seed=seed)
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
    metrics.update({"final_kl": final_kl, "max_kl": cfg.max_kl,
                    "frac_reward_zero_std_mean": (sum(r["frac_reward_zero_std"] for r in result.history)
                                                  / max(len(result.history), 1)),
                    "train_problems": sum(len(v) for v in pool.by_level.values()), "dropped_prompts": pool.dropped,
                    "resumed_from": result.resumed_from, "math_samples": samples})
    check_final_kl(final_kl, cfg.max_kl, STAGE)
    save_model_dir(model_out, policy.cpu(), tok, {"stage": STAGE, "fingerprint": fp, "inputs": inputs,
                                                  "parent": str(sft), "steps": result.step})
    atomic_write_json(metrics_path, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from llm.rl import QualityGateError

    def work(args, common: CommonConfig, cfg: GRPOConfig, rt: Runtime) -> str:
        m = run(common, cfg, rt)
        em = m.get("math_exact_match")
        return (f"{STAGE}: reward {m['reward_start']:.3f} -> {m['reward_end']:.3f}; final KL {m['final_kl']:.4f}"
                + (f"; held-out math exact match {m['math_exact_match_start']:.1%} -> {em:.1%}"
                   f" [{m['math_exact_match_lo']:.1%}, {m['math_exact_match_hi']:.1%}]" if em is not None else "")
                + f"; wrote {MODEL_OUT}/ and {METRICS}")

    return stage_main(STAGE, __doc__, argv, load=lambda params: load_sections(["common", STAGE], params),
                      work=work, errors=(QualityGateError,))


if __name__ == "__main__":
    raise SystemExit(main())
