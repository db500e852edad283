"""Stage `prepare` end to end on a small params file."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from tests.conftest import ROOT, dvc_command


def _no_passages(params: dict) -> None:
    """The continuation preference off (its passages are drawn last and change SFT's statement of
    what it can do: tests/test_prepare.py's continuation test turns it on)."""
    params["prepare"].update(continuation_train=0, continuation_rl=0, continuation_test=0)
    params["eval"]["continuation_items"] = params["rankers"]["continuation_passages"] = 0
    params["pairs"]["continuation_prompts"] = params["ppo"]["continuation_eval"] = 0
    params["ppo"]["continuation_share"] = 0.0


def _run_prepare(tmp_path, **overrides):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["prepare"].update(math_train=300, math_val=40, math_test=60, math_pretrain_docs=50, task_train=100,
                             task_val=20, pref_train=80, pref_val=20)
    # two-exchange conversations and out-of-scope requests off unless a test asks: they are drawn
    # last and skip what the evaluation asks, so they would blur what each test isolates
    params["prepare"].update(multiturn_train=0, multiturn_test=0, scope_train=0, scope_test=0, context_train=0,
                             tier_test=0)
    _no_passages(params)
    params["prepare"].update(overrides)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(dvc_command("prepare"), cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prepare_writes_disjoint_splits(tmp_path):
    r = _run_prepare(tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data" / "prepared"
    rl = {s: _jsonl(out / "rl" / f"{s}.jsonl") for s in ("train", "val", "test")}
    qs = {s: {r["question"] for r in recs} for s, recs in rl.items()}
    assert not (qs["train"] & qs["test"]) and not (qs["val"] & qs["test"]) and not (qs["train"] & qs["val"])
    sft_train_prompts = {r["messages"][0]["content"] for r in _jsonl(out / "sft" / "train.jsonl")}
    pref_prompts = {r["prompt"][0]["content"] for r in _jsonl(out / "prefs" / "train.jsonl")}
    pretrain_text = (out / "pretrain" / "train.jsonl").read_text()
    for q in qs["test"]:
        assert q not in sft_train_prompts and q not in pref_prompts
        assert json.dumps(q, ensure_ascii=False)[1:-1] not in pretrain_text
    metrics = json.loads((tmp_path / "metrics" / "prepare.json").read_text())
    assert metrics["records"]["rl/test"] == 60
    assert metrics["by_source"]["pretrain/val"] == {"shakespeare": 2}


def test_eval_only_items_are_no_training_prompt(tmp_path):
    r = _run_prepare(tmp_path, task_train=600, task_test=40, arithmetic_test=100)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data" / "prepared"
    trained = {m["content"] for r in _jsonl(out / "sft" / "train.jsonl") for m in r["messages"] if m["role"] == "user"}
    trained |= {r["question"] for r in _jsonl(out / "rl" / "train.jsonl")}
    tasks, arithmetic = _jsonl(out / "tasks" / "test.jsonl"), _jsonl(out / "arithmetic" / "test.jsonl")
    assert not {t["prompt"] for t in tasks} & trained and not {q["question"] for q in arithmetic} & trained
    assert len({t["prompt"] for t in tasks}) == len(tasks) and len({q["question"] for q in arithmetic}) == 100
    per_kind = {k: sum(t["kind"] == k for t in tasks) for k in {t["kind"] for t in tasks}}
    assert per_kind["max"] == per_kind["sort"] == 40
    # reverse has 60 distinct prompts: the test set is all of those SFT does not train on, and no more
    reverse_trained = {p for p in trained if p.startswith(("Reverse the word: ", "Spell "))}
    assert per_kind["reverse"] == 60 - len(reverse_trained) < 40
    metrics = json.loads((tmp_path / "metrics" / "prepare.json").read_text())
    assert metrics["records"]["tasks/test"] == len(tasks) and metrics["records"]["arithmetic/test"] == 100


def test_eval_only_items_change_no_training_record(tmp_path):
    """Without bare calculations and two-exchange conversations in SFT (both are drawn after the
    evaluation's items and skip them), the evaluation-only items leave every training file as it was."""
    a, b = tmp_path / "with", tmp_path / "without"
    a.mkdir(), b.mkdir()
    none = dict(arithmetic_train=0, multiturn_train=0, multiturn_test=0, scope_train=0, scope_test=0)
    assert _run_prepare(a, task_test=10, arithmetic_test=30, **none).returncode == 0
    assert _run_prepare(b, task_test=0, arithmetic_test=0, **none).returncode == 0
    files = sorted(str(f.relative_to(a / "data/prepared")) for f in (a / "data/prepared").rglob("*.jsonl"))
    assert len(files) == 16  # multiturn/test, scope/test, tiers/test and continue/* are empty at these counts
    for f in files:
        same = (a / "data/prepared" / f).read_bytes() == (b / "data/prepared" / f).read_bytes()
        assert same == (f not in ("tasks/test.jsonl", "arithmetic/test.jsonl")), f
    assert (b / "data/prepared/tasks/test.jsonl").read_text() == ""


def test_difficulty_tiers_are_held_out_and_change_no_other_record(tmp_path):
    """prepare.tier_test problems per tier, drawn last from their own generator: every other file
    stays byte for byte what it is without them, the tiers hold the levels they name (the
    in-distribution tier the trained levels below the edge), and no tier question is a question
    of any other file."""
    a, b = tmp_path / "with", tmp_path / "without"
    a.mkdir(), b.mkdir()
    assert _run_prepare(a, tier_test=30, context_train=40).returncode == 0
    assert _run_prepare(b, tier_test=0, context_train=40).returncode == 0
    pa, pb = a / "data/prepared", b / "data/prepared"
    for f in sorted(str(f.relative_to(pa)) for f in pa.rglob("*.jsonl")):
        if f != "tiers/test.jsonl":
            assert (pa / f).read_bytes() == (pb / f).read_bytes(), f
    assert (pb / "tiers/test.jsonl").read_text() == ""
    tiers = _jsonl(pa / "tiers/test.jsonl")
    levels = {t: {r["level"] for r in tiers if r["tier"] == t} for t in ("in_distribution", "edge", "harder")}
    assert levels == {"in_distribution": {1, 2, 3}, "edge": {4}, "harder": {5}}
    assert [sum(r["tier"] == t for r in tiers) for t in levels] == [30, 30, 30]
    assert len({r["question"] for r in tiers}) == len({r["id"] for r in tiers}) == 90
    others = set()
    for f in pa.rglob("*.jsonl"):
        for rec in _jsonl(f) if f.name != "test.jsonl" or f.parent.name != "tiers" else []:
            others |= {rec.get("question"), rec.get("prompt") if isinstance(rec.get("prompt"), str) else None}
            others |= {m["content"] for m in rec.get("messages", [])}
    assert not {r["question"] for r in tiers} & others
    assert {r["answer"] for r in tiers if r["level"] == 5} and all(r["answer"].lstrip("-").isdigit() for r in tiers)


def test_a_harder_tier_that_is_trained_on_is_refused(tmp_path):
    r = _run_prepare(tmp_path, tier_test=10, harder_levels=[4])
    assert r.returncode != 0
    assert "prepare.harder_levels: [4] also in math_levels" in r.stderr


def test_bare_calculations_for_sft_are_appended_and_never_asked_by_eval(tmp_path):
    """prepare.arithmetic_train appends bare calculations to sft/train and changes nothing else:
    the evaluation's questions stay those of a run without them, and no trained calculation is
    one the evaluation asks, in either language ("What is 6 * 4?" and "6 * 4 等于多少？")."""
    a, b = tmp_path / "with", tmp_path / "without"
    a.mkdir(), b.mkdir()
    assert _run_prepare(a, arithmetic_test=150, arithmetic_train=600).returncode == 0
    assert _run_prepare(b, arithmetic_test=150, arithmetic_train=0).returncode == 0
    pa, pb = a / "data/prepared", b / "data/prepared"
    for f in sorted(str(f.relative_to(pa)) for f in pa.rglob("*.jsonl")):
        if f != "sft/train.jsonl":
            assert (pa / f).read_bytes() == (pb / f).read_bytes(), f
    with_, without = _jsonl(pa / "sft/train.jsonl"), _jsonl(pb / "sft/train.jsonl")
    assert with_[:len(without)] == without
    added = with_[len(without):]
    assert len(added) == 600 and {r["source"] for r in added} == {"generated/arithmetic"}
    expression = lambda q: q.removeprefix("What is ").removesuffix("?").removesuffix(" 等于多少？")
    trained = {expression(r["messages"][0]["content"]) for r in added}
    asked = {expression(q["question"]) for q in _jsonl(pa / "arithmetic/test.jsonl")}
    assert len(asked) > 100 and not trained & asked
    for r in added:
        question, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        value = eval(expression(question).replace("/", "//"))  # exact division by construction
        assert answer == f"{expression(question)} = {value}\n#### {value}"
    metrics = json.loads((a / "metrics" / "prepare.json").read_text())
    assert metrics["by_source"]["sft/train"]["generated/arithmetic"] == 600


def test_task_weights_set_each_kinds_share(tmp_path):
    """prepare.task_weights draws the instruction task kinds in the given shares (a zero weight
    none at all); a list that is not one weight per kind is refused, naming the key and the order."""
    r = _run_prepare(tmp_path, task_train=3000, task_test=0, task_weights=[0, 0, 3, 1, 0, 0, 0])
    assert r.returncode == 0, r.stderr
    metrics = json.loads((tmp_path / "metrics" / "prepare.json").read_text())
    tasks = {k.removeprefix("generated/task_"): n for k, n in metrics["by_source"]["sft/train"].items()
             if k.startswith("generated/task_")}
    assert set(tasks) == {"sort", "count_words"}
    assert 2.5 < tasks["sort"] / tasks["count_words"] < 3.5 and sum(tasks.values()) >= 3000
    (tmp_path / "bad").mkdir()
    r = _run_prepare(tmp_path / "bad", task_weights=[1, 2, 3])
    assert r.returncode == 1 and not (tmp_path / "bad" / "data").exists()
    assert "prepare.task_weights: expected 7 weights" in r.stderr and "reverse, uppercase, sort" in r.stderr
    r = _run_prepare(tmp_path / "bad", task_train=100, task_weights=[1, 0, 0, 0, 0, 0, 0])  # 60 reverse prompts
    assert r.returncode == 1 and "prepare.task_train=100: only" in r.stderr and "lower it" in r.stderr


def test_prepare_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert _run_prepare(a).returncode == 0 and _run_prepare(b).returncode == 0
    for kind in ("sft/train", "prefs/val", "rl/test", "pretrain/val"):
        assert (a / "data/prepared" / f"{kind}.jsonl").read_bytes() == (b / "data/prepared" / f"{kind}.jsonl").read_bytes()


def test_bad_params_rejected_before_any_data_is_read(tmp_path):
    r = _run_prepare(tmp_path, math_trian=5)
    assert r.returncode == 1
    assert "prepare.math_trian: unknown key; did you mean 'math_train'?" in r.stderr
    assert not (tmp_path / "data").exists()


def test_external_sources_flow_into_the_splits(tmp_path, fixtures):
    src = lambda p, s: {"path": str(fixtures / p), "hub": "", "hub_config": "", "split": "train", "schema": s,
                        "field": "text", "limit": 0}
    r = _run_prepare(tmp_path, val_fraction=0.0, sft_sources=[src("gsm8k.jsonl", "gsm8k"), src("alpaca.jsonl", "alpaca")],
                     pref_sources=[src("hh_rlhf.jsonl", "hh_rlhf")], pretrain_sources=[src("corpus.txt", "text")])
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data" / "prepared"
    rl_train = _jsonl(out / "rl" / "train.jsonl")
    assert {"72", "10"} <= {x["answer"] for x in rl_train}
    sources = {x["source"] for x in _jsonl(out / "sft" / "train.jsonl")}
    assert str(fixtures / "alpaca.jsonl") in sources
    assert any(x["source"].endswith("hh_rlhf.jsonl") for x in _jsonl(out / "prefs" / "train.jsonl"))


def test_bad_external_record_fails_with_path_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": 3, "output": "b"}\n')
    src = {"path": str(bad), "hub": "", "hub_config": "", "split": "train", "schema": "alpaca", "field": "text",
           "limit": 0}
    r = _run_prepare(tmp_path, sft_sources=[src])
    assert r.returncode == 1
    assert f"{bad}:2: field 'instruction' must be a string" in r.stderr


def test_empty_math_levels_is_a_params_error_not_a_crash(tmp_path):
    r = _run_prepare(tmp_path, math_levels=[])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "prepare.math_levels: expected a non-empty list" in r.stderr
    assert not (tmp_path / "data").exists()


def test_a_directory_as_source_path_fails_cleanly_even_when_skipping_bad_records(tmp_path):
    src = {"path": str(tmp_path), "hub": "", "hub_config": "", "split": "train", "schema": "text", "field": "text",
           "limit": 0}
    r = _run_prepare(tmp_path, pretrain_sources=[src], on_bad_record="skip", max_bad_fraction=1.0,
                     math_train=20, math_val=5, math_test=5, math_pretrain_docs=5, task_train=5, task_val=5,
                     pref_train=5, pref_val=5)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{tmp_path}: is a directory, not a regular file" in r.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "metrics").exists()


def _small_cfg(**overrides):
    from llm.config import load_params_text
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["prepare"].update({"shakespeare": False, "math_train": 200, "math_val": 20, "math_test": 30,
                              "math_pretrain_docs": 20, "task_train": 60, "task_val": 10, "task_test": 5,
                              "pref_train": 40, "pref_val": 8, "arithmetic_train": 20, "arithmetic_test": 10,
                              "multiturn_train": 0, "multiturn_test": 0, "scope_train": 0, "scope_test": 0,
                              "context_train": 0})
    _no_passages(params)
    params["prepare"].update(overrides)
    params["eval"]["math_problems"] = params["prepare"]["math_test"]
    return load_params_text(yaml.safe_dump(params, sort_keys=False)).prepare


def test_build_keeps_the_evaluation_apart_from_what_a_policy_trains_on():
    """llm.data.splits.build in-process: no held-out math question or evaluation prompt is a training prompt."""
    from llm.data.splits import build
    counts = dict(multiturn_train=100, multiturn_test=20, scope_train=50, scope_test=20, context_train=300)
    data, _ = build(_small_cfg(**counts), seed=7)
    trained = {m["content"] for r in data["sft"]["train"] for m in r["messages"] if m["role"] == "user"}
    trained |= {r["question"] for r in data["rl"]["train"]}
    held_out = {r["question"] for s in ("val", "test") for r in data["rl"][s]}
    assert held_out and not held_out & trained
    assert not {r["prompt"] for r in data["tasks"]["test"]} & trained
    assert not {r["question"] for r in data["arithmetic"]["test"]} & trained
    assert data["scope"]["test"] and not {r["prompt"] for r in data["scope"]["test"]} & trained
    assert build(_small_cfg(**counts), seed=7)[0] == data  # the same (cfg, seed), the same records


def test_math_in_a_context_is_appended_last_and_asks_and_opens_with_nothing_the_evaluation_asks():
    """prepare.context_train appends its conversations after every other record, leaving them as
    they are; none asks a held-out problem or calculation (in either language) or a user turn of
    the evaluation's conversations, and none opens with an evaluation task or out-of-scope
    request (the evaluation asks its held-out questions after those); the same seed gives the
    same conversations."""
    import re

    from llm.data.splits import build
    counts = dict(multiturn_train=100, multiturn_test=40, scope_train=100, scope_test=60, scope_second_turn=0.5,
                  task_test=40, arithmetic_test=60)
    on, _ = build(_small_cfg(**counts, context_train=1500), seed=7)
    off, _ = build(_small_cfg(**counts), seed=7)
    assert {k: {s: v for s, v in on[k].items()} for k in on if k != "sft"} == {
        k: {s: v for s, v in off[k].items()} for k in off if k != "sft"}
    assert on["sft"]["val"] == off["sft"]["val"]
    before = off["sft"]["train"]
    assert on["sft"]["train"][:len(before)] == before
    added = on["sft"]["train"][len(before):]
    assert len(added) == 1500 and {r["source"] for r in added} == {
        "generated/context_scope", "generated/context_task", "generated/context_none"}
    asked = {m["content"] for r in added for m in r["messages"] if m["role"] == "user"}
    questions = {r["messages"][-2]["content"] for r in added}
    held_out = {r["question"] for s in ("val", "test") for r in on["rl"][s]} | {
        r["question"] for r in on["arithmetic"]["test"]} | {
        m["content"] for c in on["multiturn"]["test"] for m in c["messages"] if m["role"] == "user"}
    requests = {r["prompt"] for r in on["scope"]["test"]} | {t["prompt"] for t in on["tasks"]["test"]}
    # (a task after a sum in the evaluation's conversations may ask a training task: no opening is checked against it)
    assert not questions & held_out and not asked & requests and not asked & (held_out - requests - {
        c["messages"][2]["content"] for c in on["multiturn"]["test"] if c["kind"] == "task_after_sum"})
    calc = re.compile(r"(\d+ [-+*/] \d+)")
    evaluated = {calc.search(r["question"]).group(1) for r in on["arithmetic"]["test"]}
    assert not evaluated & {m.group(1) for q in asked if (m := calc.search(q))}  # no calculation, either language
    assert sum(r["messages"][0]["role"] == "system" for r in added) > 700
    assert {r["messages"][-2]["content"] for r in added if r["source"] == "generated/context_none"} <= asked
    assert build(_small_cfg(**counts, context_train=1500), seed=7)[0]["sft"]["train"] == on["sft"]["train"]


def test_an_empty_required_split_names_the_kind_and_the_params():
    import pytest

    from llm.data.splits import build, check_required
    from llm.fileio import DataError
    data, _ = build(_small_cfg(), seed=7)  # no Shakespeare and no source: no pretraining text held out
    with pytest.raises(DataError, match=r"no pretrain/val records: raise the matching prepare\.\* count"):
        check_required(data)


def test_multiturn_and_scope_conversations_are_appended_and_their_test_items_held_out():
    """The counts append their conversations to sft/train and write their test files, leaving every
    other record as it is; no held-out conversation opens with a training prompt, no training
    conversation asks a held-out question, and no held-out request is a training prompt."""
    from llm.data.splits import build
    counts = dict(multiturn_train=300, multiturn_test=60, scope_train=80, scope_test=40)
    on, _ = build(_small_cfg(**counts), seed=7)
    off, _ = build(_small_cfg(), seed=7)
    for kind in set(on) | set(off):
        for split in set(on[kind]) | set(off[kind]):
            if (kind, split) not in (("sft", "train"), ("multiturn", "test"), ("scope", "test")):
                assert on[kind][split] == off[kind][split], (kind, split)
    before = off["sft"]["train"]
    assert on["sft"]["train"][:len(before)] == before
    added = on["sft"]["train"][len(before):]
    assert [r["source"] for r in added] == ["generated/multiturn"] * 300 + ["generated/scope"] * 80
    assert not off["multiturn"]["test"] and not off["scope"]["test"]
    tests, requests = on["multiturn"]["test"], on["scope"]["test"]
    assert len(tests) == 60 and len(requests) == 40
    assert {t["kind"] for t in tests} == {"followup", "new_problem", "task_after_sum"}
    assert all([m["role"] for m in t["messages"]] == ["user", "assistant", "user"] for t in tests)
    trained = {m["content"] for r in on["sft"]["train"] for m in r["messages"] if m["role"] == "user"}
    assert not {t["messages"][0]["content"] for t in tests} & trained
    assert not {t["messages"][2]["content"] for t in tests if t["kind"] == "new_problem"} & trained
    assert not {r["prompt"] for r in requests} & trained
    held_out = {r["question"] for s in ("val", "test") for r in on["rl"][s]}
    assert not held_out & {m["content"] for r in added for m in r["messages"] if m["role"] == "user"}


def test_more_out_of_scope_requests_than_the_generator_has_is_refused_naming_the_key():
    import pytest

    from llm.data.splits import build
    from llm.fileio import DataError
    with pytest.raises(DataError, match=r"prepare\.scope_train \(there are \d+ English and \d+ Chinese ones"):
        build(_small_cfg(scope_test=10, scope_train=1000), seed=7)


def test_no_two_exchange_conversation_asks_an_evaluation_prompt_in_any_turn():
    """A task after a sum asks a task prompt in its second turn; the reverse and repeat tasks have
    few distinct prompts, so without the check many of the evaluation's would be trained on."""
    from llm.data.splits import build
    on, _ = build(_small_cfg(multiturn_train=2000, task_test=40, arithmetic_test=60), seed=7)
    evals = {t["prompt"] for t in on["tasks"]["test"]} | {q["question"] for q in on["arithmetic"]["test"]}
    assert sum(t["kind"] in ("reverse", "repeat") for t in on["tasks"]["test"]) >= 40
    turns = {m["content"] for r in on["sft"]["train"] if r["source"] == "generated/multiturn"
             for m in r["messages"] if m["role"] == "user"}
    assert len(turns) > 2000 and not evals & turns


def test_out_of_scope_requests_asked_mid_conversation_open_with_no_evaluation_question():
    """prepare.scope_second_turn asks that share of the out-of-scope requests after a first
    exchange (a sum or a word problem, answered): the requests are those drawn without it, the
    test records carry the opening as "history", and no opening asks a held-out question, a
    held-out calculation or a user turn of the evaluation's conversations."""
    from llm.data.splits import build
    counts = dict(multiturn_train=100, multiturn_test=40, scope_train=200, scope_test=60)
    on, _ = build(_small_cfg(**counts, scope_second_turn=0.5), seed=7)
    off, _ = build(_small_cfg(**counts, scope_second_turn=0.0), seed=7)
    assert [r["prompt"] for r in on["scope"]["test"]] == [r["prompt"] for r in off["scope"]["test"]]
    assert not any("history" in r for r in off["scope"]["test"])
    opened = [r for r in on["scope"]["test"] if "history" in r]
    assert 15 <= len(opened) <= 45
    assert all([m["role"] for m in r["history"]] == ["user", "assistant"] for r in opened)
    train = [r for r in on["sft"]["train"] if r["source"] == "generated/scope"]
    assert [r["messages"][-2:] for r in train] == [r["messages"] for r in off["sft"]["train"]
                                                   if r["source"] == "generated/scope"]
    openings = [r["messages"][0]["content"] for r in train if len(r["messages"]) == 4]
    assert 60 <= len(openings) <= 140
    openings += [r["history"][0]["content"] for r in opened]
    held_out = {r["question"] for s in ("val", "test") for r in on["rl"][s]} | {
        r["question"] for r in on["arithmetic"]["test"]} | {
        m["content"] for c in on["multiturn"]["test"] for m in c["messages"] if m["role"] == "user"}
    assert not set(openings) & held_out
    assert {r["lang"] for r in opened} == {"en", "zh"}


def test_a_math_test_source_joins_the_evaluation_and_nothing_trains_on_it():
    """prepare.math_test_sources (GSM8K's test split): its problems follow the generated ones in
    rl/test at level 0, and the same problems given as a training source are left out of SFT and
    the RL splits."""
    from llm.config import SourceConfig
    from llm.data.splits import build
    gsm = str(ROOT / "tests" / "fixtures" / "gsm8k.jsonl")
    src = dict(path=gsm, hub="", hub_config="", split="train", schema="gsm8k", field="text", limit=0)
    train_only, _ = build(_small_cfg(sft_sources=[src]), seed=7)
    both, _ = build(_small_cfg(sft_sources=[src], math_test_sources=[{**src, "split": "test"}]), seed=7)
    questions = {r["question"] for r in train_only["rl"]["train"] + train_only["rl"]["val"]
                 if r["source"] == gsm}
    assert len(questions) == 2  # the fixture's two problems, trained on when not held out
    generated = train_only["rl"]["test"]
    assert both["rl"]["test"][:len(generated)] == generated
    added = both["rl"]["test"][len(generated):]
    assert {r["question"] for r in added} == questions and {r["level"] for r in added} == {0}
    assert [r["id"] for r in added] == ["gsm8k-test-0", "gsm8k-test-1"]
    trained = {m["content"] for s in ("train", "val") for r in both["sft"][s] for m in r["messages"]}
    trained |= {r["question"] for s in ("train", "val") for r in both["rl"][s]}
    assert not trained & questions
    assert isinstance(SourceConfig(**src), SourceConfig)


def test_params_refuse_more_evaluation_math_than_prepare_writes_and_a_test_source_of_another_schema():
    from llm.config import ConfigError, params_from_dict
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    too_many = {**params, "eval": {**params["eval"], "math_problems": params["prepare"]["math_test"] + 1}}
    with pytest.raises(ConfigError, match=r"eval\.math_problems=501 asks for more test problems than prepare writes"
                                          r" \(500: prepare\.math_test=500\); lower eval\.math_problems"):
        params_from_dict(too_many)
    chat = dict(path="x.jsonl", hub="", hub_config="", split="test", schema="chat", field="messages", limit=0)
    with pytest.raises(ConfigError, match=r"prepare\.math_test_sources\[0\]\.schema: 'chat'.*schema gsm8k"):
        params_from_dict({**params, "prepare": {**params["prepare"], "math_test_sources": [chat]}})
    limited = dict(chat, schema="gsm8k", limit=1)
    ok = {**too_many, "prepare": {**params["prepare"], "math_test_sources": [limited]}}
    assert params_from_dict(ok).eval.math_problems == 501


def test_continuation_passages_come_last_and_the_held_out_ones_from_held_out_works():
    """prepare.continuation_*: SFT's lessons appended last to sft/train, the RL prompts from the
    pretraining works with no passage of a lesson, the test prompts from the works held out of
    pretraining; every other record is what it is without them, but for the statement of what
    the model can do, which names verse once SFT learns it."""
    import json

    from llm.data.continuation import PROMPT_HEAD, passage_of
    from llm.data.generators import SCOPE_ANSWER, SCOPE_ANSWER_VERSE
    from llm.data.splits import CONTINUATION_SOURCE, build
    chat = dict(scope_train=30, scope_test=10, context_train=30)   # conversations that state what it can do
    on, _ = build(_small_cfg(shakespeare=True, continuation_train=200, continuation_rl=100,
                             continuation_test=50, **chat), seed=7)
    off, _ = build(_small_cfg(shakespeare=True, **chat), seed=7)
    said = json.dumps(on, ensure_ascii=False)
    assert SCOPE_ANSWER_VERSE["en"] in said and not any(a in said for a in SCOPE_ANSWER.values())
    for lang in ("en", "zh"):
        said = said.replace(json.dumps(SCOPE_ANSWER_VERSE[lang], ensure_ascii=False)[1:-1],
                            json.dumps(SCOPE_ANSWER[lang], ensure_ascii=False)[1:-1])
    on = json.loads(said)
    for kind in set(on) | set(off):
        for split in set(on[kind]) | set(off[kind]):
            if kind == "sft" and split == "train":
                assert on[kind][split][:len(off[kind][split])] == off[kind][split]
            elif kind != "continue":
                assert on[kind][split] == off[kind][split], (kind, split)
    lessons = on["sft"]["train"][len(off["sft"]["train"]):]
    assert len(lessons) == 200 and {r["source"] for r in lessons} == {CONTINUATION_SOURCE}
    assert all(r["messages"][0]["content"].startswith(PROMPT_HEAD + "\n") for r in lessons)
    assert [len(on["continue"][s]) for s in ("train", "test")] == [100, 50]
    taught = {passage_of(r["messages"][0]["content"]) for r in lessons}
    assert not taught & {r["passage"] for r in on["continue"]["train"]}
    held_out = {r["source"] for r in on["pretrain"]["val"]}
    trained = {r["source"] for r in on["pretrain"]["train"]}
    assert {r["source"] for r in on["continue"]["test"]} <= held_out
    assert {r["source"] for r in on["continue"]["train"]} <= trained
    assert all(r["prompt"] == f"{PROMPT_HEAD}\n{r['passage']}" and r["reference"] for r in on["continue"]["test"])
    assert not off["continue"]["train"] and not off["continue"]["test"]
    from llm.data.continuation import passages
    from llm.data.sources import shakespeare_works
    from llm.data.splits import summarize
    lines = {ln for name, text in shakespeare_works() if f"shakespeare/{name}" in trained
             for p, a in passages(text) for ln in (p + "\n" + a).split("\n")}
    assert not {ln for r in on["continue"]["test"] for ln in (r["passage"] + "\n" + r["reference"]).split("\n")} & lines
    # off, the metrics are those of a run before the preference existed; on, they count it
    assert not any(k.startswith("continue/") for k in summarize(off, {"sources": []})["records"])
    assert summarize(on, {"sources": []})["records"]["continue/test"] == 50


def test_continuation_without_shakespeare_or_beyond_the_works_is_refused():
    from llm.data.splits import build
    from llm.fileio import DataError
    with pytest.raises(DataError, match="set prepare.shakespeare: true or the continuation counts to 0"):
        build(_small_cfg(continuation_test=5), seed=7)
    with pytest.raises(DataError, match="ask for more: lower them"):
        build(_small_cfg(shakespeare=True, continuation_test=1_000_000), seed=7)
