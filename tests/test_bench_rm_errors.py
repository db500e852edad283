"""bench/rm_errors.py: it finds the slipped step of a wrong-answer pair and counts each pair in the right
groups; a missing model is named."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, load_script

SCRIPT = ROOT / "bench" / "rm_errors.py"


def _bench():
    return load_script(SCRIPT)


def test_the_slipped_step_and_its_groups():
    b = _bench()
    # one step, off by one: the last digit differs
    s = b.slip("53 - 31 = 22\n#### 22", "53 - 31 = 23\n#### 23")
    assert s == (0, 1, 22, 23)
    assert b.groups(2, s) == ["|delta| 1-2", "last digit differs", "level 2", "one-step problem"]
    # the first of two steps, off by ten, carried to the end: the first differing line counts
    s = b.slip("28 - 12 = 16\n16 - 9 = 7\n#### 7", "28 - 12 = 26\n26 - 9 = 17\n#### 17")
    assert s == (0, 2, 16, 26)
    assert b.groups(3, s) == ["|delta| >= 10", "last digit same", "level 3", "slip at step 1 of 2"]
    s = b.slip("4 * 6 = 24\n24 + 5 = 29\n#### 29", "4 * 6 = 24\n24 + 5 = 34\n#### 34")
    assert s == (1, 2, 29, 34) and b.groups(3, s)[0] == "|delta| 3-9" and b.groups(3, s)[-1] == "slip at step 2 of 2"
    # not a slip: the same text, a broken format, an answer line only
    assert b.slip("3 + 4 = 7\n#### 7", "3 + 4 = 7\n#### 7") is None
    assert b.slip("3 + 4 = 7\n#### 7", "The answer is 7") is None
    assert b.slip("#### 7", "#### 8") is None


def test_a_missing_model_is_named(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "nope")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "nope: not found; run `dvc repro reward` first" in p.stderr
