"""The RL and evaluation prompts: math problems (and passages to continue) read from JSONL, rendered as chat prompts, pooled by level.

    problems = read_problems("data/prepared/rl/train.jsonl")     # [{"question", "answer", "level", ...}]
    pool = MathPrompts(problems, tokenizer, seq_len=256, max_new_tokens=64)
    ids, problems = pool.sample(16, levels=[1, 2], generator=g)  # with replacement, seeded

PPO and GRPO draw each step's prompts from a `MathPrompts` pool (llm/post/rl.py), and the bench
scripts read the same files through `read_problems`. PPO may mix in passages to continue
(`read_passages`, `PassagePrompts`: prepare's continue/*.jsonl). A problem's answer must be one number of
the grammar llm/sample/rewards.py checks answers against, so a reference the verifier cannot read is an
error at load time, not a zero reward in the middle of a run.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch

from llm.data.template import user_prompt
from llm.fileio import MAX_RECORD_BYTES, read_jsonl
from llm.sample.rewards import to_number


def read_problems(path: str | Path, limit: int | None = None) -> list[dict]:
    """Math problems {"question", "answer", "level", ...} from a JSONL file (data/prepared/rl/*.jsonl)."""
    def validate(obj: Any) -> str | None:
        if not isinstance(obj.get("question"), str) or not obj["question"].strip():
            return "missing or empty 'question'"
        if not isinstance(obj.get("answer"), str) or to_number(obj["answer"]) is None:
            return f"'answer' must be a number as a string, got {obj.get('answer')!r}"
        if not isinstance(obj.get("level", 0), int):
            return f"'level' must be an int, got {obj.get('level')!r}"
        return None
    out = []
    for obj in read_jsonl(path, validate=validate, max_line_bytes=MAX_RECORD_BYTES):
        out.append(obj)
        if limit is not None and len(out) >= limit:
            break
    return out


def read_passages(path: str | Path, limit: int | None = None) -> list[dict]:
    """Passages to continue {"id", "prompt", "passage", ...} (prepare's continue/*.jsonl)."""
    def validate(obj: Any) -> str | None:
        for key in ("prompt", "passage"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                return f"missing or empty {key!r}"
        return None
    out = list(read_jsonl(path, validate=validate, max_line_bytes=MAX_RECORD_BYTES))
    return out[:limit] if limit is not None else out


class PassagePrompts:
    """Passages to continue as chat prompts, sampled with replacement per step. Each sampled
    problem is {"question": the prompt, "passage", "kind": "continuation"}: a reward function
    tells it from a math problem by its "passage" (llm/sample/rewards.py `with_continuations`).
    Passages whose prompt leaves fewer than max_new_tokens positions are dropped (`dropped`)."""

    def __init__(self, items: Sequence[dict], tokenizer, *, seq_len: int, max_new_tokens: int, where: str = ""):
        self.items: list[tuple[list[int], dict]] = []
        self.dropped = 0
        for it in items:
            ids = user_prompt(it["prompt"], tokenizer)
            if len(ids) + max_new_tokens > seq_len:
                self.dropped += 1
                continue
            self.items.append((ids, {"id": it.get("id"), "question": it["prompt"], "passage": it["passage"],
                                     "kind": "continuation"}))
        if not self.items:
            raise ValueError(f"{where or 'passages'}: no usable passage to continue ({len(items)} read,"
                             f" {self.dropped} too long for seq_len with max_new_tokens); raise"
                             f" prepare.continuation_rl, or set the stage's continuation_share: 0")

    def sample(self, n: int, generator: torch.Generator) -> tuple[list[list[int]], list[dict]]:
        idx = torch.randint(len(self.items), (n,), generator=generator).tolist()
        return [self.items[i][0] for i in idx], [self.items[i][1] for i in idx]


class MathPrompts:
    """Math problems as chat prompts, grouped by level, sampled with replacement per step.

    Problems whose prompt leaves fewer than max_new_tokens positions in the context are
    dropped (and counted in `dropped`).
    """

    def __init__(self, problems: Sequence[dict], tokenizer, *, seq_len: int, max_new_tokens: int, where: str = ""):
        self.by_level: dict[int, list[tuple[list[int], dict]]] = defaultdict(list)
        self.dropped = 0
        for p in problems:
            ids = user_prompt(p["question"], tokenizer)
            if len(ids) + max_new_tokens > seq_len:
                self.dropped += 1
                continue
            self.by_level[int(p.get("level", 0))].append((ids, p))
        self.where = where

    def pool(self, levels: Sequence[int]) -> list[tuple[list[int], dict]]:
        out = [x for lvl in sorted(set(levels)) for x in self.by_level.get(lvl, [])]
        if not out:
            raise ValueError(f"{self.where or 'math prompts'}: no usable problem at levels {sorted(set(levels))}"
                             f" (levels present: {sorted(self.by_level)}; {self.dropped} dropped as too long)")
        return out

    def sample(self, n: int, levels: Sequence[int], generator: torch.Generator) -> tuple[list[list[int]], list[dict]]:
        pool = self.pool(levels)
        idx = torch.randint(len(pool), (n,), generator=generator).tolist()
        return [pool[i][0] for i in idx], [pool[i][1] for i in idx]
