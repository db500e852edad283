"""Benchmark: time to a loss. AdamW against Muon-for-matrices (llm/nn/optim.py), paired, same run.

    python bench/optim.py [--profile cpu] [--steps 300] [--seeds 3] [--muon-lr 0.02 ...] [--tokens data/tokens]
    python bench/optim.py --steps 30 --seeds 2 --muon-lr 0.02 0.04 --eval-every 3 --eval-batches 2  # short, a sweep
    python bench/optim.py --profile gpu-13m --batch-size 16 --muon-lr 0.005  # another profile's shapes, on the CPU

Trains the profile's pretraining (its model, batch, schedule and AdamW settings, from
env/profiles/<profile>.yaml) through the project's own loop (llm.train.trainer.train), once with
`optimizer: adamw` and once per --muon-lr with `optimizer: muon`, from the same initial weights
on the same batches. Per seed the runs alternate, the first one rotated every seed (A B, B A, ...
with a sweep: A B C, B C A, ...). --steps shortens the run: max_steps, and warmup_steps scaled
with it, so the schedule keeps its shape. --batch-size cuts the profile's batch (a GPU profile's 96
windows of 512 tokens take seconds a step on the CPU); the model's shapes stay the profile's, the
vocabulary is the data's, and every run is eager fp32 on the CPU (a profile's `compile` is off).
The bench prints the share of the parameters Muon would train (`muon_share`): Muon orthogonalises
only the blocks' matrices, so its saving can reach only as far as they decide the loss.

Data: the pipeline's token shards (--tokens: train.bin, val.bin, meta.json, as stages/pretrain.py
reads them) when they exist; otherwise the first --doc-mb MB of the English text under
/usr/share/doc (bench/tokenizer.py's corpus) as bytes (vocabulary 256, the last 10 % held out):
real text without a tokenizer, so the embedding and the head are smaller than the profile's.
That text changes as packages are installed: compare runs only where the printed sha256 agrees.

The AdamW run's final validation loss is the target. For every Muon run: the steps it needs to
reach that loss (linear between its evaluations, every --eval-every steps; a run that never
reaches it counts as not reached) and the seconds of training steps up to there (the loop's
per-step times; evaluations and checkpoints left out), each as a ratio to the AdamW run's steps
and seconds; and its final validation loss at the same step count as AdamW's. Ratios < 1:
Muon is faster. Printed per seed, then min/median/max of the paired ratios over seeds.
Steps-to-loss does not depend on the machine's load; seconds do: on a shared machine only the
step ratios and the losses are worth comparing between runs.

The last line is JSON with every figure, every evaluation and the machine's load (bench/common.py).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import loadavg, machine, rotations, summary  # noqa: E402
from llm.config import PretrainConfig, load_params_text  # noqa: E402
from llm.data.batching import WindowSampler, fixed_windows, open_tokens  # noqa: E402
from llm.nn.model import GPT  # noqa: E402
from llm.nn.optim import build_optimizers  # noqa: E402
from llm.runtime import Runtime  # noqa: E402
from llm.tools.profile import render, to_yaml  # noqa: E402
from llm.train.monitor import Plots  # noqa: E402
from llm.train.trainer import train  # noqa: E402


def load_tokens(tokens: Path, doc_mb: float) -> tuple[np.ndarray, np.ndarray, int, str]:
    """(train tokens, val tokens, vocabulary size, where they came from): module docstring."""
    if (tokens / "meta.json").is_file():
        meta = json.loads((tokens / "meta.json").read_text(encoding="utf-8"))
        return (open_tokens(tokens / "train.bin", meta["dtype"]), open_tokens(tokens / "val.bin", meta["dtype"]),
                meta["vocab_size"], f"{tokens} ({meta['train_tokens']} train tokens)")
    from bench.tokenizer import english_docs

    docs, source = english_docs(int(doc_mb * 1e6))
    data = np.frombuffer("\n\n".join(docs).encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    cut = int(len(data) * 0.9)
    digest = hashlib.sha256(data.tobytes()).hexdigest()[:12]  # /usr/share/doc changes as packages come and go
    return data[:cut], data[cut:], 256, f"{source}, {len(data)} bytes as tokens, sha256 {digest} ({tokens} not found)"


def muon_share(model: torch.nn.Module, cfg: PretrainConfig) -> float:
    """The fraction of the model's trainable parameters (a tied table counted once) that
    `optimizer: muon` hands to Muon (build_optimizers' own split); AdamW trains the rest."""
    opts = build_optimizers(model, dataclasses.replace(cfg, optimizer="muon"))
    counts = [sum(p.numel() for g in o.param_groups for p in g["params"]) for o in opts]
    return counts[0] / sum(counts)


def run_once(cfg: PretrainConfig, model_cfg, seed: int, train_tok, val_tok) -> dict:
    """One pretraining run; {"evals": [(step, val_loss)], "step_s": [seconds of each step]}."""
    model = GPT(model_cfg, seed=seed)
    batches = WindowSampler(train_tok, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size,
                            grad_accum=cfg.grad_accum, seed=seed)
    val = fixed_windows(val_tok, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size, n_batches=cfg.eval_batches)
    with tempfile.TemporaryDirectory() as d, open(os.devnull, "w") as null, contextlib.redirect_stderr(null), \
            contextlib.redirect_stdout(null):
        res = train(model, cfg, Runtime(device=torch.device("cpu")), stage="bench", seed=seed, batches=batches,
                    val_batches=val, run_dir=Path(d) / "run", fingerprint="bench", plots=Plots(), progress=False)
    return {"evals": [(r["step"], r["val_loss"]) for r in res.val_history], "step_s": [r["step_s"] for r in res.train_history]}


def steps_to(evals: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which the validation loss reaches `target`, linear between evaluations."""
    for (s0, l0), (s1, l1) in zip(evals, evals[1:]):
        if l1 <= target:
            return float(s1) if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def seconds_to(step_s: list[float], step: float) -> float:
    """Seconds of training steps up to the fractional step `step`."""
    whole = int(step)
    return sum(step_s[:whole]) + (step - whole) * (step_s[whole] if whole < len(step_s) else 0.0)


def compare(base: dict, other: dict) -> dict:
    """The paired figures of one seed: `other` against the target set by `base` (AdamW)."""
    target = base["evals"][-1][1]
    steps = steps_to(other["evals"], target)
    out = {"target_val_loss": target, "final_val_loss": other["evals"][-1][1], "steps": steps,
           "steps_ratio": None, "seconds_ratio": None}
    if steps is not None:
        out["steps_ratio"] = steps / base["evals"][-1][0]
        out["seconds_ratio"] = seconds_to(other["step_s"], steps) / sum(base["step_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu", help="env/profiles/<profile>.yaml's pretrain section")
    ap.add_argument("--steps", type=int, default=0, help="max_steps of every run; 0 = the profile's")
    ap.add_argument("--seeds", type=int, default=3, help="paired repeats (model init and batch order)")
    ap.add_argument("--first-seed", type=int, default=1337,
                    help="the seeds are first-seed, first-seed + 1, ...: --first-seed 1339 --seeds 1 adds a third seed")
    ap.add_argument("--muon-lr", type=float, nargs="+", default=None,
                    help="Muon's peak learning rate(s), one run each per seed; default: the profile's muon_lr")
    ap.add_argument("--eval-every", type=int, default=0, help="steps between evaluations; 0 = steps / 20")
    ap.add_argument("--batch-size", type=int, default=0, help="windows per step; 0 = the profile's")
    ap.add_argument("--eval-batches", type=int, default=0, help="validation batches per evaluation; 0 = the profile's")
    ap.add_argument("--tokens", type=Path, default=Path("data/tokens"))
    ap.add_argument("--doc-mb", type=float, default=4.0, help="MB of /usr/share/doc text when --tokens is absent")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed: both sides alike)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    params, desc = render(args.profile)
    pre = load_params_text(to_yaml(params, args.profile, desc), f"env/profiles/{args.profile}.yaml").pretrain
    train_tok, val_tok, vocab, source = load_tokens(args.tokens, args.doc_mb)
    model_cfg = dataclasses.replace(pre.model, vocab_size=vocab)
    steps = args.steps or pre.max_steps
    every = args.eval_every or max(1, steps // 20)
    base = dataclasses.replace(pre, max_steps=steps, warmup_steps=round(pre.warmup_steps * steps / pre.max_steps),
                               eval_every=every, checkpoint_every=steps, log_every=steps,
                               eval_batches=args.eval_batches or pre.eval_batches,
                               batch_size=args.batch_size or pre.batch_size, compile=False)
    cfgs = {"adamw": dataclasses.replace(base, optimizer="adamw")}
    for lr in args.muon_lr or [pre.muon_lr]:
        cfgs[f"muon@{lr:g}"] = dataclasses.replace(base, optimizer="muon", muon_lr=lr)
    share = muon_share(GPT(model_cfg), base)
    print(f"bench: {args.profile} pretraining, {GPT(model_cfg).summary()}; Muon would train {share:.1%} of the"
          f" parameters (the blocks' matrices), AdamW the rest; data: {source}", flush=True)
    print(f"bench: {steps} steps (warmup {base.warmup_steps}), batch {base.batch_size} x {model_cfg.seq_len}"
          f" x grad_accum {base.grad_accum}, AdamW lr {base.lr:g}, eval every {every} steps on {base.eval_batches}"
          f" batches, {args.threads} thread(s); {args.seeds} seed(s)", flush=True)

    load0 = loadavg()
    seeds = []
    skip = max(0, args.first_seed - 1337)  # the orders a run from 1337 would give these seeds
    for i, order in enumerate(rotations(list(cfgs), skip + args.seeds)[skip:]):
        seed = args.first_seed + i
        runs = {}
        for name in order:
            runs[name] = run_once(cfgs[name], model_cfg, seed, train_tok, val_tok)
            print(f"  seed {seed} {name}: final val loss {runs[name]['evals'][-1][1]:.4f},"
                  f" {sum(runs[name]['step_s']):.1f} s of steps", flush=True)
        pairs = {name: compare(runs["adamw"], runs[name]) for name in cfgs if name != "adamw"}
        for name, p in pairs.items():
            reached = (f"reaches {p['target_val_loss']:.4f} at step {p['steps']:.1f}: {p['steps_ratio']:.3f}x steps,"
                       f" {p['seconds_ratio']:.3f}x seconds") if p["steps"] is not None else "never reaches it"
            print(f"  seed {seed} {name} vs adamw: {reached}; final val loss {p['final_val_loss']:.4f}"
                  f" vs {p['target_val_loss']:.4f}", flush=True)
        seeds.append({"seed": seed, "order": order, "runs": runs, "pairs": pairs})

    result = {}
    for name in cfgs:
        if name == "adamw":
            continue
        ps = [s["pairs"][name] for s in seeds]
        got = [p for p in ps if p["steps"] is not None]
        result[name] = {
            "reached": f"{len(got)}/{len(ps)}",
            "steps_ratio": summary([p["steps_ratio"] for p in got], 3) if got else None,
            "seconds_ratio": summary([p["seconds_ratio"] for p in got], 3) if got else None,
            "final_val_loss_diff": summary([p["final_val_loss"] - p["target_val_loss"] for p in ps], 4),
            "final_val_loss_median": round(statistics.median(p["final_val_loss"] for p in ps), 4)}
        r = result[name]
        ratio = (f"steps {r['steps_ratio']['min']}/{r['steps_ratio']['median']}/{r['steps_ratio']['max']}x,"
                 f" seconds {r['seconds_ratio']['min']}/{r['seconds_ratio']['median']}/{r['seconds_ratio']['max']}x"
                 if got else "no ratio")
        d = r["final_val_loss_diff"]
        print(f"{name} vs adamw (min/median/max over seeds): reached AdamW's final val loss in {r['reached']};"
              f" {ratio}; final val loss minus AdamW's {d['min']:+.4f}/{d['median']:+.4f}/{d['max']:+.4f}")
    adamw_final = [s["runs"]["adamw"]["evals"][-1][1] for s in seeds]
    print(f"adamw final val loss (min/median/max): {min(adamw_final):.4f}/{statistics.median(adamw_final):.4f}"
          f"/{max(adamw_final):.4f}")
    print(json.dumps({"bench": "optim", "profile": args.profile, "steps": steps, "warmup_steps": base.warmup_steps,
                      "eval_every": every, "batch_size": base.batch_size, "muon_share": round(share, 4),
                      "threads": args.threads, "data": source, "summary": result,
                      "seeds": seeds, "machine": machine(load0)}))


if __name__ == "__main__":
    main()
