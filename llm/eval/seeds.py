"""Several runs of the same settings (say three values of `common.seed`) read together: the spread
of every score across runs, and each model's paired change from its parent pooled over them.

    python -m llm.seeds . ../run-1338 ../run-1339              # run directories (each has metrics/eval/)
    python -m llm.seeds . exp:seed-1338 exp:seed-1339          # DVC experiments, read from git
    python -m llm.seeds 1337=. 1338=rev:HEAD~3 --json seeds.json --markdown seeds.md   # labelled

A run is a directory holding `metrics/eval/<model>_items.jsonl` (a repository, its metrics/ or
the eval directory itself), `rev:REV` (the files as committed at a git revision of the current
repository) or `exp:NAME` (a DVC experiment: `dvc exp run -n NAME -S common.seed=1338` keeps its
metrics in a git ref, read here without checking it out); LABEL=RUN names its column. Every run
must have evaluated the same models. Stage metrics that the items do not hold (the reward
model's and DPO's held-out accuracy, KL, the RL stages' training reward: STAGE_METRICS, or
--metric FILE:KEY) are read from the run's metrics/ and shown per run. DVC keeps most of them in
its cache, not in git: a fresh clone has them after `dvc repro` or `dvc pull`, and rev: and exp:
runs read them from this machine's cache (dvc.api); a default one some run lacks is named, not
shown.

Why pool. One run's paired interval says how sure we are of the change on that run's test items;
it says nothing about how the change moves from one training run to the next, and a small gain can
be inside each run's interval and still be real. Each run draws its own test items, so the runs
are strata: the pooled change is the mean of the runs' changes, its interval a bootstrap that
resamples every run's items within that run, and for right/wrong skills the test is McNemar's on
all the runs' discordant items together (b items only the child gets right, c only the parent:
with no change anywhere, each of the b + c is a fair coin). That answers "did the child change on
average over these runs, given their test items?". It still leaves out the spread between
training runs, which the second interval measures: the t interval of the runs' own changes,
mean +- t(n-1) sd / sqrt(n). With three runs its multiplier is 4.30, so it excludes zero only
when the runs agree closely; both are printed, with how many runs moved up.

Per model the levels table gives each run's score, the mean and the worst run, and a third table
whether the reward model's score follows correctness on that model's own greedy math answers (the
AUC of right over wrong answers, llm/eval/paired.py rm_separation); where the runs' run files
(metrics/run/ppo.json, grpo.json) keep each held-out problem's reward at the start and the end,
the RL stages' held-out reward change per run and pooled. Outputs: a table on stdout, and with
--json / --markdown the same as files.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from llm.eval.paired import (bootstrap_means, compare, mcnemar_exact, parse_items, percentile_interval, read_items,
                             rm_separation, skills, t_quantile)

EVAL_DIR = "metrics/eval"
HEADLINE = ("math", "math_en", "math_zh", "task", "arithmetic", "math_sampled", "rm_score",
            "tier_in_distribution", "tier_edge", "tier_harder")
# FILE:KEY in a run's metrics/: what the eval items do not hold (shown where every run has it)
STAGE_METRICS = ("reward.json:accuracy", "reward.json:sft_likelihood_accuracy",
                 "reward.json:accuracy_without_likelihood", "samples.json:heldout_errors_sft_would_make",
                 "dpo.json:rewards_accuracy", "dpo.json:ref_logp_accuracy",
                 "ppo.json:reward_delta", "ppo.json:reward_trend", "ppo.json:heldout_reward_delta",
                 "grpo.json:reward_delta", "grpo.json:reward_trend", "grpo.json:heldout_reward_delta",
                 "eval/ppo.json:kl", "eval/grpo.json:kl",
                 "eval/dpo.json:kl", "eval/sft.json:multiturn_exact_match", "eval/sft.json:scope_no_math_rate",
                 "eval/sft.json:scope_no_math_rate_second_turn", "eval/sft.json:scope_exact_match",
                 "eval/sft.json:context_math_after_scope_drop", "eval/sft.json:context_arithmetic_system_helpful_drop",
                 "eval/sft.json:val_bpb", "eval/base.json:val_bpb", "eval/sft.json:tier_edge_greedy_wrong_pass",
                 "eval/sft.json:tier_edge_pass_at_16", "rankers.json:greedy_accuracy", "rankers.json:pass_at_n",
                 *(f"rankers.json:rankers.{r}.best_of_n" for r in ("likelihood", "reward_model", "dpo_implicit",
                                                                  "agreement", "generative_verifier")),
                 "rankers.json:rankers.generative_verifier.best_of_n_vs_likelihood",
                 "rankers.json:rankers.generative_verifier.greedy_wrong_accuracy",
                 "verifier.json:heldout_pair_accuracy", "verifier.json:heldout_likelihood_pair_accuracy",
                 "verifier.json:math_exact_match", "verifier.json:sft_math_exact_match",
                 # the continuation preference: the reward model against the gold judge, PPO's win
                 # rate and what guards it (KL, the base model's bits/byte, repetition)
                 "reward.json:by_kind.continuation.accuracy", "reward.json:continuation_spearman",
                 *(f"eval/{m}.json:continuation_{k}" for m in ("sft", "ppo", "dpo")
                   for k in ("gold", "win_rate", "kl", "base_bpb", "base_bpb_sft", "repetition")),
                 "rankers.json:continuation_best_of_n_gold")


@dataclass
class Run:
    """One run: its name, {model: records of <model>_items.jsonl}, and {file: parsed JSON} of the
    metrics files it has, named as under metrics/ (reward.json, eval/ppo.json, ...)."""
    name: str
    items: dict[str, list[dict]]
    metrics: dict[str, Any] = field(default_factory=dict)


def _git(args: list[str], what: str) -> str:
    r = subprocess.run(["git", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise ValueError(f"{what}: git {' '.join(args)} failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


def resolve_rev(spec: str) -> str:
    """The git revision of `rev:REV` or `exp:NAME` (a ref under refs/exps/ ending in /NAME)."""
    kind, _, name = spec.partition(":")
    if kind == "rev":
        return name
    # an experiment's ref is refs/exps/<2 hex>/<rest of its baseline's sha>/<name>
    refs = [r for r in _git(["for-each-ref", "--format=%(refname)", "refs/exps/"], spec).split() if r.count("/") == 4]
    hits = [r for r in refs if r.rsplit("/", 1)[-1] == name]
    if len(hits) != 1:
        known = sorted({r.rsplit("/", 1)[-1] for r in refs})
        why = "matches several experiments" if hits else "is no DVC experiment of this repository"
        raise ValueError(f"{spec}: {name!r} {why}; `dvc exp list -A` shows them"
                         f" (known here: {', '.join(known) or 'none'}); or give rev:<git revision>")
    return hits[0]


def load_run(spec: str) -> Run:
    """One run: a directory, rev:REV or exp:NAME, optionally named as LABEL=RUN (the label heads
    its column; without one the run is its spec).

    A directory is a repository's root (its metrics/ read), a metrics directory (eval/ and the
    stage JSONs inside), or an eval directory alone (<model>_items.jsonl, no stage metrics)."""
    label, eq, rest = spec.partition("=")
    if eq and label and not label.startswith(("rev:", "exp:")) and "/" not in label:
        run = load_run(rest)
        run.name = label
        return run
    if spec.startswith(("rev:", "exp:")):
        rev = resolve_rev(spec)
        paths = _git(["ls-tree", "-r", "--full-tree", "--name-only", rev, "metrics/"], spec).split()
        models = sorted(p[len(EVAL_DIR) + 1:].removesuffix("_items.jsonl") for p in paths
                        if p.startswith(EVAL_DIR + "/") and p.endswith("_items.jsonl") and p.count("/") == 2)
        if not models:
            raise ValueError(f"{spec}: {EVAL_DIR}/ has no <model>_items.jsonl at {rev}; was its eval run?")
        items = {m: parse_items(_git(["show", f"{rev}:{EVAL_DIR}/{m}_items.jsonl"], spec),
                           f"{spec}:{EVAL_DIR}/{m}_items.jsonl") for m in models}
        jsons = [p for p in paths if p.endswith(".json")
                 and (p.count("/") == 1 or p.startswith((EVAL_DIR + "/", "metrics/run/")))]
        metrics = {p[len("metrics/"):]: _json(_git(["show", f"{rev}:{p}"], spec), f"{spec}:{p}") for p in jsons}
        return Run(spec, items, {**_cached_metrics(rev, spec, skip=set(metrics)), **metrics})
    root = Path(spec)
    mdir = next((d for d in (root / "metrics", root) if (d / "eval").is_dir()), None)
    edir = mdir / "eval" if mdir else root
    files = sorted(edir.glob("*_items.jsonl")) if edir.is_dir() else []
    if not files:
        raise ValueError(f"{spec}: no {EVAL_DIR}/<model>_items.jsonl here (looked in {edir});"
                         f" run `dvc repro` there, or give the eval directory itself")
    jsons = sorted(mdir.glob("*.json")) + sorted(mdir.glob("eval/*.json")) + sorted(mdir.glob("run/*.json")) \
        if mdir else []
    metrics = {f.relative_to(mdir).as_posix(): _json(f.read_text(encoding="utf-8"), str(f)) for f in jsons}
    return Run(spec, {f.name.removesuffix("_items.jsonl"): read_items(f) for f in files}, metrics)


def _cached_metrics(rev: str, spec: str, skip: set[str]) -> dict[str, Any]:
    """The metrics/<stage>.json files that DVC keeps in its cache rather than in git, as dvc.lock
    at `rev` lists them, read from this machine's DVC cache; those it does not hold (an
    experiment run elsewhere and not pulled) are left out."""
    import dvc.api
    import yaml
    try:
        lock = yaml.safe_load(_git(["show", f"{rev}:dvc.lock"], spec)) or {}
    except ValueError:  # no dvc.lock at that revision
        return {}
    outs = {o.get("path", "") for st in (lock.get("stages") or {}).values() for o in st.get("outs") or []}
    out = {}
    for p in sorted(o for o in outs if o.startswith("metrics/") and o.endswith(".json")
                    and (o.count("/") == 1 or o.startswith("metrics/run/"))):
        if p[len("metrics/"):] in skip:
            continue
        try:
            text = dvc.api.read(p, rev=rev)
        except Exception:  # noqa: BLE001 - DVC raises several kinds for "not in this cache"
            continue
        out[p[len("metrics/"):]] = _json(text, f"{spec}:{p}")
    return out


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}:{e.lineno}: not JSON ({e.msg})") from None


def pooled(runs: list[Run], child: str, parent: str, *, confidence: float = 0.95, n_boot: int = 10000,
           seed: int = 0, keys: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
    """Per skill, `child`'s change from `parent` over the runs (each run paired on its own items).

    Returns {skill: {"label", "type", "deltas" (per run), "significant" (per run, as
    llm.eval.paired.compare says), "mean", "worst", "lo", "hi" (pooled interval), "up" (runs with a
    delta above zero), "t_lo", "t_hi" (across-run t interval; None for one run), "pooled_significant",
    plus "wins", "losses", "p_value" (pooled McNemar) for right/wrong skills}. A skill is kept
    when every run measured it.
    """
    per_run = []
    for run in runs:
        for m in (child, parent):
            if m not in run.items:
                raise ValueError(f"{run.name}: no {m}_items.jsonl (it has {', '.join(sorted(run.items))});"
                                 f" every run must have evaluated the same models")
        per_run.append(compare(run.items[child], run.items[parent], confidence=confidence, n_boot=n_boot,
                               seed=seed, child_name=child))
    order = [k for k, *_ in skills(runs[0].items[child] + runs[0].items[parent])]
    t = t_quantile(1 - (1 - confidence) / 2, len(runs) - 1) if len(runs) > 1 else None
    out: dict[str, dict[str, Any]] = {}
    for key in order:
        if (keys is not None and key not in keys) or not all(key in r for r in per_run):
            continue
        rs = [r[key] for r in per_run]
        deltas = np.array([r["delta"] for r in rs])
        res: dict[str, Any] = {"label": rs[0]["label"], "type": rs[0]["type"], "n": [r["n"] for r in rs],
                               "deltas": deltas.tolist(), "significant": [r["significant"] for r in rs],
                               "mean": float(deltas.mean()), "worst": float(deltas.min()),
                               "up": int((deltas > 0).sum())}
        rng = np.random.default_rng([seed, *f"pooled/{child}/{key}".encode()])
        boot = np.zeros(n_boot)
        for run, r in zip(runs, rs):   # resample each run's items within that run
            boot += _run_boot(run, child, parent, key, r, n_boot, rng)
        res["lo"], res["hi"] = percentile_interval(boot / len(runs), confidence)
        test_says = None
        if res["type"] == "rate":
            b, c = sum(r["wins"] for r in rs), sum(r["losses"] for r in rs)
            res.update({"wins": b, "losses": c, "p_value": mcnemar_exact(b, c)})
            test_says = res["p_value"] < 1 - confidence
        res["pooled_significant"] = (res["lo"] > 0 or res["hi"] < 0) and test_says is not False
        if t is not None:
            half = t * deltas.std(ddof=1) / math.sqrt(len(runs))
            res["t_lo"], res["t_hi"] = float(deltas.mean() - half), float(deltas.mean() + half)
        else:
            res["t_lo"] = res["t_hi"] = None
        out[key] = res
    return out


def _run_boot(run: Run, child: str, parent: str, key: str, r: dict, n_boot: int,
              rng: np.random.Generator) -> np.ndarray:
    """n_boot resampled deltas of one run's skill (its n paired items drawn with replacement)."""
    n = r["n"]
    if r["type"] == "rate":   # three kinds of item: only the child right, only the parent, the same
        counts = rng.multinomial(n, [r["wins"] / n, r["losses"] / n, 1 - (r["wins"] + r["losses"]) / n],
                                 size=n_boot)
        return (counts[:, 0] - counts[:, 1]) / n
    _, _, item_set, which, field = next(s for s in skills(run.items[child] + run.items[parent]) if s[0] == key)
    theirs = {x["id"]: x for x in run.items[parent] if x["set"] == item_set and which(x)}
    diffs = np.array([float(x[field]) - float(theirs[x["id"]][field])
                      for x in run.items[child] if x["set"] == item_set and which(x) and x["id"] in theirs])
    return bootstrap_means(diffs, n_boot=n_boot, rng=rng)


def levels(runs: list[Run], model: str, keys: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
    """Per skill, `model`'s score on each run, their mean and the worst (lowest) run."""
    out: dict[str, dict[str, Any]] = {}
    for key, label, item_set, which, field in skills(runs[0].items[model]):
        if keys is not None and key not in keys:
            continue
        vals = []
        for run in runs:
            xs = [float(x[field]) for x in run.items.get(model, []) if x["set"] == item_set and which(x)]
            if not xs:
                break
            vals.append(sum(xs) / len(xs))
        else:
            out[key] = {"label": label, "values": vals, "mean": sum(vals) / len(vals), "worst": min(vals)}
    return out


def separations(runs: list[Run], model: str, *, confidence: float, n_boot: int, seed: int) -> dict[str, Any] | None:
    """Whether the reward model's score follows correctness on `model`'s own greedy math answers,
    per run (llm.eval.paired.rm_separation: the AUC of right over wrong answers and its interval), with
    the mean and the lowest; None unless every run has both right and wrong scored answers."""
    seps = [rm_separation(run.items.get(model, []), confidence=confidence, n_boot=n_boot, seed=seed) for run in runs]
    if None in seps:
        return None
    vals = [x["auc"] for x in seps]
    return {"values": vals, "lo": [x["lo"] for x in seps], "hi": [x["hi"] for x in seps],
            "mean": sum(vals) / len(vals), "worst": min(vals)}


def heldout_changes(runs: list[Run], stage: str, *, confidence: float = 0.95, n_boot: int = 10000,
                    seed: int = 0) -> dict[str, Any] | None:
    """An RL stage's change of the held-out reward, per run and pooled: each run's run/<stage>.json
    keeps every held-out problem's reward at the start and the end (the same draws); per run the
    mean change, pooled the mean of the runs' changes with a bootstrap that resamples each run's
    problems within it. None unless every run has both lists."""
    diffs = []
    for run in runs:
        info = run.metrics.get(f"run/{stage}.json") or {}
        start, end = info.get("heldout_rewards_start"), info.get("heldout_rewards_end")
        if not isinstance(start, list) or not isinstance(end, list) or len(start) != len(end) or not start:
            return None
        diffs.append(np.asarray(end, dtype=np.float64) - np.asarray(start, dtype=np.float64))
    rng = np.random.default_rng([seed, *f"heldout/{stage}".encode()])
    boot = sum(bootstrap_means(d, n_boot=n_boot, rng=rng) for d in diffs) / len(diffs)
    lo, hi = percentile_interval(boot, confidence)
    deltas = [float(d.mean()) for d in diffs]
    return {"deltas": deltas, "changed": [int((d != 0).sum()) for d in diffs], "n": [len(d) for d in diffs],
            "mean": sum(deltas) / len(deltas), "lo": lo, "hi": hi}


def metric_value(run: Run, name: str) -> float | None:
    """The number at FILE:KEY in the run's metrics/FILE (KEY dotted for nested objects), or None."""
    file, colon, key = name.partition(":")
    if not colon or not key:
        raise ValueError(f"metric {name!r}: expected FILE:KEY, e.g. dpo.json:rewards_accuracy")
    v: Any = run.metrics.get(file)
    for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return None if isinstance(v, bool) or not isinstance(v, (int, float)) else float(v)


def stage_metrics(runs: list[Run], names: tuple[str, ...], *, required: bool) -> dict[str, dict[str, Any]]:
    """{FILE:KEY: {"values" per run, "mean", "min", "max"}} of `metric_value` over the runs.
    Missing in some run: an error if `required`, else left out."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        vals = [metric_value(run, name) for run in runs]
        if None in vals:
            if required:
                run = runs[vals.index(None)]
                file, _, key = name.partition(":")
                have = "no such file" if file not in run.metrics else f"no number at {key!r}"
                files = ", ".join(sorted(run.metrics)) or "none"
                raise ValueError(f"{run.name}: metrics/{file}: {have} (files: {files})")
            continue
        out[name] = {"values": vals, "mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)}
    return out


def summarize(runs: list[Run], parent: str = "sft", *, confidence: float = 0.95, n_boot: int = 10000,
              seed: int = 0, keys: tuple[str, ...] | None = HEADLINE, metrics: tuple[str, ...] | None = None,
              models: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Levels of every model, the pooled change of every model trained from `parent`, and the
    stage metrics named in `metrics` (None: those of STAGE_METRICS that every run has; the others
    that some run has are named in "metrics_left_out" with the runs that lack them). `models`
    (with the parent) reads only those models' items, where some run evaluated more than the
    others; the summary then records them under "models"."""
    chosen = {}
    if models is not None:
        chosen = {"models": list(dict.fromkeys((parent, *models)))}
        runs = [replace(r, items={m: v for m, v in r.items.items() if m in chosen["models"]}) for r in runs]
    models = list(dict.fromkeys(m for r in runs for m in r.items))
    for r in runs:
        missing = [m for m in models if m not in r.items]
        if missing:
            raise ValueError(f"{r.name}: no {', '.join(m + '_items.jsonl' for m in missing)} (it has"
                             f" {', '.join(sorted(r.items))}); every run must have evaluated the same models, or"
                             f" --models names the ones to read")
    if parent not in models:
        raise ValueError(f"the parent {parent!r} is not evaluated in every run (models: {', '.join(models)})")
    children = [m for m in models if m not in (parent, "base")]
    names = STAGE_METRICS if metrics is None else metrics
    left_out = {}  # what some run has and another lacks
    for name in names:
        lacking = [r.name for r in runs if metric_value(r, name) is None]
        if 0 < len(lacking) < len(runs):
            left_out[name] = lacking
    return {"runs": [r.name for r in runs], "parent": parent, "confidence": confidence,
            "levels": {m: levels(runs, m, keys) for m in models},
            "paired": {c: pooled(runs, c, parent, confidence=confidence, n_boot=n_boot, seed=seed, keys=keys)
                       for c in children},
            "rm_separation": {m: sep for m in models
                              if (sep := separations(runs, m, confidence=confidence, n_boot=min(n_boot, 2000),
                                                     seed=seed)) is not None},
            "heldout_reward": {st: ch for st in ("ppo", "grpo")
                               if (ch := heldout_changes(runs, st, confidence=confidence, n_boot=n_boot,
                                                         seed=seed)) is not None},
            "metrics": stage_metrics(runs, names, required=metrics is not None),
            "metrics_left_out": left_out, **chosen}


def _fmt(v: float | None, score: bool, sign: bool = False) -> str:
    if v is None:
        return "-"
    return (f"{v:+.4f}" if sign else f"{v:.4f}") if score else (f"{100 * v:+.1f}" if sign else f"{100 * v:.1f}%")


def markdown(s: dict[str, Any]) -> list[str]:
    """The summary as two markdown tables (levels, pooled changes)."""
    runs = s["runs"]
    pct = round(100 * s["confidence"])
    lines = [f"Runs: {', '.join(runs)}.", "", "| model | skill | " + " | ".join(runs) + " | mean | worst |",
             "|---|---|" + "---|" * len(runs) + "---|---|"]
    for m, sk in s["levels"].items():
        for k, v in sk.items():
            sc = k == "rm_score"
            lines.append(f"| {m} | {v['label']} | " + " | ".join(_fmt(x, sc) for x in v["values"])
                         + f" | {_fmt(v['mean'], sc)} | {_fmt(v['worst'], sc)} |")
    lines += ["", f"Change from {s['parent']} (points; the reward model's score in its units); * = "
              f"significant on that run; pooled = {pct}% interval over every run's items, with McNemar's p; "
              f"across runs = the t interval of the runs' changes.", "",
              "| model | skill | " + " | ".join(runs) + f" | mean | pooled {pct}% | p | across runs | up |",
              "|---|---|" + "---|" * len(runs) + "---|---|---|---|---|"]
    for c, sk in s["paired"].items():
        for k, v in sk.items():
            sc = k == "rm_score"
            cells = [_fmt(d, sc, True) + ("*" if sig else "") for d, sig in zip(v["deltas"], v["significant"])]
            pooled_cell = (f"[{_fmt(v['lo'], sc, True)}, {_fmt(v['hi'], sc, True)}]"
                           + ("*" if v["pooled_significant"] else ""))
            p = f"{v['p_value']:.2g}" if "p_value" in v else "-"
            across = "-" if v["t_lo"] is None else f"[{_fmt(v['t_lo'], sc, True)}, {_fmt(v['t_hi'], sc, True)}]"
            lines.append(f"| {c} | {v['label']} | " + " | ".join(cells)
                         + f" | {_fmt(v['mean'], sc, True)} | {pooled_cell} | {p} | {across} | {v['up']}/{len(runs)} |")
    if s.get("rm_separation"):
        lines += ["", f"Does the reward model's score follow correctness? Per model, the share of (right, wrong)"
                      f" pairs of its own greedy math answers that the RM orders right (AUC, {pct}% interval;"
                      f" 0.5 = the score says nothing about being right).", "",
                  "| model | " + " | ".join(runs) + " | mean | worst |", "|---|" + "---|" * (len(runs) + 2)]
        for m, v in s["rm_separation"].items():
            lines.append(f"| {m} | " + " | ".join(f"{a:.3f} [{lo:.3f}, {hi:.3f}]"
                                                 for a, lo, hi in zip(v["values"], v["lo"], v["hi"]))
                         + f" | {v['mean']:.3f} | {v['worst']:.3f} |")
    if s.get("heldout_reward"):
        lines += ["", f"The RL stages' reward on their held-out problems, start to end (the same problems and"
                      f" draws; pooled = {pct}% interval, each run's problems resampled within it).", "",
                  "| stage | " + " | ".join(runs) + f" | mean | pooled {pct}% | problems changed |",
                  "|---|" + "---|" * (len(runs) + 3)]
        for st, v in s["heldout_reward"].items():
            lines.append(f"| {st} | " + " | ".join(f"{d:+.4f}" for d in v["deltas"])
                         + f" | {v['mean']:+.4f} | [{v['lo']:+.4f}, {v['hi']:+.4f}] | "
                         + " / ".join(f"{c} of {n}" for c, n in zip(v["changed"], v["n"])) + " |")
    if s["metrics"]:
        lines += ["", "| stage metric | " + " | ".join(runs) + " | mean | min | max |",
                  "|---|" + "---|" * (len(runs) + 3)]
        for name, v in s["metrics"].items():
            lines.append(f"| {name} | " + " | ".join(f"{x:.4g}" for x in v["values"])
                         + f" | {v['mean']:.4g} | {v['min']:.4g} | {v['max']:.4g} |")
    if s.get("metrics_left_out"):
        lacking = "; ".join(f"{n} ({', '.join(r)})" for n, r in s["metrics_left_out"].items())
        lines += ["", f"Stage metrics left out, missing in these runs: {lacking}. A run directory has its"
                      f" metrics/<stage>.json after `dvc repro` or `dvc pull`; rev: and exp: runs read them"
                      f" from this machine's DVC cache."]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llm.seeds", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Each RUN: a directory with metrics/eval/ (or the eval directory itself),"
                                        " rev:<git revision>, or exp:<DVC experiment name>; LABEL=RUN"
                                        " names its column.")
    ap.add_argument("runs", nargs="+", metavar="RUN", help="the runs to read together (two or more for a spread)")
    ap.add_argument("--parent", default="sft", help="the model every other one is compared with (default: sft)")
    ap.add_argument("--all-skills", action="store_true",
                    help="every skill the items measure (per level, per task kind), not only the headline ones")
    ap.add_argument("--metric", action="append", metavar="FILE:KEY",
                    help="a number from each run's metrics/FILE (dotted KEY for nested objects), repeatable;"
                         f" default: those of {', '.join(STAGE_METRICS)} that every run has")
    ap.add_argument("--models", nargs="+", metavar="MODEL",
                    help="read only these models (and the parent), where some run evaluated more than the others"
                         " (say seeds whose GRPO stages have not run); default: every model, which every run must"
                         " have")
    ap.add_argument("--confidence", type=float, default=0.95, help="of every interval (default: 0.95)")
    ap.add_argument("--n-boot", type=int, default=10000, help="bootstrap resamples (default: 10000)")
    ap.add_argument("--seed", type=int, default=1337, help="the bootstrap's seed (default: 1337)")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write the summary as JSON")
    ap.add_argument("--markdown", type=Path, metavar="FILE", help="write the tables as markdown")
    args = ap.parse_args(argv)
    if not 0.5 < args.confidence < 1:
        ap.error(f"--confidence must be between 0.5 and 1, got {args.confidence}")
    if not 100 <= args.n_boot <= 10**6:
        ap.error(f"--n-boot must be between 100 and 1000000, got {args.n_boot}")
    try:
        runs = [load_run(r) for r in args.runs]
        s = summarize(runs, args.parent, confidence=args.confidence, n_boot=args.n_boot, seed=args.seed,
                      keys=None if args.all_skills else HEADLINE,
                      metrics=tuple(args.metric) if args.metric else None,
                      models=tuple(args.models) if args.models else None)
    except (ValueError, OSError) as e:
        print(f"llm.seeds: {e}", file=sys.stderr)
        return 2
    lines = markdown(s)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(s, indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
