"""Stage `pretrain`: train the base language model on the token shards.

    dvc repro pretrain        (dvc.yaml passes the paths: `python -m stages.pretrain --help`)

With `common.nproc > 1` (or `common.nnodes > 1`) it runs under torchrun's launcher (DDP, or
FSDP2 with `pretrain.distributed: fsdp`; llm/stage.py); the code path is the same as with
one process, and so is the global batch (pretrain.batch_size x pretrain.grad_accum).

Reads the `common` and `pretrain` sections of params.yaml, the token shards (train.bin,
val.bin, meta.json; llm.data.batching.open_tokens) and the tokenizer (vocab_size comes from it).
Writes, on rank 0:

    run dir          ckpt-<step>/ training checkpoints (a persisted DVC out: a killed or
                     interrupted run resumes from the newest verified one whose fingerprint =
                     params + input hashes matches), tb/ TensorBoard events, plots/ live curves
    model            model.safetensors, config.json, tokenizer/, meta.json
    metrics          final train/val loss, val perplexity, val bits-per-byte and the unigram
                     baseline's bits-per-byte, tokens seen, tokens/s, MFU (null where the
                     device's peak FLOP/s is unknown, e.g. CPU), non-finite skips, n_params
    plots            pretrain.tsv, pretrain_val.tsv, pretrain.png: curves for `dvc plots`

SIGTERM/SIGINT write a checkpoint and exit with 128 + the signal number; the outputs
above are written only when training completes.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from llm.config import CommonConfig, ConfigError, PretrainConfig, fingerprint
from llm.data.batching import WindowSampler, derive_seed, fixed_windows, open_tokens
from llm.fileio import DataError, sha256_file
from llm.runtime import Runtime, full_model_state, setup_runtime
from llm.stage import stage_main, training_outputs
from llm.train.finish import finish_stage, run_plots
from llm.train.trainer import train

STAGE = "pretrain"
INPUTS = {"tokens": "token shards: train.bin, val.bin, meta.json", "tokenizer": "the tokenizer directory"}
OUTPUTS = training_outputs("the base model directory")


def unigram_bits_per_byte(train: np.ndarray, val: np.ndarray, vocab_size: int, val_bytes: int,
                          chunk: int = 1 << 24) -> float:
    """Bits per byte of `val` under the train set's unigram distribution (add-one smoothed).

    The floor a model must beat to have learned anything beyond token frequencies.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    val_counts = np.zeros(vocab_size, dtype=np.int64)
    for arr, out in ((train, counts), (val, val_counts)):
        for s in range(0, len(arr), chunk):  # bounded memory on big memmaps
            out += np.bincount(np.asarray(arr[s:s + chunk]), minlength=vocab_size)[:vocab_size]
    logp = np.log2(counts + 1.0) - math.log2(counts.sum() + vocab_size)
    return float(-(val_counts * logp).sum() / val_bytes)


def _read_meta(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; run `dvc repro tokenize` first")
    meta = json.loads(path.read_text(encoding="utf-8"))
    need = ("dtype", "train_tokens", "val_tokens", "val_bytes", "tokenizer_sha256", "vocab_size")
    missing = [k for k in need if k not in meta]
    if missing:
        raise DataError(f"{path}: missing keys {missing}; re-run `dvc repro tokenize`")
    return meta


def run(common: CommonConfig, cfg: PretrainConfig, rt: Runtime, *, tokens: Path, tokenizer: Path, run_dir: Path,
        model: Path, metrics: Path, plots: Path, progress: bool = True) -> dict | None:
    """Train, then (rank 0) write models/base and the metrics; returns the metrics on rank 0."""
    from llm.data.tokenizer import Tokenizer
    from llm.nn.model import GPT

    meta = _read_meta(tokens / "meta.json")
    tok = Tokenizer.load(tokenizer)
    if tok.sha256() != meta["tokenizer_sha256"]:
        raise DataError(f"{tokens}/meta.json: the shards were made with another tokenizer than {tokenizer}"
                        f" (sha256 {meta['tokenizer_sha256'][:12]}... vs {tok.sha256()[:12]}...);"
                        f" run `dvc repro tokenize`")
    if cfg.model.vocab_size not in (0, tok.vocab_size):
        raise ConfigError([f"pretrain.model.vocab_size: {cfg.model.vocab_size}, but the tokenizer has"
                           f" {tok.vocab_size}; set it to 0 to take the tokenizer's"])
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    train_tok = open_tokens(tokens / "train.bin", meta["dtype"])
    val_tok = open_tokens(tokens / "val.bin", meta["dtype"])
    inputs = {"train.bin": sha256_file(tokens / "train.bin"), "val.bin": sha256_file(tokens / "val.bin"),
              "tokenizer": tok.sha256()}
    fp = fingerprint(common, cfg, inputs)
    seed = derive_seed(common.seed, STAGE)

    gpt = GPT(model_cfg, seed=derive_seed(common.seed, STAGE, "init"))
    if rt.is_main:
        print(f"{STAGE}: {gpt.summary()}; {rt.world_size} process(es) on {rt.device}, {rt.dtype}", flush=True)
    batches = WindowSampler(train_tok, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size,
                            grad_accum=cfg.grad_accum, seed=seed, rank=rt.rank, world_size=rt.world_size)
    val = fixed_windows(val_tok, seq_len=model_cfg.seq_len, batch_size=cfg.batch_size, n_batches=cfg.eval_batches)
    result = train(gpt, cfg, rt, stage=STAGE, seed=seed, batches=batches, val_batches=val, run_dir=run_dir,
                   fingerprint=fp, plots=run_plots(STAGE, run_dir),
                   bytes_per_token=meta["val_bytes"] / meta["val_tokens"], progress=progress)

    state = full_model_state(gpt, rt)  # every rank joins (FSDP gathers); a dict on rank 0 only
    if not rt.is_main:
        return None
    out_model = GPT(model_cfg, seed=0)
    out_model.load_state_dict(state)
    m = result.metrics
    out = {
        "train_loss": m["train_loss"], "val_loss": m.get("val_loss"), "val_ppl": m.get("val_ppl"),
        "val_bpb": m.get("val_bpb"),
        "unigram_bpb": unigram_bits_per_byte(train_tok, val_tok, tok.vocab_size, meta["val_bytes"]),
        "tokens_seen": m["tokens_seen"], "tokens_per_s": m["tokens_per_s"], "mfu": m["mfu"],
        "nonfinite_skips": m["nonfinite_skips"], "amp_overflows": m["amp_overflows"],
        "n_params": out_model.n_params(), "n_params_non_embedding": out_model.n_params(non_embedding=True),
        "flops_per_token": out_model.flops_per_token(), "steps": m["steps"], "train_time_s": m["train_time_s"],
        "world_size": m["world_size"], "device": m["device"], "dtype": m["dtype"], "num_threads": m["num_threads"],
        "threads_steps": m["threads_steps"], "threads_probe": m["threads_probe"],
        **{k: v for k, v in m.items() if k.startswith("mem_")},
    }
    return finish_stage(STAGE, run_dir=run_dir, model=model, weights=out_model, tokenizer=tok,
                        meta={"stage": STAGE, "fingerprint": fp, "inputs": inputs, "steps": result.step},
                        plots=plots, metrics=metrics, numbers=out)


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: PretrainConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt, tokens=args.tokens, tokenizer=args.tokenizer, run_dir=args.run_dir, model=args.model,
                metrics=args.metrics, plots=args.plots, progress=not args.no_progress)
        if m is None:  # ranks > 0
            return None
        return (f"{STAGE}: val loss {m['val_loss']:.4f}, val bits/byte {m['val_bpb']:.4f}"
                f" (unigram baseline {m['unigram_bpb']:.4f}), {m['tokens_per_s']:.0f} tokens/s;"
                f" wrote {args.model}/ and {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
