"""The DAG as a product: changing one hyperparameter reruns only what depends on it.

The real stages take minutes, so this test runs DVC on a copy of the repository whose
stage commands are replaced by stubs that write their declared outputs (with fresh
content each time, so a rerun always changes its outputs). Everything else is the
real dvc.yaml and params.yaml: deps, params sections, outs, foreach. DVC itself then
decides what a params change reruns.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

STUB = """\
import sys, time, pathlib
for spec in sys.argv[1:]:
    kind, path = spec.split(":", 1)
    p = pathlib.Path(path)
    if kind == "dir":
        p.mkdir(parents=True, exist_ok=True)
        (p / "stub.txt").write_text(str(time.time_ns()))
    else:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text('{"stub": %d}' % (time.time_ns() % 1000) if p.suffix == ".json" else str(time.time_ns()))
"""


def _kind(path: str) -> str:
    return "file" if Path(path).suffix else "dir"


def _outs(stage: dict, all_deps: set[str]) -> list[str]:
    """Stub specs for a stage's outputs, plus any path inside them that a later stage reads."""
    specs = []
    for key in ("outs", "metrics", "plots"):
        for entry in stage.get(key, []):
            path = entry if isinstance(entry, str) else next(iter(entry))
            specs.append(f"{_kind(path)}:{path}")
            specs += [f"{_kind(d)}:{d}" for d in sorted(all_deps) if d.startswith(path + "/")]
    return specs


def _stub_pipeline(dst: Path) -> None:
    """Replace every stage's command by the stub; a training stage's stub also writes its run
    directory (`--run-dir`, which DVC does not track), as the real stage writes checkpoints."""
    dvc = yaml.safe_load((dst / "dvc.yaml").read_text())
    bodies = [st["do"] if "foreach" in st else st for st in dvc["stages"].values()]
    all_deps = {d for b in bodies for d in b.get("deps", [])}
    for body in bodies:
        run_dir = re.findall(r"--run-dir (\S+)", body["cmd"])
        body["cmd"] = f"python stub.py {' '.join(_outs(body, all_deps) + [f'dir:{d}' for d in run_dir])}"
    (dst / "dvc.yaml").write_text(yaml.safe_dump(dvc, sort_keys=False))
    (dst / "stub.py").write_text(STUB)


def _run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def _ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


@pytest.fixture(scope="module")
def stub_repo(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("dag") / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    for stale in ("dvc.lock",):
        (dst / stale).unlink(missing_ok=True)
    shutil.rmtree(dst / "metrics", ignore_errors=True)
    _stub_pipeline(dst)
    dvc = [sys.executable, "-m", "dvc"]
    _run(["git", "init", "-q"], dst)
    _run(dvc + ["init", "-q", "-f"], dst)
    _run(dvc + ["config", "core.analytics", "false"], dst)
    out = _run(dvc + ["repro"], dst)
    stages = yaml.safe_load((dst / "dvc.yaml").read_text())["stages"]
    assert len(_ran(out)) >= len(stages), out
    _run(["git", "add", "-A"], dst)
    _run(["git", "commit", "-qm", "stub pipeline"], dst)
    return dst


def _change_and_repro(repo: Path, section: str, key: str, value) -> set[str]:
    """Change one param in a fresh copy of the stub repo (outputs that DVC does not cache,
    like checkpoints, would otherwise leak from one case into the next) and repro."""
    work = repo.parent / f"work-{section}-{key}"
    shutil.copytree(repo, work, symlinks=True)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params[section][key] = value
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        return _ran(_run([sys.executable, "-m", "dvc", "repro"], work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _downstream(stage: str) -> set[str]:
    """Stages that must rerun when `stage`'s params change: it and what depends on it."""
    return {
        "ppo": {"ppo", "eval@ppo", "ppo_rm", "eval@ppo_rm", "report"},          # ppo_rm: a variant of ppo
        "grpo": {"grpo", "eval@grpo", "grpo_random", "eval@grpo_random", "report"},
        "dpo": {"dpo", "eval@dpo", "rankers", "report"},                         # rankers reads DPO's model
        # the verifier reads only its own keys of the rankers section
        "rankers.verifier_steps": {"verifier", "rankers", "report"},
        "rankers.problems": {"rankers", "report"},
    }[stage]


@pytest.mark.slow
def test_nothing_reruns_when_nothing_changed(stub_repo):
    assert _ran(_run([sys.executable, "-m", "dvc", "repro"], stub_repo)) == set()


@pytest.mark.slow
@pytest.mark.parametrize("section,key,value", [("ppo", "clip_epsilon", 0.1), ("grpo", "beta", 0.08),
                                               ("dpo", "beta", 0.2), ("rankers", "verifier_steps", 4),
                                               ("rankers", "problems", 64)])
def test_a_param_change_reruns_only_its_stage_and_downstream(stub_repo, section, key, value):
    stages = yaml.safe_load((stub_repo / "dvc.yaml").read_text())["stages"]
    if section not in stages:
        pytest.skip(f"stage {section} is not in dvc.yaml yet")
    expected = _downstream(f"{section}.{key}" if section == "rankers" else section)
    assert _change_and_repro(stub_repo, section, key, value) == expected


@pytest.mark.slow
@pytest.mark.parametrize("section,key,value,stages", [
    ("grpo", "reward_control", "shuffled", {"grpo", "eval@grpo", "report"}),
    ("ppo", "reward_source", "rm", {"ppo", "eval@ppo", "report"})])
def test_a_key_that_a_variant_forces_reruns_only_the_stage_that_reads_it(stub_repo, section, key, value, stages):
    """grpo_random forces grpo.reward_control and ppo_rm ppo.reward_source: a change to that key
    cannot change their models, and DVC does not rerun them (the README's experiment)."""
    assert _change_and_repro(stub_repo, section, key, value) == stages


@pytest.mark.slow
def test_tokenize_change_does_not_rerun_the_tokenizer_or_prepare(stub_repo):
    ran = _change_and_repro(stub_repo, "tokenize", "chunk_docs", 7)
    assert "tokenize" in ran and "pretrain" in ran
    assert not ran & {"prepare", "tokenizer", "clean_sft"}


@pytest.mark.slow
def test_returning_to_the_baseline_after_an_experiment_reruns_nothing(stub_repo):
    """The README's Experiments flow after the committed run: one experiment, then back to the
    baseline (`git checkout -- . && dvc checkout`, no -f): every model file is there with the
    bytes it had, nothing DVC tracks differs from dvc.lock (`dvc status` clean), so `dvc repro`
    runs no stage (a run directory declared as an output made it retrain)."""
    import hashlib

    def models(root: Path) -> dict[str, str]:
        return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted((root / "models").rglob("*")) if f.is_file()}

    work = stub_repo.parent / "baseline"
    shutil.copytree(stub_repo, work, symlinks=True)
    before = models(work)
    dvc = [sys.executable, "-m", "dvc"]
    assert _ran(_run(dvc + ["exp", "run", "-S", "ppo.clip_epsilon=0.3"], work)) == _downstream("ppo")
    assert any((work / "runs" / "ppo").iterdir())  # the experiment wrote into the run directory
    assert models(work) != before  # it changed models/ppo
    # the README's `dvc exp show` view, as DVC draws it: the changed param stays, other params and deps go
    cols = next(ln.strip()[len("cols='"):-1] for ln in (ROOT / "README.md").read_text().splitlines()
                if ln.strip().startswith("cols='"))
    header = _run(dvc + ["exp", "show", "--no-pager", "--csv", "--only-changed", "--drop", cols], work).splitlines()[0]
    assert "ppo.clip_epsilon" in header.split(","), header
    _run(["git", "checkout", "--", "."], work)
    _run(dvc + ["checkout"], work)
    assert before and models(work) == before
    assert "Data and pipelines are up to date" in _run(dvc + ["status"], work)
    assert _ran(_run(dvc + ["repro"], work)) == set()
    assert _run(["git", "status", "--porcelain"], work) == ""
