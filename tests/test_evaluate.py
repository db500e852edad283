"""Confidence intervals and pass@k against known values."""
from __future__ import annotations


import pytest

from llm.eval.evaluate import (CONTEXT_SYSTEM, CONTEXTS, bootstrap_interval, context_items, has_math_template,
                               pass_at_k, score_context, score_multiturn, score_scope, wilson_interval, z_score)


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


def test_second_turns_are_scored_as_math_or_as_tasks_per_kind():
    items = [{"kind": "followup", "lang": "en", "answer": "24"}, {"kind": "followup", "lang": "zh", "answer": "9"},
             {"kind": "new_problem", "lang": "en", "answer": "49"},
             {"kind": "task_after_sum", "lang": "en", "answer": "elbba"},
             {"kind": "task_after_sum", "lang": "en", "answer": "elbba"}]
    responses = ["12 * 2 = 24\n#### 24", "#### 8", "30 + 19 = 49\n#### 49", "elbba", "elbba\n#### 5"]
    m, ok = score_multiturn(items, responses)
    assert ok == [True, False, True, True, False]  # a task answer with a math line after it is not the answer
    assert m["multiturn_exact_match"] == 0.6 and m["multiturn_n"] == 5
    assert m["multiturn_exact_match_followup"] == 0.5 and m["multiturn_exact_match_new_problem"] == 1.0
    assert m["multiturn_exact_match_task_after_sum"] == 0.5
    assert m["multiturn_exact_match_en"] == 0.75 and m["multiturn_exact_match_zh"] == 0.0


def test_out_of_scope_answers_count_as_math_when_they_have_a_math_template():
    statement = "I can solve arithmetic word problems."
    items = [{"prompt": p, "answer": statement, "lang": "en"} for p in ("Write a poem.", "Who was Napoleon?",
                                                                      "Translate hello.", "Opinion?")]
    responses = ["0 - 2 = 8 #### 8", "12+5=17", statement, "Napoleon was born in 1769."]
    m, ok = score_scope(items, responses)
    assert ok == [False, False, True, True]
    assert m["scope_no_math_rate"] == 0.5 and m["scope_exact_match"] == 0.25 and m["scope_n"] == 4
    assert m["scope_no_math_rate_lo"] < 0.5 < m["scope_no_math_rate_hi"]
    assert has_math_template("#### 3") and has_math_template("7 × 6 = 42") and not has_math_template("in 2024 - 2025")


def test_each_question_is_asked_in_every_context_after_an_opening_in_its_language():
    questions = [{"id": "a", "question": "What is 7 + 5?", "lang": "en"},
                 {"id": "b", "question": "7 + 5 等于多少？", "lang": "zh"},
                 {"id": "c", "question": "What is 9 - 4?", "lang": "en"},
                 {"id": "d", "question": "What is 3 * 3?", "lang": "en"}]
    scope = [{"prompt": "Write a poem.", "answer": "I do sums.", "lang": "en"},
             {"prompt": "写一首诗。", "answer": "我会算数。", "lang": "zh"},
             {"prompt": "Who was Napoleon?", "answer": "I do sums.", "lang": "en"}]
    tasks = [{"prompt": "Reverse the word: castle", "answer": "eltsac"}]
    items = context_items(questions, scope, tasks)
    assert [c["context"] for c in items] == [c for c in CONTEXTS for _ in questions]  # context by context
    by = {(c["context"], c["index"]): c["messages"] for c in items}
    assert [by["after_scope", i][0]["content"] for i in range(4)] == [
        "Write a poem.", "写一首诗。", "Who was Napoleon?", "Write a poem."]  # the i-th request in the language
    assert by["after_scope", 1][1] == {"role": "assistant", "content": "我会算数。"}
    assert all(by["after_task", i][:2] == [{"role": "user", "content": "Reverse the word: castle"},
                                           {"role": "assistant", "content": "eltsac"}] for i in range(4))
    assert by["system_short", 1][0] == {"role": "system", "content": CONTEXT_SYSTEM["system_short"]["zh"]}
    assert by["system_helpful", 1][0]["content"] == "You are a helpful assistant."  # what clients send, any language
    assert all(by[k][-1] == {"role": "user", "content": questions[k[1]]["question"]} for k in by)
    assert {c["context"] for c in context_items(questions)} == {c for c in CONTEXTS if c.startswith("system")}
    only_en = context_items(questions[1:2], scope[:1])  # no request in Chinese: any language's
    assert only_en[0]["messages"][0]["content"] == "Write a poem."


def test_a_context_is_scored_beside_the_same_questions_alone_with_the_drop_in_points():
    questions = [{"lang": "en"}, {"lang": "en"}, {"lang": "zh"}, {"lang": "zh"}]
    alone = [True, True, False, True]
    items = [{"context": "after_scope", "index": i} for i in range(4)] + [
        {"context": "system_helpful", "index": i} for i in (0, 2)]
    outcomes = [False, True, False, False, True, True]
    m = score_context("math", questions, alone, items, outcomes, seed=1)
    assert m["context_math_n"] == 4 and m["context_math_alone"] == 0.75
    assert m["context_math_alone_en"] == 1.0 and m["context_math_alone_zh"] == 0.5
    assert m["context_math_after_scope"] == 0.25 and m["context_math_after_scope_en"] == 0.5
    assert m["context_math_after_scope_zh"] == 0.0
    assert m["context_math_after_scope_drop"] == 0.5  # the same four items: 3 right alone, 1 after the request
    assert m["context_math_after_scope_drop_lo"] <= 0.5 <= m["context_math_after_scope_drop_hi"]
    assert m["context_math_system_helpful"] == 1.0
    assert m["context_math_system_helpful_drop"] == -0.5  # items 0 and 2: one right alone, both with it
    assert not any("after_task" in k for k in m)  # a context without items has no keys
