"""Benchmark: the 77m preset trained by our own loop on one CUDA GPU: throughput, MFU, memory, resume.

    python bench/gpu_77m.py [--compile] [--steps 300] [--batch-size 32] [--seq-len 1024] [--vocab 32768]
                            [--tokens data/tokens/train.bin] [--resume-steps 20]

The one prepared script a session with a GPU runs to record this project's GPU figures
(written for an H200 lent for a few minutes: at the defaults it should take well under
8 minutes there, most of it start-up and, with --compile, compilation; it prints the
elapsed time of every phase). Without a CUDA device it refuses (exit 2) unless
`--device cpu` is given: that mode only checks the plumbing, with a small preset, e.g.

    python bench/gpu_77m.py --device cpu --preset tiny --steps 6 --warmup 2 --batch-size 2 --seq-len 64 \\
        --vocab 512 --resume-steps 2

What it does, all through `llm.trainer.train` (the loop every stage uses: WindowSampler
batches copied to the device, token-weighted accumulation, grad clipping, the non-finite
check with its one host sync per step, the LR schedule, the per-step TSV row, the final
checkpoint), so the figures measure our code and not a bare loop:

1. Throughput. GPT `--preset` (default 77m: 8 layers x 512, 8 heads; the model section of
   the gpu-77m profile otherwise: RMSNorm, RoPE, SwiGLU, tied embeddings, SDPA attention)
   with `--vocab` and `--seq-len`, trained `--steps` optimizer steps of `--batch-size`
   sequences in bf16 autocast (fp32 on CPU), on uniformly random tokens, or with `--tokens`
   on random windows of a token shard (llm.batching.open_tokens + WindowSampler, as the
   pretrain stage does; the dtype and vocab_size come from meta.json beside it).
   Optimizer knobs (lr, betas, weight decay, clip) are the gpu-77m profile's; its warm-up
   is cut to steps // 10. No evaluation; no checkpoint before the last step.
   - tokens/s: tokens of steps W+1..N over the wall time between the end of step W and
     the end of step N (the `elapsed_s` column of the loop's own rows), W = `--warmup`
     (compilation and allocator warm-up happen there). The final checkpoint is outside.
   - MFU = model.flops_per_token() (6 N + 12 L H hd T, training FLOPs per token, the
     formula the trainer uses) x tokens/s / llm.monitor.peak_flops(device, bf16), the
     card's dense bf16 datasheet peak (H100/H200: 989.4 TFLOP/s). Also reported against a
     bf16 8192^3 matmul measured in the same process (what the card really gives here).
   - memory: torch.cuda.max_memory_allocated over the run (and max_memory_reserved, and
     the device's used memory from cudaMemGetInfo, which includes the CUDA context),
     against `llm.profile.memory_estimate` of the gpu-77m profile with its pretrain
     section set to this run's model, batch and seq_len. The estimate includes ~1 GiB of
     context and slack that max_memory_allocated does not see, so allocated is compared
     with (estimate - 1 GiB) and device-used with the whole estimate.
2. Resume on the device (`--resume-steps` k, 0 = skip; eager even with --compile, to keep
   the run short). A run configured for 2k steps gets SIGTERM during step k (the trainer's
   real preemption path: finish the step, write ckpt-k, exit 143); a second train() call
   resumes it from the checkpoint and runs to 2k. Its losses of steps k+1..2k are compared
   with those of an uninterrupted 2k-step run from the same initial weights. On CPU the
   trainer promises bitwise equality; on CUDA it does not (atomics in some kernels), so
   the check passes when max |loss_resumed - loss_ref| / loss_ref <= `--resume-rtol`
   (default 1e-3); max abs diff and bitwise equality are reported as well.

Prints a table and, as the last line, one JSON object with every figure. Exit status:
0 done (resume check passed or skipped), 1 the resume check failed, 2 refused (no CUDA
without --device cpu, bad arguments, bf16 not supported, --tokens missing).
Writes nothing outside a temporary directory (checkpoints, TSV), removed at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from llm.batching import WindowSampler, open_tokens  # noqa: E402
from llm.config import PRESETS, ModelConfig, TrainConfig  # noqa: E402
from llm.model import GPT  # noqa: E402
from llm.monitor import peak_flops  # noqa: E402
from llm.profile import memory_estimate, render  # noqa: E402
from llm.monitor import Plots  # noqa: E402
from llm.runtime import Runtime  # noqa: E402
from llm.trainer import lm_loss, train  # noqa: E402

PROFILE = "gpu-77m"
GIB = 2**30
PLUMBING = ("python bench/gpu_77m.py --device cpu --preset tiny --steps 6 --warmup 2 --batch-size 2"
            " --seq-len 64 --vocab 512 --resume-steps 2")


def refuse(msg: str) -> None:
    print(f"gpu_77m: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda (default; refused without a GPU) or cpu (plumbing check only, fp32)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="77m", help="model size (default 77m)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocab_size (default 32768, as gpu-77m);"
                    " with --tokens, meta.json's vocab_size is used instead")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step (grad_accum 1)")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps of the throughput run")
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of tokens/s and MFU")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (train.compile: true)")
    ap.add_argument("--tokens", type=Path, default=None,
                    help="a token shard, e.g. data/tokens/train.bin (meta.json beside it); default: random tokens")
    ap.add_argument("--resume-steps", type=int, default=20,
                    help="k of the resume check (k steps, SIGTERM, resume to 2k, vs 2k uninterrupted); 0 = skip")
    ap.add_argument("--resume-rtol", type=float, default=1e-3,
                    help="pass if max |loss diff| / loss over steps k+1..2k is at most this (default 1e-3)")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    args = ap.parse_args(argv)
    problems = []
    if args.steps <= args.warmup:
        problems.append(f"--steps {args.steps} must be above --warmup {args.warmup} (warm-up steps are not timed)")
    if args.warmup < 1:
        problems.append(f"--warmup must be >= 1 (step 1 holds start-up costs), got {args.warmup}")
    for name in ("vocab", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.resume_steps < 0:
        problems.append(f"--resume-steps: must be >= 0 (0 = skip the resume check), got {args.resume_steps}")
    if problems:
        refuse("; ".join(problems))
    return args


def runtime(args: argparse.Namespace) -> Runtime:
    """The device and dtype, or exit 2 with what to do."""
    if args.device == "cpu":
        return Runtime(device=torch.device("cpu"), dtype=torch.float32)  # the trainer's CPU dtype
    if not torch.cuda.is_available():
        refuse(f"needs a CUDA GPU, and torch.cuda.is_available() is False here (torch {torch.__version__},"
               f" CUDA build {torch.version.cuda}). Run it on a machine with an NVIDIA GPU:\n"
               f"    python bench/gpu_77m.py            # add --compile for torch.compile\n"
               f"To check only this script's plumbing on a CPU (tiny model, no GPU figures):\n    {PLUMBING}")
    device = torch.device("cuda", 0)
    if not torch.cuda.is_bf16_supported():
        refuse(f"{torch.cuda.get_device_name(device)} has no bf16; this benchmark measures bf16 training")
    return Runtime(device=device, dtype=torch.bfloat16)


def profile_params(args: argparse.Namespace, vocab: int) -> dict:
    """The gpu-77m profile with its pretrain section set to this run's model, batch and seq_len."""
    params, _ = render(PROFILE, ROOT / "env" / "profiles")
    pre = params["pretrain"]
    sizes = PRESETS[args.preset]
    pre["model"].update(preset=args.preset, **sizes, n_kv_head=sizes["n_head"], seq_len=args.seq_len,
                        vocab_size=vocab)
    pre.update(batch_size=args.batch_size, grad_accum=1, activation_checkpointing=False, compile=args.compile)
    params["tokenizer"]["vocab_size"] = vocab
    return params


def train_config(pre: dict, max_steps: int, compile_: bool) -> TrainConfig:
    """TrainConfig from the profile's pretrain knobs; no eval, no checkpoint before the end."""
    knobs = {f.name: pre[f.name] for f in dataclasses.fields(TrainConfig)}
    knobs.update(max_steps=max_steps, warmup_steps=min(pre["warmup_steps"], max_steps // 10),
                 eval_every=10**9, checkpoint_every=10**9, log_every=max(1, min(50, max_steps)),
                 keep_checkpoints=2, nonfinite_policy="raise", compile=compile_)
    return TrainConfig(**knobs)


def token_source(args: argparse.Namespace) -> tuple[np.ndarray, int, str]:
    """(token array, vocab_size, description): random tokens, or the shard given with --tokens."""
    if args.tokens is None:
        n = max(args.seq_len + 2, 8_000_000)  # windows are drawn at random offsets: size only sets variety
        dtype = np.uint16 if args.vocab <= 2**16 else np.uint32
        tokens = np.random.default_rng(args.seed).integers(0, args.vocab, n, dtype=dtype)
        return tokens, args.vocab, f"{n:,} uniformly random tokens"
    meta_path = args.tokens.parent / "meta.json"
    if not args.tokens.is_file() or not meta_path.is_file():
        refuse(f"--tokens {args.tokens}: need the shard and meta.json beside it (run `dvc repro tokenize`,"
               f" or leave --tokens out to train on random tokens)")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    tokens = open_tokens(args.tokens, meta["dtype"])
    vocab = int(meta["vocab_size"])
    if vocab != args.vocab:
        print(f"gpu_77m: vocab_size {vocab} from {meta_path} (not --vocab {args.vocab})", flush=True)
    return tokens, vocab, f"{args.tokens} ({len(tokens):,} tokens, vocab {vocab})"


def sync(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


def matmul_ceiling(rt: Runtime, n: int = 8192, reps: int = 10) -> float | None:
    """Measured bf16 n^3 matmul FLOP/s on this card (None on CPU)."""
    if rt.device.type != "cuda":
        return None
    a = torch.randn(n, n, device=rt.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=rt.device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(rt)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(rt)
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return flops


def run_train(model: GPT, cfg: TrainConfig, rt: Runtime, tokens: np.ndarray, seed: int, run_dir: Path,
              loss_fn=lm_loss):
    """One llm.trainer.train() call on WindowSampler batches; returns its TrainResult."""
    src = WindowSampler(tokens, seq_len=model.config.seq_len, batch_size=cfg.batch_size, grad_accum=1, seed=seed)
    # the trainer's own messages ("resumed from ...") go to stderr, so stdout holds the table and JSON
    with contextlib.redirect_stdout(sys.stderr):
        return train(model, cfg, rt, stage="bench", seed=seed, batches=src, loss_fn=loss_fn, val_batches=None,
                     run_dir=run_dir, fingerprint="bench-gpu-77m",
                     plots=Plots(tsv=run_dir.parent / f"{run_dir.name}.tsv"), progress=False)


def throughput(h: list[dict], warmup: int) -> tuple[float, float]:
    """(tokens/s, seconds) over steps warmup+1..N from the rows' elapsed_s (end of each step)."""
    secs = h[-1]["elapsed_s"] - h[warmup - 1]["elapsed_s"]
    return (h[-1]["tokens_seen"] - h[warmup - 1]["tokens_seen"]) / secs, secs


def resume_check(args, mcfg: ModelConfig, pre: dict, rt: Runtime, tokens: np.ndarray, tmp: Path) -> dict:
    """k steps, SIGTERM, resume to 2k; losses k+1..2k against an uninterrupted 2k-step run."""
    k = args.resume_steps
    cfg = train_config(pre, 2 * k, compile_=False)
    t0 = time.perf_counter()
    ref = run_train(GPT(mcfg, seed=args.seed), cfg, rt, tokens, args.seed, tmp / "ref")

    calls = [0]

    def term_at_k(model, batch):
        out = lm_loss(model, batch)
        calls[0] += 1
        if calls[0] == k:  # during step k: the loop finishes it, writes ckpt-k and exits 128 + 15
            signal.raise_signal(signal.SIGTERM)
        return out

    exit_code = None
    try:
        run_train(GPT(mcfg, seed=args.seed), cfg, rt, tokens, args.seed, tmp / "run", loss_fn=term_at_k)
    except SystemExit as e:
        exit_code = e.code
    resumed = run_train(GPT(mcfg, seed=args.seed), cfg, rt, tokens, args.seed, tmp / "run")
    secs = time.perf_counter() - t0

    a = [r["loss"] for r in ref.train_history[k:]]
    b = [r["loss"] for r in resumed.train_history[k:]]
    steps_ok = ([r["step"] for r in resumed.train_history] == list(range(1, 2 * k + 1))
                and resumed.resumed_from == k and exit_code == 128 + signal.SIGTERM)
    abs_diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    rel_diff = max(abs(x - y) / abs(y) for x, y in zip(b, a, strict=True))
    return {"resume_k": k, "resume_exit_code": exit_code, "resume_resumed_from": resumed.resumed_from,
            "resume_max_abs_diff": abs_diff, "resume_max_rel_diff": rel_diff,
            "resume_bitwise_equal": a == b, "resume_rtol": args.resume_rtol,
            "resume_pass": bool(steps_ok and rel_diff <= args.resume_rtol), "resume_s": secs,
            "resume_losses_ref": a, "resume_losses_resumed": b}


def fmt(v, spec: str, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    rt = runtime(args)
    if rt.device.type == "cpu" and args.preset in ("77m", "406m"):
        print(f"gpu_77m: --device cpu with preset {args.preset}: this only checks plumbing and will be slow;"
              f" use --preset tiny", flush=True)
    tokens, vocab, data_desc = token_source(args)
    params = profile_params(args, vocab)
    pre = params["pretrain"]
    mcfg = ModelConfig(**pre["model"])
    est = memory_estimate(params)
    est_profile = memory_estimate(render(PROFILE, ROOT / "env" / "profiles")[0])  # as the profile stands
    cfg = train_config(pre, args.steps, args.compile)

    model = GPT(mcfg, seed=args.seed)
    n_params, flops_tok = model.n_params(), model.flops_per_token()
    dev_name = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu"
    peak = peak_flops(rt.device, rt.dtype)
    print(f"gpu_77m: {model.summary()}", flush=True)
    dtype = str(rt.dtype).replace("torch.", "") + (" autocast" if rt.device.type == "cuda" else "")
    print(f"gpu_77m: {dev_name}, {dtype},"
          f" torch {torch.__version__}, compile={args.compile}; batch {args.batch_size} x {args.seq_len};"
          f" {args.steps} steps ({args.warmup} warm-up); data: {data_desc}", flush=True)
    ceiling = matmul_ceiling(rt)
    t_setup = time.perf_counter() - t_start
    print(f"gpu_77m: setup {t_setup:.1f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="gpu_77m-") as d:
        tmp = Path(d)
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(rt.device)
        t0 = time.perf_counter()
        res = run_train(model, cfg, rt, tokens, args.seed, tmp / "main")
        sync(rt)
        t_main = time.perf_counter() - t0
        mem = {}
        if rt.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(rt.device)
            mem = {"mem_peak_allocated_gib": torch.cuda.max_memory_allocated(rt.device) / GIB,
                   "mem_peak_reserved_gib": torch.cuda.max_memory_reserved(rt.device) / GIB,
                   "mem_device_used_gib": (total - free) / GIB, "mem_device_total_gib": total / GIB}
        h = res.train_history
        tps, timed_s = throughput(h, args.warmup)
        step_s = [h[0]["elapsed_s"]] + [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(h, h[1:])]
        print(f"gpu_77m: throughput run {t_main:.1f} s (step 1 {step_s[0]:.2f} s, median step"
              f" {1000 * statistics.median(step_s[args.warmup:]):.1f} ms, final checkpoint included)", flush=True)
        trainer_tps = res.metrics["tokens_per_s"]  # the trainer's own figure: warm-up included
        del model, res
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()

        resume = {}
        if args.resume_steps:
            resume = resume_check(args, mcfg, pre, rt, tokens, tmp)
            print(f"gpu_77m: resume check {resume['resume_s']:.1f} s", flush=True)

    mfu = flops_tok * tps / peak if peak else None
    mfu_ceiling = flops_tok * tps / ceiling if ceiling else None
    est_alloc = est["total_gib"] - 1.0  # the estimate's ~1 GiB context/slack is outside the allocator
    alloc = mem.get("mem_peak_allocated_gib")
    total_s = time.perf_counter() - t_start
    result = {
        "bench": "gpu_77m", "device": dev_name, "dtype": str(rt.dtype).replace("torch.", ""),
        "torch": torch.__version__, "compile": args.compile, "preset": args.preset, "vocab_size": vocab,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
        "data": "random" if args.tokens is None else str(args.tokens),
        "n_params": n_params, "n_params_non_embedding": GPT(mcfg, device="meta").n_params(non_embedding=True),
        "flops_per_token": flops_tok, "tokens_per_s": tps, "timed_s": timed_s,
        "ms_per_step_median": 1000 * statistics.median(step_s[args.warmup:]), "first_step_s": step_s[0],
        "trainer_tokens_per_s_incl_warmup": trainer_tps,
        "peak_flops": peak, "peak_flops_source": "llm.monitor.peak_flops (datasheet dense bf16)" if peak else None,
        "mfu": mfu, "matmul_ceiling_flops": ceiling, "mfu_vs_matmul_ceiling": mfu_ceiling,
        "final_loss": h[-1]["loss"], "ln_vocab": math.log(vocab),
        **mem,
        "mem_estimate_gib": est["total_gib"],
        "mem_estimate_parts_gib": {k: v for k, v in est.items() if k.endswith("_gib") and k != "total_gib"},
        "mem_estimate_profile_as_is_gib": est_profile["total_gib"],
        "mem_allocated_over_estimate": alloc / est_alloc if alloc is not None and est_alloc > 0 else None,
        **resume, "setup_s": t_setup, "main_s": t_main, "total_s": total_s,
    }

    rows = [
        ("parameters", f"{n_params:,} ({result['n_params_non_embedding']:,} non-embedding)"),
        ("flops/token (6N + 12LHhdT)", f"{flops_tok / 1e6:.1f} M"),
        ("tokens/s (steps after warm-up)", f"{tps:,.0f}  ({timed_s:.1f} s timed, "
                                           f"{result['ms_per_step_median']:.1f} ms/step median)"),
        ("MFU vs datasheet bf16 peak", f"{fmt(mfu, '.1%')}  (peak {fmt(peak and peak / 1e12, '.1f', ' TFLOP/s')},"
                                       f" llm.monitor.peak_flops)"),
        ("MFU vs measured bf16 matmul", f"{fmt(mfu_ceiling, '.1%')}  (8192^3 matmul:"
                                        f" {fmt(ceiling and ceiling / 1e12, '.1f', ' TFLOP/s')})"),
        ("peak memory allocated", f"{fmt(alloc, '.2f', ' GiB')}  vs estimate {est_alloc:.2f} GiB without context"
                                  f" (ratio {fmt(result['mem_allocated_over_estimate'], '.2f')})"),
        ("peak memory reserved", fmt(mem.get("mem_peak_reserved_gib"), ".2f", " GiB")),
        ("device memory used (with context)", f"{fmt(mem.get('mem_device_used_gib'), '.2f', ' GiB')}"
                                              f"  vs estimate {est['total_gib']:.2f} GiB"),
        (f"estimate ({PROFILE}, this batch/seq)", f"weights+grads+AdamW {est['weights_grads_adam_gib']:.2f},"
                                                  f" activations {est['activations_gib']:.2f}, logits"
                                                  f" {est['logits_gib']:.2f}, context 1.0 GiB"),
        ("final loss (ln vocab)", f"{h[-1]['loss']:.4f} ({math.log(vocab):.4f})"),
    ]
    if resume:
        verdict = "PASS" if resume["resume_pass"] else "FAIL"
        rows.append((f"resume {resume['resume_k']} + {resume['resume_k']} vs {2 * resume['resume_k']}",
                     f"{verdict}: max |diff| {resume['resume_max_abs_diff']:.3g}, max rel"
                     f" {resume['resume_max_rel_diff']:.3g} (tolerance {args.resume_rtol:g}),"
                     f" bitwise {resume['resume_bitwise_equal']}, exit {resume['resume_exit_code']},"
                     f" resumed from {resume['resume_resumed_from']}"))
    rows.append(("elapsed", f"setup {t_setup:.1f} s, throughput {t_main:.1f} s,"
                            f" resume {resume.get('resume_s', 0.0):.1f} s, total {total_s:.1f} s"))
    width = max(len(r[0]) for r in rows)
    print()
    for name, val in rows:
        print(f"{name:<{width}}  {val}")
    print(json.dumps(result))
    return 1 if resume and not resume["resume_pass"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
