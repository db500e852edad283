"""python -m llm.repro: `dvc repro` with independent stages side by side (llm/tools/repro.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from llm.tools import repro

DIAMOND = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}


def test_the_stage_with_the_most_work_behind_it_goes_first():
    rank = repro.priorities(DIAMOND, {"b": 10.0, "c": 100.0})  # a and d: 60 s, none recorded
    assert rank == {"d": 60.0, "b": 70.0, "c": 160.0, "a": 220.0}


def test_targets_bring_what_they_depend_on_and_an_unknown_one_is_named():
    assert repro.upstream(DIAMOND, ["b"]) == {"a": [], "b": ["a"]}
    with pytest.raises(SystemExit, match="no stage nope in dvc.yaml"):
        repro.upstream(DIAMOND, ["nope"])


def test_a_gpu_profile_runs_one_stage_at_a_time(tmp_path):
    (tmp_path / "params.yaml").write_text("common: {device: cuda}\n")
    assert repro.default_jobs(tmp_path / "params.yaml") == 1
    (tmp_path / "params.yaml").write_text("common: {device: cpu}\n")
    assert repro.default_jobs(tmp_path / "params.yaml") == len(os.sched_getaffinity(0))


# each stage writes when its command started and ended (and sleeps between), so the test reads the
# order the stages ran in from the stages themselves, not from timings of this machine
STAGE = ("python -c \"import sys, time; t = time.time(); time.sleep({sleep}); "
         "open('{name}.txt', 'w').write(f'{{t}} {{time.time()}}')\"")


def _project(tmp_path, stages: dict[str, tuple[list[str], str]]):
    """A git + DVC repository in tmp_path with `stages`: {name: (deps, cmd)}."""
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True, env=env)
    lines = ["stages:"]
    for name, (deps, cmd) in stages.items():
        lines += [f"  {name}:", f"    cmd: {cmd}", f"    outs: [{name}.txt]"]
        if deps:
            lines.append(f"    deps: [{', '.join(d + '.txt' for d in deps)}]")
    (tmp_path / "dvc.yaml").write_text("\n".join(lines) + "\n")
    return env


def _repro(tmp_path, env, *args):
    return subprocess.run([sys.executable, "-m", "llm.repro", *args], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(ROOT)}, timeout=300)


def _span(tmp_path, name) -> tuple[float, float]:
    start, end = (tmp_path / f"{name}.txt").read_text().split()
    return float(start), float(end)


@pytest.mark.slow
def test_independent_stages_run_side_by_side_and_dvc_records_every_one(tmp_path):
    env = _project(tmp_path, {n: (deps, STAGE.format(name=n, sleep=4 if n in "bc" else 0))
                              for n, deps in DIAMOND.items()})
    r = _repro(tmp_path, env, "-j", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    (a0, a1), (b0, b1), (c0, c1), (d0, d1) = (_span(tmp_path, n) for n in "abcd")
    assert a1 <= min(b0, c0) and max(b1, c1) <= d0      # the graph's order
    assert b0 < c1 and c0 < b1                           # b and c overlapped
    assert "4 stage(s) ran" in r.stdout
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=tmp_path, capture_output=True, text=True,
                            env=env)
    assert "Data and pipelines are up to date" in status.stdout, status.stdout  # dvc.lock holds all four
    assert set(json.loads((tmp_path / "runs/repro/seconds.json").read_text())) == set("abcd")
    again = _repro(tmp_path, env, "-j", "2")
    assert again.returncode == 0 and "0 stage(s) ran, 4 up to date" in again.stdout, again.stdout
    forced = _repro(tmp_path, env, "-f", "-s", "b", "c")   # those two again, nothing above or below them
    assert forced.returncode == 0 and "2 stage(s) ran, 0 up to date" in forced.stdout, forced.stdout
    assert _span(tmp_path, "a") == (a0, a1) and _span(tmp_path, "d") == (d0, d1) and _span(tmp_path, "b")[0] > b1


@pytest.mark.slow
def test_one_job_runs_one_stage_at_a_time(tmp_path):
    env = _project(tmp_path, {n: (deps, STAGE.format(name=n, sleep=1)) for n, deps in DIAMOND.items()})
    r = _repro(tmp_path, env, "-j", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    (b0, b1), (c0, c1) = _span(tmp_path, "b"), _span(tmp_path, "c")
    assert b1 <= c0 or c1 <= b0


@pytest.mark.slow
def test_a_failed_stage_is_named_with_its_log_and_what_needs_it_does_not_start(tmp_path):
    env = _project(tmp_path, {"a": ([], STAGE.format(name="a", sleep=0)),
                              "b": (["a"], "python -c \"raise SystemExit('b found a broken input')\""),
                              "c": (["a"], STAGE.format(name="c", sleep=1)),
                              "d": (["b", "c"], STAGE.format(name="d", sleep=0))})
    r = _repro(tmp_path, env, "-j", "2")
    assert r.returncode == 1
    assert "FAILED b" in r.stdout and "runs/repro/b.log" in r.stdout and "b found a broken input" in r.stdout, r.stdout
    assert "not started: d" in r.stdout
    assert not (tmp_path / "d.txt").exists()


@pytest.mark.slow
def test_a_pipeline_dvc_cannot_read_is_an_error_not_a_traceback(tmp_path):
    env = _project(tmp_path, {"a": ([], STAGE.format(name="a", sleep=0))})
    (tmp_path / "dvc.yaml").write_text("stages:\n  a: [unclosed\n")
    r = _repro(tmp_path, env)
    assert r.returncode == 2 and "llm.repro: DVC could not read the pipeline" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_dry_run_prints_the_plan_of_this_pipeline(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert repro.main(["--dry-run", "-j", "2", "eval@grpo"]) == 0
    out = capsys.readouterr().out
    assert "up to 2 at a time" in out
    plan = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert {"pretrain", "sft", "grpo", "eval@grpo"} <= set(plan) and "ppo" not in plan
    assert "sft" in plan["grpo"].split("after ")[1]
    # -s: only the named stages; grpo needs clean_sft through sft, which is not named, and still waits
    assert repro.main(["--dry-run", "-s", "clean_sft", "grpo"]) == 0
    plan = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(plan) == {"clean_sft", "grpo"} and plan["grpo"].endswith("after clean_sft")


def test_priorities_weigh_stages_by_this_commands_last_times_else_by_what_metrics_recorded(tmp_path):
    logs, metrics = tmp_path / "runs/repro", tmp_path / "metrics"
    assert repro.known_seconds(logs, metrics) == ({}, "60 s a stage")
    metrics.mkdir()
    (metrics / "sft.json").write_text(json.dumps({"stage_time_s": 812.5}))
    assert repro.known_seconds(logs, metrics) == ({"sft": 812.5}, f"the seconds recorded in {metrics}/")
    logs.mkdir(parents=True)
    (logs / "seconds.json").write_text(json.dumps({"sft": 700, "grpo": 650}))
    assert repro.known_seconds(logs, metrics)[0] == {"sft": 700.0, "grpo": 650.0}


def test_a_fresh_clone_weighs_the_stages_by_the_committed_report_cards_times(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "report.md").write_text((ROOT / "metrics/report.md").read_text())
    got, source = repro.known_seconds(tmp_path / "runs/repro", metrics)
    assert source == f"the stage times of {metrics / 'report.md'}"
    assert {"pretrain", "sft", "grpo", "eval@ppo"} <= set(got) and "prepare" not in got  # prepare records none
    assert all(t > 0 for t in got.values())
