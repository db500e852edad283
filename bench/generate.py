"""Benchmark: cached greedy decoding, ours against Hugging Face transformers, same run.

    python bench/generate.py [--rounds 3] [--batches 1 64] [--threads 0]
    python bench/generate.py --size 4,4,128,4096    # the tiny CPU preset instead (layers,heads,width,vocab)

Both models have the same size, randomly initialised: 6 layers, 384 wide, 6 heads, vocab
8192 (ours: our default RMSNorm/RoPE/SwiGLU architecture; HF: GPT2LMHeadModel, same parameter
count up to position embeddings). Each run decodes --new 256 tokens greedily after a
--prompt 32 token prompt with the KV cache (HF: `generate(do_sample=False, use_cache=True)`,
with min_new_tokens so that neither stops early). tokens/s = batch * new tokens / wall time,
prefill included. Runs alternate HF, ours, ours, HF, ... and each round gives a paired ratio.

At batch 1 a decode step is a matrix-vector product per weight matrix, so every step streams
all weights from memory (55 MB in fp32 here, more than the 32 MB L3 cache of the reference
machine). The benchmark measures that floor in the same round (one F.linear per weight
matrix of our model on a single token, no attention, no Python model code): no
implementation can decode faster than `floor_tok_s` at batch 1, which bounds the ratio to HF.

The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm.config import ModelConfig  # noqa: E402
from llm.generate import generate  # noqa: E402
from llm.model import GPT  # noqa: E402

L, H, C, V = 6, 6, 384, 8192  # --size overrides


def build(prompt: int, new: int):
    import transformers
    transformers.logging.set_verbosity_error()
    ours = GPT(ModelConfig(vocab_size=V, seq_len=prompt + new, n_layer=L, n_head=H, n_kv_head=H, n_embd=C)).eval()
    torch.manual_seed(0)  # HF initialises from the global RNG
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=prompt + new, n_embd=C, n_layer=L, n_head=H)).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return ours, hf


def weight_floor(model: GPT, reps: int = 20) -> float:
    """Seconds per token to stream every weight matrix once (batch-1 matrix-vector products)."""
    mats = [p for p in model.parameters() if p.ndim == 2]
    xs = {n: torch.randn(1, n) for n in {p.shape[1] for p in mats}}
    with torch.inference_mode():
        for w in mats:
            F.linear(xs[w.shape[1]], w)
        t0 = time.perf_counter()
        for _ in range(reps):
            for w in mats:
                F.linear(xs[w.shape[1]], w)
    return (time.perf_counter() - t0) / reps


def summary(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main() -> None:
    global L, H, C, V
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    ap.add_argument("--size", default=f"{L},{H},{C},{V}", help="n_layer,n_head,n_embd,vocab_size")
    args = ap.parse_args()
    L, H, C, V = (int(v) for v in args.size.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, hf = build(args.prompt, args.new)
    n_ours = ours.n_params()
    n_hf = sum(p.numel() for p in hf.parameters())
    g = torch.Generator().manual_seed(0)

    def run_ours(ids: torch.Tensor) -> None:
        out = generate(ours, ids.tolist(), args.new, temperature=0.0, pad_id=0)
        assert out.tokens.shape == (ids.shape[0], ids.shape[1] + args.new)

    def run_hf(ids: torch.Tensor) -> None:
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                              min_new_tokens=args.new, do_sample=False, use_cache=True)
        assert out.shape == (ids.shape[0], ids.shape[1] + args.new)

    result = {"bench": "generate", "shape": {"n_layer": L, "n_head": H, "n_embd": C, "vocab_size": V,
                                             "prompt": args.prompt, "new_tokens": args.new},
              "params": {"ours": n_ours, "hf_gpt2": n_hf}, "threads": torch.get_num_threads(),
              "rounds": args.rounds, "batches": {}}
    for B in args.batches:
        ids = torch.randint(1, V, (B, args.prompt), generator=g)
        run_ours(ids[:, :8].contiguous()), run_hf(ids[:, :8].contiguous())  # warm-up
        tps = {"ours": [], "hf": []}
        floors = []
        for r in range(args.rounds):
            if B == 1:
                floors.append(1.0 / weight_floor(ours))
            for name in (("hf", "ours") if r % 2 == 0 else ("ours", "hf")):
                fn = run_ours if name == "ours" else run_hf
                t0 = time.perf_counter()
                fn(ids)
                tps[name].append(B * args.new / (time.perf_counter() - t0))
            print(f"batch {B} round {r + 1}/{args.rounds}: ours {tps['ours'][-1]:.0f} tok/s, HF {tps['hf'][-1]:.0f}"
                  f" tok/s, ratio {tps['ours'][-1] / tps['hf'][-1]:.2f}"
                  + (f"; weight-streaming floor {floors[-1]:.0f} tok/s" if floors else ""), flush=True)
        ratio = [a / b for a, b in zip(tps["ours"], tps["hf"])]
        entry = {"ours_tok_s": summary(tps["ours"]), "hf_tok_s": summary(tps["hf"]), "ratio": summary(ratio)}
        if floors:
            entry["floor_tok_s"] = summary(floors)
            entry["ours_fraction_of_floor"] = summary([a / f for a, f in zip(tps["ours"], floors)])
        result["batches"][str(B)] = entry
    print()
    for B, e in result["batches"].items():
        r = e["ratio"]
        print(f"batch {B:>3}: ours {e['ours_tok_s']['median']:.0f} tok/s,"
              f" HF {e['hf_tok_s']['median']:.0f} tok/s (medians);"
              f" ratio min/median/max {r['min']:.2f}/{r['median']:.2f}/{r['max']:.2f}x"
              + (f"; floor {e['floor_tok_s']['median']:.0f} tok/s" if "floor_tok_s" in e else ""))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
