"""Stage `tokenize`: encode the pretraining text into token shards.

    dvc repro tokenize        (dvc.yaml passes the paths: `python -m stages.tokenize --help`)

Reads the `common` and `tokenize` sections of params.yaml, the tokenizer and the
pretraining text ({train,val}.jsonl, "text" per line). Writes, atomically (the directory is
swapped in whole, or not at all):

    train.bin, val.bin   token ids, np.uint16 when vocab_size < 65536 else np.uint32; every
                         document is followed by <|endoftext|>
    meta.json            dtype, {train,val}_tokens, {train,val}_bytes (UTF-8 bytes of the
                         text, for bits-per-byte), {train,val}_docs, tokenizer_sha256,
                         vocab_size, eot_id

and the metrics (the same counts, bytes per token, seconds, MB/s).

Streaming with bounded memory: documents are read one line at a time, grouped in
batches of `tokenize.chunk_docs`, and encoded by `tokenize.workers` processes (0 = one
per CPU core; 1 = in this process). At most two batches per worker are in flight and the
results are written in input order, so memory does not grow with the corpus. Text that
looks like a special token ("<|end|>") is encoded as plain text: only the separator
is a special id.
"""
from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from llm.config import TokenizeConfig
from llm.data.tokenizer import Tokenizer
from llm.fileio import DataError, atomic_dir, atomic_write_json, read_jsonl
from llm.train.metrics import write_metrics

INPUTS = {"text": "the pretraining text: train.jsonl, val.jsonl", "tokenizer": "the tokenizer directory"}
OUTPUTS = {"out": "the token shards directory", "metrics": "the metrics JSON"}
SPLITS = ("train", "val")

_TOK: Tokenizer | None = None  # the tokenizer inside a worker process


def _init_worker(tokenizer_dir: str) -> None:
    global _TOK
    _TOK = Tokenizer.load(tokenizer_dir)


def _encode_batch(texts: list[str], dtype: str) -> tuple[bytes, int, int, int]:
    """(token ids as raw `dtype` bytes, UTF-8 bytes of the text, token count, doc count)."""
    assert _TOK is not None, "worker not initialised"
    ids: list[int] = []
    eot = _TOK.eot_id
    for t in texts:
        ids.extend(_TOK.encode_ordinary(t))
        ids.append(eot)
    return np.asarray(ids, dtype=dtype).tobytes(), sum(len(t.encode("utf-8")) for t in texts), len(ids), len(texts)


def _doc_batches(path: Path, chunk_docs: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for n, rec in enumerate(read_jsonl(path), start=1):
        text = rec.get("text")
        if not isinstance(text, str):
            raise DataError(f"{path}: record {n}: expected a string field 'text', got {type(text).__name__}")
        batch.append(text)
        if len(batch) == chunk_docs:
            yield batch
            batch = []
    if batch:
        yield batch


def _encoded(batches: Iterator[list[str]], dtype: str, pool, window: int) -> Iterator[tuple[bytes, int, int, int]]:
    """_encode_batch over `batches`, in order; in `pool` with <= `window` batches in flight."""
    if pool is None:
        for b in batches:
            yield _encode_batch(b, dtype)
        return
    pending: deque = deque()
    for b in batches:
        pending.append(pool.apply_async(_encode_batch, (b, dtype)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def run(cfg: TokenizeConfig, text: Path, tokenizer_dir: Path, out: Path, metrics_path: Path,
        progress: bool = True) -> dict:
    """Encode every split into `out`; returns meta.json's content plus timing."""
    global _TOK
    tok = Tokenizer.load(tokenizer_dir)
    dtype = "uint16" if tok.vocab_size < 1 << 16 else "uint32"
    workers = cfg.workers or os.cpu_count() or 1
    meta: dict = {"dtype": dtype, "vocab_size": tok.vocab_size, "tokenizer_sha256": tok.sha256(),
                  "eot_id": tok.eot_id, "separator": "<|endoftext|> after every document"}
    pool = None
    if workers > 1:
        import multiprocessing as mp
        pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_dir),))
    else:
        _TOK = tok
    t0 = time.perf_counter()
    try:
        with atomic_dir(out) as tmp:
            for split in SPLITS:
                bar = None
                if progress:
                    from tqdm import tqdm
                    bar = tqdm(desc=f"tokenize {split}", unit="B", unit_scale=True, mininterval=1.0)
                n_tok = n_bytes = n_docs = 0
                with open(tmp / f"{split}.bin", "wb") as f:
                    batches = _doc_batches(text / f"{split}.jsonl", cfg.chunk_docs)
                    for data, nb, nt, nd in _encoded(batches, dtype, pool, 2 * workers):
                        f.write(data)
                        n_tok, n_bytes, n_docs = n_tok + nt, n_bytes + nb, n_docs + nd
                        if bar is not None:
                            bar.update(nb)
                if bar is not None:
                    bar.close()
                meta.update({f"{split}_tokens": n_tok, f"{split}_bytes": n_bytes,
                             f"{split}_docs": n_docs})
            atomic_write_json(tmp / "meta.json", meta)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    seconds = time.perf_counter() - t0
    total_bytes = sum(meta[f"{s}_bytes"] for s in SPLITS)
    metrics = {**{k: v for k, v in meta.items() if k != "separator"}, "workers": workers,
               "bytes_per_token_train": round(meta["train_bytes"] / max(meta["train_tokens"], 1), 4),
               "seconds": round(seconds, 3), "mb_per_s": round(total_bytes / 1e6 / max(seconds, 1e-9), 3)}
    write_metrics(metrics_path, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from llm.stage import stage_main

    def work(args, common, cfg: TokenizeConfig, rt) -> str:
        m = run(cfg, text=args.text, tokenizer_dir=args.tokenizer, out=args.out, metrics_path=args.metrics,
                progress=not args.no_progress)
        return (f"tokenize: {m['train_tokens']} train + {m['val_tokens']} val tokens ({m['dtype']}),"
                f" {m['bytes_per_token_train']} bytes/token, {m['mb_per_s']} MB/s with {m['workers']} workers\n"
                f"tokenize: wrote {args.out}/ and {args.metrics}")

    return stage_main("tokenize", __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work)


if __name__ == "__main__":
    raise SystemExit(main())
