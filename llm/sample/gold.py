"""The gold judge of the continuation preference: what human raters are in RLHF, here a rule.

The preference is defined here and nowhere else. Of two continuations of the same passage
(llm/data/continuation.py), the one with the higher gold score is preferred:

    gold(continuation, passage) = VADER's compound sentiment of the continuation, in [-1, 1]
                                = FLOOR (-1) if it is not a continuation at all:
                                  fewer than MIN_WORDS words,
                                  not in the passage's language (under 90 % of its letters ASCII:
                                  the passages are English verse), or
                                  a repetition (over REPEAT_LIMIT of its word trigrams said
                                  already, in the passage or earlier in the continuation)

so "the more positive continuation, in English, that says something new". The judge reads text
only: it never sees the policy, the reward model or their scores, and the reward model never
labels its own training data (the `samples` stage labels SFT's continuations with this judge).

Why VADER (Hutto and Gilbert 2014, package `vaderSentiment`): a sentiment lexicon of about 7,500
words and emoticons rated by human raters, with rules for negation, intensifiers and "but", that
ships inside the wheel (no model download, no network) and scores a sentence in microseconds; it
is the field's usual rule-based sentiment judge, and Ziegler et al. 2019 and TRL's sentiment
example use a sentiment classifier as the mock labeller the same way. Its lexicon is modern
English, so Shakespeare's "thee" or "'tis" count as neutral: the judge's scale is its own, which
is what a gold judge may be, as long as everything is measured against it.

`repetition_rate` (the share of repeated word trigrams) is reported beside the gold score as a
guard against a degenerate win (PPO's held-out evaluation logs it as `continuation_repetition`).
"""
from __future__ import annotations

import functools
import re

FLOOR = -1.0          # the gold score of a text that is not a continuation
MIN_WORDS = 3
REPEAT_LIMIT = 0.5    # share of word trigrams said already, above which a text is a repetition
MIN_ASCII_LETTERS = 0.9

_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)*", re.UNICODE)


@functools.lru_cache(maxsize=1)
def _analyzer():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as e:
        raise RuntimeError("the gold judge needs the VADER lexicon: `pip install vaderSentiment==3.3.2`"
                           " (env/requirements.txt lists it; env/setup_cpu.sh installs it)") from e
    return SentimentIntensityAnalyzer()


def words(text: str) -> list[str]:
    """The words of `text`, lower-cased (letters, with inner apostrophes: "thou'rt")."""
    return [w.lower() for w in _WORD.findall(text)]


def repetition_rate(text: str, passage: str = "") -> float:
    """Share of the text's word trigrams said already, in `passage` or earlier in the text (0 for
    a text of under three words)."""
    ws = words(text)
    grams = [tuple(ws[i:i + 3]) for i in range(len(ws) - 2)]
    if not grams:
        return 0.0
    pw = words(passage)
    seen = {tuple(pw[i:i + 3]) for i in range(len(pw) - 2)}
    repeated = 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / len(grams)


def english(text: str) -> bool:
    """At least MIN_ASCII_LETTERS of the text's letters are ASCII (the passages' language)."""
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) >= MIN_ASCII_LETTERS * len(letters)


def sentiment(text: str) -> float:
    """VADER's compound score of `text`, in [-1, 1] (0: neutral or no rated word)."""
    return float(_analyzer().polarity_scores(text)["compound"])


def gold_score(continuation: str, passage: str) -> float:
    """The preference's score of one continuation of `passage` (module docstring)."""
    if (len(words(continuation)) < MIN_WORDS or not english(continuation)
            or repetition_rate(continuation, passage) > REPEAT_LIMIT):
        return FLOOR
    return sentiment(continuation)

