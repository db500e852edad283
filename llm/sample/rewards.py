"""Verifiable math rewards from a safe answer parser.

A response is scored against the reference answer N:

    correct_reward (1.0)  if the final answer equals N
  + format_reward  (0.2)  if the response ends with the required line `#### <number>`

capped at correct_reward + format_reward, so 1.2 = right and well formatted, 1.0 =
right without the format, 0.2 = formatted but wrong, 0.0 = neither.

The RL stages score a batch of rollouts with a `RewardFn` (rollout, problems) -> (rewards (B,),
statistics): `verifier_reward` (math_reward of each decoded response), `rm_reward` (a reward
model's score, llm/nn/reward_model.py) or `rm_verifier_reward` (their sum).

`task_correct(response, answer)` is the instruction tasks' check: exactly the reference
answer, surrounding whitespace aside (the evaluation's, and the pairs stage's with
`pairs.verify_tasks`).

The final answer is the number on the last `####` line if there is one, else the last
number anywhere in the response. Parsing is regular expressions and `Decimal` only:
model output is never evaluated as code.

What a number is (the same grammar for responses and reference answers):

    number    := sign? integer fraction?            at most MAX_CHARS (40) characters
    sign      := "-" | "+" | "\u2212"               (U+2212 MINUS SIGN reads as "-")
    integer   := d{1,3} ("," d{3})+  |  d+           thousands separators: commas, groups of 3
    fraction  := "." d+
    d         := an ASCII digit 0-9

  - Only ASCII digits are digits. Arabic-Indic (٣), Devanagari (३), full-width (３) and
    other Unicode digits are text, not numbers: "#### ３" has no number (and no format).
  - No exponents, fractions or words: "1e5", "3/4", "five" are not numbers, and a number
    may not run into a letter or digit: "1e999999" holds none (not 1), nor "x5", "5kg".
  - A number is a whole token: it may not be directly preceded by an ASCII letter, a
    digit, ".", ",", "/" or a sign or dash that is not its own sign, nor followed by a
    letter, a digit, "/", or "." / "," with a digit after it. So "1,23" (a separator not
    followed by three digits), "1.2.3" and "3/4" hold no number, "–5" (en dash) is not
    -5, "3-5" is 3, and "is 12." is 12 (a full stop after a number is punctuation).
  - More than MAX_CHARS characters is garbage, not an answer: such a line has no number
    and earns no format reward.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

MAX_CHARS = 40
_SIGNS = "\\-+\u2212"  # for a character class: "-" escaped
# Dashes that look like a minus but are not one; a digit run right after one is no number.
_DASHES = "\u2010-\u2015\ufe58\ufe63\uff0d"
_BODY = rf"[{_SIGNS}]?(?:[0-9]{{1,3}}(?:,[0-9]{{3}})+|[0-9]+)(?:\.[0-9]+)?"
# Whole tokens only: see the module docstring. `\d` in the lookarounds is any Unicode digit, so
# an ASCII digit run glued to a non-ASCII one is not a number either.
_NUM = (rf"(?<![0-9A-Za-z_.,/{_SIGNS}{_DASHES}])(?<!\d)"
        rf"{_BODY}"
        r"(?![0-9A-Za-z_/]|\d|[.,][0-9])")
_FINAL_LINE = re.compile(rf"####[ \t]*({_NUM})[ \t]*")
_HASH_ANY = re.compile(rf"####[ \t]*({_NUM})")
_ANY_NUM = re.compile(_NUM)
_PLAIN = re.compile(_BODY)


def to_number(text: str) -> Decimal | None:
    """`'-1,234.50'` -> Decimal('-1234.50'); None for anything that is not one number of the
    grammar above (surrounding whitespace allowed)."""
    s = text.strip()
    if not s or len(s) > MAX_CHARS or not _PLAIN.fullmatch(s):
        return None
    try:
        return Decimal(s.replace(",", "").replace("\u2212", "-"))
    except InvalidOperation:  # pragma: no cover - the grammar only admits valid literals
        return None


def parse_answer(response: str) -> tuple[Decimal | None, bool]:
    """(final answer or None, whether the response ends with a `#### N` line whose N is a number)."""
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    last = _FINAL_LINE.fullmatch(lines[-1]) if lines else None
    formatted = last is not None and to_number(last.group(1)) is not None
    hashes = _HASH_ANY.findall(response)
    candidates = hashes or _ANY_NUM.findall(response)
    value = to_number(candidates[-1]) if candidates else None
    return value, formatted


def is_correct(response: str, answer: str) -> bool:
    value, _ = parse_answer(response)
    target = to_number(answer)
    return value is not None and target is not None and value == target


def task_correct(response: str, answer: str) -> bool:
    """An instruction task is done when the response is exactly the answer (surrounding
    whitespace aside): the SFT data answers with nothing else."""
    return response.strip() == answer.strip()


def math_reward(response: str, answer: str, correct_reward: float = 1.0, format_reward: float = 0.2) -> float:
    value, formatted = parse_answer(response)
    target = to_number(answer)
    r = 0.0
    if value is not None and target is not None and value == target:
        r += correct_reward
    if formatted:
        r += format_reward
    return min(r, correct_reward + format_reward)


# ---------------------------------------------------------------------------
# Rewards of a batch of rollouts (the RL stages)

RewardFn = Callable[..., tuple[Tensor, dict[str, float]]]  # (Rollout, problems) -> (rewards (B,), stats)


def math_stats(texts: Sequence[str], problems: Sequence[dict]) -> dict[str, float]:
    """Fraction correct and fraction in the `#### N` format (when problems carry answers)."""
    if not problems or "answer" not in problems[0]:
        return {}
    parsed = [parse_answer(t) for t in texts]
    correct = [v is not None and v == to_number(p["answer"]) for (v, _), p in zip(parsed, problems)]
    return {"accuracy": sum(correct) / len(texts), "format_rate": sum(f for _, f in parsed) / len(texts)}


def verifier_reward(tokenizer, *, correct_reward: float, format_reward: float) -> RewardFn:
    """Reward = math_reward of each decoded response against its problem's answer."""
    def score(ro, problems: list[dict]) -> tuple[Tensor, dict[str, float]]:
        texts = [tokenizer.decode(ids) for ids in ro.response_ids()]
        r = [math_reward(t, p["answer"], correct_reward, format_reward) for t, p in zip(texts, problems)]
        return torch.tensor(r, dtype=torch.float32), math_stats(texts, problems)
    return score


def rm_reward(rm: nn.Module, tokenizer) -> RewardFn:
    """Reward = the reward model's score of prompt + response (read at the last real token:
    the closing <|end|> of a finished response)."""
    from llm.nn.reward_model import reward

    @torch.no_grad()
    def score(ro, problems: list[dict]) -> tuple[Tensor, dict[str, float]]:
        r = reward(rm, ro.tokens, ro.attention_mask).float().cpu()       # (B,)
        texts = [tokenizer.decode(ids) for ids in ro.response_ids()]
        return r, math_stats(texts, problems)
    return score


def rm_verifier_reward(rm: nn.Module, tokenizer, *, correct_reward: float, format_reward: float) -> RewardFn:
    """Reward = the reward model's score + the verifier's (ppo.reward_source: rm+verifier).

    A learned RM that checks arithmetic imperfectly can be climbed by drifting towards the
    answers it misjudges; the verifier term pays for the right final number, so the policy
    gains nothing by trading correctness for RM score. Both parts are logged (rm_score,
    verifier_reward) so a run shows whether the RM score itself rose.
    """
    from llm.nn.reward_model import reward

    ver_fn = verifier_reward(tokenizer, correct_reward=correct_reward, format_reward=format_reward)

    @torch.no_grad()
    def score(ro, problems: list[dict]) -> tuple[Tensor, dict[str, float]]:
        r_rm = reward(rm, ro.tokens, ro.attention_mask).float().cpu()     # (B,), as rm_reward
        r_ver, stats = ver_fn(ro, problems)                                # decodes each response once
        return r_rm + r_ver, {**stats, "rm_score": float(r_rm.mean()), "verifier_reward": float(r_ver.mean())}
    return score


def with_continuations(math_fn: RewardFn, rm: nn.Module, tokenizer) -> RewardFn:
    """A reward for batches that mix math problems and passages to continue (a problem with a
    "passage", llm/sample/prompts.py `PassagePrompts`): a continuation's reward is the reward
    model's score alone, a math problem's is `math_fn`'s. Statistics: math_fn's over the math
    rows, and over the continuations the reward model's mean (`continuation_rm`) and the gold
    judge's (`continuation_gold`, llm/sample/gold.py): logged, never a reward, so the policy
    learns the preference from the reward model only."""
    from llm.nn.reward_model import reward
    from llm.sample.gold import gold_score

    @torch.no_grad()
    def score(ro, problems: list[dict]) -> tuple[Tensor, dict[str, float]]:
        cont = [i for i, p in enumerate(problems) if "passage" in p]
        if not cont:
            return math_fn(ro, problems)
        taken = set(cont)
        maths = [i for i in range(len(problems)) if i not in taken]
        r = torch.zeros(len(problems), dtype=torch.float32)
        stats: dict[str, float] = {}
        if maths:
            r_math, stats = math_fn(ro.select(maths), [problems[i] for i in maths])
            r[maths] = r_math.float()
        sub = ro.select(cont)
        r_rm = reward(rm, sub.tokens, sub.attention_mask).float().cpu()
        r[cont] = r_rm
        texts = [tokenizer.decode(ids) for ids in sub.response_ids()]
        gold = [gold_score(t, problems[i]["passage"]) for t, i in zip(texts, cont)]
        return r, {**stats, "continuation_rm": float(r_rm.mean()), "continuation_gold": sum(gold) / len(gold)}
    return score


# ---------------------------------------------------------------------------
# Process-level credit: which result tokens of a worked answer are right

# `a` may be negative, as the result of a step before it can be (`5 - 9 = -4`, then `-4 + 3 = -1`);
# a minus right after a digit (`3-4`) is a subtraction, not a sign, and such a step is not read
_STEP = re.compile(rb"(?:(?<![0-9])(-)|(?<![-0-9]))([0-9]+) ([-+*/]) ([0-9]+) = (-?[0-9]+)(?![0-9])")
_MAX_STEP_DIGITS = 12  # longer numbers are not checked (no huge-integer arithmetic on model output)


def check_steps(text: bytes) -> list[tuple[int, int, bool]]:
    """The result of every worked step `a op b = c` in a response, as (start, end, right) byte spans.

    Steps are written as the data writes them, one per line: `12 + 7 = 19`, with op one of
    `+ - * /` (ASCII digits only; integer division must be exact); `a` and c may be negative
    (`5 - 9 = -4`, then `-4 + 3 = -1`). A result is right when
    c == a op b, and, after the first step, when its `a` is the previous step's result (a
    copied wrong number makes the rest of the chain wrong, so that step's result is marked
    wrong even if its own arithmetic holds). Only the digits of c are in the span.
    """
    out, prev = [], None
    for m in _STEP.finditer(text):
        sign, a, op, b, c = m.groups()
        if max(len(a), len(b), len(c)) > _MAX_STEP_DIGITS:
            continue
        a_i, b_i, c_i = -int(a) if sign else int(a), int(b), int(c)
        if op == b"+":
            want = a_i + b_i
        elif op == b"-":
            want = a_i - b_i
        elif op == b"*":
            want = a_i * b_i
        else:
            want = a_i // b_i if b_i and a_i % b_i == 0 else None
        right = want == c_i and (prev is None or prev == a_i)
        out.append((m.start(5), m.end(5), right))
        prev = c_i
    return out


def step_credit(tokenizer, ro) -> Tensor:
    """Per-token credit (B, N) float32 of a batch of rollouts: +1 on the tokens of every right
    step result, -1 on those of a wrong one (`check_steps`), 0 elsewhere.

    The verifier can say exactly where a worked answer went wrong, which an outcome reward
    cannot: GRPO adds `step_credit` times this to its per-token advantages, so a slip is pushed
    down where it happened and the right arithmetic around it is not. A token counts for a step
    when any of its bytes lies in the result's span (digits are single tokens here)."""
    B, N = ro.response_mask.shape
    credit = torch.zeros(B, N)
    for row, (ids, mask) in enumerate(zip(ro.responses.tolist(), ro.response_mask.tolist())):
        ids = [t for t, keep in zip(ids, mask) if keep]
        pieces = [tokenizer.token_bytes(t) if 0 <= t < tokenizer.n_base else b"" for t in ids]
        text = b"".join(pieces)
        ends, pos = [], 0
        for p in pieces:
            pos += len(p)
            ends.append(pos)
        t = 0
        for start, end, right in check_steps(text):
            while t < len(ends) and ends[t] <= start:
                t += 1
            u = t
            while u < len(ends) and ends[u] - len(pieces[u]) < end:
                credit[row, u] = 1.0 if right else -1.0
                u += 1
    return credit
