"""llm/eval/readme.py and the README: every number a run wrote (tables, findings, the experiment, which run
and machine, how long it took) is generated from the committed metrics, a run of one's own replaces
all of them, and the README stays a front door (short, narrow tables, the two commands as CI runs them)."""
from __future__ import annotations

import json
import re
import shutil
import zlib

import pytest

from llm.eval import readme
from tests.conftest import ROOT

README = ROOT / "README.md"


def test_the_readme_numbers_are_the_committed_metrics():
    text = README.read_text(encoding="utf-8")
    assert all(readme.markers(name)[0] in text for name in readme.BLOCKS)
    assert readme.render(text, ROOT / "metrics") == text, (
        "README.md's generated blocks differ from metrics/: run `python -m llm.readme` and commit README.md")


def _fake(value, path: str):
    """Every measured number moved by 5 to 35 points, by an amount that depends on its place in the
    file (so that differences and ratios of two numbers move too); counts, the confidence level
    and the labels stay."""
    if isinstance(value, dict):
        return {k: v if k == "confidence" else _fake(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_fake(v, path) for v in value]
    return value + 0.05 + 0.3 * (zlib.crc32(path.encode()) % 1000) / 1000 if isinstance(value, float) else value


def _fake_run(tmp_path):
    """A copy of metrics/ as another run would leave it: every eval, paired and seeds number moved, the
    seeds' first run this one (as after `python -m llm.seeds`), another report header."""
    dst, src = tmp_path / "metrics", ROOT / "metrics"
    (dst / "eval").mkdir(parents=True)
    (dst / "seeds").mkdir()
    read = lambda path: json.loads(path.read_text(encoding="utf-8"))  # noqa: E731
    evals = {f.stem: _fake(read(f), f.name) for f in (src / "eval").glob("*[a-z].json") if "_samples" not in f.name}
    committed = read(src / "seeds" / "summary.json")
    summary = _fake(committed, "summary")
    # the fake seeds hold the fake run exactly when the committed seeds hold the committed run, so
    # the README shows the same blocks (with or without the seeds tables) before and after
    if all(levels["math"]["values"][0] == read(src / "eval" / f"{model}.json")["math_exact_match"]
           for model, levels in committed["levels"].items()):
        for model, levels in summary["levels"].items():
            levels["math"]["values"][0] = evals[model]["math_exact_match"]
    files = {f"eval/{m}.json": e for m, e in evals.items()} | {
        "paired.json": _fake(read(src / "paired.json"), "paired"), "seeds/summary.json": summary}

    for name, content in files.items():
        (dst / name).write_text(json.dumps(content), encoding="utf-8")
    (dst / "report.md").write_text("# Report card\n\n- **commit**: 0123456789ab\n- **date**: 2031-07-19 10:10 UTC\n"
                                   "- **machine**: Intel Xeon, 64 logical cores\n- **wall time**: 13.7 min in all, as"
                                   " the stages recorded it\n\n## Summary\n", encoding="utf-8")
    return dst


NUMBER = re.compile(r"[+-]?\d+\.\d+%?|\d+%")  # a measured figure; counts and labels are whole numbers
FIXED = re.compile(r"at (?:most|least) \S+|within [\d.]+-[\d.]+|95% interval|\(95%\)")  # the targets' thresholds, the confidence level


def _generated(text: str) -> list[list[str]]:
    """Each generated block's measured figures, in order, with the commit and date."""
    out = []
    for name in readme.BLOCKS:
        begin, end = readme.markers(name)
        body = text.split(begin)[1].split(end)[0]
        out.append(NUMBER.findall(FIXED.sub("", body)) + re.findall(r"\b[0-9a-f]{12}\b|\d{4}-\d\d-\d\d", body))
    return out


def test_after_a_run_of_ones_own_no_number_of_the_committed_run_remains(tmp_path):
    page = tmp_path / "README.md"
    shutil.copy(README, page)
    assert readme.main([str(page), "--metrics", str(_fake_run(tmp_path))]) == 0
    ours, theirs = _generated(README.read_text(encoding="utf-8")), _generated(page.read_text(encoding="utf-8"))
    for name, a, b in zip(readme.BLOCKS, ours, theirs):
        assert len(a) == len(b) and a, (name, a, b)
        same = [x for x, y in zip(a, b) if x == y]
        assert not same, f"README block {name!r} keeps the committed run's {same}"
    assert "0123456789ab" in page.read_text() and "Intel Xeon, 64 logical cores" in page.read_text()


def test_a_seeds_summary_without_this_run_is_left_out_and_says_how_to_add_it(tmp_path):
    metrics = _fake_run(tmp_path)
    shutil.copy(ROOT / "metrics" / "seeds" / "summary.json", metrics / "seeds" / "summary.json")  # the committed seeds
    page = tmp_path / "README.md"
    shutil.copy(README, page)
    assert readme.main([str(page), "--metrics", str(metrics)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "seeds read together" not in text and "| SFT: second-turn math" not in text
    assert text.count(readme.SEEDS_COMMAND) == 2  # in the results and in the findings
    runs = json.loads((ROOT / "metrics" / "seeds" / "summary.json").read_text())["runs"]
    assert " / ".join(runs) not in text  # no table or finding of the committed seeds


def test_the_readme_is_short_and_its_table_cells_are_narrow():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, "README.md is a front door: move details to docs/"
    cells = [c.strip() for ln in lines if ln.startswith("|") for c in ln.strip().strip("|").split("|")]
    assert cells and max(map(len, cells)) <= 200, max(cells, key=len)


def test_the_readme_gives_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "    bash env/setup_cpu.sh && . .venv/bin/activate && dvc repro\n" in text
    assert "    bash env/setup_cpu.sh --dev && .venv/bin/python -m pytest -q\n" in text
    assert "git checkout -- . && dvc checkout -f" not in text  # -f deletes models the cache lacks


def test_only_the_text_between_the_markers_changes():
    text = f"intro\n{readme.BEGIN}\nold table\n{readme.END}\nfindings\n"
    assert readme.replace_block(text, "\nnew table\n") == f"intro\n{readme.BEGIN}\nnew table\n{readme.END}\nfindings\n"


@pytest.mark.parametrize("text", ["no markers\n", f"{readme.END}\n{readme.BEGIN}\n",
                                  f"{readme.BEGIN}\n{readme.BEGIN}\n{readme.END}\n"])
def test_markers_missing_or_out_of_order_are_an_error_naming_the_file(text):
    with pytest.raises(ValueError, match="notes.md: expected one"):
        readme.replace_block(text, "x\n", "notes.md")


def _copy_metrics(tmp_path):
    dst = tmp_path / "metrics"
    (dst / "eval").mkdir(parents=True)
    for m in ("base", "sft", "ppo", "grpo", "dpo"):
        shutil.copy(ROOT / "metrics" / "eval" / f"{m}.json", dst / "eval")
    shutil.copy(ROOT / "metrics" / "paired.json", dst)
    return dst


def test_check_fails_when_a_number_differs_and_the_rewrite_mends_it(tmp_path, capsys):
    metrics = _copy_metrics(tmp_path)
    page = tmp_path / "README.md"
    page.write_text(f"# x\n{readme.BEGIN}\n{readme.END}\n", encoding="utf-8")
    assert readme.main([str(page), "--metrics", str(metrics)]) == 0
    assert readme.main([str(page), "--metrics", str(metrics), "--check"]) == 0
    sft = json.loads((metrics / "eval" / "sft.json").read_text())
    sft["math_exact_match"] = 0.5
    (metrics / "eval" / "sft.json").write_text(json.dumps(sft))
    assert readme.main([str(page), "--metrics", str(metrics), "--check"]) == 1
    assert "run `python -m llm.readme`" in capsys.readouterr().err
    assert readme.main([str(page), "--metrics", str(metrics)]) == 0
    assert "| SFT | 50.0% [" in page.read_text()


def test_a_missing_model_leaves_its_row_out_and_fills_in_nothing(tmp_path):
    metrics = _copy_metrics(tmp_path)
    (metrics / "eval" / "dpo.json").unlink()
    text = readme.block(metrics)
    assert "| PPO |" in text and "| DPO |" not in text
    assert "seeds" not in text  # no metrics/seeds/summary.json: no seeds table


def test_a_row_holds_the_model_value_and_its_paired_change():
    e = json.loads((ROOT / "metrics" / "eval" / "ppo.json").read_text())
    p = json.loads((ROOT / "metrics" / "paired.json").read_text())["ppo_vs_sft"]["math"]
    row = next(ln for ln in readme.run_table(ROOT / "metrics") if ln.startswith("| PPO |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].startswith(f"{100 * e['math_exact_match']:.1f}%")
    assert cells[2] == f"{100 * p['delta']:+.1f} [{100 * p['lo']:+.1f}, {100 * p['hi']:+.1f}]"


def test_the_targets_table_shows_each_seed_the_mean_and_the_worst_side():
    """Worst is the lowest value where higher is better and the highest where lower is (second
    turns' gap, text bits/byte ratio); a row some seed lacks is left out, never filled in."""
    m = lambda *v: {"values": list(v)}  # noqa: E731
    summary = {"runs": ["1", "2"], "levels": {"sft": {"math": {"values": [0.80, 0.90]}}},
               "metrics": {"eval/sft.json:multiturn_exact_match": m(0.78, 0.82),
                           "eval/sft.json:scope_no_math_rate": m(1.0, 0.96),
                           "eval/sft.json:val_bpb": m(2.4, 2.6), "eval/base.json:val_bpb": m(2.4, 2.0),
                           "reward.json:accuracy": m(0.8, 0.7), "reward.json:sft_likelihood_accuracy": m(0.75, 0.8),
                           "eval/sft.json:context_math_after_scope_drop": m(0.02, -0.01)},
               "rm_separation": {"sft": {"values": [0.7, 0.9]}},
               "paired": {"ppo": {"math": {"type": "rate", "deltas": [0.01, -0.02], "mean": -0.005, "lo": -0.02,
                                           "hi": 0.01}}}}
    rows = {r.split(" | ")[0].lstrip("| "): r for r in readme.targets_table(summary)}
    assert rows["SFT: second-turn math below first-turn, points"].split(" | ")[1:4] == ["+2.0 / +8.0", "+5.0", "+8.0"]
    assert rows["SFT: out-of-scope requests answered without a worked sum"].split(" | ")[3] == "96.0%"
    assert rows["SFT's held-out text bits/byte over the base model's"].split(" | ")[1:4] == ["1.00 / 1.30", "1.15",
                                                                                              "1.30"]
    assert "RM minus SFT's likelihood on the same pairs, points" not in rows  # a finding, not a target
    assert rows["RM AUC, SFT's right over wrong test answers"].split(" | ")[3] == "0.70"
    assert "the same, asked after a sum or a word problem" not in rows  # no seed has it
    assert rows["SFT: math after an out-of-scope request below math alone, points"].split(" | ")[1:5] == [
        "+2.0 / -1.0", "+0.5", "+2.0", "at most 5 |"]
    assert not any("You are a helpful assistant" in r for r in rows)  # no seed has it
    assert rows["PPO (on passages): math change vs SFT (pooled over the seeds' items)"].split(" | ")[1:5] == [
        "+1.0 / -2.0", "-0.5", "[-2.0, +1.0] (95%)", "within 2 points of 0 (interval) |"]
    assert readme.targets_table(None) == []
    # the continuation preference's targets: the worst PPO KL is the highest, the worst win rate the lowest
    summary["metrics"].update({"eval/ppo.json:continuation_win_rate": m(0.78, 0.72),
                               "eval/ppo.json:continuation_kl": m(0.12, 0.18),
                               "eval/ppo.json:continuation_base_bpb": m(2.4, 2.6),
                               "eval/ppo.json:continuation_base_bpb_sft": m(2.5, 2.5)})
    rows = {r.split(" | ")[0].lstrip("| "): r for r in readme.targets_table(summary)}
    assert rows["PPO: the judge prefers its continuation to SFT's"].split(" | ")[1:5] == [
        "78.0% / 72.0%", "75.0%", "72.0%", "at least 75% |"]
    assert rows["PPO: KL to SFT on held-out passages, nats/token"].split(" | ")[3] == "0.18"
    assert rows["PPO: the base model's bits/byte on its continuations over on SFT's"].split(" | ")[1] == "0.96 / 1.04"
    assert "RM: Spearman with the judge on single continuations" not in rows   # no seed has it


def test_the_preference_table_reads_each_models_continuations_and_the_best_of_n(tmp_path):
    """A row per model evaluated on held-out passages (the judge's mean, its paired change, the win
    rate, the base model's bits/byte over SFT's), from files git keeps; the finding names PPO's and
    DPO's move."""
    m = tmp_path / "metrics"
    (m / "eval").mkdir(parents=True)

    def ev(gold, win, kl, bpb):
        return {"continuation_gold": gold, "continuation_win_rate": win, "continuation_win_rate_lo": win - 0.05,
                "continuation_win_rate_hi": win + 0.05, "continuation_rm": gold * 2, "continuation_kl": kl,
                "continuation_base_bpb": bpb, "continuation_base_bpb_sft": 2.5}
    for name, e in (("sft", ev(0.1, 0.5, 0.0, 2.5)), ("ppo", ev(0.5, 0.75, 0.16, 2.4)), ("dpo", ev(0.8, 0.9, 0.4, 2.3))):
        (m / "eval" / f"{name}.json").write_text(json.dumps(e))
    (m / "paired.json").write_text(json.dumps({"ppo_vs_sft": {"continuation": {"delta": 0.4, "lo": 0.35, "hi": 0.45}}}))
    (m / "rankers.json").write_text(json.dumps({"continuation_samples": 64, "continuation_best_of_n_gold": 0.7,
                                                "continuation_best_of_n_rm": 2.1}))
    (m / "reward.json").write_text(json.dumps({"by_kind": {"continuation": {"accuracy": 0.84}},
                                               "continuation_spearman": 0.72}))
    rows = readme.preference_table(m)
    assert rows[2] == "| SFT | +0.100 | - | - | +0.200 | 0.000 | 1.00 |"
    assert rows[3] == "| PPO | +0.500 | +0.400 [+0.350, +0.450] | 75.0% [70.0, 80.0] | +1.000 | 0.160 | 0.96 |"
    assert rows[4].startswith("| DPO | +0.800 | - | 90.0% [85.0, 95.0] |")
    assert len(rows) == 5   # the reward model's best-of-n is the report's (rankers.json is no file git keeps)
    line = readme.preference_finding(m)
    assert "PPO +0.10 -> +0.50, winning 75% [70.0, 80.0] of passages at KL 0.16 nats/token" in line
    assert readme.preference_table(tmp_path / "nothing") == []


def test_the_seeds_command_carries_the_models_a_summary_was_read_on():
    from llm.eval.readme import SEEDS_COMMAND, seeds_command
    assert seeds_command(None) == seeds_command({"runs": ["1337"]}) == SEEDS_COMMAND
    assert seeds_command({"models": ["sft", "ppo", "dpo"]}) == SEEDS_COMMAND + " --models sft ppo dpo"


def test_the_tier_finding_sets_ppos_edge_change_beside_grpos_and_its_controls():
    """GRPO's per-tier sentence carries PPO's change on the edge where PPO was evaluated there (PPO
    trains on no edge problem: the gain GRPO's is read beside), and leaves it out where it was not."""
    def res(mean, lo, hi, deltas):
        return {"mean": mean, "lo": lo, "hi": hi, "deltas": deltas, "worst": min(deltas)}
    paired = {"grpo": {"tier_edge": res(0.043, 0.029, 0.057, [0.051, 0.018, 0.059]),
                       "tier_in_distribution": res(0.005, -0.0, 0.01, [0.0, 0.005, 0.009])},
              "grpo_random": {"tier_edge": res(-0.035, -0.048, -0.022, [-0.045, -0.061, 0.001])},
              "ppo": {"tier_edge": res(0.041, 0.027, 0.056, [0.054, 0.022, 0.048])}}
    line = readme.tier_finding(paired, [0.31], pooled=True)
    assert ("on the edge tier +4.3 [+2.9, +5.7], worst seed +1.8, its shuffled-reward control there -3.5"
            " [-4.8, -2.2], worst seed -6.1, PPO there +4.1 [+2.7, +5.6], worst seed +2.2, in distribution") in line
    assert "PPO" not in readme.tier_finding({k: v for k, v in paired.items() if k != "ppo"}, None, pooled=True)


def test_the_ranker_finding_names_each_ranker_and_the_verifiers_own_check():
    from llm.eval.readme import ranker_finding
    v = {"greedy_accuracy": [0.5, 0.6], "pass_at_n": [0.8, 0.8], "rankers.likelihood.best_of_n": [0.5, 0.5],
         "rankers.generative_verifier.best_of_n": [0.2, 0.3], "heldout_pair_accuracy": [0.6, 0.5],
         "heldout_likelihood_pair_accuracy": [0.9, 0.8]}
    assert ranker_finding(v) == (
        "Picking the best of 16 of SFT's answers on the edge tier (mean of 2 seeds): greedy 55.0%, pass@16 80.0%;"
        " by SFT's likelihood 50.0%, SFT's own verdict (a generative verifier) 25.0%; taught to judge its own"
        " answers, the verifier orders 55% of held-out pairs of one problem's right and wrong answers right (worst"
        " seed 50%), SFT's likelihood 85%")
    # a ranker some seed lacks is left out, and so is the verifier's check
    assert "verdict" not in ranker_finding({**v, "rankers.generative_verifier.best_of_n": [0.2],
                                            "heldout_pair_accuracy": None})
