"""The pieces of bench/ that decide what a figure means: pairing, rotation, corpora, the decode split."""
from __future__ import annotations

import struct

import pytest
import torch

from conftest import ROOT, load_script
from bench.common import loadavg, ratios, rotations, summary


def test_every_name_goes_first_once_per_cycle_of_rounds():
    assert rotations(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_ratios_are_paired_per_round_then_summarised():
    # medians of each side would give 3/2.5 = 1.2; the per-round ratios are 2, 0.5, 1
    assert ratios([2.0, 1.0, 3.0], [1.0, 2.0, 3.0]) == {"min": 0.5, "median": 1.0, "max": 2.0}
    assert summary([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}


def test_the_load_average_is_read():
    assert len(loadavg()) == 3


def _mo(pairs: list[tuple[str, str]]) -> bytes:
    """A GNU .mo catalog (little-endian) holding msgid -> msgstr pairs."""
    ids = [k.encode() for k, _ in pairs]
    strs = [v.encode() for _, v in pairs]
    n, head = len(pairs), 28
    at = head + 16 * n
    table_o, table_t, blob = [], [], b""
    for s in ids:
        table_o.append((len(s), at + len(blob)))
        blob += s + b"\0"
    for s in strs:
        table_t.append((len(s), at + len(blob)))
        blob += s + b"\0"
    out = struct.pack("<7I", 0x950412DE, 0, n, head, head + 8 * n, 0, 0)
    out += b"".join(struct.pack("<2I", *e) for e in table_o) + b"".join(struct.pack("<2I", *e) for e in table_t)
    return out + blob


def test_the_chinese_corpus_reads_the_translations_of_a_message_catalog(tmp_path):
    bench = load_script(ROOT / "bench/tokenizer.py", "bench_tokenizer")
    f = tmp_path / "x.mo"
    f.write_bytes(_mo([("", "Project-Id: x"), ("file", "文件"), ("%d file", "%d 个文件\0%d 个文件们")]))
    assert bench.catalog_messages(f) == ["Project-Id: x", "文件", "%d 个文件", "%d 个文件们"]


def test_the_ids_digest_sees_where_documents_end():
    bench = load_script(ROOT / "bench/tokenizer.py", "bench_tokenizer")
    assert bench.ids_digest([[1, 2], [3]]) != bench.ids_digest([[1], [2, 3]])
    assert bench.ids_digest([[1, 2], [3]]) == bench.ids_digest([[1, 2], [3]])


@pytest.mark.usefixtures("one_thread")
def test_the_decode_split_times_four_ways_and_gives_torch_its_products_back():
    from llm.config import ModelConfig
    from llm.nn.model import GPT
    bench = load_script(ROOT / "bench/generate.py", "bench_generate")
    mm, addmm = torch.mm, torch.addmm
    model = GPT(ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_kv_head=2, n_embd=16)).eval()
    parts = bench.breakdown(model, 2, prompt=4, steps=3, clock=__import__("time").perf_counter)
    assert set(parts) == {"step", "products", "products_in_step", "other"} and all(v > 0 for v in parts.values())
    assert parts["products_in_step"] < parts["step"]  # a part of the step it was timed in
    assert torch.mm is mm and torch.addmm is addmm


@pytest.mark.usefixtures("one_thread")
def test_the_small_operation_probe_times_each_operation_after_each_prelude():
    from llm.config import ModelConfig
    from llm.nn.model import GPT
    bench = load_script(ROOT / "bench/generate.py", "bench_generate")
    model = GPT(ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_kv_head=2, n_embd=16)).eval()
    got = bench.after_products(model, reps=3)
    assert set(got) == {f"{op}_{when}" for op in ("mul", "rms_norm", "silu")
                        for when in ("warm", "after_product", "after_read")}
    assert all(v > 0 for v in got.values())
