"""The math answer parser and verifiable reward."""
from __future__ import annotations

from decimal import Decimal

import pytest

from llm.rewards import is_correct, math_reward, parse_answer, to_number


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
    ("#### 1" + "0" * 60, None, True),                  # absurdly long: not a number, still the format line
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
