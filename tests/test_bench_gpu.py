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
    assert [r["part"] for r in rows] == (["speedrun"] * 5 + ["dag"] * 3 + ["pretrain", "rl", "rl"] + ["stages"] * 4
                                         + ["resume"])
    assert all(r["ok"] for r in rows), rows
    rows = rows[5:]  # the speedrun's: test_the_speedrun_part_runs_a_profile_at_its_own_step_counts
    assert [r["what"] for r in rows[:3]] == ["smoke prepare", "smoke tokenizer", "smoke tokenize"]
    assert rows[3]["tokens_per_s"] > 0 and rows[3]["mfu"] is None  # no known CPU peak: no made-up MFU
    assert rows[3]["estimate_gib"] > 0 and rows[5]["what"] == "grpo step custom"
    assert rows[-1]["resume_bitwise"]  # the CPU plumbing mode requires a bitwise-equal resume
    assert lines[0].split()[:4] == ["part", "what", "result", "seconds"]
    parts = ("speedrun ", "dag ", "pretrain ", "rl ", "stages ", "resume ")
    assert sum(ln.startswith(parts) for ln in lines) == len(rows) + 5


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


@pytest.mark.slow
def test_the_speedrun_part_runs_a_profile_at_its_own_step_counts():
    """--cpu-plumbing: the smoke profile's first stages, nothing cut (its 30 pretraining steps), with
    pretraining's throughput by both FLOP counts read from the stage's own metrics."""
    p = _run(["--cpu-plumbing", "--parts", "speedrun"])
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])["rows"]
    assert [r["what"] for r in rows] == ["smoke prepare", "smoke tokenizer", "smoke tokenize", "smoke pretrain",
                                         "smoke whole DAG"]
    pre = rows[3]
    assert pre["tokens_per_s"] > 0 and pre["mfu"] is None and pre["mfu_nanochat"] is None
    assert pre["tflops"] > pre["tflops_nanochat"] > 0  # the tied LM head counts only in this project's count
    assert "at its own step counts" in p.stderr and "every stage cut" not in p.stderr


def test_the_speedrun_reads_throughput_and_the_eval_table_from_the_stages_metrics(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check
    from llm.tools.profile import render
    from llm.train.metrics import write_metrics
    params = render("gpu-speedrun", ROOT / "env" / "profiles")[0]
    ours, nano = gpu_check.flop_counts(params)
    # 77m shape at vocab 4096: the tied head's 6 x 4096 x 512 is the whole difference
    assert ours - nano == 6 * 4096 * 512
    write_metrics(tmp_path / "metrics" / "pretrain.json", {"tokens_seen": 2_000_000, "train_time_s": 4.0, "steps": 3})
    row = gpu_check.stage_throughput(tmp_path, "pretrain", (ours, nano), peak=1e15)
    assert row["tokens_per_s"] == 500_000
    assert row["tflops"] == pytest.approx(ours * 5e5 / 1e12) and row["mfu"] == pytest.approx(ours * 5e5 / 1e15)
    assert row["mfu_nanochat"] == pytest.approx(nano * 5e5 / 1e15)
    (tmp_path / "metrics" / "eval").mkdir()
    (tmp_path / "metrics" / "eval" / "sft.json").write_text(json.dumps({
        "math_exact_match": 0.84, "math_sample_accuracy": 0.61, "task_exact_match": 0.9, "arithmetic_exact_match": 0.5}))
    (tmp_path / "metrics" / "eval" / "base.json").write_text("{}")  # a model this run did not evaluate
    (row,) = gpu_check.eval_rows(tmp_path, ["sft"])
    assert row["what"] == "eval sft" and row["math_exact_match"] == 0.84 and row["math_pass_at_k"] is None
    assert row["note"] == "math greedy 0.840, math sampled 0.610, pass@k -, tasks 0.900, arithmetic 0.500"
