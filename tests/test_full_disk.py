"""A full disk while a stage or export writes: the run ends with one line that names the path
being written and says to free space, the outputs an earlier run wrote are as they were, and
no temp file is left.

The disk fills at `os.fsync`, which every atomic write calls before its rename (a file system
with delayed allocation, or NFS, reports ENOSPC there rather than at write()); the project is
a tiny run of prepare -> tokenizer -> tokenize -> pretrain -> sft -> export in a temp dir."""
from __future__ import annotations

import errno
import importlib
import os
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, common_params, dvc_command
from tests.test_fileio import temps_under, tree_digest

pytestmark = pytest.mark.usefixtures("one_thread")


def _stage(ws: Path, stage: str) -> int:
    """The stage's dvc.yaml command, run in this process with every path under `ws`."""
    argv = dvc_command(stage)[3:]  # after `python -m stages.<stage>`
    argv = [a if a.startswith("--") else str(ws / a) for a in argv]
    module = importlib.import_module(f"stages.{stage}")
    return module.main([*argv, "--params", str(ws / "params.yaml"), "--no-progress"])


def _export(ws: Path) -> int:
    from llm.tools.export import main

    return main([str(ws / "models/sft"), str(ws / "exported/sft"), "--force"])


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("project")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["common"] = common_params()
    params["prepare"].update(math_train=300, math_val=40, math_test=60, math_pretrain_docs=50, task_train=100,
                             task_val=20, pref_train=80, pref_val=20)
    params["tokenizer"].update(vocab_size=300)
    small = dict(max_steps=2, batch_size=4, grad_accum=1, warmup_steps=1, eval_every=2, eval_batches=1, log_every=1,
                 checkpoint_every=2)
    params["pretrain"].update(small)
    params["pretrain"]["model"].update(preset="custom", seq_len=128, n_layer=1, n_embd=16, n_head=2, n_kv_head=2)
    params["sft"].update(small, min_source_examples=0, eval_math_problems=2, max_new_tokens=4, bucket_width=8)
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for stage in ("prepare", "tokenizer", "tokenize", "pretrain"):
        assert _stage(ws, stage) == 0, stage
    shutil.copytree(ws / "data/prepared/sft", ws / "data/clean_sft")  # what clean_sft keeps, near enough here
    assert _stage(ws, "sft") == 0
    assert _export(ws) == 0
    return ws


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("stage, outputs", [
    ("prepare", ["data/prepared", "metrics/prepare.json"]),
    ("tokenize", ["data/tokens", "metrics/tokenize.json"]),
    ("pretrain", ["models/base", "metrics/pretrain.json", "runs/pretrain/ckpt-00000002"]),
    ("sft", ["models/sft", "metrics/sft.json", "runs/sft/ckpt-00000002"]),
    ("export", ["exported/sft"]),
])
def test_a_full_disk_is_one_line_naming_the_path_and_keeps_what_was_there(project, monkeypatch, capsys, stage,
                                                                          outputs):
    before = [tree_digest(project / o) if (project / o).is_dir() else (project / o).read_bytes() for o in outputs]
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _enospc)
        code = _export(project) if stage == "export" else _stage(project, stage)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"{stage}: {project}/") and ": no space left on the device while writing" in err
    assert "free space on that disk" in err
    after = [tree_digest(project / o) if (project / o).is_dir() else (project / o).read_bytes() for o in outputs]
    assert after == before and temps_under(project) == []
