"""Model directories: the unit every stage hands to the next (`models/<stage>/`).

    models/sft/
      model.safetensors   every weight, incl. a value/reward head (a tied lm_head is stored once, as wte)
      config.json         ModelConfig as a dict + "heads": ["lm", ...]
      tokenizer/          the tokenizer's own files (Tokenizer.save)
      meta.json           format_version, stage, fingerprint, inputs, n_params, and the sha256 of
                          every other file in the directory, the tokenizer's included. No
                          timestamp: the same weights give the same bytes, so DVC skips what
                          depends on an unchanged model

    save_model_dir("models/sft", model, tokenizer, {"stage": "sft", "fingerprint": fp, "inputs": {...}})
    model, tokenizer, meta = load_model_dir("models/sft", device="cpu", heads=None)

Saving is atomic (llm.fileio.atomic_dir: built in a temp sibling, fsynced, renamed): a
failed or killed save leaves the previous directory as it was. (Under `dvc repro` there
may be none to leave: DVC deletes a stage's outputs before it runs the stage; `dvc
checkout` brings back the committed ones.)

Loading reads only safetensors and JSON (never pickle) and trusts none of it: config.json
passes the same type and bound checks as params.yaml (so `n_layer: 1000000` or
`vocab_size: 10**12` is refused before anything is allocated), every file must match
meta.json's sha256 and no unlisted file may be there (sizes are checked before anything is
hashed: a sparse file of 100 GB costs no disk, but hashing reads every byte), and the safetensors header's
names, dtypes, shapes and offsets must match the config before a tensor is read or a real module
built. meta.json's hashes catch corruption and stray edits, not an attacker (who can
recompute them); the bound and shape checks are what keep a hostile directory from
allocating without limit. Errors are `ArtifactError`, naming the file and what is wrong.

Directories of format version 1 (meta.json hashed only model.safetensors and config.json)
still load: their tokenizer is checked through tokenizer_meta.json, which is then
required and pins tokenizer.txt's sha256, so the same edits are caught. Every stage
writes version 2.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from llm.config import ConfigError, ModelConfig, from_dict
from llm.errors import capped
from llm.fileio import atomic_dir, sha256_file, unchanged_since_written
from llm.nn.model import GPT, HEADS

FORMAT_VERSION = 2  # 2: meta.json hashes every file of the directory; 1 hashed model.safetensors and config.json
READS_VERSIONS = (1, 2)
MODEL_FILE, CONFIG_FILE, META_FILE, TOKENIZER_DIR = "model.safetensors", "config.json", "meta.json", "tokenizer"
TOKENIZER_META = f"{TOKENIZER_DIR}/tokenizer_meta.json"
MAX_JSON_BYTES = 16 << 20     # config.json, meta.json: a few KB
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (the format's own limit)
MAX_FILES = 64                # files in a model directory: it holds 5
# no trained weight comes near this (the largest in the committed models is 2.8, a final norm's
# gain); a value far beyond it is an edit or corruption that the hashes did not catch (they were
# recomputed), and in float32 it overflows the forward pass to NaN (a norm gain of 1e21 does)
MAX_WEIGHT = 1e4


class ArtifactError(ValueError):
    """A model directory that cannot be used; the message names the path and the reason."""


class MissingArtifactError(ArtifactError, FileNotFoundError):
    """A model directory, or a file it must contain, does not exist."""


def _stored(model: GPT) -> dict[str, torch.Tensor]:
    """The state dict without the tied lm_head alias (stored once, as wte)."""
    tied = model.lm_head is not None and model.config.tie_embeddings
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The tensors to store: the state dict without the tied lm_head alias, contiguous, on CPU."""
    return {k: v.detach().to("cpu").contiguous() for k, v in _stored(model).items()}


def config_dict(model: GPT) -> dict[str, Any]:
    return {**dataclasses.asdict(model.config), "heads": list(model.head_names)}


def _files(path: Path) -> dict[str, Path]:
    """Every file under `path` except meta.json, by its relative POSIX name. Entries that are
    not regular files (a device, a FIFO, a link to one) are refused: hashing /dev/zero never ends."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = p.relative_to(path).as_posix()
            if rel == META_FILE:
                continue
            if not p.is_file():
                raise ArtifactError(f"{p}: not a regular file (a device, FIFO, directory link or broken link);"
                                    f" a model directory holds only the files its stage wrote")
            out[rel] = p
            if len(out) > MAX_FILES:
                raise ArtifactError(f"{path}: more than {MAX_FILES} files; a model directory holds 5 (wrong directory?)")
    return out


def is_model_dir(path: Path) -> bool:
    """Whether `path` is a model directory as save_model_dir wrote it, unchanged: meta.json lists
    every other file with the sha256 it has now (a version 1 directory, whose meta.json lists two of
    them, is not). What `--force` may replace; file names alone prove nothing."""
    return unchanged_since_written(path, META_FILE, max_manifest_bytes=MAX_JSON_BYTES, files_of=lambda doc: (
        doc.get("files") if isinstance(doc, dict) and doc.get("format_version") in READS_VERSIONS else None))


def save_model_dir(path: str | Path, model: GPT, tokenizer: Any, meta: dict[str, Any]) -> Path:
    """Write a model directory atomically. `meta` carries provenance (stage, fingerprint,
    inputs); format_version, n_params and the sha256 of every other file are added here."""
    from safetensors.torch import save_file

    path = Path(path)
    model = getattr(model, "module", model)      # DDP wrapper
    model = getattr(model, "_orig_mod", model)   # torch.compile wrapper
    with atomic_dir(path) as tmp:
        save_file(model_state(model), str(tmp / MODEL_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config_dict(model), indent=2) + "\n", encoding="utf-8")
        tokenizer.save(tmp / TOKENIZER_DIR)
        full = {
            "format_version": FORMAT_VERSION,
            **meta,
            "n_params": model.n_params(),
            "n_params_non_embedding": model.n_params(non_embedding=True),
            "summary": model.summary(),
            "files": {name: sha256_file(f) for name, f in _files(tmp).items()},
        }
        (tmp / META_FILE).write_text(json.dumps(full, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _not_a_model_dir(path: Path) -> str:
    """What a directory without meta.json and weights is, and the model directories to pass instead."""
    what = ("a tokenizer directory (tokenizer.txt), not a model" if (path / "tokenizer.txt").exists() else
            f"not a model directory (no {META_FILE}, no {MODEL_FILE})")
    beside = sorted(str(d) for d in path.parent.iterdir() if d != path and (d / META_FILE).is_file())
    return (f"{path}: {what}; pass a model directory: "
            + (", ".join(beside) if beside else "one a training stage writes, e.g. models/sft")
            + " (each holds meta.json and model.safetensors)")


def _read_json(f: Path) -> Any:
    if not f.exists():
        raise MissingArtifactError(f"{f}: missing; the model directory is incomplete (re-run the stage that writes it)")
    if not f.is_file():
        raise ArtifactError(f"{f}: not a regular file")
    size = f.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ArtifactError(f"{f}: {size} bytes; this file is a few KB (at most {MAX_JSON_BYTES})")
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, huge ints
        raise ArtifactError(f"{f}: not valid JSON ({str(e)[:200] or type(e).__name__})") from None


def read_config(path: str | Path) -> tuple[ModelConfig, list[str]]:
    """config.json of a model directory -> (ModelConfig, heads), with the same type and bound
    checks as params.yaml (llm.config: n_layer <= MAX_LAYERS, seq_len <= MAX_SEQ_LEN, ...)."""
    f = Path(path) / CONFIG_FILE
    doc = _read_json(f)
    if not isinstance(doc, dict):
        raise ArtifactError(f"{f}: expected a JSON object")
    heads = doc.pop("heads", ["lm"])
    if (not isinstance(heads, list) or not heads or not all(isinstance(h, str) and h in HEADS for h in heads)
            or len(set(heads)) != len(heads)):
        raise ArtifactError(f"{f}: invalid model config: heads: expected a non-empty list of distinct names from {list(HEADS)},"
                            f" got {str(heads)[:100]}")
    known = {fl.name for fl in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ArtifactError(f"{f}: unknown model config keys {unknown[:8]}; written by a newer version of llm/?")
    try:
        cfg = from_dict(ModelConfig, doc, str(f), "config")  # types, bounds and ModelConfig.check
    except ConfigError as e:
        raise ArtifactError(f"{f}: invalid model config: " + "; ".join(capped([p.removeprefix(f"{f}: ")
                                                                           for p in e.problems]))) from None
    if cfg.vocab_size < 1:
        raise ArtifactError(f"{f}: invalid model config: config.vocab_size: a saved model has a vocabulary"
                            f" (>= 1), got {cfg.vocab_size}")
    return cfg, list(heads)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


_TORCH_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                 torch.int64: "I64"}  # int64: the reward model's likelihood-feature marker, a buffer


def read_safetensors_header(f: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, checked against the file:
    a bounded header, known dtypes, every tensor's bytes inside the file, and the file exactly as
    long as the header says (8 + header + the last tensor's end), so that a file padded to any
    size is refused before anything hashes it. Reads the header only."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise ArtifactError(f"{f}: not a readable safetensors file (header length {n}, file {size} bytes)")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ArtifactError(f"{f}: not a readable safetensors file (header: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{f}: not a readable safetensors file (header is not a JSON object)")
    out, end = {}, 0
    data_bytes = size - 8 - n
    for name, e in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(e, dict) and isinstance(e.get("dtype"), str) and e["dtype"] in _DTYPE_BYTES
              and isinstance(e.get("shape"), list)
              and len(e["shape"]) <= 8 and all(type(d) is int and 0 <= d < 2 ** 40 for d in e["shape"])
              and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
              and all(type(o) is int for o in e["data_offsets"]))
        if ok:
            a, b = e["data_offsets"]
            ok = 0 <= a <= b <= data_bytes and b - a == math.prod(e["shape"]) * _DTYPE_BYTES[e["dtype"]]
        if not ok:
            raise ArtifactError(f"{f}: not a readable safetensors file (tensor {name[:80]!r}: bad dtype, shape or"
                                f" offsets for a file of {size} bytes)")
        out[name] = (e["dtype"], tuple(e["shape"]))
        end = max(end, e["data_offsets"][1])
    if end != data_bytes:
        raise ArtifactError(f"{f}: {size} bytes, but its header describes {8 + n + end} (8 + a header of {n} +"
                            f" tensors of {end}); the file was truncated, padded or corrupted (re-run the stage that"
                            f" writes it)")
    return out


def _max_bytes() -> dict[str, int]:
    from llm.data.tokenizer import MAX_FILE_BYTES, MAX_META_BYTES

    return {f"{TOKENIZER_DIR}/tokenizer.txt": MAX_FILE_BYTES, TOKENIZER_META: MAX_META_BYTES}  # config.json:
    # read_config bounds it first; model.safetensors: read_safetensors_header


def _verify_files(path: Path, meta: dict) -> None:
    """Every file of the directory against meta.json's sha256 list (version 2: each file listed,
    each listed file present). Version 1 listed only the model and config; its tokenizer is then
    checked through tokenizer_meta.json, which must be there and pins tokenizer.txt's sha256."""
    files = meta.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ArtifactError(f"{path / META_FILE}: 'files' must map each file name to its sha256 (re-run the stage"
                            f" that writes {path})")
    present = _files(path)
    for name, f in present.items():  # before hashing: a sparse file of 100 GB would be read in full
        limit = _max_bytes().get(name)
        if limit is not None and (size := f.stat().st_size) > limit:
            raise ArtifactError(f"{f}: {size} bytes, more than such a file holds (at most {limit}); the file was"
                                f" padded or replaced (re-run the stage that writes {path})")
    if meta["format_version"] >= 2:
        unlisted, gone = sorted(set(present) - set(files)), sorted(set(files) - set(present))
        if gone:
            raise MissingArtifactError(f"{path / gone[0]}: missing; the model directory is incomplete (re-run the"
                                       f" stage that writes it)")
        if unlisted:
            raise ArtifactError(f"{path / unlisted[0]}: not listed in {META_FILE}; a file was added or renamed after"
                                f" saving (remove it, or re-run the stage that writes {path})")
    else:
        required = [MODEL_FILE, CONFIG_FILE]
        if (path / TOKENIZER_DIR).is_dir():
            required.append(TOKENIZER_META)  # the v1 check of the tokenizer, see above
        for name in required:
            if name not in present:
                raise MissingArtifactError(f"{path / name}: missing; the model directory is incomplete (re-run the"
                                           f" stage that writes it)")
            if name != TOKENIZER_META and name not in files:
                raise ArtifactError(f"{path / META_FILE}: does not list {name}; re-run the stage that writes {path}")
    for name, digest in files.items():
        if name in present and sha256_file(present[name]) != digest:
            raise ArtifactError(f"{path / name}: sha256 does not match {META_FILE}; the file is corrupt or was"
                                f" edited after saving (re-run the stage that writes it)")


def load_model_dir(path: str | Path, device: str | torch.device = "cpu",
                   heads: tuple[str, ...] | list[str] | None = None) -> tuple[GPT, Any, dict[str, Any]]:
    """Load (model, tokenizer, meta) from a model directory written by save_model_dir.

    heads=None loads every saved head; otherwise only the named ones, each of which must be
    saved there (attach a new head with model.add_head(name)).

    Checks, in order, before any tensor is read or any real module built: meta.json, the
    config's types and bounds, the safetensors header (and the file's size against it), every
    file's size bound and then its sha256, the header's names, shapes and dtypes against those the
    config implies; then the tensors are read and checked finite and within MAX_WEIGHT, and the
    tokenizer is loaded and checked against the config's vocabulary. One function on purpose: the
    checks' order is the guarantee (nothing costly before the cheap checks pass), read top to bottom.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from llm.data.tokenizer import Tokenizer

    path = Path(path)
    if not path.is_dir():
        raise MissingArtifactError(f"{path}: no model directory here; run the stage that writes it first"
                                   f" (e.g. `dvc repro`)")
    if not (path / META_FILE).exists() and not (path / MODEL_FILE).exists():
        raise MissingArtifactError(_not_a_model_dir(path))
    meta = _read_json(path / META_FILE)
    if not isinstance(meta, dict) or meta.get("format_version") not in READS_VERSIONS:
        got = meta.get("format_version") if isinstance(meta, dict) else meta
        raise ArtifactError(f"{path / META_FILE}: format_version {str(got)[:40]}, this code reads"
                            f" {' and '.join(map(str, READS_VERSIONS))}; re-run the stage that writes {path}")
    cfg, saved_heads = read_config(path)
    want = tuple(saved_heads) if heads is None else tuple(heads)
    if "reward" in want and "reward_logprob" in saved_heads and "reward_logprob" not in want:
        # that reward is the head plus the likelihood feature: loading the head alone would change it
        want = (*want, *(h for h in ("lm", "reward_logprob") if h not in want))
    missing_heads = [h for h in want if h not in saved_heads]
    if missing_heads:
        raise ArtifactError(f"{path}: heads {missing_heads} are not saved there (it has {saved_heads});"
                            f" load it without them and call model.add_head(name)")
    f = path / MODEL_FILE
    if not f.is_file():
        raise MissingArtifactError(f"{f}: missing; the model directory is incomplete (re-run the stage that writes it)")
    header = read_safetensors_header(f)  # its size too, before the hashes read every byte
    _verify_files(path, meta)

    # The shapes the config implies, from a model on the meta device: no memory, and the config
    # is bounded already, so building it is quick. Compared with the header before reading tensors.
    try:
        like = _stored(GPT(cfg, heads=saved_heads, device="meta"))
    except ValueError as e:  # GPT's own checks (e.g. the heads a reward feature needs)
        raise ArtifactError(f"{path / CONFIG_FILE}: {e}") from None
    expected = {k: tuple(v.shape) for k, v in like.items()}
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected))
    if missing or unexpected:
        raise ArtifactError(f"{f}: does not match {CONFIG_FILE}: missing tensors {missing[:8]},"
                            f" unexpected tensors {unexpected[:8]}")
    bad_shapes = [f"{k}: file {header[k][1]} vs config {v}" for k, v in expected.items() if header[k][1] != v]
    if bad_shapes:
        raise ArtifactError(f"{f}: tensor shapes do not match {CONFIG_FILE}: " + "; ".join(bad_shapes[:8]))
    # an integer tensor passes the finite and magnitude checks below and load_state_dict casts it
    bad_dtypes = [f"{k} is {header[k][0]}, not {_TORCH_DTYPES.get(v.dtype, v.dtype)}" for k, v in like.items()
                  if header[k][0] != _TORCH_DTYPES.get(v.dtype)]
    if bad_dtypes:
        raise ArtifactError(f"{f}: tensor dtypes do not match the model's: " + "; ".join(bad_dtypes[:8])
                            + " (the file was edited or corrupted; re-run the stage that writes it)")
    try:
        tensors = load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{f}: not a readable safetensors file ({e})") from None
    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ArtifactError(f"{f}: tensor {k!r} holds non-finite values (NaN/Inf)")
        if t.is_floating_point() and t.numel() and (big := float(t.abs().max())) > MAX_WEIGHT:
            raise ArtifactError(f"{f}: tensor {k!r} holds a weight of magnitude {big:.3g}, beyond any trained"
                                f" weight (limit {MAX_WEIGHT:g}): the file was edited or corrupted; re-run the"
                                f" stage that writes it")

    model = GPT(cfg, heads=want)
    model.load_state_dict({k: tensors[k] for k in _stored(model)}, strict=False)
    try:
        tokenizer = Tokenizer.load(path / TOKENIZER_DIR)
    except FileNotFoundError as e:
        raise MissingArtifactError(f"{path / TOKENIZER_DIR}: {e}") from None
    except ValueError as e:
        raise ArtifactError(f"{path / TOKENIZER_DIR}: {e}") from None
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ArtifactError(f"{path}: tokenizer vocab_size {tokenizer.vocab_size} != model vocab_size"
                            f" {cfg.vocab_size}")
    return model.to(device), tokenizer, meta
