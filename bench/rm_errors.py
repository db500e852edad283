"""Where the reward model is wrong on wrong-answer pairs (the numbers behind the README's RM notes).

    python bench/rm_errors.py [--model models/reward] [--data data/prepared/prefs]

Scores every held-out pair of --data (val.jsonl) with the reward model, then splits the
`wrong_answer` pairs (chosen: the correct solution; rejected: the same solution with one step's
result off by some delta, carried to the end, llm/data/generators.py `wrong_solution`) by

  - the size of the slip |delta|: 1-2, 3-9 or 10 or more;
  - whether the slip changed the last digit of that step's result;
  - which step slipped, in problems of more than one step;
  - the problem's level;

and prints the accuracy (chosen scored above rejected) of each group. A reward model that checks
the arithmetic its trunk can do would be about as good on off-by-one slips as on off-by-ten ones.
The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm.data.preference import encode_pairs  # noqa: E402
from llm.nn.artifacts import load_model_dir  # noqa: E402
from llm.nn.reward_model import score_sequences  # noqa: E402


def slip(chosen: str, rejected: str) -> tuple[int, int, int, int] | None:
    """(index of the first step that differs, number of steps, right value, slipped value), from
    two solutions written as `a op b = c` lines and a final `#### n` line; None if no step differs
    or a differing line is not a step."""
    c, r = chosen.strip().split("\n"), rejected.strip().split("\n")
    steps = [line for line in c if not line.startswith("####")]
    for i, (a, b) in enumerate(zip(c, r)):
        if a == b:
            continue
        if a.startswith("####") or " = " not in a or " = " not in b:
            return None
        try:
            return i, len(steps), int(a.rsplit(" = ", 1)[1]), int(b.rsplit(" = ", 1)[1])
        except ValueError:
            return None
    return None


def groups(level: int, s: tuple[int, int, int, int]) -> list[str]:
    """The groups one wrong-answer pair counts in."""
    k, n, right, wrong = s
    d = abs(wrong - right)
    out = [f"|delta| {'1-2' if d <= 2 else '3-9' if d < 10 else '>= 10'}",
           "last digit differs" if right % 10 != wrong % 10 else "last digit same",
           f"level {level}"]
    out.append(f"slip at step {k + 1} of {n}" if n > 1 else "one-step problem")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/reward")
    ap.add_argument("--data", default="data/prepared/prefs", help="a folder with val.jsonl")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir, data = Path(args.model), Path(args.data)
    if not model_dir.is_dir():
        sys.exit(f"{model_dir}: not found; run `dvc repro reward` first")
    if not (data / "val.jsonl").is_file():
        sys.exit(f"{data / 'val.jsonl'}: not found; run `dvc repro prepare` first")
    gpt, tok, _ = load_model_dir(model_dir)
    if "reward" not in gpt.head_names:
        sys.exit(f"{model_dir}: this model has heads {list(gpt.head_names)}, no reward head")
    records = [json.loads(line) for line in (data / "val.jsonl").read_text().splitlines() if line.strip()]
    val, kept, dropped = encode_pairs(records, tok, gpt.config.seq_len)
    records = [records[i] for i in kept]  # pairs longer than seq_len are left out, as in the reward stage
    r = score_sequences(gpt, [p.chosen for p in val] + [p.rejected for p in val], pad_id=tok.pad_id,
                        batch_size=args.batch_size)
    n = len(val)
    right = (r[:n] > r[n:]).tolist()
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for rec, ok in zip(records, right):
        counts["all pairs"][0] += ok
        counts["all pairs"][1] += 1
        s = slip(rec["chosen"], rec["rejected"]) if rec.get("kind") == "wrong_answer" else None
        for g in (["wrong_answer", *groups(int(rec.get("level", 0)), s)] if s else []):
            counts[g][0] += ok
            counts[g][1] += 1
    if "wrong_answer" not in counts:
        sys.exit(f"{data / 'val.jsonl'}: no wrong_answer pairs to analyse")
    print(f"reward model {model_dir}, {n} held-out pairs of {data}" + (f" ({dropped} too long, left out)" if dropped else ""))
    print(f"{'group':28s} {'right':>9s}  accuracy")
    for g in ["all pairs", "wrong_answer", *sorted(k for k in counts if k not in ("all pairs", "wrong_answer"))]:
        ok, tot = counts[g]
        print(f"{g:28s} {ok:4d}/{tot:<4d}  {ok / tot:.1%}")
    print(json.dumps({"bench": "rm_errors", "model": str(model_dir),
                      "groups": {g: {"right": ok, "n": tot, "accuracy": ok / tot} for g, (ok, tot) in counts.items()}}))


if __name__ == "__main__":
    main()
