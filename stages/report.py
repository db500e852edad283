"""Stage `report`: the stage-by-stage comparison as markdown and as an offline HTML page.

    dvc repro report        (dvc.yaml passes the paths: `python -m stages.report --help`)

Reads the `common` and `report` sections of params.yaml and whatever exists, under the
metrics directory, of

    eval/<model>.json, <model>_samples.json   the eval stage's metrics and samples
    <stage>.json                               tokenizer, pretrain, clean_sft, sft, reward,
                                               pairs, dpo, ppo, grpo
    plots/*.tsv                                per-step training curves (llm/monitor.py)

A missing file is listed under "Not available" in the report, never invented. Writes, into
the same directory:

    report.md            the table (value [95% interval], delta vs parent), curves, samples
    report.html          the same, one self-contained file: no scripts, no network, images as
                         base64 data URIs; the stage fails if an http(s) URL slipped in
    report_curves.png    training curves (pretrain/SFT loss, RM accuracy, PPO/GRPO reward and
                         KL, DPO), also declared as a DVC image plot
    report_eval.png      math exact match, win rate and KL per model with 95% intervals
    summary.json         the headline numbers per model (llm/metrics.py headline), a DVC metric
                         that `dvc exp show` compares across experiments

`report.max_samples` caps the prompts shown per sample table.
"""
from __future__ import annotations

from pathlib import Path

from llm.config import ReportConfig
from llm.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text
from llm.metrics import headline

STAGE = "report"
INPUTS = {"metrics": "the metrics directory: every stage's metrics, eval/ and plots/ (it writes the report there)"}


def run(cfg: ReportConfig, metrics_dir: Path) -> dict:
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
    atomic_write_json(metrics_dir / "summary.json", headline(metrics_dir))
    return data


def main(argv: list[str] | None = None) -> int:
    from llm.stage import stage_main

    def work(args, common, cfg: ReportConfig, rt) -> str:
        data = run(cfg, args.metrics)
        m = args.metrics
        return (f"{STAGE}: {len(data['evals'])} model(s) evaluated, {len(data['stages'])} stage metrics,"
                f" {len(data['curves'])} curve files; {len(data['notes'])} missing input(s);"
                f" wrote {m}/report.md and {m}/report.html")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs={}, work=work)


if __name__ == "__main__":
    raise SystemExit(main())
