"""Verifiable math rewards from a safe answer parser.

A response is scored against the reference answer N:

    correct_reward (1.0)  if the final answer equals N
  + format_reward  (0.2)  if the response ends with the required line `#### <number>`

capped at correct_reward + format_reward, so 1.2 = right and well formatted, 1.0 =
right without the format, 0.2 = formatted but wrong, 0.0 = neither.

The final answer is the number on the last `#### ` line if there is one, else the last
number anywhere in the response. Numbers may carry a sign, thousands separators and
decimals (`#### -1,234.50` == -1234.5). Parsing is regular expressions and `Decimal`
only: model output is never evaluated as code.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_FINAL_LINE = re.compile(rf"^####\s*({_NUM})\s*$")
_HASH_ANY = re.compile(rf"####\s*({_NUM})")
_ANY_NUM = re.compile(_NUM)
_MAX_DIGITS = 40  # longer "numbers" are garbage, not answers


def to_number(text: str) -> Decimal | None:
    """`'-1,234.50'` -> Decimal('-1234.50'); None for anything that is not a plain number."""
    s = text.strip().replace(",", "")
    if not s or len(s) > _MAX_DIGITS or not re.fullmatch(r"[-+]?\d+(\.\d+)?", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex already guarantees a valid literal
        return None


def parse_answer(response: str) -> tuple[Decimal | None, bool]:
    """(final answer or None, whether the response ends with a `#### N` line)."""
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    formatted = bool(lines) and _FINAL_LINE.match(lines[-1]) is not None
    hashes = _HASH_ANY.findall(response)
    candidates = hashes or _ANY_NUM.findall(response)
    value = to_number(candidates[-1]) if candidates else None
    return value, formatted


def is_correct(response: str, answer: str) -> bool:
    value, _ = parse_answer(response)
    target = to_number(answer)
    return value is not None and target is not None and value == target


def math_reward(response: str, answer: str, correct_reward: float = 1.0, format_reward: float = 0.2) -> float:
    value, formatted = parse_answer(response)
    target = to_number(answer)
    r = 0.0
    if value is not None and target is not None and value == target:
        r += correct_reward
    if formatted:
        r += format_reward
    return min(r, correct_reward + format_reward)
