"""Metrics files: what a person compares, apart from what else a run records and how it went.

Every stage writes its numbers with one call,

    write_metrics("metrics/ppo.json", m)

which splits `m` by the rules below into three files:

    metrics/ppo.json       quality and size figures: what `dvc metrics diff` and `dvc exp show`
                           compare (dvc.yaml declares it under `metrics:`)
    metrics/run/ppo.json   what else the run made that is not a metric (samples, per-problem
                           rewards, provenance, labels): a DVC output that is not a metric, so
                           an experiment's diff stays short
    runs/ppo/run.json      the run's timings, throughput and what it ran with that changes
                           from run to run: beside the stage's checkpoints in its run directory,
                           which DVC does not track, so that a rerun on the same machine whose
                           models come out byte for byte the same leaves dvc.lock unchanged

The last goes into the run directory a training stage is given (`--run-dir`, passed on as
`run_dir`: `<run_dir>/run.json`); a stage without one derives it from the metrics file's path,
`<root>/metrics/<stage>.json` -> `<root>/runs/<stage>/run.json` (timings_path; every stage's
metrics file is metrics/<stage>.json in dvc.yaml, and its run directory runs/<stage>). The rules,
applied key by key at every level of nesting (a nested dict is split the same way, and each part
keeps the path to its keys):

- timings (the runs/ file): a key one of whose `_`-separated words is `s`, `seconds`, `time`
  or `mem` (`train_time_s`, `tokens_per_s`, `rollout_s_total`, `seconds`, `mem_peak_gb`), and
  `mfu`, `generation_fraction` (a share of the step time), `num_threads` and `threads_steps`
  (`auto` follows the machine's load), `threads_probe` (the thread counts `auto` found to give
  one thread's bits on this CPU, and the CPU) and `resumed_from` (where a killed run picked up):
  they change with the machine, its load and the run's history, not with what was learned;
- the run file: provenance and what was in force: `device`, `dtype`, `world_size`, `workers`,
  `inputs`, `fingerprint`, `warning`, every `*_sha256`, the quality gates' thresholds echoed
  from params.yaml (`max_kl`, `min_accuracy`; `dvc exp show` lists params), and every value
  that is not a number, a boolean or null: strings, lists (samples, names);
- everything else (numbers, booleans, null for "not measured") is a metric.

`read_metrics(path)` joins the files back into the dict the stage had (`join_metrics` is the
inverse of `split_metrics` and `split_timings`). `headline(metrics_dir)` gathers the few numbers
per model that a person compares first into metrics/summary.json (see its docstring).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from llm.fileio import DataError, atomic_write_json, read_text

# The rules (module docstring). Key names, not values: a key is a timing whatever run it comes from.
TIMING_WORDS = frozenset({"s", "seconds", "time", "mem"})
TIMING_KEYS = frozenset({"mfu", "generation_fraction", "num_threads", "threads_steps", "threads_probe",
                         "resumed_from"})
RUN_KEYS = frozenset({"device", "dtype", "world_size", "workers", "inputs", "fingerprint", "warning",
                      "max_kl", "min_accuracy"})

RUN_DIR = "run"  # metrics/<stage>.json -> metrics/run/<stage>.json
RUNS = "runs"    # metrics/<stage>.json -> runs/<stage>/run.json


def is_timing_key(key: str) -> bool:
    """True when `key` names a timing, a rate, memory, or what changes from run to run (the runs/ file)."""
    return key in TIMING_KEYS or not TIMING_WORDS.isdisjoint(key.split("_"))


def is_run_key(key: str) -> bool:
    """True when `key` is no metric by its name: a timing (is_timing_key), provenance or an echoed threshold."""
    return is_timing_key(key) or key in RUN_KEYS or key.endswith("_sha256")


def _is_metric_value(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float))


def _split(d: dict, key_out: Callable[[str], bool], value_out: Callable[[Any], bool]) -> tuple[dict, dict]:
    """(kept, out) of `d`: a key for which key_out holds goes out whole; a nested dict is split the
    same way; any other value goes out when value_out holds. A nested dict that is empty stays; one
    whose keys all go one way is not repeated empty on the other."""
    kept: dict = {}
    out: dict = {}
    for k, v in d.items():
        if key_out(str(k)):
            out[k] = v
        elif isinstance(v, dict) and v:
            a, b = _split(v, key_out, value_out)
            if a:
                kept[k] = a
            if b:
                out[k] = b
        elif isinstance(v, dict) or not value_out(v):
            kept[k] = v
        else:
            out[k] = v
    return kept, out


def split_metrics(d: dict) -> tuple[dict, dict]:
    """(metrics, the rest) of one stage's dict, by the rules in the module docstring;
    join_metrics(*split_metrics(d)) == d."""
    return _split(d, is_run_key, lambda v: not _is_metric_value(v))


def split_timings(d: dict) -> tuple[dict, dict]:
    """(the rest, timings) of one stage's dict: the timings are what goes to the runs/ file."""
    return _split(d, is_timing_key, lambda v: False)


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


def timings_path(path: str | Path, run_dir: str | Path | None = None) -> Path:
    """Where the timings of the metrics file `path` go: `run_dir`/run.json when the stage was given
    a run directory; else metrics/ppo.json -> runs/ppo/run.json (the stage's run directory, beside
    metrics/ under the same root; untracked by DVC), and an evaluation's metrics/eval/sft.json ->
    runs/eval@sft/run.json (the DVC stage that writes it)."""
    if run_dir is not None:
        return Path(run_dir) / "run.json"
    path = Path(path)
    if path.parent.name == "eval":
        return path.parent.parent.parent / RUNS / f"eval@{path.stem}" / "run.json"
    return path.parent.parent / RUNS / path.stem / "run.json"


def write_metrics(path: str | Path, d: dict, run_dir: str | Path | None = None) -> tuple[dict, dict, dict]:
    """Write `d` as the metrics file `path`, its run file (run_info_path) and its timings
    (timings_path: into `run_dir` when given); returns the three parts."""
    rest, timings = split_timings(d)
    metrics, run = split_metrics(rest)
    atomic_write_json(timings_path(path, run_dir), timings)
    atomic_write_json(run_info_path(path), run)
    atomic_write_json(path, metrics)
    return metrics, run, timings


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None


def read_metrics(path: str | Path, run_dir: str | Path | None = None) -> dict:
    """The dict a stage wrote with write_metrics (given the same `run_dir`): its metrics file joined
    with its run file and its timings, each when there is one (files written before a split hold
    more in the metrics file; timings are absent where the run directory was removed or the outputs
    came from DVC's cache)."""
    path = Path(path)
    out = _read_json(path)
    for extra in (run_info_path(path), timings_path(path, run_dir)):
        if not extra.is_file():
            continue
        try:
            out = join_metrics(out, _read_json(extra))
        except ValueError as e:
            raise DataError(f"{path} and {extra}: {e}; rerun the stage that writes them") from None
    return out


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
