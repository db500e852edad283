"""Shared test setup: offline hub settings, the repo root, small helpers and shared fixtures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Hub look-ups wait 25-80 s before failing when there is no network; tests never need them.
for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DVC_NO_ANALYTICS"):
    os.environ.setdefault(_k, "1")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def load_script(path: Path, name: str | None = None):
    """Import a script that is not in a package (bench/*.py, env/check_env.py) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dvc_command(stage: str, item: str | None = None) -> list[str]:
    """A stage's command as dvc.yaml writes it (paths relative to the project root), with this
    interpreter as `python`; `item` fills a foreach stage's ${item}. Tests that run a stage in a
    scratch layout run exactly what `dvc repro` runs."""
    import shlex
    import sys

    import yaml

    st = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    cmd = (st["do"] if "foreach" in st else st)["cmd"]
    if item is not None:
        cmd = cmd.replace("${item}", item)
    argv = shlex.split(cmd)
    assert argv[0] == "python", f"dvc.yaml stage {stage}: expected `python -m ...`, got {cmd!r}"
    return [sys.executable, *argv[1:]]


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a whole module: tiny models run fastest that way (and the CI box has
    two shared cores). A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch  # here, not at the top: most test modules never touch torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
