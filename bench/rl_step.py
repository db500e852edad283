"""Benchmark: the time split of one GRPO step and one PPO step.

    python bench/rl_step.py [--model models/sft] [--params params.yaml] [--rounds 3] [--device auto]

Runs the stages' own step code (llm/post/grpo.py, llm/post/ppo.py) with the settings of params.yaml's
`grpo` and `ppo` sections (the `cpu` profile by default): GRPO prompts_per_step x group_size
completions, PPO rollout_prompts rollouts with ppo.epochs passes of ppo.minibatch_size
minibatches, the verifier reward on math problems from data/prepared/rl/train.jsonl at the
sections' `levels` (GRPO at its curriculum levels: its first steps). Each step is split into

    rollout_s   sampling with the KV cache (llm/sample/rollout.py -> llm/sample/generate.py)
    scoring_s   reward + reference log-probs (+ PPO: old log-probs and values), no_grad
    update_s    the optimizer steps over minibatches

The policy is `--model` (default models/sft) if it exists, else a randomly initialised model
of pretrain.model's size: it never emits <|end|>, so every response runs to max_new_tokens, the
worst case for generation (and the line says so). One warm-up step of each, then GRPO and
PPO steps alternate `--rounds` times (different prompts each round). Reported per part:
min / median / max seconds, and the generation fraction rollout_s / step_s of the median
step. Target: generation takes no more than half of the step (ratio <= 0.5).

The last line of output is JSON with every figure.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from llm.config import load_params  # noqa: E402
from llm.data.batching import derive_seed  # noqa: E402
from llm.post.grpo import GRPO  # noqa: E402
from llm.post.ppo import PPO  # noqa: E402
from llm.post.shares import step_generator  # noqa: E402
from llm.runtime import Runtime, resolve_device, resolve_dtype  # noqa: E402
from llm.sample.prompts import MathPrompts, read_problems  # noqa: E402
from llm.sample.rewards import verifier_reward  # noqa: E402
from llm.train.loop import Updater  # noqa: E402

PARTS = ("rollout_s", "scoring_s", "update_s")


def load_policy(path: Path, params, device):
    from llm.data.tokenizer import Tokenizer
    from llm.nn.artifacts import load_model_dir
    from llm.nn.model import GPT
    if (path / "model.safetensors").is_file():
        model, tok, _ = load_model_dir(path, device=device, heads=("lm",))
        return model, tok, f"{path}"
    tok = Tokenizer.load("models/tokenizer")
    cfg = dataclasses.replace(params.pretrain.model, vocab_size=tok.vocab_size)
    return GPT(cfg, seed=0).to(device), tok, "a random model (no <|end|>: every response is max_new_tokens long)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/sft")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", default="data/prepared/rl/train.jsonl")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = load_params(args.params)
    common = dataclasses.replace(params.common, device=args.device)
    device = resolve_device(common)
    rt = Runtime(device=device, dtype=resolve_dtype(common, device))
    policy, tok, what = load_policy(Path(args.model), params, device)
    problems = read_problems(args.data)
    gcfg, pcfg = params.grpo, params.ppo
    seed = derive_seed(params.common.seed, "bench_rl")
    stop = (tok.end_id, tok.eot_id)
    print(f"bench: policy {what}; {policy.summary()}", flush=True)
    print(f"bench: {device}, {rt.dtype}, {torch.get_num_threads()} threads; GRPO {gcfg.prompts_per_step} x"
          f" {gcfg.group_size} completions, PPO {pcfg.rollout_prompts} rollouts x {pcfg.epochs} epochs of"
          f" minibatch {pcfg.minibatch_size}; max_new_tokens {gcfg.max_new_tokens} / {pcfg.max_new_tokens}", flush=True)

    reward = verifier_reward(tok, correct_reward=gcfg.correct_reward, format_reward=gcfg.format_reward)
    g_pool = MathPrompts(problems, tok, seq_len=policy.config.seq_len, max_new_tokens=gcfg.max_new_tokens)
    p_pool = MathPrompts(problems, tok, seq_len=policy.config.seq_len, max_new_tokens=pcfg.max_new_tokens)
    g_policy, p_policy = copy.deepcopy(policy), copy.deepcopy(policy)
    p_policy.add_head("value", seed=1)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    grpo = GRPO(g_policy, ref, gcfg, reward_fn=reward, stop_ids=stop, pad_id=tok.pad_id, seed=seed, tokenizer=tok,
                prompts_fn=lambda s: g_pool.sample(gcfg.prompts_per_step, gcfg.curriculum_levels,
                                                   step_generator(seed, "prompts", s)))
    ppo = PPO(p_policy, ref, pcfg, reward_fn=reward, stop_ids=stop, pad_id=tok.pad_id, seed=seed,
              prompts_fn=lambda s: p_pool.sample(pcfg.rollout_prompts, pcfg.levels, step_generator(seed, "prompts", s)),
              log=lambda m: None)
    algos = {"grpo": (grpo, Updater(g_policy, gcfg, rt, stage="grpo")),
             "ppo": (ppo, Updater(p_policy, pcfg, rt, stage="ppo"))}
    for algo, up in algos.values():
        algo.model.eval()
        up.set_step(gcfg.warmup_steps)  # full lr

    rows: dict[str, list[dict]] = {"grpo": [], "ppo": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, (algo, up) in algos.items():
            with rt.autocast():
                row = algo.step(1000 + r, up)
            row["step_s"] = sum(row[k] for k in PARTS)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r == 0:
                continue
            rows[name].append(row)
            print(f"round {r} {name}: " + ", ".join(f"{k} {row[k]:.3f}" for k in (*PARTS, "step_s"))
                  + f"  (generation {row['rollout_s'] / row['step_s']:.0%}, response length"
                  f" {row['response_length']:.1f}, reward {row['reward']:.3f})", flush=True)

    out = {"bench": "rl_step", "device": str(device), "dtype": str(rt.dtype).replace("torch.", ""),
           "threads": torch.get_num_threads(), "policy": what, "rounds": args.rounds}
    for name, rs in rows.items():
        stats = {}
        for k in (*PARTS, "step_s", "response_length"):
            xs = [x[k] for x in rs]
            stats[k] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
        med = sorted(rs, key=lambda x: x["step_s"])[len(rs) // 2]
        stats["generation_fraction"] = med["rollout_s"] / med["step_s"]
        stats["generation_fraction_all"] = [x["rollout_s"] / x["step_s"] for x in rs]
        stats["target_met"] = stats["generation_fraction"] <= 0.5
        out[name] = stats
        print(f"{name}: median step {stats['step_s']['median']:.3f} s = rollout {stats['rollout_s']['median']:.3f}"
              f" + scoring {stats['scoring_s']['median']:.3f} + update {stats['update_s']['median']:.3f};"
              f" generation {stats['generation_fraction']:.0%} of the median step"
              f" ({'meets' if stats['target_met'] else 'MISSES'} the <= 50% target)", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
