"""Several processes: data-parallel RL, sharded eval and pairs, FSDP in every supervised stage,
two machines, resuming on another number of processes, and the launcher's errors.

Everything runs as gloo processes on the CPU. Library-level runs start their ranks with the
environment torchrun would give them (`_ranks`); stage-level runs go through `python -m
stages.<name>` and its launcher (llm/stage.py), as `dvc repro` runs them. "1 vs 2 processes"
tests compare against one process with the same params: equal up to the order of float sums
(tolerances below), or byte for byte where the work is shared out by whole batches.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from llm.config import CommonConfig, ConfigError
from llm.train.metrics import read_metrics
from tests.conftest import ROOT, dvc_command, free_port
from tests.test_eval_stage import world  # noqa: F401  (a fixture: the eval stage's tiny models and data)

pytestmark = pytest.mark.usefixtures("one_thread")

RL_TOL = 2e-5  # absolute and relative, on every logged number and every final weight of a few RL steps
# shares of tokens where one side of a comparison beats the other: a token at the edge of a clip
# range falls on either side with the order of float sums
FLIP_TOL = {"clip_ratio": 0.02, "vf_clipfrac": 0.02}


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _ranks(child: str, opt: dict | list[dict], world: int, machines: int = 1) -> list[tuple[int, str]]:
    """Run tests.test_scale.<child>(opt) as `world` gloo ranks (torchrun's environment, as if on
    `machines` machines); (rc, output) per rank."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests import test_scale;"
            f" test_scale.{child}(sys.argv[1])")
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world // machines)} if world > 1 else {}
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(opt)], cwd=ROOT,
                              env=_env(**env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if world > 1 else {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    return [(p.returncode, out) for p, out in ((p, p.communicate(timeout=600)[0]) for p in procs)]


def _runtime(world: int):
    from llm.runtime import Runtime, setup_runtime
    if world == 1:
        return Runtime(torch.device("cpu"))
    return setup_runtime(CommonConfig(seed=0, device="cpu", dtype="auto", nproc=world, num_threads=1,
                                      cpu_kernels=True))


# ---------------------------------------------------------------------------
# Data-parallel RL: the trajectory of one process

# prompts of 3 to 5 tokens: ranks left-pad their share differently from one process
_g = torch.Generator().manual_seed(5)
RL_PROMPTS = [torch.randint(4, 16, (3 + i % 3,), generator=_g).tolist() for i in range(8)]


def rl_child(arg: str) -> None:
    """RL runs of a tiny model on the synthetic reward of tests/test_grpo.py, one options object
    or a list of them run in turn (one interpreter, one process group: starting Python with
    torch costs more than a run); rank 0 writes each run's history (timings left out) and final
    weights under its opt["out"]."""
    opts = json.loads(arg)
    torch.set_num_threads(1)
    rt = _runtime(int(os.environ.get("WORLD_SIZE", "1")))
    for opt in opts if isinstance(opts, list) else [opts]:
        _rl_child_one(opt, rt)
    rt.close()


def _rl_child_one(opt: dict, rt) -> None:
    from safetensors.torch import save_file

    from llm.post.grpo import GRPO
    from llm.post.ppo import PPO
    from llm.post.rl import run_rl
    from tests.test_grpo import PAD, STOP, TIME_KEYS, grpo_cfg, target_fraction, tiny
    from tests.test_ppo import ppo_cfg

    common = dict(reward_fn=target_fraction, stop_ids=(STOP,), pad_id=PAD, seed=0, rt=rt)
    if opt["algo"] == "grpo":
        cfg = grpo_cfg(**opt["cfg"])
        n = cfg.prompts_per_step * cfg.oversample
        algo = GRPO(tiny(), tiny(), cfg, prompts_fn=lambda step: (RL_PROMPTS[:n], [{}] * n), **common)
    else:
        cfg = ppo_cfg(**opt["cfg"])
        n = cfg.rollout_prompts
        algo = PPO(tiny(("lm", "value")), tiny(), cfg, prompts_fn=lambda step: (RL_PROMPTS[:n], [{}] * n),
                   log=lambda m: None, **common)
    res = run_rl(algo, cfg, rt, stage=opt["algo"], run_dir=opt["run_dir"], fingerprint="fp", progress=False)
    if rt.is_main:
        rows = [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in res.history]
        Path(opt["out"] + ".json").write_text(json.dumps({"history": rows, "resumed_from": res.resumed_from}))
        save_file({k: v.contiguous() for k, v in algo.model.state_dict().items() if k != "lm_head.weight"},  # tied
                  opt["out"] + ".safetensors")


def _rl_result(out: str) -> dict:
    from safetensors.torch import load_file
    got = json.loads(Path(out + ".json").read_text())
    got["weights"] = load_file(out + ".safetensors")
    return got


def _rl_run(tmp_path: Path, name: str, algo: str, cfg: dict, world: int, run_dir: str | None = None) -> dict:
    out = str(tmp_path / name)
    res = _ranks("rl_child", {"algo": algo, "cfg": cfg, "run_dir": str(tmp_path / (run_dir or name)), "out": out},
                 world)
    assert [rc for rc, _ in res] == [0] * world, res
    return _rl_result(out)


def _assert_close_runs(a: dict, b: dict, tol: float = RL_TOL) -> float:
    """Every logged number and every weight within tol (absolute + relative); returns the largest difference."""
    worst = 0.0
    assert len(a["history"]) == len(b["history"])
    for ra, rb in zip(a["history"], b["history"]):
        assert ra.keys() == rb.keys()
        for k in ra:
            d = abs(ra[k] - rb[k])
            if k in FLIP_TOL:
                assert d <= FLIP_TOL[k], (ra["step"], k, ra[k], rb[k])
                continue
            worst = max(worst, d)
            assert d <= tol * (1 + abs(ra[k])), (ra["step"], k, ra[k], rb[k])
    for k, w in a["weights"].items():
        d = float((w - b["weights"][k]).abs().max())
        worst = max(worst, d)
        assert d <= tol, (k, d)
    return worst


# lr 1e-3 (tests/test_grpo.py trains at 1e-2): at 1e-2 AdamW turns the 1e-7 differences of float sums
# into 1e-5 (one process perturbed once) to 4e-4 (two processes) in the weights within three steps
RL_LR = dict(lr=1e-3, min_lr=1e-3)
RL_CASES = {
    # minibatches of 6 rows over 2 ranks of 8 rows: some lie on one rank only, some straddle both
    "grpo": ("grpo", dict(prompts_per_step=4, group_size=4, minibatch_size=6, epochs=2, beta=0.04,
                          loss_agg="grpo", max_steps=3, **RL_LR)),
    # beta 0: completions of zero-variance groups skip the update; dapo: global token normaliser
    "grpo-dapo": ("grpo", dict(prompts_per_step=4, group_size=4, minibatch_size=5, epochs=1, beta=0.0,
                               loss_agg="dapo", max_steps=3, **RL_LR)),
    # dynamic sampling: 4 groups rolled out over 2 ranks, the first 2 informative ones trained on
    # (here rank 0's: rank 1 joins every update with no row of its own)
    "grpo-dynamic": ("grpo", dict(prompts_per_step=2, oversample=2, group_size=4, minibatch_size=6, epochs=1,
                                  beta=0.04, loss_agg="grpo", max_steps=3, **RL_LR)),
    # whitening, the adaptive KL controller and the value head over the global batch
    "ppo": ("ppo", dict(rollout_prompts=6, minibatch_size=4, epochs=2, adaptive_kl=True, kl_target=0.01,
                        kl_horizon=100, max_steps=3, **RL_LR)),
}


# the uninterrupted run the checkpointed one is compared with
RL_REF = {"grpo-4-steps": ("grpo", {**RL_CASES["grpo"][1], "max_steps": 4})}


@pytest.fixture(scope="session")
def rl_runs(tmp_path_factory):
    """`rl_runs(case, nproc)`: the result of RL_CASES[case] (or RL_REF's) on `nproc` processes.
    Every case of one process count runs in one launch, on first use."""
    root = tmp_path_factory.mktemp("rl_runs")
    done: set[int] = set()

    def get(case: str, nproc: int) -> dict:
        if nproc not in done:
            cases = {**RL_CASES, **RL_REF} if nproc == 1 else RL_CASES
            runs = [{"algo": algo, "cfg": cfg, "run_dir": str(root / f"{c}-{nproc}"), "out": str(root / f"{c}-{nproc}")}
                    for c, (algo, cfg) in cases.items()]
            res = _ranks("rl_child", runs, nproc)
            assert [rc for rc, _ in res] == [0] * nproc, res
            done.add(nproc)
        return _rl_result(str(root / f"{case}-{nproc}"))
    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RL_CASES))
def test_two_processes_follow_the_one_process_rl_trajectory(rl_runs, case):
    algo, cfg = RL_CASES[case]
    one, two = rl_runs(case, 1), rl_runs(case, 2)
    worst = _assert_close_runs(one, two)
    print(f"{case}: largest difference 1 vs 2 processes {worst:.1e} (tolerance {RL_TOL})")
    from tests.test_grpo import tiny
    init = tiny(("lm", "value") if algo == "ppo" else ("lm",)).state_dict()
    assert any(not torch.equal(init[k], w) for k, w in one["weights"].items())  # it trained: not vacuous
    assert len({r["loss"] for r in one["history"]}) == len(one["history"])


@pytest.mark.slow
def test_an_rl_run_checkpointed_on_two_processes_resumes_on_one(tmp_path, rl_runs):
    algo, cfg = RL_CASES["grpo"]
    ref = rl_runs("grpo-4-steps", 1)
    _rl_run(tmp_path, "first", algo, {**cfg, "max_steps": 2}, world=2, run_dir="run")  # checkpoint at step 2
    rest = _rl_run(tmp_path, "rest", algo, {**cfg, "max_steps": 4}, world=1, run_dir="run")
    assert rest["resumed_from"] == 2
    _assert_close_runs(ref, rest)


# ---------------------------------------------------------------------------
# Supervised runs resumed on another number of processes (tests/test_trainer.py's runs)

@pytest.mark.slow
def test_a_supervised_run_resumes_on_another_number_of_processes_from_the_same_sample(tmp_path, reference_runs):
    """Checkpointed on 2 processes, resumed on 1; checkpointed on 1, resumed on 2: the loss curve
    and the weights of the uninterrupted one-process run (dropout on: its masks follow the sample)."""
    from tests.test_trainer import CASES, DDP_TOL, _assert_same, _child_run, _launch2, _result

    base = CASES["dropout"]
    ref = reference_runs("dropout")

    stop = _launch2({**base, "distributed": "ddp", "run_dir": str(tmp_path / "a"), "out": str(tmp_path / "x"),
                     "term_at_attempt": 4})
    assert [rc for rc, _ in stop] == [143, 143], stop  # SIGTERM on rank 0: both checkpoint step 5 and stop
    rc, out = _child_run({**base, "run_dir": str(tmp_path / "a"), "out": str(tmp_path / "a")})
    assert rc == 0 and "written by 2 process(es), continuing on 1" in out, out
    got = _result(str(tmp_path / "a"))
    assert got[0]["resumed_from"] == 5
    _assert_same(ref, got, exact=False, atol=DDP_TOL)

    rc, out = _child_run({**base, "run_dir": str(tmp_path / "b"), "out": str(tmp_path / "y"), "kill_at_attempt": 6})
    assert rc == -9, out  # SIGKILL in step 7, after the checkpoint of step 6
    again = _launch2({**base, "distributed": "ddp", "run_dir": str(tmp_path / "b"), "out": str(tmp_path / "b")})
    assert [rc for rc, _ in again] == [0, 0], again
    got = _result(str(tmp_path / "b"))
    assert got[0]["resumed_from"] == 6
    _assert_same(ref, got, exact=False, atol=DDP_TOL)


# ---------------------------------------------------------------------------
# Eval and pairs: shared out by whole batches, the same bytes as one process

def _copy_with_nproc(src: Path, dst: Path, nproc: int, **sections: dict) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    p = yaml.safe_load((dst / "params.yaml").read_text())
    p["common"].update(nproc=nproc, num_threads=1)
    for name, over in sections.items():
        p[name].update(over)
    (dst / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    return dst


def _stage(ws: Path, stage: str, item: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*dvc_command(stage, item), "--no-progress"], cwd=ws, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_eval_on_two_processes_writes_the_bytes_of_one(tmp_path, world):
    runs = {}
    for n in (1, 2):
        # batches of 2: every sampling loop (pass@k, KL) spans several batches, shared out over the ranks
        ws = _copy_with_nproc(world["root"], tmp_path / f"n{n}", n, eval={"batch_size": 2})
        r = _stage(ws, "eval", "ppo")
        assert r.returncode == 0, r.stdout + r.stderr
        runs[n] = ws
    assert "2 processes on this machine" in r.stdout
    one, two = (runs[n] / "metrics/eval/ppo.json" for n in (1, 2))
    assert one.read_bytes() == two.read_bytes()
    one, two = (runs[n] / "metrics/eval/ppo_samples.json" for n in (1, 2))
    assert one.read_bytes() == two.read_bytes() and json.loads(one.read_text())["sample_prompts"]


@pytest.mark.slow
def test_samples_and_pairs_on_two_processes_write_the_bytes_of_one(tmp_path):
    from tests.test_reward import make_workspace
    src = make_workspace(tmp_path / "src", reward_model=True)
    runs = {}
    for n in (1, 2):
        ws = _copy_with_nproc(src, tmp_path / f"n{n}", n)
        for stage in ("samples", "pairs"):
            r = _stage(ws, stage)
            assert r.returncode == 0, r.stdout + r.stderr
        runs[n] = ws
    for f in ("data/samples/samples.jsonl", "data/samples/train.jsonl", "data/samples/val.jsonl",
              "data/pairs/train.jsonl", "data/pairs/val.jsonl", "metrics/plots/pairs.tsv"):
        assert (runs[1] / f).read_bytes() == (runs[2] / f).read_bytes(), f
    timing = ("generate_time_s", "generate_tokens_per_s", "score_time_s", "stage_time_s")
    for stage in ("samples", "pairs"):
        m1, m2 = (json.loads((runs[n] / f"metrics/{stage}.json").read_text()) for n in (1, 2))
        assert {k: v for k, v in m1.items() if k not in timing} == {k: v for k, v in m2.items() if k not in timing}
        assert m1["responses" if stage == "samples" else "pairs"] > 0


# ---------------------------------------------------------------------------
# FSDP2 in every supervised stage

def _curve(ws: Path, stage: str) -> list[dict]:
    lines = (ws / f"metrics/plots/{stage}.tsv").read_text().splitlines()
    head = lines[0].split("\t")
    return [dict(zip(head, map(float, ln.split("\t")))) for ln in lines[1:]]


def _fsdp_workspace(root: Path, stage: str) -> Path:
    """tests/test_reward.py's workspace, with what `stage` reads: SFT data (sft), pairs (dpo)."""
    from tests.test_dpo import _pairs_workspace
    from tests.test_reward import _write_jsonl, params, tcfg
    ws = _pairs_workspace(root)
    if stage == "sft":
        shutil.copytree(ws / "models/sft", ws / "models/base")
        convs = [json.loads(x) for x in (ws / "data/clean_sft/train.jsonl").read_text().splitlines()]
        _write_jsonl(ws / "data/clean_sft/val.jsonl", convs[:8])
        rl = [json.loads(x) for x in (ws / "data/prepared/rl/train.jsonl").read_text().splitlines()]
        _write_jsonl(ws / "data/prepared/rl/val.jsonl", rl[:4])
    p = params()
    # the task kinds have about 6 conversations each here: below 8 they are repeated (both sides)
    p["sft"] = {**tcfg(), "bucket_width": 16, "eval_math_problems": 4, "max_new_tokens": 8, "min_source_examples": 8,
                "replay_fraction": 0.0, "average_last": 2}
    p["dpo"]["trainable"] = ["norm_f.weight", "blocks.1.*"]  # FSDP with frozen parameters
    p[stage].update(grad_accum=2, distributed="fsdp")
    (ws / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    return ws


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "reward", "dpo"])
def test_fsdp_on_two_processes_trains_as_one_process(tmp_path, stage):
    """`<stage>.distributed: fsdp` with common.nproc 2 (parameters, gradients and AdamW moments
    sharded; DPO's frozen reference is never wrapped): the losses and the model of one process.
    SFT writes the mean of its last two checkpoints, which rank 0 reads back alone."""
    from llm.nn.artifacts import load_model_dir
    src = _fsdp_workspace(tmp_path / "src", stage)
    runs = {}
    for n in (1, 2):
        ws = _copy_with_nproc(src, tmp_path / f"n{n}", n)
        r = _stage(ws, stage)
        assert r.returncode == 0, r.stdout + r.stderr
        runs[n] = ws
    assert "2 processes on this machine" in r.stdout
    if stage == "sft":
        assert "repeated 2x (fewer than min_source_examples=8)" in r.stdout, r.stdout
        m = json.loads((runs[2] / "metrics/sft.json").read_text())
        assert m["sources_upsampled"] > 0 and m["train_conversations"] > m["train_records"] == 50
        assert "the model is the mean of the weights at steps 2, 4" in r.stdout, r.stdout
        assert m["val_loss"] != m["val_loss_last"]
    one, two = _curve(runs[1], stage), _curve(runs[2], stage)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["weight"] == b["weight"]
    m1, _, _ = load_model_dir(runs[1] / f"models/{stage}")
    m2, _, _ = load_model_dir(runs[2] / f"models/{stage}")
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert max(float((s1[k] - s2[k]).abs().max()) for k in s1) < 1e-5


# ---------------------------------------------------------------------------
# The launcher: its checks, its errors, two machines

def _tiny_params(path: Path, **common) -> Path:
    from tests.conftest import common_params
    report = yaml.safe_load((ROOT / "params.yaml").read_text())["report"]  # the section tests/tiny_stage.py reads
    path.write_text(yaml.safe_dump({"common": common_params(**common), "report": report}))
    return path


def _tiny(tmp_path: Path, *args: str, **common) -> tuple[subprocess.CompletedProcess, float]:
    params = _tiny_params(tmp_path / "params.yaml", **common)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tests.tiny_stage", "--params", str(params), *args], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    return r, time.monotonic() - t0


@pytest.mark.slow
def test_a_failing_rank_stops_the_others_and_the_stage_exits_with_its_message(tmp_path):
    ok, _ = _tiny(tmp_path, nproc=2)
    assert ok.returncode == 0 and "tiny: 2 processes" in ok.stdout, ok.stdout + ok.stderr
    r, took = _tiny(tmp_path, "--fail-rank", "1", nproc=2)
    assert r.returncode == 1 and took < 120, (took, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tiny: rank 1 of 2 failed: rank 1 could not read its share (a stage error"), last
    r, took = _tiny(tmp_path, "--kill-rank", "0", nproc=2)
    assert r.returncode == 1 and took < 120, (took, r.stderr)
    assert "tiny: rank 0 of 2 failed: killed by SIGKILL" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    r, took = _tiny(tmp_path, "--bug-rank", "1", nproc=2)
    assert r.returncode == 1 and "Traceback" in r.stderr  # a bug keeps its traceback
    assert "tiny: rank 1 of 2 failed: RuntimeError: a bug, on purpose" in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_rendezvous_that_never_completes_names_the_endpoint_within_its_timeout(tmp_path):
    # the second machine never joins. Tests send traffic to this machine's loopback only, so the
    # endpoint is 127.0.0.1: this launcher hosts the rendezvous there and waits rdzv_timeout for
    # the other one, the wait a user meets whether the head cannot be reached or a peer is missing
    endpoint = f"127.0.0.1:{free_port()}"
    r, took = _tiny(tmp_path, nnodes=2, nproc=1, rdzv_endpoint=endpoint, rdzv_timeout=5)
    assert r.returncode == 1 and took < 90, (took, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tiny: the rendezvous at {endpoint} (common.rdzv_endpoint") and "rdzv_timeout=5" in last


def test_more_processes_than_gpus_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    from tests import tiny_stage
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("llm.stage.launch", lambda *a: pytest.fail("launched"))
    params = _tiny_params(tmp_path / "params.yaml", nproc=2, device="auto")
    assert tiny_stage.main(["--params", str(params)]) == 1
    err = capsys.readouterr().err
    assert "common.nproc: 2 processes per machine, one per GPU, but this machine has 1 GPU(s)" in err


def test_work_that_does_not_share_out_over_the_processes_is_refused_by_key(tmp_path, monkeypatch, capsys):
    import stages.grpo
    import stages.pretrain
    monkeypatch.setattr("llm.stage.launch", lambda *a: pytest.fail("launched"))
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["common"].update(nproc=2, nnodes=2, rdzv_endpoint="node0:29400", device="cpu")
    p["pretrain"]["grad_accum"] = 2
    p["grpo"].update(prompts_per_step=6, oversample=1)  # 6 groups a step for 4 processes
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    paths = [f"--{k.replace('_', '-')}=x" for k in (*stages.pretrain.INPUTS, *stages.pretrain.OUTPUTS)]
    assert stages.pretrain.main(["--params", str(tmp_path / "params.yaml"), *paths]) == 1
    err = capsys.readouterr().err
    assert "pretrain.grad_accum: 2 micro-batches per optimizer step cannot be shared equally by 4 processes" in err
    paths = [f"--{k.replace('_', '-')}=x" for k in (*stages.grpo.INPUTS, *stages.grpo.OUTPUTS)]
    assert stages.grpo.main(["--params", str(tmp_path / "params.yaml"), *paths]) == 1
    assert "grpo.prompts_per_step: 6 prompts (groups) per step cannot be shared equally by 4" in capsys.readouterr().err


def test_several_machines_need_an_endpoint():
    with pytest.raises(ConfigError, match="common.rdzv_endpoint: nnodes=2 needs host:port"):
        from llm.config import params_from_dict
        p = yaml.safe_load((ROOT / "params.yaml").read_text())
        p["common"].update(nnodes=2, rdzv_endpoint="node0")
        params_from_dict(p)


def test_join_runs_the_command_dvc_yaml_gives_the_stage(tmp_path):
    from llm.stage import join_command
    assert join_command("pretrain", ROOT / "dvc.yaml")[:3] == ["stages.pretrain", "--tokens", "data/tokens"]
    got = join_command("eval@sft", ROOT / "dvc.yaml")
    assert got[:2] == ["stages.eval", "sft"] and "metrics/eval/sft.json" in got
    with pytest.raises(ConfigError, match="eval@base"):
        join_command("eval", ROOT / "dvc.yaml")
    with pytest.raises(ConfigError, match="no stage 'pretrian'"):
        join_command("pretrian", ROOT / "dvc.yaml")


@pytest.mark.slow
def test_two_machines_of_one_process_give_the_losses_of_two_processes_on_one(tmp_path):
    """Two "machines" on this one (two launchers meeting at a localhost rendezvous, one process
    each, `dvc repro`'s command on one and `python -m llm.stage join pretrain` on the other):
    the losses of common.nproc 2 on one machine."""
    from tests.test_trainer import _stage_project
    one = tmp_path / "one"
    one.mkdir()
    _stage_project(one, nproc=2)
    r = _stage(one, "pretrain")
    assert r.returncode == 0, r.stdout + r.stderr

    two = tmp_path / "two"
    two.mkdir()
    _stage_project(two, nproc=1)
    p = yaml.safe_load((two / "params.yaml").read_text())
    p["common"].update(nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="test-two", rdzv_timeout=120)
    (two / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    shutil.copy(ROOT / "dvc.yaml", two / "dvc.yaml")
    head = subprocess.Popen([*dvc_command("pretrain"), "--no-progress"], cwd=two, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-m", "llm.stage", "join", "pretrain"], cwd=two, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (h_out, h_err), (o_out, o_err) = head.communicate(timeout=600), other.communicate(timeout=600)
    assert head.returncode == 0 and other.returncode == 0, h_out + h_err + o_out + o_err
    assert "1 processes on each of 2 machines" in h_out + o_out and "join: pretrain: python -m stages.pretrain" in o_out
    a, b = _curve(one, "pretrain"), _curve(two, "pretrain")
    assert len(a) == len(b) == 20
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5) and x["tokens_seen"] == y["tokens_seen"]
    assert read_metrics(two / "metrics/pretrain.json")["world_size"] == 2


def test_the_rendezvous_may_name_its_host_by_an_environment_variable(monkeypatch):
    """A batch job learns its head machine only when it starts: `${VAR}:port` is read then, so
    params.yaml (and DVC's view of it) stays the same from job to job."""
    from llm.stage import torchrun_args
    common = CommonConfig(seed=0, device="cpu", dtype="auto", nproc=2, num_threads=1, cpu_kernels=True, nnodes=2,
                          rdzv_endpoint="${LLM_TEST_HEAD}:29400", rdzv_id="$LLM_TEST_JOB")
    monkeypatch.delenv("LLM_TEST_HEAD", raising=False)
    monkeypatch.setenv("LLM_TEST_JOB", "job-7")
    with pytest.raises(ConfigError, match=r"common.rdzv_endpoint: '\$\{LLM_TEST_HEAD\}:29400' names an environment"):
        torchrun_args(common, "stages.pretrain", [])
    monkeypatch.setenv("LLM_TEST_HEAD", "node17")
    args = torchrun_args(common, "stages.pretrain", ["--x"])
    assert "--rdzv-endpoint=node17:29400" in args and "--rdzv-id=job-7" in args
    assert args[-3:] == ["-m", "stages.pretrain", "--x"]


def test_a_sampled_batch_does_not_depend_on_the_batches_before_it(world):
    """What lets eval share its batches out: batch b samples from its own generator, seeded by
    (seed, b), whatever ran before it (a generator shared by the batches would hand batch 1
    whatever batch 0 left of its stream)."""
    from llm.data.batching import derive_seed
    from llm.data.template import user_prompt
    from llm.eval.evaluate import generate_answers
    from llm.sample.generate import generate
    tok, model = world["tok"], world["base"]  # the barely trained model: its samples vary with the draws
    qs = sorted((p["question"] for p in world["test"]), key=lambda q: len(user_prompt(q, tok)))
    first, last = qs[:2], qs[-2:]
    got, _ = generate_answers(model, tok, first + last, max_new_tokens=12, batch_size=2, temperature=1.0, seed=11)
    alone = generate(model, [user_prompt(q, tok) for q in last], 12, temperature=1.0, pad_id=tok.pad_id,
                     stop_ids=(tok.special["<|end|>"], tok.special["<|endoftext|>"]),
                     generator=torch.Generator().manual_seed(derive_seed(11, "batch", 1)))
    assert got[2:] == [tok.decode(r) for r in alone.responses()]
    again, _ = generate_answers(model, tok, first + last, max_new_tokens=12, batch_size=2, temperature=1.0, seed=12)
    assert again[2:] != got[2:]  # another seed, other samples: the equality above is not vacuous


def shared_child(arg: str) -> None:
    """Rank r starts in opt["dirs"][r] and sets up its runtime as one of several machines."""
    from llm.runtime import setup_runtime
    opt = json.loads(arg)
    os.chdir(opt["dirs"][int(os.environ["RANK"])])
    try:
        rt = setup_runtime(CommonConfig(seed=0, device="cpu", dtype="auto", nproc=1, num_threads=1,
                                        cpu_kernels=True, nnodes=2, rdzv_endpoint="127.0.0.1:1"))
    except ConfigError as e:  # setup_runtime has torn the process group down
        print(e)
        sys.exit(1)
    rt.close()


@pytest.mark.slow
def test_machines_that_do_not_share_the_directory_are_named_by_every_rank(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    same = _ranks("shared_child", {"dirs": [str(tmp_path / "a")] * 2}, world=2, machines=2)
    assert [rc for rc, _ in same] == [0, 0], same
    apart = _ranks("shared_child", {"dirs": [str(tmp_path / "a"), str(tmp_path / "b")]}, world=2, machines=2)
    assert [rc for rc, _ in apart] == [1, 1], apart  # both ranks stop: neither waits for the other
    assert all("rank 1 on " in out and "cannot see the file rank 0 wrote" in out for _, out in apart)
    assert not list((tmp_path / "a").iterdir())  # the probe is gone


def test_the_failure_reported_is_the_cause_not_its_consequences():
    """A rank that fails takes the others down with it (broken connections, the launcher's
    SIGTERM); the line names the one that started it."""
    from types import SimpleNamespace as F

    from llm.stage import failure_line

    def f(exitcode, message="", t=0.0, **extra):
        data = {"message": message, "time": t, **extra} if message else {"message": "<NONE>"}
        return F(exitcode=exitcode, message=message, timestamp=int(t), error_file_data=data,
                 signal_name=lambda: {-9: "SIGKILL", -15: "SIGTERM"}[exitcode])

    peer = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    bug = f(1, "RuntimeError: a bug", t=2.0)
    assert failure_line("s", {0: f(1, peer, t=1.0), 1: bug}, 2).startswith("s: rank 1 of 2 failed: RuntimeError: a bug")
    assert "rank 1 of 2 failed: RuntimeError: a bug" in failure_line("s", {0: f(-15), 1: bug}, 2)
    assert "rank 0 of 2 failed: killed by SIGKILL" in failure_line("s", {0: f(-9), 1: f(1, peer, t=0.5)}, 2)
    stage = f(1, "s: rank 2 could not read x", t=5.0, stage_error=True)
    line = failure_line("s", {0: f(-15), 1: bug, 2: stage}, 3)
    assert line == "s: rank 2 of 3 failed: rank 2 could not read x; rank(s) 0, 1 stopped with it"
    # the failing rank left its message, then the launcher's SIGTERM caught it still shutting down
    # while the peer it left had already exited (as a loaded machine makes likely): the message wins
    late = f(-15, "s: rank 1 could not read x", t=1.0, stage_error=True)
    line = failure_line("s", {0: f(1, "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:1", t=1.1), 1: late}, 2)
    assert line == "s: rank 1 of 2 failed: rank 1 could not read x; rank(s) 0 stopped with it"
    late_bug = f(-15, "RuntimeError: a bug", t=2.0)
    assert "rank 1 of 2 failed: RuntimeError: a bug" in failure_line("s", {0: f(1, peer, t=3.0), 1: late_bug}, 2)
