"""The end of every training stage: its quality gates, then the model, its curves and its metrics.

    finish_stage(STAGE, gates=[Gate("final KL to the reference", kl, "max", "ppo.max_kl", cfg.max_kl,
                                    advice="Lower ppo.lr, raise the KL penalty, or run fewer steps")],
                 run_dir=run_dir, model=model, weights=out_model.cpu(), tokenizer=tok, meta={...},
                 plots=plots, metrics=metrics, numbers=out)

Pretrain, SFT, the reward model, DPO, PPO and GRPO all end here, in this order:

1. the gates: the first that fails writes the run's numbers to <run dir>/failed_metrics.json
   and raises llm.errors.QualityGateError (one message shape for every gate: which gate,
   measured vs limit, the params key); nothing below is written, so the outputs of the last
   run that passed stay as they were;
2. the model directory (llm.nn.artifacts.save_model_dir, with its meta.json);
3. the curves: <run dir>/plots published to the dvc plots directory (`publish_curves`), the
   TSVs without their timing columns;
4. the metrics (llm.train.metrics.write_metrics: the metrics file and, apart, its run file and the
   run's timings, which go to <run dir>/run.json).

What changes from run to run (step times, tokens per second, thread counts) stays in the run
directory, so a rerun that makes the same model byte for byte writes the same DVC outputs and
leaves dvc.lock as it was.

Under torchrun every rank checks the gates (they hold the same numbers, so all fail together)
and rank 0 alone writes (`write=rank 0`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from torch import nn

from llm.errors import QualityGateError
from llm.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text
from llm.nn.artifacts import save_model_dir
from llm.train.metrics import is_timing_key, write_metrics
from llm.train.monitor import Plots


@dataclass(frozen=True)
class Gate:
    """One quality gate: `measured` must stay at most (`bound` "max") or at least ("min") the params
    value `limit` at `key`, or strictly below it ("under": a count that must not reach its limit);
    a measurement that is not finite fails either way."""
    gate: str                      # what is measured, as the message names it
    measured: float
    bound: Literal["max", "min", "under"]
    key: str                       # the params key of the limit: "reward.min_accuracy"
    limit: float
    advice: str                    # what to change
    detail: str = ""               # the numbers beside it (on how many items, the weakest kinds)

    def failed(self) -> bool:
        if not math.isfinite(self.measured):
            return True
        if self.bound == "under":
            return self.measured >= self.limit
        return self.measured > self.limit if self.bound == "max" else self.measured < self.limit

    def error(self, stage: str, consequence: str) -> QualityGateError:
        relation = ("at" if self.measured == self.limit else "above") if self.bound != "min" else "below"
        return QualityGateError(stage, self.gate, self.measured, relation,
                                self.key, self.limit, detail=self.detail, advice=self.advice,
                                consequence=consequence)


def run_plots(stage: str, run_dir: Path, panels: list | None = None) -> Plots:
    """Where the training loop draws a stage's curves: in its run directory (plots/, tb/), from
    which `finish_stage` publishes them once the gates pass, so a failed run never replaces the
    curves of the last good one. `panels`: the PNG's (llm.train.monitor.Plots; default loss curves)."""
    curves = run_dir / "plots"
    return Plots(tsv=curves / f"{stage}.tsv", png=curves / f"{stage}.png", tb_dir=run_dir / "tb",
                 **({"panels": panels} if panels is not None else {}))


def finish_stage(stage: str, *, gates: Sequence[Gate] = (), run_dir: Path, model: Path, weights: nn.Module,
                 tokenizer: Any, meta: dict, plots: Path, metrics: Path, numbers: dict[str, Any],
                 write: bool = True) -> dict[str, Any]:
    """Check `gates`, then write `weights` to the model directory `model`, publish the curves in
    `run_dir`/plots (run_plots) to `plots` and write `numbers` as the metrics file `metrics` (module
    docstring); returns `numbers`. `write` False (ranks > 0) checks the gates and writes nothing."""
    for gate in gates:
        if gate.failed():
            failed = run_dir / "failed_metrics.json"
            if write:
                atomic_write_json(failed, numbers)
            raise gate.error(stage, f"no model was written ({model}/ and {metrics} are as before); the run's"
                                    f" numbers are in {failed}")
    if write:
        save_model_dir(model, weights, tokenizer, meta)
        publish_curves(run_dir / "plots", plots, stage)
        write_metrics(metrics, numbers, run_dir)  # the timings to run_dir/run.json
    return numbers


def publish_curves(src: Path, dst: Path, stage: str) -> None:
    """Copy a finished run's `<stage>.tsv` and `<stage>_val.tsv` without their timing columns
    (llm.train.metrics.is_timing_key: step_s, tokens_per_s, ...) and its `<stage>.png` from `src` (the
    run directory's plots/, which keeps every column) to `dst` (what `dvc plots` reads), each
    atomically."""
    for name in (f"{stage}.tsv", f"{stage}_val.tsv"):
        f = src / name
        if f.is_file():
            atomic_write_text(dst / name, without_timings(f.read_text(encoding="utf-8")))
    png = src / f"{stage}.png"
    if png.is_file():
        atomic_write_bytes(dst / png.name, png.read_bytes())


def without_timings(tsv: str) -> str:
    """A TSV (header line first, every line ending in a newline) without its timing columns."""
    rows = [line.split("\t") for line in tsv.splitlines()]
    if not rows:
        return ""
    keep = [i for i, column in enumerate(rows[0]) if not is_timing_key(column)]
    return "".join("\t".join(row[i] for i in keep) + "\n" for row in rows)
