"""Tests for stages/tokenizer.py and stages/tokenize.py on a small prepared-data fixture:
outputs and metrics, the shard format (documents + <|endoftext|>), parallel == serial,
and invalid UTF-8 reported with path, line and offset."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from llm.config import TokenizeConfig, TokenizerConfig
from llm.data.generators import math_problem
from llm.data.tokenizer import Tokenizer
from llm.fileio import DataError
from llm.train.metrics import read_metrics
from stages import tokenize as tokenize_stage
from stages import tokenizer as tokenizer_stage

SHAKESPEARE = ("HAMLET. To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
               "The slings and arrows of outrageous fortune.\n")


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


@pytest.fixture()
def prepared(tmp_path):
    rng = random.Random(0)
    root = tmp_path / "prepared"
    probs = [math_problem(rng, 1 + i % 3, "zh" if i % 3 == 0 else "en") for i in range(120)]
    docs = [{"text": SHAKESPEARE * (1 + i % 3), "source": "shakespeare/x"} for i in range(30)]
    docs += [{"text": p.question + "\n" + "\n".join(p.steps) + f"\n#### {p.answer}", "source": "math"} for p in probs]
    docs.append({"text": "user text with <|endoftext|> in it", "source": "x"})
    _write_jsonl(root / "pretrain/train.jsonl", docs)
    _write_jsonl(root / "pretrain/val.jsonl", [{"text": SHAKESPEARE, "source": "shakespeare/y"}])
    sft = [{"id": str(i), "source": "math", "group": "g", "messages": [
        {"role": "user", "content": p.question}, {"role": "assistant", "content": "\n".join(p.steps)}]}
        for i, p in enumerate(probs)]
    _write_jsonl(root / "sft/train.jsonl", sft[:100])
    _write_jsonl(root / "sft/val.jsonl", sft[100:])
    _write_jsonl(root / "rl/train.jsonl", [{"id": str(i), "question": p.question, "answer": str(p.answer),
                                            "level": p.level, "lang": p.lang} for i, p in enumerate(probs)])
    return root


def _tok_cfg(**kw) -> TokenizerConfig:
    base = dict(vocab_size=400, max_pairs=100_000, min_frequency=2, required_tokens=["####"], max_train_chars=0)
    return TokenizerConfig(**{**base, **kw})


def test_tokenizer_then_tokenize(prepared, tmp_path):
    out, metrics_path = tmp_path / "models/tokenizer", tmp_path / "metrics/tokenizer.json"
    m = tokenizer_stage.run(_tok_cfg(), prepared, out, metrics_path, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer.txt", "tokenizer_meta.json"]
    assert read_metrics(metrics_path) == m  # the metrics file joined with its run file
    assert m["vocab_size"] == 400 and not m["early_stop"] and m["warning"] is None
    assert m["bytes_per_token_en"] > 1.5 and m["bytes_per_token_zh"] > 1.5 and m["val_texts_zh"] > 0
    assert 0 < m["vocab_coverage"] <= 1 and m["train_seconds"] > 0
    assert m["train_texts"] == {"sft": 200, "rl": 120, "pretrain": 151}
    tok = Tokenizer.load(out)
    assert tok.sha256() == m["tokenizer_sha256"] and len(tok.encode("####")) == 1

    tokens = tmp_path / "tokens"
    meta = tokenize_stage.run(TokenizeConfig(workers=1, chunk_docs=7), prepared / "pretrain", out, tokens,
                              tmp_path / "metrics/tokenize.json", progress=False)
    on_disk = json.loads((tokens / "meta.json").read_text())
    assert {k: on_disk[k] for k in ("dtype", "train_tokens", "val_tokens", "train_bytes", "val_bytes",
                                    "tokenizer_sha256", "vocab_size")} == {k: meta[k] for k in (
        "dtype", "train_tokens", "val_tokens", "train_bytes", "val_bytes", "tokenizer_sha256", "vocab_size")}
    assert on_disk["dtype"] == "uint16" and on_disk["tokenizer_sha256"] == tok.sha256()
    docs = [json.loads(line)["text"] for line in (prepared / "pretrain/train.jsonl").read_text().splitlines()]
    ids = np.fromfile(tokens / "train.bin", dtype=np.uint16)
    assert len(ids) == on_disk["train_tokens"] and on_disk["train_docs"] == len(docs)
    assert on_disk["train_bytes"] == sum(len(d.encode()) for d in docs)
    # each document followed by <|endoftext|>; the literal text "<|endoftext|>" is not the id
    assert (ids == tok.eot_id).sum() == len(docs) and ids[-1] == tok.eot_id
    assert tok.decode(ids.tolist()) == "".join(d + "<|endoftext|>" for d in docs)
    val = np.fromfile(tokens / "val.bin", dtype=np.uint16)
    assert tok.decode(val.tolist()) == SHAKESPEARE + "<|endoftext|>"


def test_parallel_tokenize_equals_serial(prepared, tmp_path):
    out = tmp_path / "tok"
    tokenizer_stage.run(_tok_cfg(), prepared, out, tmp_path / "m.json", progress=False)
    for workers in (1, 2):
        tokenize_stage.run(TokenizeConfig(workers=workers, chunk_docs=5), prepared / "pretrain", out, tmp_path / f"t{workers}",
                           tmp_path / f"m{workers}.json", progress=False)
    for split in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "t1" / split).read_bytes() == (tmp_path / "t2" / split).read_bytes()


def test_max_train_chars_keeps_chat_and_math_first(prepared):
    counts: dict = {}
    texts = list(tokenizer_stage.training_texts(prepared, max_chars=500, counts=counts))
    assert sum(map(len, texts)) >= 500 and list(counts) == ["sft"]


def test_invalid_utf8_is_reported_with_path_line_offset(prepared, tmp_path):
    p = prepared / "pretrain/train.jsonl"
    lines = p.read_bytes().split(b"\n")
    lines[2] = b'{"text": "bad \xff byte", "source": "x"}'
    p.write_bytes(b"\n".join(lines))
    offset = len(lines[0]) + len(lines[1]) + 2 + lines[2].index(b"\xff")
    with pytest.raises(DataError, match=rf"{p}:3: invalid UTF-8 at byte 14 of the line \(file offset {offset}\)"):
        tokenizer_stage.run(_tok_cfg(), prepared, tmp_path / "tok", tmp_path / "m.json", progress=False)
    assert not (tmp_path / "tok").exists()  # nothing half-written


def test_tokenize_failure_leaves_previous_shards(prepared, tmp_path):
    out = tmp_path / "tok"
    tokenizer_stage.run(_tok_cfg(), prepared, out, tmp_path / "m.json", progress=False)
    tokens = tmp_path / "tokens"
    tokenize_stage.run(TokenizeConfig(workers=1, chunk_docs=8), prepared / "pretrain", out, tokens, tmp_path / "t.json",
                       progress=False)
    before = (tokens / "train.bin").read_bytes()
    (prepared / "pretrain/val.jsonl").write_bytes(b'{"text": "\xc3\x28"}\n')
    with pytest.raises(DataError, match="val.jsonl:1: invalid UTF-8"):
        tokenize_stage.run(TokenizeConfig(workers=1, chunk_docs=8), prepared / "pretrain", out, tokens, tmp_path / "t.json",
                           progress=False)
    assert (tokens / "train.bin").read_bytes() == before


def test_corpus_too_small_is_recorded_in_metrics(prepared, tmp_path):
    m = tokenizer_stage.run(_tok_cfg(vocab_size=60_000), prepared, tmp_path / "tok", tmp_path / "m.json",
                            progress=False)
    assert m["early_stop"] and "corpus too small" in m["warning"] and m["vocab_size"] < 60_000
