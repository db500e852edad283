"""Greedy against sampled answers on held-out math: could RL sharpen its way to a better greedy score?

    python bench/math_sampling.py [--model models/sft] [--problems 300] [--k 16] [--temperature 0.7]

For the first --problems of data/prepared/rl/val.jsonl, per level and overall:

  - greedy: exact match of the greedy answer (as `eval` measures it);
  - sampled: the mean exact match of k answers sampled at --temperature;
  - maj@k: the answer most of the k samples give (parsed with llm.sample.rewards.parse_answer; a tie
    goes to the answer seen first) is right;
  - pass@k: at least one of the k samples is right;
  - slips: among the wrong samples, the share that contain an equation `a op b = c` whose c
    is wrong (an arithmetic slip, not a wrong plan or a broken format);
  - lucky: among the right samples, the share that reach the right number through such a slip.

A policy gradient on a verifiable reward (GRPO) moves probability towards the answers the
policy already samples and gets right. If maj@k is about the greedy score, the right answer is
in the minority where greedy is wrong, so sharpening the distribution cannot raise greedy exact
match: the gap to pass@k has to be learned (the README's GRPO notes). The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Sequence


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm.sample.rewards import is_correct, parse_answer, to_number  # noqa: E402

_EQUATION = re.compile(r"(-?\d+)\s*([-+*/])\s*(-?\d+)\s*=\s*(-?\d+)")


def has_slip(text: str) -> bool:
    """True if some `a op b = c` in text has the wrong c (exact arithmetic, / as a fraction)."""
    for m in _EQUATION.finditer(text):
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        if op == "/" and b == 0:
            return True
        value = {"+": a + b, "-": a - b, "*": a * b}.get(op) if op != "/" else Fraction(a, b)
        if value != c:
            return True
    return False


def majority(answers: Sequence[str]):
    """The parsed final answer most of `answers` give (a tie: the one seen first); None if none parses."""
    values = [v for v in (parse_answer(a)[0] for a in answers) if v is not None]
    if not values:
        return None
    counts = Counter(values)
    best = max(counts.values())
    return next(v for v in values if counts[v] == best)


def summarize(problems: Sequence[dict], greedy: Sequence[str], samples: Sequence[Sequence[str]]) -> dict:
    """{group: {n, greedy, sampled, maj, pass, slips, lucky}} for "all" and "level N"."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for p, g, smp in zip(problems, greedy, samples, strict=True):
        right = [is_correct(a, p["answer"]) for a in smp]
        row = {"greedy": float(is_correct(g, p["answer"])), "sampled": sum(right) / len(smp),
               "maj": float(majority(smp) == to_number(p["answer"])), "pass": float(any(right))}
        for key in ("all", f"level {p['level']}"):
            for name, v in row.items():
                acc[key][name].append(v)
            acc[key]["slips"] += [float(has_slip(a)) for a, ok in zip(smp, right) if not ok]
            acc[key]["lucky"] += [float(has_slip(a)) for a, ok in zip(smp, right) if ok]
    out = {}
    for key in sorted(acc, key=lambda k: (k != "all", k)):
        cols = acc[key]
        out[key] = {"n": len(cols["greedy"]),
                    **{name: (sum(v) / len(v) if v else None) for name, v in cols.items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/sft", help="a model directory (default: models/sft)")
    ap.add_argument("--data", default="data/prepared/rl/val.jsonl", help="held-out math problems")
    ap.add_argument("--problems", type=int, default=300, help="the first N problems (default 300)")
    ap.add_argument("--k", type=int, default=16, help="samples per problem (default 16)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7, grpo's)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for path, stage in ((Path(args.model), "sft"), (Path(args.data), "prepare")):
        if not path.exists():
            print(f"{path}: not found; run `dvc repro {stage}` first (or pass another path)", file=sys.stderr)
            return 1

    from llm.eval.evaluate import answer_questions
    from llm.nn.artifacts import load_model_dir
    from llm.sample.prompts import read_problems

    model, tok, _ = load_model_dir(args.model, heads=("lm",))
    problems = read_problems(args.data, limit=args.problems)
    questions = [p["question"] for p in problems]
    greedy = answer_questions(model, tok, questions, max_new_tokens=args.max_new_tokens, batch_size=64)
    flat = answer_questions(model, tok, [q for q in questions for _ in range(args.k)],
                            max_new_tokens=args.max_new_tokens, batch_size=128, temperature=args.temperature,
                            seed=args.seed)
    samples = [flat[i * args.k:(i + 1) * args.k] for i in range(len(problems))]
    table = summarize(problems, greedy, samples)

    print(f"{args.model}: {len(problems)} problems of {args.data}, k={args.k} samples at temperature"
          f" {args.temperature}")
    cols = ("greedy", "sampled", "maj", "pass", "slips", "lucky")
    print(f"{'group':<10} {'n':>4} " + " ".join(f"{c if c not in ('maj', 'pass') else f'{c}@{args.k}':>8}"
                                                for c in cols))
    for key, row in table.items():
        print(f"{key:<10} {row['n']:>4} " + " ".join(f"{'-' if row[c] is None else f'{row[c]:.1%}':>8}"
                                                      for c in cols))
    print(json.dumps({"model": args.model, "k": args.k, "temperature": args.temperature, "groups": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
