"""Passages to continue: the prompts and lessons of the continuation preference.

The preference task asks the model to continue a passage of verse: two lines of one speech
in, the next two lines of the same speech out. `passages(text)` cuts a work into such
(passage, continuation) windows; `continuation_prompt(passage)` is the user turn that asks
for it, one fixed wording, so the chat, SFT, the samples and the evaluation ask alike:

    Continue this passage:
    Thus have you heard me sever'd from my bliss;
    That by misfortunes was my life prolong'd,

A window keeps verse only: every line of it 4 to 14 words and at most 60 characters, opening
with a capital letter (a verse line has 6 to 12 words and starts with a capital; the texts wrap
prose at about 70 characters, mid-sentence), none a speaker's name ("DUKE."), a stage direction
("Enter ...", "[Exit]"), an act or scene heading or a cast list (a word in capitals, columns of
spaces), all four lines inside one speech (no blank line between them). The windows of a work
do not overlap, so no continuation is another window's passage.

Which works a window may come from is the caller's choice (llm/data/splits.py: SFT's lessons
and the RL prompts from the pretraining works, the evaluation's prompts from the held-out ones);
`draw(windows, n, rng, skip)` takes n distinct passages in a seeded order.
"""
from __future__ import annotations

import random
import re
from typing import Callable, Iterable

PROMPT_HEAD = "Continue this passage:"
SOURCE = "generated/continuation"   # the `source` of SFT's continuation lessons
CONTEXT_LINES = 2   # lines of the passage the user gives
ANSWER_LINES = 2    # lines the model is asked for (SFT's lessons answer with the real next lines)
MIN_LINE_WORDS, MAX_LINE_WORDS, MAX_LINE_CHARS = 4, 14, 60

_SPEAKER = re.compile(r"^[A-Z][A-Z' .,&-]*\.$")             # "DUKE.", "FIRST LORD.", "SIR TOBY."
_SHOUTED = re.compile(r"\b[A-Z]{2,}\b")                   # a name in capitals: a cast list, a heading
_DIRECTION = re.compile(r"^\s*(\[|Enter\b|Exit\b|Exeunt\b|Re-enter\b|ACT\b|SCENE\b|Scene\b|Act\b)")


def continuation_prompt(passage: str) -> str:
    """The user turn asking for a continuation of `passage` (its lines, newline-separated)."""
    return f"{PROMPT_HEAD}\n{passage}"


def passage_of(prompt: str) -> str | None:
    """The passage a continuation prompt asks to continue, or None for any other prompt."""
    head, sep, rest = prompt.partition("\n")
    return rest if sep and head.strip() == PROMPT_HEAD and rest.strip() else None


def _verse(line: str) -> bool:
    words = line.split()
    first = next((c for c in line if c.isalpha()), "")
    return (MIN_LINE_WORDS <= len(words) <= MAX_LINE_WORDS and len(line) <= MAX_LINE_CHARS and first.isupper()
            and not _SPEAKER.match(line.strip())
            and not _DIRECTION.match(line) and not _SHOUTED.search(line) and "  " not in line)


def passages(text: str) -> list[tuple[str, str]]:
    """Non-overlapping (passage, continuation) windows of verse in one work, in reading order."""
    out: list[tuple[str, str]] = []
    width = CONTEXT_LINES + ANSWER_LINES
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.split("\n")]
        i = 0
        while i + width <= len(lines):
            window = lines[i:i + width]
            if all(map(_verse, window)):
                out.append(("\n".join(window[:CONTEXT_LINES]), "\n".join(window[CONTEXT_LINES:])))
                i += width
            else:
                i += 1
    return out


def draw(windows: Iterable[tuple[str, str, str]], n: int, rng: random.Random,
         skip: Callable[[str], bool] = lambda passage: False) -> list[tuple[str, str, str]]:
    """n distinct (work, passage, continuation) windows in a seeded order, none whose passage
    `skip` refuses; fewer where the works run out (the caller says so)."""
    pool = list(windows)
    rng.shuffle(pool)
    out, seen = [], set()
    for work, passage, answer in pool:
        if len(out) == n:
            break
        if passage in seen or skip(passage):
            continue
        seen.add(passage)
        out.append((work, passage, answer))
    return out
