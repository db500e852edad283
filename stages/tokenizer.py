"""Stage `tokenizer`: train the byte-level BPE tokenizer.

    dvc repro tokenizer        (dvc.yaml passes the paths: `python -m stages.tokenizer --help`)

Reads the `common` and `tokenizer` sections of params.yaml and the prepared text:

    sft/train.jsonl        every message's "content" (chat, math solutions)
    rl/train.jsonl         "question" (English and Chinese math)
    pretrain/train.jsonl   "text" (Shakespeare, math documents)
    pretrain/val.jsonl     English validation text (metrics only)
    sft/val.jsonl          its Chinese messages (metrics only)

in that order, so that with `tokenizer.max_train_chars` > 0 (a cap on training
characters) the chat and math text, which is small, is always included. Writes, atomically:

    the tokenizer directory: tokenizer.txt, tokenizer_meta.json, tokenizer.json (HF format)
    the metrics:
        vocab_size, bytes_per_token_en / _zh (compression on validation text),
        vocab_coverage (share of learned tokens used on validation text), train_seconds,
        early_stop + warning (corpus too small for vocab_size), and training statistics.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

from llm.config import TokenizerConfig
from llm.data.tokenizer import Tokenizer, has_han
from llm.fileio import DataError, atomic_dir, read_jsonl
from llm.train.metrics import write_metrics

INPUTS = {"prepared": "the prepared data directory (the files above are read from it)"}
OUTPUTS = {"out": "the tokenizer directory", "metrics": "the metrics JSON"}


def training_texts(prepared: Path, max_chars: int = 0, counts: dict | None = None) -> Iterator[str]:
    """The training text, streamed: SFT message contents, RL questions, pretraining docs.
    Stops once `max_chars` characters were yielded (0 = no cap). `counts` (if given)
    receives texts per source."""
    sources = [
        ("sft", prepared / "sft/train.jsonl", lambda r: [m["content"] for m in r["messages"]]),
        ("rl", prepared / "rl/train.jsonl", lambda r: [r["question"]]),
        ("pretrain", prepared / "pretrain/train.jsonl", lambda r: [r["text"]]),
    ]
    total = 0
    for name, path, fields in sources:
        n = 0
        for rec in read_jsonl(path):
            try:
                texts = fields(rec)
            except (KeyError, TypeError) as e:
                raise DataError(f"{path}: record {n + 1} lacks the expected field {e}") from None
            for t in texts:
                n += 1
                yield t
                total += len(t)
                if max_chars and total >= max_chars:
                    if counts is not None:
                        counts[name] = n
                    return
        if counts is not None:
            counts[name] = n


def validation_texts(prepared: Path) -> tuple[list[str], list[str]]:
    """English (pretrain/val) and Chinese (sft/val messages holding Han characters) text."""
    en = [r["text"] for r in read_jsonl(prepared / "pretrain/val.jsonl")]
    zh = [m["content"] for r in read_jsonl(prepared / "sft/val.jsonl") for m in r["messages"]
          if has_han(m["content"])]
    return en, zh


def bytes_per_token(tok: Tokenizer, texts: list[str], used: set[int]) -> float | None:
    n_bytes = n_tokens = 0
    for t in texts:
        ids = tok.encode(t)
        used.update(ids)
        n_bytes += len(t.encode("utf-8"))
        n_tokens += len(ids)
    return round(n_bytes / n_tokens, 4) if n_tokens else None


def run(cfg: TokenizerConfig, prepared: Path, out: Path, metrics_path: Path, progress: bool = True) -> dict:
    """Train, save and measure; returns the metrics dict."""
    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    tok = Tokenizer.train(training_texts(prepared, cfg.max_train_chars, counts), cfg.vocab_size,
                          max_pairs=cfg.max_pairs, min_frequency=cfg.min_frequency,
                          required_tokens=cfg.required_tokens, progress=progress)
    seconds = time.perf_counter() - t0
    with atomic_dir(out) as tmp:
        tok.save(tmp)
        tok.save_hf(tmp / "tokenizer.json")

    en, zh = validation_texts(prepared)
    used: set[int] = set()
    st = tok.train_stats
    metrics = {
        "vocab_size": tok.vocab_size, "requested_vocab_size": cfg.vocab_size, "n_merges": len(tok.merges),
        "bytes_per_token_en": bytes_per_token(tok, en, used),
        "bytes_per_token_zh": bytes_per_token(tok, zh, used),
        "val_texts_en": len(en), "val_texts_zh": len(zh),
        "train_seconds": round(seconds, 3), "count_seconds": st["count_seconds"],
        "early_stop": st["early_stop"], "warning": st["warning"],
        "train_chars": st["corpus_chars"], "train_bytes": st["corpus_bytes"],
        "train_texts": counts, "compression_train": st["compression"],
        "unique_chunks": st["unique_chunks"], "jieba_chunks": st["jieba_chunks"],
        "skipped_duplicate_merges": st["skipped_duplicate_merges"], "pairs_pruned": st["pairs_pruned"],
        "max_tracked_pairs": st["max_tracked_pairs"], "exact": st["exact"],
        "last_merge_count": st["last_merge_count"], "tokenizer_sha256": tok.sha256(),
        "corpus_sha256": st["corpus_sha256"],
    }
    # Share of the learned tokens (merges; bytes and specials excluded) seen on validation text.
    learned = sum(1 for i in used if 256 <= i < tok.n_base)
    metrics["vocab_coverage"] = round(learned / max(len(tok.merges), 1), 4)
    write_metrics(metrics_path, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from llm.stage import stage_main

    def work(args, common, cfg: TokenizerConfig, rt) -> str:
        m = run(cfg, prepared=args.prepared, out=args.out, metrics_path=args.metrics,
                progress=not args.no_progress)
        warning = f"tokenizer: WARNING: {m['warning']}\n" if m["warning"] else ""
        return (f"{warning}tokenizer: vocab_size {m['vocab_size']} in {m['train_seconds']} s; bytes/token"
                f" en {m['bytes_per_token_en']} zh {m['bytes_per_token_zh']}; coverage {m['vocab_coverage']}\n"
                f"tokenizer: wrote {args.out}/ and {args.metrics}")

    return stage_main("tokenizer", __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work)


if __name__ == "__main__":
    raise SystemExit(main())
