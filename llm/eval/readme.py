"""Everything in the README that comes from a run, generated from the metrics it wrote.

    python -m llm.readme                  # rewrite README.md's generated blocks from metrics/
    python -m llm.readme --check          # exit 1 when a block differs from metrics/

Each block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; nothing outside them is
touched, and every number inside one is read from metrics/ (BLOCKS):

- `run`: which run the numbers are (commit, date, machine) and how long its stages took, from the
  header of the report it wrote (`metrics/report.md`);
- `results`: the same provenance, then two short tables: this run, one row per model
  (`metrics/eval/<model>.json`): greedy math with its 95% interval, the paired change against the
  model's parent (`metrics/paired.json`), instruction tasks, bare arithmetic, sampled math,
  pass@k, RM score, win rate, KL per token against SFT, and bits per byte of held-out Shakespeare
  (how well the model still reads plain text; lower is better); and several seeds read together
  (`metrics/seeds/summary.json`, written by `python -m llm.seeds`): greedy math per seed and its
  mean, each RL model's change from SFT pooled over all the seeds' items and across seeds, then
  the targets that need several seeds, per seed with mean and worst;
- `findings`: the one-line findings, from the seeds' summary and this run;
- `experiment`: what the README's experiment (GRPO on shuffled rewards) changed on this run.

The seeds' summary is shown only where it holds this run (one of its seeds has this run's greedy
math for every model): after a run of your own it does not, and the block says how to read your
run with the committed seeds instead of showing another run's numbers. A missing file leaves its
rows or its table out (a run may stop before the last stage); nothing is filled in.
tests/test_readme.py fails when the committed README and the committed metrics disagree: after a
run you keep, run this command and commit README.md with it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from llm.eval.report import MODELS, NAME, PARENT, dig, fmt_interval, fmt_p, fmt_value
from llm.fileio import atomic_write_text

SEEDS_COMMAND = ("python -m llm.seeds 1337=. 1338=metrics/seeds/1338 1339=metrics/seeds/1339 --json"
                 " metrics/seeds/summary.json --markdown metrics/seeds/summary.md")


def seeds_command(summary: dict | None) -> str:
    """The command that rewrites the seeds' summary: SEEDS_COMMAND, with the summary's --models
    where it read only some models (seeds whose every stage has not run)."""
    models = (summary or {}).get("models")
    return SEEDS_COMMAND + (f" --models {' '.join(models)}" if models else "")


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = markers("results")

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


PREFERENCE_MODELS = ("sft", "ppo", "ppo_rm", "dpo")


def preference_table(metrics: Path) -> list[str]:
    """The continuation preference on this run: one row per model evaluated on held-out passages
    (the gold judge's mean with its paired change against SFT, the win rate against SFT, the
    reward model's mean, KL, the base model's bits/byte over SFT's); [] without them. Only files
    git keeps (metrics/eval/, paired.json): the reward model's agreement and best-of-n are the
    report's."""
    evals = {m: e for m in PREFERENCE_MODELS
             if (e := _read(metrics / "eval" / f"{m}.json")) and isinstance(e.get("continuation_gold"), (int, float))}
    if not evals:
        return []
    paired = _read(metrics / "paired.json") or {}
    labels = ["model", "gold judge", "change vs SFT", "win rate vs SFT", "RM score", "KL, nats/token",
              "base bits/byte over SFT's"]
    lines = [_row(labels), _row(["---"] * len(labels))]
    for m, e in evals.items():
        res = paired.get(f"{m}_vs_sft", {}).get("continuation")
        change = f"{res['delta']:+.3f} [{res['lo']:+.3f}, {res['hi']:+.3f}]" if res else "-"
        ratio = (e["continuation_base_bpb"] / e["continuation_base_bpb_sft"]
                 if isinstance(e.get("continuation_base_bpb"), (int, float)) and e.get("continuation_base_bpb_sft")
                 else None)
        lines.append(_row([NAME[m], f"{e['continuation_gold']:+.3f}", change,
                           _cell(e, "continuation_win_rate", "pct") if m != "sft" else "-",
                           f"{e['continuation_rm']:+.3f}", f"{e['continuation_kl']:.3f}",
                           f"{ratio:.2f}" if ratio is not None else "n/a"]))
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
    rows.append(("RM: held-out comparisons of SFT's own answers ranked right", rm, "pct", True,
                 "- (the old target is withdrawn: a slip the trunk cannot see; docs/log.md)"))
    sep = summary.get("rm_separation", {}).get("sft")
    rows.append(("RM AUC, SFT's right over wrong test answers", sep["values"] if sep else None, "num", True,
                 "at least 0.85"))
    rows.append(("RM: the gold judge's held-out comparisons of SFT's continuations ranked as it does",
                 _vals(summary, "reward.json:by_kind.continuation.accuracy"), "pct", True, "at least 90%"))
    rows.append(("RM: Spearman with the judge on single continuations",
                 _vals(summary, "reward.json:continuation_spearman"), "num", True, "at least 0.8"))
    rows.append(("PPO: the judge prefers its continuation to SFT's", _vals(summary, "eval/ppo.json:continuation_win_rate"),
                 "pct", True, "at least 75%"))
    rows.append(("PPO: KL to SFT on held-out passages, nats/token", _vals(summary, "eval/ppo.json:continuation_kl"),
                 "num", False, "within 0.05-0.2"))
    bpb, bpb_sft = (_vals(summary, f"eval/ppo.json:continuation_base_bpb{k}") for k in ("", "_sft"))
    rows.append(("PPO: the base model's bits/byte on its continuations over on SFT's",
                 [a / b for a, b in zip(bpb, bpb_sft)] if bpb and bpb_sft else None, "ratio", False, "at most 1.25"))
    rep, rep_sft = (_vals(summary, f"eval/{m}.json:continuation_repetition") for m in ("ppo", "sft"))
    rows.append(("PPO: repeated trigrams over SFT's, points", [100 * (a - b) for a, b in zip(rep, rep_sft)]
                 if rep and rep_sft else None, "pts", False, "at most 5"))
    lines = [_row(["target", f"seeds {' / '.join(runs)}", "mean", "worst", "target"]), _row(["---"] * 5)]
    show = {"pct": lambda v: f"{100 * v:.1f}%", "pts": lambda v: f"{v:+.1f}", "ratio": lambda v: f"{v:.2f}",
            "num": lambda v: f"{v:.2f}"}
    for label, values, kind, higher, target in rows:
        if not values or len(values) != len(runs):
            continue
        f = show[kind]
        worst = min(values) if higher else max(values)
        lines.append(_row([label, " / ".join(f(v) for v in values), f(sum(values) / len(values)), f(worst), target]))
    for model, skill, label, target in (("grpo", "tier_edge", "GRPO on the edge tier: greedy change vs SFT",
                                         "at least +8, above 0 on every seed"),
                                        ("grpo_random", "tier_edge", "its shuffled-reward control on the edge tier",
                                         "covers 0"),
                                        ("grpo", "tier_in_distribution", "GRPO in distribution: change vs SFT",
                                         "not below -1"),
                                        ("ppo", "math", "PPO (on passages): math change vs SFT",
                                         "within 2 points of 0"),
                                        ("ppo", "multiturn", "PPO: second-turn math change vs SFT",
                                         "within 2 points of 0"),
                                        ("ppo", "task", "PPO: instruction tasks change vs SFT",
                                         "within 2 points of 0")):
        res = paired.get(model, {}).get(skill)
        if res:
            f = (lambda v: f"{100 * v:+.1f}") if res.get("type") == "rate" else (lambda v: f"{v:+.4f}")
            lines.append(_row([label + " (pooled over the seeds' items)", " / ".join(map(f, res["deltas"])),
                               f(res["mean"]), f"[{f(res['lo'])}, {f(res['hi'])}] (95%)", target + " (interval)"]))
    return lines if len(lines) > 2 else []


def run_header(metrics: Path) -> dict[str, str]:
    """The report's header lines (`- **label**: text`: profile, commit, date, machine, wall time),
    written by the same run as the metrics (llm/eval/report_render.py header_lines); {} without a report."""
    path = metrics / "report.md"
    if not path.is_file():
        return {}
    head = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"- \*\*(.+?)\*\*: (.*)$", line):
            head[m.group(1)] = m.group(2)
        elif line.startswith("## "):
            break
    return head


def provenance(metrics: Path) -> str:
    """One sentence: which run the numbers are, on what machine, and how long its stages took."""
    head = run_header(metrics)
    if not head:
        return ("No `metrics/report.md`, so which run and machine these numbers come from is not known here:"
                " `dvc repro report` writes it.")
    wall = head.get("wall time", "not recorded").split(",")[0].split(" (")[0]
    return (f"The numbers below come from the run of commit {head.get('commit', 'unknown')}"
            f" ({head.get('date', 'date unknown')}) on {head.get('machine', 'an unknown machine')}; its stages"
            f" recorded {wall} (`metrics/report.md`).")


def summary_holds_run(summary: dict | None, metrics: Path) -> bool:
    """True when one of the summary's seeds has this run's greedy math for every model it reads."""
    if not summary or not summary.get("levels"):
        return False
    evals = {m: _read(metrics / "eval" / f"{m}.json") for m in summary["levels"]}
    if any(e is None for e in evals.values()):
        return False
    return any(all(abs(lv["math"]["values"][i] - evals[m].get("math_exact_match", float("nan"))) < 1e-9
                   for m, lv in summary["levels"].items() if "math" in lv)
               for i in range(len(summary["runs"])))


def _stale_seeds(summary: dict | None) -> str:
    return ("`metrics/seeds/summary.json` reads other runs than this one (none of its seeds has this run's"
            " greedy math), so its tables and findings are left out: to read this run with the committed seeds,"
            f" `{seeds_command(summary)}`, then `python -m llm.readme`.")


def results(metrics: Path) -> str:
    out = [provenance(metrics)]
    if run := run_table(metrics):
        out = [out[0] + " This run (`metrics/eval/`, `metrics/paired.json`): 95% intervals; changes in points,"
                        " paired on the same items against the parent (SFT's is base).", "", *run]
    if pref := preference_table(metrics):
        out += ["", "The continuation preference on this run (held-out passages of verse, each continued once; the"
                    " gold judge is VADER's sentiment, the reward model's stand-in for a rater; change: paired on"
                    " the same passages, with its 95% interval by the bootstrap):", "", *pref]
    summary = _read(metrics / "seeds" / "summary.json")
    if summary and not summary_holds_run(summary, metrics):
        return "\n".join(out + ["", _stale_seeds(summary)])
    if seeds := seeds_table(summary):
        out += ["", f"{len(summary['runs'])} seeds read together (`metrics/seeds/summary.json`; where and when they"
                    " ran: `metrics/seeds/README.md`): each seed draws its own data and test items; pooled = all"
                    " seeds' items (McNemar's p), across seeds = the t interval of the per-seed changes.", "", *seeds]
    if targets := targets_table(summary):
        out += ["", f"The targets that need several seeds, on the same {len(summary['runs'])} (worst: the seed furthest"
                    " from the target; the last rows' fourth column is the pooled 95% interval):", "", *targets]
    return "\n".join(out)


# the RL stages in the findings' order, with the words a finding names them by
RL_LABELS = (("grpo", "GRPO"), ("grpo_random", "its shuffled-reward control"), ("ppo", "PPO"),
             ("ppo_rm", "PPO on the reward model alone"), ("dpo", "DPO"))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def findings(metrics: Path) -> str:
    """The one-line findings, each number read from the seeds' summary (or this run, where it says so)."""
    summary = _read(metrics / "seeds" / "summary.json")
    if not summary_holds_run(summary, metrics) or "math" not in summary["levels"].get("sft", {}):
        return run_findings(metrics)
    n, levels, paired = len(summary["runs"]), summary["levels"], summary["paired"]
    log = "([log](docs/log.md))"
    out = []
    first, second = levels["sft"]["math"]["values"], _vals(summary, "eval/sft.json:multiturn_exact_match")
    scope, scope2 = (_vals(summary, f"eval/sft.json:scope_no_math_rate{k}") for k in ("", "_second_turn"))
    bpb, base_bpb = _vals(summary, "eval/sft.json:val_bpb"), _vals(summary, "eval/base.json:val_bpb")
    parts = [f"SFT does the work ({n} seeds): greedy math {100 * _mean(first):.1f}%"
             f" ({100 * min(first):.1f}-{100 * max(first):.1f}% across seeds)"]
    if second:
        gaps = [100 * (a - b) for a, b in zip(first, second)]
        parts.append(f"second turns {abs(_mean(gaps)):.1f} points {'below' if _mean(gaps) >= 0 else 'above'} first"
                     f" ones (worst seed {max(gaps):+.1f})")
    if scope:
        parts.append(f"requests outside its skills get its statement of what it can do, not a sum,"
                     f" {100 * _mean(scope):.0f}% of the time" + (f" ({100 * _mean(scope2):.0f}% asked mid-conversation)"
                                                                   if scope2 else ""))
    if bpb and base_bpb:
        parts.append(f"held-out text at {_mean([a / b for a, b in zip(bpb, base_bpb)]):.2f} times the base model's"
                     " bits/byte")
    out.append("; ".join(parts) + f" {log}.")
    rl = [(m, label) for m, label in RL_LABELS if "math" in paired.get(m, {})]
    if rl:
        # the first with its interval and p, the rest as means beside it
        cells = [f"{label} " + (_pooled(paired[m]["math"]) if i == 0 else f"{100 * paired[m]['math']['mean']:+.1f}")
                 for i, (m, label) in enumerate(rl)]
        line = "RL's change of greedy math from SFT, pooled over the seeds' items: " + ", ".join(cells)
        if "math_sampled" in paired.get("dpo", {}):
            line += f"; DPO's sampled math {_pooled(paired['dpo']['math_sampled'])}"
        out.append(line + f" {log}.")
    if line := tier_finding({m: paired.get(m, {}) for m in ("grpo", "grpo_random", "ppo")},
                            _vals(summary, "eval/sft.json:tier_edge_greedy_wrong_pass"), pooled=True):
        out.append(line + f" {log}.")
    elif "grpo" not in summary["levels"] and (line := run_tier_finding(metrics)):
        out.append(line + f"; the other seeds did not run GRPO {log}.")   # seeds read without GRPO (--models)
    if line := preference_finding(metrics):
        out.append(line)
    if line := ranker_finding({**{k: _vals(summary, f"rankers.json:{k}") for k in RANKER_KEYS},
                               **{k: _vals(summary, f"verifier.json:{k}") for k in VERIFIER_KEYS}}):
        out.append(line + f" {log}.")
    rm, lik = _vals(summary, "reward.json:accuracy"), _vals(summary, "reward.json:sft_likelihood_accuracy")
    own = _vals(summary, "samples.json:heldout_errors_sft_would_make")
    sep = summary.get("rm_separation", {}).get("sft")
    if rm and lik:
        diff = 100 * (_mean(rm) - _mean(lik))
        line = (f"The reward model, taught on SFT's own answers, ranks {100 * _mean(rm):.0f}% of held-out comparisons"
                f" right, {abs(diff):.0f} points {'below' if diff < 0 else 'above'} SFT's own likelihood")
        if sep:
            line += f" (AUC {min(sep['values']):.2f}-{max(sep['values']):.2f})"
        if own:
            line += (f": {100 * min(own):.0f}-{100 * max(own):.0f}% of SFT's held-out errors are its own greedy"
                     " choices, which no reward read from SFT can rank")
        out.append(line + f" {log}.")
    sft = _read(metrics / "eval" / "sft.json") or {}
    if isinstance(sft.get("task_exact_match_reverse"), (int, float)):
        out.append("SFT's data mix is a trade: more instruction tasks cost math; reversing a word scores"
                   f" {100 * sft['task_exact_match_reverse']:.1f}% on this run, recalled not computed {log}.")
    return "\n".join(f"- {line}" for line in out)


def run_findings(metrics: Path) -> str:
    """The findings of this run alone (one seed, and it says so), while the seeds' summary does not
    hold it: SFT's math alone and in a conversation's contexts, and what each RL stage changed."""
    sft, paired = _read(metrics / "eval" / "sft.json") or {}, _read(metrics / "paired.json") or {}
    out = []
    if isinstance(sft.get("math_exact_match"), (int, float)):
        line = f"SFT does the work (this run, one seed): greedy math {100 * sft['math_exact_match']:.1f}%"
        asked = [(f"context_{s}", what, ctx, label) for s, what in (("math", "word problems"),
                                                                   ("arithmetic", "bare calculations"))
                 for ctx, label in (("after_scope", "after an out-of-scope request"),
                                    ("system_helpful", 'under "You are a helpful assistant."'))]
        parts = [f"{what} {label} {100 * sft[f'{p}_{ctx}']:.0f}% against {100 * sft[f'{p}_alone']:.0f}% alone"
                 for p, what, ctx, label in asked if isinstance(sft.get(f"{p}_{ctx}"), (int, float))]
        out.append(line + ("; " + ", ".join(parts) if parts else "") + " ([log](docs/log.md)).")
    cells = [f"{label} {_pp(paired[f'{m}_vs_sft']['math'])}" for m, label in RL_LABELS
             if "math" in paired.get(f"{m}_vs_sft", {})]
    if cells:
        out.append("RL's change of greedy math from SFT on this run's items: " + ", ".join(cells) + ".")
    if line := run_tier_finding(metrics):
        out.append(line + ".")
    if line := preference_finding(metrics):
        out.append(line)
    out.append(f"Read across seeds: `{seeds_command(_read(metrics / 'seeds' / 'summary.json'))}`, then"
               " `python -m llm.readme`.")
    return "\n".join(f"- {line}" for line in out)


def run_tier_finding(metrics: Path) -> str | None:
    """tier_finding of this run's GRPO and its control (metrics/paired.json, eval/sft.json)."""
    paired, sft = _read(metrics / "paired.json") or {}, _read(metrics / "eval" / "sft.json") or {}
    head = sft.get("tier_edge_greedy_wrong_pass")
    return tier_finding({m: paired.get(f"{m}_vs_sft", {}) for m in ("grpo", "grpo_random", "ppo")},
                        [head] if isinstance(head, (int, float)) else None, pooled=False)


def preference_finding(metrics: Path) -> str | None:
    """The continuation preference in one line (this run): what PPO and DPO did to the gold judge's
    mean and win rate against SFT and at what KL (from metrics/eval/, which git keeps)."""
    evals = {m: _read(metrics / "eval" / f"{m}.json") or {} for m in ("sft", "ppo", "dpo")}
    if not all(isinstance(e.get("continuation_gold"), (int, float)) for e in evals.values()):
        return None
    parts = [f"{NAME[m]} {evals['sft']['continuation_gold']:+.2f} -> {e['continuation_gold']:+.2f}, winning"
             f" {100 * e['continuation_win_rate']:.0f}% {fmt_interval(e['continuation_win_rate_lo'], e['continuation_win_rate_hi'], 'pct')}"
             f" of passages at KL {e['continuation_kl']:.2f} nats/token"
             for m, e in evals.items() if m != "sft"]
    line = "The continuation preference, judged by the gold judge (this run): " + "; ".join(parts)
    return line + "; the reward model's agreement with the judge and its best-of-n: the report ([log](docs/log.md))."


RANKER_KEYS = ("greedy_accuracy", "pass_at_n", "rankers.likelihood.best_of_n", "rankers.reward_model.best_of_n",
               "rankers.dpo_implicit.best_of_n", "rankers.agreement.best_of_n", "rankers.generative_verifier.best_of_n")
VERIFIER_KEYS = ("heldout_pair_accuracy", "heldout_likelihood_pair_accuracy")


def _change(res: dict, pooled: bool) -> str:
    """A paired change in points with its interval: pooled over seeds (summary["paired"]) or one
    run's (metrics/paired.json)."""
    if pooled:
        worst = f", worst seed {100 * res['worst']:+.1f}" if len(res.get("deltas", [])) > 1 else ""
        return f"{100 * res['mean']:+.1f} [{100 * res['lo']:+.1f}, {100 * res['hi']:+.1f}]{worst}"
    return _pp(res)


def tier_finding(paired: dict[str, dict], headroom: list[float] | None, *, pooled: bool) -> str | None:
    """GRPO's change of greedy math per difficulty tier, its control's and PPO's on the edge, and how
    much sharpening could add there; None when GRPO was not evaluated on the tiers."""
    g = paired.get("grpo", {})
    if "tier_edge" not in g:
        return None
    where = "pooled over the seeds' items" if pooled else "this run's items"
    parts = [f"on the edge tier {_change(g['tier_edge'], pooled)}"]
    if "tier_edge" in paired.get("grpo_random", {}):
        parts.append(f"its shuffled-reward control there {_change(paired['grpo_random']['tier_edge'], pooled)}")
    if "tier_edge" in paired.get("ppo", {}):  # PPO trains on no edge problem: what GRPO's gain is read beside
        parts.append(f"PPO there {_change(paired['ppo']['tier_edge'], pooled)}")
    for key, label in (("tier_in_distribution", "in distribution"), ("tier_harder", "on the harder tier, never trained on")):
        if key in g:
            parts.append(f"{label} {_change(g[key], pooled)}")
    line = f"GRPO per difficulty tier, greedy math against SFT ({where}): " + ", ".join(parts)
    if headroom:
        line += (f"; SFT's greedy answer is wrong while one of its 16 samples is right on"
                 f" {100 * _mean(headroom):.0f}% of the edge problems, the most sharpening can add")
    return line


def ranker_finding(values: dict[str, list[float] | None]) -> str | None:
    """Best-of-16 on the edge tier by each ranker against greedy decoding (means over the seeds)."""
    greedy, n = values.get("greedy_accuracy"), len(values.get("greedy_accuracy") or [])
    if not greedy or not values.get("rankers.likelihood.best_of_n"):
        return None
    names = (("likelihood", "SFT's likelihood"), ("reward_model", "the reward model"),
             ("dpo_implicit", "DPO's implicit reward"), ("agreement", "agreement among the samples"),
             ("generative_verifier", "SFT's own verdict (a generative verifier)"))
    cells = [f"{label} {100 * _mean(v):.1f}%" for key, label in names
             if (v := values.get(f"rankers.{key}.best_of_n")) and len(v) == n]
    line = (f"Picking the best of 16 of SFT's answers on the edge tier{' (mean of ' + str(n) + ' seeds)' if n > 1 else ''}:"
            f" greedy {100 * _mean(greedy):.1f}%, pass@16 {100 * _mean(values.get('pass_at_n') or greedy):.1f}%; by "
            + ", ".join(cells))
    own, lik = values.get("heldout_pair_accuracy"), values.get("heldout_likelihood_pair_accuracy")
    if own and lik and len(own) == len(lik) == n:
        line += (f"; taught to judge its own answers, the verifier orders {100 * _mean(own):.0f}% of held-out pairs of"
                 f" one problem's right and wrong answers right (worst seed {100 * min(own):.0f}%), SFT's likelihood"
                 f" {100 * _mean(lik):.0f}%")
    return line


def experiment(metrics: Path) -> str:
    """What the README's experiment (`ppo.clip_epsilon`) is read against on the run the tables show:
    PPO's continuations and skills (metrics/eval/, which git keeps)."""
    e, sft = _read(metrics / "eval" / "ppo.json"), _read(metrics / "eval" / "sft.json")
    if not (e and sft and "continuation_gold" in e and "continuation_gold" in sft):
        return ("This run has no PPO evaluated on held-out passages (`metrics/eval/ppo.json`,"
                " `continuation_*`: eval.continuation_items).")
    return (f"On the run the tables show, PPO's continuations of held-out passages score"
            f" {e['continuation_gold']:+.3f} by the gold judge (SFT's {sft['continuation_gold']:+.3f}), win"
            f" {100 * e['continuation_win_rate']:.1f}% {fmt_interval(e['continuation_win_rate_lo'], e['continuation_win_rate_hi'], 'pct')}"
            f" of passages against SFT's, at KL {e['continuation_kl']:.3f} nats per token, with greedy math at"
            f" {100 * e['math_exact_match']:.1f}% (SFT's {100 * sft['math_exact_match']:.1f}%): what `dvc metrics diff`"
            f" sets the experiment's numbers against ([log](docs/log.md): what it changed when we ran it).")


# name -> the text between its markers; each reads only metrics/
BLOCKS: dict[str, Callable[[Path], str]] = {"run": provenance, "results": results, "findings": findings,
                                            "experiment": experiment}
NOTE = "<!-- generated by `python -m llm.readme` from metrics/: rewritten, not edited by hand -->"


def block(metrics: str | Path = "metrics", name: str = "results") -> str:
    """The text between `name`'s markers (markers excluded), ending in a newline."""
    body = BLOCKS[name](Path(metrics))
    return (f"{NOTE}\n{body}\n" if name == "results" else f"{body}\n")


def replace_block(text: str, new: str, where: str = "README.md", name: str = "results") -> str:
    """`text` with what stands between `name`'s markers replaced by `new`."""
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where}: expected one `{begin}` line followed by one `{end}` line; add them where"
                         f" the generated {name} text belongs")
    head, rest = text.split(begin)
    return head + begin + "\n" + new.lstrip("\n") + end + rest.split(end, 1)[1]


def render(text: str, metrics: str | Path, where: str = "README.md") -> str:
    """`text` with every block of BLOCKS whose markers it holds rewritten (the results block is required)."""
    for name in BLOCKS:
        if name == "results" or markers(name)[0] in text:
            text = replace_block(text, block(metrics, name), where, name)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write the README's numbers from the committed metrics.",
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("readme", nargs="?", default="README.md")
    ap.add_argument("--metrics", default="metrics", help="the metrics directory (default: metrics)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block differs")
    args = ap.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text(encoding="utf-8")
    try:
        new = render(text, args.metrics, str(path))
    except ValueError as e:
        print(f"readme: {e}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(f"{path}: the generated blocks differ from {args.metrics}/; run `python -m llm.readme` and commit"
                  f" {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        atomic_write_text(path, new)
    print(f"{path}: generated blocks {'rewritten' if new != text else 'already'} from {args.metrics}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
