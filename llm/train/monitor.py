"""What a training run shows and records while it runs.

- a tqdm bar: loss, lr, tokens/s, MFU (where the device's peak is known), ETA;
- TensorBoard event files (SummaryWriter imported lazily; on resume, events after the
  resumed step are purged);
- per-step TSV files for `dvc plots`: `<stage>.tsv` (one row per step) and `<stage>_val.tsv`
  (one row per evaluation), header row, `step` first; on resume they are rewritten from the
  checkpoint's history, so rows after the resumed step are dropped and the file never holds a
  step twice. The stages write them in their run directory and copy them to metrics/plots
  (`publish_curves`) when the run has finished and passed its gates;
- a PNG of the training curves (`write_curves_png`, the one curve writer; matplotlib, Agg
  backend, imported lazily);
- CUDA memory allocated / peak where CUDA is in use.

Only rank 0 creates a Monitor with `enabled=True`; other ranks get a silent one.
"""
from __future__ import annotations

import io
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llm.fileio import atomic_write_bytes, atomic_write_text

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, for MFU. fp16 is the same
# on these parts. Unknown devices (and CPUs) report no MFU rather than a made-up one.
_PEAK_BF16 = [("H200", 989.4e12), ("H100", 989.4e12), ("H800", 989.4e12), ("GH200", 989.4e12),
              ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12),
              ("A10", 125e12), ("RTX 4090", 165.2e12), ("RTX 3090", 71e12), ("V100", 125e12),
              ("T4", 65e12), ("B200", 2250e12)]


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s for `dtype` if known, else None (CPU: None)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for frag, peak in _PEAK_BF16:
        if frag in name:
            return peak
    return None


def cuda_memory(device: torch.device) -> dict[str, float]:
    """{"mem_allocated_gb", "mem_peak_gb"} on CUDA, {} elsewhere."""
    if device.type != "cuda":
        return {}
    return {"mem_allocated_gb": torch.cuda.memory_allocated(device) / 2**30,
            "mem_peak_gb": torch.cuda.max_memory_allocated(device) / 2**30}


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else str(v)  # repr: exact round trip
    return str(v)


class TSVLog:
    """Append-only TSV with a fixed header (`step` first), rebuilt from history on resume.

    `rows` (a resumed run's history, from its checkpoint) are written first, atomically,
    replacing whatever the file held: rows a killed run wrote after its checkpoint go, and
    a file deleted in between (DVC removes outputs before re-running a stage) comes back
    whole. The header is the first row's keys; keys missing from a row are written empty,
    keys not in the header are ignored.
    """

    def __init__(self, path: str | Path, rows: list[dict[str, Any]] = ()):
        self.path = Path(path)
        self.columns: list[str] | None = None
        self._f = None
        lines = []
        if rows:
            self.columns = self._header(rows[0])
            lines = ["\t".join(self.columns)] + [self._line(r) for r in rows]
        atomic_write_text(self.path, "".join(line + "\n" for line in lines))

    @staticmethod
    def _header(row: dict[str, Any]) -> list[str]:
        return ["step"] + [k for k in row if k != "step"]

    def _line(self, row: dict[str, Any]) -> str:
        return "\t".join(_fmt(row.get(c)) for c in self.columns)

    def write(self, row: dict[str, Any]) -> None:
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8", newline="\n")
        if self.columns is None:
            self.columns = self._header(row)
            self._f.write("\t".join(self.columns) + "\n")
        self._f.write(self._line(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


@dataclass
class Plots:
    """Where a run's curves go, and what its PNG shows.

    tsv:    `<stage>.tsv`, one row per step; `<stage>_val.tsv` beside it, one per evaluation
    png:    the curves as a picture (`panels`, below)
    tb_dir: TensorBoard event files
    panels: the PNG's panels, top to bottom: (y label, [(source, key, label), ...]) with
            source "train" (a point per step: drawn faint, with its moving average on top)
            or "val" (a point per evaluation, with markers); a panel whose label ends in
            "(log)" uses a log y axis
    """
    tsv: Path | None = None
    png: Path | None = None
    tb_dir: Path | None = None
    panels: list[tuple[str, list[tuple[str, str, str]]]] = field(default_factory=list)


class Monitor:
    """Progress bar + TensorBoard + TSV + PNG for one training run.

    The training stages point `plots` into their run directory and copy the files to
    metrics/plots with `publish_curves` once the run has passed its quality gates, so a run
    that fails leaves the published curves of the last good run as they were.
    """

    def __init__(self, stage: str, *, max_steps: int, start_step: int = 0, enabled: bool = True,
                 plots: Plots | None = None, progress: bool = True,
                 train_history: list[dict] = (), val_history: list[dict] = ()):
        self.stage, self.enabled = stage, enabled
        self.plots = plots or Plots()
        self.bar = self.tb = self.tsv = self.val_tsv = None
        if not enabled:
            return
        if self.plots.tsv:
            self.tsv = TSVLog(self.plots.tsv, train_history)
            self.val_tsv = TSVLog(self.plots.tsv.with_name(_val_name(self.plots.tsv)), val_history)
        if self.plots.tb_dir:
            from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard
            # TensorBoard drops older events at steps >= purge_step: a resumed run hides what the
            # killed run logged after its checkpoint; a fresh start hides an earlier run's events
            self.tb = SummaryWriter(log_dir=str(self.plots.tb_dir), purge_step=start_step + 1 if start_step else 0)
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=max_steps, initial=start_step, desc=stage, dynamic_ncols=True,
                            file=sys.stderr, mininterval=1.0)

    def step(self, row: dict[str, Any], show: bool) -> None:
        """Record one step's row (TSV every step; bar and TensorBoard when `show`)."""
        if not self.enabled:
            return
        if self.tsv:
            self.tsv.write(row)
        if self.bar is not None:
            self.bar.update(row["step"] - self.bar.n)
        if show:
            if self.bar is not None:
                post = {k: f"{row[k]:.4f}" for k in ("loss", "reward") if row.get(k) is not None}
                post["lr"] = f"{row['lr']:.2e}"
                if row.get("tokens_per_s") is not None:
                    post["tok/s"] = f"{row['tokens_per_s']:.0f}"
                if row.get("mfu") is not None:
                    post["mfu"] = f"{100 * row['mfu']:.1f}%"
                self.bar.set_postfix(post, refresh=False)
            if self.tb:
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)) and v is not None:
                        self.tb.add_scalar(f"train/{k}", v, row["step"])

    def log_eval(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.val_tsv:
            self.val_tsv.write(row)
        if self.tb:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"val/{k}", v, row["step"])
        self.print(f"{self.stage} step {row['step']}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in row.items() if k != "step" and isinstance(v, float)))

    def print(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self, train_history: list[dict], val_history: list[dict]) -> None:
        """Close the files and write the PNG of the curves."""
        if not self.enabled:
            return
        for t in (self.tsv, self.val_tsv):
            if t:
                t.close()
        if self.tb:
            self.tb.flush()
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
        if self.plots.png and train_history:
            write_curves_png(self.plots.png, f"{self.stage}: training curves", train_history, val_history,
                             self.plots.panels)


def publish_curves(src: str | Path, dst: str | Path, stage: str) -> None:
    """Copy a finished run's `<stage>.tsv`, `<stage>_val.tsv` and `<stage>.png` from `src` (its run
    directory's plots/) to `dst` (metrics/plots/, what `dvc plots` reads), each atomically."""
    for name in (f"{stage}.tsv", f"{stage}_val.tsv", f"{stage}.png"):
        f = Path(src) / name
        if f.is_file():
            atomic_write_bytes(Path(dst) / name, f.read_bytes())


def _val_name(tsv: Path) -> str:
    return tsv.stem + "_val.tsv"


def smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (fewer at the start); None/NaN points skipped."""
    out, buf = [], []
    for y in ys:
        if y is not None and math.isfinite(y):
            buf = (buf + [y])[-window:]
        out.append(sum(buf) / len(buf) if buf else float("nan"))
    return out


def write_curves_png(path: str | Path, title: str, train: list[dict], val: list[dict],
                     panels: list[tuple[str, list[tuple[str, str, str]]]]) -> None:
    """The one training-curve picture of this project, written atomically (see `Plots.panels`).

    Per-step series are drawn faint, with a moving average over ~2% of the run on top;
    evaluation series as points with markers. Panels whose series are all absent are left out.
    """
    import matplotlib
    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    rows = {"train": train, "val": val}
    shown = [(label, [s for s in series if any(r.get(s[1]) is not None for r in rows[s[0]])])
             for label, series in panels]
    shown = [(label, series) for label, series in shown if series]
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(7, 2.2 + 2.0 * len(shown)), sharex=True, squeeze=False)
    window = max(1, len(train) // 50)
    for ax, (label, series) in zip(axes[:, 0], shown):
        for i, (source, key, name) in enumerate(series):
            pts = [(r["step"], r[key]) for r in rows[source] if r.get(key) is not None]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            color = f"C{i}"
            if source == "train" and window > 1:
                ax.plot(xs, ys, lw=0.6, alpha=0.3, color=color)
                ax.plot(xs, smooth(ys, window), lw=1.4, color=color, label=f"{name} (mean of {window})")
            elif source == "train":
                ax.plot(xs, ys, lw=1.0, color=color, label=name)
            else:
                ax.plot(xs, ys, "o-", ms=3, color=color, label=name)
        if label.endswith("(log)"):
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0, 0].set_title(title)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
