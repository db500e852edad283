"""Safe file I/O: atomic writes and strict, well-reported reads.

Writes go to a temporary sibling, are fsynced, then renamed over the target, so a
killed process leaves either the old file or the new one, never half of one; the temp
sibling it leaves (`.<name>.<host>-<pid>.*.tmp`) is removed by the next successful write
of the same target. (Under `dvc repro` the old one may be gone already: DVC deletes a
stage's outputs before running it, and `dvc checkout` restores the committed ones.)

Reads are strict UTF-8 and every bad record is reported as `path:line: reason`:

    data/raw/sft.jsonl:17: invalid JSON: Expecting ',' delimiter (column 42)
    data/raw/corpus.txt:3: invalid UTF-8 at byte 118 of the line (file offset 2310)

`read_jsonl(..., on_bad_record="skip", max_bad_fraction=0.01)` skips bad lines up to
a budget and counts them; "raise" stops at the first one. Empty input is an error.

Reads are bounded whatever the input: only regular files are opened (a directory, a
device such as /dev/zero or a FIFO is refused by name), a line may hold at most
MAX_LINE_BYTES, or MAX_RECORD_BYTES for a reader of small records (a longer one is a bad
record, read past without being held), and a
JSON record may nest at most MAX_JSON_DEPTH levels (a deeper one is a bad record, not a
RecursionError).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from llm.errors import MAX_LISTED, DiskFullError, is_disk_full


class DataError(ValueError):
    """A problem with an input file that the user can fix; the message names path and line."""


@contextlib.contextmanager
def naming_full_disk(*outputs: str | Path) -> Iterator[None]:
    """A full disk (or quota) inside the block becomes one DiskFullError naming the file the
    error names, or else `outputs`; one raised by an atomic write below, which names its
    target, passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if not is_disk_full(e):
            raise
        name = getattr(e, "filename", None)
        raise DiskFullError(name or ", ".join(map(str, outputs)),
                            "while writing it" if name else "while writing one of these") from None


@contextlib.contextmanager
def _full_disk_as(path: Path) -> Iterator[None]:
    """A full disk while writing `path` (its temp sibling, or a nested atomic write into that
    temp) is reported as `path`, the name the user knows."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(path) from None


# ---------------------------------------------------------------------------
# Atomic writes

def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def _public(path: str | Path, directory: bool = False) -> None:
    """mkstemp/mkdtemp create 0600/0700 entries; give them the usual umask-derived mode."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_UMASK)

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Temp names carry this host and process: `.<name>.<host>-<pid>.<random>.tmp`. After a write
# succeeds, the temps of its target that a killed write left behind are removed: those of this
# host whose process is gone, and untagged ones of earlier versions. A live writer's temp, or
# another host's (on a shared disk its pid means nothing here), is left alone.
_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}.{_HOST}-{os.getpid()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, as another user's
        return True
    return True


def _remove_leftovers(path: Path) -> list[Path]:
    """Remove the temp siblings of `path` that killed writes left; returns what went."""
    prefix, gone = f".{path.name}.", []
    for p in path.parent.glob(glob.escape(prefix) + "*.tmp"):
        body = p.name[len(prefix):-len(".tmp")]
        if "." in body:  # tagged "<host>-<pid>.<random>" (or another target's temp: no host match)
            host, _, pid = body.rsplit(".", 1)[0].rpartition("-")
            if host != _HOST or not pid.isdigit() or _alive(int(pid)):
                continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        gone.append(p)
    return gone


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False) + "\n")


def write_jsonl(path: str | Path, records: Iterable[dict]) -> int:
    """Atomically write one JSON object per line; returns the record count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with atomic_file(path) as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, allow_nan=False))
            f.write("\n")
            n += 1
    return n


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[Any]:
    """Stream into a temp file that replaces `path` only if the block completes (a full disk:
    DiskFullError naming `path`, which is left as it was)."""
    path = Path(path)
    with _full_disk_as(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=".tmp", dir=path.parent)
        try:
            kwargs = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
            with os.fdopen(fd, mode, **kwargs) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            _public(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    _fsync_dir(path.parent)
    _remove_leftovers(path)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under root, giving each the umask-derived mode on the way:
    writers that create private files (mkstemp, safetensors: 0600) would otherwise leave a
    model directory that other users cannot read. Executable files stay executable."""
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            _public(os.path.join(dirpath, name), directory=True)
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o111
                os.chmod(path, (0o777 if executable else 0o666) & ~_UMASK)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Build a directory in a temp sibling; on success it replaces `path` in one rename.

    If the block or the swap raises (KeyboardInterrupt included), `path` is as it was and the
    temp dir is removed; a full disk is reported as DiskFullError naming `path`; if the process is killed, the temp dir stays until the next successful write of `path` removes it.
    The swap of an existing directory is two renames (old -> trash, new -> path); a crash
    between them leaves `path` missing but the complete old copy in `.<name>.old-*`, and
    the next successful write removes it.
    """
    path = Path(path)
    with _full_disk_as(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(path), suffix=".tmp", dir=path.parent))
        _public(tmp, directory=True)
        try:
            yield tmp
            _fsync_tree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    old = None
    try:
        if path.exists() or path.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rmdir(old)
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:  # e.g. `path` is a mount point or the current directory: put things back
        if old is not None and not os.path.lexists(path):
            os.replace(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in path.parent.glob(glob.escape(f".{path.name}.old-") + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    _remove_leftovers(path)


class TargetError(ValueError):
    """An output path a command will not write: the write would destroy what the command did not make."""


def check_target(out: str | Path, *, inputs: Iterable[str | Path], force: bool, kind: str,
                 replaceable: Callable[[Path], bool]) -> None:
    """Refuse an output directory whose replacement would destroy what this command did not make.

    `out` may not be the current directory or above it, nor be, hold or lie inside one of `inputs`
    (whatever `force` says). If it exists it must be an empty directory or, with `force`, one that
    `replaceable(out)` recognises as a `kind`, the kind of directory the command writes; anything
    else (a file, a directory of other things, e.g. the folder holding every model) is refused.
    The command still writes beside `out` and swaps (atomic_dir), so a failed write changes nothing.
    """
    out, here = Path(out), Path.cwd().resolve()
    where = out.resolve()
    if where == here or where in here.parents:
        raise TargetError(f"{out}: is the current directory or one above it; name a new directory for the {kind}")
    for inp in inputs:
        src = Path(inp).resolve()
        if where == src or where in src.parents or src in where.parents:
            how = "is" if where == src else "holds" if where in src.parents else "lies inside"
            raise TargetError(f"{out}: {how} the input {inp}, which writing there would destroy; name a new"
                              f" directory for the {kind}")
    if not os.path.lexists(out):
        return
    if not out.is_dir() or out.is_symlink():
        raise TargetError(f"{out}: exists and is not a directory; name a new directory for the {kind}")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    if not force:
        raise TargetError(f"{out}: exists and is not empty ({shown}); name a new directory, or pass --force to"
                          f" replace it if it is a {kind}")
    if not replaceable(out):
        raise TargetError(f"{out}: is not a {kind} (it holds {shown}), so --force will not replace it: it replaces"
                          f" only a {kind} this project wrote and nobody changed since (each file as its manifest"
                          f" lists it, and no other); name a new directory, or move this one"
                          f" away yourself if nothing in it is needed")


def unchanged_since_written(path: str | Path, manifest: str, files_of: Callable[[Any], Any],
                            max_manifest_bytes: int = 1 << 20) -> bool:
    """Whether directory `path` is exactly as this project wrote it: its `manifest` JSON file (a regular
    file of at most `max_manifest_bytes`) lists, as `files_of(doc)`, every other file under `path` by its
    relative POSIX name with its sha256, and each has that hash now. What check_target's `force` may
    replace: file names alone prove nothing (a user's directory can hold the same ones), and an edit
    made after writing (a card, a weight) is kept. Links, folders the list does not need and anything
    not a regular file fail; only listed files are hashed, and the walk stops at the first file or
    folder beyond the list."""
    path = Path(path)
    doc_path = path / manifest
    try:
        if not doc_path.is_file() or doc_path.is_symlink() or doc_path.stat().st_size > max_manifest_bytes:
            return False
        listed = files_of(json.loads(doc_path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    if not isinstance(listed, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in listed.items()):
        return False
    present: dict[str, Path] = {}
    folders = {n.rsplit("/", i)[0] for n in listed for i in range(1, n.count("/") + 1)}  # a/b/c: a/b, a
    for dirpath, dirnames, filenames in os.walk(path):
        rel_dir = Path(dirpath).relative_to(path).as_posix()
        if rel_dir != "." and rel_dir not in folders:  # e.g. an empty folder of the user's
            return False
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            f = Path(dirpath) / name
            rel = f.relative_to(path).as_posix()
            if rel == manifest:
                continue
            if rel not in listed or f.is_symlink() or not f.is_file():
                return False
            present[rel] = f
    return set(present) == set(listed) and all(sha256_file(present[n]) == h for n, h in listed.items())


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: str | Path) -> str:
    """Hash of a file, or of a directory's relative names and contents (sorted)."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(path)).encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------
# Strict reads

MAX_LINE_BYTES = 64 << 20  # one line of text or one JSONL record; a document may be a book
# One record of a file whose records are small (a comparison, a math problem: a few KB). json.loads
# takes up to 26 bytes of memory a byte of a line (`[{},{},...]`: 16 MB took 411 MB), so such a
# reader passes this bound and a longer line is a bad record, read past and never parsed.
MAX_RECORD_BYTES = 1 << 20
MAX_JSON_DEPTH = 100  # nesting of one JSONL record; a chat record is 4 levels deep


def open_regular(path: str | Path) -> Any:
    """Open a regular file for binary reading, or raise DataError saying what `path` is instead.

    A directory, a device (`/dev/zero` never ends), a FIFO (blocks until someone writes) or a
    socket is refused before it is opened."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise DataError(f"{path}: is {kind}, not a regular file; give the path of a data file")
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None


def _raw_lines(f: Any, path: Path, most: int = MAX_LINE_BYTES) -> Iterator[tuple[int, int, bytes | None]]:
    """(line number, file offset, raw bytes) per line; raw is None for a line longer than
    `most` bytes, which is read past in blocks and never held whole."""
    offset, lineno = 0, 0
    while True:
        raw = f.readline(most + 1)
        if not raw:
            return
        lineno += 1
        start = offset
        offset += len(raw)
        if len(raw) > most and not raw.endswith(b"\n"):
            while (more := f.readline(1 << 20)) and not more.endswith(b"\n"):
                offset += len(more)
            offset += len(more)
            yield lineno, start, None
            continue
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw, start = raw[3:], start + 3
        yield lineno, start, raw


def _decode_line(raw: bytes, path: Path, lineno: int, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line"
                        f" (file offset {offset + e.start}): {raw[max(0, e.start - 8):e.start + 8]!r};"
                        f" re-encode the file as UTF-8") from None


def _too_long(path: Path, lineno: int, most: int = MAX_LINE_BYTES) -> str:
    return f"{path}:{lineno}: line longer than {most} bytes (a missing newline, or not a text file?)"


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """Yield (line number, text without the line ending) from a strict UTF-8 regular file.

    A UTF-8 BOM at the start is dropped; CRLF and LF endings both work. A line over
    MAX_LINE_BYTES is an error (DataError naming path and line)."""
    path = Path(path)
    with open_regular(path) as f:
        for lineno, start, raw in _raw_lines(f, path):
            if raw is None:
                raise DataError(_too_long(path, lineno))
            text = _decode_line(raw, path, lineno, start)
            yield lineno, text.rstrip("\r\n")


def read_text(path: str | Path, max_bytes: int | None = None) -> str:
    """The whole file as strict UTF-8 (errors name path, line and byte); empty is an error,
    and so is a file over `max_bytes`."""
    path = Path(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise DataError(f"{path}: {size} bytes, more than the {max_bytes} this file can hold (wrong file?)")
        # One read and one decode, not a loop over lines: a file of a million empty lines is
        # read at the speed of a file of one line.
        raw = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(raw) > max_bytes:  # it grew since the size was read
        raise DataError(f"{path}: more than the {max_bytes} bytes this file can hold (wrong file?)")
    raw = raw.removeprefix(b"\xef\xbb\xbf")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        start, end = raw.rfind(b"\n", 0, e.start) + 1, raw.find(b"\n", e.start)
        line = raw[start:] if end < 0 else raw[start:end]
        _decode_line(line, path, raw.count(b"\n", 0, e.start) + 1, start)  # raises, naming the line
        raise
    text = re.sub(r"\r+(?=\n|\Z)", "", text).removesuffix("\n")  # CRLF as LF; the last line's ending dropped
    if not text.strip():
        raise DataError(f"{path}: empty file; expected text")
    return text


@dataclass
class ReadStats:
    """What a reader saw: records kept, bad records skipped, and the first few reasons."""
    path: str
    records: int = 0
    bad: int = 0
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"path": self.path, "records": self.records, "bad": self.bad, "reasons": self.reasons[:MAX_LISTED]}


class BadRecords:
    """The raise|skip policy with a budget, shared by every reader."""

    def __init__(self, path: str | Path, on_bad_record: str = "raise", max_bad_fraction: float = 0.0):
        if on_bad_record not in ("raise", "skip"):
            raise ValueError(f"on_bad_record must be 'raise' or 'skip', got {on_bad_record!r}")
        self.on_bad_record, self.max_bad_fraction = on_bad_record, max_bad_fraction
        self.stats = ReadStats(str(path))

    def bad(self, reason: str) -> None:
        self.stats.bad += 1
        if len(self.stats.reasons) < MAX_LISTED:  # the first few say what is wrong; `bad` counts them all
            self.stats.reasons.append(reason)
        if self.on_bad_record == "raise":
            raise DataError(reason + "  (set on_bad_record: skip to skip bad records)")

    def finish(self) -> ReadStats:
        s = self.stats
        total = s.records + s.bad
        if s.records == 0:
            extra = f" ({s.bad} bad records, first: {s.reasons[0]})" if s.bad else ""
            raise DataError(f"{s.path}: no usable records{extra}")
        if s.bad and s.bad / total > self.max_bad_fraction:
            raise DataError(f"{s.path}: {s.bad} of {total} records are bad ({s.bad / total:.1%}), above"
                            f" max_bad_fraction={self.max_bad_fraction}; first: {s.reasons[0]}")
        return s


def read_jsonl(path: str | Path, on_bad_record: str = "raise", max_bad_fraction: float = 0.0,
               validate: Callable[[Any], str | None] | None = None,
               stats: list[ReadStats] | None = None, max_line_bytes: int | None = None) -> Iterator[dict]:
    """Yield one dict per line of a JSONL file.

    Bad lines (invalid UTF-8, invalid JSON, not an object, NUL bytes, a lone surrogate,
    longer than `max_line_bytes` (None: MAX_LINE_BYTES), or `validate(obj)` returning a reason) raise
    `DataError("path:line: reason")` or are skipped and counted, by `on_bad_record`. Blank lines
    are ignored. After the last line the budget is checked; if `stats` is a list the final
    ReadStats is appended.
    """
    policy = BadRecords(path, on_bad_record, max_bad_fraction)
    for _, obj in iter_jsonl(path, policy, validate, max_line_bytes):
        policy.stats.records += 1
        yield obj
    result = policy.finish()
    if stats is not None:
        stats.append(result)


def iter_jsonl(path: str | Path, policy: BadRecords, validate: Callable[[Any], str | None] | None = None,
               max_line_bytes: int | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each good line; bad lines go to `policy` (which may raise).

    The caller counts good records (`policy.stats.records += 1`) once it has accepted
    them, so schema checks downstream share the same budget and line numbers.
    """
    path = Path(path)
    max_line_bytes = MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes  # read now: tests lower it
    with open_regular(path) as f:
        for lineno, start, raw in _raw_lines(f, path, max_line_bytes):
            if raw is None:
                policy.bad(_too_long(path, lineno, max_line_bytes))
                continue
            try:
                text = _decode_line(raw, path, lineno, start)
            except DataError as e:
                policy.bad(str(e))
                continue
            if not text.strip():
                continue
            reason = None
            if "\x00" in text:
                reason = "NUL byte in line"
            else:
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    truncated = " (truncated line?)" if not raw.endswith(b"\n") or "Unterminated" in e.msg else ""
                    reason = f"invalid JSON: {e.msg} (column {e.colno}){truncated}"
                except ValueError as e:  # e.g. an integer of more digits than Python converts
                    reason = f"invalid JSON: {e}"
                except RecursionError:
                    reason = f"JSON nested too deeply to read (more than {MAX_JSON_DEPTH} levels)"
                else:
                    if _too_deep(obj):
                        reason = f"JSON nested more than {MAX_JSON_DEPTH} levels deep; a record is a few levels"
                    elif not isinstance(obj, dict):
                        reason = f"expected a JSON object, got {type(obj).__name__}"
                    elif _has_lone_surrogate(obj):
                        reason = "string holds a lone surrogate (\\ud800-\\udfff), which is not valid Unicode"
                    elif validate is not None:
                        reason = validate(obj)
            if reason is not None:
                policy.bad(f"{path}:{lineno}: {reason}")
                continue
            yield lineno, obj


def _children(obj: Any) -> list:
    return [*obj.keys(), *obj.values()] if isinstance(obj, dict) else obj if isinstance(obj, list) else []


def _too_deep(obj: Any) -> bool:
    """Whether `obj` nests deeper than MAX_JSON_DEPTH (iterative: no recursion on hostile input)."""
    level = [obj]
    for _ in range(MAX_JSON_DEPTH):
        level = [c for o in level for c in _children(o) if isinstance(c, (dict, list))]
        if not level:
            return False
    return True


def _has_lone_surrogate(obj: Any) -> bool:
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            try:
                o.encode("utf-8")
            except UnicodeEncodeError:
                return True
        else:
            stack.extend(_children(o))
    return False
