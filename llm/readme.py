"""The README's results tables, generated from the committed metrics so that the two cannot disagree.

    python -m llm.readme                  # rewrite README.md's block from metrics/
    python -m llm.readme --check          # exit 1 when README.md's block differs from metrics/

The block sits between `<!-- results:begin -->` and `<!-- results:end -->`; nothing outside it
is touched. It holds two short tables:

- this run, one row per model (`metrics/eval/<model>.json`): greedy math with its 95% interval,
  the paired change against the model's parent (`metrics/paired.json`), instruction tasks, bare
  arithmetic, sampled math, pass@k, RM score, win rate, KL per token against SFT, and bits per
  byte of held-out Shakespeare (how well the model still reads plain text; lower is better);
- several seeds read together (`metrics/seeds/summary.json`, written by `python -m llm.seeds`):
  greedy math per seed and its mean, and each RL model's change from SFT, pooled over all the
  seeds' items and across seeds; then the targets that need several seeds (second turns,
  out-of-scope requests, held-out text, the reward model on SFT's own answers, PPO on the
  reward model), per seed with mean and worst.

A missing file leaves its rows or its table out (a run may stop before the last stage); the
table never fills in a number. tests/test_readme.py fails when the committed README and the
committed metrics disagree: after a run you keep, run this command and commit README.md with it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from llm.fileio import atomic_write_text
from llm.report import MODELS, NAME, PARENT, fmt_interval, fmt_p, fmt_value

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# (eval metrics key, column label, kind, with its interval): kind "pct" shows a proportion as a
# percentage, "num" a number, "nats" a KL to four decimals (the RL models' are below 0.001),
# "bits" bits per byte of held-out text to two
COLUMNS: tuple[tuple[str, str, str, bool], ...] = (
    ("task_exact_match", "instruction tasks", "pct", True),
    ("arithmetic_exact_match", "bare arithmetic", "pct", False),
    ("math_sample_accuracy", "sampled math", "pct", True),
    ("math_pass_at_k", "pass@k", "pct", False),
    ("rm_score", "RM score", "num", False),
    ("win_rate_vs_sft", "win rate vs SFT", "pct", False),
    ("kl", "KL to SFT, nats/token", "nats", False),
    ("val_bpb", "text, bits/byte", "bits", False),
)


def _read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _pp(res: dict) -> str:
    """A paired change in percentage points with its interval: `+0.4 [-1.0, +1.8]`."""
    return f"{100 * res['delta']:+.1f} [{100 * res['lo']:+.1f}, {100 * res['hi']:+.1f}]"


def _cell(m: dict, key: str, kind: str, interval: bool = True) -> str:
    v = m.get(key)
    if kind in ("nats", "bits"):
        return f"{v:.{4 if kind == 'nats' else 2}f}" if isinstance(v, (int, float)) else "n/a"
    if not interval:
        return fmt_value(v, kind)
    return f"{fmt_value(v, kind)} {fmt_interval(m.get(f'{key}_lo'), m.get(f'{key}_hi'), kind)}".strip()


def run_table(metrics: Path) -> list[str]:
    """One row per model that has `metrics/eval/<model>.json`."""
    evals = {m: e for m in MODELS if (e := _read(metrics / "eval" / f"{m}.json")) is not None}
    if not evals:
        return []
    paired = _read(metrics / "paired.json") or {}
    k = next((e["math_pass_k"] for e in evals.values() if "math_pass_k" in e), "k")
    labels = ["model", "math (greedy)", "math change vs parent"] + [
        lab.replace("pass@k", f"pass@{k}") for _, lab, _, _ in COLUMNS]
    lines = [_row(labels), _row(["---"] * len(labels))]
    for m, e in evals.items():
        change = paired.get(f"{m}_vs_{PARENT[m]}", {}).get("math") if m in PARENT else None
        cells = [NAME[m], _cell(e, "math_exact_match", "pct"), _pp(change) if change else "-"]
        cells += [_cell(e, key, kind, interval) for key, _, kind, interval in COLUMNS]
        lines.append(_row(cells))
    return lines


def _pooled(res: dict) -> str:
    return (f"{100 * res['mean']:+.1f} [{100 * res['lo']:+.1f}, {100 * res['hi']:+.1f}], p {fmt_p(res['p_value'])}"
            if "p_value" in res else f"{100 * res['mean']:+.1f} [{100 * res['lo']:+.1f}, {100 * res['hi']:+.1f}]")


def seeds_table(summary: dict | None) -> list[str]:
    """Greedy math per seed, and each RL model's change from SFT over all seeds."""
    if not summary:
        return []
    runs, levels, paired = summary["runs"], summary["levels"], summary["paired"]
    labels = ["model", f"math, seeds {' / '.join(runs)}", "mean", "math change vs SFT, pooled",
              "across seeds", "sampled math change, pooled"]
    lines = [_row(labels), _row(["---"] * len(labels))]
    for m in MODELS:
        if m not in levels or "math" not in levels[m]:
            continue
        lv = levels[m]["math"]
        cells = [NAME[m], " / ".join(f"{100 * v:.1f}" for v in lv["values"]), fmt_value(lv["mean"], "pct")]
        p = paired.get(m)
        if p and "math" in p:
            cells += [_pooled(p["math"]), f"[{100 * p['math']['t_lo']:+.1f}, {100 * p['math']['t_hi']:+.1f}]",
                      _pooled(p["math_sampled"]) if "math_sampled" in p else "-"]
        else:
            cells += ["-", "-", "-"]
        lines.append(_row(cells))
    return lines


def _vals(summary: dict, key: str) -> list[float] | None:
    """A stage or eval metric's per-seed values from summary["metrics"] ("FILE:KEY"), or None."""
    m = summary.get("metrics", {}).get(key)
    return m["values"] if m and all(isinstance(v, (int, float)) for v in m["values"]) else None


def targets_table(summary: dict | None) -> list[str]:
    """The targets that need several seeds, one row each: per seed, mean, worst (the lower where
    higher is better) and the target. A row whose metrics some seed lacks is left out."""
    if not summary:
        return []
    runs, levels, paired = summary["runs"], summary.get("levels", {}), summary.get("paired", {})
    rows: list[tuple[str, list[float] | None, str, bool, str]] = []  # label, values, kind, higher is better, target
    first = levels.get("sft", {}).get("math", {}).get("values")
    second = _vals(summary, "eval/sft.json:multiturn_exact_match")
    rows.append(("SFT: second-turn math below first-turn, points",
                 [100 * (a - b) for a, b in zip(first, second)] if first and second else None, "pts", False, "at most 5"))
    rows.append(("SFT: out-of-scope requests answered without a worked sum",
                 _vals(summary, "eval/sft.json:scope_no_math_rate"), "pct", True, "at least 95%"))
    rows.append(("the same, asked after a sum or a word problem",
                 _vals(summary, "eval/sft.json:scope_no_math_rate_second_turn"), "pct", True, "at least 95%"))
    for key, label in (("context_math_after_scope_drop", "SFT: math after an out-of-scope request below math alone"),
                       ("context_arithmetic_system_helpful_drop",
                        'SFT: bare arithmetic under "You are a helpful assistant." below none')):
        drop = _vals(summary, f"eval/sft.json:{key}")
        rows.append((label + ", points", [100 * v for v in drop] if drop else None, "pts", False, "at most 5"))
    sft_bpb, base_bpb = _vals(summary, "eval/sft.json:val_bpb"), _vals(summary, "eval/base.json:val_bpb")
    rows.append(("SFT's held-out text bits/byte over the base model's",
                 [a / b for a, b in zip(sft_bpb, base_bpb)] if sft_bpb and base_bpb else None, "ratio", False,
                 "at most 1.2"))
    rm, lik = _vals(summary, "reward.json:accuracy"), _vals(summary, "reward.json:sft_likelihood_accuracy")
    rows.append(("RM: held-out comparisons of SFT's own answers ranked right", rm, "pct", True, "at least 95%"))
    rows.append(("RM minus SFT's likelihood on the same pairs, points",
                 [100 * (a - b) for a, b in zip(rm, lik)] if rm and lik else None, "pts", True, "at least +5"))
    rows.append(("RM without its likelihood feature (the head alone)",
                 _vals(summary, "reward.json:accuracy_without_likelihood"), "pct", True, "-"))
    rows.append(("held-out wrong answers that are SFT's own greedy choice",
                 _vals(summary, "samples.json:heldout_errors_sft_would_make"), "pct", False, "- (no reward read from"
                 " SFT ranks these)"))
    sep = summary.get("rm_separation", {}).get("sft")
    rows.append(("RM AUC, SFT's right over wrong test answers", sep["values"] if sep else None, "num", True,
                 "at least 0.85"))
    lines = [_row(["target", f"seeds {' / '.join(runs)}", "mean", "worst", "target"]), _row(["---"] * 5)]
    show = {"pct": lambda v: f"{100 * v:.1f}%", "pts": lambda v: f"{v:+.1f}", "ratio": lambda v: f"{v:.2f}",
            "num": lambda v: f"{v:.2f}"}
    for label, values, kind, higher, target in rows:
        if not values or len(values) != len(runs):
            continue
        f = show[kind]
        worst = min(values) if higher else max(values)
        lines.append(_row([label, " / ".join(f(v) for v in values), f(sum(values) / len(values)), f(worst), target]))
    for model, skill, label, target in (("ppo_rm", "math", "PPO on the RM alone: math change vs SFT", "above 0"),
                                        ("ppo", "math", "PPO: math change vs SFT", "above 0"),
                                        ("ppo", "rm_score", "PPO: RM score change vs SFT", "above 0")):
        res = paired.get(model, {}).get(skill)
        if res:
            f = (lambda v: f"{100 * v:+.1f}") if res.get("type") == "rate" else (lambda v: f"{v:+.4f}")
            lines.append(_row([label + " (pooled over the seeds' items)", " / ".join(map(f, res["deltas"])),
                               f(res["mean"]), f"[{f(res['lo'])}, {f(res['hi'])}] (95%)", target + " (interval)"]))
    return lines if len(lines) > 2 else []


def block(metrics: str | Path = "metrics") -> str:
    """The text between the markers (markers excluded), ending in a newline."""
    metrics = Path(metrics)
    out = ["<!-- generated by `python -m llm.readme` from metrics/: rewritten, not edited by hand -->"]
    if run := run_table(metrics):
        out += ["This run (`metrics/eval/`, `metrics/paired.json`): 95% intervals; changes in points,"
                    " paired on the same items against the parent (SFT's is base).", "", *run]
    summary = _read(metrics / "seeds" / "summary.json")
    if seeds := seeds_table(summary):
        out += ["", f"{len(summary['runs'])} seeds read together (`metrics/seeds/summary.json`; where and when they"
                    " ran: `metrics/seeds/README.md`): each seed draws its own data and test items; pooled = all"
                    " seeds' items (McNemar's p), across seeds = the t interval of the per-seed changes.", "", *seeds]
    if targets := targets_table(summary):
        out += ["", "The targets that need several seeds, on the same three (worst: the seed furthest from the"
                    " target; the last rows' fourth column is the pooled 95% interval):", "", *targets]
    return "\n".join(out) + "\n"


def replace_block(text: str, new: str, where: str = "README.md") -> str:
    """`text` with what stands between the markers replaced by `new`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{where}: expected one `{BEGIN}` line followed by one `{END}` line; add them where"
                         " the results tables belong")
    head, rest = text.split(BEGIN)
    return head + BEGIN + "\n" + new.lstrip("\n") + END + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write the README's results tables from the committed metrics.",
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("readme", nargs="?", default="README.md")
    ap.add_argument("--metrics", default="metrics", help="the metrics directory (default: metrics)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when the block differs")
    args = ap.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text(encoding="utf-8")
    try:
        new = replace_block(text, block(args.metrics), str(path))
    except ValueError as e:
        print(f"readme: {e}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(f"{path}: the results tables differ from {args.metrics}/; run `python -m llm.readme` and commit"
                  f" {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        atomic_write_text(path, new)
    print(f"{path}: results tables {'rewritten' if new != text else 'already'} from {args.metrics}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
