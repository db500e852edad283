"""The report stage: offline HTML, tolerance of missing stages, the table's deltas."""
from __future__ import annotations

import json
import re

import pytest

from llm.config import ReportConfig
from llm.report import collect, curves_png, defang, find_urls, read_tsv, render_html, render_markdown, table_rows
from stages.report import run


def _eval(em: float, lo: float, hi: float, **extra) -> dict:
    return {"math_exact_match": em, "math_exact_match_lo": lo, "math_exact_match_hi": hi, "val_bpb": 2.5,
            "rm_score": 0.1, "toxicity": "unavailable", **extra}


def _write(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)


@pytest.fixture
def metrics(tmp_path):
    m = tmp_path / "metrics"
    _write(m / "eval/base.json", _eval(0.02, 0.01, 0.05))
    _write(m / "eval/sft.json", _eval(0.40, 0.35, 0.45, win_rate_vs_sft=0.5, kl_to_sft=0.0))
    _write(m / "eval/grpo.json", _eval(0.55, 0.50, 0.60, win_rate_vs_sft=0.7, kl_to_sft=0.3))
    url_text = "see https://example.com/x and HTTP://cdn.example.org/y.js"
    for name in ("base", "sft", "grpo"):
        _write(m / f"eval/{name}_samples.json", {
            "model": name,
            "sample_prompts": [{"prompt": "What is 7 + 5?", "response": f"{name}: 12 <b>|</b>"},
                               {"prompt": "Who is Hamlet?", "response": url_text}],
            "math_samples": [{"question": "1 + 1?", "answer": "2", "response": "#### 2", "correct": True}]})
    _write(m / "pretrain.json", {"val_loss": 3.2, "val_bpb": 1.9, "nested": {"a": 1, "b": [1, 2]}, "link": url_text})
    _write(m / "plots/pretrain.tsv", "step\tloss\tlr\n1\t8.0\t0.001\n2\t7.5\t\n3\t7.0\t0.001\n")
    _write(m / "plots/pretrain_val.tsv", "step\tval_loss\n0\t8.1\n2\t7.2\n")
    _write(m / "plots/grpo.tsv", "step\treward\tkl\n1\t0.1\t0.0\n2\t0.3\t0.02\n")
    return m


def test_html_is_offline(metrics):
    run(ReportConfig(max_samples=3), metrics)
    page = (metrics / "report.html").read_text()
    assert find_urls(page) == [] and not re.search(r"(?i)https?:", page)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == 2 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "hxxps://example.com/x" in page and "HxxP://cdn.example.org" in page  # shown, defanged
    assert "&lt;b&gt;" in page  # model output is escaped, not markup


def test_report_tolerates_missing_stages(tmp_path):
    empty = tmp_path / "metrics"
    empty.mkdir()
    data = run(ReportConfig(max_samples=3), empty)
    assert data["evals"] == {} and data["stages"] == {}
    md = (empty / "report.md").read_text()
    assert "metrics/eval/ppo.json: missing" in md and "metrics/grpo.json: missing" in md
    for f in ("report.html", "report_curves.png", "report_eval.png"):
        assert (empty / f).stat().st_size > 0
    assert find_urls((empty / "report.html").read_text()) == []


def test_table_has_intervals_and_deltas_against_the_parent(metrics):
    data = collect(metrics)
    assert "ppo" not in data["evals"] and any("eval/ppo.json" in n for n in data["notes"])
    models, rows = table_rows(data["evals"])
    assert models == ["base", "sft", "grpo"]
    em = next(r for r in rows if r["key"] == "math_exact_match")["cells"]
    assert em["base"] == {"value": "2.0%", "interval": "[1.0%, 5.0%]", "delta": "", "verdict": ""}
    assert em["sft"]["delta"] == "+38.0 pp vs base" and em["sft"]["verdict"] == "better"
    assert em["grpo"]["delta"] == "+15.0 pp vs sft"  # grpo's parent is sft, not base
    bpb = next(r for r in rows if r["key"] == "val_bpb")["cells"]
    assert bpb["sft"]["delta"] == "+0 vs base" and bpb["sft"]["verdict"] == ""
    wr = next(r for r in rows if r["key"] == "win_rate_vs_sft")["cells"]
    assert wr["base"]["value"] == "n/a" and wr["grpo"]["delta"] == "+20.0 pp vs sft"
    md = render_markdown(data, {"curves": "report_curves.png"})
    assert "| math exact match (greedy) | 2.0% [1.0%, 5.0%] |" in md
    assert "12 &lt;b&gt;\\|&lt;/b&gt;" in md  # model output is not markup; a pipe does not break the table
    assert "![training curves](report_curves.png)" in md


def test_samples_side_by_side_are_capped(metrics):
    page = render_html({**collect(metrics, max_samples=1)})
    assert "What is 7 + 5?" in page and "Who is Hamlet?" not in page


def test_curves_draw_only_what_exists(metrics):
    data = collect(metrics)
    assert set(data["curves"]) == {"pretrain.tsv", "pretrain_val.tsv", "grpo.tsv"}
    png, titles = curves_png(data["curves"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == ["pretrain loss", "GRPO reward", "GRPO KL to SFT"]
    assert curves_png({}) == (None, [])


def test_read_tsv_and_defang(tmp_path):
    f = tmp_path / "x.tsv"
    f.write_text("step\ta\tb\n1\t0.5\t\n2\tnan\t3\n")
    cols = read_tsv(f)
    assert cols["step"] == [1.0, 2.0] and cols["a"][0] == 0.5 and cols["b"][1] == 3.0
    assert cols["b"][0] != cols["b"][0]  # empty cell -> NaN
    assert defang("a http://x https://y HTTPS://z") == "a hxxp://x hxxps://y HxxPS://z"
