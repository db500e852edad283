"""Stage `report`: the report card, as markdown and as an offline HTML page.

    python -m stages.report [--params params.yaml]

Reads the `common` and `report` sections of params.yaml (and its `# profile:` header line),
and whatever exists of

    metrics/eval/<model>.json, _samples.json, _items.jsonl   eval's metrics, samples, per-item outcomes
    metrics/<stage>.json                                      tokenizer, tokenize, pretrain, clean_sft,
                                                              sft, reward, pairs, dpo, ppo, grpo
    metrics/plots/*.tsv                                       per-step training curves (llm/monitor.py)

A missing file is listed under "Not available" in the report, never invented. Compares each
model with its parent on the same items (llm/paired.py: McNemar's exact test and a paired
bootstrap with `report.bootstrap_samples` resamples, intervals at `report.confidence`, seeded
from `common.seed`), and writes

    metrics/paired.json          the paired changes, {"<model>_vs_<parent>": {skill: {"delta", "lo",
                                 "hi", "p_value", "significant", ...}}}, a DVC metric: `dvc metrics
                                 diff` shows how a change of params moved them
    metrics/report.md            the report card (llm/report.py): header with profile, commit,
                                 date, machine and stage times; summary table; what each stage
                                 changed, in words; curves; samples marked right or wrong
    metrics/report.html          the same, one self-contained file: no scripts, no network, images
                                 as base64 data URIs; the stage fails if an http(s) URL slipped in
    metrics/report_curves.png    training curves, smoothed over the faint raw ones (DVC image plot)
    metrics/report_eval.png      accuracy per skill, win rate and KL to SFT (log axis) per model

`report.max_samples` caps the items shown per sample group.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llm.config import CommonConfig, ConfigError, ReportConfig, load_sections
from llm.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text

STAGE = "report"
METRICS = Path("metrics")


def run(cfg: ReportConfig, common: CommonConfig, metrics_dir: Path = METRICS,
        params: Path = Path("params.yaml")) -> tuple[dict, dict]:
    """Write the report files under metrics_dir; returns (what was collected, the paired changes)."""
    from llm.report import collect, paired_deltas, paired_metrics, provenance
    from llm.report_render import find_urls, render_html, render_markdown
    from llm.report_plots import curves_png, eval_png, placeholder_png

    data = collect(metrics_dir, max_samples=cfg.max_samples)
    paired = paired_deltas(data["items"], confidence=cfg.confidence, n_boot=cfg.bootstrap_samples, seed=common.seed)
    head = provenance(params)
    curves, _ = curves_png(data["curves"])
    evals = eval_png(data["evals"])
    images = {"curves": curves or placeholder_png("no training curves yet (metrics/plots/*.tsv)"),
              "eval": evals or placeholder_png("no eval metrics yet (metrics/eval/<model>.json)")}
    page = render_html(data, paired, head, images)
    urls = find_urls(page)
    if urls:  # an internal error: render_html defangs every text it writes
        raise ValueError(f"report: the HTML page would hold URLs {urls[:3]}; it must work offline")
    atomic_write_json(metrics_dir / "paired.json", paired_metrics(paired))
    atomic_write_bytes(metrics_dir / "report_curves.png", images["curves"])
    atomic_write_bytes(metrics_dir / "report_eval.png", images["eval"])
    atomic_write_text(metrics_dir / "report.md",
                      render_markdown(data, paired, head, {"curves": "report_curves.png", "eval": "report_eval.png"}))
    atomic_write_text(metrics_dir / "report.html", page)
    return data, paired


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
        data, paired = run(sections[STAGE], sections["common"], params=Path(args.params))
    except ValueError as e:
        print(f"{STAGE}: {e}", file=sys.stderr)
        return 1
    print(f"{STAGE}: {len(data['evals'])} model(s) evaluated, {len(paired)} paired against their parent,"
          f" {len(data['stages'])} stage metrics, {len(data['curves'])} curve files; {len(data['notes'])} missing"
          f" input(s); wrote {METRICS}/report.md, {METRICS}/report.html and {METRICS}/paired.json", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
