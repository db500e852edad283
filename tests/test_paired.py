"""Paired comparisons of a model with its parent: McNemar's exact test, the paired bootstrap,
and the skills read from per-item outcomes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llm.eval.paired import (bootstrap_binary, bootstrap_mean, compare, linear_trend, mcnemar_exact, read_items,
                             rm_separation, separation, skills)


@pytest.mark.parametrize("b,c,p", [(0, 5, 2 / 32), (1, 9, 2 * 11 / 1024), (5, 0, 2 / 32), (3, 3, 1.0), (0, 0, 1.0),
                                   (0, 1, 1.0)])
def test_mcnemar_exact_by_hand(b, c, p):
    # two-sided: twice the smaller binomial tail of b + c fair coins, capped at 1
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_mcnemar_exact_matches_scipy_binomial_test():
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(12, 30), (40, 41), (7, 0), (100, 130), (1, 20)]:
        assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


def test_multinomial_bootstrap_equals_resampling_the_items():
    """One multinomial draw per resample is the same distribution as resampling n items."""
    n, b, c = 300, 30, 12
    d = np.array([1] * b + [-1] * c + [0] * (n - b - c), dtype=float)
    lo, hi = bootstrap_binary(b, c, n, confidence=0.95, n_boot=40000, rng=np.random.default_rng(0))
    lo2, hi2 = bootstrap_mean(d, confidence=0.95, n_boot=40000, rng=np.random.default_rng(1))
    assert (lo, hi) == pytest.approx((lo2, hi2), abs=0.004)
    # and both agree with the normal approximation: sd of the mean of d
    sd = np.sqrt(((d - d.mean()) ** 2).mean() / n)
    assert (lo, hi) == pytest.approx((d.mean() - 1.96 * sd, d.mean() + 1.96 * sd), abs=0.005)


def _items(math: list[int], rm: list[float] | None = None, **per_set) -> list[dict]:
    out = [{"set": "math", "id": f"m{i}", "lang": "en" if i % 2 else "zh", "level": 1 + i % 4, "correct": bool(c),
            "formatted": True} for i, c in enumerate(math)]
    out += [{"set": "rm", "id": f"m{i}", "score": s} for i, s in enumerate(rm or [])]
    for name, outcomes in per_set.items():
        out += [{"set": "task", "id": f"{name}{i}", "kind": name, "correct": bool(c)} for i, c in enumerate(outcomes)]
    return out


def test_compare_counts_discordant_items_and_pairs_by_id():
    parent = _items([1, 1, 0, 0, 0, 0, 1, 0])
    child = _items([1, 0, 1, 1, 1, 0, 1, 0])  # item 1 lost, items 2, 3, 4 won
    r = compare(child, parent, n_boot=2000, seed=0)["math"]
    assert (r["wins"], r["losses"], r["n"]) == (3, 1, 8)
    assert r["delta"] == pytest.approx(2 / 8) and r["value"] == 5 / 8 and r["parent_value"] == 3 / 8
    assert r["p_value"] == pytest.approx(mcnemar_exact(3, 1)) and not r["significant"]
    assert r["lo"] <= r["delta"] <= r["hi"]
    # the same outcomes listed in another order pair up the same way
    assert compare(child[::-1], parent, n_boot=2000, seed=0)["math"]["delta"] == r["delta"]
    # an item only one model has is left out and counted
    r2 = compare(child + [{"set": "math", "id": "extra", "correct": True, "formatted": True}], parent,
                 n_boot=2000, seed=0)["math"]
    assert r2["n"] == 8 and r2["unpaired"] == 1


def test_a_large_consistent_gain_is_significant_and_no_change_is_not():
    parent = _items([0] * 100 + [1] * 100)
    child = _items([1] * 40 + [0] * 60 + [1] * 100)  # 40 wins, 0 losses
    r = compare(child, parent, n_boot=4000, seed=0)["math"]
    assert r["significant"] and not r["borderline"] and r["lo"] > 0 and r["p_value"] < 1e-9
    same = compare(parent, parent, n_boot=4000, seed=0)["math"]
    assert same["delta"] == 0 and same["p_value"] == 1.0 and not same["significant"]
    assert (same["lo"], same["hi"]) == (0.0, 0.0)


def test_when_the_test_and_the_interval_disagree_the_change_is_borderline():
    # 5 wins, no loss in 500 items: McNemar p = 2 / 32 = 0.0625, but no bootstrap resample is
    # likely to draw none of the 5 (P = 0.99^500 < 0.01), so the interval excludes zero
    parent = _items([0] * 5 + [1] * 495)
    r = compare(_items([1] * 500), parent, n_boot=4000, seed=0)["math"]
    assert r["p_value"] == pytest.approx(0.0625) and r["lo"] > 0
    assert r["borderline"] and not r["significant"]


def test_scores_are_compared_by_their_mean_difference():
    parent = _items([1, 0, 1], rm=[0.1, -0.2, 0.3])
    r = compare(_items([1, 0, 1], rm=[1.1, 0.8, 1.3]), parent, n_boot=1000, seed=0)["rm_score"]
    assert r["type"] == "score" and "p_value" not in r
    assert r["delta"] == pytest.approx(1.0) and r["lo"] == pytest.approx(1.0) and r["hi"] == pytest.approx(1.0)
    assert r["significant"]


def test_skills_follow_the_items_and_results_are_reproducible():
    items = _items([1, 0, 1, 1], rm=[0.0, 1.0], reverse=[1, 0], sort=[0, 1])
    keys = [k for k, *_ in skills(items)]
    assert keys == ["math", "math_en", "math_zh", "math_level1", "math_level2", "math_level3", "math_level4",
                    "math_format", "task", "task_reverse", "task_sort", "rm_score"]
    other = _items([0, 0, 1, 0], rm=[0.5, 0.5], reverse=[1, 1], sort=[1, 1])
    a = compare(items, other, n_boot=500, seed=3, child_name="ppo")
    assert a == compare(items, other, n_boot=500, seed=3, child_name="ppo")
    assert (a["task_reverse"]["n"], a["task_reverse"]["delta"]) == (2, -0.5)
    assert (a["math_en"]["n"], a["math_en"]["value"], a["math_en"]["parent_value"]) == (2, 0.5, 0.0)


def test_an_id_twice_in_one_set_is_refused():
    items = _items([1, 0])
    with pytest.raises(ValueError, match="item 'm0' of set 'math' appears twice"):
        compare(items + items[:1], items, n_boot=100)


def test_read_items_names_a_bad_line(tmp_path):
    f = tmp_path / "sft_items.jsonl"
    f.write_text(json.dumps({"set": "math", "id": "a", "correct": True}) + "\n{oops\n")
    with pytest.raises(ValueError, match="sft_items.jsonl:2: not JSON"):
        read_items(f)
    f.write_text(json.dumps({"id": "a"}) + "\n")
    with pytest.raises(ValueError, match=":1: expected an object with 'set' and 'id'"):
        read_items(f)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_separation_is_the_share_of_right_wrong_pairs_ranked_right():
    # right answers 3, 1, 2; wrong ones 0, 2, 5: of the 9 (right, wrong) pairs the right one is
    # higher in 4 (3 > 0, 3 > 2, 1 > 0, 2 > 0) and tied in 1 (2 = 2): 4.5 / 9
    r = separation([3.0, 0.0, 1.0, 2.0, 2.0, 5.0], [True, False, True, False, True, False], rng=_rng())
    assert r["auc"] == pytest.approx(4.5 / 9)
    assert (r["n_right"], r["n_wrong"]) == (3, 3)
    assert r["mean_right"] == pytest.approx(2.0) and r["mean_wrong"] == pytest.approx(7 / 3)
    assert 0.0 <= r["lo"] <= r["auc"] <= r["hi"] <= 1.0
    full = separation([5.0, 6.0, 1.0, 0.5], [True, True, False, False], rng=_rng())
    assert full["auc"] == full["lo"] == full["hi"] == 1.0  # every resample keeps the order
    assert separation([5.0, 6.0, 1.0, 0.5], [False, False, True, True], rng=_rng())["auc"] == 0.0
    assert separation([1.0, 2.0], [True, True], rng=_rng()) is None  # nothing wrong to rank against
    with pytest.raises(ValueError, match="2 scores but 1 labels"):
        separation([1.0, 2.0], [True], rng=_rng())


def test_separation_is_mann_whitney_and_its_bootstrap_is_the_brute_force_one():
    g = _rng(5)
    right = g.random(300) < 0.8
    scores = np.round(g.normal(size=300) + 0.7 * right, 1)  # rounded: many ties
    r = separation(scores, right, n_boot=300, rng=_rng(3))
    pos, neg = scores[right], scores[~right]
    brute = lambda p, q: ((p[:, None] > q[None, :]) + 0.5 * (p[:, None] == q[None, :])).mean()  # noqa: E731
    assert r["auc"] == pytest.approx(brute(pos, neg), abs=1e-12)
    # the same draws, made by hand: resample each group, count the pairs
    rng = _rng(3)  # in one chunk: the 300 right-answer draws, then the 300 wrong-answer draws
    cps = rng.multinomial(len(pos), np.full(len(pos), 1 / len(pos)), size=300)
    cns = rng.multinomial(len(neg), np.full(len(neg), 1 / len(neg)), size=300)
    boots = [brute(np.repeat(pos, cp), np.repeat(np.sort(neg), cn)) for cp, cn in zip(cps, cns)]
    assert (r["lo"], r["hi"]) == pytest.approx(tuple(np.quantile(boots, [0.025, 0.975])), abs=1e-12)
    assert 0.55 < r["lo"] < r["auc"] < r["hi"]  # a real separation is found
    assert separation(scores, right, n_boot=300, rng=_rng(3)) == r  # seeded


def test_rm_separation_joins_the_rm_scores_with_the_math_outcomes_by_id():
    items = [{"set": "math", "id": f"p{i}", "correct": i % 3 == 0} for i in range(9)]
    items += [{"set": "rm", "id": f"p{i}", "score": float(i % 3 == 0) + 0.1 * i} for i in (8, 0, 3, 4, 5, 6)]
    items += [{"set": "rm", "id": "not-scored-for-math", "score": 9.0}, {"set": "task", "id": "p1", "correct": True}]
    r = rm_separation(items, seed=1)
    assert (r["n_right"], r["n_wrong"]) == (3, 3) and r["auc"] == 1.0  # p0, p3, p6 right, all above
    assert r["mean_right"] == pytest.approx(1.3) and r["mean_wrong"] == pytest.approx(0.5 + 2 / 30)
    assert rm_separation([i for i in items if i["set"] != "rm"]) is None  # no reward model
    assert rm_separation([i for i in items if i["set"] != "math"]) is None


def test_linear_trend_is_the_fitted_lines_change_with_a_t_interval():
    from scipy import stats
    g = _rng(2)
    x = np.arange(1, 61)
    y = 0.7 + 0.002 * x + g.normal(scale=0.05, size=60)
    r = linear_trend(x, y)
    fit = stats.linregress(x, y)
    assert r["change"] == pytest.approx(fit.slope * 59, rel=1e-9) and r["n"] == 60
    half = stats.t.ppf(0.975, 58) * fit.stderr * 59
    assert (r["lo"], r["hi"]) == pytest.approx((fit.slope * 59 - half, fit.slope * 59 + half), abs=1e-4)
    assert r["lo"] > 0  # 0.118 over the run against noise of 0.05 a step: found
    flat = linear_trend(x, 0.7 + g.normal(scale=0.05, size=60))
    assert flat["lo"] < 0 < flat["hi"]
    exact = linear_trend([1, 2, 3, 4], [1.0, 3.0, 5.0, 7.0])  # on the line: no spread
    assert exact == {"change": pytest.approx(6.0), "lo": pytest.approx(6.0), "hi": pytest.approx(6.0), "n": 4}
    assert linear_trend([1, 2, np.nan, 4], [1.0, 3.0, 5.0, float("nan")]) is None  # 2 finite points
    assert linear_trend([3, 3, 3], [1.0, 2.0, 3.0]) is None  # a single x


def test_second_turns_and_out_of_scope_answers_are_compared_when_evaluated():
    def items(multiturn, scope):
        return ([{"set": "multiturn", "id": f"t{i}", "kind": "followup", "correct": bool(c)}
                 for i, c in enumerate(multiturn)]
                + [{"set": "scope", "id": f"s{i}", "correct": bool(c)} for i, c in enumerate(scope)])
    assert not {"multiturn", "scope"} & {k for k, *_ in skills(_items([1, 0]))}
    child, parent = _items([1, 0]) + items([1, 1], [1, 1, 1]), _items([1, 0]) + items([0, 1], [0, 0, 1])
    out = compare(child, parent, n_boot=200, seed=0)
    assert (out["multiturn"]["n"], out["multiturn"]["delta"]) == (2, 0.5)
    assert (out["scope"]["n"], out["scope"]["delta"]) == (3, pytest.approx(2 / 3))


def test_items_asked_again_in_a_context_are_compared_per_context_over_the_same_items():
    def asked(of, ctx, outcomes):  # as llm/eval/evaluate.py writes them: id "<of>:<context>:<item id>"
        return [{"set": "context", "id": f"{of}:{ctx}:q{i}", "of": of, "context": ctx, "lang": "en",
                 "correct": bool(c)} for i, c in enumerate(outcomes)]
    child = (_items([1, 1, 1, 1]) + asked("math", "after_scope", [0, 0, 0, 1])
             + asked("math", "system_short", [1, 1, 1, 1]) + asked("arithmetic", "after_scope", [1, 1]))
    parent = (_items([1, 1, 1, 1]) + asked("math", "after_scope", [1, 1, 1, 0])
              + asked("math", "system_short", [1, 1, 1, 1]) + asked("arithmetic", "after_scope", [1, 0])
              + asked("arithmetic", "after_task", [1, 1]))
    keys = [k for k, *_ in skills(child + parent)]
    assert keys[-4:] == ["context_math_after_scope", "context_math_system_short", "context_arithmetic_after_scope",
                         "context_arithmetic_after_task"]
    out = compare(child, parent, n_boot=500, seed=0, child_name="grpo")
    r = out["context_math_after_scope"]  # math alone unchanged; after an out-of-scope turn 3 lost, 1 won
    assert r["label"] == "math after an out-of-scope request" and r["type"] == "rate"
    assert (r["n"], r["wins"], r["losses"], r["delta"]) == (4, 1, 3, -0.5)
    assert r["p_value"] == pytest.approx(mcnemar_exact(1, 3)) and r["lo"] <= r["delta"] <= r["hi"]
    assert (out["context_math_system_short"]["delta"], out["context_math_system_short"]["n"]) == (0.0, 4)
    assert (out["context_arithmetic_after_scope"]["wins"], out["context_arithmetic_after_scope"]["n"]) == (1, 2)
    assert "context_arithmetic_after_task" not in out  # only the parent was asked there: nothing paired
    assert out["math"]["delta"] == 0.0 and out["math"]["n"] == 4  # the context items stay out of math
