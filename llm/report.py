"""The stage-comparison report: tables, training curves and samples.

    data = collect(metrics_dir="metrics", max_samples=3)   # what exists; notes for what does not
    md = render_markdown(data, images={"curves": "report_curves.png"})
    page = render_html(data, images={"curves": png_bytes, ...})   # one self-contained file

`collect` reads the per-model eval metrics (`metrics/eval/<model>.json`) and samples
(`<model>_samples.json`), the stage metrics (`metrics/<stage>.json`) and the per-step TSVs
of `metrics/plots/`; any of them may be missing (stages land one by one, or one failed): it is
left out and listed in `data["notes"]`, never filled in.

The table has one row per metric and one column per model: value, its 95% interval where the
metrics carry `<key>_lo` / `<key>_hi`, and each post-training stage's change against its
parent (sft vs base; ppo, grpo and dpo vs sft).

The HTML page is offline: no scripts, no stylesheets or fonts from elsewhere, images embedded as
base64 PNG data URIs, and any http(s) URL appearing in model output or metrics defanged to
`hxxp(s)://`, so the page can fetch nothing. Plots use matplotlib (Agg, imported lazily).
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

from llm.metrics import join_metrics, run_info_path

MODELS = ("base", "sft", "ppo", "grpo", "dpo")
PARENT = {"sft": "base", "ppo": "sft", "grpo": "sft", "dpo": "sft"}
STAGES = ("tokenizer", "pretrain", "clean_sft", "sft", "reward", "pairs", "dpo", "ppo", "grpo")

# (metrics key, label, kind, better): kind "pct" shows a proportion as a percentage (deltas in
# percentage points), "num" a plain number; better: +1 higher is better, -1 lower, 0 neither.
TABLE: tuple[tuple[str, str, str, int], ...] = (
    ("math_exact_match", "math exact match (greedy)", "pct", +1),
    ("math_pass_at_k", "math pass@k", "pct", +1),
    ("math_format_rate", "answers ending in a #### N line", "pct", +1),
    ("math_exact_match_level1", "exact match, level 1", "pct", +1),
    ("math_exact_match_level2", "exact match, level 2", "pct", +1),
    ("math_exact_match_level3", "exact match, level 3", "pct", +1),
    ("math_exact_match_level4", "exact match, level 4", "pct", +1),
    ("rm_score", "reward model score", "num", +1),
    ("win_rate_vs_sft", "win rate vs SFT (RM judge)", "pct", +1),
    ("kl_to_sft", "KL to SFT (nats / response)", "num", 0),
    ("kl_to_sft_per_token", "KL to SFT (nats / token)", "num", 0),
    ("val_bpb", "held-out bits per byte", "num", -1),
    ("val_ppl", "held-out perplexity", "num", -1),
    ("math_response_tokens_mean", "answer length (tokens)", "num", 0),
    ("toxicity_rate", "toxicity rate", "pct", -1),
)

# Training-curve panels: (title, y label, [(tsv file, candidate columns, legend)]). The first
# candidate column a file has is plotted; files or columns that are missing are skipped.
PANELS: tuple[tuple[str, str, tuple[tuple[str, tuple[str, ...], str], ...]], ...] = (
    ("pretrain loss", "nats / token", (("pretrain.tsv", ("loss",), "train"),
                                       ("pretrain_val.tsv", ("val_loss",), "val"))),
    ("SFT loss", "nats / token", (("sft.tsv", ("loss",), "train"), ("sft_val.tsv", ("val_loss",), "val"))),
    ("reward model accuracy", "pairwise accuracy", (("reward.tsv", ("accuracy",), "train"),
                                                    ("reward_val.tsv", ("val_accuracy",), "val"))),
    ("PPO reward", "reward", (("ppo.tsv", ("reward",), "rollouts"), ("ppo_val.tsv", ("reward",), "held-out"))),
    ("PPO KL to SFT", "nats / token", (("ppo.tsv", ("kl",), "rollouts"), ("ppo_val.tsv", ("kl",), "held-out"))),
    ("GRPO reward", "reward / accuracy", (("grpo.tsv", ("reward",), "rollouts"),
                                          ("grpo_val.tsv", ("math_exact_match",), "held-out"))),
    ("GRPO KL to SFT", "nats / token", (("grpo.tsv", ("kl",), "rollouts"), ("grpo_val.tsv", ("kl",), "held-out"))),
    ("DPO loss", "loss", (("dpo.tsv", ("loss",), "train"), ("dpo_val.tsv", ("val_loss",), "val"))),
    ("DPO preference accuracy", "rewards accuracy", (("dpo.tsv", ("rewards_accuracy",), "train"),
                                                     ("dpo_val.tsv", ("val_rewards_accuracy",), "val"))),
)

# KL to SFT is already a distance from the parent of ppo/grpo/dpo; a "change" of it says nothing more
NO_DELTA = {"kl_to_sft", "kl_to_sft_per_token"}
_URL = re.compile(r"(?i)\b(http)(s?)://")
MAX_STAGE_KEYS = 40


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


def flatten_scalars(obj: dict, prefix: str = "", depth: int = 2) -> dict[str, Any]:
    """Numbers, booleans and short strings of a metrics dict, nested dicts as dotted keys
    (down to `depth` levels); lists are left out."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            if depth > 1:
                out.update(flatten_scalars(v, key + ".", depth - 1))
        elif isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 80) or v is None:
            out[key] = v
    return out


def collect(metrics_dir: str | Path = "metrics", max_samples: int = 3) -> dict:
    """Everything the report shows, from what exists under `metrics_dir`.

    Returns {"evals": {model: metrics}, "samples": {model: samples}, "stages": {stage: flat
    scalars}, "curves": {tsv name: columns}, "notes": [what is missing], "max_samples"}.
    """
    root = Path(metrics_dir)
    notes: list[str] = []
    evals, samples, stages, curves = {}, {}, {}, {}
    for m in MODELS:
        e = _read_json(root / "eval" / f"{m}.json", notes)
        if isinstance(e, dict):
            evals[m] = e
            s = _read_json(root / "eval" / f"{m}_samples.json", notes)
            if isinstance(s, dict):
                samples[m] = s
    for st in STAGES:
        d = _read_json(root / f"{st}.json", notes)
        if isinstance(d, dict):
            run = run_info_path(root / f"{st}.json")  # its timings and provenance (llm/metrics.py)
            run_d = _read_json(run, notes) if run.is_file() else None
            stages[st] = flatten_scalars(join_metrics(d, run_d) if isinstance(run_d, dict) else d)
    plots = root / "plots"
    wanted = sorted({f for _, _, series in PANELS for f, _, _ in series})
    for f in wanted:
        if (plots / f).is_file():
            cols = read_tsv(plots / f)
            if cols.get("step"):
                curves[f] = cols
    return {"evals": evals, "samples": samples, "stages": stages, "curves": curves, "notes": notes,
            "max_samples": max_samples}


# ---------------------------------------------------------------------------
# The table

def _num(v: float) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}" if a >= 100 else f"{v:.3f}"


def fmt_value(v: float, kind: str) -> str:
    return f"{100 * v:.1f}%" if kind == "pct" else _num(v)


def fmt_delta(d: float, kind: str) -> str:
    if kind == "pct":
        return f"{100 * d:+.1f} pp"
    return f"{d:+,.0f}" if abs(d) >= 1000 else f"{d:+.3g}"


def table_rows(evals: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """(models present, rows): each row {"key", "label", "cells": {model: {"value", "interval",
    "delta", "verdict"}}}; rows no model has are dropped. verdict: "better" / "worse" / ""
    (the change against the parent, where the metric has a direction)."""
    models = [m for m in MODELS if m in evals]
    rows = []
    for key, label, kind, better in TABLE:
        if not any(isinstance(evals[m].get(key), (int, float)) for m in models):
            continue
        if key == "math_pass_at_k":
            ks = {evals[m].get("math_pass_k") for m in models} - {None}
            if len(ks) == 1:
                label = f"math pass@{ks.pop()}"
        cells = {}
        for m in models:
            v = evals[m].get(key)
            if not isinstance(v, (int, float)):
                cells[m] = {"value": "n/a", "interval": "", "delta": "", "verdict": ""}
                continue
            lo, hi = evals[m].get(f"{key}_lo"), evals[m].get(f"{key}_hi")
            interval = (f"[{fmt_value(lo, kind)}, {fmt_value(hi, kind)}]"
                        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else "")
            delta, verdict = "", ""
            p = PARENT.get(m)
            pv = evals.get(p, {}).get(key) if p and key not in NO_DELTA else None
            if isinstance(pv, (int, float)):
                d = v - pv
                delta = f"{fmt_delta(d, kind)} vs {p}"
                if better and d != 0:
                    verdict = "better" if d * better > 0 else "worse"
            cells[m] = {"value": fmt_value(v, kind), "interval": interval, "delta": delta, "verdict": verdict}
        rows.append({"key": key, "label": label, "cells": cells})
    return models, rows


# ---------------------------------------------------------------------------
# Plots

def _plt():
    import matplotlib
    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt
    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, metadata={"Software": None})  # no version string: same bytes per run
    _plt().close(fig)
    return buf.getvalue()


def curves_png(curves: dict[str, dict[str, list[float]]]) -> tuple[bytes | None, list[str]]:
    """One figure with a panel per training curve that has data; (png or None, titles drawn)."""
    panels = []
    for title, ylabel, series in PANELS:
        lines = []
        for f, candidates, legend in series:
            cols = curves.get(f)
            col = next((c for c in candidates if cols and c in cols), None) if cols else None
            if col is not None:
                pts = [(s, y) for s, y in zip(cols["step"], cols[col]) if math.isfinite(y)]
                if pts:
                    lines.append((pts, f"{legend} ({col})"))
        if lines:
            panels.append((title, ylabel, lines))
    if not panels:
        return None, []
    plt = _plt()
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.0 * nrow), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, ylabel, lines) in zip(axes.flat, panels):
        for pts, legend in lines:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "o-" if len(xs) < 30 else "-", lw=1.0, ms=3, label=legend)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig), [t for t, _, _ in panels]


def eval_png(evals: dict[str, dict]) -> bytes | None:
    """Bars per model with 95% intervals: math exact match, win rate vs SFT; KL to SFT."""
    models = [m for m in MODELS if m in evals]
    specs = [(k, t) for k, t in (("math_exact_match", "held-out math exact match"),
                                 ("win_rate_vs_sft", "win rate vs SFT"), ("kl_to_sft", "KL to SFT (nats/response)"))
             if any(isinstance(evals[m].get(k), (int, float)) for m in models)]
    if not specs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(specs), figsize=(4.0 * len(specs), 3.0), squeeze=False)
    for ax, (key, title) in zip(axes.flat, specs):
        ms = [m for m in models if isinstance(evals[m].get(key), (int, float))]
        vals = [evals[m][key] for m in ms]
        lo = [max(0.0, v - evals[m].get(f"{key}_lo", v)) for m, v in zip(ms, vals)]
        hi = [max(0.0, evals[m].get(f"{key}_hi", v) - v) for m, v in zip(ms, vals)]
        ax.bar(ms, vals, yerr=[lo, hi], capsize=4, color="tab:blue", alpha=0.8)
        if key != "kl_to_sft":  # proportions: the whole [0, 1] scale, and chance for the win rate
            ax.set_ylim(0, 1)
        if key == "win_rate_vs_sft":
            ax.axhline(0.5, color="gray", ls="--", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("error bars: 95% intervals", fontsize=8)
    fig.tight_layout()
    return _png(fig)


def placeholder_png(text: str) -> bytes:
    """A small image saying what is missing (a DVC out must exist even before its data does)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.0, 1.2))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, wrap=True)
    return _png(fig)


# ---------------------------------------------------------------------------
# Rendering

def defang(text: str) -> str:
    """http(s):// -> hxxp(s)://: the offline page must hold no URL it could fetch."""
    return _URL.sub(lambda m: f"{m.group(1)[0]}xx{m.group(1)[3]}{m.group(2)}://", text)


def _samples_by_prompt(data: dict, field: str, key: str) -> list[tuple[str, dict[str, str]]]:
    """[(prompt, {model: response})] for the first max_samples prompts, in the first model's order."""
    order: list[str] = []
    table: dict[str, dict[str, str]] = {}
    for m in MODELS:
        for s in (data["samples"].get(m) or {}).get(field, []):
            p = s.get(key, "") + (f"\n(answer: {s['answer']})" if "answer" in s else "")
            if p not in table:
                order.append(p)
                table[p] = {}
            table[p][m] = _clip(s.get("response", ""))
    return [(p, table[p]) for p in order[:data["max_samples"]]]


MAX_SAMPLE_CHARS = 600


def _clip(text: str) -> str:
    return text if len(text) <= MAX_SAMPLE_CHARS else text[:MAX_SAMPLE_CHARS] + f" … ({len(text)} characters)"


def _md_cell(text: str) -> str:
    """Text for a markdown table cell: no raw HTML (model output is data), pipes and newlines kept."""
    if not text:
        return "_(empty)_"
    return html.escape(_clip(text), quote=False).replace("|", "\\|").replace("\n", "<br>")


def render_markdown(data: dict, images: dict[str, str] | None = None) -> str:
    """The report as GitHub markdown; `images` maps "curves"/"eval" to relative image paths."""
    images = images or {}
    out = ["# Pipeline report", ""]
    models, rows = table_rows(data["evals"])
    out += ["## Stage by stage", ""]
    if rows:
        out += ["Value [95% interval]; deltas against the parent stage (sft vs base; ppo, grpo, dpo vs sft).",
                "", "| metric | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
        for r in rows:
            cells = []
            for m in models:
                c = r["cells"][m]
                txt = c["value"] + (f" {c['interval']}" if c["interval"] else "")
                if c["delta"]:
                    mark = {"better": " ▲", "worse": " ▼"}.get(c["verdict"], "")
                    txt += f"<br>{c['delta']}{mark}"
                cells.append(txt)
            out.append(f"| {r['label']} | " + " | ".join(cells) + " |")
        tox = {m: data["evals"][m].get("toxicity") for m in models if data["evals"][m].get("toxicity")}
        if tox:
            out += ["", "Toxicity: " + ", ".join(f"{m} {v}" for m, v in tox.items())
                    + " (no Detoxify checkpoint configured: `eval.detoxify_checkpoint`)."]
    else:
        out.append("_No eval metrics yet (metrics/eval/<model>.json)._")
    if images.get("eval"):
        out += ["", f"![eval metrics with 95% intervals]({images['eval']})"]
    out += ["", "## Training curves", ""]
    out.append(f"![training curves]({images['curves']})" if images.get("curves") else "_No per-step TSVs yet._")
    out += ["", "## Samples", ""]
    for title, field, key in (("Fixed prompts (greedy)", "sample_prompts", "prompt"),
                              ("Held-out math (greedy)", "math_samples", "question")):
        groups = _samples_by_prompt(data, field, key)
        if not groups:
            continue
        out += [f"### {title}", ""]
        for prompt, by_model in groups:
            out += [f"**{_md_cell(prompt)}**", "", "| model | response |", "|---|---|"]
            out += [f"| {m} | {_md_cell(by_model[m])} |" for m in MODELS if m in by_model]
            out.append("")
    out += ["## Training stages", ""]
    if data["stages"]:
        for st, kv in data["stages"].items():
            items = list(kv.items())[:MAX_STAGE_KEYS]
            out.append(f"- **{st}**: " + ", ".join(f"{k} {_num(v) if isinstance(v, (int, float)) else v}"
                                                    for k, v in items))
    else:
        out.append("_No stage metrics yet._")
    if data["notes"]:
        out += ["", "## Not available", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(out) + "\n"


_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #f3f3f3; }
td.num { white-space: nowrap; }
.iv { color: #666; font-size: 0.85em; }
.delta { font-size: 0.85em; }
.better { color: #1a7f37; } .worse { color: #cf222e; }
pre { margin: 0; white-space: pre-wrap; font-size: 0.85em; max-width: 28em; }
img { max-width: 100%; }
.note { color: #666; }
"""


def _e(text: Any) -> str:
    return html.escape(defang(str(text)))


def _img(png: bytes | None, alt: str) -> str:
    if not png:
        return ""
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def render_html(data: dict, images: dict[str, bytes | None] | None = None) -> str:
    """The report as one offline HTML page (no URL anywhere; images inlined)."""
    images = images or {}
    h = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', "<title>Pipeline report</title>",
         f"<style>{_CSS}</style></head><body>", "<h1>Pipeline report</h1>", "<h2>Stage by stage</h2>"]
    models, rows = table_rows(data["evals"])
    if rows:
        h.append('<p class="note">Value, [95% interval], and the change against the parent stage'
                 " (sft vs base; ppo, grpo, dpo vs sft).</p>")
        h.append("<table><tr><th>metric</th>" + "".join(f"<th>{_e(m)}</th>" for m in models) + "</tr>")
        for r in rows:
            tds = []
            for m in models:
                c = r["cells"][m]
                cell = _e(c["value"])
                if c["interval"]:
                    cell += f' <span class="iv">{_e(c["interval"])}</span>'
                if c["delta"]:
                    cell += f'<br><span class="delta {c["verdict"]}">{_e(c["delta"])}</span>'
                tds.append(f'<td class="num">{cell}</td>')
            h.append(f"<tr><th>{_e(r['label'])}</th>{''.join(tds)}</tr>")
        h.append("</table>")
        tox = {m: data["evals"][m].get("toxicity") for m in models if data["evals"][m].get("toxicity")}
        if tox:
            h.append('<p class="note">Toxicity: ' + _e(", ".join(f"{m} {v}" for m, v in tox.items()))
                     + " (no Detoxify checkpoint configured: <code>eval.detoxify_checkpoint</code>).</p>")
    else:
        h.append('<p class="note">No eval metrics yet (metrics/eval/&lt;model&gt;.json).</p>')
    h.append(_img(images.get("eval"), "eval metrics with 95% intervals"))
    h.append("<h2>Training curves</h2>")
    h.append(_img(images.get("curves"), "training curves") or '<p class="note">No per-step TSVs yet.</p>')
    h.append("<h2>Samples</h2>")
    for title, field, key in (("Fixed prompts (greedy)", "sample_prompts", "prompt"),
                              ("Held-out math (greedy)", "math_samples", "question")):
        groups = _samples_by_prompt(data, field, key)
        if not groups:
            continue
        present = [m for m in MODELS if any(m in g for _, g in groups)]
        h.append(f"<h3>{_e(title)}</h3><table><tr><th>prompt</th>"
                 + "".join(f"<th>{_e(m)}</th>" for m in present) + "</tr>")
        for prompt, by_model in groups:
            h.append(f"<tr><td><pre>{_e(prompt)}</pre></td>"
                     + "".join(f"<td><pre>{_e(by_model.get(m, ''))}</pre></td>" for m in present) + "</tr>")
        h.append("</table>")
    h.append("<h2>Training stages</h2>")
    if data["stages"]:
        for st, kv in data["stages"].items():
            items = list(kv.items())[:MAX_STAGE_KEYS]
            h.append(f"<details><summary><b>{_e(st)}</b></summary><table>"
                     + "".join(f"<tr><td>{_e(k)}</td><td>{_e(_num(v) if isinstance(v, (int, float)) else v)}</td></tr>"
                               for k, v in items) + "</table></details>")
    else:
        h.append('<p class="note">No stage metrics yet.</p>')
    if data["notes"]:
        h.append("<h2>Not available</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in data["notes"]) + "</ul>")
    h.append("</body></html>")
    return "\n".join(x for x in h if x) + "\n"


def find_urls(text: str) -> Sequence[str]:
    """Every http(s) URL in `text` (the offline check of tests and the report stage)."""
    return re.findall(r"(?i)https?://\S*", text)
