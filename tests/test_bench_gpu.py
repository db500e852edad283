"""bench/gpu_check.py: its CPU plumbing mode runs every part and prints one table and one JSON line; without
CUDA it refuses."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.py"


def _run(args: list[str], **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_cpu_plumbing_runs_every_part_and_prints_one_table_and_json():
    p = _run(["--cpu-plumbing"])
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["bench"] == "gpu_check" and out["plumbing"] and out["device"].startswith("cpu")
    rows = out["rows"]
    assert [r["part"] for r in rows] == ["dag"] * 3 + ["pretrain", "rl", "rl"] + ["stages"] * 4 + ["resume"]
    assert all(r["ok"] for r in rows), rows
    assert [r["what"] for r in rows[:3]] == ["smoke prepare", "smoke tokenizer", "smoke tokenize"]
    assert rows[3]["tokens_per_s"] > 0 and rows[3]["mfu"] is None  # no known CPU peak: no made-up MFU
    assert rows[3]["estimate_gib"] > 0 and rows[5]["what"] == "grpo step custom"
    assert rows[-1]["resume_bitwise"]  # the CPU plumbing mode requires a bitwise-equal resume
    assert lines[0].split()[:4] == ["part", "what", "result", "seconds"]
    assert sum(ln.startswith(("dag ", "pretrain ", "rl ", "stages ", "resume ")) for ln in lines) == len(rows)


@pytest.mark.slow
def test_the_stages_part_trains_sft_the_reward_model_dpo_and_fp16_pretraining():
    p = _run(["--cpu-plumbing", "--parts", "stages"])
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    rows = json.loads(lines[-1])["rows"]
    assert [r["what"] for r in rows] == ["sft custom", "reward custom", "dpo custom", "pretrain fp16 custom"]
    assert all(r["ok"] and r["estimate_gib"] > 0 for r in rows), rows
    assert [len(r["losses"]) for r in rows] == [3, 3, 3, 10]
    # the policy starts as its reference, whose log-probs ride in the batches: DPO's first loss is log 2
    assert rows[2]["losses"][0] == pytest.approx(math.log(2), abs=1e-5)
    # the loop's GradScaler ran: its scale halved once per overflowed step (no growth within 2000 steps)
    fp16 = rows[3]
    assert fp16["loss_scale"] == 65536.0 / 2 ** fp16["amp_overflows"] and fp16["nonfinite_skips"] == 0
    assert [ln.split()[:3] for ln in lines if ln.startswith("stages ")] == [
        ["stages", "sft", "custom"], ["stages", "reward", "custom"], ["stages", "dpo", "custom"],
        ["stages", "pretrain", "fp16"]]


def test_refuses_without_cuda():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on GPU machines too
    p = _run([], CUDA_VISIBLE_DEVICES="")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "needs a CUDA GPU" in p.stderr and "--cpu-plumbing" in p.stderr
    assert p.stdout == ""


def test_unknown_part_is_refused():
    p = _run(["--cpu-plumbing", "--parts", "dag,warp"])
    assert p.returncode == 2 and "--parts: unknown ['warp']" in p.stderr


@pytest.mark.slow
def test_the_dag_part_runs_from_a_saved_plan(tmp_path):
    # a GPU machine with no DVC takes the DAG's stages from a plan saved where DVC is
    plan = tmp_path / "plan.txt"
    p = _run(["--cpu-plumbing", "--save-dag-plan", str(plan)])
    assert p.returncode == 0 and "Running stage 'tokenize':" in plan.read_text(), p.stdout + p.stderr
    p = _run(["--cpu-plumbing", "--parts", "dag", "--dag-plan", str(plan)])
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])["rows"]
    assert [r["what"] for r in rows] == ["smoke prepare", "smoke tokenizer", "smoke tokenize"]
    assert f"(from the plan {plan})" in p.stderr
