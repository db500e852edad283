"""Write chat_math.jsonl, the data of the lm-evaluation-harness task chat_math.yaml beside it.

    python -m bench.lm_eval_tasks.make      # from the repository root; the file is committed

Twelve word problems (levels 1 and 2) and twelve bare calculations, two thirds in English and
one third in Chinese, drawn by llm.data.generators under their own seed: the kinds of questions the
chat models are trained on, each written as one user message, its answer the integer the model
should write after `#### `. They are not the evaluation's held-out set (that one is made by the
prepare stage and lives under data/, absent on a fresh clone), so an item can coincide with a
training item; the task checks that a served model answers in its format, not how well it
generalises (tests/test_lm_eval_task.py holds the file equal to `rows()`).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from llm.data.generators import arithmetic_question, math_problem

SEED = 7
DATA = Path(__file__).with_name("chat_math.jsonl")


def rows() -> list[dict]:
    rng, out = random.Random(SEED), []
    for i in range(12):
        lang = "zh" if i % 3 == 2 else "en"
        p = math_problem(rng, 1 + i % 2, lang)
        out.append({"id": f"word-{i}", "kind": "word problem", "lang": lang, "question": p.question,
                    "answer": str(p.answer)})
    for i in range(12):
        lang = "zh" if i % 3 == 2 else "en"
        q = arithmetic_question(rng, lang)
        out.append({"id": f"bare-{i}", "kind": "bare arithmetic", "lang": lang, "question": q.question,
                    "answer": str(q.answer)})
    return out


def main() -> None:
    DATA.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows()), encoding="utf-8")
    print(f"wrote {DATA} ({len(rows())} questions)")


if __name__ == "__main__":
    main()
