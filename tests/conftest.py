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
