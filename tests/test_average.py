"""llm.average: the mean of a run's last checkpoints, written as a model directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm.data.tokenizer import Tokenizer
from llm.nn.artifacts import load_model_dir, save_model_dir
from llm.nn.model import GPT, ModelConfig
from llm.train.average import average_run, average_states, main
from llm.train.checkpoint import CheckpointError, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path, list[dict[str, torch.Tensor]]]:
    """A model directory (fingerprint "fp") and a run directory with three checkpoints of it
    (steps 10, 20, 30), each with different weights; returns (run_dir, model_dir, states)."""
    root = tmp_path_factory.mktemp("avg")
    tok = Tokenizer.train(["abc abc abd abd abe, 12 + 7 = 19 " * 20], vocab_size=300, max_pairs=1000,
                          min_frequency=1, jieba=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=16)
    states = [GPT(cfg, seed=s).state_dict() for s in (1, 2, 3)]
    for step, state in zip((10, 20, 30), states):
        save_checkpoint(root / "run", step, model_state=state, train_state={"step": step}, fingerprint="fp", keep=3)
    model = GPT(cfg, seed=0)
    model.load_state_dict(states[-1])
    like = save_model_dir(root / "sft", model, tok, {"stage": "sft", "fingerprint": "fp", "steps": 30})
    return root / "run", like, states


def test_average_states_is_the_elementwise_mean_in_each_dtype():
    a = {"w": torch.tensor([1.0, 2.0]), "h": torch.tensor([1.0, 3.0], dtype=torch.bfloat16)}
    b = {"w": torch.tensor([2.0, 5.0]), "h": torch.tensor([2.0, 4.0], dtype=torch.bfloat16)}
    m = average_states([a, b])
    assert torch.equal(m["w"], torch.tensor([1.5, 3.5]))
    assert m["h"].dtype == torch.bfloat16 and torch.equal(m["h"], torch.tensor([1.5, 3.5], dtype=torch.bfloat16))
    assert torch.equal(average_states([a])["w"], a["w"])


@pytest.mark.parametrize("other, match", [
    ({"v": torch.zeros(2)}, "other tensors"),
    ({"w": torch.zeros(3)}, "shape or dtype"),
    ({"w": torch.zeros(2, dtype=torch.float64)}, "shape or dtype"),
])
def test_average_states_refuses_states_that_do_not_line_up(other, match):
    with pytest.raises(ValueError, match=match):
        average_states([{"w": torch.zeros(2)}, other])


def test_average_states_refuses_integers_and_nothing():
    with pytest.raises(ValueError, match="only floats can be averaged"):
        average_states([{"n": torch.tensor([1, 2])}])
    with pytest.raises(ValueError, match="no state dicts"):
        average_states([])


def test_the_last_two_checkpoints_averaged_into_a_model_directory(run, tmp_path):
    run_dir, like, states = run
    meta = average_run(run_dir, like, tmp_path / "avg")
    model, tok, saved_meta = load_model_dir(tmp_path / "avg")
    _, like_tok, _ = load_model_dir(like)
    for k, v in model.state_dict().items():
        want = ((states[1][k].double() + states[2][k].double()) / 2).to(v.dtype)
        assert torch.equal(v, want), k
    assert saved_meta["averaged_checkpoints"] == [20, 30] == meta["averaged_checkpoints"]
    assert saved_meta["stage"] == "sft" and saved_meta["fingerprint"] == "fp" and saved_meta["steps"] == 30
    assert tok.sha256() == like_tok.sha256()


def test_last_three_and_the_command_line(run, tmp_path, capsys):
    run_dir, like, states = run
    assert main([str(run_dir), str(like), str(tmp_path / "avg3"), "--last", "3"]) == 0
    assert "steps 10, 20, 30" in capsys.readouterr().out
    model, _, _ = load_model_dir(tmp_path / "avg3")
    k = "lm_head.weight" if "lm_head.weight" in states[0] else next(iter(states[0]))
    want = (sum(s[k].double() for s in states) / 3).to(states[0][k].dtype)
    assert torch.equal(model.state_dict()[k], want)


def test_refusals_name_what_to_do(run, tmp_path, capsys):
    run_dir, like, _ = run
    with pytest.raises(ValueError, match=r"3 checkpoint\(s\).*fewer than the 4 to average.*keep_checkpoints"):
        average_run(run_dir, like, tmp_path / "x", last=4)
    with pytest.raises(ValueError, match="--last must be at least 1, got 0"):
        average_run(run_dir, like, tmp_path / "x", last=0)
    with pytest.raises(ValueError, match="is the input"):
        average_run(run_dir, like, like)
    with pytest.raises(FileNotFoundError, match="no run directory"):
        average_run(tmp_path / "nowhere", like, tmp_path / "x")
    assert main([str(tmp_path / "nowhere"), str(like), str(tmp_path / "x")]) == 1
    assert "average: " in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def workspace(run, tmp_path_factory):
    """A project's layout: runs/sft with its checkpoints, models/sft, models/base, notes/."""
    import shutil

    run_dir, like, _ = run
    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(run_dir, ws / "runs/sft")
    shutil.copytree(like, ws / "models/sft")
    shutil.copytree(like, ws / "models/base")
    (ws / "notes").mkdir()
    (ws / "notes" / "todo.txt").write_text("mine")
    return ws


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("target, says", [
    ("notes", "notes: exists and is not empty"),      # --force: is not a model directory
    (".", ".: is the current directory"),
    ("runs/sft", "runs/sft: is the input runs/sft"),
    ("models/sft", "models/sft: is the input models/sft"),
    ("models", "models: holds the input models/sft"),
    ("runs", "runs: holds the input runs/sft"),
])
def test_average_never_replaces_what_it_did_not_write(workspace, monkeypatch, capsys, target, says, force):
    from tests.test_fileio import temps_under, tree_digest

    monkeypatch.chdir(workspace)
    before = tree_digest(workspace)
    assert main(["runs/sft", "models/sft", target, *(["--force"] if force else [])]) == 1
    err = capsys.readouterr().err.strip()
    if force and target == "notes":
        says = "notes: is not a model directory"
    assert err.startswith(f"average: {says}") and "name a new directory" in err and "\n" not in err
    assert tree_digest(workspace) == before and temps_under(workspace) == []


def test_average_replaces_another_model_directory_only_with_force(workspace, tmp_path, monkeypatch, capsys):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(workspace / "runs", "runs")
    shutil.copytree(workspace / "models", "models")
    assert main(["runs/sft", "models/sft", "models/base"]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert main(["runs/sft", "models/sft", "models/base", "--force"]) == 0
    assert load_model_dir("models/base")[2]["averaged_checkpoints"] == [20, 30]


@pytest.mark.parametrize("change", ["look-alike", "edited config", "added file", "empty folder", "version 1"])
def test_force_keeps_a_look_alike_or_changed_model_directory(workspace, tmp_path, monkeypatch, capsys, change):
    """File names prove nothing: --force replaces a model directory only if its meta.json lists
    every file with the hash it has now; anything else is kept, byte for byte."""
    import shutil

    from tests.test_fileio import temps_under, tree_digest

    monkeypatch.chdir(tmp_path)
    shutil.copytree(workspace / "runs", "runs")
    shutil.copytree(workspace / "models", "models")
    base = Path("models/base")
    if change == "look-alike":  # the user's own files under a model directory's names
        shutil.rmtree(base)
        base.mkdir()
        for name in ("meta.json", "model.safetensors", "config.json"):
            (base / name).write_text(f"the user's {name}")
    elif change == "edited config":
        cfg = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**cfg, "dropout": 0.5}))
    elif change == "added file":
        (base / "notes.txt").write_text("mine")
    elif change == "empty folder":
        (base / "scratch").mkdir()
    else:  # meta.json of the first format: it hashed two of the files
        meta = json.loads((base / "meta.json").read_text())
        meta["files"] = {k: v for k, v in meta["files"].items() if k in ("model.safetensors", "config.json")}
        (base / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    before = tree_digest(tmp_path)
    assert main(["runs/sft", "models/sft", "models/base", "--force"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("average: models/base: is not a model directory") and "name a new directory" in err
    assert tree_digest(tmp_path) == before and temps_under(tmp_path) == []


def test_checkpoints_of_other_params_are_refused(run, tmp_path):
    run_dir, like, states = run
    other = tmp_path / "other"
    for step in (1, 2):
        save_checkpoint(other, step, model_state=states[0], train_state={}, fingerprint="another", keep=2)
    with pytest.raises(CheckpointError, match="other params or inputs"):
        average_run(other, like, tmp_path / "x")


def test_a_corrupt_checkpoint_is_refused_before_anything_is_written(run, tmp_path):
    import shutil

    run_dir, like, _ = run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    f = copy / "ckpt-00000030" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        average_run(copy, like, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert json.loads((like / "meta.json").read_text())["fingerprint"] == "fp"


# ---------------------------------------------------------------------------
# SFT's own averaging (sft.average_last)

def _sft_section(**over) -> dict:
    sec = dict(bucket_width=8, eval_math_problems=2, max_new_tokens=8, min_source_examples=0, max_steps=6,
               batch_size=4, grad_accum=1, distributed="ddp", lr=3e-3, min_lr=3e-4, warmup_steps=1, weight_decay=0.0,
               optimizer="adamw", muon_lr=0.02,
               beta1=0.9, beta2=0.95, grad_clip=1.0, eval_every=3, eval_batches=2, log_every=1, checkpoint_every=2,
               keep_checkpoints=3, nonfinite_policy="raise", nonfinite_budget=0, activation_checkpointing=False,
               compile=False, replay_fraction=0.0, average_last=1)
    sec.update(over)
    return sec


@pytest.fixture(scope="module")
def sft_workspace(tmp_path_factory) -> Path:
    """models/base (a tiny GPT), data/clean_sft/{train,val}.jsonl and data/prepared/rl/val.jsonl."""
    import random

    from llm.data.generators import math_problem

    ws = tmp_path_factory.mktemp("sft")
    rng = random.Random(0)
    problems = [math_problem(rng, 1, "en") for _ in range(40)]
    convs = [{"id": f"m{i}", "source": "generated/math_en", "messages": [
        {"role": "user", "content": p.question}, {"role": "assistant", "content": p.solution}]} for i, p in enumerate(problems)]
    for name, recs in (("data/clean_sft/train.jsonl", convs[:32]), ("data/clean_sft/val.jsonl", convs[32:]),
                       ("data/prepared/rl/val.jsonl", [{"id": f"v{i}", "question": p.question, "answer": str(p.answer)}
                                                        for i, p in enumerate(problems[32:])])):
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok = Tokenizer.train([p.question + " " + p.solution for p in problems] * 2, vocab_size=320, max_pairs=5000,
                          min_frequency=2, required_tokens=["####"], jieba=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, seq_len=128, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    save_model_dir(ws / "models/base", GPT(cfg, seed=1), tok, {"stage": "pretrain", "fingerprint": "base-fp"})
    return ws


def _run_sft(ws: Path, name: str, **over) -> tuple[dict, Path]:
    """The sft stage as dvc.yaml runs it, its outputs under `name`/; returns (metrics, model dir)."""
    import yaml

    import stages.sft
    from llm.train.metrics import read_metrics
    from tests.conftest import common_params, dvc_command

    out = ws / name
    out.mkdir(exist_ok=True)
    (out / "params.yaml").write_text(yaml.safe_dump({"common": common_params(), "sft": _sft_section(**over)}))
    argv = dvc_command("sft")[3:]  # after `python -m stages.sft`
    outputs = {"--run-dir", "--model", "--metrics", "--plots"}
    argv = [a if a.startswith("--") else str((out if prev in outputs else ws) / a) for prev, a in zip([""] + argv, argv)]
    assert stages.sft.main([*argv, "--params", str(out / "params.yaml"), "--no-progress"]) == 0
    return read_metrics(out / "metrics/sft.json"), out / "models/sft"


def test_sft_writes_the_mean_of_its_last_checkpoints(sft_workspace):
    from llm.train.checkpoint import load_checkpoint

    plain, plain_dir = _run_sft(sft_workspace, "plain")
    avg, avg_dir = _run_sft(sft_workspace, "avg", average_last=3)
    assert "averaged_steps" not in plain and "val_loss_last" not in plain
    assert avg["averaged_steps"] == [2, 4, 6]
    # training is the same: the final weights of the averaging run are the plain run's model
    final = load_checkpoint(sft_workspace / "avg/runs/sft/ckpt-00000006").model_state
    plain_model, _, _ = load_model_dir(plain_dir)
    for k, v in plain_model.state_dict().items():
        assert torch.equal(final[k], v), k
    assert avg["val_loss_last"] == plain["val_loss"]
    # the model written is the mean of steps 2, 4 and 6, and its val loss is its own
    model, _, meta = load_model_dir(avg_dir)
    states = [load_checkpoint(sft_workspace / f"avg/runs/sft/ckpt-0000000{s}").model_state for s in (2, 4, 6)]
    for k, v in model.state_dict().items():
        assert torch.equal(v, (sum(s[k].double() for s in states) / 3).to(v.dtype)), k
    assert meta["averaged_checkpoints"] == [2, 4, 6] and meta["steps"] == 6
    assert avg["val_loss"] != avg["val_loss_last"]


def test_sft_rerun_after_its_last_step_writes_the_same_mean(sft_workspace):
    """A stage stopped after its last step but before its model was written resumes at its final
    checkpoint, trains nothing, and averages the same checkpoints into the same bytes."""
    import shutil

    first, model_dir = _run_sft(sft_workspace, "again", average_last=2)
    before = {f.name: f.read_bytes() for f in model_dir.iterdir() if f.is_file()}
    shutil.rmtree(model_dir)
    second, model_dir = _run_sft(sft_workspace, "again", average_last=2)
    assert {f.name: f.read_bytes() for f in model_dir.iterdir() if f.is_file()} == before
    assert second["averaged_steps"] == first["averaged_steps"] == [4, 6]
    assert second["val_loss"] == first["val_loss"] and second["val_loss_last"] == first["val_loss_last"]
    assert second["train_time_s"] == first["train_time_s"]  # restored from the final checkpoint: no step ran


@pytest.mark.parametrize("over, match", [
    (dict(average_last=4, keep_checkpoints=3), r"sft.average_last: 4 .*keep_checkpoints=3.*at least 4"),
    (dict(average_last=3, keep_checkpoints=3, checkpoint_every=3), r"sft.average_last: 3 .*max_steps=6 with"
                                                                     r" checkpoint_every=3 writes 2"),
])
def test_sft_average_last_that_cannot_be_met_is_refused_by_the_params_check(tmp_path, over, match):
    import yaml

    from llm.config import ConfigError, load_sections
    from tests.conftest import common_params

    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"common": common_params(), "sft": _sft_section(**over)}))
    with pytest.raises(ConfigError, match=match):
        load_sections(["common", "sft"], p)
