"""No code execution on load.

1. A static scan of every Python file in llm/ and stages/ (AST, not grep, so `model.eval()`
   is not mistaken for `eval(...)`) finds no pickle-family import, no eval/exec, no unsafe
   YAML load, no torch.load without weights_only=True, no np.load(allow_pickle=True).
2. A booby-trapped pickle (its __reduce__ creates a marker file) handed to each of our
   loaders is refused, and the marker never appears. A control proves the trap is live.
"""
from __future__ import annotations

import ast
import io
import json
import pickle
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCANNED = sorted(p for d in ("llm", "stages") for p in (ROOT / d).rglob("*.py"))
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib", "jsonpickle"}


def _const_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def scan_source(source: str, where: str) -> list[str]:
    """Every unsafe construct in one file, as 'path:line: what'."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in BANNED_MODULES:
                    problems.append(f"{at}: import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in BANNED_MODULES:
                problems.append(f"{at}: from {node.module} import ...")
            # bare names would hide the call from the checks below
            hidden = {"yaml": {"load", "unsafe_load", "full_load", "load_all"}, "torch": {"load"}}
            for a in node.names:
                if a.name in hidden.get(node.module or "", ()):
                    problems.append(f"{at}: from {node.module} import {a.name} (call {node.module}.{a.name} instead)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            short = name.rsplit(".", 1)[-1]
            if name in ("eval", "exec", "builtins.eval", "builtins.exec", "__import__"):
                problems.append(f"{at}: {name}(...)")
            elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all"):
                problems.append(f"{at}: {name}(...)")
            elif name == "yaml.load":
                loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                if not (loader is not None and _dotted(loader).rsplit(".", 1)[-1] in ("SafeLoader", "CSafeLoader")):
                    problems.append(f"{at}: yaml.load without Loader=SafeLoader")
            elif name == "torch.load" or (short == "load" and name.startswith("torch.")):
                if not _const_true(_kw(node, "weights_only")):
                    problems.append(f"{at}: {name} without weights_only=True")
            elif short == "load" and name.split(".")[0] in ("np", "numpy") and _const_true(_kw(node, "allow_pickle")):
                problems.append(f"{at}: {name}(allow_pickle=True)")
            elif name in ("pd.read_pickle", "pandas.read_pickle"):
                problems.append(f"{at}: {name}")
    return problems


def test_static_scan_finds_nothing_unsafe():
    assert len(SCANNED) > 5, "the scan found too few files; is ROOT right?"
    problems = [p for f in SCANNED for p in scan_source(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))]
    assert problems == [], "unsafe constructs:\n" + "\n".join(problems)


def test_static_scan_catches_each_pattern():
    bad = """
import pickle
from dill import loads
import yaml, torch, numpy as np
eval("1")
exec("x = 1")
yaml.load(s)
yaml.load(s, Loader=yaml.Loader)
yaml.unsafe_load(s)
torch.load("f")
torch.load("f", weights_only=False)
np.load("f", allow_pickle=True)
from torch import load
"""
    found = scan_source(bad, "bad.py")
    assert len(found) == 11, found
    ok = """
import yaml, torch
model.eval()
yaml.safe_load(s)
yaml.load(s, Loader=yaml.SafeLoader)
torch.load("f", weights_only=True, map_location="cpu")
"""
    assert scan_source(ok, "ok.py") == []


# ---------------------------------------------------------------------------
# Booby-trapped pickles

class _Trap:
    """Unpickling this creates the marker file (open(path, "w")); it must never happen."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def trap(tmp_path):
    marker = tmp_path / "PWNED"
    raw = pickle.dumps(_Trap(marker))
    buf = io.BytesIO()
    torch.save({"x": _Trap(marker)}, buf)  # a torch zip file whose data.pkl holds the trap
    yield marker, {"raw-pickle": raw, "torch-save": buf.getvalue()}
    assert not marker.exists(), "a loader executed pickled code"


def test_the_trap_is_live(tmp_path):
    marker = tmp_path / "PWNED"
    pickle.loads(pickle.dumps(_Trap(marker)))  # the control: unpickling does run it
    assert marker.exists()


def _fix_manifest(ckpt: Path) -> None:
    """Re-hash a tampered checkpoint so only the file format, not the hash, can stop the load."""
    from llm.fileio import sha256_file
    from llm.train.checkpoint import MANIFEST
    man = json.loads((ckpt / MANIFEST).read_text())
    for name in man["files"]:
        man["files"][name] = {"sha256": sha256_file(ckpt / name), "bytes": (ckpt / name).stat().st_size}
    (ckpt / MANIFEST).write_text(json.dumps(man))


@pytest.mark.parametrize("target", ["model.safetensors", "train_state.safetensors"])
def test_checkpoint_loader_refuses_pickles(tmp_path, trap, target):
    from llm.train.checkpoint import CheckpointError, find_resume, load_checkpoint, save_checkpoint
    _, payloads = trap
    for kind, data in payloads.items():
        run = tmp_path / kind
        p = save_checkpoint(run, 1, model_state={"w": torch.ones(2)}, train_state={"a": torch.zeros(1)},
                            fingerprint="fp", keep=2)
        (p / target).write_bytes(data)
        _fix_manifest(p)
        with pytest.raises(CheckpointError, match="not a readable safetensors file"):
            load_checkpoint(p)
        with pytest.raises(CheckpointError):
            find_resume(run, "fp", warn=lambda m: None)


def test_checkpoint_state_json_cannot_smuggle_objects(tmp_path, trap):
    """state.json is plain JSON: a pickle in it is just a parse error."""
    from llm.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    _, payloads = trap
    p = save_checkpoint(tmp_path, 1, model_state={"w": torch.ones(2)}, train_state={}, fingerprint="fp", keep=2)
    (p / "state.json").write_bytes(payloads["raw-pickle"])
    _fix_manifest(p)
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(p)


def test_model_dir_loader_refuses_pickles(tmp_path, trap):
    from llm.config import ModelConfig
    from llm.data.tokenizer import Tokenizer
    from llm.fileio import sha256_file
    from llm.nn.artifacts import ArtifactError, load_model_dir, save_model_dir
    from llm.nn.model import GPT
    _, payloads = trap
    tok = Tokenizer.train(["abc abc abd abd abe " * 20], vocab_size=270, max_pairs=1000, min_frequency=2)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, seq_len=8, n_layer=1, n_head=2, n_kv_head=2, n_embd=8))
    for kind, data in payloads.items():
        d = save_model_dir(tmp_path / kind, model, tok, {"stage": "test"})
        (d / "model.safetensors").write_bytes(data)
        meta = json.loads((d / "meta.json").read_text())
        meta["files"]["model.safetensors"] = sha256_file(d / "model.safetensors")  # a hash that matches
        (d / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(ArtifactError, match="safetensors"):
            load_model_dir(d)


def test_tokenizer_loader_refuses_pickles(tmp_path, trap):
    from llm.data.tokenizer import Tokenizer
    _, payloads = trap
    tok = Tokenizer.train(["abc abc abd abd abe " * 20], vocab_size=270, max_pairs=1000, min_frequency=2)
    for kind, data in payloads.items():
        d = tmp_path / kind
        tok.save(d)
        for f in d.iterdir():
            f.write_bytes(data)
        with pytest.raises(Exception):
            Tokenizer.load(d)


def test_params_loader_refuses_python_yaml_tags(tmp_path, trap):
    from llm.config import ConfigError, load_params
    marker, _ = trap
    p = tmp_path / "params.yaml"
    p.write_text(f"common: !!python/object/apply:builtins.open [{str(marker)!r}, 'w']\n")
    with pytest.raises(ConfigError):
        load_params(p)


def test_jsonl_reader_treats_pickles_as_bad_records(tmp_path, trap):
    from llm.fileio import DataError, read_jsonl
    _, payloads = trap
    p = tmp_path / "x.jsonl"
    p.write_bytes(payloads["raw-pickle"])
    with pytest.raises(DataError):
        list(read_jsonl(p))
