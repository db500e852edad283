"""Atomic writes and strict reads."""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llm.errors import MAX_LISTED, capped
from llm.fileio import (MAX_RECORD_BYTES, DataError, atomic_dir, atomic_file, atomic_write_json, atomic_write_text,
                        read_jsonl, read_text, write_jsonl)


def test_atomic_write_replaces_whole_file(tmp_path):
    f = tmp_path / "out.json"
    atomic_write_json(f, {"a": 1})
    atomic_write_json(f, {"a": 2})
    assert json.loads(f.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temp files left


def test_interrupted_atomic_write_keeps_the_old_file(tmp_path):
    f = tmp_path / "out.txt"
    atomic_write_text(f, "old")
    # A process killed in the middle of writing: SIGKILL after half the data.
    code = textwrap.dedent(f"""
        import os, signal
        from llm.fileio import atomic_file
        with atomic_file({str(f)!r}) as fh:
            fh.write("new" * 1000)
            fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd())
    assert r.returncode == -9
    assert f.read_text() == "old"


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_killed_write_leaves_a_temp_that_the_next_successful_write_removes(tmp_path, kind):
    target = tmp_path / ("prepared" if kind == "dir" else "out.txt")
    code = textwrap.dedent(f"""
        import os, signal
        from llm.fileio import atomic_dir, atomic_file
        if {kind!r} == "dir":
            with atomic_dir({str(target)!r}) as t:
                (t / "part.jsonl").write_text("half")
                os.kill(os.getpid(), signal.SIGKILL)
        with atomic_file({str(target)!r}) as fh:
            fh.write("half")
            fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    for _ in range(2):  # two killed runs
        assert subprocess.run([sys.executable, "-c", code], cwd=os.getcwd()).returncode == -9
    assert len(list(tmp_path.glob(f".{target.name}.*.tmp"))) == 2 and not target.exists()
    if kind == "dir":
        with atomic_dir(target) as t:
            (t / "part.jsonl").write_text("whole")
    else:
        atomic_write_text(target, "whole")
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_leftover_cleanup_spares_live_writers_and_other_hosts(tmp_path):
    from llm.fileio import _HOST
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    names = {f".out.txt.{_HOST}-{dead}.abc123.tmp": False,         # this host, process gone: removed
             ".out.txt.xyz789_q.tmp": False,                          # untagged, from an earlier version: removed
             f".out.txt.{_HOST}-{os.getpid()}.def456.tmp": True,     # a live writer (this one): kept
             f".out.txt.otherhost-{dead}.ghi789.tmp": True,           # another host's: its pid means nothing here
             f".out.txt.bak.{_HOST}-{dead}.jkl012.tmp": True}         # the temp of another target, out.txt.bak
    for n in names:
        (tmp_path / n).write_text("x")
    atomic_write_text(tmp_path / "out.txt", "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out.txt", *(n for n, kept in names.items() if kept)])


def test_exception_inside_atomic_dir_keeps_the_old_dir(tmp_path):
    d = tmp_path / "model"
    with atomic_dir(d) as t:
        (t / "w.bin").write_bytes(b"v1")
    with pytest.raises(RuntimeError):
        with atomic_dir(d) as t:
            (t / "w.bin").write_bytes(b"v2-partial")
            raise RuntimeError("crash while writing")
    assert (d / "w.bin").read_bytes() == b"v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_atomic_dir_gives_private_files_the_usual_mode(tmp_path):
    """mkstemp and safetensors create 0600 files; the finished directory has umask-derived modes
    (0644 / 0755 under the common umask 022), executables stay executable."""
    from llm.fileio import _UMASK

    with atomic_dir(tmp_path / "m") as t:
        os.close(os.open(t / "private", os.O_CREAT | os.O_WRONLY, 0o600))
        (t / "sub").mkdir(mode=0o700)
        os.close(os.open(t / "sub" / "tool", os.O_CREAT | os.O_WRONLY, 0o700))
    def mode(p):
        return p.stat().st_mode & 0o777

    assert mode(tmp_path / "m" / "private") == 0o666 & ~_UMASK
    assert mode(tmp_path / "m" / "sub") == mode(tmp_path / "m" / "sub" / "tool") == 0o777 & ~_UMASK


def test_atomic_dir_replaces_existing(tmp_path):
    d = tmp_path / "model"
    with atomic_dir(d) as t:
        (t / "a").write_text("1")
    with atomic_dir(d) as t:
        (t / "b").write_text("2")
    assert sorted(p.name for p in d.iterdir()) == ["b"]


def tree_digest(root) -> str:
    """sha256 of every name under `root` (hidden ones included) and every file's bytes: equal
    before and after a command means it changed, added and removed nothing there."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def temps_under(root) -> list[str]:
    """Temp entries atomic writes leave when they fail (`.<name>.*.tmp`, `.<name>.old-*`)."""
    return sorted(str(p) for p in Path(root).rglob(".*") if p.name.endswith(".tmp") or ".old-" in p.name)


def test_a_swap_that_fails_leaves_no_temp_dir_and_the_target_as_it_was(tmp_path, monkeypatch):
    """The current directory cannot be renamed away: the build succeeds, the swap fails, and
    what was built beside it goes."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    before = tree_digest(tmp_path)
    with pytest.raises(OSError):
        with atomic_dir(Path(".")) as t:
            (t / "w.bin").write_bytes(b"x" * 1000)
    assert tree_digest(tmp_path) == before and temps_under(tmp_path) == []


def test_a_swap_interrupted_after_moving_the_old_dir_puts_it_back(tmp_path, monkeypatch):
    d = tmp_path / "model"
    with atomic_dir(d) as t:
        (t / "w.bin").write_bytes(b"v1")
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(a)
        if len(calls) == 2:  # old -> trash went through; the new dir's rename is interrupted
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(d) as t:
            (t / "w.bin").write_bytes(b"v2")
    monkeypatch.setattr(os, "replace", real)
    assert (d / "w.bin").read_bytes() == b"v1" and temps_under(tmp_path) == []


@pytest.mark.parametrize("target, force, says", [
    ("notes", False, "notes: exists and is not empty (a.txt); name a new directory, or pass --force"),
    ("notes", True, "notes: is not a model (it holds a.txt), so --force will not replace it"),
    ("file.txt", True, "file.txt: exists and is not a directory"),
    (".", True, ".: is the current directory or one above it"),
    ("..", True, "..: is the current directory or one above it"),
    ("in", True, "in: is the input in,"),
    ("in/sub", True, "in/sub: lies inside the input in,"),
])
def test_check_target_refuses_what_a_write_would_destroy(tmp_path, monkeypatch, target, force, says):
    from llm.fileio import TargetError, check_target

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "in").mkdir()
    with pytest.raises(TargetError) as e:
        check_target(target, inputs=["in"], force=force, kind="model", replaceable=lambda p: False)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_check_target_allows_a_new_or_empty_dir_and_with_force_a_replaceable_one(tmp_path, monkeypatch):
    from llm.fileio import check_target

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "w.bin").write_text("x")
    for target, force in (("new", False), ("empty", False), ("old", True)):
        check_target(target, inputs=[], force=force, kind="model", replaceable=lambda p: p.name == "old")


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    from llm.errors import DiskFullError

    target = tmp_path / "out.json"
    atomic_write_json(target, {"v": 1})
    monkeypatch.setattr(os, "fsync", _enospc)  # where a delayed-allocation file system reports it
    with pytest.raises(DiskFullError) as e:
        atomic_write_json(target, {"v": 2})
    assert str(e.value).startswith(f"{target}: no space left on the device while writing it; free space")
    assert json.loads(target.read_text()) == {"v": 1} and temps_under(tmp_path) == []


def test_a_full_disk_inside_a_directory_names_the_directory(tmp_path):
    """A nested write into the temp dir, or a library's own error (safetensors reports the
    errno only in its message), is reported as the directory the user asked for."""
    from safetensors import SafetensorError

    from llm.errors import DiskFullError

    d = tmp_path / "model"
    with atomic_dir(d) as t:
        (t / "w.bin").write_bytes(b"v1")
    before = tree_digest(tmp_path)
    for error in (OSError(errno.EDQUOT, "Disk quota exceeded"),
                  SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")):
        with pytest.raises(DiskFullError, match=f"^{re.escape(str(d))}: no space left on the device"):
            with atomic_dir(d) as t:
                with atomic_file(t / "inner.txt") as f:
                    f.write("x")
                    raise error
        assert tree_digest(tmp_path) == before and temps_under(tmp_path) == []


def test_only_a_full_disk_becomes_a_disk_full_error(tmp_path):
    from safetensors import SafetensorError

    for error in (OSError(errno.EACCES, "Permission denied"), ValueError("bad line: (os error 28)"),
                  SafetensorError("header too large")):
        with pytest.raises(type(error)):
            with atomic_dir(tmp_path / "d"):
                raise error


def _write(tmp_path, data: bytes):
    f = tmp_path / "in.jsonl"
    f.write_bytes(data)
    return f


def test_jsonl_bom_and_crlf_are_fine(tmp_path):
    f = _write(tmp_path, b'\xef\xbb\xbf{"a": 1}\r\n{"a": 2}\r\n\r\n')
    assert list(read_jsonl(f)) == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize("line,reason", [
    (b'{"a": 1', "invalid JSON"),
    (b'{"a": "x\x00y"}', "NUL byte"),
    (b'{"a": "\\ud800"}', "lone surrogate"),
    (b'[1, 2]', "expected a JSON object, got list"),
    (b'{"a": "\xff\xfe"}', "invalid UTF-8 at byte 7 of the line (file offset 17)"),
])
def test_bad_lines_name_path_and_line(tmp_path, line, reason):
    f = _write(tmp_path, b'{"ok": 1}\n' + line + b'\n{"ok": 2}\n')
    with pytest.raises(DataError) as e:
        list(read_jsonl(f))
    assert f"{f}:2: " in str(e.value)
    assert reason in str(e.value)


def test_line_numbers_stay_right_after_a_bad_line(tmp_path):
    f = _write(tmp_path, b'{"ok": 1}\nnot json\n\n{"ok": 2}\n{"broken": \n{"ok": 3}\n')
    stats = []
    got = list(read_jsonl(f, on_bad_record="skip", max_bad_fraction=0.5, stats=stats))
    assert got == [{"ok": 1}, {"ok": 2}, {"ok": 3}]
    assert stats[0].bad == 2
    assert stats[0].reasons[0].startswith(f"{f}:2: invalid JSON")
    assert stats[0].reasons[1].startswith(f"{f}:5: invalid JSON")


def test_truncated_last_line(tmp_path):
    f = _write(tmp_path, b'{"ok": 1}\n{"text": "cut in the mid')
    with pytest.raises(DataError, match=r":2: invalid JSON.*truncated line"):
        list(read_jsonl(f))


def test_bad_fraction_budget(tmp_path):
    f = _write(tmp_path, b'{"ok": 1}\nbad\nbad\n{"ok": 2}\n')
    with pytest.raises(DataError, match="2 of 4 records are bad"):
        list(read_jsonl(f, on_bad_record="skip", max_bad_fraction=0.25))


def test_validate_callback_counts_as_bad(tmp_path):
    f = _write(tmp_path, b'{"text": "a"}\n{"text": 3}\n')
    check = lambda o: None if isinstance(o.get("text"), str) else "field 'text' must be a string"
    with pytest.raises(DataError, match=r":2: field 'text' must be a string"):
        list(read_jsonl(f, validate=check))


@pytest.mark.parametrize("data", [b"", b"\n\n", b"   \n"])
def test_empty_input_is_an_error(tmp_path, data):
    f = _write(tmp_path, data)
    with pytest.raises(DataError, match="no usable records"):
        list(read_jsonl(f))


def test_read_text_invalid_utf8_names_line_and_offset(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(b"hello\nw\xc3orld\n")
    with pytest.raises(DataError, match=r"c.txt:2: invalid UTF-8 at byte 1 of the line \(file offset 7\)"):
        read_text(f)


def test_read_text_empty_is_an_error(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("\n  \n")
    with pytest.raises(DataError, match="empty file"):
        read_text(f)


def test_write_jsonl_round_trip(tmp_path):
    recs = [{"t": "héllo 你好 🙂"}, {"t": "x"}]
    assert write_jsonl(tmp_path / "a" / "b.jsonl", recs) == 2
    assert list(read_jsonl(tmp_path / "a" / "b.jsonl")) == recs


def test_skipped_records_keep_the_first_reasons_and_count_all(tmp_path):
    f = _write(tmp_path, b"bad\n" * 5000 + b'{"ok": 1}\n')
    stats = []
    got = list(read_jsonl(f, on_bad_record="skip", max_bad_fraction=1.0, stats=stats))
    assert got == [{"ok": 1}]
    assert stats[0].bad == 5000 and len(stats[0].reasons) == MAX_LISTED
    assert stats[0].reasons[0].startswith(f"{f}:1: ") and stats[0].reasons[-1].startswith(f"{f}:{MAX_LISTED}: ")


def test_capped_lists_the_first_and_counts_the_rest():
    assert capped(["a", "b"], most=2) == ["a", "b"]
    assert capped(["a", "b", "c", "d"], most=2) == ["a", "b", "... and 2 more"]


def test_read_text_is_one_read_not_a_loop_over_lines(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(b"\xef\xbb\xbfa\r\nb\r\r\n\nc\r\n")
    assert read_text(f) == "a\nb\n\nc"  # BOM dropped, CRLF as LF, the last line ending dropped
    f.write_bytes(b"\n" * (10 << 20) + b"x")  # ten million lines: a loop over them took seconds
    t0 = time.perf_counter()
    assert read_text(f, max_bytes=(10 << 20) + 1).endswith("\n\nx")
    assert time.perf_counter() - t0 < 3


@pytest.mark.parametrize("reader", ["problems", "comparisons"])
def test_readers_of_small_records_refuse_a_huge_line_without_parsing_it(tmp_path, reader):
    """A math problem or a comparison is a few KB; a 3 MiB line of `{},` would take json.loads
    about 80 MB, so it is refused by its length (MAX_RECORD_BYTES) and never parsed."""
    from llm.data.preference import load_pair_splits
    from llm.post.rl import read_problems
    from tests.conftest import bounded

    huge = b'[' + b'{},' * (1 << 20) + b'{}]\n'
    if reader == "problems":
        f = _write(tmp_path, b'{"question": "1 + 1?", "answer": "2"}\n' + huge)
        read = lambda: read_problems(f)  # noqa: E731
    else:
        f = tmp_path / "train.jsonl"
        f.write_bytes(b'{"prompt": [{"role": "user", "content": "p"}], "chosen": "a", "rejected": "b"}\n' + huge)
        read = lambda: load_pair_splits(tmp_path, tokenizer=None, seq_len=64)  # noqa: E731
    with bounded(seconds=5, memory=32 << 20), pytest.raises(DataError) as e:
        read()
    assert str(e.value).startswith(f"{f}:2: line longer than {MAX_RECORD_BYTES} bytes")


def test_unchanged_since_written_needs_every_file_listed_with_its_hash(tmp_path):
    """What --force may replace: the manifest lists every file (nested ones by relative name) with
    the hash it has now; a link, an unlisted folder or a changed byte is not what was written."""
    from llm.fileio import sha256_file, unchanged_since_written

    d = tmp_path / "out"
    (d / "sub").mkdir(parents=True)
    (d / "w.bin").write_bytes(b"w")
    (d / "sub" / "t.txt").write_text("t")
    files = {"w.bin": sha256_file(d / "w.bin"), "sub/t.txt": sha256_file(d / "sub" / "t.txt")}
    (d / "m.json").write_text(json.dumps({"files": files}))
    check = lambda: unchanged_since_written(d, "m.json", files_of=lambda doc: doc.get("files"))  # noqa: E731
    assert check()
    assert not unchanged_since_written(d, "m.json", files_of=lambda doc: doc.get("files"), max_manifest_bytes=10)
    (d / "sub" / "t.txt").write_text("T")
    assert not check()
    (d / "sub" / "t.txt").write_text("t")
    (d / "empty").mkdir()
    assert not check()
    (d / "empty").rmdir()
    (d / "w.bin").unlink()
    (d / "w.bin").symlink_to(tmp_path / "elsewhere.bin")
    (tmp_path / "elsewhere.bin").write_bytes(b"w")
    assert not check()
