"""Stage `report`: the stage-by-stage comparison as markdown and as an offline HTML page.

    python -m stages.report [--params params.yaml]

Reads the `common` and `report` sections of params.yaml and whatever exists of

    metrics/eval/<model>.json, <model>_samples.json   the eval stage's metrics and samples
    metrics/<stage>.json                               tokenizer, pretrain, clean_sft, sft, reward,
                                                       pairs, dpo, ppo, grpo
    metrics/plots/*.tsv                                per-step training curves (llm/monitor.py)

A missing file is listed under "Not available" in the report, never invented. Writes

    metrics/report.md            the table (value [95% interval], delta vs parent), curves, samples
    metrics/report.html          the same, one self-contained file: no scripts, no network, images
                                 as base64 data URIs; the stage fails if an http(s) URL slipped in
    metrics/report_curves.png    training curves (pretrain/SFT loss, RM accuracy, PPO/GRPO reward
                                 and KL, DPO), also declared as a DVC image plot
    metrics/report_eval.png      math exact match, win rate and KL per model with 95% intervals

`report.max_samples` caps the prompts shown per sample table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llm.config import ConfigError, ReportConfig, load_sections
from llm.fileio import atomic_write_bytes, atomic_write_text

STAGE = "report"
METRICS = Path("metrics")


def run(cfg: ReportConfig, metrics_dir: Path = METRICS) -> dict:
    """Write the report files under metrics_dir; returns what was collected."""
    from llm.report import (collect, curves_png, eval_png, find_urls, placeholder_png, render_html,
                            render_markdown)

    data = collect(metrics_dir, max_samples=cfg.max_samples)
    curves, _ = curves_png(data["curves"])
    evals = eval_png(data["evals"])
    images = {"curves": curves or placeholder_png("no training curves yet (metrics/plots/*.tsv)"),
              "eval": evals or placeholder_png("no eval metrics yet (metrics/eval/<model>.json)")}
    page = render_html(data, images)
    urls = find_urls(page)
    if urls:  # an internal error: render_html defangs every text it writes
        raise ValueError(f"report: the HTML page would hold URLs {urls[:3]}; it must work offline")
    atomic_write_bytes(metrics_dir / "report_curves.png", images["curves"])
    atomic_write_bytes(metrics_dir / "report_eval.png", images["eval"])
    atomic_write_text(metrics_dir / "report.md",
                      render_markdown(data, {"curves": "report_curves.png", "eval": "report_eval.png"}))
    atomic_write_text(metrics_dir / "report.html", page)
    return data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    try:
        sections = load_sections(["common", STAGE], args.params)
    except ConfigError as e:
        print(f"{STAGE}: {e}", file=sys.stderr)
        return 1
    try:
        data = run(sections[STAGE])
    except ValueError as e:
        print(f"{STAGE}: {e}", file=sys.stderr)
        return 1
    print(f"{STAGE}: {len(data['evals'])} model(s) evaluated, {len(data['stages'])} stage metrics,"
          f" {len(data['curves'])} curve files; {len(data['notes'])} missing input(s);"
          f" wrote {METRICS}/report.md and {METRICS}/report.html", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
