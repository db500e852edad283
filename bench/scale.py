"""Benchmark: data-parallel scaling on this machine, 1 vs N processes, for pretraining and GRPO.

    python bench/scale.py [--rounds 3] [--threads 1] [--nproc 1 2] [--tasks pretrain grpo]

Each measurement starts N gloo processes (with the environment torchrun gives its workers)
that do the same global work whatever N is:

  pretrain  llm.train.trainer.train of the `tiny` preset (1.3M parameters, vocabulary 4096) on random
            tokens: seq_len 256, global batch grad_accum 2 x batch_size 16 = 32 sequences per step
            (each of 2 processes runs one micro-batch of 16, one process both);
  grpo      llm.post.grpo.GRPO on the same model: 8 prompts of 16-23 random tokens x group 8, up to
            48 new tokens each, beta 0.04 (the reference's forward too), one epoch of minibatches
            of 32, a synthetic reward (the share of one token id in each response).

Every process runs --threads torch threads (1 by default: on a 2-core machine 2 processes of
1 thread use the same cores as 1 process of 2). tokens/s = the step's global tokens (pretrain:
every input token; grpo: prompt + response tokens of the rollout) over its time, median over
the steps after --warmup; per rank = tokens/s / N; scaling efficiency = tokens/s(N) /
(N x tokens/s(1)). Sides alternate (1, 2, 1, 2, ...) for --rounds rounds, and the machine's
load average is read before and after each run, since a shared machine's other work slows
whichever run it overlaps. Also reported, because it hardly depends on that other work: CPU
seconds per 1000 tokens, summed over the ranks (each process's CPU time over the whole run,
warm-up steps and checkpoint included, against every step's tokens); its ratio N : 1 is the
parallel overhead (all-reduces, gathers, the work every rank repeats), the wall-clock speedup a
machine with N free cores would show at most. The last line of output is JSON with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

V = 4096


def child(opt: dict) -> None:
    """One run as one of WORLD_SIZE ranks; rank 0 writes the per-step tokens/s to opt["out"]."""
    import numpy as np
    import torch

    from llm.config import CommonConfig, GRPOConfig, ModelConfig, TrainConfig
    from llm.nn.model import GPT
    from llm.runtime import Runtime, setup_runtime

    torch.set_num_threads(opt["threads"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cpu0 = time.process_time()
    rt = (setup_runtime(CommonConfig(seed=0, device="cpu", dtype="auto", nproc=world, num_threads=opt["threads"],
                                     cpu_kernels=True)) if world > 1 else Runtime(torch.device("cpu")))
    model_cfg = ModelConfig(preset="tiny", vocab_size=V, seq_len=256, n_layer=4, n_head=4, n_kv_head=4, n_embd=128)
    loop = dict(lr=1e-4, min_lr=1e-4, warmup_steps=0, weight_decay=0.0, beta1=0.9, beta2=0.95, grad_clip=1.0,
                eval_every=10 ** 6, checkpoint_every=10 ** 6, keep_checkpoints=2, nonfinite_policy="raise",
                nonfinite_budget=0, max_steps=opt["steps"])
    run_dir = tempfile.mkdtemp(prefix="bench-scale-")
    if opt["task"] == "pretrain":
        from llm.data.batching import WindowSampler
        from llm.train.trainer import train
        cfg = TrainConfig(batch_size=16, grad_accum=2, eval_batches=1, log_every=10 ** 6,
                          activation_checkpointing=False, compile=False, **loop)
        tokens = np.random.default_rng(0).integers(0, V, 200_000).astype(np.uint16)
        src = WindowSampler(tokens, seq_len=256, batch_size=16, grad_accum=2, seed=0, rank=rt.rank,
                            world_size=rt.world_size)
        res = train(GPT(model_cfg, seed=0), cfg, rt, stage="bench", seed=0, batches=src, run_dir=run_dir,
                    fingerprint="bench", progress=False)
        rows = res.train_history
        tokens = sum(r["tokens_per_s"] * r["step_s"] for r in rows)
    else:
        from llm.post.grpo import GRPO
        from llm.post.rl import run_rl
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, V, (16 + i % 8,), generator=g).tolist() for i in range(8)]

        def reward(ro, problems):
            return torch.tensor([sum(t == 3 for t in x) / max(len(x), 1) for x in ro.response_ids()]), {}

        cfg = GRPOConfig(epochs=1, minibatch_size=32, prompts_per_step=8, group_size=8, beta=0.04, loss_agg="grpo",
                         curriculum_steps=0, curriculum_levels=[1], max_zero_std_steps=10 ** 6, clip_epsilon=0.2,
                         max_new_tokens=48, temperature=1.0, levels=[1], eval_problems=0, max_kl=1e9,
                         correct_reward=1.0, format_reward=0.2, step_credit=0.0, **loop)
        algo = GRPO(GPT(model_cfg, seed=0), GPT(model_cfg, seed=0), cfg, prompts_fn=lambda s: (prompts, [{}] * 8),
                    reward_fn=reward, stop_ids=(1,), pad_id=0, seed=0, rt=rt)
        rows = run_rl(algo, cfg, rt, stage="bench", run_dir=run_dir, fingerprint="bench", progress=False).history
        tokens = sum(r["tokens_per_s"] * (r["rollout_s"] + r["scoring_s"] + r["update_s"]) for r in rows)
    cpu = time.process_time() - cpu0
    Path(f"{opt['out']}.cpu{rt.rank}").write_text(json.dumps(cpu))
    if rt.is_main:
        Path(opt["out"]).write_text(json.dumps({"rates": [r["tokens_per_s"] for r in rows], "tokens": tokens}))
    rt.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(task: str, n: int, args) -> dict:
    """Start n ranks of `child`; the median tokens/s after the warm-up steps and the load around the run."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    opt = {"task": task, "threads": args.threads, "steps": args.warmup + args.steps, "out": str(out)}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if n > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE=str(n))
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", json.dumps(opt)], cwd=ROOT,
                              env={**env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if n > 1 else {})})
             for r in range(n)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"bench/scale.py: a {task} run on {n} process(es) failed")
    got = json.loads(out.read_text())
    cpu = sum(json.loads(Path(f"{out}.cpu{r}").read_text()) for r in range(n))
    for f in [out, *(Path(f"{out}.cpu{r}") for r in range(n))]:
        f.unlink()
    return {"tokens_per_s": statistics.median(got["rates"][args.warmup:]),
            "cpu_s_per_1k_tokens": 1000 * cpu / got["tokens"], "wall_s": time.perf_counter() - t0,
            "load_before": load0, "load_after": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tasks", nargs="+", default=["pretrain", "grpo"], choices=["pretrain", "grpo"])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    print(f"bench/scale.py: {os.cpu_count()} CPUs, {args.threads} thread(s) per process, load average"
          f" {os.getloadavg()[0]:.1f}; rounds alternate {args.nproc}", flush=True)
    results: dict = {}
    for task in args.tasks:
        runs: dict[int, list[dict]] = {n: [] for n in args.nproc}
        for r in range(args.rounds):
            for n in args.nproc:
                x = run(task, n, args)
                runs[n].append(x)
                print(f"  {task} round {r + 1}: {n} process(es) {x['tokens_per_s']:8.0f} tokens/s,"
                      f" {x['cpu_s_per_1k_tokens']:.3f} CPU s / 1k tokens (load {x['load_before']:.1f} ->"
                      f" {x['load_after']:.1f}, {x['wall_s']:.0f} s)", flush=True)
        base = statistics.median(x["tokens_per_s"] for x in runs[args.nproc[0]])
        base_cpu = statistics.median(x["cpu_s_per_1k_tokens"] for x in runs[args.nproc[0]])
        results[task] = {}
        for n in args.nproc:
            tps = statistics.median(x["tokens_per_s"] for x in runs[n])
            cpu = statistics.median(x["cpu_s_per_1k_tokens"] for x in runs[n])
            results[task][n] = {"tokens_per_s": tps, "tokens_per_s_per_rank": tps / n,
                                "efficiency": tps / (n * base) if args.nproc[0] == 1 else None,
                                "cpu_s_per_1k_tokens": cpu, "cpu_overhead": cpu / base_cpu,
                                "load": [round(x["load_before"], 2) for x in runs[n]], "runs": runs[n]}
            eff = results[task][n]["efficiency"]
            print(f"{task}: {n} process(es): {tps:.0f} tokens/s, {tps / n:.0f} per rank"
                  + (f", scaling efficiency {eff:.0%}" if eff is not None else "")
                  + f"; {cpu:.3f} CPU s / 1k tokens ({cpu / base_cpu:.2f}x one process's)", flush=True)
    print(json.dumps({"threads_per_process": args.threads, "cpus": os.cpu_count(), "results": results}))


if __name__ == "__main__":
    main()
