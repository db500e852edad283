"""The report card: what the run was, what each stage changed, and how sure we are.

    data = collect("metrics", max_samples=3)             # what exists; notes for what does not
    paired = paired_deltas(data["items"], confidence=0.95, n_boot=10000, seed=1337)
    head = provenance("params.yaml")                      # profile, commit, date, hardware
    md = render_markdown(data, paired, head, images={"curves": "report_curves.png", "eval": "report_eval.png"})
    page = render_html(data, paired, head, images={"curves": png_bytes, "eval": png_bytes})
    # (render_* are in llm/eval/report_render.py; the figures in llm/eval/report_plots.py)

Reads the per-model eval metrics, samples and per-item outcomes (`metrics/eval/<model>.json`,
`_samples.json`, `_items.jsonl`), the stage metrics (`metrics/<stage>.json`) and the per-step
TSVs of `metrics/plots/`; any of them may be missing (stages land one by one, or one failed):
it is left out and listed in `data["notes"]`, never filled in.

The page, top to bottom:
- a header: the profile (from params.yaml's `# profile:` line), the git commit and whether
  code or params differ from it, the date, the machine, and the wall time each stage recorded
  in its own metrics (`stage_time_s`, else `train_time_s` + `eval_time_s`, else `seconds`;
  eval's `timing_s`); a smoke run says that its numbers check plumbing, not learning;
- the summary table: one row per model, one column per headline skill: the value, its 95%
  interval, and the paired change against the parent (sft vs base; the others vs sft)
  with its interval, marked significant or not (llm/eval/paired.py);
- per stage, a sentence saying what moved and whether it is significant, then every skill's
  paired comparison (per level, per task kind and per context too); for GRPO, how much of its change in
  math its control (grpo_random: the same rewards given to random samples) leaves to the
  real reward (`control_line`);
- math by difficulty tier (when evaluated: llm/eval/tiers.py): per tier and model, greedy accuracy
  with its paired change against the parent, pass@1 and pass@k of sampled answers, the majority
  vote, and the share greedy gets wrong while a sample is right (what sharpening can add at most),
  the pass@k curves as a figure (`tier_rows`, `tier_line`);
- math rankers (stage rankers, llm/post/rankers.py): how often each score ranks a right answer of
  SFT's above a wrong one, overall and against SFT's own greedy answer, and its best-of-n accuracy
  beside pass@n (`ranker_rows`, `ranker_line`; the curves as a figure);
- over-optimisation: PPO on the reward model alone (ppo_rm), its RM score (proxy) and the
  verifier's accuracy (gold) of each step's rollouts against sqrt(KL to SFT), and the KL at
  which the gold stops rising (`overoptimisation`, `overopt_line`);
- the continuation preference (when evaluated: llm/post/continuation.py): per model, the gold
  judge's mean on held-out passages with its paired change against SFT, the win rate against SFT's
  continuation of the same passage, the reward model's score, KL per continuation, the base
  model's bits per byte and repetition, beside the reward model's best-of-n of SFT's samples
  (stage rankers); the gold and the proxy against sqrt(KL) along PPO's evaluations and along n;
  SFT's and PPO's continuations of the same passages (`preference_rows`, `preference_line`,
  `preference_curves`, `preference_samples`);
- plots (llm/eval/report_plots.py), samples of each skill marked right or wrong, the fixed prompts,
  every eval metric per model, and a few headline numbers per training stage. Hashes and
  the full key=value contents stay in the metrics files.

This module gathers and words the content; llm/eval/report_render.py writes it as markdown and as
an offline HTML page.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Sequence

from llm.config import TASK_KINDS
from llm.eval.paired import CONTEXT_OF, CONTEXT_WHERE, TIER_LABELS, compare, read_items
from llm.train.metrics import join_metrics, run_info_path, timings_path

# ppo_rm (PPO on the reward model alone) and grpo_random (GRPO's control: its rewards shuffled
# across each step's samples) stand beside the stages they vary
MODELS = ("base", "sft", "ppo", "ppo_rm", "grpo", "grpo_random", "dpo")
PARENT = {"sft": "base", "ppo": "sft", "ppo_rm": "sft", "grpo": "sft", "grpo_random": "sft", "dpo": "sft"}
NAME = {"base": "base", "sft": "SFT", "ppo": "PPO", "ppo_rm": "PPO on the RM alone", "grpo": "GRPO",
        "grpo_random": "GRPO on shuffled rewards", "dpo": "DPO"}
STAGES = ("tokenizer", "tokenize", "pretrain", "clean_sft", "sft", "samples", "reward", "pairs", "dpo", "ppo",
          "ppo_rm", "grpo", "grpo_random", "verifier", "rankers")
PLUMBING_PROFILES = {"smoke": "Smoke profile: tiny models trained for a few steps, so that every stage runs end to end"
                              " in minutes. These numbers check the plumbing, not learning: do not read them as"
                              " results."}

# The summary table's columns: (eval metrics key, paired skill or None, label, kind). kind "pct"
# shows a proportion as a percentage (changes in percentage points), "num" a plain number.
SUMMARY: tuple[tuple[str, str | None, str, str], ...] = (
    ("math_exact_match", "math", "math", "pct"),
    ("math_exact_match_en", "math_en", "English math", "pct"),
    ("math_exact_match_zh", "math_zh", "Chinese math", "pct"),
    ("math_format_rate", "math_format", "#### N format", "pct"),
    ("task_exact_match", "task", "instruction tasks", "pct"),
    ("arithmetic_exact_match", "arithmetic", "bare arithmetic", "pct"),
    ("math_sample_accuracy", "math_sampled", "sampled math", "pct"),
    ("rm_score", "rm_score", "RM score", "num"),
    ("win_rate_vs_sft", None, "win rate vs SFT", "pct"),
    ("kl", None, "KL to SFT, nats/token", "num"),
)
HEADLINE_SKILLS = tuple(s for _, s, _, _ in SUMMARY if s)

# Every eval metric, one row each: (key, label, kind); rows no model has are dropped.
ALL_METRICS: tuple[tuple[str, str, str], ...] = (
    ("math_exact_match", "math exact match (greedy)", "pct"),
    ("math_exact_match_en", "English math", "pct"),
    ("math_exact_match_zh", "Chinese math", "pct"),
    *((f"math_exact_match_level{i}", f"math level {i}", "pct") for i in (1, 2, 3, 4)),
    ("math_exact_match_level0", "math from sources (prepare.math_test_sources: GSM8K)", "pct"),
    ("math_format_rate", "answers ending in a #### N line", "pct"),
    ("math_sample_accuracy", "sampled math accuracy", "pct"),
    ("math_pass_at_k", "math pass@k", "pct"),
    ("task_exact_match", "instruction tasks", "pct"),
    *((f"task_exact_match_{k}", f"task: {k.replace('_', ' ')}", "pct")
      for k in TASK_KINDS),
    ("arithmetic_exact_match", "bare arithmetic", "pct"),
    ("multiturn_exact_match", "second turns: math right in the second answer", "pct"),
    ("scope_no_math_rate", "requests outside its skills answered without a worked sum", "pct"),
    ("scope_no_math_rate_second_turn", "the same, asked after a sum or a word problem", "pct"),
    ("scope_no_math_rate_zh", "the same, asked in Chinese", "pct"),
    ("scope_exact_match", "requests outside its skills answered with the taught statement", "pct"),
    *((f"context_{of}_{ctx}", f"{label}{where}", "pct")
      for of, label in CONTEXT_OF.items()
      for ctx, where in {"alone": " asked alone (the items asked again below)", **CONTEXT_WHERE}.items()),
    *((f"tier_{t}_exact_match", f"math, tier: {label}", "pct") for t, label in TIER_LABELS.items()),
    ("rm_score", "reward model score", "num"),
    ("rm_auc", "RM ranks its right math answers above its wrong ones (AUC)", "num"),
    ("win_rate_vs_sft", "win rate vs SFT (RM judge)", "pct"),
    ("kl", "KL to SFT, nats/token", "num"),
    ("kl_seq", "KL to SFT summed over a response, nats/response", "num"),
    ("val_bpb", "held-out bits per byte", "num"),
    ("val_ppl", "held-out perplexity", "num"),
    ("math_response_tokens_mean", "answer length (tokens)", "num"),
    ("toxicity_rate", "toxicity rate", "pct"),
)

# A few numbers per training stage: (stage, dotted key, label, kind)
STAGE_HEADLINES: tuple[tuple[str, str, str, str], ...] = (
    ("tokenizer", "vocab_size", "vocabulary", "int"),
    ("tokenizer", "bytes_per_token_en", "bytes per token, English", "num"),
    ("tokenizer", "bytes_per_token_zh", "bytes per token, Chinese", "num"),
    ("pretrain", "n_params", "parameters", "int"),
    ("pretrain", "tokens_seen", "tokens seen", "int"),
    ("pretrain", "val_bpb", "held-out bits per byte", "num"),
    ("clean_sft", "train.kept", "conversations kept", "int"),
    ("clean_sft", "train.dropped_total", "conversations dropped", "int"),
    ("sft", "val_loss", "held-out loss", "num"),
    ("sft", "val_loss_last", "held-out loss of the final weights (the model is the mean of the last checkpoints)", "num"),
    ("sft", "math_exact_match", "validation math", "pct"),
    ("samples", "pairs", "comparisons of SFT's own answers, labelled by the verifier", "int"),
    ("samples", "heldout_errors_sft_would_make",
     "held-out wrong answers whose first wrong step is SFT's own greedy choice (no reward read from SFT can rank"
     " these)", "pct"),
    ("reward", "accuracy", "held-out comparisons of SFT's own answers ranked right", "pct"),
    ("reward", "sft_likelihood_accuracy", "the same pairs ranked by SFT's likelihood", "pct"),
    ("reward", "accuracy_without_likelihood", "the same pairs, the likelihood feature off (the learned head alone)",
     "pct"),
    ("reward", "generated_accuracy", "generated pairs (a slip or a broken format) ranked right", "pct"),
    ("pairs", "pairs", "preference pairs", "int"),
    ("dpo", "rewards_accuracy", "held-out preference accuracy", "pct"),
    ("dpo", "ref_logp_accuracy", "the same pairs ranked by SFT's likelihood", "pct"),
    ("dpo", "kl", "KL to SFT, nats/token", "num"),
    ("ppo", "reward_start", "rollout reward, first steps", "num"),
    ("ppo", "reward_end", "rollout reward, last steps", "num"),
    ("ppo", "reward_trend", "rollout reward, change of the line fitted to every step", "num"),
    ("ppo", "heldout_reward_delta", "held-out reward, change on the same problems and draws", "num"),
    ("ppo", "math_exact_match", "validation math", "pct"),
    ("ppo_rm", "reward_start", "rollout RM score, first steps", "num"),
    ("ppo_rm", "reward_end", "rollout RM score, last steps", "num"),
    ("ppo_rm", "math_exact_match", "validation math", "pct"),
    ("grpo", "reward_start", "rollout reward, first steps", "num"),
    ("grpo", "reward_end", "rollout reward, last steps", "num"),
    ("grpo", "reward_trend", "rollout reward, change of the line fitted to the steps after the curriculum", "num"),
    ("grpo", "heldout_reward_delta", "held-out reward, change on the same problems and draws", "num"),
    ("grpo", "math_exact_match", "validation math", "pct"),
    ("grpo_random", "math_exact_match", "validation math", "pct"),
)
TSVS = ("pretrain", "pretrain_val", "sft", "sft_val", "reward", "reward_val", "dpo", "dpo_val", "ppo", "ppo_val",
        "ppo_rm", "ppo_rm_val", "grpo", "grpo_val", "grpo_random", "grpo_random_val")


# ---------------------------------------------------------------------------
# Reading

def read_tsv(path: str | Path) -> dict[str, list[float]]:
    """Columns of a TSV with a header row, as floats (empty or non-numeric cells -> NaN)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines:
        return {}
    header = lines[0].split("\t")
    cols: dict[str, list[float]] = {h: [] for h in header}
    for line in lines[1:]:
        if not line.strip():
            continue
        cells = line.split("\t")
        for h, c in zip(header, cells + [""] * (len(header) - len(cells))):
            try:
                cols[h].append(float(c))
            except ValueError:
                cols[h].append(math.nan)
    return cols


def _read_json(path: Path, notes: list[str]) -> Any:
    if not path.is_file():
        notes.append(f"{path}: missing (stage not run yet)")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        notes.append(f"{path}: unreadable ({e}); left out")
        return None


def dig(obj: Any, dotted: str) -> Any:
    """obj["a"]["b"] for "a.b"; None where a level is missing."""
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def collect(metrics_dir: str | Path = "metrics", max_samples: int = 3) -> dict:
    """Everything the report shows, from what exists under `metrics_dir`.

    Returns {"evals": {model: metrics}, "samples": {model: samples}, "items": {model: item
    records}, "stages": {stage: metrics}, "curves": {tsv name: columns}, "notes": [what is
    missing], "max_samples"}.
    """
    root = Path(metrics_dir)
    notes: list[str] = []
    evals, samples, items, stages, curves = {}, {}, {}, {}, {}
    for m in MODELS:
        e = _read_json(root / "eval" / f"{m}.json", notes)
        if not isinstance(e, dict):
            continue
        evals[m] = e
        s = _read_json(root / "eval" / f"{m}_samples.json", notes)
        if isinstance(s, dict):
            t = timings_path(root / "eval" / f"{m}.json")  # the run's timings, where they are kept
            samples[m] = {**s, **(_read_json(t, []) or {})} if t.is_file() else s
        f = root / "eval" / f"{m}_items.jsonl"
        if not f.is_file():
            notes.append(f"{f}: missing (eval@{m} predates per-item outcomes; rerun it for paired tests)")
        else:
            try:
                items[m] = read_items(f)
            except (ValueError, UnicodeDecodeError) as e:
                notes.append(f"{f}: unreadable ({e}); left out")
    for st in STAGES:
        d = _read_json(root / f"{st}.json", notes)
        if isinstance(d, dict):
            for extra in (run_info_path(root / f"{st}.json"), timings_path(root / f"{st}.json")):
                # its provenance and samples, and its timings (llm/train/metrics.py), where present
                extra_d = _read_json(extra, notes) if extra.is_file() else None
                d = join_metrics(d, extra_d) if isinstance(extra_d, dict) else d
            stages[st] = d
    for name in TSVS:
        f = root / "plots" / f"{name}.tsv"
        if f.is_file():
            cols = read_tsv(f)
            if cols.get("step"):
                curves[f.name] = cols
    for name in ("rankers", "rankers_continuation"):  # best-of-n against n (stage rankers)
        f = root / "plots" / f"{name}.tsv"
        if f.is_file() and (cols := read_tsv(f)).get("n"):
            curves[f.name] = cols
    return {"evals": evals, "samples": samples, "items": items, "stages": stages, "curves": curves, "notes": notes,
            "max_samples": max_samples, "committed_seconds": committed_seconds(root) if root.is_dir() else {}}


def paired_deltas(items: dict[str, list[dict]], *, confidence: float, n_boot: int, seed: int) -> dict[str, dict]:
    """{child: {"parent", "skills": llm.eval.paired.compare(...)}} for every model whose parent's
    items exist too (the content of metrics/paired.json)."""
    out = {}
    for child, parent in PARENT.items():
        if child in items and parent in items:
            out[child] = {"parent": parent, "skills": compare(items[child], items[parent], confidence=confidence,
                                                              n_boot=n_boot, seed=seed, child_name=child)}
    return out


def paired_metrics(paired: dict[str, dict]) -> dict[str, dict]:
    """The paired changes as a DVC metrics file: {"<child>_vs_<parent>": {skill: numbers}}, numbers
    and booleans only (labels stay in the report), so `dvc metrics diff` lists what moved."""
    return {f"{c}_vs_{p['parent']}": {s: {k: v for k, v in r.items() if k not in ("label", "type")}
                                      for s, r in p["skills"].items()} for c, p in paired.items()}


def recorded_seconds(metrics: dict) -> tuple[float, str] | None:
    """(seconds, which keys) a stage recorded about its own run, or None."""
    for keys in (("stage_time_s",), ("train_time_s", "eval_time_s"), ("seconds.total",), ("seconds",),
                 ("train_seconds",), ("timing_s.total",)):
        found = [(k, dig(metrics, k)) for k in keys]
        found = [(k, v) for k, v in found if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if found:
            return float(sum(v for _, v in found)), " + ".join(k for k, _ in found)
    return None


COMMITTED = "committed"   # stage_times' source of a time read from the committed report card


def stage_times(data: dict) -> list[tuple[str, float | None, str]]:
    """[(stage, seconds or None, source)] in pipeline order, eval@<model> included. A stage's
    timings live in its run directory (runs/<stage>/run.json: no DVC output, so that a rerun
    writes the same bytes), which a clone does not have: a stage that did not run in this
    checkout keeps the time the committed report card recorded for it (source COMMITTED)."""
    before = data.get("committed_seconds") or {}
    rows: list[tuple[str, float | None, str]] = []

    def add(name: str, metrics: dict | None) -> None:
        t = recorded_seconds(metrics) if metrics is not None else None
        if t:
            rows.append((name, t[0], t[1]))
        elif name in before:
            rows.append((name, before[name], COMMITTED))
        else:
            rows.append((name, None, ""))

    add("prepare", None)
    for st in STAGES:
        if st in data["stages"]:
            add(st, data["stages"][st])
    for m in MODELS:
        if m in data["samples"]:
            add(f"eval@{m}", data["samples"][m])
    return rows


def stage_seconds_row(text: str) -> dict[str, float]:
    """{stage: seconds} from a report card's table of stage times (report_render writes it under
    the header: a row of stage names, `|---|...`, a row of `159 s`, `159 s*` or `–`)."""
    lines = text.splitlines()
    for head, rule, row in zip(lines, lines[1:], lines[2:]):
        if head.startswith("| prepare |") and rule.startswith("|---|"):
            names = [c.strip() for c in head.strip("|").split("|")]
            cells = [c.strip().rstrip("*") for c in row.strip("|").split("|")]
            return {n: float(c.removesuffix(" s")) for n, c in zip(names, cells) if c.endswith(" s")}
    return {}


def committed_seconds(metrics_dir: str | Path) -> dict[str, float]:
    """The stage times of the report card committed at HEAD in `metrics_dir` ({} outside git)."""
    text = _git(["show", "HEAD:./report.md"], Path(metrics_dir))
    return stage_seconds_row(text) if text else {}


# ---------------------------------------------------------------------------
# Provenance

def _git(args: list[str], cwd: Path) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def _hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal"))
        mem = f", {kb / 2 ** 20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{cpu}, {os.cpu_count()} logical cores{mem} ({platform.system()} {platform.machine()})"


def provenance(params: str | Path = "params.yaml", now: datetime.datetime | None = None) -> dict[str, Any]:
    """Profile, commit, uncommitted changes to code or params, date and machine of this run."""
    params = Path(params)
    root = params.resolve().parent
    first = params.read_text(encoding="utf-8").split("\n", 1)[0] if params.is_file() else ""
    m = re.match(r"# profile: (\S+)(?: \((.*)\))?\s*$", first)
    commit = _git(["rev-parse", "--short=12", "HEAD"], root)
    status = _git(["status", "--porcelain", "--untracked-files=no"], root)
    changed = sorted({line[3:].strip() for line in (status or "").splitlines()
                      if line[3:].strip() != "dvc.lock" and not line[3:].strip().startswith("metrics/")})
    return {"profile": m.group(1) if m else None, "profile_description": (m.group(2) or "") if m else "",
            "commit": commit.strip() if commit else None, "changed": changed,
            "date": (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC"),
            "hardware": _hardware()}


# ---------------------------------------------------------------------------
# Numbers and words

def _isnum(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: Any) -> str:
    if not _isnum(v):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    a = abs(v)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}" if a >= 100 else f"{v:.3f}"


def fmt_value(v: Any, kind: str) -> str:
    if not _isnum(v):
        return "n/a"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    return f"{int(v):,}" if kind == "int" else _num(v)


def fmt_interval(lo: Any, hi: Any, kind: str) -> str:
    if not (_isnum(lo) and _isnum(hi)):
        return ""
    return f"[{100 * lo:.1f}, {100 * hi:.1f}]" if kind == "pct" else f"[{_num(lo)}, {_num(hi)}]"


def fmt_delta(d: float, kind: str) -> str:
    return f"{100 * d:+.1f} pp" if kind == "pct" else f"{d:+.3g}"


def fmt_p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def verdict(res: dict) -> str:
    """"up" / "down" (significant), "borderline" (test and interval disagree) or "flat"."""
    if res["significant"]:
        return "up" if res["delta"] > 0 else "down"
    return "borderline" if res["borderline"] else "flat"


MARK = {"up": "▲", "down": "▼", "borderline": "?", "flat": "·"}
NBSP, NBSP_COMMA = "\u00a0", ",\u00a0"


def _kind_of(skill: str, res: dict) -> str:
    return "num" if res.get("type") == "score" and skill != "math_sampled" else "pct"


def _change(skill: str, res: dict, with_values: bool = True) -> str:
    k = _kind_of(skill, res)
    text = f"{fmt_delta(res['delta'], k)} {fmt_interval(res['lo'], res['hi'], k)}".strip()
    if with_values:
        text = f"{fmt_value(res['parent_value'], k)} → {fmt_value(res['value'], k)}, {text}"
    return text


def _join(xs: Sequence[str]) -> str:
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


def stage_summary(child: str, paired: dict, evals: dict) -> tuple[str, list[str]]:
    """What moved from the parent to `child`, from the paired comparisons: (one sentence in
    words over the headline skills, [the numbers behind it, one line each])."""
    parent, res = paired[child]["parent"], paired[child]["skills"]
    head = [s for s in HEADLINE_SKILLS if s in res]
    groups: dict[str, list[str]] = {"up": [], "down": [], "borderline": [], "flat": []}
    for s in head:
        groups[verdict(res[s])].append(s)
    labels = lambda keys: _join([res[k]["label"] for k in keys])  # noqa: E731
    parts = []
    if groups["up"]:
        parts.append("significantly better at " + labels(groups["up"]))
    if groups["down"]:
        parts.append("significantly worse at " + labels(groups["down"]))
    if groups["flat"]:
        parts.append(("no significant change in " if parts else "no significant change in any skill: ")
                     + labels(groups["flat"]))
    if groups["borderline"]:
        parts.append("borderline for " + labels(groups["borderline"]))
    sentence = f"{NAME[child]} against {NAME[parent]}: " + ("; ".join(parts) if parts else "no paired items") + "."
    lines = []
    for s in groups["up"] + groups["down"] + groups["borderline"]:
        r = res[s]
        p = f", McNemar p {fmt_p(r['p_value'])}" if "p_value" in r else ""
        note = " (the test and the interval disagree)" if r["borderline"] else ""
        lines.append(f"{MARK[verdict(r)]} {r['label']}: {_change(s, r)}{p}{note}")
    fine = [f"{res[s]['label']} {MARK[verdict(res[s])]} {fmt_delta(res[s]['delta'], _kind_of(s, res[s]))}"
            for s in res if s not in head and verdict(res[s]) in ("up", "down")]
    if fine:
        lines.append("significant within those: " + _join(fine))
    ev = evals.get(child, {})
    if _isnum(ev.get("rm_auc")):
        lines.append(f"the reward model ranks {NAME[child]}'s right math answers above its wrong ones with AUC"
                     f" {_num(ev['rm_auc'])} {fmt_interval(ev.get('rm_auc_lo'), ev.get('rm_auc_hi'), 'num')}"
                     f" (0.5: its score says nothing about correctness; mean score {_num(ev['rm_score_right'])}"
                     f" right, {_num(ev['rm_score_wrong'])} wrong)")
    kl = ev.get("kl")
    if child != "sft" and _isnum(kl):
        lines.append(f"KL to SFT: {_num(kl)} nats/token" + (_NEG_KL if kl < 0 else ""))
    return sentence, lines


# What each model of the report is, one line each, in the order of MODELS (the reward model, which
# the report does not evaluate as a chat model, after SFT, which it starts from)
MODEL_LINES = (
    ("base", "pretrained from random initialisation on plain text (Shakespeare, word problems): it continues"
             " text and was never taught the chat format"),
    ("sft", "supervised fine-tuning: the base model trained on example conversations, the loss on the answers"
            " only, so that it answers inside the chat template"),
    ("reward model", "SFT's network with a one-number head, trained on preference pairs so that the preferred"
                     " answer scores higher; PPO's reward uses it (`ppo.reward_source`)"),
    ("ppo", "reinforcement learning from SFT: it samples answers, scores them (`ppo.reward_source`), and takes"
            " clipped policy steps guided by a learnt value model, with a penalty on its KL to SFT;"
            " `ppo.ptx_coef` above 0 adds SFT's own loss on its conversations to every step"),
    ("ppo_rm", "PPO on the reward model's score alone, no verifier and no KL penalty (its KL to SFT measured,"
               " not penalised), run longer: where optimising a learnt reward stops helping (Over-optimisation)"),
    ("grpo", "reinforcement learning from SFT on math problems without a value model: several answers per"
             " problem, each one's advantage its reward minus the group's mean, with a KL penalty to SFT"),
    ("grpo_random", "GRPO's control: the same rewards shuffled across each step's samples, so any gain it shows"
                    " is not from the reward"),
    ("dpo", "direct preference optimisation: SFT trained on preference pairs to raise the preferred answer's"
            " likelihood against the other's, relative to SFT, with no reward model and no sampling"),
)
# Under the training curves: what the KL columns are, so an estimate below 0 is not a surprise
CURVES_NOTE = ("KL to SFT during RL is each run's own training estimate per token: PPO's is its penalty's"
               " (`ppo.kl_estimator`: k1, the mean of log pi - log ref over the sampled tokens, is unbiased but"
               " can fall below 0 in a batch while the policy is close to SFT; k3 cannot), GRPO's is k3. The KL"
               " in the tables is exact, from held-out samples. DPO's preference accuracy counts a pair only when"
               " the preferred answer's implicit reward is strictly higher, as TRL's rewards/accuracies does: at"
               " step 0 the policy is SFT itself, every reward is 0, so it starts at 0.")


_NEG_KL = (" (an estimate below zero: the sampled estimator's noise around a KL of about zero; KL itself"
           " is never negative)")


# ---------------------------------------------------------------------------
# Tables

def summary_rows(evals: dict[str, dict], paired: dict[str, dict]) -> tuple[list[tuple[str, str]], list[dict]]:
    """(columns present as (key, label), rows): one row per model, each cell {"value", "interval",
    "change", "verdict"} ("verdict" one of up / down / borderline / flat / "" without a test)."""
    models = [m for m in MODELS if m in evals]
    cols = [(key, skill, label, kind) for key, skill, label, kind in SUMMARY if any(_isnum(evals[m].get(key))
                                                                                    for m in models)]
    rows = []
    for m in models:
        cells = {}
        for key, skill, _, kind in cols:
            e = evals[m]
            v = e.get(key)
            cell = {"value": fmt_value(v, kind), "interval": fmt_interval(e.get(f"{key}_lo"), e.get(f"{key}_hi"), kind),
                    "change": "", "verdict": ""}
            if key == "kl" and _isnum(v) and v < 0:
                cell["value"] += " †"
            if key in ("kl", "win_rate_vs_sft") and m == "sft":
                cell["interval"] = "(itself)"
            res = paired.get(m, {}).get("skills", {}).get(skill) if skill else None
            if res:
                cell["change"] = _change(skill, res, with_values=False).replace(" pp", "")
                cell["verdict"] = verdict(res)
            cells[key] = cell
        rows.append({"model": m, "parent": PARENT.get(m, ""), "cells": cells})
    return [(key, label) for key, _, label, _ in cols], rows


def all_metric_rows(evals: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """(models, rows) of every eval metric: {"label", "cells": {model: "value [interval]"}}."""
    models = [m for m in MODELS if m in evals]
    rows = []
    for key, label, kind in ALL_METRICS:
        if not any(_isnum(evals[m].get(key)) for m in models):
            continue
        if key == "math_pass_at_k":
            ks = {evals[m].get("math_pass_k") for m in models} - {None}
            label = f"math pass@{ks.pop()}" if len(ks) == 1 else label
        cells = {m: (fmt_value(evals[m].get(key), kind) + " "
                     + fmt_interval(evals[m].get(f"{key}_lo"), evals[m].get(f"{key}_hi"), kind)).strip()
                 for m in models}
        rows.append({"label": label, "cells": cells})
    return models, rows


def paired_rows(child: str, paired: dict) -> list[list[str]]:
    """Every skill's paired comparison for one stage: [skill, parent, child, change [interval],
    McNemar p, items, verdict] as text."""
    out = []
    for s, r in paired[child]["skills"].items():
        k = _kind_of(s, r)
        out.append([r["label"], fmt_value(r["parent_value"], k), fmt_value(r["value"], k), _change(s, r, False),
                    fmt_p(r["p_value"]) if "p_value" in r else "", str(r["n"]),
                    {"up": "better", "down": "worse", "borderline": "borderline", "flat": "no significant change"}
                    [verdict(r)]])
    return out


def stage_headline_rows(stages: dict[str, dict]) -> list[tuple[str, str, str]]:
    rows = []
    for st, key, label, kind in STAGE_HEADLINES:
        m = stages.get(st, {})
        v = dig(m, key)
        if _isnum(v):
            interval = fmt_interval(dig(m, f"{key}_lo"), dig(m, f"{key}_hi"), kind)
            rows.append((st, label, f"{fmt_value(v, kind)} {interval}".strip()))
    return rows


GROUP_TITLES = {("math", "en"): "English math", ("math", "zh"): "Chinese math", ("math", ""): "math",
                ("arithmetic", ""): "bare arithmetic"}


def sample_mark(x: dict) -> bool | None:
    """A kept sample's mark: True right, False wrong, None neither. A request outside the model's
    skills counts as right only when answered with the taught statement (its "answer"); with no
    worked sum but other text (the base model's continuation, a near miss) it is neither, and with
    a worked sum wrong (the eval's "correct" there means only "no worked sum")."""
    if x.get("set") == "scope":
        if x.get("response", "").strip() == str(x.get("answer", "")).strip():
            return True
        return None if x.get("correct") else False
    return bool(x.get("correct"))


def _disagreement(rec: dict) -> tuple[int, int]:
    """How much the models' answers to one item differ: distinct marks, then distinct responses."""
    answers = [rec["by_model"][m] for m in MODELS if m != "base" and m in rec["by_model"]]
    return len({mark for _, mark in answers}), len({resp for resp, _ in answers})


def item_sample_groups(samples: dict[str, dict], max_samples: int) -> list[tuple[str, list[dict]]]:
    """[(group title, [{"prompt", "answer", "by_model": {model: (response, sample_mark)}}])]:
    `max_samples` items of each group (math language, arithmetic, conversations, requests outside
    the model's skills), one item per task kind; of the items the evaluations kept, those whose
    answers differ most between the trained models (base aside: it differs from all) come first,
    so the table shows where the models part, and in their own order when they agree."""
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for m in MODELS:
        for x in (samples.get(m) or {}).get("item_samples", []):
            g = groups.setdefault((x["set"], x.get("group", "")), {})
            rec = g.setdefault(x["prompt"], {"prompt": x["prompt"], "answer": x["answer"], "by_model": {}})
            rec["by_model"][m] = (x.get("response", ""), sample_mark(x))
    out = []
    task_rows = []
    for (item_set, group), recs in groups.items():
        ranked = sorted(recs.values(), key=lambda r: tuple(-d for d in _disagreement(r)))  # stable
        if item_set == "task":
            first = ranked[0]
            task_rows.append({**first, "prompt": f"[{group.replace('_', ' ')}] {first['prompt']}"})
        else:
            out.append((GROUP_TITLES.get((item_set, group), f"{item_set} {group}".strip()), ranked[:max_samples]))
    if task_rows:
        out.append(("instruction tasks (one per kind)", task_rows))
    return out


def fixed_prompt_rows(samples: dict[str, dict], max_samples: int) -> list[tuple[str, dict[str, str]]]:
    order: list[str] = []
    table: dict[str, dict[str, str]] = {}
    for m in MODELS:
        for s in (samples.get(m) or {}).get("sample_prompts", []):
            p = s.get("prompt", "")
            if p not in table:
                order.append(p)
                table[p] = {}
            table[p][m] = s.get("response", "")
    return [(p, table[p]) for p in order[:max_samples]]


# ---------------------------------------------------------------------------
# The variants: over-optimisation (ppo_rm) and the control of GRPO (grpo_random)

def overoptimisation(kl: Sequence[float], gold: Sequence[float], proxy: Sequence[float] | None = None,
                     window: int | None = None) -> dict[str, Any] | None:
    """The over-optimisation curve of Gao, Schulman and Hilton (2022) from an RL run's steps: each
    step's KL to the reference (nats per response; a negative estimate counts as 0), its gold
    score (the verifier's accuracy) and its proxy (the RM score it was trained on). The steps are
    ordered by sqrt(KL) and each score smoothed by a centred moving average over `window` of
    them (default: a tenth of the steps, at least 3); the gold peaks where its smoothed curve is
    highest. None with fewer than 3 usable steps.

    Returns {"sqrt_kl", "gold", "proxy", "gold_smooth", "proxy_smooth" (lists in sqrt-KL order),
    "window", "peak" (its index), "peak_sqrt_kl", "peak_gold" (smoothed), "still_rising" (the peak is the last point:
    the gold had not stopped rising at the largest KL reached), "never_rose" (the peak is at the
    smallest KL reached: the gold did not rise above where it started, so there is no rise that
    stops), "n"}."""
    proxy = proxy if proxy is not None else [math.nan] * len(kl)
    pts = sorted((math.sqrt(max(k, 0.0)), g, p) for k, g, p in zip(kl, gold, proxy)
                 if _isnum(k) and _isnum(g))
    if len(pts) < 3:
        return None
    w = window or max(3, len(pts) // 10)
    x, g, p = (list(c) for c in zip(*pts))

    def centred(ys: list[float]) -> list[float]:
        out = []
        for i in range(len(ys)):
            near = [y for y in ys[max(0, i - w // 2): i + w - w // 2] if _isnum(y)]
            out.append(sum(near) / len(near) if near else math.nan)
        return out

    gs = centred(g)
    peak = max(range(len(gs)), key=lambda i: (gs[i], -i))   # the first of equal maxima
    return {"sqrt_kl": x, "gold": g, "proxy": p, "gold_smooth": gs, "proxy_smooth": centred(p), "window": w,
            "peak": peak, "peak_sqrt_kl": x[peak], "peak_gold": gs[peak], "still_rising": peak == len(x) - 1,
            "never_rose": x[peak] == x[0], "n": len(x)}


def overopt_curve(curves: dict[str, dict[str, list[float]]], tsv: str = "ppo_rm.tsv") -> dict[str, Any] | None:
    """`overoptimisation` of a run's per-step TSV (default ppo_rm's): KL per response (kl_seq, else
    the per-token kl), gold = the rollouts' verifier accuracy, proxy = their mean reward."""
    cols = curves.get(tsv) or {}
    kl = cols.get("kl_seq") or cols.get("kl")
    if not kl or not cols.get("accuracy"):
        return None
    return overoptimisation(kl, cols["accuracy"], cols.get("reward"))


def overopt_line(curve: dict[str, Any]) -> str:
    """The over-optimisation curve in one sentence: where the gold stops rising, or that it did not
    rise (highest at the smallest KL reached), or that it had not stopped by the end."""
    span = f"over {curve['n']} steps up to sqrt(KL) {curve['sqrt_kl'][-1]:.3g}"
    gold = (f"PPO on the reward model alone: the verifier's accuracy of its rollouts (gold: each step's own"
            f" training prompts, so noisy from step to step; mean of {curve['window']} steps)")
    if curve["still_rising"]:
        return (f"{gold} is still rising at the end, {fmt_value(curve['peak_gold'], 'pct')} at"
                f" the largest KL reached ({span}): no over-optimisation within this run.")
    proxy = curve["proxy_smooth"]
    moved = (f"; the RM score it is trained on (proxy) goes from {_num(proxy[curve['peak']])} there to"
             f" {_num(proxy[-1])} at the largest KL" if _isnum(proxy[curve["peak"]]) and _isnum(proxy[-1]) else "")
    if curve.get("never_rose"):
        return (f"{gold} never rises above where it starts: it is highest at the smallest KL reached"
                f" (sqrt(KL) {curve['peak_sqrt_kl']:.3g}), at {fmt_value(curve['peak_gold'], 'pct')}, and ends at"
                f" {fmt_value(curve['gold_smooth'][-1], 'pct')}{moved} ({span}): optimising the reward model"
                " did not raise the gold at any KL in this run.")
    return (f"{gold} stops rising at sqrt(KL to SFT) {curve['peak_sqrt_kl']:.3g}"
            f" (KL {curve['peak_sqrt_kl'] ** 2:.3g} nats per response), at {fmt_value(curve['peak_gold'], 'pct')},"
            f" and ends at {fmt_value(curve['gold_smooth'][-1], 'pct')}{moved} ({span}).")


def control_line(paired: dict[str, dict], skill: str = "math") -> str | None:
    """How much of GRPO's change in `skill` against SFT the real reward explains: GRPO's change
    minus its control's (grpo_random, trained on the same rewards given to random samples), each
    with its paired interval; None unless both were compared with SFT."""
    res = [paired.get(m, {}).get("skills", {}).get(skill) for m in ("grpo", "grpo_random")]
    if not all(res):
        return None
    g, c = res
    k = _kind_of(skill, g)
    return (f"GRPO against its control: GRPO's change in {g['label']} against SFT is {_change(skill, g, False)},"
            f" its control's (the same rewards shuffled across each step's samples) {_change(skill, c, False)};"
            f" the real reward explains {fmt_delta(g['delta'] - c['delta'], k)} of it (the difference of the two"
            f" changes, whose intervals are those above).")


def tier_rows(evals: dict[str, dict], paired: dict[str, dict]) -> list[tuple[str, int | None, list[dict]]]:
    """Per difficulty tier evaluated: (label, k of pass@k, rows), a row per model: {"model",
    "parent", "greedy": "value [interval]", "change": paired change against the parent or "",
    "verdict", "pass_1", "pass_k", "maj", "headroom"} as text ("–" where not measured)."""
    out = []
    models = [m for m in MODELS if m in evals]
    tiers = [t for t in TIER_LABELS if any(_isnum(evals[m].get(f"tier_{t}_exact_match")) for m in models)]
    for t in tiers:
        ks = {evals[m].get("tier_pass_k") for m in models} - {None}
        k = ks.pop() if len(ks) == 1 else None
        rows = []
        for m in models:
            e = evals[m]
            if not _isnum(e.get(f"tier_{t}_exact_match")):
                continue
            key = f"tier_{t}_exact_match"
            res = paired.get(m, {}).get("skills", {}).get(f"tier_{t}")
            maj = next((v for kk, v in e.items() if kk.startswith(f"tier_{t}_maj_at_")), None)
            rows.append({"model": m, "parent": PARENT.get(m, ""),
                         "greedy": (fmt_value(e.get(key), "pct") + " "
                                    + fmt_interval(e.get(f"{key}_lo"), e.get(f"{key}_hi"), "pct")).strip(),
                         "change": _change(f"tier_{t}", res, with_values=False) if res else "",
                         "verdict": verdict(res) if res else "",
                         "pass_1": fmt_value(e.get(f"tier_{t}_pass_at_1"), "pct"),
                         "pass_k": fmt_value(e.get(f"tier_{t}_pass_at_{k}"), "pct") if k else "–",
                         "maj": fmt_value(maj, "pct"),
                         "headroom": fmt_value(e.get(f"tier_{t}_greedy_wrong_pass"), "pct")})
        out.append((TIER_LABELS[t], k, rows))
    return out


TIER_NOTE = ("Greedy accuracy [95% interval] on each tier's held-out problems, and below it the change against"
             " the parent on the same problems with its paired interval. pass@1 and pass@k: of k sampled answers"
             " (eval.temperature), the unbiased estimate that one is right; majority: the most common answer of"
             " the first 8 samples; greedy wrong, a sample right: the share of problems where greedy decoding"
             " misses an answer the model does sample, the most that sharpening (making the model choose what it"
             " already samples) can add to greedy accuracy. The in-distribution tier holds the trained levels"
             " below the edge; the edge, trained levels the SFT model solves about half the time; the harder tier,"
             " levels nothing trains on.")


def tier_line(paired: dict[str, dict], evals: dict[str, dict]) -> str | None:
    """GRPO on the edge tier against SFT and against its control, and what sharpening could add
    there at most; None unless GRPO was compared with SFT on the edge tier."""
    g = paired.get("grpo", {}).get("skills", {}).get("tier_edge")
    if not g:
        return None
    line = f"GRPO on the edge tier: {_change('tier_edge', g, True)} against SFT"
    c = paired.get("grpo_random", {}).get("skills", {}).get("tier_edge")
    if c:
        line += f", its control (shuffled rewards) {_change('tier_edge', c, False)}"
    head = evals.get("sft", {}).get("tier_edge_greedy_wrong_pass")
    if _isnum(head):
        line += (f"; SFT's greedy answer is wrong while one of its samples is right on {fmt_value(head, 'pct')}"
                 f" of the edge problems sampled, the most sharpening could add")
    h = paired.get("grpo", {}).get("skills", {}).get("tier_harder")
    if h:
        line += f". On the harder tier, which nothing trains on: {_change('tier_harder', h, True)}"
    return line + "."


# The rankers of stage rankers (its metrics' keys), as the report words them, in order.
RANKER_LABELS = {"likelihood": "SFT's likelihood", "per_token": "SFT's likelihood per token",
                 "reward_model": "the reward model", "dpo_implicit": "DPO's implicit reward",
                 "agreement": "agreement with the other samples",
                 "generative_verifier": "the generative verifier (SFT asked \"Is the answer right?\")"}
RANKERS_NOTE = ("Each of SFT's problems on the tier gets its greedy answer and n sampled answers; the verifier (the"
                " exact checker of the final number) says which are right. Pairs: every (right, wrong) pair of different answers to one problem, ranked"
                " right when the right one scores higher (ties count half); against the greedy answer: the pairs"
                " of a right sample and SFT's own wrong greedy answer, the only errors a reward must fix to change"
                " what greedy decoding says. Best of n: the share of problems whose top-ranked of n samples is right"
                " (pass@n is the most any ranker can reach; a random pick scores the sampled accuracy), and its"
                " difference in points from the likelihood's pick, paired over the problems. The generative verifier"
                " is SFT taught (stage verifier) to answer \"Is the answer right?\" about its own answers to training"
                " problems, with SFT's loss beside; it scores log p(Yes) - log p(No).")


def ranker_rows(stages: dict[str, dict]) -> list[list[str]]:
    """[ranker, pairs ranked right [interval], against the greedy answer [interval] (pairs), best of n,
    its best of n less the likelihood's in points (paired over the problems) [interval]] per ranker
    of metrics/rankers.json; [] without it."""
    m = stages.get("rankers") or {}
    out = []
    for key, label in RANKER_LABELS.items():
        r = (m.get("rankers") or {}).get(key)
        if not r:
            continue
        pair = f"{fmt_value(r.get('pair_accuracy'), 'pct')} {fmt_interval(r.get('pair_accuracy_lo'), r.get('pair_accuracy_hi'), 'pct')}"
        slice_ = (f"{fmt_value(r.get('greedy_wrong_accuracy'), 'pct')} "
                  f"{fmt_interval(r.get('greedy_wrong_accuracy_lo'), r.get('greedy_wrong_accuracy_hi'), 'pct')}"
                  f" ({r.get('greedy_wrong_pairs', 0)} pairs)") if _isnum(r.get("greedy_wrong_accuracy")) else "–"
        best = f"{fmt_value(r.get('best_of_n'), 'pct')} {fmt_interval(r.get('best_of_n_lo'), r.get('best_of_n_hi'), 'pct')}"
        d = r.get("best_of_n_vs_likelihood")
        vs = (f"{d * 100:+.1f} {fmt_interval(r.get('best_of_n_vs_likelihood_lo'), r.get('best_of_n_vs_likelihood_hi'), 'pct')}"
              if _isnum(d) else "–")
        out.append([label, pair.strip(), slice_, best.strip(), vs.strip()])
    return out


def ranker_line(stages: dict[str, dict]) -> str | None:
    """One sentence: the tier, greedy and pass@n, and which ranker's best-of-n is highest against
    greedy decoding; None without metrics/rankers.json."""
    m = stages.get("rankers") or {}
    rs = {k: r for k, r in (m.get("rankers") or {}).items() if _isnum(r.get("best_of_n"))}
    if not rs or not _isnum(m.get("greedy_accuracy")):
        return None
    best = max(rs, key=lambda k: rs[k]["best_of_n"])
    n, greedy = m.get("samples"), m["greedy_accuracy"]
    r = rs[best]
    beats = r["best_of_n_lo"] is not None and r["best_of_n_lo"] > greedy
    return (f"On {m.get('problems')} problems of the {str(m.get('tier', '')).replace('_', ' ')} tier SFT answers"
            f" {fmt_value(greedy, 'pct')} greedily and pass@{n} is {fmt_value(m.get('pass_at_n'), 'pct')}; the best"
            f" ranker's pick of {n} samples, {RANKER_LABELS.get(best, best)}'s, is right on"
            f" {fmt_value(r['best_of_n'], 'pct')} {fmt_interval(r['best_of_n_lo'], r['best_of_n_hi'], 'pct')}: "
            + ("above greedy decoding." if beats else "no better than greedy decoding, so none of these scores"
               " would make a better math reward than the likelihood the policy already has."))


def verifier_line(stages: dict[str, dict]) -> str | None:
    """One sentence on the generative verifier's own held-out check (stage verifier): pairs of one
    problem's answers it orders right against SFT's likelihood, and its greedy math against SFT's;
    None without metrics/verifier.json."""
    v = stages.get("verifier") or {}
    if not _isnum(v.get("heldout_pair_accuracy")):
        return None
    line = (f"The generative verifier, on {v.get('heldout_verdicts')} answers to training problems it never saw"
            f" (SFT's samples, as many right as wrong per problem), orders"
            f" {fmt_value(v['heldout_pair_accuracy'], 'pct')} of the pairs of one problem's right and wrong answers"
            f" right, SFT's likelihood {fmt_value(v.get('heldout_likelihood_pair_accuracy'), 'pct')}")
    if _isnum(v.get("math_exact_match")):
        line += (f"; its own greedy math {fmt_value(v['math_exact_match'], 'pct')} (SFT"
                 f" {fmt_value(v.get('sft_math_exact_match'), 'pct')}, {v.get('math_problems')} held-out problems)")
    return line + "."


# ---------------------------------------------------------------------------
# The continuation preference: the gold judge against the reward model, per model and along KL

PREFERENCE_NOTE = ("Held-out passages of verse from works no stage trained on, each continued once at temperature 1"
                   " by every model and by SFT with the same seed. The gold judge (VADER's sentiment of the"
                   " continuation, -1 for no continuation: too short, not English or repeating; llm/sample/gold.py)"
                   " stands in for a human rater and never trains anything; the reward model learned its"
                   " comparisons of SFT's samples and is what PPO optimises. Win rate: the judge prefers the model's"
                   " continuation to SFT's of the same passage (ties half). KL in nats per continuation. Base"
                   " bits/byte: how well the base model, pretrained on the works, reads the continuation after its"
                   " passage (in brackets SFT's, on SFT's continuations): a win in words no verse holds shows there."
                   " Best of n: SFT's n samples, the reward model's top pick (stage rankers), whose KL to SFT is at"
                   " most log n - (n-1)/n.")
PREFERENCE_BEST_OF = (4, 16, 64)


def _at(cols: dict[str, list[float]], key: str, n: int) -> float | None:
    ns = cols.get("n") or []
    return cols[key][ns.index(n)] if n in ns and key in cols else None


def preference_rows(evals: dict[str, dict], paired: dict[str, dict],
                    curves: dict[str, dict[str, list[float]]]) -> list[list[str]]:
    """[model, judge mean, change vs SFT [interval], win rate vs SFT [interval], RM score, KL per
    continuation, base bits/byte (SFT's), repetition, not a continuation] per evaluated model with
    continuations, then the reward model's best-of-n rows; [] when no model was evaluated on them."""
    rows = []
    for m in MODELS:
        e = evals.get(m) or {}
        if not _isnum(e.get("continuation_gold")):
            continue
        res = (paired.get(m) or {}).get("skills", {}).get("continuation") if PARENT.get(m) == "sft" else None
        change = f"{fmt_delta(res['delta'], 'num')} {fmt_interval(res['lo'], res['hi'], 'num')}" if res else "–"
        win = (f"{fmt_value(e.get('continuation_win_rate'), 'pct')} "
               f"{fmt_interval(e.get('continuation_win_rate_lo'), e.get('continuation_win_rate_hi'), 'pct')}"
               if m != "sft" else "50% (itself)")
        bpb = fmt_value(e.get("continuation_base_bpb"), "num")
        if m != "sft" and _isnum(e.get("continuation_base_bpb_sft")):
            bpb += f" ({fmt_value(e['continuation_base_bpb_sft'], 'num')})"
        rows.append([NAME.get(m, m), f"{e['continuation_gold']:+.3f}", change.strip(), win.strip(),
                     fmt_value(e.get("continuation_rm"), "num"), fmt_value(e.get("continuation_kl_seq"), "num"),
                     bpb, fmt_value(e.get("continuation_repetition"), "pct"),
                     fmt_value(e.get("continuation_not_continuation"), "pct")])
    bon = curves.get("rankers_continuation.tsv") or {}
    for n in PREFERENCE_BEST_OF:
        gold = _at(bon, "rm_pick_gold", n)
        if gold is None:
            continue
        rows.append([f"SFT, best of {n} by the RM", f"{gold:+.3f}", "–", "–",
                     fmt_value(_at(bon, "rm_pick_rm", n), "num"), f"≤ {_num(_at(bon, 'kl_bound', n))}", "–", "–",
                     "–"])
    return rows


def preference_line(evals: dict[str, dict], paired: dict[str, dict],
                    curves: dict[str, dict[str, list[float]]]) -> str | None:
    """One sentence per method: how far PPO and DPO moved the judge's mean against SFT (paired),
    their win rate and KL, and what the reward model's best-of-n reaches at about PPO's KL."""
    parts = []
    for m in ("ppo", "ppo_rm", "dpo"):
        e = evals.get(m) or {}
        res = (paired.get(m) or {}).get("skills", {}).get("continuation")
        if not (_isnum(e.get("continuation_gold")) and res):
            continue
        sure = "significant" if res["significant"] else "not significant"
        parts.append(f"{NAME[m]} moves the judge's mean {_change('continuation', res)} ({sure}), winning"
                     f" {fmt_value(e.get('continuation_win_rate'), 'pct')}"
                     f" {fmt_interval(e.get('continuation_win_rate_lo'), e.get('continuation_win_rate_hi'), 'pct')}"
                     f" of passages against SFT at KL {_num(e.get('continuation_kl_seq'))} nats per continuation")
    if not parts:
        return None
    bon = curves.get("rankers_continuation.tsv") or {}
    kl_ppo = (evals.get("ppo") or {}).get("continuation_kl_seq")
    if bon.get("n") and _isnum(kl_ppo):
        i = min(range(len(bon["n"])), key=lambda j: abs(bon["kl_bound"][j] - kl_ppo))
        parts.append(f"the reward model's best of {int(bon['n'][i])} of SFT's samples, at KL at most"
                     f" {_num(bon['kl_bound'][i])}, scores {bon['rm_pick_gold'][i]:+.3f} by the judge (SFT's mean"
                     f" {bon['rm_pick_gold'][0]:+.3f}, the judge's own pick of {int(bon['n'][i])}"
                     f" {bon['gold_pick_gold'][i]:+.3f})")
    return "; ".join(parts) + "."


def preference_curves(curves: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, list[float]]]:
    """The gold (judge's mean) and the proxy (reward model's mean) against sqrt(KL per continuation):
    {"PPO": ..., "PPO on the RM alone": ... (each run's held-out evaluations, its start included),
    "best of n by the RM": ... (n = 1..N, KL its bound)}, each {"sqrt_kl", "gold", "proxy"}; runs
    without those columns are left out."""
    out = {}
    for tsv, label in (("ppo_val.tsv", "PPO"), ("ppo_rm_val.tsv", "PPO on the RM alone")):
        cols = curves.get(tsv) or {}
        kl, gold, proxy = cols.get("continuation_kl_seq"), cols.get("continuation_gold"), cols.get("continuation_rm")
        if kl and gold and proxy:
            pts = [(math.sqrt(max(k, 0.0)), g, p) for k, g, p in zip(kl, gold, proxy) if _isnum(k) and _isnum(g)]
            if pts:
                out[label] = {"sqrt_kl": [x for x, _, _ in pts], "gold": [g for _, g, _ in pts],
                              "proxy": [p for _, _, p in pts]}
    bon = curves.get("rankers_continuation.tsv") or {}
    if bon.get("n"):
        out["best of n by the RM"] = {"sqrt_kl": bon["sqrt_kl"], "gold": bon["rm_pick_gold"],
                                      "proxy": bon["rm_pick_rm"], "n": bon["n"], "ceiling": bon["gold_pick_gold"]}
    return out


def preference_overopt_line(curves: dict[str, dict[str, list[float]]]) -> str | None:
    """Where the gold stops rising along PPO on the reward model alone (ppo_rm's held-out
    evaluations) and along best-of-n, or that it had not stopped by the largest KL reached."""
    parts = []
    for label, c in preference_curves(curves).items():
        if label == "PPO" or len(c["gold"]) < 2:
            continue
        order = sorted(range(len(c["gold"])), key=lambda i: c["sqrt_kl"][i])
        peak = max(order, key=lambda i: (c["gold"][i], -c["sqrt_kl"][i]))
        top = c["sqrt_kl"][order[-1]] ** 2
        what = "n = " + str(int(c["n"][peak])) + ", " if "n" in c else ""
        if peak == order[-1]:
            parts.append(f"along {label} the judge's mean is still rising at the largest KL reached ({_num(top)} nats"
                         f" per continuation: {c['gold'][order[0]]:+.3f} -> {c['gold'][peak]:+.3f})")
        else:
            # where it stops rising: the first point (by KL) with 95% of the peak's gain over the start
            start = c["gold"][order[0]]
            near = next(i for i in order if c["gold"][i] - start >= 0.95 * (c["gold"][peak] - start))
            plateau = (f" (95% of that gain first at KL {_num(c['sqrt_kl'][near] ** 2)}: {c['gold'][near]:+.3f})"
                       if near != peak else "")
            parts.append(f"along {label} the judge's mean peaks at KL {_num(c['sqrt_kl'][peak] ** 2)} ({what}"
                         f"{c['gold'][peak]:+.3f}){plateau} and ends at {c['gold'][order[-1]]:+.3f} at KL {_num(top)},"
                         f" while the reward model's own score goes {c['proxy'][peak]:+.3f} ->"
                         f" {c['proxy'][order[-1]]:+.3f}")
    return ("Over-optimisation on the preference: " + "; ".join(parts) + ".") if parts else None


def preference_samples(samples: dict[str, dict], model: str = "ppo", n: int = 5) -> list[dict]:
    """The first n held-out passages with SFT's continuation and `model`'s beside it, each with the
    judge's score (from eval@<model>'s samples file); [] without them."""
    return list((samples.get(model) or {}).get("continuation_samples") or [])[:n]
