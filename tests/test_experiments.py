"""The experiment workflows of the README and docs/experiments.md: offline plots, the profiles
and artifacts DVC sees, TensorBoard per params, the same bytes from the same params, the docs'
copies of DVC output. tests/test_dag.py checks that an experiment leaves the baseline as it was
(on stub stages); .ci/run runs every workflow, remotes and queues included, on the smoke DAG.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

DVC = [sys.executable, "-m", "dvc"]


# ---------------------------------------------------------------------------
# dvc plots show, offline

def _tsv_plots() -> list[tuple[str, str, dict]]:
    """(stage, TSV path, its properties) of every TSV plot in dvc.yaml."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return [(name, path, props) for name, st in stages.items() for p in st.get("plots", []) if isinstance(p, dict)
            for path, props in p.items() if path.endswith(".tsv")]


def test_every_curve_names_its_stage_and_metric():
    """A plot on the `dvc plots show` page says which stage and which quantity it is (DVC's
    default title is the file path), its y axis names the TSV column, and it uses the
    template that gives a constant series a readable axis."""
    plots = _tsv_plots()
    assert len(plots) >= 10
    for stage, path, props in plots:
        title, metric = props.get("title", ""), props.get("title", "").removeprefix(f"{stage}: ")
        assert title.startswith(f"{stage}: ") and len(metric) > 3, (path, title)
        assert props.get("y_label", "").startswith(props["y"]), (path, props)
        assert props.get("template") == "curve", path


def test_every_profile_names_its_device_and_dtype():
    """The run-cache keys a stage by params, deps and command, not by the machine: under
    `device: auto` a CUDA run and a CPU run of one profile would share a key, and one machine
    could restore the other's outputs. Every profile names both."""
    from llm.tools.profile import render

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


def test_the_graph_in_the_docs_is_dvc_dag():
    """docs/experiments.md shows `dvc dag --md --collapse-foreach-matrix`: this keeps it current."""
    out = subprocess.run(DVC + ["dag", "--md", "--collapse-foreach-matrix"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out in (ROOT / "docs" / "experiments.md").read_text(), "rerun dvc dag --md --collapse-foreach-matrix"


def test_the_readme_exp_show_view_keeps_every_params_section():
    """The README's `cols` pattern keeps the columns of every params section (and so the
    headline of metrics/summary.json, grouped by the same names) and drops every other metric."""
    import re

    from llm.config import section_keys
    from llm.train.metrics import MODEL_OF_STAGE

    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.strip().startswith("cols='"))
    pattern = line.strip()[len("cols='"):-1]
    assert pattern in (ROOT / "docs" / "experiments.md").read_text()
    sections = set(re.search(r"\(([a-z_|]+)\)", pattern).group(1).split("|"))
    assert sections == set(section_keys())
    assert {*MODEL_OF_STAGE, "reward"} <= sections
    drop = re.compile(pattern)
    assert not drop.match("Experiment") and not drop.match("ppo.clip_epsilon") and not drop.match("sft.em")
    assert drop.match("math_exact_match") and drop.match("by_kind.math.n") and drop.match("llm/nn/model.py")
