"""Benchmark: a training stage's steps next to a competing CPU-bound process, per thread setting.

    python bench/threads.py [--rounds 3] [--steps 16] [--params params.yaml] [--stage pretrain]

The step is the stage's own: its model and batch size from params.yaml (vocab_size from
`tokenizer.vocab_size`, as the tokenizer stage makes it), llm/nn/optim.py's AdamW and
llm/train/trainer.py's lm_loss, forward + backward + optimizer step on random tokens, fp32 on the CPU.
A "stage" here is --steps such steps (after one warm-up step at the start of the run), timed as a
whole; the three settings' stages run side by side, step i of each (in rotated order) before
step i + 1 of any, so that the machine's load, which changes by the second on a shared machine,
hits all three alike.

Conditions, rotated each round:
  idle      nothing started by the bench (the machine's own load is recorded with every figure)
  busy      one CPU-bound process (a Python loop) running beside the whole stage
  arriving  that process starts after a third of the stage's steps, once `auto` has chosen
Thread settings:
  auto   common.num_threads: auto as the training loop runs it (llm/threads.py auto_tuner): the
         starting count from the load rule, then ThreadTuner between steps among the stage's
         candidate counts (one thread throughout for a stage that has only one); without the
         loop's check of which counts train one thread's bits (the check at the end says that)
  1      one thread
  all    one thread per usable CPU (what torch does by default)
Reported per condition: seconds per stage for each setting, and `auto_over_best_fixed`, auto's
stage time over the faster of 1 and all threads in the same round (min/median/max of the
per-round ratios; target <= 1.15), with the steps auto ran at each count.
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
from llm.nn.model import GPT  # noqa: E402
from llm.nn.optim import build_optimizer  # noqa: E402
from llm.threads import auto_tuner, usable_cpus  # noqa: E402
from llm.train.trainer import lm_loss  # noqa: E402


def train_step(model: GPT, opt, batch: dict) -> None:
    loss_sum, n = lm_loss(model, batch)
    (loss_sum / n).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def stages_seconds(model: GPT, opt, batch: dict, settings: list[str], steps: int, usable: int, stage: str,
                   arrive_at: int | None) -> tuple[dict[str, float], dict[int, int]]:
    """One stage of `steps` steps per thread setting, run side by side: step i of every setting,
    in an order rotated each step, before step i + 1 of any, so that a change of the machine's
    load hits all of them alike. A competitor starts before step `arrive_at` (None: never).
    Returns ({setting: seconds of its steps}, {count: steps auto ran with it})."""
    tuner = auto_tuner(stage, say=lambda m: None)  # None: the stage stays on one thread
    fixed = {"1": 1, "all": usable}
    secs, used, hog = {s: 0.0 for s in settings}, {}, None
    try:
        for i in range(steps):
            if i == arrive_at:
                hog = competitor()
            for s in rotations(settings, steps)[i]:
                n = fixed[s] if s != "auto" else tuner.before_step() if tuner is not None else 1
                torch.set_num_threads(n)  # the other settings changed it since the tuner last did
                t0 = time.perf_counter()
                train_step(model, opt, batch)
                dt = time.perf_counter() - t0
                secs[s] += dt
                if s == "auto":
                    if tuner is not None:
                        tuner.after_step(dt)
                    used[n] = used.get(n, 0) + 1
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return secs, used


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
    """One CPU-bound process, given 0.5 s to be running before anything is measured; it spins
    until this process is gone, so that a killed bench leaves no spinner behind."""
    p = subprocess.Popen([sys.executable, "-c", "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"])
    time.sleep(0.5)
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
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

    settings, conds = ["auto", "1", "all"], ["idle", "busy", "arriving"]
    t = {c: {s: [] for s in settings} for c in conds}
    used: dict[str, list[dict]] = {c: [] for c in conds}
    torch.set_num_threads(usable)
    train_step(model, opt, batch)  # warm-up: first-call costs out of the timings
    for r in range(args.rounds):
        for cond in rotations(conds, args.rounds)[r]:
            hog = competitor() if cond == "busy" else None
            try:
                secs, counts = stages_seconds(model, opt, batch, settings, args.steps, usable, args.stage,
                                              args.steps // 3 if cond == "arriving" else None)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            for s in settings:
                t[cond][s].append(secs[s])
            used[cond].append({str(k): v for k, v in sorted(counts.items())})
            print(f"round {r + 1} {cond}: s/stage " + ", ".join(f"{s} {t[cond][s][-1]:.2f}" for s in settings)
                  + f"; auto ran {used[cond][-1]}", flush=True)

    res = {"bench": "threads", "stage": args.stage, "n_params": model.n_params(), "batch_size": cfg.batch_size,
           "seq_len": mcfg.seq_len, "steps": args.steps, "rounds": args.rounds, "usable_cpus": usable,
           "auto_threads_steps": used, "target_auto_over_best_fixed": 1.15}
    for c in conds if args.rounds else ():  # --rounds 0: the reproducibility check alone
        for s in settings:
            res[f"s_per_stage_{c}_{s}"] = summary(t[c][s])
        best = [min(a, b) for a, b in zip(t[c]["1"], t[c]["all"])]
        res[f"auto_over_best_fixed_{c}"] = ratios(t[c]["auto"], best)
        res[f"all_over_1_{c}"] = ratios(t[c]["all"], t[c]["1"])
        print(f"{c:>8}: s/stage " + ", ".join(f"{s} {show(res[f's_per_stage_{c}_{s}'])}" for s in settings)
              + f"; auto / best fixed {show(res[f'auto_over_best_fixed_{c}'], 'x')};"
              f" all / 1 {show(res[f'all_over_1_{c}'], 'x')}")
    if args.rounds:
        res["meets_target"] = all(res[f"auto_over_best_fixed_{c}"]["median"] <= 1.15 for c in conds)
    if args.bitwise_steps:
        ref = weights_after(mcfg, cfg, batch, 1, args.bitwise_steps)
        res["bitwise_same_as_1_thread"] = {t: weights_after(mcfg, cfg, batch, t, args.bitwise_steps) == ref
                                           for t in (2, 3, 4)}
        print(f"after {args.bitwise_steps} steps, weights bit-identical to 1 thread's: {res['bitwise_same_as_1_thread']}")
    res["machine"] = machine(load0)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
