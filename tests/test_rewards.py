"""The math answer parser and verifiable reward."""
from __future__ import annotations

import time
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm.sample.rewards import MAX_CHARS, is_correct, math_reward, parse_answer, to_number


@pytest.mark.parametrize("text,value,formatted", [
    ("12 + 7 = 19\n#### 19", Decimal(19), True),
    ("#### 1,234", Decimal(1234), True),
    ("5 - 9 = -4\n#### -4", Decimal(-4), True),
    ("#### 3.50", Decimal("3.5"), True),
    ("the answer is 42", Decimal(42), False),
    ("#### 7\nI think that's it", Decimal(7), False),   # answer line not last: no format bonus
    ("no numbers here", None, False),
    ("", None, False),
    ("#### __import__('os').system('touch /tmp/x')", None, False),
    ("#### 1" + "0" * 60, None, False),                 # absurdly long: not a number, so no format line either
])
def test_parse_answer(text, value, formatted):
    v, f = parse_answer(text)
    assert v == value
    assert f is formatted


def test_decimals_compare_by_value():
    assert to_number("3.50") == to_number("3.5")
    assert is_correct("#### 3.50", "3.5")
    assert not is_correct("#### 3.51", "3.5")


@pytest.mark.parametrize("text,reward", [
    ("4 + 5 = 9\n#### 9", 1.2),
    ("4 + 5 = 9\nso 9", 1.0),
    ("4 + 5 = 8\n#### 8", 0.2),
    ("I don't know", 0.0),
])
def test_reward_levels(text, reward):
    assert math_reward(text, "9") == pytest.approx(reward)


def test_reward_is_capped():
    assert math_reward("#### 9", "9", correct_reward=1.0, format_reward=0.2) <= 1.2


def test_parser_never_runs_code(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"#### __import__('pathlib').Path({str(marker)!r}).touch()"
    parse_answer(payload), math_reward(payload, "1")
    assert not marker.exists()


# ---------------------------------------------------------------------------
# The number grammar of the module docstring, rule by rule.

@pytest.mark.parametrize("text,value,formatted", [
    ("#### \u22125", Decimal(-5), True),                 # U+2212 MINUS SIGN is a minus, not nothing
    ("#### \u20135", None, False),                       # an en dash is not a sign: no number, not 5
    ("#### \uff0d5", None, False),                       # nor a full-width hyphen-minus
    ("#### +7", Decimal(7), True),
    ("#### \u0663", None, False),                        # Arabic-Indic 3
    ("#### \u0969", None, False),                        # Devanagari 3
    ("#### \uff13", None, False),                        # full-width 3
    ("#### 1\uff13", None, False),                       # an ASCII digit glued to a non-ASCII one
    ("#### 1e999999", None, False),                      # no exponents, and not 1
    ("#### 1E5", None, False),
    ("#### 1,23", None, False),                          # a separator needs three digits after it: not 1
    ("#### 12,345,678", Decimal(12345678), True),
    ("#### 1234,567", None, False),                      # groups of at most 3 before the first comma
    ("#### 1.2.3", None, False),
    ("#### .5", None, False),                            # a fraction needs its integer part
    ("#### 3/4", None, False),
    ("x5 and 5kg", None, False),                         # glued to letters: not numbers
    ("\u5c0f\u660e\u670914\u4e2a\u82f9\u679c", Decimal(14), False),  # Chinese around it is fine: 小明有14个苹果
    ("3-5", Decimal(3), False),                          # the 5 is glued to a dash that is not its sign
    ("the answer is 12.", Decimal(12), False),           # a full stop after a number is punctuation
])
def test_the_number_grammar(text, value, formatted):
    assert parse_answer(text) == (value, formatted)


def test_max_chars_is_the_longest_number():
    longest = "-" + "9" * (MAX_CHARS - 1)
    assert to_number(longest) == Decimal(longest) and parse_answer(f"#### {longest}") == (Decimal(longest), True)
    assert to_number(longest + "9") is None and parse_answer(f"#### {longest}9") == (None, False)


def test_a_100000_digit_answer_earns_nothing_and_parses_in_linear_time():
    t0 = time.perf_counter()
    assert math_reward("#### " + "1" * 100_000, "1") == 0.0
    assert parse_answer("1," * 100_000) == (None, False)
    assert time.perf_counter() - t0 < 1


digit_runs = st.text(alphabet="0123456789", min_size=1, max_size=6)


@st.composite
def grammar_numbers(draw):
    """(text, value) for a number the grammar accepts, built rule by rule."""
    sign = draw(st.sampled_from(["", "-", "+", "\u2212"]))
    if draw(st.booleans()):
        head = draw(st.text(alphabet="0123456789", min_size=1, max_size=3))
        groups = draw(st.lists(st.text(alphabet="0123456789", min_size=3, max_size=3), min_size=1, max_size=3))
        integer = ",".join([head, *groups])
    else:
        integer = draw(digit_runs)
    fraction = draw(st.one_of(st.just(""), digit_runs.map(lambda d: "." + d)))
    text = sign + integer + fraction
    value = Decimal(("-" if sign in ("-", "\u2212") else "") + integer.replace(",", "") + fraction)
    return text, value


@settings(max_examples=200, deadline=None)
@given(grammar_numbers(), st.sampled_from(["", "12 + 7 = 19\n", "小明有3个苹果。\n"]))
def test_every_number_of_the_grammar_parses_to_its_value(num, before):
    text, value = num
    assert to_number(text) == value
    assert parse_answer(f"{before}#### {text}") == (value, True)
    assert parse_answer(f"{before}so it is {text} apples") == (value, False)


@settings(max_examples=200, deadline=None)
@given(grammar_numbers(), st.sampled_from(["e5", "E-3", "x", "\u0663", "\uff13", ",12", ".5.1", "/4", "_"]))
def test_a_number_glued_to_more_is_no_number(num, tail):
    text, _ = num
    assert to_number(text + tail) is None
    assert parse_answer(f"#### {text}{tail}") == (None, False)


# ---------------------------------------------------------------------------
# process-level credit


def test_check_steps_marks_each_result_and_a_broken_chain():
    from llm.sample.rewards import check_steps
    text = b"12 + 7 = 19\n19 - 3 = 15\n15 * 2 = 30\n31 / 1 = 31\n#### 31"
    spans = check_steps(text)
    assert [(text[s:e], ok) for s, e, ok in spans] == [(b"19", True), (b"15", False), (b"30", True),
                                                       (b"31", False)]  # 31 is not the previous result 30
    assert check_steps(b"7 / 2 = 3") == [(8, 9, False)] and check_steps(b"8 / 0 = 0")[0][2] is False
    assert check_steps(b"no steps here #### 5") == [] and check_steps(b"1" * 20 + b" + 1 = 2") == []


def test_check_steps_reads_a_negative_intermediate_as_the_next_step_s_operand():
    from llm.sample.rewards import check_steps
    text = b"5 - 9 = -4\n-4 + 3 = -1\n-1 * -2 = 2\n#### -1"
    assert [(text[s:e], ok) for s, e, ok in check_steps(text)] == [(b"-4", True), (b"-1", True)]
    text = b"5 - 9 = -4\n-4 + 3 = 1\n4 + 3 = 7\n-8 / 2 = -4\n-7 / 2 = -3"
    assert [ok for _, _, ok in check_steps(text)] == [True, False, False, False, False]  # 4 is not -4
    assert [ok for _, _, ok in check_steps(b"12-4 + 3 = 11\n-8 / 2 = -4")] == [True]  # 12-4: no sign


def test_step_credit_puts_plus_and_minus_one_on_the_result_tokens():
    import torch

    from llm.data.tokenizer import Tokenizer
    from llm.sample.rewards import step_credit
    from llm.sample.rollout import Rollout
    tok = Tokenizer.train(["12 + 7 = 19\n19 - 3 = 16\n#### 16"] * 3, vocab_size=300, min_frequency=1, jieba=False)
    texts = ["12 + 7 = 19\n19 - 3 = 15\n#### 15", "#### 4"]
    rows = [tok.encode(t) + [tok.end_id] for t in texts]
    N = max(map(len, rows))
    resp = torch.tensor([r + [tok.pad_id] * (N - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (N - len(r)) for r in rows])
    ro = Rollout(tokens=torch.cat([torch.zeros(2, 1, dtype=torch.long), resp], 1),
                 attention_mask=torch.cat([torch.ones(2, 1, dtype=torch.bool), mask], 1), prompt_len=1,
                 response_mask=mask, logprobs=torch.zeros(2, N), stopped=torch.ones(2, dtype=torch.bool))
    credit = step_credit(tok, ro)
    marked = {tok.decode([t]): float(c) for t, c in zip(rows[0], credit[0]) if c != 0}
    text_plus = tok.decode([t for t, c in zip(rows[0], credit[0]) if c > 0])
    text_minus = tok.decode([t for t, c in zip(rows[0], credit[0]) if c < 0])
    assert text_plus == "19" and text_minus == "15", marked       # the first step right, the second a slip
    assert credit[1].abs().sum() == 0 and credit[0, len(rows[0]):].abs().sum() == 0
