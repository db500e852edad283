"""Stage `report`: the report card, as markdown and as an offline HTML page.

    dvc repro report        (dvc.yaml passes the paths: `python -m stages.report --help`)

Reads the `common` and `report` sections of params.yaml (and its `# profile:` header line),
and whatever exists, under the metrics directory, of

    eval/<model>.json, _samples.json, _items.jsonl   eval's metrics, samples, per-item outcomes
    <stage>.json                                      tokenizer, tokenize, pretrain, clean_sft, sft,
                                                      reward, pairs, dpo, ppo, ppo_rm,
                                                      grpo, grpo_random
    plots/*.tsv                                       per-step training curves (llm/train/monitor.py)

A missing file is listed under "Not available" in the report, never invented. Compares each
model with its parent on the same items (llm/eval/paired.py: McNemar's exact test and a paired
bootstrap with `report.bootstrap_samples` resamples, intervals at `report.confidence`, seeded
from `common.seed`), and writes, into the same directory:

    paired.json          the paired changes, {"<model>_vs_<parent>": {skill: {"delta", "lo", "hi",
                         "p_value", "significant", ...}}}, a DVC metric: `dvc metrics diff` shows
                         how a change of params moved them
    report.md            the report card (llm/eval/report.py): header with profile, commit, date,
                         machine and stage times; summary table; what each stage changed, in
                         words; curves; samples marked right or wrong
    report.html          the same, one self-contained file: no scripts, no network, images as
                         base64 data URIs; the stage fails if an http(s) URL slipped in
    report_curves.png    training curves, smoothed over the faint raw ones (DVC image plot)
    report_eval.png      accuracy per skill, win rate and KL to SFT (log axis) per model
    report_tiers.png     pass@k against k per difficulty tier, a line per model (a placeholder without tiers)
    report_rankers.png   best-of-n against n per math ranker, beside pass@n (from plots/rankers.tsv)
    report_overopt.png   over-optimisation: ppo_rm's RM score (proxy) and verifier accuracy (gold)
                         per step against sqrt(KL to SFT), from plots/ppo_rm.tsv
    summary.json         the headline numbers per model (llm/train/metrics.py headline), a DVC metric
                         that `dvc exp show` compares across experiments

`report.max_samples` caps the items shown per sample group.
"""
from __future__ import annotations

from pathlib import Path

from llm.config import CommonConfig, ReportConfig
from llm.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text
from llm.train.metrics import headline

STAGE = "report"
INPUTS = {"metrics": "the metrics directory: every stage's metrics, eval/ and plots/ (it writes the report there)"}


def run(cfg: ReportConfig, common: CommonConfig, metrics_dir: Path,
        params: Path = Path("params.yaml")) -> tuple[dict, dict]:
    """Write the report files under metrics_dir; returns (what was collected, the paired changes)."""
    from llm.eval.report import collect, overopt_curve, paired_deltas, paired_metrics, preference_curves, provenance
    from llm.eval.report_plots import (curves_png, eval_png, overopt_png, placeholder_png, preference_png, rankers_png,
                                       tiers_png)
    from llm.eval.report_render import find_urls, render_html, render_markdown

    data = collect(metrics_dir, max_samples=cfg.max_samples)
    paired = paired_deltas(data["items"], confidence=cfg.confidence, n_boot=cfg.bootstrap_samples, seed=common.seed)
    head = provenance(params)
    curves, _ = curves_png(data["curves"])
    evals = eval_png(data["evals"])
    overopt = overopt_png(overopt_curve(data["curves"]))
    tiers = tiers_png(data["samples"])
    rankers = rankers_png(data["curves"].get("rankers.tsv"))
    preference = preference_png(preference_curves(data["curves"]))
    images = {"curves": curves or placeholder_png("no training curves yet (metrics/plots/*.tsv)"),
              "eval": evals or placeholder_png("no eval metrics yet (metrics/eval/<model>.json)"),
              "overopt": overopt or placeholder_png("no per-step history of ppo_rm yet (metrics/plots/ppo_rm.tsv)"),
              "tiers": tiers or placeholder_png("no difficulty tiers evaluated (eval.tier_pass_k_problems: 0)"),
              "rankers": rankers or placeholder_png("no math rankers measured yet (metrics/plots/rankers.tsv)"),
              "preference": preference or placeholder_png("no continuations measured (eval.continuation_items,"
                                                          " ppo.continuation_eval, rankers.continuation_passages: 0)")}
    page = render_html(data, paired, head, images)
    urls = find_urls(page)
    if urls:  # an internal error: render_html defangs every text it writes
        raise ValueError(f"report: the HTML page would hold URLs {urls[:3]}; it must work offline")
    atomic_write_json(metrics_dir / "paired.json", paired_metrics(paired))
    atomic_write_bytes(metrics_dir / "report_curves.png", images["curves"])
    atomic_write_bytes(metrics_dir / "report_eval.png", images["eval"])
    atomic_write_bytes(metrics_dir / "report_overopt.png", images["overopt"])
    atomic_write_bytes(metrics_dir / "report_tiers.png", images["tiers"])
    atomic_write_bytes(metrics_dir / "report_rankers.png", images["rankers"])
    atomic_write_bytes(metrics_dir / "report_preference.png", images["preference"])
    atomic_write_text(metrics_dir / "report.md",
                      render_markdown(data, paired, head, {"curves": "report_curves.png", "eval": "report_eval.png",
                                                           "overopt": "report_overopt.png",
                                                           "tiers": "report_tiers.png" if tiers else None,
                                                           "rankers": "report_rankers.png" if rankers else None,
                                                           "preference": "report_preference.png" if preference
                                                           else None}))
    atomic_write_text(metrics_dir / "report.html", page)
    atomic_write_json(metrics_dir / "summary.json", headline(metrics_dir))
    return data, paired


def main(argv: list[str] | None = None) -> int:
    from llm.stage import stage_main

    def work(args, common: CommonConfig, cfg: ReportConfig, rt) -> str:
        data, paired = run(cfg, common, args.metrics, params=args.params)
        m = args.metrics
        return (f"{STAGE}: {len(data['evals'])} model(s) evaluated, {len(paired)} paired against their parent,"
                f" {len(data['stages'])} stage metrics, {len(data['curves'])} curve files; {len(data['notes'])}"
                f" missing input(s); wrote {m}/report.md, {m}/report.html and {m}/paired.json")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs={}, work=work)


if __name__ == "__main__":
    raise SystemExit(main())
