"""Benchmark: cached decoding (llm/generate.py) against Hugging Face transformers, with its floors.

    python bench/generate.py [--rounds 3] [--batches 1 64] [--threads 1 0] [--new 256]
    python bench/generate.py --size 4,4,128,4096    # the tiny CPU preset instead (layers,heads,width,vocab)

Models, randomly initialised, same size: 6 layers, 384 wide, 6 heads, vocab 8192. Ours has our
default architecture (RMSNorm, RoPE, SwiGLU 1024, tied embeddings: 13.8M parameters, 55 MB in
fp32); HF's is GPT2LMHeadModel (the same parameter count up to its position table). Each run
decodes --new tokens greedily after a --prompt token prompt with the KV cache; tokens/s = batch x
new tokens / wall time, prefill included. Decoders:

  fast    generate(model, ...): llm/generate.py's FastDecoder ((in, out) weight copies, addmm,
          keys rotated straight into the cache)
  plain   generate(model, ..., fast=False): every step through GPT.hidden_states
  hf      transformers' generate(do_sample=False, use_cache=True), with min_new_tokens so that
          neither side stops early

and at batch 1, in the same rounds, what bounds any decoder from above:

  gemv_linear   one F.linear(x, W) per weight matrix, x one row: the products the plain path runs
  gemv_in_out   one torch.mm(x, W) per weight matrix stored (in, out): the ones FastDecoder runs
  read          one pass over every weight matrix (torch.sum): memory traffic alone

A decoding step multiplies one row by every weight matrix, so the faster of the two GEMVs is the
"GEMV floor" (floor_tok_s); `fast_of_floor` is fast's tokens/s over that floor, per round.

For each thread count in --threads (0 = every usable CPU) and each batch size, the decoders and
floors run in rotated order each round (A B C, B C A, ...); reported: tokens/s min/median/max
and the min/median/max of the per-round ratios. `--clock cpu` times process CPU seconds instead
of wall seconds (with --threads 1, it leaves out the time the process waited for a CPU on a busy
machine). The last line is JSON with every figure and the machine's load (bench/common.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import loadavg, machine, ratios, rotations, show, summary  # noqa: E402
from llm.config import ModelConfig  # noqa: E402
from llm.generate import FastDecoder, generate  # noqa: E402
from llm.model import GPT  # noqa: E402
from llm.threads import usable_cpus  # noqa: E402


def build(size: tuple[int, int, int, int], seq_len: int):
    import transformers
    transformers.logging.set_verbosity_error()
    L, H, C, V = size
    ours = GPT(ModelConfig(vocab_size=V, seq_len=seq_len, n_layer=L, n_head=H, n_kv_head=H, n_embd=C)).eval()
    torch.manual_seed(0)  # HF initialises from the global RNG
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=seq_len, n_embd=C, n_layer=L, n_head=H)).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return ours, hf


def floors(model: GPT, clock=time.perf_counter, reps: int = 10) -> dict[str, float]:
    """Seconds per token of: F.linear per weight matrix (its own layout), torch.mm per (in, out)
    copy, and one torch.sum per matrix (a read), for one row."""
    mats = [p.detach() for p in model.parameters() if p.ndim == 2]
    in_out = [w.t().contiguous() for w in mats]
    xs = {n: torch.randn(1, n) for n in {w.shape[1] for w in mats}}
    out = {}
    with torch.inference_mode():
        for name, fn in (("gemv_linear", lambda: [F.linear(xs[w.shape[1]], w) for w in mats]),
                         ("gemv_in_out", lambda: [torch.mm(xs[w.shape[0]], w) for w in in_out]),
                         ("read", lambda: [w.sum() for w in mats])):
            fn()
            t0 = clock()
            for _ in range(reps):
                fn()
            out[name] = (clock() - t0) / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="torch threads; 0 = every usable CPU")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--size", default="6,6,384,8192", help="n_layer,n_head,n_embd,vocab_size")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time (meaningful with --threads 1: leaves out time spent preempted)")
    args = ap.parse_args()
    load0 = loadavg()
    size = tuple(int(v) for v in args.size.split(","))
    ours, hf = build(size, args.prompt + args.new)
    assert FastDecoder.supports(ours)
    V = size[3]
    g = torch.Generator().manual_seed(0)
    prompts = {B: torch.randint(1, V, (B, args.prompt), generator=g) for B in args.batches}

    clock = time.perf_counter if args.clock == "wall" else time.process_time

    def run(name: str, ids: torch.Tensor) -> float:
        t0 = clock()
        if name == "hf":
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                  min_new_tokens=args.new, do_sample=False, use_cache=True)
        else:
            out = generate(ours, ids.tolist(), args.new, temperature=0.0, pad_id=0, fast=name == "fast").tokens
        dt = clock() - t0
        assert out.shape == (ids.shape[0], ids.shape[1] + args.new)
        return ids.shape[0] * args.new / dt

    result = {"bench": "generate", "shape": dict(zip(("n_layer", "n_head", "n_embd", "vocab_size"), size),
                                                 prompt=args.prompt, new_tokens=args.new),
              "params": {"ours": ours.n_params(), "hf_gpt2": sum(p.numel() for p in hf.parameters())},
              "weight_mb": round(sum(p.numel() for p in ours.parameters() if p.ndim == 2) * 4 / 1e6, 1),
              "rounds": args.rounds, "clock": args.clock, "runs": {}}
    print(f"bench: ours {ours.n_params():,} parameters, HF GPT-2 {result['params']['hf_gpt2']:,};"
          f" {args.rounds} rounds; load {load0}", flush=True)
    for n_threads in args.threads:
        torch.set_num_threads(n_threads or usable_cpus())
        T = torch.get_num_threads()
        for B in args.batches:
            ids = prompts[B]
            names = ["fast", "plain", "hf"] + (["floors"] if B == 1 else [])
            tps: dict[str, list[float]] = {n: [] for n in names if n != "floors"}
            fl: dict[str, list[float]] = {"gemv_linear": [], "gemv_in_out": [], "read": []}
            for name in ("fast", "plain", "hf"):  # warm-up: first-call costs out of the timings
                run(name, ids)
            for r, order in enumerate(rotations(names, args.rounds)):
                for name in order:
                    if name == "floors":
                        for k, v in floors(ours, clock).items():
                            fl[k].append(v)
                    else:
                        tps[name].append(run(name, ids))
                line = ", ".join(f"{n} {tps[n][-1]:.0f}" for n in tps)
                if B == 1:
                    line += (f"; floors (tok/s): GEMV {1 / fl['gemv_linear'][-1]:.0f} (linear),"
                             f" {1 / fl['gemv_in_out'][-1]:.0f} (in,out); read {1 / fl['read'][-1]:.0f}")
                print(f"threads {T} batch {B} round {r + 1}: tok/s {line}", flush=True)
            e = {f"{n}_tok_s": summary(v, 1) for n, v in tps.items()}
            e["fast_over_hf"] = ratios(tps["fast"], tps["hf"])
            e["plain_over_hf"] = ratios(tps["plain"], tps["hf"])
            e["fast_over_plain"] = ratios(tps["fast"], tps["plain"])
            if B == 1:
                floor = [min(a, b) for a, b in zip(fl["gemv_linear"], fl["gemv_in_out"])]
                e["floor_tok_s"] = summary([1 / f for f in floor], 1)
                e["gemv_linear_tok_s"] = summary([1 / f for f in fl["gemv_linear"]], 1)
                e["gemv_in_out_tok_s"] = summary([1 / f for f in fl["gemv_in_out"]], 1)
                e["read_tok_s"] = summary([1 / f for f in fl["read"]], 1)
                e["gemv_linear_gb_s"] = summary([result["weight_mb"] / 1e3 / f for f in fl["gemv_linear"]], 1)
                e["gemv_in_out_gb_s"] = summary([result["weight_mb"] / 1e3 / f for f in fl["gemv_in_out"]], 1)
                e["read_gb_s"] = summary([result["weight_mb"] / 1e3 / f for f in fl["read"]], 1)
                e["fast_of_floor"] = summary([t * f for t, f in zip(tps["fast"], floor)], 3)
                e["plain_of_floor"] = summary([t * f for t, f in zip(tps["plain"], floor)], 3)
            result["runs"][f"threads{T}_batch{B}"] = e
            print(f"threads {T} batch {B}: fast/HF {show(e['fast_over_hf'], 'x')}, plain/HF"
                  f" {show(e['plain_over_hf'], 'x')}, fast/plain {show(e['fast_over_plain'], 'x')}"
                  + (f"; fast = {show(e['fast_of_floor'])} of the GEMV floor" if B == 1 else ""), flush=True)
    result["machine"] = machine(load0)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
