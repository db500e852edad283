"""bench/optim.py's figures: the step at which a run reaches the target, its seconds, the paired ratios."""
from __future__ import annotations

import pytest

from conftest import ROOT, load_script

bench = load_script(ROOT / "bench/optim.py", "bench_optim")


def test_the_step_that_reaches_a_loss_is_linear_between_evaluations():
    evals = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.8)]
    assert bench.steps_to(evals, 3.5) == pytest.approx(15.0)   # halfway from 4.0 at 10 to 3.0 at 20
    assert bench.steps_to(evals, 3.0) == 20.0
    assert bench.steps_to(evals, 2.5) is None                  # never reached


def test_seconds_count_the_steps_up_to_a_fractional_step():
    assert bench.seconds_to([1.0, 2.0, 4.0], 1.5) == pytest.approx(1.0 + 0.5 * 2.0)
    assert bench.seconds_to([1.0, 2.0, 4.0], 3.0) == pytest.approx(7.0)


def test_ratios_are_to_the_adamw_runs_steps_and_seconds_at_its_final_loss():
    adamw = {"evals": [(0, 5.0), (2, 4.0), (4, 3.0)], "step_s": [1.0] * 4}
    muon = {"evals": [(0, 5.0), (2, 3.0), (4, 2.0)], "step_s": [2.0] * 4}
    got = bench.compare(adamw, muon)
    assert got["target_val_loss"] == 3.0 and got["final_val_loss"] == 2.0
    assert (got["steps"], got["steps_ratio"], got["seconds_ratio"]) == (2.0, 0.5, 1.0)  # half the steps, twice as slow
    assert bench.compare(muon, adamw)["steps_ratio"] is None  # AdamW never reaches Muon's 2.0


def test_muon_share_is_the_blocks_matrices_over_all_parameters():
    from llm.config import ModelConfig, load_params_text
    from llm.nn.model import GPT

    model = GPT(ModelConfig(vocab_size=64, n_embd=16, n_head=2, n_kv_head=2, n_layer=1, seq_len=32))
    # counted by hand: the tied token table 64 x 16 and three gains of 16 stay with AdamW; the block's
    # q/k/v 48 x 16, attention's output 16 x 16, the MLP's 128 x 16 and 16 x 64 go to Muon
    muon = 48 * 16 + 16 * 16 + 128 * 16 + 16 * 64
    assert bench.muon_share(model, load_params_text((ROOT / "params.yaml").read_text()).pretrain) == pytest.approx(muon / (muon + 64 * 16 + 3 * 16))
