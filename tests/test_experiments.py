"""The experiment workflows of the README and docs/experiments.md, on DVC itself.

The DVC workflows run on the stub pipeline of tests/test_dag.py (the real dvc.yaml, params and
outs; stub commands that write fresh content, run directories included), so they check what our
dvc.yaml makes DVC do, in seconds: an experiment leaves the committed baseline as it was; a clone
pulls everything from a remote and reruns nothing; an experiment already run elsewhere comes
back from the run-cache. .ci/run does the same on the real smoke DAG.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.browser import chromium, offline_dom, vega_plots
from tests.conftest import ROOT
from tests.test_dag import _ran, _run, stub_repo  # noqa: F401  (stub_repo is a fixture)

DVC = [sys.executable, "-m", "dvc"]


def _copy(repo: Path, name: str) -> Path:
    work = repo.parent / name
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(repo, work, symlinks=True)
    return work


@pytest.mark.slow
def test_returning_to_the_baseline_after_an_experiment_reruns_nothing(stub_repo):  # noqa: F811
    work = _copy(stub_repo, "baseline")
    assert _ran(_run(DVC + ["exp", "run", "-S", "ppo.clip_epsilon=0.3"], work)) == {"ppo", "eval@ppo", "report"}
    assert any((work / "runs" / "ppo").iterdir())  # the experiment wrote into the run directory
    _run(["git", "checkout", "--", "."], work)
    _run(DVC + ["checkout", "-f"], work)
    assert _ran(_run(DVC + ["repro"], work)) == set()
    assert _run(["git", "status", "--porcelain"], work) == ""


@pytest.mark.slow
def test_a_clone_pulls_from_a_remote_reruns_nothing_and_restores_an_experiment_from_the_run_cache(
        stub_repo, tmp_path):  # noqa: F811
    work = _copy(stub_repo, "pushed")
    _run(DVC + ["remote", "add", "-d", "storage", str(tmp_path / "remote")], work)
    _run(["git", "commit", "-qm", "remote", ".dvc/config"], work)
    _run(DVC + ["exp", "run", "-S", "ppo.clip_epsilon=0.3"], work)  # an experiment run here ...
    trained = (work / "models" / "ppo" / "stub.txt").read_text()
    _run(["git", "checkout", "--", "."], work)
    _run(DVC + ["checkout", "-f"], work)
    _run(DVC + ["push", "--run-cache"], work)

    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", str(work), str(clone)], tmp_path)
    _run(DVC + ["pull"], clone)
    assert "Data and pipelines are up to date" in _run(DVC + ["status"], clone)
    assert _ran(_run(DVC + ["repro"], clone)) == set()
    _run(DVC + ["pull", "--run-cache"], clone)
    out = _run(DVC + ["exp", "run", "-S", "ppo.clip_epsilon=0.3"], clone)  # ... is restored there
    assert _ran(out) == set(), out
    assert "Stage 'ppo' is cached" in out
    assert (clone / "models" / "ppo" / "stub.txt").read_text() == trained


# ---------------------------------------------------------------------------
# dvc plots show, offline

def _plots_repo(tmp_path: Path, venv: Path) -> Path:
    """A DVC repository with two curves, this repository's plots page and `.venv` pointing at `venv`."""
    repo = tmp_path / "plots"
    (repo / "metrics").mkdir(parents=True)
    (repo / "env").mkdir()
    shutil.copy(ROOT / "env" / "dvc_plots.html", repo / "env" / "dvc_plots.html")
    for name, col in (("train", "loss"), ("val", "val_bpb")):
        (repo / "metrics" / f"{name}.tsv").write_text(f"step\t{col}\n" + "".join(f"{i}\t{5 - i / 3}\n" for i in range(6)))
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"plots": [{"metrics/train.tsv": {"x": "step", "y": "loss"}},
                                                             {"metrics/val.tsv": {"x": "step", "y": "val_bpb"}}]}))
    subprocess.run(DVC + ["init", "--no-scm", "-q"], cwd=repo, check=True)
    (repo / ".dvc" / "config").write_text((ROOT / ".dvc" / "config").read_text())  # the plots template
    (repo / ".venv").symlink_to(venv)
    subprocess.run(DVC + ["plots", "show", "-q"], cwd=repo, check=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    return repo


@pytest.mark.slow
def test_dvc_plots_show_draws_every_plot_with_no_network(tmp_path):
    if chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
    venv = (ROOT / ".venv").resolve()
    if not (venv / "share" / "vega" / "vega-embed.min.js").is_file():
        pytest.skip("Vega is not in .venv/share/vega: env/setup_cpu.sh puts it there (it needs npm)")
    page = _plots_repo(tmp_path, venv) / "dvc_plots" / "index.html"
    assert "https://" not in "".join(line for line in page.read_text().splitlines() if "<script" in line)
    assert vega_plots(page) == (2, 2)

    # Without the venv's Vega the page says so instead of staying blank
    empty = tmp_path / "empty-venv"
    empty.mkdir()
    page = _plots_repo(tmp_path / "b", empty) / "dvc_plots" / "index.html"
    dom = offline_dom(page)
    assert vega_plots(page) == (2, 0)
    assert '<div id="no-vega">' in dom and "Vega is missing" in dom


# ---------------------------------------------------------------------------
# dvc.yaml and the profiles

def test_every_profile_names_its_device_and_dtype():
    """The run-cache keys a stage by params, deps and command, not by the machine: under
    `device: auto` a CUDA run and a CPU run of one profile would share a key, and one machine
    could restore the other's outputs. Every profile names both."""
    from llm.profile import render

    for path in sorted((ROOT / "env" / "profiles").glob("*.yaml")):
        common = render(path.stem, ROOT / "env" / "profiles")[0]["common"]
        assert common["device"] in ("cpu", "cuda") and common["dtype"] != "auto", (path.name, common)


def test_every_trained_model_is_a_dvc_artifact():
    """dvc.yaml's `artifacts:` name every model directory a stage writes, as DVC's model
    registry expects: type model, a description and labels, a name DVC accepts."""
    from dvc.repo import Repo
    from dvc.repo.artifacts import check_name_format

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    models = {o if isinstance(o, str) else next(iter(o)) for st in stages.values() for o in st.get("outs", [])}
    models = {m for m in models if m.startswith("models/") and m != "models/tokenizer"}
    with Repo(str(ROOT)) as repo:
        artifacts = repo.artifacts.read()["dvc.yaml"]
    assert {a.path for a in artifacts.values()} == models
    for name, a in artifacts.items():
        check_name_format(name)
        assert a.type == "model" and a.desc and a.labels, name


# ---------------------------------------------------------------------------
# Runs: TensorBoard per params, and the same bytes from the same params

def test_each_fingerprint_gets_its_own_tensorboard_run(tmp_path):
    from tests.test_trainer import run, tcfg

    for fp in ("a" * 64, "b" * 64):  # two experiments with one run directory
        run(tmp_path / "run", tcfg(max_steps=2, eval_every=2), fingerprint=fp, tb_dir=tmp_path / "run" / "tb")
    runs = sorted(p.name for p in (tmp_path / "run" / "tb").iterdir())
    assert runs == ["a" * 12, "b" * 12]
    assert all(any(f.name.startswith("events.out.tfevents") for f in (tmp_path / "run" / "tb" / r).iterdir())
               for r in runs)


def test_the_same_params_train_the_same_bytes(tmp_path):
    """Two runs from scratch with the same params on this machine give identical weights, bit
    for bit (the README's reproducibility claim; .ci/run checks it on the smoke pretrain stage)."""
    from safetensors.torch import save

    from tests.test_trainer import run, tcfg

    blobs = []
    for name in ("a", "b"):
        _, model = run(tmp_path / name, tcfg(max_steps=6))
        blobs.append(save({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}))
    assert blobs[0] == blobs[1]
