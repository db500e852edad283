"""Several runs read together (llm/eval/seeds.py): the t quantile, the pooled paired change, the
levels, the stage metrics, and runs read from directories, git revisions and DVC experiment refs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llm.eval.paired import compare, mcnemar_exact
from llm.eval.seeds import Run, levels, load_run, main, markdown, pooled, stage_metrics, summarize, t_quantile


@pytest.mark.parametrize("df,q", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (1000, 1.9623)])
def test_t_quantile_matches_the_tables(df, q):
    assert t_quantile(0.975, df) == pytest.approx(q, abs=2e-4)


def test_t_quantile_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for p, df in [(0.95, 3), (0.995, 2), (0.9, 7)]:
        assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), abs=1e-4)


def _items(math: list[int], rm: list[float] | None = None) -> list[dict]:
    out = [{"set": "math", "id": f"math-test-{i}", "lang": "en", "level": 1, "correct": bool(c), "formatted": True}
           for i, c in enumerate(math)]
    return out + [{"set": "rm", "id": f"math-test-{i}", "score": s} for i, s in enumerate(rm or [])]


def _run(name: str, parent: list[int], child: list[int], rm_parent=None, rm_child=None, **metrics) -> Run:
    return Run(name, {"sft": _items(parent, rm_parent), "grpo": _items(child, rm_child)}, metrics)


def _outcomes(n: int, wins: int, losses: int, seed: int) -> tuple[list[int], list[int]]:
    """Parent and child right/wrong on n items: `wins` only the child gets right, `losses` only the parent."""
    rng = np.random.default_rng(seed)
    parent = [int(x) for x in rng.random(n) < 0.7]
    right, wrong = [i for i in range(n) if parent[i]], [i for i in range(n) if not parent[i]]
    child = list(parent)
    for i in wrong[:wins]:
        child[i] = 1
    for i in right[:losses]:
        child[i] = 0
    return parent, child


def test_the_pooled_change_is_the_mean_of_the_runs_and_its_test_pools_their_discordant_items():
    # the same item ids in both runs: they are different problems and must not be paired across runs
    a = _run("a", *_outcomes(200, 6, 1, seed=0))
    b = _run("b", *_outcomes(200, 5, 3, seed=1))
    r = pooled([a, b], "grpo", "sft", n_boot=4000, seed=0)["math"]
    assert r["deltas"] == pytest.approx([5 / 200, 2 / 200])
    assert r["mean"] == pytest.approx((5 / 200 + 2 / 200) / 2) and r["worst"] == pytest.approx(2 / 200)
    assert (r["wins"], r["losses"]) == (11, 4) and r["p_value"] == pytest.approx(mcnemar_exact(11, 4))
    assert r["up"] == 2 and r["lo"] < r["mean"] < r["hi"]
    # the across-run interval: mean +- t(1) sd / sqrt(2), by hand
    d = np.array([5 / 200, 2 / 200])
    half = 12.7062 * d.std(ddof=1) / np.sqrt(2)
    assert (r["t_lo"], r["t_hi"]) == pytest.approx((d.mean() - half, d.mean() + half), abs=1e-5)


def test_one_run_pooled_is_that_runs_paired_comparison():
    run = _run("a", *_outcomes(300, 20, 6, seed=2))
    r = pooled([run], "grpo", "sft", n_boot=20000, seed=0)["math"]
    c = compare(run.items["grpo"], run.items["sft"], n_boot=20000, seed=5)["math"]
    assert r["mean"] == c["delta"] and r["p_value"] == c["p_value"] and r["t_lo"] is None
    assert (r["lo"], r["hi"]) == pytest.approx((c["lo"], c["hi"]), abs=0.004)  # two bootstraps of one law


def test_a_gain_too_small_for_each_run_can_be_significant_over_several():
    runs = [_run(str(s), *_outcomes(500, 9, 3, seed=s)) for s in range(3)]
    per_run = [compare(r.items["grpo"], r.items["sft"], n_boot=4000, seed=0)["math"] for r in runs]
    assert not any(p["significant"] for p in per_run)
    r = pooled(runs, "grpo", "sft", n_boot=4000, seed=0)["math"]
    assert r["pooled_significant"] and r["lo"] > 0 and r["p_value"] < 0.05 and r["up"] == 3


def test_scores_pool_the_mean_differences():
    a = _run("a", [1, 0], [1, 0], rm_parent=[0.0, 1.0], rm_child=[0.5, 1.5])
    b = _run("b", [1, 0], [1, 0], rm_parent=[2.0, 2.0], rm_child=[1.0, 2.0])
    r = pooled([a, b], "grpo", "sft", n_boot=2000, seed=0)["rm_score"]
    assert r["deltas"] == pytest.approx([0.5, -0.5]) and r["mean"] == pytest.approx(0.0)
    assert "p_value" not in r and r["lo"] <= 0 <= r["hi"] and r["up"] == 1


def test_levels_give_each_runs_score_the_mean_and_the_worst():
    runs = [_run("a", [1, 1, 0, 0], [1, 1, 1, 0]), _run("b", [1, 0, 0, 0], [1, 1, 1, 1])]
    lv = levels(runs, "grpo")["math"]
    assert lv["values"] == [0.75, 1.0] and lv["mean"] == 0.875 and lv["worst"] == 0.75


def test_stage_metrics_read_nested_keys_and_name_what_is_missing():
    runs = [_run("a", [1], [1], **{"dpo.json": {"rewards_accuracy": 0.8, "by_kind": {"math": {"n": 3}}}}),
            _run("b", [1], [1], **{"dpo.json": {"rewards_accuracy": 0.7, "by_kind": {"math": {"n": 5}}}})]
    m = stage_metrics(runs, ("dpo.json:rewards_accuracy", "dpo.json:by_kind.math.n"), required=True)
    assert m["dpo.json:rewards_accuracy"]["values"] == [0.8, 0.7]
    assert m["dpo.json:by_kind.math.n"] == {"values": [3.0, 5.0], "mean": 4.0, "min": 3.0, "max": 5.0}
    with pytest.raises(ValueError, match=r"b: metrics/ppo.json: no such file"):
        stage_metrics([Run("b", {}, {})], ("ppo.json:final_kl",), required=True)
    assert stage_metrics(runs, ("ppo.json:final_kl",), required=False) == {}
    with pytest.raises(ValueError, match="expected FILE:KEY"):
        stage_metrics(runs, ("dpo.json",), required=True)


def _write_run(root, parent, child, dpo_acc):
    ev = root / "metrics" / "eval"
    ev.mkdir(parents=True)
    for name, outcomes in (("sft", parent), ("grpo", child)):
        (ev / f"{name}_items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _items(outcomes)))
    (root / "metrics" / "dpo.json").write_text(json.dumps({"rewards_accuracy": dpo_acc}))
    (ev / "grpo.json").write_text(json.dumps({"kl": 0.001}))


def test_runs_from_directories_labels_and_the_command_line(tmp_path, capsys):
    _write_run(tmp_path / "r1", *_outcomes(100, 4, 1, seed=0), 0.8)
    _write_run(tmp_path / "r2", *_outcomes(100, 3, 2, seed=1), 0.9)
    # the repository root, its metrics/ and its metrics/eval/ are the same run (the last without metrics)
    for spec in (tmp_path / "r1", tmp_path / "r1" / "metrics"):
        run = load_run(str(spec))
        assert sorted(run.items) == ["grpo", "sft"]
        assert run.metrics == {"dpo.json": {"rewards_accuracy": 0.8}, "eval/grpo.json": {"kl": 0.001}}
    assert load_run(str(tmp_path / "r1" / "metrics" / "eval")).metrics == {}
    assert load_run(f"one={tmp_path / 'r1'}").name == "one"
    out_json, out_md = tmp_path / "s.json", tmp_path / "s.md"
    assert main([f"a={tmp_path / 'r1'}", f"b={tmp_path / 'r2'}", "--n-boot", "500", "--json", str(out_json),
                 "--markdown", str(out_md)]) == 0
    s = json.loads(out_json.read_text())
    assert s["runs"] == ["a", "b"] and s["paired"]["grpo"]["math"]["deltas"] == pytest.approx([0.03, 0.01])
    assert "| grpo | math | +3.0 | +1.0 | +2.0 |" in out_md.read_text()
    assert set(s["metrics"]) == {"dpo.json:rewards_accuracy", "eval/grpo.json:kl"}
    assert capsys.readouterr().out.startswith("Runs: a, b.")


def test_a_bad_run_is_named_and_exits_2(tmp_path, capsys):
    _write_run(tmp_path / "r1", [1, 0], [1, 1], 0.8)
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "r1"), str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "empty" in err and "no metrics/eval/<model>_items.jsonl" in err
    (tmp_path / "r2" / "metrics" / "eval").mkdir(parents=True)
    (tmp_path / "r2" / "metrics" / "eval" / "sft_items.jsonl").write_text(json.dumps(_items([1])[0]) + "\n")
    assert main([str(tmp_path / "r1"), f"two={tmp_path / 'r2'}"]) == 2
    assert "two: no grpo_items.jsonl (it has sft)" in capsys.readouterr().err
    assert main([str(tmp_path / "r1"), "--metric", "ppo.json:final_kl"]) == 2
    assert "metrics/ppo.json: no such file" in capsys.readouterr().err


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_runs_from_a_git_revision_and_a_dvc_experiment_ref(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t")
    _git(repo, "config", "user.name", "t")
    _write_run(repo, *_outcomes(100, 4, 1, seed=0), 0.8)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "run")
    # a DVC experiment is a commit kept under refs/exps/<2 hex>/<baseline sha>/<name>
    _git(repo, "update-ref", "refs/exps/ab/cdef0123/seed-1338", "HEAD")
    monkeypatch.chdir(repo)
    here = load_run(".")
    for spec in ("rev:HEAD", "exp:seed-1338"):
        run = load_run(spec)
        assert run.items == here.items and run.metrics == here.metrics and run.name == spec
        assert set(run.metrics) == {"dpo.json", "eval/grpo.json"}
    with pytest.raises(ValueError, match=r"'seed-9' is no DVC experiment.*known here: seed-1338"):
        load_run("exp:seed-9")
    with pytest.raises(ValueError, match="rev:nope"):
        load_run("rev:nope")


def test_summarize_skips_base_and_needs_the_parent():
    runs = [Run("a", {"base": _items([0, 0]), "sft": _items([1, 0]), "grpo": _items([1, 1])}, {})]
    s = summarize(runs, n_boot=200)
    assert list(s["paired"]) == ["grpo"] and set(s["levels"]) == {"base", "sft", "grpo"} and s["metrics"] == {}
    with pytest.raises(ValueError, match="the parent 'ppo' is not evaluated"):
        summarize(runs, "ppo", n_boot=200)


@pytest.mark.slow
def test_an_experiments_stage_metrics_come_from_the_dvc_cache(tmp_path, monkeypatch):
    """metrics/<stage>.json is a DVC output, not in git: an exp: run reads it from the cache."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text("x: 1\n")
    (repo / "make.py").write_text(
        "import json, os, yaml\n"
        "x = yaml.safe_load(open('params.yaml'))['x']\n"
        "os.makedirs('metrics/eval', exist_ok=True)\n"
        "for m, k in (('sft', 0), ('grpo', x)):\n"
        "    with open(f'metrics/eval/{m}_items.jsonl', 'w') as f:\n"
        "        f.writelines(json.dumps({'set': 'math', 'id': f'm{i}', 'correct': i < 10 + k, 'formatted': True})"
        " + '\\n' for i in range(20))\n"
        "json.dump({'accuracy': 0.9 + x / 100}, open('metrics/reward.json', 'w'))\n")
    (repo / "dvc.yaml").write_text(
        "stages:\n  make:\n    cmd: python make.py\n    deps: [make.py]\n    params: [x]\n    outs:\n"
        "      - metrics/eval/sft_items.jsonl:\n          cache: false\n"
        "      - metrics/eval/grpo_items.jsonl:\n          cache: false\n"
        "    metrics:\n      - metrics/reward.json\n")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@t"], ["git", "config", "user.name", "t"],
                ["dvc", "init", "-q"], ["dvc", "repro", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "base"],
                ["dvc", "exp", "run", "-q", "-n", "two", "-S", "x=2"]):
        r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
    monkeypatch.chdir(repo)
    s = summarize([load_run("base=rev:HEAD"), load_run("exp:two")], n_boot=200, metrics=("reward.json:accuracy",))
    assert s["metrics"]["reward.json:accuracy"]["values"] == pytest.approx([0.91, 0.92])
    assert s["paired"]["grpo"]["math"]["deltas"] == pytest.approx([0.05, 0.10])


def test_a_stage_metric_one_run_lacks_is_named_not_shown():
    items = {"sft": _items([1, 0]), "grpo": _items([1, 1])}
    runs = [Run("a", items, {"reward.json": {"accuracy": 0.9}}), Run("b", items, {})]
    s = summarize(runs, n_boot=200)
    assert s["metrics"] == {} and s["metrics_left_out"] == {"reward.json:accuracy": ["b"]}
    assert "reward.json:accuracy (b)" in "\n".join(markdown(s))


def test_whether_the_rm_follows_correctness_is_given_per_run():
    # sft: the RM orders both runs' answers perfectly; grpo: run a perfectly, run b backwards
    a = _run("a", [1, 1, 0, 0], [1, 1, 0, 0], rm_parent=[2.0, 3.0, 0.0, 1.0], rm_child=[2.0, 3.0, 0.0, 1.0])
    b = _run("b", [1, 0, 1, 0], [1, 0, 1, 0], rm_parent=[5.0, 1.0, 4.0, 0.0], rm_child=[0.0, 4.0, 1.0, 5.0])
    s = summarize([a, b], n_boot=300)
    sep = s["rm_separation"]
    assert sep["sft"]["values"] == [1.0, 1.0] and sep["grpo"]["values"] == [1.0, 0.0]
    assert sep["grpo"]["mean"] == 0.5 and sep["grpo"]["worst"] == 0.0
    assert sep["grpo"]["lo"] == sep["grpo"]["hi"] == [1.0, 0.0]  # a perfect order survives every resample
    md = "\n".join(markdown(s))
    assert "| grpo | 1.000 [1.000, 1.000] | 0.000 [0.000, 0.000] | 0.500 | 0.000 |" in md
    # a run with no wrong answer among the scored ones: the model has no row
    c = _run("c", [1, 1, 1, 1], [1, 1, 1, 1], rm_parent=[1.0] * 4, rm_child=[1.0] * 4)
    assert summarize([a, c], n_boot=300)["rm_separation"] == {}


def test_the_rl_stages_held_out_reward_change_is_pooled_from_the_run_files(tmp_path):
    items = {"sft": _items([1, 0]), "grpo": _items([1, 1])}
    start = [0.0, 1.0, 1.2, 0.2] * 25
    a = Run("a", items, {"run/ppo.json": {"heldout_rewards_start": start,
                                          "heldout_rewards_end": [x + 0.1 for x in start]}})
    b = Run("b", items, {"run/ppo.json": {"heldout_rewards_start": start,
                                          "heldout_rewards_end": start[:96] + [1.2] * 4}})
    s = summarize([a, b], n_boot=500)
    ppo = s["heldout_reward"]["ppo"]
    assert ppo["deltas"] == pytest.approx([0.1, (1.2 + 0.2 + 1.0) / 100]) and ppo["changed"] == [100, 3]
    assert ppo["mean"] == pytest.approx((0.1 + 0.024) / 2) and ppo["lo"] < ppo["mean"] < ppo["hi"]
    assert "grpo" not in s["heldout_reward"]  # no run file for it
    assert "| ppo | +0.1000 | +0.0240 | +0.0620 |" in "\n".join(markdown(s))
    # a run without the lists: no row
    assert summarize([a, Run("c", items, {"run/ppo.json": {"steps": 60}})], n_boot=200)["heldout_reward"] == {}
    # a directory run reads metrics/run/*.json
    _write_run(tmp_path / "r", [1, 0], [1, 1], 0.8)
    (tmp_path / "r/metrics/run").mkdir()
    (tmp_path / "r/metrics/run/ppo.json").write_text(json.dumps({"heldout_rewards_start": [0.0],
                                                                 "heldout_rewards_end": [1.0]}))
    assert load_run(str(tmp_path / "r")).metrics["run/ppo.json"]["heldout_rewards_end"] == [1.0]


def test_runs_that_evaluated_different_models_are_read_on_the_models_named():
    """A seed whose GRPO stages have not run beside one that has them: refused as they are, read
    on --models (the parent always kept), which the summary records; the command line takes it."""
    a = Run("a", {"sft": _items([1, 0, 1, 0]), "ppo": _items([1, 1, 1, 0]), "grpo": _items([1, 1, 1, 1])}, {})
    b = Run("b", {"sft": _items([1, 1, 0, 0]), "ppo": _items([1, 1, 1, 0])}, {})
    with pytest.raises(ValueError, match="a: .*no grpo_items.jsonl|b: no grpo_items.jsonl.*--models"):
        summarize([a, b], n_boot=200)
    s = summarize([a, b], n_boot=200, models=("ppo",))
    assert s["models"] == ["sft", "ppo"] and set(s["levels"]) == {"sft", "ppo"} and set(s["paired"]) == {"ppo"}
    assert "models" not in summarize([b, b], n_boot=200)
