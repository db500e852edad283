"""llm/train/finish.py: the end every training stage shares (gates, model, curves, metrics) and the one shape of a failed gate."""
from __future__ import annotations

import json

import pytest

from llm.errors import QualityGateError
from llm.train.finish import Gate, finish_stage
from tests.test_grpo import tiny


class _Tok:
    """What save_model_dir needs of a tokenizer, and no more."""

    def save(self, path):
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.json").write_text("{}")


def _finish(tmp_path, gates, numbers):
    run_dir = tmp_path / "runs/ppo"
    (run_dir / "plots").mkdir(parents=True)
    (run_dir / "plots/ppo.tsv").write_text("step\treward\trollout_s\ttokens_per_s\n1\t0.5\t0.25\t1200.0\n")
    return finish_stage("ppo", gates=gates, run_dir=run_dir, model=tmp_path / "models/ppo", weights=tiny(),
                        tokenizer=_Tok(), meta={"stage": "ppo"}, plots=tmp_path / "metrics/plots",
                        metrics=tmp_path / "metrics/ppo.json", numbers=numbers)


def _kl_gate(kl: float) -> Gate:
    return Gate("final KL to the reference", kl, "max", "ppo.max_kl", 0.2, advice="Lower ppo.lr")


def test_a_failed_gate_writes_only_the_run_s_numbers_and_says_gate_measured_limit_and_key(tmp_path):
    with pytest.raises(QualityGateError) as e:
        _finish(tmp_path, [_kl_gate(0.31)], {"final_kl": 0.31, "train_time_s": 3.0})
    assert str(e.value).startswith("ppo: quality gate failed: final KL to the reference 0.31 is above ppo.max_kl=0.2.")
    assert "Lower ppo.lr; no model was written" in str(e.value)
    assert (e.value.measured, e.value.limit, e.value.key) == (0.31, 0.2, "ppo.max_kl")
    assert json.loads((tmp_path / "runs/ppo/failed_metrics.json").read_text())["final_kl"] == 0.31
    assert not (tmp_path / "models").exists() and not (tmp_path / "metrics").exists()


def test_a_passed_gate_writes_the_model_the_curves_and_the_metrics(tmp_path):
    _finish(tmp_path, [_kl_gate(0.2)], {"final_kl": 0.2, "train_time_s": 3.0})  # at the limit: passes
    assert (tmp_path / "models/ppo/model.safetensors").is_file()
    # the published curves lose their timings (the run directory's keep them): a rerun writes the same bytes
    assert (tmp_path / "metrics/plots/ppo.tsv").read_text() == "step\treward\n1\t0.5\n"
    assert "tokens_per_s" in (tmp_path / "runs/ppo/plots/ppo.tsv").read_text()
    assert json.loads((tmp_path / "metrics/ppo.json").read_text()) == {"final_kl": 0.2}
    assert json.loads((tmp_path / "runs/ppo/run.json").read_text()) == {"train_time_s": 3.0}


def test_the_timings_go_to_the_run_directory_the_stage_was_given(tmp_path):
    run_dir = tmp_path / "elsewhere" / "my-run"
    (run_dir / "plots").mkdir(parents=True)
    finish_stage("ppo", run_dir=run_dir, model=tmp_path / "models/ppo", weights=tiny(), tokenizer=_Tok(),
                 meta={"stage": "ppo"}, plots=tmp_path / "metrics/plots", metrics=tmp_path / "metrics/ppo.json",
                 numbers={"final_kl": 0.2, "train_time_s": 3.0})
    assert json.loads((run_dir / "run.json").read_text()) == {"train_time_s": 3.0}
    assert not (tmp_path / "runs").exists()  # not beside metrics/, where another run's timings may be


@pytest.mark.parametrize("bound,measured,failed", [("max", 0.21, True), ("max", 0.2, False), ("min", 0.19, True),
                                                   ("min", 0.2, False), ("min", float("nan"), True),
                                                   ("max", float("inf"), True), ("under", 0.2, True),
                                                   ("under", 0.19, False)])
def test_a_gate_fails_beyond_its_limit_or_on_a_measurement_that_is_not_finite(bound, measured, failed):
    assert Gate("g", measured, bound, "x.limit", 0.2, advice="").failed() is failed


def test_a_count_that_reaches_its_limit_is_reported_at_it():
    """An "under" gate (a streak that must not reach its limit) says "at" the limit, not "above"."""
    assert "g 3 is at x.limit=3 (d). Do less; c" in str(Gate("g", 3, "under", "x.limit", 3, advice="Do less",
                                                               detail="d").error("s", "c"))
    assert "g 4 is above x.limit=3" in str(Gate("g", 4, "under", "x.limit", 3, advice="").error("s", "c"))
