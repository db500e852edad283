"""bench/gpu_77m.py: its CPU plumbing mode runs end to end, and it refuses to run without CUDA."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "bench" / "gpu_77m.py"
PLUMBING = ["--device", "cpu", "--preset", "tiny", "--steps", "6", "--warmup", "2", "--batch-size", "2",
            "--seq-len", "64", "--vocab", "512", "--resume-steps", "2"]


def _run(args: list[str], **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_cpu_plumbing_prints_table_and_json_and_resume_is_exact():
    p = _run(PLUMBING)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    for key in ("n_params", "tokens_per_s", "mfu", "flops_per_token", "mem_estimate_gib", "resume_max_abs_diff",
                "resume_pass", "setup_s", "main_s", "total_s"):
        assert key in out, key
    assert out["bench"] == "gpu_77m" and out["device"] == "cpu" and out["preset"] == "tiny"
    assert out["tokens_per_s"] > 0 and out["mfu"] is None  # CPU: no known peak, no made-up MFU
    # the trainer promises bitwise resume on CPU: steps 3..4 of SIGTERM-at-2 + resume == uninterrupted
    assert out["resume_exit_code"] == 143 and out["resume_resumed_from"] == 2
    assert out["resume_bitwise_equal"] and out["resume_max_abs_diff"] == 0.0 and out["resume_pass"]
    table = "\n".join(lines[:-1])
    for row in ("parameters", "tokens/s", "MFU vs datasheet bf16 peak", "peak memory allocated", "resume 2 + 2 vs 4",
                "elapsed"):
        assert row in table, row


def test_refuses_without_cuda():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on GPU machines too
    p = _run([], CUDA_VISIBLE_DEVICES="")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "needs a CUDA GPU" in p.stderr and "--device cpu" in p.stderr
    assert p.stdout == ""
