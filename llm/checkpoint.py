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

`find_resume(run_dir, fingerprint)` walks the checkpoints newest first and returns the
first one that verifies (manifest readable, every file present with its size and sha256,
every float tensor finite). Broken ones are named in a warning and skipped; if every
checkpoint of the current run is broken it raises, because silently starting over would
throw away the run. Checkpoints whose fingerprint (params + input hashes) differs from
the current run's are never resumed: the caller starts fresh and moves them to
`<run_dir>/stale/` (`quarantine_stale`).
"""
from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llm.fileio import atomic_dir, atomic_write_json, sha256_file
from llm.errors import CheckpointError  # noqa: F401 (raised here; callers import it from here too)

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{8})$")
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
    prune(run_dir, keep)
    return path


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `ckpt-*` directory, newest first (not verified)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints and leftovers of killed writes; returns what went."""
    run_dir = Path(run_dir)
    gone = [p for _, p in list_checkpoints(run_dir)[keep:]]
    # temp dirs of writes that were killed (atomic_dir names them .ckpt-XXXXXXXX.*.tmp / .old-*)
    gone += [p for p in run_dir.glob(".ckpt-*") if p.is_dir()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def quarantine_stale(run_dir: str | Path, stale: list[Path]) -> Path | None:
    """Move checkpoints of a different run (other params/inputs) to `<run_dir>/stale/`.

    Only the latest set of stale checkpoints is kept there, so disk use stays bounded
    while an accidental params change does not destroy the old run.
    """
    if not stale:
        return None
    dest = Path(run_dir) / "stale"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for p in stale:
        p.rename(dest / p.name)
    return dest


# ---------------------------------------------------------------------------
# Reading and verifying

def read_manifest(path: str | Path) -> dict:
    """The manifest of a checkpoint directory; CheckpointError if missing or malformed."""
    path = Path(path)
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (the write did not finish)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
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
    try:
        doc = json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
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
    """(newest verified checkpoint of this run or None, checkpoints of other runs).

    Newer broken checkpoints are named through `warn` and skipped. If checkpoints exist
    but none verifies (and they are not all stale), raises CheckpointError listing each
    one's problem: starting over silently would discard the run.
    """
    problems: list[str] = []
    stale: list[Path] = []
    for _, path in list_checkpoints(run_dir):
        try:
            manifest = read_manifest(path)
            if manifest["fingerprint"] != fingerprint:
                stale.append(path)
                continue
            ck = load_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"checkpoint: skipping {path}: {e}")
            continue
        ck.skipped = problems
        return ck, stale
    if problems:
        raise CheckpointError(
            f"{run_dir}: no usable checkpoint; every one failed verification:\n  " + "\n  ".join(problems)
            + f"\nRefusing to start over silently. Delete {run_dir} (or the broken checkpoints) to start"
              f" a fresh run.")
    return None, stale
