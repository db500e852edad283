"""Confidence intervals and pass@k against known values."""
from __future__ import annotations


import pytest

from llm.evaluate import bootstrap_interval, pass_at_k, wilson_interval, z_score


@pytest.mark.parametrize("k,n,lo,hi", [
    # reference values from the closed form (e.g. statsmodels proportion_confint(method="wilson"))
    (50, 100, 0.4038315, 0.5961685),
    (0, 10, 0.0, 0.2775328),
    (10, 10, 0.7224672, 1.0),
    (1, 20, 0.0088814, 0.2361311),
])
def test_wilson_known_counts(k, n, lo, hi):
    a, b = wilson_interval(k, n, 0.95)
    assert a == pytest.approx(lo, abs=1e-6) and b == pytest.approx(hi, abs=1e-6)


def test_wilson_contains_the_estimate_and_narrows_with_n():
    for n in (10, 100, 1000):
        lo, hi = wilson_interval(n // 3, n)
        assert lo <= (n // 3) / n <= hi
    assert (wilson_interval(300, 1000)[1] - wilson_interval(300, 1000)[0]) < \
           (wilson_interval(30, 100)[1] - wilson_interval(30, 100)[0])


def test_z_score():
    assert z_score(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert z_score(0.8) == pytest.approx(1.281552, abs=1e-5)


def test_pass_at_k():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # 1 - C(7,2)/C(10,2) = 1 - 21/45
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)


def test_bootstrap_interval_brackets_the_mean():
    vals = [0.0] * 30 + [1.0] * 70
    lo, hi = bootstrap_interval(vals)
    assert lo < 0.7 < hi
    assert 0.55 < lo and hi < 0.85
    assert bootstrap_interval(vals) == bootstrap_interval(vals)  # seeded


def test_bootstrap_interval_with_counts_is_of_the_ratio_of_sums():
    """With counts (response lengths) the interval is of sum(values) / sum(counts), KL per token:
    one long response with a large sum does not weigh as much as its share of responses."""
    sums, lengths = [0.1] * 50 + [9.0] * 50, [1] * 50 + [100] * 50
    per_token = sum(sums) / sum(lengths)                 # 0.0901
    lo, hi = bootstrap_interval(sums, counts=lengths)
    assert lo < per_token < hi and hi < 0.1
    assert bootstrap_interval([2.0] * 10, counts=[4] * 10) == (0.5, 0.5)
