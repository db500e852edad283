"""Benchmark: a training step next to a competing CPU-bound process, per thread setting.

    python bench/threads.py [--rounds 3] [--steps 4] [--params params.yaml] [--stage pretrain]

The step is the stage's own: its model and batch size from params.yaml (vocab_size from
`tokenizer.vocab_size`, as the tokenizer stage makes it), llm/optim.py's AdamW and
llm/trainer.py's lm_loss, forward + backward + optimizer step on random tokens, fp32 on the CPU.

Conditions, alternating each round:
  idle   nothing started by the bench (the machine's own load is recorded with every figure)
  busy   one CPU-bound process (`while True: pass`) running beside the step
Thread settings, in rotated order within each condition:
  auto   common.num_threads: auto, decided at the start of the condition the way a stage decides
         it (llm/threads.py: usable CPUs minus those other processes keep busy)
  1      one thread
  all    one thread per usable CPU (what torch does by default)
Reported per setting: seconds per step (median of --steps after one warm-up step) in each
condition, and the slowdown busy / idle per round (min/median/max). The target for auto is a
slowdown of at most 1.2x. Also: what auto chose in each condition, and `best_fixed_idle`, the
faster of 1 and all threads on the idle machine, against which auto's busy step is compared too
(no thread count can give a step more than the CPUs the competitor leaves it).
Then, reproducibility: the same model from the same initial weights trained --bitwise-steps
steps on the same batches with 1, 2, 3 and 4 threads (more threads than CPUs only costs time);
`bitwise_same_as_1_thread` says which counts end with weights bit-identical to one thread's.

The last line is JSON with every figure and the machine's load (bench/common.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import loadavg, machine, ratios, rotations, show, summary  # noqa: E402
from llm.config import ModelConfig, load_sections  # noqa: E402
from llm.model import GPT  # noqa: E402
from llm.optim import build_optimizer  # noqa: E402
from llm.threads import busy_cpus, choose_num_threads, usable_cpus  # noqa: E402
from llm.trainer import lm_loss  # noqa: E402


def step_seconds(model: GPT, opt, batch: dict, steps: int) -> float:
    """Median wall seconds of `steps` training steps, after one warm-up step."""
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        loss_sum, n = lm_loss(model, batch)
        (loss_sum / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weights_after(mcfg: ModelConfig, cfg, batch: dict, threads: int, steps: int) -> str:
    """sha256 of the weights after `steps` steps from seed 0 with `threads` torch threads."""
    torch.set_num_threads(threads)
    model = GPT(mcfg, seed=0)
    opt = build_optimizer(model, cfg, "cpu")
    for _ in range(steps):
        loss_sum, n = lm_loss(model, batch)
        (loss_sum / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def competitor() -> subprocess.Popen:
    """One CPU-bound process; given 0.5 s to be running before anything is measured."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--stage", default="pretrain", help="a training stage whose `model` and `batch_size` to use")
    ap.add_argument("--bitwise-steps", type=int, default=3, help="steps of the reproducibility check; 0 = skip it")
    args = ap.parse_args()
    load0 = loadavg()
    sec = load_sections(["tokenizer", args.stage], args.params)
    cfg = sec[args.stage]
    mcfg = ModelConfig(**{**cfg.model.__dict__, "vocab_size": sec["tokenizer"].vocab_size})
    model = GPT(mcfg, seed=0)
    opt = build_optimizer(model, cfg, "cpu")
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, mcfg.seq_len + 1), generator=g)
    batch = {"idx": idx[:, :-1], "targets": idx[:, 1:]}
    usable = usable_cpus()
    print(f"bench: {args.stage} step, {model.summary()}; batch {cfg.batch_size} x {mcfg.seq_len};"
          f" {usable} usable CPUs; load {load0}", flush=True)

    settings = ["auto", "1", "all"]
    t = {c: {s: [] for s in settings} for c in ("idle", "busy")}
    chosen: dict[str, list[dict]] = {"idle": [], "busy": []}
    for r in range(args.rounds):
        for cond in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
            hog = competitor() if cond == "busy" else None
            try:
                busy = busy_cpus()
                auto = choose_num_threads(usable, busy)
                chosen[cond].append({"busy_cpus": round(busy, 2), "threads": auto})
                for s in rotations(settings, args.rounds)[r]:
                    torch.set_num_threads(auto if s == "auto" else 1 if s == "1" else usable)
                    t[cond][s].append(step_seconds(model, opt, batch, args.steps))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            print(f"round {r + 1} {cond}: auto chose {auto} (busy {busy:.2f}); s/step "
                  + ", ".join(f"{s} {t[cond][s][-1]:.3f}" for s in settings), flush=True)

    res = {"bench": "threads", "stage": args.stage, "n_params": model.n_params(), "batch_size": cfg.batch_size,
           "seq_len": mcfg.seq_len, "steps": args.steps, "rounds": args.rounds, "usable_cpus": usable,
           "auto_chose": chosen, "target_slowdown": 1.2}
    for s in settings:
        res[f"s_per_step_idle_{s}"] = summary(t["idle"][s])
        res[f"s_per_step_busy_{s}"] = summary(t["busy"][s])
        res[f"slowdown_{s}"] = ratios(t["busy"][s], t["idle"][s])
    best_idle = [min(a, b) for a, b in zip(t["idle"]["1"], t["idle"]["all"])]
    res["auto_busy_over_best_fixed_idle"] = ratios(t["busy"]["auto"], best_idle)
    res["all_busy_over_1_busy"] = ratios(t["busy"]["all"], t["busy"]["1"])
    res["all_idle_over_1_idle"] = ratios(t["idle"]["all"], t["idle"]["1"])
    res["meets_target"] = res["slowdown_auto"]["median"] <= 1.2
    for s in settings:
        print(f"{s:>4}: idle {show(res[f's_per_step_idle_{s}'], ' s')}, busy {show(res[f's_per_step_busy_{s}'], ' s')};"
              f" slowdown busy/idle {show(res[f'slowdown_{s}'], 'x')}")
    print(f"auto busy / best fixed count idle: {show(res['auto_busy_over_best_fixed_idle'], 'x')};"
          f" all threads / 1 thread: idle {show(res['all_idle_over_1_idle'], 'x')}, busy"
          f" {show(res['all_busy_over_1_busy'], 'x')}")
    if args.bitwise_steps:
        ref = weights_after(mcfg, cfg, batch, 1, args.bitwise_steps)
        res["bitwise_same_as_1_thread"] = {t: weights_after(mcfg, cfg, batch, t, args.bitwise_steps) == ref
                                           for t in (2, 3, 4)}
        print(f"after {args.bitwise_steps} steps, weights bit-identical to 1 thread's: {res['bitwise_same_as_1_thread']}")
    res["machine"] = machine(load0)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
