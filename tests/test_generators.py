"""The embedded-default generators: deterministic, arithmetic right, splits disjoint."""
from __future__ import annotations

import random
import re

import pytest

from llm.data.generators import (_FOLLOWUPS_EN, _FOLLOWUPS_ZH, CONTEXT_OPENINGS, MULTITURN_KINDS, SCOPE_ANSWER,
                                 SYSTEM_MESSAGES, TASK_KINDS, MathProblem, arithmetic_question, context_conversation,
                                 math_problem, multiturn_conversation, preference_pair, scope_prompt_count,
                                 scope_request, task, task_preference_pair, wrong_solution)

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


_FOLLOWUP_OPS = {**{t: op for op, ts in _FOLLOWUPS_EN.items() for t in ts},
                 **{t: op for op, ts in _FOLLOWUPS_ZH.items() for t in ts}}


def _followup_op(question: str) -> tuple[str, int]:
    """The operation and operand a follow-up asks, read from its template."""
    for template, op in _FOLLOWUP_OPS.items():
        m = re.fullmatch(re.escape(template).replace(r"\{n\}", r"(\d+)"), question)
        if m:
            return op, int(m.group(1))
    raise AssertionError(f"not a follow-up: {question!r}")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_multiturn_second_answers_follow_from_the_earlier_turns(lang):
    """Every conversation is user, assistant, user, assistant; a follow-up's answer is its
    operation applied to the first answer's `#### N`; a new problem's and a task's answer are
    their own, whatever came before."""
    rng = random.Random(11)
    kinds = set()
    for _ in range(600):
        c = multiturn_conversation(rng, lang, levels=(1, 2, 3, 4))
        kinds.add(c.kind)
        assert [m["role"] for m in c.messages] == ["user", "assistant", "user", "assistant"]
        assert all(m["content"].strip() for m in c.messages)
        first, last = c.messages[1]["content"], c.messages[3]["content"]
        previous = int(first.rsplit("#### ", 1)[1])
        if c.kind == "followup":
            op, n = _followup_op(c.messages[2]["content"])
            value = {"+": previous + n, "-": previous - n, "*": previous * n, "/": previous // n}[op]
            assert value >= 0 and (op != "/" or previous % n == 0)
            assert last == f"{previous} {op} {n} = {value}\n#### {value}" and c.answer == str(value)
        elif c.kind == "new_problem":
            assert last.endswith(f"#### {c.answer}")
        else:
            assert c.answer == last and "####" not in last and c.expressions
    assert kinds == set(MULTITURN_KINDS)
    again = random.Random(11)
    assert multiturn_conversation(again, lang, levels=(1, 2, 3, 4)) == multiturn_conversation(
        random.Random(11), lang, levels=(1, 2, 3, 4))


def test_out_of_scope_requests_get_the_statement_of_what_the_model_can_do():
    rng = random.Random(3)
    for lang in ("en", "zh"):
        requests = [scope_request(rng, lang) for _ in range(300)]
        assert {r.answer for r in requests} == {SCOPE_ANSWER[lang]}
        assert len({r.prompt for r in requests}) > 25  # many different requests, one answer
    assert not any("####" in a or re.search(r"\d", a) for a in SCOPE_ANSWER.values())


def test_scope_prompt_count_is_what_the_generator_reaches():
    for lang in ("en", "zh"):
        rng = random.Random(1)
        seen = {scope_request(rng, lang).prompt for _ in range(40 * scope_prompt_count(lang))}
        assert len(seen) == scope_prompt_count(lang)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_math_in_a_context_is_answered_as_if_asked_alone(lang):
    """After an out-of-scope request (answered with the statement), after a task (answered) or
    with nothing before it, under a system message where drawn and always when nothing comes
    before: the last answer is the question's own worked solution, ending in its value."""
    rng = random.Random(5)
    seen = set()
    for _ in range(600):
        c = context_conversation(rng, lang, system_share=0.5, levels=(1, 2, 3, 4))
        roles = [m["role"] for m in c.messages]
        seen.add((c.opening, bool(c.system)))
        assert roles == ["system"] * bool(c.system) + ["user", "assistant"] * (1 + (c.opening != "none"))
        assert c.system == (c.messages[0]["content"] if c.system else "")
        assert not c.system or c.system in SYSTEM_MESSAGES["en"] + SYSTEM_MESSAGES["zh"]
        if c.opening == "scope":
            assert c.messages[-3]["content"] == SCOPE_ANSWER[lang] and c.opening_prompt == c.messages[-4]["content"]
        assert c.messages[-2]["content"] == c.question
        answer = c.messages[-1]["content"]
        *steps, last = answer.split("\n")
        prev = None
        for line in steps:
            a, op, b, value = _STEP.match(line).groups()
            assert prev is None or int(a) == prev
            prev = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b), "/": int(a) // int(b)}[op]
            assert prev == int(value)
        assert last == f"#### {prev}"
        if c.expression:
            assert steps == [f"{c.expression} = {prev}"] and c.expression in c.question
    assert seen == {("scope", False), ("scope", True), ("task", False), ("task", True), ("none", True)}
    assert {o for o, _ in seen} == set(CONTEXT_OPENINGS)
    assert context_conversation(random.Random(9), lang) == context_conversation(random.Random(9), lang)


def test_the_evaluation_asks_under_the_common_system_messages_and_one_no_training_conversation_has():
    from llm.eval.evaluate import CONTEXT_SYSTEM
    trained = set(SYSTEM_MESSAGES["en"]) | set(SYSTEM_MESSAGES["zh"])
    for key in ("system_short", "system_helpful"):
        assert set(CONTEXT_SYSTEM[key].values()) <= trained
    assert not set(CONTEXT_SYSTEM["system_unseen"].values()) & trained


def test_where_sft_learns_verse_the_scope_statement_says_so_and_draws_the_same_requests():
    """`verse` changes the taught statement only: the same generator state gives the same requests."""
    from llm.data.generators import SCOPE_ANSWER_VERSE, context_conversation
    for lang in ("en", "zh"):
        plain = [scope_request(random.Random(7), lang) for _ in range(1)][0]
        verse = scope_request(random.Random(7), lang, verse=True)
        assert verse.prompt == plain.prompt and verse.answer == SCOPE_ANSWER_VERSE[lang] != plain.answer
    assert "verse" in SCOPE_ANSWER_VERSE["en"] and "诗" in SCOPE_ANSWER_VERSE["zh"]
    a = context_conversation(random.Random(3), "en", opening="scope")
    b = context_conversation(random.Random(3), "en", opening="scope", verse=True)
    assert [m["content"] for m in a.messages if m["role"] == "user"] == \
        [m["content"] for m in b.messages if m["role"] == "user"]
    assert b.messages[-3]["content"] == SCOPE_ANSWER_VERSE["en"]
