"""Shared test setup: offline hub settings, the repo root, and small helpers."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Hub look-ups wait 25-80 s before failing when there is no network; tests never need them.
for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DVC_NO_ANALYTICS"):
    os.environ.setdefault(_k, "1")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
