"""The embedded-default generators: deterministic, arithmetic right, splits disjoint."""
from __future__ import annotations

import random
import re

import pytest

from llm.generators import (TASK_KINDS, MathProblem, arithmetic_question, math_problem, preference_pair, task,
                            task_preference_pair, wrong_solution)

_STEP = re.compile(r"^(-?\d+) ([-+*/]) (\d+) = (-?\d+)$")


def _check_solution(p: MathProblem) -> None:
    lines = p.solution.split("\n")
    assert lines[-1] == f"#### {p.answer}"
    prev = None
    for line in lines[:-1]:
        a, op, b, c = _STEP.match(line).groups()
        a, b, c = int(a), int(b), int(c)
        if prev is not None:
            assert a == prev, "each step starts from the previous result"
        assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
        if op == "/":
            assert a % b == 0
        prev = c
    assert prev == p.answer


@pytest.mark.parametrize("level", [1, 2, 3, 4])
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_every_final_answer_equals_the_worked_result(level, lang):
    rng = random.Random(level * 7 + len(lang))
    for _ in range(1500):
        p = math_problem(rng, level, lang)
        _check_solution(p)
        assert p.answer >= 0
        assert len(p.steps) == {1: 1, 2: 1, 3: 2, 4: 3}[level]


def test_generators_are_deterministic():
    a = [math_problem(random.Random(5), 3, "en") for _ in range(3)]
    b = [math_problem(random.Random(5), 3, "en") for _ in range(3)]
    assert a == b
    assert [task(random.Random(9)) for _ in range(3)] == [task(random.Random(9)) for _ in range(3)]


def test_chinese_problems_are_chinese():
    p = math_problem(random.Random(0), 2, "zh")
    assert re.search(r"[\u4e00-\u9fff]", p.question)


def test_task_answers_are_right():
    rng = random.Random(3)
    for _ in range(500):
        t = task(rng)
        assert t.answer != t.wrong
        if t.kind == "reverse":
            word = t.prompt.split()[-1] if ":" in t.prompt else t.prompt.split()[1]
            assert t.answer == word[::-1]
        elif t.kind == "sort":
            nums = [int(x) for x in t.prompt.split(": ")[1].split(", ")]
            assert t.answer == ", ".join(map(str, sorted(nums)))
        elif t.kind == "count_words":
            assert int(t.answer) == len(t.prompt.split(": ")[1].split())
        elif t.kind == "max":
            assert int(t.answer) == max(int(x) for x in t.prompt.split(": ")[1].split(", "))


def test_a_task_of_a_given_kind_is_of_that_kind():
    rng = random.Random(4)
    for kind in TASK_KINDS:
        assert {task(rng, kind).kind for _ in range(20)} == {kind}
    with pytest.raises(ValueError, match="unknown kind 'revers'"):
        task(rng, "revers")


_SUM = re.compile(r"^(?:What is )?(\d+) ([-+*/]) (\d+)(?:\?| 等于多少？)$")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_arithmetic_questions_state_a_sum_and_its_value(lang):
    rng = random.Random(8)
    ops = set()
    for _ in range(2000):
        q = arithmetic_question(rng, lang)
        a, op, b = _SUM.match(q.question).groups()
        a, b = int(a), int(b)
        assert q.question.startswith("What is ") == (lang == "en") and q.lang == lang and q.op == op
        assert q.answer == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op] >= 0
        if op == "/":
            assert a % b == 0
        assert q.expression == f"{a} {op} {b}" and q.solution == f"{a} {op} {b} = {q.answer}\n#### {q.answer}"
        ops.add(op)
    assert ops == set("+-*/")
    assert arithmetic_question(random.Random(1), lang) == arithmetic_question(random.Random(1), lang)


def test_wrong_solutions_are_wrong_and_well_formatted():
    rng = random.Random(11)
    for level in (1, 2, 3, 4):
        for _ in range(300):
            p = math_problem(rng, level, "en")
            w = wrong_solution(p, rng)
            assert w.split("\n")[-1].startswith("#### ")
            assert w.split("\n")[-1] != f"#### {p.answer}"


def test_preference_pairs():
    rng = random.Random(2)
    kinds = set()
    for _ in range(200):
        pair = preference_pair(rng, 2, "en", broken_fraction=0.5)
        kinds.add(pair["kind"])
        assert pair["chosen"] != pair["rejected"]
        assert pair["chosen"].split("\n")[-1].startswith("#### ")
        if pair["kind"] == "broken_format":
            assert "####" not in pair["rejected"]
    assert kinds == {"broken_format", "wrong_answer"}
    t = task_preference_pair(rng)
    assert t["chosen"] != t["rejected"]
