"""bench/math_sampling.py: slips, the majority answer and the table are right on hand-made answers; a
missing model is named."""
from __future__ import annotations

import subprocess
import sys
from decimal import Decimal

import pytest
from conftest import ROOT, load_script

SCRIPT = ROOT / "bench" / "math_sampling.py"


def _bench():
    return load_script(SCRIPT)


def test_a_slip_is_a_wrong_equation_result():
    b = _bench()
    assert not b.has_slip("26 * 3 = 78\n78 - 6 = 72\n#### 72")
    assert b.has_slip("26 * 3 = 77\n77 - 6 = 71\n#### 71")
    assert b.has_slip("26 * 3 = 78\n78 - 6 = 71\n#### 71")       # the last step
    assert not b.has_slip("144 / 9 = 16\n#### 16") and b.has_slip("144 / 9 = 17\n#### 17")
    assert b.has_slip("7 / 2 = 3\n#### 3")                         # not exact
    assert not b.has_slip("5 - 8 = -3\n#### -3") and b.has_slip("4 / 0 = 0")
    assert not b.has_slip("The answer is 12.") and not b.has_slip("")  # no equation: no slip


def test_majority_answer_and_ties():
    b = _bench()
    assert b.majority(["#### 5", "1 + 4 = 5\n#### 5", "#### 6"]) == Decimal(5)
    assert b.majority(["#### 6", "#### 5", "#### 5", "#### 6"]) == Decimal(6)   # a tie: seen first
    assert b.majority(["no number", "#### 1,200"]) == Decimal(1200)
    assert b.majority(["nothing", "here"]) is None


def test_summary_table():
    b = _bench()
    problems = [{"answer": "5", "level": 1}, {"answer": "9", "level": 2}]
    greedy = ["2 + 3 = 5\n#### 5", "4 + 4 = 8\n#### 8"]
    samples = [["2 + 3 = 5\n#### 5", "2 + 3 = 6\n#### 6", "2 + 3 = 5\n#### 5", "#### 7"],
               ["4 + 5 = 8\n#### 8", "4 + 5 = 9\n#### 9", "4 + 5 = 8\n#### 8", "4 + 4 = 9\n#### 9"]]
    t = b.summarize(problems, greedy, samples)
    assert list(t) == ["all", "level 1", "level 2"]
    assert t["level 1"] == {"n": 1, "greedy": 1.0, "sampled": 0.5, "maj": 1.0, "pass": 1.0,
                            "slips": pytest.approx(0.5), "lucky": 0.0}
    # level 2: greedy wrong, the majority (8, seen first in a 2-2 tie) wrong, one sample right through a slip
    assert t["level 2"] == {"n": 1, "greedy": 0.0, "sampled": 0.5, "maj": 0.0, "pass": 1.0, "slips": 1.0,
                            "lucky": 0.5}
    assert t["all"]["n"] == 2 and t["all"]["greedy"] == 0.5 and t["all"]["slips"] == pytest.approx(3 / 4)


def test_a_missing_model_is_named(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "nope")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "nope: not found; run `dvc repro sft` first" in p.stderr
