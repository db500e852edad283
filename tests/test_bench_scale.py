"""bench/scale.py: one step of each task runs and reports a rate (the 2-process path is
tests/test_scale.py's; the figures themselves are in docs/scale.md)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, load_script


@pytest.mark.slow
@pytest.mark.parametrize("task", ["pretrain", "grpo"])
def test_one_step_of_each_task_reports_tokens_per_second(tmp_path, task):
    import torch
    bench = load_script(ROOT / "bench/scale.py", "bench_scale")
    out = tmp_path / "rates.json"
    threads = torch.get_num_threads()
    try:
        bench.child({"task": task, "threads": 1, "steps": 1, "out": str(out)})
    finally:
        torch.set_num_threads(threads)
    got = json.loads(out.read_text())
    assert len(got["rates"]) == 1 and got["rates"][0] > 0 and got["tokens"] > 0
    assert json.loads((tmp_path / "rates.json.cpu0").read_text()) > 0
