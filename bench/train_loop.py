"""Benchmark: the full training loop (llm/train/trainer.py) against a bare step, same model, same run.

    python bench/train_loop.py [--rounds 3] [--steps 20] [--device auto] [--n-layer 4 --n-embd 128 ...]

Both sides train the same GPT (same config, same initial weights) with the same AdamW
(llm.nn.optim.build_optimizer) on batches of the same shape:

  bare   for each step: grad_accum x (forward, loss, backward) on batches sampled before the
         clock starts (a new one for every micro-batch, as the loop gets) and already on the
         device, optimizer.step(), zero_grad(); one synchronize at the end. The loss is the
         trainer's own (llm/train/trainer.py lm_loss: the blocked cross-entropy of llm/nn/losses.py),
         scaled as the trainer scales it (sum over the step's tokens / their number), so the
         two sides differ only by the loop around them.
  loop   llm.train.trainer.train(): sampling windows from a token array (WindowSampler), moving
         them to the device, token-weighted accumulation, grad-norm clipping, the
         non-finite check (one host sync per step), the LR schedule, the per-step TSV row,
         TensorBoard every log_every steps, the tqdm bar (to /dev/null). No evaluation, and
         one checkpoint at the end (both periodic and configured per stage).

Both are timed over `steps` steps after W warm-up steps: the bare one with a clock around
its loop, the full loop from the `elapsed_s` column of its per-step rows (wall time at the
end of each step, after the previous row was written), so start-up (resume scan,
TensorBoard import) and the final checkpoint are outside the window. Sides alternate, the
first side swapped every round (bare loop, loop bare, ...), `--rounds` times. Reported:
overhead % = (loop - bare) / bare from the medians, and min/median/max of the per-round
(paired) overheads; on a shared, noisy machine use more rounds. Target: < 5 %.

The last line of output is JSON with every figure and the machine's load (bench/common.py).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import loadavg, machine, summary  # noqa: E402
from llm.config import CommonConfig, ModelConfig, TrainConfig  # noqa: E402
from llm.data.batching import WindowSampler  # noqa: E402
from llm.nn.model import GPT  # noqa: E402
from llm.nn.optim import build_optimizer  # noqa: E402
from llm.runtime import Runtime, resolve_device, resolve_dtype  # noqa: E402
from llm.train.monitor import Plots  # noqa: E402
from llm.train.trainer import lm_loss, train  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_steps(model: GPT, cfg: TrainConfig, rt: Runtime, batches: list[dict], warmup: int, steps: int) -> float:
    """Seconds per bare step (fwd + bwd x grad_accum, optimizer.step), after `warmup` steps;
    `batches` holds (warmup + steps) x grad_accum micro-batches, used in turn. (One batch used
    again and again made the bare side 6-12% slower here than fresh ones: a bench artefact.)"""
    opt = build_optimizer(model, cfg, rt.device)
    micro = iter([{k: v.to(rt.device) for k, v in b.items()} for b in batches])
    n_tokens = cfg.grad_accum * batches[0]["targets"].numel()  # the trainer divides the summed loss by this
    model.train()

    def step():
        for _ in range(cfg.grad_accum):
            b = next(micro)
            with rt.autocast():
                loss_sum, _ = lm_loss(model, b)
            (loss_sum / n_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    _sync(rt.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(rt.device)
    return (time.perf_counter() - t0) / steps


def loop_step_seconds(model: GPT, cfg: TrainConfig, rt: Runtime, tokens: np.ndarray, seq_len: int,
                      warmup: int) -> float:
    """Seconds per loop iteration after `warmup` steps, from the rows' elapsed_s (one train() call)."""
    with tempfile.TemporaryDirectory() as d, open(os.devnull, "w") as null, contextlib.redirect_stderr(null), \
            contextlib.redirect_stdout(null):
        src = WindowSampler(tokens, seq_len=seq_len, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, seed=0)
        res = train(model, cfg, rt, stage="bench", seed=0, batches=src, val_batches=None, run_dir=Path(d) / "run",
                    fingerprint="bench", plots=Plots(tsv=Path(d) / "bench.tsv", tb_dir=Path(d) / "tb"), progress=True)
    h = res.train_history  # row i is written after step i + 1 finished
    return (h[-1]["elapsed_s"] - h[warmup - 1]["elapsed_s"]) / (len(h) - warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    common = CommonConfig(seed=0, device=args.device, dtype=args.dtype, nproc=1, num_threads=args.threads,
                          cpu_kernels=True)
    device = resolve_device(common)
    rt = Runtime(device=device, dtype=resolve_dtype(common, device))
    mcfg = ModelConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                       n_kv_head=args.n_head, n_embd=args.n_embd)
    base = GPT(mcfg, seed=0)
    tokens = np.random.default_rng(0).integers(0, args.vocab_size, 2_000_000).astype(np.uint16)
    common_cfg = dict(batch_size=args.batch_size, grad_accum=args.grad_accum, lr=3e-4, min_lr=3e-5,
                      warmup_steps=1, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, eval_batches=1,
                      log_every=10, keep_checkpoints=2, nonfinite_policy="skip", nonfinite_budget=10,
                      activation_checkpointing=False, compile=False)
    W = args.warmup

    def tcfg(max_steps: int) -> TrainConfig:
        return TrainConfig(max_steps=max_steps, eval_every=10**9, checkpoint_every=10**9, **common_cfg)

    sampler = WindowSampler(tokens, seq_len=args.seq_len, batch_size=args.batch_size, seed=1)
    batches = [sampler.next_batch() for _ in range((W + args.steps) * args.grad_accum)]
    print(f"bench: {base.summary()}", flush=True)
    print(f"bench: {device}, {rt.dtype}, batch {args.batch_size} x {args.seq_len}, grad_accum {args.grad_accum},"
          f" {torch.get_num_threads()} threads; {args.rounds} rounds of {args.steps} steps", flush=True)
    load0 = loadavg()
    bare, loop = [], []
    for r in range(args.rounds):
        for side in (("bare", "loop") if r % 2 == 0 else ("loop", "bare")):
            if side == "bare":
                b = bare_steps(copy.deepcopy(base).to(device), tcfg(W + args.steps), rt, batches, W, args.steps)
            else:
                per = loop_step_seconds(copy.deepcopy(base), tcfg(W + args.steps), rt, tokens, args.seq_len, W)
        bare.append(b)
        loop.append(per)
        print(f"round {r + 1}: bare {1000 * b:.1f} ms/step, loop {1000 * per:.1f} ms/step"
              f" ({100 * (per - b) / b:+.1f}%)", flush=True)
    mb, ml = statistics.median(bare), statistics.median(loop)
    tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
    overhead = 100 * (ml - mb) / mb
    paired_all = [100 * (lp - b) / b for b, lp in zip(bare, loop)]
    paired = statistics.median(paired_all)
    print(f"median: bare {1000 * mb:.1f} ms/step ({tokens_per_step / mb:.0f} tokens/s),"
          f" loop {1000 * ml:.1f} ms/step ({tokens_per_step / ml:.0f} tokens/s): overhead {overhead:+.2f}%"
          f" (median of paired rounds {paired:+.2f}%; target < 5%)")
    print(json.dumps({"bench": "train_loop", "device": str(device), "dtype": str(rt.dtype).replace("torch.", ""),
                      "threads": torch.get_num_threads(), "n_params": base.n_params(),
                      "batch_size": args.batch_size, "grad_accum": args.grad_accum, "seq_len": args.seq_len,
                      "steps": args.steps, "rounds": args.rounds,
                      "bare_ms_per_step": [round(1000 * x, 3) for x in bare],
                      "loop_ms_per_step": [round(1000 * x, 3) for x in loop],
                      "bare_ms_median": round(1000 * mb, 3), "loop_ms_median": round(1000 * ml, 3),
                      "overhead_pct": round(overhead, 2),
                      "paired_overhead_pct_median": round(paired, 2), "paired_overhead_pct": summary(paired_all, 2),
                      "loss": "llm.train.trainer.lm_loss on both sides",
                      "target_pct": 5.0, "meets_target": overhead < 5.0, "machine": machine(load0)}))


if __name__ == "__main__":
    main()
