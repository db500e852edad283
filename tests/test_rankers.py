"""Math rankers (llm/post/rankers.py): pair accuracy, its greedy-wrong slice and best-of-n, on
candidates whose answers and scores are known."""
import numpy as np
import pytest

from llm.post.rankers import agreement_with, best_of_n, ranker_table


def _cand(right, greedy_right=False, texts=None):
    texts = texts or [f"#### {i}" for i in range(len(right))]
    return {"prompt_ids": [1], "answer": "0", "greedy": "#### 99", "samples": texts, "greedy_right": greedy_right,
            "right": list(right)}


def test_agreement_counts_the_other_samples_with_the_same_final_number():
    samples = ["1 + 1 = 2\n#### 2", "#### 2", "#### 3", "no number here"]
    assert agreement_with(samples, samples) == [1.0, 1.0, 0.0, 0.0]
    # a text that is not one of the samples (the greedy answer) is counted against all of them
    assert agreement_with(samples, [*samples, "#### 2"])[-1] == 2.0


def test_pair_accuracy_and_the_greedy_wrong_slice():
    """Problem 1: right answers score 3 and 1, wrong ones 2 and 0: 3 of 4 pairs ordered right.
    Greedy is wrong and scores 2.5: of the right samples, one (3) is above it."""
    c = _cand([True, False, True, False])
    t = ranker_table([c], {"s": [[3.0, 2.0, 1.0, 0.0]]}, {"s": [2.5]}, confidence=0.95, seed=0)["rankers"]["s"]
    assert t["pair_accuracy"] == 0.75 and t["pairs"] == 4
    assert t["greedy_wrong_accuracy"] == 0.5 and t["greedy_wrong_pairs"] == 2
    # a tie counts half; a right greedy answer leaves the problem out of the slice
    t = ranker_table([_cand([True, False], greedy_right=True)], {"s": [[1.0, 1.0]]}, {"s": [0.0]},
                     confidence=0.95, seed=0)["rankers"]["s"]
    assert t["pair_accuracy"] == 0.5 and t["greedy_wrong_accuracy"] is None and t["greedy_wrong_pairs"] == 0


def test_best_of_n_of_a_perfect_ranker_is_pass_at_n_and_of_a_constant_one_the_sampled_accuracy():
    rng = np.random.default_rng(0)
    cands = [_cand(rng.random(8) < p) for p in (0.1, 0.3, 0.5, 0.5, 0.8, 0.0, 1.0)]
    perfect = [[float(x) for x in c["right"]] for c in cands]
    table = ranker_table(cands, {"perfect": perfect, "flat": [[0.0] * 8 for _ in cands]},
                         {"perfect": [0.0] * len(cands), "flat": [0.0] * len(cands)}, confidence=0.95, seed=1)
    assert table["rankers"]["perfect"]["best_of_n"] == pytest.approx(table["pass_at_n"])
    assert table["rankers"]["perfect"]["pair_accuracy"] == 1.0
    # a constant score picks at random among all: the sampled accuracy at every n
    flat = best_of_n(cands, [[0.0] * 8 for _ in cands])
    assert np.allclose(flat, flat[:, :1]) and table["rankers"]["flat"]["pair_accuracy"] == 0.5
    # scores 3, 2, 1 with only the second right: best of 1 is 1/3; of 2, the pair {2, 1} of three pairs
    assert best_of_n([_cand([False, True, False])], [[3.0, 2.0, 1.0]])[0] == pytest.approx([1 / 3, 1 / 3, 0.0])
    assert table["random"][0] == pytest.approx(np.mean([c["right"] for c in cands]))


def test_pass_at_n_uses_the_unbiased_estimator():
    t = ranker_table([_cand([True, False, False, False])], {"s": [[0.0] * 4]}, {"s": [0.0]}, confidence=0.9, seed=0)
    assert t["pass_at_n"] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_best_of_n_is_compared_with_greedy_and_with_the_likelihood_paired_over_problems():
    """Problem 1: one right answer of two, greedy wrong; problem 2: none right, greedy right. A
    perfect ranker's best of 2 is 1 and 0, greedy 0 and 1: no change; a constant likelihood picks
    at random, 0.5 and 0: the perfect ranker is 0.25 above it."""
    cands = [_cand([True, False]), _cand([False, False], greedy_right=True)]
    t = ranker_table(cands, {"likelihood": [[0.0, 0.0], [0.0, 0.0]], "s": [[1.0, 0.0], [0.0, 0.0]]},
                     {}, confidence=0.95, seed=0)["rankers"]
    assert t["s"]["best_of_n_vs_greedy"] == pytest.approx(0.0)
    assert t["s"]["best_of_n_vs_likelihood"] == pytest.approx(0.25)
    assert t["s"]["best_of_n_vs_likelihood_lo"] <= 0.25 <= t["s"]["best_of_n_vs_likelihood_hi"]
    assert t["likelihood"]["best_of_n_vs_greedy"] == pytest.approx(-0.25)
    assert "best_of_n_vs_likelihood" not in t["likelihood"]
