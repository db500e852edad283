"""Training checkpoints: write atomically, verify before trusting, resume the newest good one.

A checkpoint is a directory `<run_dir>/ckpt-<step:08d>/`:

    model.safetensors        every model tensor (tied aliases stored once, see "aliases")
    train_state.safetensors  every other tensor: optimizer moments, RNG states (uint8), ...
    state.json               everything else, with {"__tensor__": key} where a tensor was
    manifest.json            written last: format_version, step, fingerprint, and the
                             sha256 + size of each file above

It is built in a temp sibling (`llm.fileio.atomic_dir`: fsync, then one rename), so a
process killed mid-write leaves only a `.ckpt-*.tmp` directory that is never read and is
removed by the next successful save. Nothing here unpickles: tensors come from
safetensors, the rest from JSON.

`find_resume(run_dir, fingerprint)` walks the checkpoints of this fingerprint newest
first, in `run_dir` and in `run_dir/stale/`, and returns the first one that verifies
(manifest readable, every file present with its size and sha256, every float tensor
finite). Broken ones are named in a warning and skipped; if every checkpoint of the
current run is broken it raises, because silently starting over would throw away the
run. Checkpoints whose fingerprint (params + input hashes) differs from the current
run's are never resumed: the caller moves them to `run_dir/stale/<fingerprint>/`
(`quarantine_stale`), where a later run with those params finds them again, so a
params round trip (cpu -> smoke -> cpu) resumes the first run where it stopped.

Nothing that could be resumed is ever deleted by a params change. stale/ holds, per
fingerprint, at most the checkpoints a run kept (`keep`); the only thing that removes a
stale checkpoint is a save of the same fingerprint at the same or a later step, which
moves the older ones back into `run_dir`, where the usual retention (`prune`) applies,
so a run that resumed from stale/ does not leave a second copy of its history there.
To reclaim disk from params you will not return to, delete their `stale/<fingerprint>/`.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llm.errors import CheckpointError, capped  # noqa: F401 (CheckpointError: callers import it from here)
from llm.fileio import DataError, atomic_dir, atomic_write_json, read_text, sha256_file

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 10  # manifest.json lists three files: a few hundred bytes
_NAME = re.compile(r"^ckpt-(\d{8})$")
STALE = "stale"
MODEL_FILE, STATE_TENSORS, STATE_JSON, MANIFEST = (
    "model.safetensors", "train_state.safetensors", "state.json", "manifest.json")


@dataclass
class Checkpoint:
    path: Path
    step: int
    fingerprint: str
    model_state: dict[str, torch.Tensor]
    train_state: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # newer checkpoints rejected on the way here


# ---------------------------------------------------------------------------
# Nested state <-> (JSON tree, flat tensor dict)

def _flatten(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able tree of `obj`; tensors are moved to `tensors` under their dotted path."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and "__tensor__" not in obj:
            return {k: _flatten(v, f"{key}/{k}", tensors) for k, v in obj.items()}
        # int keys (e.g. optimizer state by index) survive as explicit pairs
        return {"__items__": [[k, _flatten(v, f"{key}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}  # 'nan', 'inf', '-inf'
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint state at {key!r}: cannot store a {type(obj).__name__}"
                    f" (only tensors, dicts, lists, tuples, numbers, strings, None)")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            key = obj["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"{where}: state.json refers to tensor {key!r}, missing from {STATE_TENSORS}")
            return tensors[key]
        if "__items__" in obj:
            return {k: _unflatten(v, tensors, where) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors, where) for v in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        return {k: _unflatten(v, tensors, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors, where) for v in obj]
    return obj


def _storable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that own their memory (safetensors refuses shared memory)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for k, t in state.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr()
        owns = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if t.device.type != "cpu":
            t = t.to("cpu").contiguous()  # a fresh copy
        elif ptr in storages or not owns:
            t = t.clone(memory_format=torch.contiguous_format)
        storages.add(ptr)
        out[k] = t
    return out


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store tensors that are the same memory (tied embeddings) once: (tensors, {alias: stored key})."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for k, t in state.items():
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if ident in seen:
            aliases[k] = seen[ident]
        else:
            seen[ident] = k
            kept[k] = t
    return _storable(kept), aliases


# ---------------------------------------------------------------------------
# Writing

def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:08d}"


def save_checkpoint(run_dir: str | Path, step: int, *, model_state: dict[str, torch.Tensor],
                    train_state: dict[str, Any], fingerprint: str, keep: int) -> Path:
    """Write `ckpt-<step>` atomically, then delete all but the newest `keep` (>= 2) checkpoints.

    `model_state`: a full (unsharded) state dict. `train_state`: nested dicts/lists of
    tensors and JSON scalars (optimizer state, sampler state, histories, RNG states).
    """
    if keep < 2:
        raise ValueError(f"keep_checkpoints must be >= 2 (a crash while writing the newest must"
                         f" leave an older one), got {keep}")
    path = checkpoint_path(run_dir, step)
    model_tensors, aliases = _dedupe(model_state)
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(train_state, "state", tensors)
    with atomic_dir(path) as tmp:
        save_file(model_tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        save_file(_storable(tensors), str(tmp / STATE_TENSORS), metadata={"format": "pt"})
        (tmp / STATE_JSON).write_text(json.dumps(
            {"format_version": FORMAT_VERSION, "step": step, "fingerprint": fingerprint,
             "aliases": aliases, "state": tree}, allow_nan=False, indent=1), encoding="utf-8")
        files = {name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
                 for name in (MODEL_FILE, STATE_TENSORS, STATE_JSON)}
        # the manifest is the last file: a directory without a complete one is never trusted
        atomic_write_json(tmp / MANIFEST, {"format_version": FORMAT_VERSION, "step": step,
                                           "fingerprint": fingerprint, "files": files})
    _reclaim(run_dir, fingerprint, step)
    prune(run_dir, keep)
    return path


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `ckpt-*` directory, newest first (not verified)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def stale_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint set aside in `run_dir/stale/`, newest first: one folder
    per fingerprint, plus checkpoints directly in stale/ (where earlier versions put them)."""
    dest = Path(run_dir) / STALE
    if not dest.is_dir():
        return []
    groups = [dest] + sorted(p for p in dest.iterdir() if p.is_dir() and not _NAME.match(p.name))
    return sorted((c for g in groups for c in list_checkpoints(g)), reverse=True)


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints and leftovers of killed writes; returns what went."""
    run_dir = Path(run_dir)
    gone = [p for _, p in list_checkpoints(run_dir)[keep:]]
    # temp dirs of writes that were killed (atomic_dir names them .ckpt-XXXXXXXX.*.tmp / .old-*)
    gone += [p for p in run_dir.glob(".ckpt-*") if p.is_dir()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _group(fingerprint: str) -> str:
    """The stale/ folder name of a fingerprint: its first 16 characters, made safe as a name."""
    return re.sub(r"[^0-9A-Za-z_-]", "_", fingerprint)[:16] or "unknown"


def _same(path: Path, manifest: dict) -> bool:
    """Whether the checkpoint at `path` has this manifest: the same step, fingerprint and file hashes."""
    try:
        return read_manifest(path) == manifest
    except CheckpointError:
        return False


def quarantine_stale(run_dir: str | Path, stale: list[Path]) -> Path | None:
    """Move checkpoints of a different run (other params/inputs) to `<run_dir>/stale/<fingerprint>/`.

    Nothing is deleted: find_resume looks there, so going back to those params resumes that
    run. A checkpoint whose name is taken in its folder by one with the same manifest (the same
    bytes) is the same checkpoint twice and is dropped; a different one goes to `<fingerprint>.2/`
    (.3, ...). Returns `<run_dir>/stale`, or None when there was nothing to move.
    """
    if not stale:
        return None
    dest = Path(run_dir) / STALE
    for p in stale:
        manifest = read_manifest(p)  # readable: find_resume has read it
        n, folder = 1, dest / _group(manifest["fingerprint"])
        while (folder / p.name).exists():
            if _same(folder / p.name, manifest):
                break
            n += 1
            folder = dest / f"{_group(manifest['fingerprint'])}.{n}"
        if (folder / p.name).exists():
            shutil.rmtree(p)  # a byte-identical copy of a checkpoint that stays in stale/
            continue
        folder.mkdir(parents=True, exist_ok=True)
        p.rename(folder / p.name)
    return dest


def _reclaim(run_dir: str | Path, fingerprint: str, step: int) -> None:
    """After saving `fingerprint` at `step`: move this run's checkpoints up to that step back from
    stale/ into run_dir (where prune's retention applies), so stale/ keeps no second history of
    a run that has since moved on. A stale copy of a step run_dir already has is dropped."""
    run_dir = Path(run_dir)
    for at, p in stale_checkpoints(run_dir):
        try:
            manifest = read_manifest(p)
        except CheckpointError:
            continue  # not provably this run's: left where it is
        if manifest["fingerprint"] != fingerprint or at > step:
            continue
        target = checkpoint_path(run_dir, at)
        if not target.exists():
            p.rename(target)
        elif _same(target, manifest):
            shutil.rmtree(p)  # the same bytes as the one in run_dir
        # else: another checkpoint of this step (another device, say): it stays in stale/
    dest = run_dir / STALE
    for folder in [*dest.iterdir(), dest] if dest.is_dir() else []:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


# ---------------------------------------------------------------------------
# Reading and verifying

def read_manifest(path: str | Path) -> dict:
    """The manifest of a checkpoint directory; CheckpointError if missing or malformed."""
    path = Path(path)
    mpath = path / MANIFEST
    if not os.path.lexists(mpath):
        raise CheckpointError(f"{path}: no {MANIFEST} (the write did not finish)")
    try:  # read before anything it lists: a bounded read of a regular file, never a traceback
        manifest = json.loads(read_text(mpath, max_bytes=MAX_MANIFEST_BYTES))
    except (DataError, ValueError, RecursionError) as e:  # DataError names the file already
        raise CheckpointError(str(e) if isinstance(e, DataError) else f"{mpath}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) \
            or not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("fingerprint"), str):
        raise CheckpointError(f"{mpath}: malformed manifest (needs step, fingerprint, files)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format_version {manifest.get('format_version')!r},"
                              f" this code reads {FORMAT_VERSION}")
    return manifest


def _verify_files(path: Path, manifest: dict) -> None:
    for name in (MODEL_FILE, STATE_TENSORS, STATE_JSON):
        entry = manifest["files"].get(name)
        f = path / name
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: manifest does not list {name}")
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        size = f.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{f}: {size} bytes, manifest says {entry.get('bytes')} (truncated?)")
        digest = sha256_file(f)
        if digest != entry.get("sha256"):
            raise CheckpointError(f"{f}: sha256 {digest[:16]}... does not match the manifest"
                                  f" ({str(entry.get('sha256'))[:16]}...): the file is corrupt")


def _load_tensors(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None


def _check_finite(tensors: dict[str, torch.Tensor], f: Path) -> None:
    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            n = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{f}: tensor {k!r} holds {n} non-finite value(s) (NaN/Inf)")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verify and load one checkpoint directory. Raises CheckpointError naming what is wrong."""
    path = Path(path)
    manifest = read_manifest(path)
    _verify_files(path, manifest)
    try:  # its size and hash matched the manifest: this project wrote it
        doc = json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path / STATE_JSON}: unreadable ({e})") from None
    if doc.get("step") != manifest["step"] or doc.get("fingerprint") != manifest["fingerprint"]:
        raise CheckpointError(f"{path}: state.json and manifest.json disagree on step or fingerprint")
    model = _load_tensors(path / MODEL_FILE)
    extra = _load_tensors(path / STATE_TENSORS)
    _check_finite(model, path / MODEL_FILE)
    _check_finite(extra, path / STATE_TENSORS)
    for alias, key in doc.get("aliases", {}).items():
        if key not in model:
            raise CheckpointError(f"{path}: alias {alias!r} -> {key!r}, which is not in {MODEL_FILE}")
        model[alias] = model[key]
    state = _unflatten(doc["state"], extra, str(path))
    return Checkpoint(path=path, step=manifest["step"], fingerprint=manifest["fingerprint"],
                      model_state=model, train_state=state)


def find_resume(run_dir: str | Path, fingerprint: str, warn: Callable[[str], None] = print,
                ) -> tuple[Checkpoint | None, list[Path]]:
    """(newest verified checkpoint of this run or None, checkpoints of other runs in run_dir).

    Looks in run_dir and in run_dir/stale/ (where a params change moved this run's checkpoints
    if it was set aside earlier); at the same step, run_dir's copy comes first. Newer broken
    checkpoints are named through `warn` and skipped. If checkpoints of this run exist but none
    verifies, raises CheckpointError listing each one's problem: starting over silently would
    discard the run. The second value lists only run_dir's own checkpoints of other fingerprints
    (for quarantine_stale); stale/ is never reported back.
    """
    problems: list[str] = []
    stale: list[Path] = []
    mine: list[tuple[int, int, Path]] = []  # (step, 0 in run_dir | 1 in stale/, path)
    for aside, found in ((0, list_checkpoints(run_dir)), (1, stale_checkpoints(run_dir))):
        for step, path in found:
            try:
                theirs = read_manifest(path)["fingerprint"]
            except CheckpointError:
                if aside:
                    continue  # not provably this run's
                theirs = None  # in run_dir, an unreadable one counts as a broken checkpoint of this run
            if theirs in (fingerprint, None):
                mine.append((step, aside, path))
            elif not aside:
                stale.append(path)
    for _, _, path in sorted(mine, key=lambda c: (-c[0], c[1])):
        try:
            ck = load_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"checkpoint: skipping {path}: {e}")
            continue
        ck.skipped = problems
        return ck, stale
    if problems:
        raise CheckpointError(
            f"{run_dir}: no usable checkpoint; every one failed verification:\n  " + "\n  ".join(capped(problems))
            + f"\nRefusing to start over silently. Delete {run_dir} (or the broken checkpoints) to start"
              f" a fresh run.")
    return None, stale
