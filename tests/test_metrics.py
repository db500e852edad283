"""llm/train/metrics.py: what goes into a stage's metrics file and what into its run file; the headline."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm.fileio import DataError
from llm.train.metrics import (headline, is_run_key, is_timing_key, join_metrics, read_metrics, run_info_path,
                               split_metrics, split_timings, timings_path, write_metrics)


def test_timings_rates_provenance_and_non_numbers_go_to_the_run_file():
    d = {"math_exact_match": 0.67, "math_exact_match_lo": 0.57, "heldout_kl": 0.0029, "steps": 60,
         "nonfinite_skips": 0, "resumed_from": None, "mfu": None, "kl_time_s": 0.6, "train_time_s": 63.0,
         "rollout_s_total": 14.4, "tokens_per_s": 11910.9, "generation_fraction": 0.23, "mem_peak_gb": 3.1,
         "device": "cpu", "dtype": "float32", "world_size": 1, "max_kl": 0.15, "reward_source": "rm+verifier",
         "math_samples": [{"question": "1+1?", "correct": True}], "tokenizer_sha256": "ab12",
         "inputs": {"sft": "ab12"}, "early_stop": False, "val_ppl": None,
         "seconds": {"near_dedupe": 9.3, "total": 14.3},
         "train": {"kept": 23896, "steps": {"toxicity": {"toxicity_filter": "unavailable"},
                                            "length": {"tokens_median": 43.0}}}}
    metrics, run = split_metrics(d)
    assert metrics == {"math_exact_match": 0.67, "math_exact_match_lo": 0.57, "heldout_kl": 0.0029, "steps": 60,
                       "nonfinite_skips": 0, "early_stop": False, "val_ppl": None,
                       "train": {"kept": 23896, "steps": {"length": {"tokens_median": 43.0}}}}
    assert run == {"resumed_from": None, "mfu": None, "kl_time_s": 0.6, "train_time_s": 63.0, "rollout_s_total": 14.4,
                   "tokens_per_s": 11910.9, "generation_fraction": 0.23, "mem_peak_gb": 3.1, "device": "cpu",
                   "dtype": "float32", "world_size": 1, "max_kl": 0.15, "reward_source": "rm+verifier",
                   "math_samples": [{"question": "1+1?", "correct": True}], "tokenizer_sha256": "ab12",
                   "inputs": {"sft": "ab12"}, "seconds": {"near_dedupe": 9.3, "total": 14.3},
                   "train": {"steps": {"toxicity": {"toxicity_filter": "unavailable"}}}}


@pytest.mark.parametrize("key,run", [
    ("eval_time_s", True), ("tokens_per_s", True), ("step_s_total", True), ("count_seconds", True),
    ("seconds", True), ("timing_s", True), ("mem_allocated_gb", True), ("corpus_sha256", True),
    ("math_exact_match_level4_hi", False), ("kl_to_sft_per_token", False), ("rewards_accuracy", False),
    ("win_rate_wins", False), ("frac_reward_zero_std_mean", False), ("val_texts_zh", False), ("tokens_seen", False),
])
def test_the_rule_reads_words_not_substrings(key, run):
    assert is_run_key(key) is run


_keys = st.sampled_from(["loss", "val_bpb", "train_time_s", "tokens_per_s", "device", "by_kind", "n", "kl",
                         "math_samples", "seconds", "inputs", "steps", "reward_source"])
_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5),
                    st.lists(st.integers(), max_size=3))
_trees = st.recursive(_leaves, lambda inner: st.dictionaries(_keys, inner, max_size=5), max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _trees, max_size=8))
def test_joining_the_parts_gives_the_stage_dict_back(d):
    metrics, run = split_metrics(d)
    assert join_metrics(metrics, run) == d
    rest, timings = split_timings(d)
    metrics, run = split_metrics(rest)
    assert join_metrics(join_metrics(metrics, run), timings) == d

    def leaves(tree: dict):
        for k, v in tree.items():
            yield from leaves(v) if isinstance(v, dict) else [(k, v)]

    for k, v in leaves(metrics):  # only numbers, booleans and null, under no timing or provenance key
        assert not is_run_key(k) and (v is None or isinstance(v, (bool, int, float))), (k, v)


def test_a_key_in_both_files_is_named_when_joining(tmp_path):
    with pytest.raises(ValueError, match=r"key by_kind\.math\.n is in both"):
        join_metrics({"by_kind": {"math": {"n": 1}}}, {"by_kind": {"math": {"n": 2}}})
    path = tmp_path / "ppo.json"
    path.write_text('{"steps": 3}')
    run_info_path(path).parent.mkdir()
    run_info_path(path).write_text('{"steps": 4}')
    with pytest.raises(DataError, match=r"ppo\.json and .*run/ppo\.json: key steps is in both"):
        read_metrics(path)


def test_write_metrics_writes_three_files_and_read_metrics_joins_them(tmp_path):
    d = {"val_loss": 5.35, "train_time_s": 103.2, "device": "cpu", "num_threads": 2, "resumed_from": None,
         "by_kind": {"math": {"n": 230, "seconds": 1.5, "samples": ["a"]}}}
    path = tmp_path / "metrics" / "pretrain.json"
    write_metrics(path, d)
    assert run_info_path(path) == tmp_path / "metrics" / "run" / "pretrain.json"
    assert timings_path(path) == tmp_path / "runs" / "pretrain" / "run.json"
    assert json.loads(path.read_text()) == {"val_loss": 5.35, "by_kind": {"math": {"n": 230}}}
    assert json.loads(run_info_path(path).read_text()) == {"device": "cpu", "by_kind": {"math": {"samples": ["a"]}}}
    assert json.loads(timings_path(path).read_text()) == {"train_time_s": 103.2, "num_threads": 2,
                                                          "resumed_from": None, "by_kind": {"math": {"seconds": 1.5}}}
    assert read_metrics(path) == d


def test_a_rerun_that_only_differs_in_its_timings_writes_the_same_dvc_outputs(tmp_path):
    """What changes from run to run on one machine (times, rates, threads, the thread counts
    checked on the machine's CPU, where a killed run resumed) goes to runs/<stage>/run.json alone, so DVC's outputs stay byte for byte."""
    path = tmp_path / "metrics" / "ppo.json"
    first = {"reward_end": 0.5, "train_time_s": 10.0, "tokens_per_s": 900.0, "num_threads": 2, "resumed_from": None,
             "threads_steps": {"2": 30},
             "threads_probe": {"checked": [1, 2], "kept": [1, 2], "cpu": "AMD EPYC", "seconds": 0.4},
             "mem_peak_gb": 1.0, "generation_fraction": 0.4, "mfu": None, "math_samples": [{"q": "1+1"}]}
    again = {**first, "train_time_s": 12.5, "tokens_per_s": 750.0, "num_threads": 1, "resumed_from": 4,
             "threads_steps": {"1": 12, "2": 18},
             "threads_probe": {"checked": [1, 2], "kept": [1], "cpu": "Intel(R) Xeon(R)", "seconds": 0.5},
             "mem_peak_gb": 1.1, "generation_fraction": 0.5}
    write_metrics(path, first)
    outputs = path.read_bytes(), run_info_path(path).read_bytes()
    timings = timings_path(path).read_bytes()
    write_metrics(path, again)
    assert (path.read_bytes(), run_info_path(path).read_bytes()) == outputs
    assert timings_path(path).read_bytes() != timings
    assert read_metrics(path) == again


@pytest.mark.parametrize("key,timing", [("train_time_s", True), ("tokens_per_s", True), ("num_threads", True),
                                        ("threads_steps", True), ("threads_probe", True),
                                        ("resumed_from", True), ("mem_peak_gb", True), ("device", False),
                                        ("max_kl", False), ("val_loss", False), ("kl_seq", False)])
def test_timing_keys(key, timing):
    assert is_timing_key(key) is timing


def test_a_metrics_file_from_before_the_split_reads_whole(tmp_path):
    path = tmp_path / "pretrain.json"
    path.write_text('{"val_loss": 5.35, "train_time_s": 103.2}')
    assert read_metrics(path) == {"val_loss": 5.35, "train_time_s": 103.2}


def test_headline_takes_each_number_from_its_file_and_invents_none(tmp_path):
    (tmp_path / "eval").mkdir()
    ev = {"math_exact_match": 0.678, "math_exact_match_lo": 0.636, "math_exact_match_hi": 0.717, "val_bpb": 4.4}
    for model, em in (("base", 0.014), ("sft", 0.678), ("ppo", 0.688)):  # no eval of grpo or dpo yet
        (tmp_path / "eval" / f"{model}.json").write_text(json.dumps({**ev, "math_exact_match": em}))
    (tmp_path / "reward.json").write_text('{"accuracy": 0.9625, "margin": 1.39}')
    (tmp_path / "dpo.json").write_text('{"rewards_accuracy": 0.829, "ref_logp_accuracy": 0.834}')
    (tmp_path / "ppo.json").write_text('{"heldout_reward": 0.658, "heldout_kl": 0.0029, "final_kl": 0.0029}')
    (tmp_path / "grpo.json").write_text('{"heldout_reward": true, "heldout_kl": "n/a"}')  # not numbers: left out
    assert headline(tmp_path) == {
        "pretrain": {"em": 0.014, "lo": 0.636, "hi": 0.717, "bpb": 4.4},
        "sft": {"em": 0.678, "lo": 0.636, "hi": 0.717},
        "reward": {"acc": 0.9625},
        "dpo": {"acc": 0.829, "acc_ref": 0.834},
        "ppo": {"em": 0.688, "lo": 0.636, "hi": 0.717, "reward": 0.658, "kl": 0.0029},
    }
    assert headline(tmp_path / "nothing-here") == {}


def test_the_report_reads_a_stage_s_timings_from_its_run_file(tmp_path):
    from llm.eval.report import collect, recorded_seconds

    write_metrics(tmp_path / "metrics/pretrain.json", {"val_loss": 5.3, "train_time_s": 103.2, "device": "cpu"})
    data = collect(tmp_path / "metrics")
    assert data["stages"]["pretrain"] == {"val_loss": 5.3, "train_time_s": 103.2, "device": "cpu"}
    assert recorded_seconds(data["stages"]["pretrain"]) == (103.2, "train_time_s")
