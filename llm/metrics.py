"""Metrics files: what a person compares, apart from how the run went.

Every stage writes its numbers with one call,

    write_metrics("metrics/ppo.json", m)

which splits `m` by the rule below into two files:

    metrics/ppo.json       quality and size figures: what `dvc metrics diff` and `dvc exp show`
                           compare (dvc.yaml declares it under `metrics:`)
    metrics/run/ppo.json   timings, throughput, where and how it ran, samples and labels: still
                           written and read by the report, but not a DVC metric (an output in
                           DVC's cache), so an experiment's diff is not buried under timings
                           that change on every run

The rule, applied key by key at every level of nesting (a nested dict is split the same way,
and each half keeps the path to its keys):

- a timing, a rate per second or a memory figure goes to the run file: a key one of whose
  `_`-separated words is `s`, `seconds`, `time` or `mem` (`train_time_s`, `tokens_per_s`,
  `rollout_s_total`, `seconds`, `mem_peak_gb`), and `mfu` and `generation_fraction` (a share of
  the step time): they change with the machine and its load, not with what was learned;
- so does provenance and what was in force: `device`, `dtype`, `world_size`, `workers`,
  `resumed_from`, `inputs`, `fingerprint`, `warning`, every `*_sha256`, and the quality gates'
  thresholds echoed from params.yaml (`max_kl`, `min_accuracy`; `dvc exp show` lists params);
- so does every value that is not a number, a boolean or null: strings, lists (samples, names);
- everything else (numbers, booleans, null for "not measured") is a metric.

`read_metrics(path)` joins the two files back into the dict the stage had (`join_metrics` is
the inverse of `split_metrics`). `headline(metrics_dir)` gathers the few numbers per model that
a person compares first into metrics/summary.json (see its docstring).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llm.fileio import DataError, atomic_write_json, read_text

# The rule (module docstring). Key names, not values: a key is a timing whatever run it comes from.
RUN_WORDS = frozenset({"s", "seconds", "time", "mem"})
RUN_KEYS = frozenset({"mfu", "generation_fraction",
                      "device", "dtype", "world_size", "workers", "resumed_from", "inputs", "fingerprint", "warning",
                      "max_kl", "min_accuracy"})

RUN_DIR = "run"  # metrics/<stage>.json -> metrics/run/<stage>.json


def is_run_key(key: str) -> bool:
    """True when `key` names a timing, a rate, memory, provenance or an echoed threshold (not a metric)."""
    return key in RUN_KEYS or key.endswith("_sha256") or not RUN_WORDS.isdisjoint(key.split("_"))


def _is_metric_value(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float))


def split_metrics(d: dict) -> tuple[dict, dict]:
    """(metrics, run info) of one stage's dict, by the rule in the module docstring.

    A nested dict that is empty stays on the metrics side; one whose keys all go one way is not
    repeated empty on the other, so join_metrics(*split_metrics(d)) == d.
    """
    metrics: dict = {}
    run: dict = {}
    for k, v in d.items():
        if is_run_key(str(k)):
            run[k] = v
        elif isinstance(v, dict) and v:
            m, r = split_metrics(v)
            if m:
                metrics[k] = m
            if r:
                run[k] = r
        elif isinstance(v, dict) or _is_metric_value(v):
            metrics[k] = v
        else:
            run[k] = v
    return metrics, run


def join_metrics(metrics: dict, run: dict, _where: str = "") -> dict:
    """The dict a stage wrote: `metrics` with `run` merged in, dict by dict.

    Raises ValueError naming the dotted key when both hold the same non-dict key.
    """
    out = dict(metrics)
    for k, v in run.items():
        if k in out and isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = join_metrics(out[k], v, f"{_where}{k}.")
        elif k in out:
            raise ValueError(f"key {_where}{k} is in both the metrics and the run file")
        else:
            out[k] = v
    return out


def run_info_path(path: str | Path) -> Path:
    """Where the run file of the metrics file `path` goes: metrics/ppo.json -> metrics/run/ppo.json."""
    path = Path(path)
    return path.parent / RUN_DIR / path.name


def write_metrics(path: str | Path, d: dict) -> tuple[dict, dict]:
    """Write `d` as the metrics file `path` and its run file (run_info_path); returns the halves."""
    metrics, run = split_metrics(d)
    atomic_write_json(run_info_path(path), run)
    atomic_write_json(path, metrics)
    return metrics, run


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None


def read_metrics(path: str | Path) -> dict:
    """The dict a stage wrote with write_metrics: its metrics file joined with its run file (when
    there is one: files written before the split hold everything in the metrics file)."""
    path = Path(path)
    metrics = _read_json(path)
    run_path = run_info_path(path)
    if not run_path.is_file():
        return metrics
    try:
        return join_metrics(metrics, _read_json(run_path))
    except ValueError as e:
        raise DataError(f"{path} and {run_path}: {e}; rerun the stage that writes them") from None


# ---------------------------------------------------------------------------
# The headline: metrics/summary.json

# The model each training stage makes, as the eval stage names it (eval@<model>).
MODEL_OF_STAGE = {"pretrain": "base", "sft": "sft", "dpo": "dpo", "ppo": "ppo", "grpo": "grpo"}


def headline(metrics_dir: str | Path) -> dict[str, dict[str, float]]:
    """The numbers a person compares first, grouped by the stage that made the model.

    Each group is named after the stage (= its params section, so `dvc exp show` lists a
    stage's params and its headline side by side) and holds short keys, so that the whole table
    stays narrow:

        em, lo, hi   held-out math exact match of the stage's model and its 95% interval
                     (eval@<model>: math_exact_match, _lo, _hi); pretrain's model is `base`
        bpb          pretrain only: bits per byte on held-out text (eval@base: val_bpb)
        acc          reward: RM accuracy on held-out pairs (reward.json: accuracy);
                     dpo: held-out preference accuracy (dpo.json: rewards_accuracy)
        acc_ref      dpo only: the same accuracy from the reference's own likelihood
                     (dpo.json: ref_logp_accuracy), the baseline DPO has to beat
        reward, kl   ppo, grpo: held-out reward of the final policy and its KL to SFT in nats
                     per token (ppo.json/grpo.json: heldout_reward, heldout_kl)

    A number whose file is missing or lacks it is left out, never filled in.
    """
    root = Path(metrics_dir)

    def read(rel: str) -> dict:
        path = root / rel
        if not path.is_file():
            return {}
        d = _read_json(path)
        return d if isinstance(d, dict) else {}

    def pick(src: dict, keys: dict[str, str]) -> dict[str, float]:
        return {short: src[k] for short, k in keys.items()
                if isinstance(src.get(k), (int, float)) and not isinstance(src.get(k), bool)}

    em = {"em": "math_exact_match", "lo": "math_exact_match_lo", "hi": "math_exact_match_hi"}
    out: dict[str, dict[str, float]] = {}
    for stage, model in MODEL_OF_STAGE.items():
        ev = read(f"eval/{model}.json")
        out[stage] = pick(ev, em)
        if stage == "pretrain":
            out[stage] |= pick(ev, {"bpb": "val_bpb"})
    out["reward"] = pick(read("reward.json"), {"acc": "accuracy"})
    out["dpo"] |= pick(read("dpo.json"), {"acc": "rewards_accuracy", "acc_ref": "ref_logp_accuracy"})
    for stage in ("ppo", "grpo"):
        out[stage] |= pick(read(f"{stage}.json"), {"reward": "heldout_reward", "kl": "heldout_kl"})
    order = ["pretrain", "sft", "reward", "dpo", "ppo", "grpo"]
    return {g: out[g] for g in order if out.get(g)}
