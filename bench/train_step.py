"""Benchmark: training-step throughput of our GPT against nanoGPT's, same run.

    python bench/train_step.py --nanogpt /path/to/nanoGPT [--rounds 5] [--steps 3] [--threads 1 0] [--clock wall]

nanoGPT is imported from a local checkout given on the command line (its model.py; never
copied into this repository), e.g. `git clone https://github.com/karpathy/nanoGPT /tmp/nanogpt`.

Size: 6 layers, 384 wide, 6 heads, vocab 8192, batch 8 x 256 tokens, fp32 on the CPU, no
dropout, no biases. One step = forward + cross-entropy + backward + AdamW step; the loss is
each model's own (nanoGPT's F.cross_entropy in its forward; ours llm/train/trainer.py's lm_loss, the
one the pipeline trains with), and so is the optimizer (`--optimizer own`, the default:
nanoGPT's configure_optimizers, which takes torch's foreach AdamW on the CPU and the fused one
only on CUDA; ours llm/nn/optim.py's build_optimizer, fused on the CPU too). `--optimizer same`
gives every model torch's default AdamW instead, to separate model cost from optimizer cost.
Models:
  nanogpt       nanoGPT's GPT (LayerNorm, learned positions, GELU MLP 4x, tied embeddings)
  ours_sdpa     our default architecture (RMSNorm, RoPE, SwiGLU 1024 = the same parameter
                count as GELU 4x, tied), attn_impl sdpa
  ours_manual   the same with the written-out attention
  ours_nanolike our model configured as nanoGPT (layernorm, learned, gelu), sdpa: separates
                architecture cost from implementation cost
After one untimed warm-up step per model, each round measures the fp32 matmul ceiling (the
best GFLOP/s of the step's GEMM shapes) and then interleaves single steps of all models
(A B C D, B C D A, ... --steps times), so that a change in machine load hits every model
alike. Reported: tokens/s min/median/max over rounds, the per-round paired ratio to nanoGPT
(min/median/max), and MFU = flops_per_token * tokens/s / ceiling, with flops_per_token =
6 N + 12 L H hd T for every model (nanoGPT's own formula; N without the position table).
The machine is shared: trust the paired ratios, not single absolute times. `--clock cpu`
times with process CPU time instead of wall time (meaningful with --threads 1: it ignores
time the process spends preempted by other work). Each thread count in --threads (default 1,
then every usable CPU: 0) is a separate set of rounds. The last line is JSON with every figure
and the machine's load (bench/common.py).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import loadavg, machine, summary  # noqa: E402
from llm.config import ModelConfig, TrainConfig  # noqa: E402
from llm.nn.model import GPT  # noqa: E402
from llm.nn.optim import build_optimizer  # noqa: E402
from llm.threads import usable_cpus  # noqa: E402
from llm.train.trainer import lm_loss  # noqa: E402

L, H, C, V, B, T = 6, 6, 384, 8192, 8, 256
LR, BETAS, WD = 1e-4, (0.9, 0.95), 0.1  # every model's AdamW, whichever set-up builds it


def load_nanogpt(path: str):
    f = Path(path) / "model.py"
    if not f.is_file():
        raise SystemExit(f"--nanogpt {path}: no model.py there; pass a nanoGPT checkout"
                         f" (git clone https://github.com/karpathy/nanoGPT)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # a benchmark reference client, loaded from the user's checkout
    return mod


def ours_loss(m: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy the way the pipeline computes it (llm/train/trainer.py lm_loss)."""
    loss_sum, n = lm_loss(m, {"idx": x, "targets": y})
    return loss_sum / n


def build(nanogpt_path: str, optimizer: str = "own") -> dict:
    """name -> (step function, flops per token, parameter count)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    ng = load_nanogpt(nanogpt_path)
    torch.manual_seed(0)  # nanoGPT initialises from the global RNG
    nano = ng.GPT(ng.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C, dropout=0.0, bias=False))
    models = {"nanogpt": (nano, lambda m: m(x, y)[1],
                          6 * nano.get_num_params(non_embedding=True) + 12 * L * H * (C // H) * T,
                          nano.get_num_params(non_embedding=False))}
    base = dict(vocab_size=V, seq_len=T, n_layer=L, n_head=H, n_kv_head=H, n_embd=C)
    variants = {"ours_sdpa": {}, "ours_manual": {"attn_impl": "manual"},
                "ours_nanolike": {"norm": "layernorm", "pos": "learned", "mlp": "gelu"}}
    for name, kw in variants.items():
        m = GPT(ModelConfig(**base, **kw))
        models[name] = (m, lambda m: ours_loss(m, x, y), m.flops_per_token(), m.n_params())
    hyper = TrainConfig(max_steps=1, batch_size=B, grad_accum=1, lr=LR, min_lr=LR, warmup_steps=0,
                        weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], grad_clip=0.0, eval_every=1, eval_batches=1,
                        log_every=1, checkpoint_every=1, keep_checkpoints=2, nonfinite_policy="raise",
                        nonfinite_budget=0, activation_checkpointing=False, compile=False)
    out = {}
    for name, (m, loss_fn, fpt, n) in models.items():
        m.train()
        if optimizer == "same":
            opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
        elif name == "nanogpt":
            with contextlib.redirect_stdout(io.StringIO()):  # it prints its group sizes
                opt = m.configure_optimizers(weight_decay=WD, learning_rate=LR, betas=BETAS, device_type="cpu")
        else:
            opt = build_optimizer(m, hyper, "cpu")

        def step(m=m, loss_fn=loss_fn, opt=opt):
            loss = loss_fn(m)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out[name] = (step, fpt, n)
    return out


def matmul_ceiling(clock=time.perf_counter, reps: int = 5) -> float:
    """Best fp32 GEMM FLOP/s over the step's shapes (tokens x C @ C x {3C, 4C, 8/3C x 2, V})."""
    best = 0.0
    for n in (3 * C, 4 * C, 2048, V):
        a, b = torch.randn(B * T, C), torch.randn(C, n)
        a @ b
        t0 = clock()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * B * T * C * n * reps / (clock() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", required=True, help="path to a nanoGPT checkout (its model.py is imported)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model per round")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="torch threads; 0 = every usable CPU")
    ap.add_argument("--skip", nargs="*", default=[], help="models to leave out, e.g. ours_nanolike")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--optimizer", choices=["own", "same"], default="own",
                    help="own: each model's own AdamW set-up (default); same: torch's default AdamW for all")
    args = ap.parse_args()
    load0 = loadavg()
    models = {k: v for k, v in build(args.nanogpt, args.optimizer).items() if k not in args.skip}
    names = list(models)
    result = {"bench": "train_step", "shape": {"n_layer": L, "n_head": H, "n_embd": C, "vocab_size": V,
                                               "batch": B, "seq_len": T},
              "clock": args.clock, "optimizer": args.optimizer, "rounds": args.rounds,
              "steps_per_round": args.steps, "runs": {}}
    for n_threads in args.threads:
        torch.set_num_threads(n_threads or usable_cpus())
        result["runs"][f"threads{torch.get_num_threads()}"] = rounds(models, names, args.rounds, args.steps,
                                                                      args.clock)
    result["machine"] = machine(load0)
    print(json.dumps(result))


def rounds(models: dict, names: list[str], n_rounds: int, steps: int, clock_name: str) -> dict:
    """`n_rounds` rounds of `steps` steps of every model, rotated; tokens/s, MFU, ratios."""
    for step, _, _ in models.values():
        step()  # warm-up
    tps: dict[str, list[float]] = {k: [] for k in names}
    ceilings: list[float] = []
    clock = time.perf_counter if clock_name == "wall" else time.process_time
    T_ = torch.get_num_threads()
    for r in range(n_rounds):
        ceilings.append(matmul_ceiling(clock))
        spent = {k: 0.0 for k in names}
        for s in range(steps):
            for i in range(len(names)):
                name = names[(i + s + r) % len(names)]  # rotate who goes first
                t0 = clock()
                models[name][0]()
                spent[name] += clock() - t0
        for name in names:
            tps[name].append(steps * B * T / spent[name])
        print(f"threads {T_} round {r + 1}/{n_rounds}: ceiling {ceilings[-1] / 1e9:.1f} GFLOP/s; "
              + ", ".join(f"{k} {tps[k][-1]:.0f} tok/s" for k in names), flush=True)
    out = {"threads": T_, "matmul_ceiling_gflops": summary([c / 1e9 for c in ceilings], 1), "models": {}}
    print(f"\nthreads {T_}\n{'model':<14} {'params':>10} {'tok/s min/med/max':>22} {'MFU med':>8}"
          f" {'vs nanoGPT min/med/max':>24}")
    for name in names:
        _, fpt, n = models[name]
        mfu = [fpt * t / c for t, c in zip(tps[name], ceilings)]
        ratio = [a / b for a, b in zip(tps[name], tps["nanogpt"])] if "nanogpt" in tps else []
        s, rs = summary(tps[name], 1), summary(ratio, 3) if ratio else None
        out["models"][name] = {"n_params": n, "flops_per_token": fpt, "tokens_per_s": s,
                               "mfu": summary(mfu, 3), "ratio_vs_nanogpt": rs}
        rtxt = f"{rs['min']:.2f}/{rs['median']:.2f}/{rs['max']:.2f}x" if rs else "-"
        print(f"{name:<14} {n:>10,} {s['min']:>6.0f}/{s['median']:>6.0f}/{s['max']:>6.0f}"
              f" {statistics.median(mfu):>8.1%} {rtxt:>24}", flush=True)
    return out


if __name__ == "__main__":
    main()
