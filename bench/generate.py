"""Benchmark: cached decoding (llm/sample/generate.py) against Hugging Face transformers, with its floors.

    python bench/generate.py [--rounds 3] [--batches 1 64] [--threads 1 0] [--new 256]
    python bench/generate.py --size 4,4,128,4096    # the tiny CPU preset instead (layers,heads,width,vocab)

Models, randomly initialised, same size: 6 layers, 384 wide, 6 heads, vocab 8192. Ours has our
default architecture (RMSNorm, RoPE, SwiGLU 1024, tied embeddings: 13.8M parameters, 55 MB in
fp32); HF's is GPT2LMHeadModel (the same parameter count up to its position table). Each run
decodes --new tokens greedily after a --prompt token prompt with the KV cache; tokens/s = batch x
new tokens / wall time, prefill included. Decoders:

  fast    generate(model, ...): llm/sample/generate.py's FastDecoder ((in, out) weight copies, addmm,
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
At every batch size, `breakdown` times FastDecoder's step four ways (see `breakdown()`): the
real step, its matrix products alone back to back, the same products timed one by one inside real
steps, and the step without its products. If the products inside steps take as long as alone, a
real step minus its products is the rest of the model as it runs there; the step without its
products can be faster than that, since nothing streams the weights through the caches then.
At batch 1, `after_products` measures that directly: a few small one-row operations timed
warm, right after a product with one layer's 3 MB gate/up matrix, and right after reading 8 MB
of other data.

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
from llm.nn.model import GPT, NORM_EPS  # noqa: E402
from llm.sample.generate import FastDecoder, generate  # noqa: E402
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


def breakdown(model: GPT, B: int, prompt: int, steps: int, clock) -> dict[str, float]:
    """Seconds per decoding step of FastDecoder at batch B after a `prompt`-token prefill, split:
    `step` the real step; `products` FastDecoder's own matrix products alone, back to back in
    step order (its (in, out) copies, addmm where it uses addmm); `products_in_step` the same
    products inside real steps, each timed by a wrapper around torch.mm / torch.addmm; `other`
    the step with every product replaced by a preallocated result (torch.mm / torch.addmm swapped
    for the run, then restored), i.e. everything but the products."""
    import llm.sample.generate as G
    dec = G.FastDecoder(model)
    outs: dict[tuple[int, int], torch.Tensor] = {}

    def fake_mm(a, b):
        return outs.setdefault((a.shape[0], b.shape[1]), torch.zeros(a.shape[0], b.shape[1]))

    inside = [0.0]

    def timed(fn):
        def run(*a):
            t0 = clock()
            out = fn(*a)
            inside[0] += clock() - t0
            return out
        return run

    def decode(mm_mode: str = "real") -> float:
        """mm_mode: the products "real", "timed" (each one timed into `inside`) or "fake" (preallocated)."""
        cache = G.KVCache.for_model(model, B, prompt + steps)
        tok = torch.ones(B, dtype=torch.long)
        model.hidden_states(torch.ones(B, prompt, dtype=torch.long), None, kv_cache=cache)
        mm, addmm = torch.mm, torch.addmm
        if mm_mode == "fake":
            torch.mm, torch.addmm = fake_mm, (lambda x, a, b: x)
        elif mm_mode == "timed":
            torch.mm, torch.addmm = timed(mm), timed(addmm)
        try:
            t0 = clock()
            for _ in range(steps):
                tok = dec.step(tok, cache).argmax(-1)
            return (clock() - t0) / steps
        finally:
            torch.mm, torch.addmm = mm, addmm

    def products() -> float:
        x, h = torch.randn(B, dec.wte.shape[1]), torch.randn(B, dec.H)
        t0 = clock()
        for _ in range(steps):
            for _, wqkv, wo, _, wfc, wp in dec.layers:
                torch.mm(x, wqkv), torch.addmm(x, x, wo), torch.mm(x, wfc), torch.addmm(x, h, wp)
            torch.mm(x, dec.lm)
        return (clock() - t0) / steps

    with torch.inference_mode():
        step, alone = decode(), products()
        decode("timed")
        return {"step": step, "products": alone, "products_in_step": inside[0] / steps, "other": decode("fake")}


SMALL_OPS = ("mul", "rms_norm", "silu")  # what after_products times


def after_products(model: GPT, clock=time.perf_counter, reps: int = 1000) -> dict[str, float]:
    """Seconds per call of small one-row operations of a decoding step (a multiply by the norm
    weight, F.rms_norm, F.silu, 384 floats each at the default size), timed right after each of:
    `warm`, a product with a tiny (C, 16) matrix, so that nothing large passes through the
    caches; `after_product`, the product with one layer's gate/up matrix (C, 2H), 3 MB at the
    default size, as every such operation in a real step follows the streaming of some weights;
    `after_read`, a sum over 8 MB of other data (memory traffic without a product). Their ratios
    are what the caches cost the small operations."""
    C = model.config.n_embd
    fc = model.blocks[0].mlp.fc.weight.detach().t().contiguous()      # (C, 2H)
    tiny, other = torch.randn(C, 16), torch.randn(2 * 1024 * 1024)
    x, w = torch.randn(1, C), torch.randn(C)
    ops = {"mul": lambda: x * w, "rms_norm": lambda: F.rms_norm(x, (C,), w, NORM_EPS), "silu": lambda: F.silu(x)}
    assert tuple(ops) == SMALL_OPS
    befores = {"warm": lambda: torch.mm(x, tiny), "after_product": lambda: torch.mm(x, fc),
               "after_read": lambda: other.sum()}
    out = {}
    with torch.inference_mode():
        for before_name, before in befores.items():
            for name, op in ops.items():
                total = 0.0
                for _ in range(reps):
                    before()
                    t0 = clock()
                    op()
                    total += clock() - t0
                out[f"{name}_{before_name}"] = total / reps
    return out


def main() -> None:
    # one function on purpose: a benchmark's rounds read top to bottom, in the order they run
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
            names = ["fast", "plain", "hf", "breakdown"] + (["floors", "after_products"] if B == 1 else [])
            parts: dict[str, list[float]] = {"step": [], "products": [], "products_in_step": [], "other": []}
            tps: dict[str, list[float]] = {n: [] for n in ("fast", "plain", "hf")}
            fl: dict[str, list[float]] = {"gemv_linear": [], "gemv_in_out": [], "read": []}
            small: dict[str, list[float]] = {}
            for name in ("fast", "plain", "hf"):  # warm-up: first-call costs out of the timings
                run(name, ids)
            for r, order in enumerate(rotations(names, args.rounds)):
                for name in order:
                    if name == "floors":
                        for k, v in floors(ours, clock).items():
                            fl[k].append(v)
                    elif name == "after_products":
                        for k, v in after_products(ours, clock).items():
                            small.setdefault(k, []).append(v)
                    elif name == "breakdown":
                        for k, v in breakdown(ours, B, args.prompt, min(args.new, 64), clock).items():
                            parts[k].append(v)
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
            e["breakdown_ms_per_step"] = {k: summary([1e3 * x for x in v], 3) for k, v in parts.items()}
            e["products_share_of_step"] = summary([p / st for p, st in zip(parts["products"], parts["step"])], 3)
            e["other_share_of_step"] = summary([o / st for o, st in zip(parts["other"], parts["step"])], 3)
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
                e["small_op_us"] = {k: summary([1e6 * x for x in v], 1) for k, v in small.items()}
                for before in ("after_product", "after_read"):
                    e[f"small_op_{before}_over_warm"] = {
                        op: ratios(small[f"{op}_{before}"], small[f"{op}_warm"]) for op in SMALL_OPS}
            result["runs"][f"threads{T}_batch{B}"] = e
            print(f"threads {T} batch {B}: fast/HF {show(e['fast_over_hf'], 'x')}, plain/HF"
                  f" {show(e['plain_over_hf'], 'x')}, fast/plain {show(e['fast_over_plain'], 'x')}"
                  + (f"; fast = {show(e['fast_of_floor'])} of the GEMV floor" if B == 1 else "")
                  + f"; a fast step (ms) {show(e['breakdown_ms_per_step']['step'])}: its products alone"
                  f" {show(e['breakdown_ms_per_step']['products'])} (inside steps"
                  f" {show(e['breakdown_ms_per_step']['products_in_step'])}), all but the products"
                  f" {show(e['breakdown_ms_per_step']['other'])}", flush=True)
            if B == 1:
                us = e["small_op_us"]
                print("  small one-row operations, us per call, warm -> after the gate/up product -> after reading 8 MB: "
                      + ", ".join(f"{op} {show(us[op + '_warm'])} -> {show(us[op + '_after_product'])}"
                                  f" -> {show(us[op + '_after_read'])}" for op in SMALL_OPS), flush=True)
    result["machine"] = machine(load0)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
