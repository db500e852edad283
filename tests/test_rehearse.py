"""llm/tools/rehearse.py: the cuts keep a profile's shapes and give a valid params file; stages and commands come
from DVC; a stage's failure, a short vocabulary and a lack of memory are reported. The whole rehearsal of
gpu-13m runs in .ci/run."""
from __future__ import annotations

import json

import pytest

from llm.config import load_params_text
from llm.tools import rehearse as rh
from llm.tools.profile import render, to_yaml
from tests.conftest import ROOT

PROFILES = ROOT / "env" / "profiles"


@pytest.mark.parametrize("name", ["gpu-13m", "gpu-77m", "gpu-406m"])
def test_cut_keeps_the_shapes_and_gives_a_valid_params_file(name):
    params = render(name, PROFILES)[0]
    cut = rh.cut(params)
    p = load_params_text(to_yaml(cut, name, ""))  # valid by the same rules as params.yaml
    assert cut["pretrain"]["model"] == params["pretrain"]["model"]
    assert cut["tokenizer"]["vocab_size"] == params["tokenizer"]["vocab_size"]
    assert (p.common.device, p.common.dtype, p.common.nproc) == ("cpu", "fp32", 1)
    for section in ("pretrain", "sft", "reward", "dpo"):
        c = getattr(p, section)
        assert (c.max_steps, c.batch_size, c.grad_accum, c.compile) == (1, 1, 1, False), section
    assert (p.ppo.max_steps, p.ppo.rollout_prompts, p.grpo.prompts_per_step, p.grpo.group_size) == (1, 1, 1, 2)
    assert p.dpo.trainable == params["dpo"]["trainable"]  # what trains is not a size: kept
    assert params["common"]["device"] == "cuda"  # the profile itself is untouched


def test_a_cut_key_the_params_lack_is_an_error(monkeypatch):
    monkeypatch.setitem(rh.CUTS, "ppo", {"steps": 1})  # as if the key were renamed in config
    with pytest.raises(KeyError, match="cuts ppo.steps, which the params do not have"):
        rh.cut(render("gpu-13m", PROFILES)[0])


def test_parse_dry_run_reads_stages_and_their_commands_in_order():
    text = ("Running stage 'prepare':\n> python -m stages.prepare\n\nRunning stage 'eval@base':\n"
            "> python -m stages.eval base data/x\n> echo done\n\nUse `dvc push` to send your updates\n")
    assert rh.parse_dry_run(text) == [("prepare", ["python -m stages.prepare"]),
                                      ("eval@base", ["python -m stages.eval base data/x", "echo done"])]
    with pytest.raises(RuntimeError, match="could not read the stages"):
        rh.parse_dry_run("Stage 'prepare' didn't change, skipping\n")


def test_shape_problem_reads_a_short_vocabulary_from_the_stage_metrics(tmp_path):
    (tmp_path / "dvc.yaml").write_text("stages:\n  tokenizer:\n    cmd: x\n    outs: [models/tokenizer]\n"
                                       "    metrics:\n      - metrics/tokenizer.json:\n          cache: false\n"
                                       "  pretrain:\n    cmd: y\n    outs:\n      - runs/pretrain:\n"
                                       "          persist: true\n      - models/base\n")
    (tmp_path / "metrics").mkdir()
    f = tmp_path / "metrics" / "tokenizer.json"
    f.write_text(json.dumps({"vocab_size": 30575, "requested_vocab_size": 32768}))
    assert rh.shape_problem(tmp_path, "tokenizer") == "vocab_size 30575, not the profile's 32768"
    f.write_text(json.dumps({"vocab_size": 32768, "requested_vocab_size": 32768}))
    assert rh.shape_problem(tmp_path, "tokenizer") == ""
    assert rh.declared(tmp_path, "pretrain", "outs", persist=True) == [tmp_path / "runs/pretrain"]


def test_scratch_copy_outside_git_leaves_outputs_and_caches_behind(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    for f in ("llm/nn/model.py", "dvc.yaml", ".dvc/config", "data/tokens/train.bin", "models/base/x",
              "llm/__pycache__/model.pyc", ".dvc/cache/ab/cd", "tests/data/keep.txt"):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text("x")
    dest.mkdir()
    assert rh.scratch_copy(src, dest) == 4
    assert sorted(str(f.relative_to(dest)) for f in dest.rglob("*") if f.is_file() and ".git/" not in str(f)) == \
        [".dvc/config", "dvc.yaml", "llm/nn/model.py", "tests/data/keep.txt"]


def test_refuses_with_both_figures_when_memory_is_short(monkeypatch, capsys):
    monkeypatch.setattr(rh, "available_memory", lambda: 2**20)
    monkeypatch.setattr(rh, "scratch_copy", lambda *a: pytest.fail("refusal must come before any work"))
    assert rh.rehearse("gpu-406m") == 2
    err = capsys.readouterr().err
    assert "refused: stage" in err and "GiB of memory and this machine has 0.0 GiB available" in err


def _rows(out: str) -> list[list[str]]:
    """The table's rows (stage, result, ...), after its header."""
    lines = out.split("\nstage ")[-1].splitlines()[1:]
    return [ln.split() for ln in lines if ln and not ln.startswith("rehearse ")]


@pytest.mark.slow
def test_runs_the_stages_dvc_lists_and_stops_at_a_failing_one(capsys, tmp_path):
    # tokenizer first (prepare's outputs are missing): its row says why, and tokenize never runs
    assert rh.rehearse("gpu-13m", only=["tokenizer", "tokenize"], tmp=tmp_path) == 1
    out = capsys.readouterr()
    assert "stages: prepare, tokenizer, tokenize, pretrain, clean_sft, sft" in out.out  # DVC's order
    rows = _rows(out.out)
    assert [r[0] for r in rows] == ["tokenizer"] and rows[0][1:4] == ["FAILED:", "exit", "1:"]
    assert "its output is in" in out.err and "scratch copy kept in" in out.out
    assert rh.rehearse("gpu-13m", only=["prepare"], tmp=tmp_path) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r[:2] for r in rows] == [["prepare", "ok"]]


@pytest.mark.slow
def test_a_saved_plan_stands_in_for_dvc_and_is_refused_for_another_pipeline(capsys, tmp_path, monkeypatch):
    # saved where DVC is: the stages in DVC's order, under a header that names dvc.yaml + params.yaml
    plan = tmp_path / "plan.txt"
    assert rh.rehearse("smoke", save_plan=plan, tmp=tmp_path) == 0
    text = plan.read_text()
    assert text.startswith(rh.PLAN_HEAD) and "Running stage 'prepare':" in text
    assert "stage " not in capsys.readouterr().out.split("written to")[-1]  # no (empty) table after saving
    # a machine without DVC: asking DVC is refused with what to do; the plan runs the stages
    monkeypatch.setattr(rh.shutil, "which", lambda cmd, path=None: None)
    with pytest.raises(RuntimeError, match="no `dvc` on PATH.*--save-plan FILE"):
        rh.rehearse("smoke", only=["prepare"], tmp=tmp_path)
    capsys.readouterr()
    assert rh.rehearse("smoke", only=["prepare"], tmp=tmp_path, plan=plan) == 0
    out = capsys.readouterr().out
    assert f"(from the plan {plan})" in out and [r[:2] for r in _rows(out)] == [["prepare", "ok"]]
    # the same plan for another profile (other params.yaml) is refused, naming both hashes
    with pytest.raises(RuntimeError, match="saved for another dvc.yaml or params.yaml"):
        rh.rehearse("gpu-13m", only=["prepare"], tmp=tmp_path, plan=plan)
    bad = tmp_path / "bad.txt"
    bad.write_text("Running stage 'prepare':\n> python -m stages.prepare\n")
    with pytest.raises(RuntimeError, match="line 1 is not a rehearsal plan's header"):
        rh.rehearse("smoke", only=["prepare"], tmp=tmp_path, plan=bad)


def test_profiles_do_not_import_the_rehearsal():
    """The rehearsal builds on profiles, never the other way round: llm/tools/profile.py stays importable
    without the DAG-running machinery, and the two modules form no import cycle."""
    import ast

    tree = ast.parse((ROOT / "llm" / "tools" / "profile.py").read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "llm.tools.rehearse" not in imported


def test_the_command_names_an_unknown_profile(capsys):
    assert rh.main(["no-such-profile"]) == 1
    err = capsys.readouterr().err
    assert "no-such-profile.yaml: no such profile" in err and "gpu-13m" in err
