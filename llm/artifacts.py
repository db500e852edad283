"""Model directories: the unit every stage hands to the next (`models/<stage>/`).

    models/sft/
      model.safetensors   every weight, incl. a value/reward head (a tied lm_head is stored once, as wte)
      config.json         ModelConfig as a dict + "heads": ["lm", ...]
      tokenizer/          the tokenizer's own files (Tokenizer.save)
      meta.json           format_version, stage, fingerprint, inputs, n_params, and the sha256
                          of model.safetensors and config.json. No timestamp: the same weights
                          give the same bytes, so DVC skips what depends on an unchanged model

    save_model_dir("models/sft", model, tokenizer, {"stage": "sft", "fingerprint": fp, "inputs": {...}})
    model, tokenizer, meta = load_model_dir("models/sft", device="cpu", heads=None)

Saving is atomic (llm.fileio.atomic_dir: built in a temp sibling, fsynced, renamed), so a
killed stage leaves the previous directory intact. Loading reads only safetensors and JSON
(never pickle), checks the hashes and that every tensor is finite, and raises
`ArtifactError` naming the file and what is wrong with it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from llm.config import ModelConfig
from llm.fileio import atomic_dir, sha256_file
from llm.model import GPT

FORMAT_VERSION = 1
MODEL_FILE, CONFIG_FILE, META_FILE, TOKENIZER_DIR = "model.safetensors", "config.json", "meta.json", "tokenizer"


class ArtifactError(ValueError):
    """A model directory that cannot be used; the message names the path and the reason."""


class MissingArtifactError(ArtifactError, FileNotFoundError):
    """A model directory, or a file it must contain, does not exist."""


def model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The tensors to store: the state dict without the tied lm_head alias, contiguous, on CPU."""
    tied = model.lm_head is not None and model.config.tie_embeddings
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")}


def config_dict(model: GPT) -> dict[str, Any]:
    return {**dataclasses.asdict(model.config), "heads": list(model.head_names)}


def save_model_dir(path: str | Path, model: GPT, tokenizer: Any, meta: dict[str, Any]) -> Path:
    """Write a model directory atomically. `meta` carries provenance (stage, fingerprint,
    inputs); format_version, n_params and file hashes are added here."""
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
            "files": {name: sha256_file(tmp / name) for name in (MODEL_FILE, CONFIG_FILE)},
        }
        (tmp / META_FILE).write_text(json.dumps(full, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _read_json(f: Path) -> Any:
    if not f.is_file():
        raise MissingArtifactError(f"{f}: missing; the model directory is incomplete (re-run the stage that writes it)")
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{f}: not valid JSON ({e})") from None


def read_config(path: str | Path) -> tuple[ModelConfig, list[str]]:
    """config.json of a model directory -> (ModelConfig, heads)."""
    f = Path(path) / CONFIG_FILE
    doc = _read_json(f)
    if not isinstance(doc, dict):
        raise ArtifactError(f"{f}: expected a JSON object")
    heads = doc.pop("heads", ["lm"])
    known = {fl.name for fl in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ArtifactError(f"{f}: unknown model config keys {unknown}; written by a newer version of llm/?")
    try:
        cfg = ModelConfig(**doc)
    except TypeError as e:
        raise ArtifactError(f"{f}: {e}") from None
    problems = cfg.check("config")
    if problems:
        raise ArtifactError(f"{f}: invalid model config: " + "; ".join(problems))
    return cfg, list(heads)


def load_model_dir(path: str | Path, device: str | torch.device = "cpu",
                   heads: tuple[str, ...] | list[str] | None = None) -> tuple[GPT, Any, dict[str, Any]]:
    """Load (model, tokenizer, meta) from a model directory written by save_model_dir.

    heads=None loads every saved head; otherwise only the named ones, each of which must be
    saved there (attach a new head with model.add_head(name)).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from llm.tokenizer import Tokenizer

    path = Path(path)
    if not path.is_dir():
        raise MissingArtifactError(f"{path}: no model directory here; run the stage that writes it first"
                                   f" (e.g. `dvc repro`)")
    meta = _read_json(path / META_FILE)
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else meta
        raise ArtifactError(f"{path / META_FILE}: format_version {got!r}, this code reads {FORMAT_VERSION}")
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
    for name, digest in (meta.get("files") or {}).items():
        if (path / name).is_file() and sha256_file(path / name) != digest:
            raise ArtifactError(f"{path / name}: sha256 does not match {META_FILE}; the file is corrupt or was"
                                f" edited after saving (re-run the stage that writes it)")
    try:
        tensors = load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{f}: not a readable safetensors file ({e})") from None
    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ArtifactError(f"{f}: tensor {k!r} holds non-finite values (NaN/Inf)")

    model = GPT(cfg, heads=want)
    expected = model_state(model)
    dropped = {f"{h}_head.{p}" for h in saved_heads if h not in want
               for p in ("weight", "bias", "marker")}  # not loaded
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - dropped)
    if missing or unexpected:
        raise ArtifactError(f"{f}: does not match {CONFIG_FILE}: missing tensors {missing[:8]},"
                            f" unexpected tensors {unexpected[:8]}")
    bad_shapes = [f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
                  for k, v in expected.items() if tuple(tensors[k].shape) != tuple(v.shape)]
    if bad_shapes:
        raise ArtifactError(f"{f}: tensor shapes do not match {CONFIG_FILE}: " + "; ".join(bad_shapes[:8]))
    model.load_state_dict({k: tensors[k] for k in expected}, strict=False)
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
