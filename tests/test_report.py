"""The report card: offline HTML, provenance header, summary table with paired changes, the
sentences per stage, samples marked right or wrong, plots; checked in headless Chromium too, where
nothing may run off a page 1280 px wide."""
from __future__ import annotations

import datetime
import html
import html.parser
import json
import math
import re
import shutil
import subprocess

import pytest

from llm.config import CommonConfig, ReportConfig
from llm.eval.report import (all_metric_rows, collect, fmt_value, paired_deltas, provenance, read_tsv, recorded_seconds,
                             stage_headline_rows, stage_summary, stage_times, summary_rows)
from llm.eval.report_plots import _kl_panel, _plt, curves_figure, curves_png, eval_figure, overopt_figure, rankers_figure, \
    tiers_figure
from llm.eval.report_render import defang, find_urls, header_lines, render_html, render_markdown
from stages.report import run

CFG = ReportConfig(max_samples=3, confidence=0.95, bootstrap_samples=2000)
COMMON = CommonConfig(seed=1, device="cpu", dtype="auto", nproc=1, num_threads=1, cpu_kernels=True)
URLS = "see https://example.com/x and HTTP://cdn.example.org/y.js"
N = 120  # math items per model


def _eval(em: float, **extra) -> dict:
    return {"math_exact_match": em, "math_exact_match_lo": em - 0.04, "math_exact_match_hi": em + 0.04,
            "math_exact_match_en": em, "task_exact_match": 0.5, "val_bpb": 2.5, "rm_score": 0.1,
            "toxicity": "unavailable", **extra}


def _items(right: int, tasks_right: int) -> list[dict]:
    """N math items, the first `right` correct; 40 tasks, the first `tasks_right` correct."""
    out = [{"set": "math", "id": f"m{i}", "level": 1 + i % 4, "lang": "en" if i % 3 else "zh", "correct": i < right,
            "formatted": True} for i in range(N)]
    out += [{"set": "task", "id": f"t{i}", "kind": "reverse" if i % 2 else "sort", "correct": i < tasks_right}
            for i in range(40)]
    return out


def _write(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(obj, list):
        path.write_text("".join(json.dumps(r) + "\n" for r in obj))
    else:
        path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)


@pytest.fixture
def metrics(tmp_path):
    m = tmp_path / "metrics"
    _write(m / "eval/base.json", _eval(0.02, kl=2.77, kl_lo=2.6, kl_hi=2.9, kl_seq=277.0))
    _write(m / "eval/sft.json", _eval(0.40, win_rate_vs_sft=0.5, kl=0.0, kl_seq=0.0))
    _write(m / "eval/grpo.json", _eval(0.42, win_rate_vs_sft=0.55, kl=-0.000238, kl_seq=-0.0119))
    # sft gains 48 items over base; grpo and sft answer the same math, grpo loses 20 tasks
    for name, (right, tasks) in {"base": (2, 0), "sft": (50, 30), "grpo": (50, 10)}.items():
        _write(m / f"eval/{name}_items.jsonl", _items(right, tasks))
        _write(m / f"eval/{name}_samples.json", {
            "model": name, "timing_s": {"math": 1.0, "total": 12.5},
            "sample_prompts": [{"prompt": "What is 7 + 5?", "response": f"{name}: 12 <b>|</b>"},
                               {"prompt": "Who is Hamlet?", "response": URLS if name != "grpo" else " "}],
            "item_samples": [{"set": "math", "group": "en", "prompt": "1 + 1?", "answer": "2",
                              "response": "#### 2" if name != "base" else "#### 3", "correct": name != "base"},
                             {"set": "task", "group": "reverse", "prompt": "Reverse the word: castle",
                              "answer": "eltsac", "response": "niw", "correct": False},
                             {"set": "scope", "group": "en", "prompt": "Write a poem.", "answer": "I can add.",
                              "response": "I can add." if name != "base" else "To be, or", "correct": True}]})
    _write(m / "pretrain.json", {"val_loss": 3.2, "val_bpb": 1.9, "train_time_s": 100.0, "device": "cpu",
                                 "dtype": "float32", "world_size": 1, "link": URLS,
                                 "tokenizer_sha256": "be50142a6a51f667f7dc1589456db729e9d8f64f06bb6b4"})
    _write(m / "clean_sft.json", {"seconds": {"total": 14.0, "near_dedupe": 9.0}, "train": {"kept": 900}})
    _write(m / "dpo.json", {"train_time_s": 95.0, "stage_time_s": 131.0, "rewards_accuracy": 0.83})
    _write(m / "plots/pretrain.tsv", "step\tloss\tlr\n" + "".join(f"{i}\t{8 - i / 10}\t0.001\n" for i in range(40)))
    _write(m / "plots/pretrain_val.tsv", "step\tval_loss\n0\t8.1\n20\t7.2\n")
    _write(m / "plots/grpo.tsv", "step\treward\tkl\n1\t0.1\t0.0\n2\t0.3\t0.02\n")
    _write(m / "plots/grpo_val.tsv", "step\tmath_exact_match\treward\n0\t0.6\t0.7\n2\t0.62\t0.75\n")
    (tmp_path / "params.yaml").write_text("# profile: cpu (the default)\ncommon:\n  seed: 1\n")
    return m


def _run(metrics):
    return run(CFG, COMMON, metrics, params=metrics.parent / "params.yaml")


def test_html_is_offline(metrics):
    _run(metrics)
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
    data, paired = run(CFG, COMMON, empty, params=tmp_path / "params.yaml")
    assert data["evals"] == {} and data["stages"] == {} and paired == {}
    md = (empty / "report.md").read_text()
    assert "metrics/eval/ppo.json: missing" in md and "metrics/grpo.json: missing" in md
    assert "profile**: unknown" in md
    for f in ("report.html", "report_curves.png", "report_eval.png", "paired.json"):
        assert (empty / f).stat().st_size > 0
    assert find_urls((empty / "report.html").read_text()) == []


def test_summary_has_one_row_per_model_with_paired_changes(metrics):
    data = collect(metrics)
    paired = paired_deltas(data["items"], confidence=0.95, n_boot=2000, seed=0)
    assert set(paired) == {"sft", "grpo"} and paired["grpo"]["parent"] == "sft"  # grpo's parent is sft, not base
    cols, rows = summary_rows(data["evals"], paired)
    assert [r["model"] for r in rows] == ["base", "sft", "grpo"]
    assert [k for k, _ in cols][:2] == ["math_exact_match", "math_exact_match_en"]
    sft, grpo = rows[1]["cells"], rows[2]["cells"]
    assert rows[0]["cells"]["math_exact_match"]["change"] == ""  # base has no parent
    assert sft["math_exact_match"]["verdict"] == "up" and sft["math_exact_match"]["change"].startswith("+40.0 [")
    assert grpo["math_exact_match"]["verdict"] == "flat" and grpo["math_exact_match"]["change"].startswith("+0.0 [")
    assert grpo["task_exact_match"]["verdict"] == "down"
    assert grpo["kl"]["value"].endswith("†") and sft["kl"]["interval"] == "(itself)"


def test_the_kl_column_is_the_eval_metrics_per_token_kl(metrics):
    """One KL unit everywhere: the summary table's and the all-metrics table's KL is eval's `kl`
    (nats/token, as in PPO's, GRPO's and DPO's metrics), never the per-response `kl_seq`."""
    evals = json.loads((metrics / "eval/base.json").read_text())
    _run(metrics)
    lines = (metrics / "report.md").read_text().splitlines()
    header = next(ln for ln in lines if ln.startswith("| model |"))
    col = [c.strip() for c in header.split("|")].index("KL to SFT, nats/token")
    base = next(ln for ln in lines if ln.startswith("| **base** |"))
    assert [c.strip() for c in base.split("|")][col].split()[0] == fmt_value(evals["kl"], "num") == "2.770"
    row = next(ln for ln in lines if ln.startswith("| KL to SFT, nats/token |"))
    assert row.split("|")[2].split()[0] == fmt_value(evals["kl"], "num")
    assert "nats/response" not in header and "nats per response" not in "\n".join(lines)


def test_each_stage_is_described_in_words(metrics):
    data = collect(metrics)
    paired = paired_deltas(data["items"], confidence=0.95, n_boot=2000, seed=0)
    s, lines = stage_summary("sft", paired, data["evals"])
    assert s == ("SFT against base: significantly better at math, English math, Chinese math and instruction tasks;"
                 " no significant change in #### N answer format.")
    assert lines[0].startswith("▲ math: 1.7% → 41.7%, +40.0 pp [") and lines[0].endswith("McNemar p < 0.001")
    g, glines = stage_summary("grpo", paired, data["evals"])
    assert g == ("GRPO against SFT: significantly worse at instruction tasks; no significant change in math,"
                 " English math, Chinese math and #### N answer format.")
    assert glines[0].startswith("▼ instruction tasks: 75.0% → 25.0%, -50.0 pp [")
    assert "significant within those: task: sort ▼ -50.0 pp and task: reverse ▼ -50.0 pp" in glines
    assert glines[-1].startswith("KL to SFT: -0.000238 nats/token (an estimate below zero")
    page = render_html(data, paired, {"profile": "cpu"})
    assert html.escape(g) in page and f"<li>{html.escape(glines[-1])}</li>" in page
    assert '<li><span class="down">▼</span> instruction tasks: 75.0% → 25.0%' in page  # the mark coloured


def test_header_has_provenance_and_stage_times(metrics, tmp_path):
    data = collect(metrics)
    head = provenance(metrics.parent / "params.yaml", now=datetime.datetime(2026, 1, 2, 3, 4))
    assert head["profile"] == "cpu" and head["profile_description"] == "the default"
    assert head["date"] == "2026-01-02 03:04 UTC" and "logical cores" in head["hardware"]
    warning, lines = header_lines(head, data)
    assert warning is None
    d = dict(lines)
    assert d["profile"] == "cpu: the default" and d["commit"].startswith("unknown")  # tmp_path is no checkout
    assert d["training device"].startswith("cpu, float32, 1 process")
    times = {s: t for s, t, _ in stage_times(data)}
    assert times["pretrain"] == 100.0 and times["clean_sft"] == 14.0 and times["dpo"] == 131.0
    assert times["eval@sft"] == 12.5 and times["prepare"] is None
    assert d["wall time"].startswith(f"{(100 + 14 + 131 + 3 * 12.5) / 60:.1f} min in all")
    smoke, _ = header_lines({**head, "profile": "smoke"}, data)
    assert "plumbing, not learning" in smoke


def test_commit_and_uncommitted_changes_come_from_git(tmp_path):
    if not shutil.which("git"):
        pytest.skip("git is not installed")
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "params.yaml").write_text("# profile: smoke (tiny)\n")
    (tmp_path / "dvc.lock").write_text("a\n")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    head = provenance(tmp_path / "params.yaml")
    assert re.fullmatch(r"[0-9a-f]{12}", head["commit"]) and head["changed"] == []
    (tmp_path / "params.yaml").write_text("# profile: smoke (tiny)\nx: 1\n")
    (tmp_path / "dvc.lock").write_text("b\n")  # what dvc repro itself changes is not a difference of the code
    assert provenance(tmp_path / "params.yaml")["changed"] == ["params.yaml"]


@pytest.mark.parametrize("metrics_keys,expected", [
    ({"stage_time_s": 5.0, "train_time_s": 4.0}, (5.0, "stage_time_s")),
    ({"train_time_s": 4.0, "eval_time_s": 1.5}, (5.5, "train_time_s + eval_time_s")),
    ({"seconds": {"total": 3.0}}, (3.0, "seconds.total")),
    ({"seconds": 2.0}, (2.0, "seconds")),
    ({"timing_s": {"total": 7.0}}, (7.0, "timing_s.total")),
    ({"val_loss": 1.0}, None),
])
def test_recorded_seconds(metrics_keys, expected):
    assert recorded_seconds(metrics_keys) == expected


def test_the_report_says_in_a_line_what_each_model_is_and_what_the_kl_curves_estimate(metrics):
    from llm.eval.report import CURVES_NOTE, MODEL_LINES
    _run(metrics)
    page, md = (metrics / "report.html").read_text(), (metrics / "report.md").read_text()
    assert [n for n, _ in MODEL_LINES] == ["base", "sft", "reward model", "ppo", "ppo_rm", "grpo", "grpo_random", "dpo"]
    for name, line in MODEL_LINES:
        assert f"- **{name}**: {line}." in md and f"<li><b>{name}</b>: " in page
    assert CURVES_NOTE in md and "k1" in CURVES_NOTE and "k3" in CURVES_NOTE


def test_a_request_outside_the_skills_is_right_only_with_the_taught_statement():
    """The eval's "correct" for such a request means only "no worked sum": the base model's text
    continuation has none, and must not get the tick the taught statement gets."""
    from llm.eval.report import item_sample_groups
    statement = "I can solve arithmetic word problems."
    said = {"base": ("and I'll be\nTo have been a man", True), "sft": (statement, True),
            "ppo": ("12 + 7 = 19\n#### 19", False), "grpo": ("I can solve word problems.", True)}
    samples = {m: {"item_samples": [{"set": "scope", "group": "en", "prompt": "Write a poem.", "answer": statement,
                                     "response": r, "correct": ok}]} for m, (r, ok) in said.items()}
    [(title, [rec])] = item_sample_groups(samples, 3)
    assert {m: mark for m, (_, mark) in rec["by_model"].items()} == {"base": None, "sft": True, "ppo": False,
                                                                     "grpo": None}


def test_the_samples_shown_are_those_where_the_trained_models_differ_first():
    from llm.eval.report import item_sample_groups
    same = [("1 + 1?", "2", "#### 2"), ("2 + 2?", "4", "#### 4")]
    samples = {}
    for m in ("base", "sft", "grpo", "dpo"):
        items = [{"set": "arithmetic", "prompt": p, "answer": a, "response": r, "correct": True} for p, a, r in same]
        # the third item: sft and dpo right, grpo wrong; the fourth: all right, in different words
        items.append({"set": "arithmetic", "prompt": "3 + 4?", "answer": "7", "response": "#### 8" if m == "grpo"
                      else "#### 7", "correct": m != "grpo"})
        items.append({"set": "arithmetic", "prompt": "5 + 5?", "answer": "10", "response": f"{m}: #### 10",
                      "correct": True})
        samples[m] = {"item_samples": items}
    [(_, recs)] = item_sample_groups(samples, 3)
    assert [r["prompt"] for r in recs] == ["3 + 4?", "5 + 5?", "1 + 1?"]


def test_samples_are_marked_right_or_wrong_and_dumps_stay_out(metrics):
    _run(metrics)
    page = (metrics / "report.html").read_text()
    md = (metrics / "report.md").read_text()
    row = re.search(r"<tr><td><pre>1 \+ 1\?</pre>.*?</tr>", page).group(0)
    assert row.count('class="ok">✓') == 2 and row.count('class="bad">✗') == 1  # sft, grpo right; base wrong
    assert "| 1 + 1?<br>(answer: 2) | ✗ #### 3 | ✓ #### 2 | ✓ #### 2 |" in md
    assert "[reverse] Reverse the word: castle" in md
    # the base model's continuation has no worked sum, but it is not the taught statement: no tick
    assert "| Write a poem.<br>(answer: I can add.) | – To be, or | ✓ I can add. | ✓ I can add. |" in md
    # wide tables scroll inside their box rather than run off the page
    assert page.count('<div class="wide"><table class="samples">') == page.count('<table class="samples">') == 4
    assert '<div class="wide"><table id="all">' in page
    row = re.search(r"<tr><td><pre>Write a poem\.</pre>.*?</tr>", page).group(0)
    assert row.count('class="ok">✓') == 2 and row.count('class="mid">–') == 1
    assert page.count('<pre><span class="note">(empty)</span></pre>') == 1  # grpo's blank answer is shown as one
    assert "be50142a" not in page and "be50142a" not in md  # hashes stay in the metrics files
    assert "val_loss 3.2" not in md
    paired = json.loads((metrics / "paired.json").read_text())
    assert set(paired) == {"sft_vs_base", "grpo_vs_sft"}
    math = paired["sft_vs_base"]["math"]
    assert math["wins"] == 48 and math["p_value"] < 1e-9 and math["significant"] is True
    assert all(isinstance(v, (int, float)) for v in math.values())  # numbers and booleans only


def test_markdown_has_the_same_summary(metrics):
    data, paired = _run(metrics)
    md = render_markdown(data, paired, {"profile": "smoke"}, {"curves": "report_curves.png"})
    assert md.startswith("# Report card\n\n> **Smoke profile")
    assert "| **grpo**<br>vs sft | 42.0% [38.0, 46.0]<br>· +0.0 [0.0, 0.0] |" in md
    assert "![training curves](report_curves.png)" in md
    assert "| sft: 12 &lt;b>\\|&lt;/b> |" in md  # model output opens no tag and breaks no table
    assert "McNemar p < 0.001" in md  # our own text stays legible


def test_curves_are_smoothed_and_panels_keep_one_unit(metrics):
    data = collect(metrics)
    assert set(data["curves"]) == {"pretrain.tsv", "pretrain_val.tsv", "grpo.tsv", "grpo_val.tsv"}
    png, titles = curves_png(data["curves"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # reward and accuracy are separate panels
    assert titles == ["pretraining loss", "GRPO reward", "held-out math accuracy during RL", "KL to SFT during RL"]
    assert curves_png({}) == (None, [])


def test_a_curve_that_never_moved_says_its_value():
    """A held-out accuracy of 0.85 at every evaluation: its legend gives the value, which the
    padded axis matplotlib draws around it need not tick."""
    curves = {"ppo_val.tsv": {"step": [0.0, 3.0, 6.0], "math_exact_match": [0.85] * 3},
              "grpo_val.tsv": {"step": [0.0, 3.0, 6.0], "math_exact_match": [0.8, 0.85, 0.9]}}
    fig, _ = curves_figure(curves)
    labels = [line.get_label() for line in fig.axes[0].lines]
    _plt().close(fig)
    assert labels == ["PPO: 0.85 throughout", "GRPO"]


def test_a_held_out_rate_logged_with_its_interval_is_drawn_with_it_and_a_negative_kl_beside_zero():
    curves = {"grpo_val.tsv": {"step": [0.0, 3.0, 6.0], "math_exact_match": [0.85, 0.86, 0.87],
                               "math_exact_match_lo": [0.80, 0.81, 0.82], "math_exact_match_hi": [0.89, 0.9, 0.91]},
              "ppo.tsv": {"step": [1.0, 2.0, 3.0], "kl": [0.001, -0.002, 0.003]}}
    fig, titles = curves_figure(curves)
    acc, kl = fig.axes[0], fig.axes[1]
    [band] = acc.collections
    (x0, y0), (x1, y1) = band.get_paths()[0].vertices.min(axis=0), band.get_paths()[0].vertices.max(axis=0)
    labels = [line.get_label() for line in kl.lines]
    _plt().close(fig)
    assert titles == ["held-out math accuracy during RL", "KL to SFT during RL"]
    assert (x0, x1) == (0.0, 6.0) and y0 == pytest.approx(0.80) and y1 == pytest.approx(0.91)
    assert "(shaded: interval)" in [line.get_label() for line in acc.lines][0]
    assert labels[-1].startswith("0 (KL is never below; a k1 estimate can be)")


def test_long_curves_are_drawn_faint_under_their_moving_average(metrics):
    from llm.train.monitor import smooth
    fig, titles = curves_figure(collect(metrics)["curves"])
    raw, mean, val = fig.axes[0].lines  # pretraining loss: 40 train steps, 2 held-out points
    _plt().close(fig)
    ys = [8 - i / 10 for i in range(40)]
    assert list(raw.get_ydata()) == pytest.approx(ys) and raw.get_alpha() == 0.25
    assert list(mean.get_ydata()) == pytest.approx(smooth(ys, 2)) and mean.get_label() == "train (mean of 2)"
    assert len(val.get_ydata()) == 2 and val.get_marker() == "o"  # short series: points, not smoothed


def test_kl_is_drawn_on_a_log_axis_with_zero_and_negative_written_out():
    plt = _plt()
    fig, ax = plt.subplots()
    evals = {"base": {"kl": 2.77}, "sft": {"kl": 0.0}, "ppo": {"kl": 0.05}, "grpo": {"kl": -0.0002}}
    _kl_panel(ax, list(evals), evals)
    texts = [t.get_text() for t in ax.texts]
    plt.close(fig)
    assert ax.get_yscale() == "log"
    assert "0\n(itself)" in texts and any(t.startswith("-0.0002") and "noise" in t for t in texts)


def test_read_tsv_and_defang(tmp_path):
    f = tmp_path / "x.tsv"
    f.write_text("step\ta\tb\n1\t0.5\t\n2\tnan\t3\n")
    cols = read_tsv(f)
    assert cols["step"] == [1.0, 2.0] and cols["a"][0] == 0.5 and cols["b"][1] == 3.0
    assert cols["b"][0] != cols["b"][0]  # empty cell -> NaN
    assert defang("a http://x https://y HTTPS://z") == "a hxxp://x hxxps://y HxxPS://z"


# ---------------------------------------------------------------------------
# The page in a real browser

def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


# Added to a copy of the page only: the report itself holds no script. At load (every image
# has loaded or failed by then), each image is drawn on a canvas and records its size and the
# share of its pixels that are not blank (a truncated PNG still reports its size, but draws
# next to nothing); the body records that the probe ran. All synchronous: nothing is left
# pending when Chromium dumps the DOM.
_PROBE = """<script>
window.addEventListener("load", () => {
  for (const img of document.images) {
    try {
      if (!img.complete || img.naturalWidth === 0) throw new Error("not decoded");
      const c = document.createElement("canvas");
      c.width = img.naturalWidth; c.height = img.naturalHeight;
      const g = c.getContext("2d");
      g.drawImage(img, 0, 0);
      const px = g.getImageData(0, 0, c.width, c.height).data;
      let ink = 0;
      for (let k = 0; k < px.length; k += 4)
        if (px[k + 3] > 0 && (px[k] < 250 || px[k + 1] < 250 || px[k + 2] < 250)) ink++;
      img.setAttribute("data-decoded", img.naturalWidth + "x" + img.naturalHeight);
      img.setAttribute("data-ink", (ink / (px.length / 4)).toFixed(4));
    } catch (e) { img.setAttribute("data-decoded", "no"); }
  }
  document.body.setAttribute("data-probe", "done");
});
</script>"""


class _Dom(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _chromium_cmd(browser: str, page, *flags: str) -> list[str]:
    """Headless Chromium on `page` with networking off: in an empty network namespace where
    `unshare` allows it, and with every host unresolvable and a dead proxy."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=10000",
           "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", *flags, page.as_uri()]
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        cmd = ["unshare", "-rn", *cmd]
    return cmd


def _dump_dom(browser: str, page, *flags: str) -> _Dom:
    """The DOM after load (`flags`: more Chromium switches, e.g. the window size)."""
    r = subprocess.run(_chromium_cmd(browser, page, "--dump-dom", *flags), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = _Dom()
    dom.feed(r.stdout)
    return dom


def _probed_report(metrics, tmp_path, probe: str):
    """(Chromium, a copy of the fixture's report with `probe` run at its end); skipped without Chromium."""
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
    _run(metrics)
    page = tmp_path / "probed.html"
    page.write_text((metrics / "report.html").read_text().replace("</body>", probe + "</body>"))
    return browser, page


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium(metrics, tmp_path):
    browser, page = _probed_report(metrics, tmp_path, _PROBE)
    dom = _dump_dom(browser, page)
    assert any(t == "body" and a.get("data-probe") == "done" for t, a in dom.tags), "the page did not finish loading"
    rows = [a for t, a in dom.tags if t == "tr" and a.get("class") == "model"]
    assert len(rows) == 3  # base, sft, grpo
    imgs = [a for t, a in dom.tags if t == "img"]
    assert len(imgs) == 2 and all(re.fullmatch(r"\d+x\d+", a.get("data-decoded", "")) for a in imgs), imgs
    assert all(float(a["data-ink"]) > 0.01 for a in imgs), imgs  # each plot draws something
    assert not any(t == "p" and a.get("id") == "plumbing" for t, a in dom.tags)  # a cpu run: no smoke warning


def test_a_stage_says_whether_the_rm_score_follows_correctness(metrics):
    ev = json.loads((metrics / "eval/grpo.json").read_text())
    ev |= {"rm_auc": 0.469, "rm_auc_lo": 0.372, "rm_auc_hi": 0.569, "rm_score_right": -0.0145,
           "rm_score_wrong": 0.0022, "rm_auc_right": 167, "rm_auc_wrong": 33}
    _write(metrics / "eval/grpo.json", ev)
    data = collect(metrics)
    paired = paired_deltas(data["items"], confidence=0.95, n_boot=2000, seed=0)
    _, lines = stage_summary("grpo", paired, data["evals"])
    assert ("the reward model ranks GRPO's right math answers above its wrong ones with AUC 0.469 [0.372, 0.569]"
            " (0.5: its score says nothing about correctness; mean score -0.015 right, 0.002 wrong)") in lines
    assert not any("AUC" in x for x in stage_summary("sft", paired, data["evals"])[1])  # sft's eval has none
    _, rows = all_metric_rows(data["evals"])
    auc = [r for r in rows if r["label"] == "RM ranks its right math answers above its wrong ones (AUC)"]
    assert auc and auc[0]["cells"]["grpo"] == "0.469 [0.372, 0.569]" and auc[0]["cells"]["sft"] == "n/a"


def test_the_rates_of_questions_asked_in_a_context_are_rows_of_the_full_table():
    ev = {"sft": {"context_math_alone": 0.9, "context_math_after_scope": 0.3, "context_math_after_scope_lo": 0.2,
                  "context_math_after_scope_hi": 0.4}, "grpo": {"context_math_alone": 0.8}}
    rows = {r["label"]: r["cells"] for r in all_metric_rows(ev)[1]}
    assert rows["math after an out-of-scope request"] == {"sft": "30.0% [20.0, 40.0]", "grpo": "n/a"}
    assert rows["math asked alone (the items asked again below)"]["grpo"] == "80.0%"
    assert not any("under" in label for label in rows)  # rows no model has are dropped


def test_stage_headlines_carry_their_intervals():
    rows = stage_headline_rows({"ppo": {"reward_start": 0.9, "reward_end": 0.91, "reward_trend": 0.0061,
                                        "reward_trend_lo": -0.0659, "reward_trend_hi": 0.0781,
                                        "heldout_reward_delta": 0.0331, "heldout_reward_delta_lo": 0.0012,
                                        "heldout_reward_delta_hi": 0.0702},
                                "reward": {"accuracy": 0.98}})
    assert ("ppo", "rollout reward, change of the line fitted to every step", "0.006 [-0.066, 0.078]") in rows
    assert ("ppo", "held-out reward, change on the same problems and draws", "0.033 [0.001, 0.070]") in rows
    assert ("ppo", "rollout reward, first steps", "0.900") in rows  # no interval: the value alone
    assert ("reward", "held-out comparisons of SFT's own answers ranked right", "98.0%") in rows


def test_an_averaged_sft_shows_the_loss_of_its_final_weights_beside_its_own():
    rows = stage_headline_rows({"sft": {"val_loss": 0.071, "val_loss_last": 0.083}})
    assert ("sft", "held-out loss", "0.071") in rows
    assert ("sft", "held-out loss of the final weights (the model is the mean of the last checkpoints)", "0.083") in rows
    assert not [r for r in stage_headline_rows({"sft": {"val_loss": 0.071}}) if "final weights" in r[1]]


# ---------------------------------------------------------------------------
# the variants: over-optimisation (ppo_rm) and GRPO's control (grpo_random)

def _hump(n: int = 60) -> tuple[list[float], list[float], list[float]]:
    """n steps whose KL per response grows as step^2 / 100 (sqrt(KL) = step / 10): a proxy that keeps
    rising and a gold 0.3 + 0.1 x - 0.05 (x - 3)^2 beyond x = 3 (x = sqrt(KL)), which peaks at x = 4 and then falls."""
    kl = [(i / 10) ** 2 for i in range(n)]
    gold = [0.3 + 0.1 * (i / 10) - 0.05 * max(0.0, i / 10 - 3.0) ** 2 for i in range(n)]
    return kl, gold, [0.1 * i for i in range(n)]


def test_overoptimisation_finds_where_the_gold_stops_rising():
    from llm.eval.report import overoptimisation
    kl, gold, proxy = _hump()
    c = overoptimisation(list(reversed(kl)), list(reversed(gold)), list(reversed(proxy)))  # order of steps: any
    assert not c["still_rising"] and c["peak_sqrt_kl"] == pytest.approx(4.0, abs=0.3)
    assert c["sqrt_kl"] == sorted(c["sqrt_kl"]) and c["proxy_smooth"][-1] > c["proxy_smooth"][c["peak"]]
    assert c["peak_gold"] == max(c["gold_smooth"]) and c["n"] == 60


def test_overoptimisation_of_a_gold_that_never_falls_is_still_rising():
    from llm.eval.report import overopt_line, overoptimisation
    kl = [(i / 10) ** 2 for i in range(30)]
    c = overoptimisation(kl, [0.2 + 0.01 * i for i in range(30)])
    assert c["still_rising"] and c["peak"] == len(kl) - 1
    assert "still rising at the end" in overopt_line(c)


def test_a_gold_that_only_falls_never_rose_and_the_sentence_names_no_point_where_it_stops_rising():
    from llm.eval.report import overopt_line, overoptimisation
    kl = [-0.02, -0.01, 0.0] + [(i / 10) ** 2 for i in range(1, 30)]  # the estimate starts below 0: sqrt(KL) 0
    c = overoptimisation(kl, [0.9 - 0.01 * i for i in range(32)], [0.1 * i for i in range(32)])
    assert c["never_rose"] and not c["still_rising"] and c["peak_sqrt_kl"] == 0.0
    line = overopt_line(c)
    assert "stops rising" not in line and "never rises above where it starts" in line
    assert "highest at the smallest KL reached (sqrt(KL) 0)" in line
    kl, gold, proxy = _hump()
    assert not overoptimisation(kl, gold, proxy)["never_rose"]


def test_overoptimisation_reads_a_negative_kl_as_zero_and_needs_three_steps():
    from llm.eval.report import overoptimisation
    c = overoptimisation([-0.01, 0.04, 0.09, float("nan")], [0.1, 0.2, 0.3, 0.4])
    assert c["sqrt_kl"] == pytest.approx([0.0, 0.2, 0.3]) and c["n"] == 3
    assert overoptimisation([0.1, 0.2], [0.1, 0.2]) is None


def test_the_report_shows_ppo_rm_and_grpo_random_beside_ppo_and_grpo(metrics):
    _write(metrics / "eval/ppo_rm.json", _eval(0.30, win_rate_vs_sft=0.6, kl=0.2))
    _write(metrics / "eval/grpo_random.json", _eval(0.39, win_rate_vs_sft=0.5, kl=0.01))
    _write(metrics / "eval/ppo_rm_items.jsonl", _items(38, 30))
    _write(metrics / "eval/grpo_random_items.jsonl", _items(47, 30))
    _write(metrics / "eval/grpo_items.jsonl", _items(70, 10))
    for name in ("ppo_rm", "grpo_random"):
        _write(metrics / f"eval/{name}_samples.json", {"model": name, "item_samples": []})
    kl, gold, proxy = _hump()
    _write(metrics / "plots/ppo_rm.tsv", "step\treward\taccuracy\tkl\tkl_seq\n" + "".join(
        f"{i}\t{p}\t{g}\t{k / 40}\t{k}\n" for i, (k, g, p) in enumerate(zip(kl, gold, proxy))))
    data, paired = _run(metrics)
    _, rows = summary_rows(data["evals"], paired)
    assert [r["model"] for r in rows] == ["base", "sft", "ppo_rm", "grpo", "grpo_random"]
    assert {r["model"]: r["parent"] for r in rows}["grpo_random"] == "sft"
    md = (metrics / "report.md").read_text()
    assert "### GRPO on shuffled rewards (against SFT)" in md and "### PPO on the RM alone (against SFT)" in md
    # grpo +20 items of 120 against SFT, its control -3: the real reward explains +19.2 pp
    line = next(ln for ln in md.splitlines() if ln.startswith("GRPO against its control"))
    assert "+16.7 pp [" in line and "-2.5 pp [" in line and "explains +19.2 pp" in line
    assert "## Over-optimisation" in md and "stops rising at sqrt(KL to SFT) 4 (KL 16 nats per response)" in md
    assert "![ppo_rm: RM score and verifier accuracy against sqrt(KL to SFT)](report_overopt.png)" in md
    page = (metrics / "report.html").read_text()
    assert len(re.findall(r'src="data:image/png', page)) == 3 and 'id="control"' in page and 'id="overopt"' in page
    assert (metrics / "report_overopt.png").read_bytes()[:4] == b"\x89PNG"


def test_without_the_variants_the_report_says_what_is_missing(metrics):
    _run(metrics)
    md = (metrics / "report.md").read_text()
    assert "metrics/eval/ppo_rm.json: missing" in md and "metrics/eval/grpo_random.json: missing" in md
    assert "No per-step history of PPO on the reward model alone" in md and "GRPO against its control" not in md
    assert (metrics / "report_overopt.png").stat().st_size > 0   # a placeholder: dvc.yaml declares the file


# Added to a copy of the page only. At load, every element whose box ends right of the window is
# recorded, except inside a box that scrolls sideways on purpose (`overflow-x: auto | scroll`,
# which must itself fit); the body records the page's scroll width and height, and the overflows.
_OVERFLOW_PROBE = """<script>
window.addEventListener("load", () => {
  const W = document.documentElement.clientWidth, out = [];
  const scrolls = el => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
  const inScroller = el => { for (let p = el.parentElement; p; p = p.parentElement) if (scrolls(p)) return true;
                             return false; };
  for (const el of document.body.querySelectorAll("*")) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > W + 0.5 && !inScroller(el))
      out.push(el.tagName.toLowerCase() + (el.className ? "." + el.className : "") + " right=" + Math.round(r.right));
  }
  const b = document.body;
  b.setAttribute("data-client-width", W);
  b.setAttribute("data-scroll-width", document.documentElement.scrollWidth);
  b.setAttribute("data-scroll-height", document.documentElement.scrollHeight);
  b.setAttribute("data-overflow", JSON.stringify(out));
});
</script>"""


@pytest.mark.slow
def test_nothing_runs_off_the_page_at_1280_px(metrics, tmp_path):
    """At a window 1280 px wide the page never scrolls sideways and no box ends past its right
    edge (a wide table scrolls inside its own box). A full-page screenshot is left in tmp_path
    (report_1280.png) for a person to look at."""
    browser, page = _probed_report(metrics, tmp_path, _OVERFLOW_PROBE)
    dom = _dump_dom(browser, page, "--window-size=1280,900")
    [body] = [a for t, a in dom.tags if t == "body"]
    assert "data-overflow" in body, "the probe did not run"
    assert int(body["data-client-width"]) == 1280
    assert json.loads(body["data-overflow"]) == [] and int(body["data-scroll-width"]) <= 1280, body

    shot = tmp_path / "report_1280.png"
    height = min(int(body["data-scroll-height"]), 16000)
    r = subprocess.run(_chromium_cmd(browser, metrics / "report.html", f"--window-size=1280,{height}",
                                     f"--screenshot={shot}"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr[-2000:]


def _collisions(fig) -> list[str]:
    """Each legend that touches another legend or a plot's box with its title, labels and ticks,
    or runs off the figure; each tick label or note that touches another in its plot."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    page = fig.bbox
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    plots = [ax for ax in fig.axes if ax.axison and ax.get_visible()]
    out = []
    for i, leg in enumerate(legends):
        box = leg.get_window_extent(r)
        out += [f"legend {i} / legend {j}" for j, other in enumerate(legends[i + 1:], i + 1)
                if box.overlaps(other.get_window_extent(r))]
        out += [f"legend {i} / plot {ax.get_title()!r}" for ax in plots if box.overlaps(ax.get_tightbbox(r))]
        if not (page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1):
            out.append(f"legend {i} runs off the figure")
    for ax in plots:
        for texts in (ax.get_xticklabels(), ax.texts):
            boxes = [(t.get_text(), t.get_window_extent(r)) for t in texts if t.get_text()]
            out += [f"{a!r} / {b!r} in {ax.get_title()!r}" for k, (a, box) in enumerate(boxes)
                    for b, other in boxes[k + 1:] if box.overlaps(other)]
    return out


def test_no_legend_covers_a_plot_its_title_or_another_legend(metrics):
    """Every series of the RL panels at once, with intervals and a KL below 0 (the longest legends),
    the evaluation of three models and of all seven, and the over-optimisation panels."""
    plt = _plt()
    steps = [float(s) for s in range(30)]
    rl = {f"{run}{suffix}.tsv": {"step": steps, "kl": [(-1) ** s * 1e-3 for s in range(30)],
                                 "reward": [s / 30 for s in range(30)], "accuracy": [s / 40 for s in range(30)],
                                 "math_exact_match": [0.85] * 30, "math_exact_match_lo": [0.8] * 30,
                                 "math_exact_match_hi": [0.9] * 30}
          for run in ("ppo", "ppo_rm", "grpo", "grpo_random") for suffix in ("", "_val")}
    data = collect(metrics)
    rates = [s / 30 for s in range(30)]
    curve = {"sqrt_kl": steps, "proxy": steps, "gold": rates, "proxy_smooth": steps, "gold_smooth": rates,
             "window": 2, "peak_sqrt_kl": 29.0, "still_rising": True}
    kls = {"base": 3.35, "sft": 0.0, "ppo": 0.00117, "ppo_rm": 0.000375, "grpo": 0.00216, "grpo_random": 0.00104,
           "dpo": -0.0002}
    seven = {m: _eval(0.8, kl=kl, kl_lo=kl / 2, kl_hi=kl * 2, win_rate_vs_sft=0.5) for m, kl in kls.items()}
    figures = {"RL curves": curves_figure(rl)[0], "fixture curves": curves_figure(data["curves"])[0],
               "evaluation": eval_figure(data["evals"]), "evaluation of seven": eval_figure(seven),
               "over-optimisation": overopt_figure(curve),
               "rankers": rankers_figure({"n": [1.0, 2.0, 4.0], **{k: [0.5, 0.55, 0.6] for k in (
                   "likelihood", "per_token", "reward_model", "dpo_implicit", "agreement", "pass_at_n", "random")}}),
               "tiers": tiers_figure({m: {"tier_pass_curves": {t: [k / 16 for k in range(1, 17)]
                                                              for t in ("in_distribution", "edge", "harder")}}
                                      for m in kls})}
    found = {name: _collisions(fig) for name, fig in figures.items()}
    n_legends = {name: len(fig.legends) + sum(ax.get_legend() is not None for ax in fig.axes)
                 for name, fig in figures.items()}
    for fig in figures.values():
        plt.close(fig)
    assert n_legends == {"RL curves": 5, "fixture curves": 4, "evaluation": 1, "evaluation of seven": 1,
                         "over-optimisation": 2, "rankers": 1, "tiers": 3}
    assert found == {name: [] for name in figures}


def _with_tiers(metrics) -> None:
    """Adds tiers to the fixture: on 100 edge problems SFT is right on the first 50 and GRPO on the
    first 62 (12 up, none down); on the harder tier both get the first 3."""
    for name, edge in (("sft", 50), ("grpo", 62)):
        ev = json.loads((metrics / f"eval/{name}.json").read_text())
        ev.update({"tier_pass_k": 16, "tier_edge_exact_match": edge / 100, "tier_edge_exact_match_lo": edge / 100 - 0.1,
                   "tier_edge_exact_match_hi": edge / 100 + 0.1, "tier_edge_pass_at_1": 0.45, "tier_edge_pass_at_16": 0.86,
                   "tier_edge_maj_at_8": 0.5, "tier_edge_greedy_wrong_pass": 0.23, "tier_harder_exact_match": 0.03})
        _write(metrics / f"eval/{name}.json", ev)
        items = [json.loads(x) for x in (metrics / f"eval/{name}_items.jsonl").read_text().splitlines()]
        items += [{"set": "tier", "id": f"e{i}", "tier": "edge", "level": 4, "lang": "en", "correct": i < edge}
                  for i in range(100)]
        items += [{"set": "tier", "id": f"h{i}", "tier": "harder", "level": 5, "lang": "en", "correct": i < 3}
                  for i in range(100)]
        _write(metrics / f"eval/{name}_items.jsonl", items)
        samples = json.loads((metrics / f"eval/{name}_samples.json").read_text())
        samples["tier_pass_curves"] = {"edge": [0.45 + 0.4 * (k / 16) ** 0.5 for k in range(1, 17)],
                                       "harder": [0.01 * k for k in range(1, 17)]}
        _write(metrics / f"eval/{name}_samples.json", samples)


def test_the_report_shows_math_per_difficulty_tier(metrics):
    """A section per tier: each model's greedy accuracy with its paired change against its parent,
    pass@1, pass@16, the majority vote and the headroom of sharpening; a sentence on GRPO at the
    edge; the pass@k figure inlined (a third image)."""
    _with_tiers(metrics)
    _run(metrics)
    md = (metrics / "report.md").read_text()
    assert "## Math by difficulty tier" in md and "### the edge" in md and "### harder, never trained on" in md
    assert "| **grpo** vs sft | 62.0% [52.0, 72.0]<br>▲ +12.0 pp [6.0, 19.0] |" in md
    assert "GRPO on the edge tier: 50.0% → 62.0%, +12.0 pp" in md and "on 23.0% of the edge problems" in md
    assert "| **sft** | 50.0% [40.0, 60.0] | 45.0% | 86.0% | 50.0% | 23.0% |" in md
    assert "| **sft** | 3.0% | n/a | n/a | n/a | n/a |" in md  # the harder tier was not sampled here
    assert "![pass@k per difficulty tier](report_tiers.png)" in md
    page = (metrics / "report.html").read_text()
    assert 'id="tiers"' in page and len(re.findall(r'src="data:image/png;base64,', page)) == 3
    paired = json.loads((metrics / "paired.json").read_text())
    assert paired["grpo_vs_sft"]["tier_edge"]["wins"] == 12 and paired["grpo_vs_sft"]["tier_edge"]["losses"] == 0
    assert (metrics / "report_tiers.png").read_bytes()[:4] == b"\x89PNG"


def _with_rankers(metrics) -> None:
    r = lambda acc, g, best: {"pair_accuracy": acc, "pair_accuracy_lo": acc - 0.05, "pair_accuracy_hi": acc + 0.05,  # noqa: E731
                              "pairs": 900, "greedy_wrong_accuracy": g, "greedy_wrong_accuracy_lo": g - 0.05,
                              "greedy_wrong_accuracy_hi": g + 0.05, "greedy_wrong_pairs": 40, "best_of_n": best,
                              "best_of_n_lo": best - 0.08, "best_of_n_hi": best + 0.08}
    _write(metrics / "rankers.json", {"tier": "edge", "problems": 128, "samples": 4, "greedy_accuracy": 0.555,
                                      "pass_at_n": 0.8, "stage_time_s": 55.0,
                                      "rankers": {"likelihood": r(0.74, 0.12, 0.555),
                                                  "reward_model": {**r(0.62, 0.36, 0.44), "best_of_n_vs_likelihood": -0.115,
                                                                   "best_of_n_vs_likelihood_lo": -0.2,
                                                                   "best_of_n_vs_likelihood_hi": -0.03},
                                                  "agreement": r(0.74, 0.23, 0.54)}})
    _write(metrics / "verifier.json", {"heldout_verdicts": 174, "heldout_pair_accuracy": 0.55,
                                       "heldout_likelihood_pair_accuracy": 0.88, "math_exact_match": 0.83,
                                       "sft_math_exact_match": 0.82, "math_problems": 200, "train_time_s": 200.0})
    _write(metrics / "plots/rankers.tsv", "n\tlikelihood\treward_model\tagreement\tpass_at_n\trandom\n"
           + "".join(f"{k}\t0.5\t0.4\t0.5\t{0.45 + 0.1 * k}\t0.45\n" for k in range(1, 5)))


def test_the_report_shows_the_math_rankers(metrics):
    """A table of the rankers (pairs, against the greedy answer, best of n, with intervals), a
    sentence saying whether any ranker's pick beats greedy decoding, and the best-of-n figure."""
    _with_rankers(metrics)
    _run(metrics)
    md = (metrics / "report.md").read_text()
    assert "## Math rankers" in md
    assert "| ranker | pairs ranked right | against the greedy answer | best of 4 | than the likelihood's |" in md
    assert ("| the reward model | 62.0% [57.0, 67.0] | 36.0% [31.0, 41.0] (40 pairs) | 44.0% [36.0, 52.0] |"
            " -11.5 [-20.0, -3.0] |") in md
    assert "| SFT's likelihood | 74.0% [69.0, 79.0] | 12.0% [7.0, 17.0] (40 pairs) | 55.5% [47.5, 63.5] | – |" in md
    assert ("the best ranker's pick of 4 samples, SFT's likelihood's, is right on 55.5% [47.5, 63.5]: no better"
            " than greedy decoding") in md
    assert ("The generative verifier, on 174 answers to training problems it never saw (SFT's samples, as many right as"
            " wrong per problem), orders 55.0% of the pairs of one problem's right and wrong answers right, SFT's"
            " likelihood 88.0%; its own greedy math 83.0% (SFT 82.0%, 200 held-out problems).") in md
    assert "![best-of-n per ranker against the exact checker](report_rankers.png)" in md
    page = (metrics / "report.html").read_text()
    assert 'id="rankers"' in page and len(re.findall(r'src="data:image/png;base64,', page)) == 3
    assert "rankers" in (metrics / "report.md").read_text().split("## The models")[0]  # its stage time


def test_a_rate_is_drawn_on_its_whole_range_and_kl_names_its_estimator():
    gold = [0.85, 0.86, 0.87]
    overopt = overopt_figure({"sqrt_kl": [0.0, 1.0, 2.0], "proxy": [0.1, 0.5, 0.9], "gold": gold,
                              "proxy_smooth": [0.1, 0.5, 0.9], "gold_smooth": gold, "window": 2, "peak_sqrt_kl": 2.0,
                              "still_rising": True})
    assert overopt.axes[1].get_ylim() == (0.0, 1.0)  # the gold, a verifier's accuracy
    _plt().close(overopt)
    curves = {"grpo_val.tsv": {"step": [0.0, 3.0, 6.0], "math_exact_match": [0.85, 0.86, 0.87]},
              "grpo.tsv": {"step": [1.0, 2.0], "kl": [0.01, 0.02]},
              "ppo.tsv": {"step": [1.0, 2.0], "kl": [0.01, 0.02]}}
    fig, _ = curves_figure(curves)
    acc, kl = fig.axes[0], fig.axes[1]
    labels = [line.get_label() for line in kl.lines]
    _plt().close(fig)
    assert acc.get_ylim() == (0.0, 1.0)
    assert labels == ["PPO (ppo.kl_estimator)", "GRPO (k3)"] and "estimated" in kl.get_ylabel()


def _with_preference(metrics) -> None:
    """Adds the continuation preference: 100 held-out passages; SFT's continuations score 0.0 by the
    judge, PPO's 0.3 on the first 70 and -0.1 on the rest; PPO on the RM alone evaluated three
    times, its judge's mean peaking in the middle; the reward model's best of 1..64."""
    for name, kl_seq in (("sft", 0.0), ("ppo", 2.5)):
        path = metrics / f"eval/{name}.json"
        ev = json.loads(path.read_text()) if path.is_file() else _eval(0.40, win_rate_vs_sft=0.5, kl=0.01)
        gold = 0.0 if name == "sft" else 0.3 * 0.7 - 0.1 * 0.3
        ev.update({"continuation_gold": gold, "continuation_rm": 0.5 if name == "ppo" else -0.2,
                   "continuation_kl_seq": kl_seq, "continuation_kl": kl_seq / 20, "continuation_repetition": 0.01,
                   "continuation_not_continuation": 0.02, "continuation_win_rate": 0.5 if name == "sft" else 0.7,
                   "continuation_win_rate_lo": 0.5 if name == "sft" else 0.6,
                   "continuation_win_rate_hi": 0.5 if name == "sft" else 0.78,
                   "continuation_base_bpb": 2.0 if name == "sft" else 2.2, "continuation_base_bpb_sft": 2.0})
        _write(path, ev)
        items_path = metrics / f"eval/{name}_items.jsonl"
        items = [json.loads(x) for x in items_path.read_text().splitlines()] if items_path.is_file() else _items(50, 30)
        items += [{"set": "continuation", "id": f"c{i}",
                   "score": 0.0 if name == "sft" else 0.3 if i < 70 else -0.1} for i in range(100)]
        _write(items_path, items)
        spath = metrics / f"eval/{name}_samples.json"
        samples = json.loads(spath.read_text()) if spath.is_file() else {"model": name}
        samples["continuation_samples"] = [{"passage": "The ship sails on\nInto the night,", "reference": "",
                                            "response": "and joy is <b>here</b>" if name == "ppo" else "and dark",
                                            "gold": 0.6 if name == "ppo" else -0.2, "sft_response": "and dark",
                                            "sft_gold": -0.2}]
        _write(spath, samples)
    _write(metrics / "plots/ppo_rm_val.tsv", "step\tmath_exact_match\tcontinuation_gold\tcontinuation_rm"
           "\tcontinuation_kl_seq\n0\t0.8\t0.05\t-0.2\t0.0\n20\t0.8\t0.40\t0.6\t4.0\n40\t0.7\t0.30\t1.4\t9.0\n")
    _write(metrics / "plots/rankers_continuation.tsv", "n\tkl_bound\tsqrt_kl\trm_pick_gold\trm_pick_rm\tgold_pick_gold\n"
           + "".join(f"{n}\t{math.log(n) - (n - 1) / n:.6f}\t{math.sqrt(math.log(n) - (n - 1) / n):.6f}"
                     f"\t{0.05 + 0.01 * n:.6f}\t{0.02 * n:.6f}\t{0.05 + 0.015 * n:.6f}\n" for n in range(1, 65)))


def test_the_report_shows_the_continuation_preference(metrics):
    """A table of every model continuing held-out passages (the judge's mean and its paired change,
    the win rate, RM score, KL, base bits/byte), the reward model's best-of-n rows, where the gold
    peaks along PPO on the RM alone, the figure and SFT's and PPO's continuations side by side."""
    _with_preference(metrics)
    _run(metrics)
    md = (metrics / "report.md").read_text()
    assert "## The continuation preference" in md
    assert "| SFT | +0.000 | – | 50% (itself) | -0.200 | 0.000 | 2.000 | 1.0% | 2.0% |" in md
    row = next(r for r in md.splitlines() if r.startswith("| PPO |"))
    assert "| +0.180 | +0.18 [0.144, 0.216] | 70.0% [60.0, 78.0] | 0.500 | 2.500 | 2.200 (2.000) |" in row
    assert "| SFT, best of 16 by the RM | +0.210 | – | – | 0.320 | ≤ 1.835 |" in md
    assert "PPO moves the judge's mean 0.000 → 0.180, +0.18 [0.144, 0.216] (significant)" in md
    assert "the reward model's best of 32 of SFT's samples, at KL at most 2.497, scores +0.370" in md  # nearest KL
    assert ("along PPO on the RM alone the judge's mean peaks at KL 4.000 (+0.400) and ends at +0.300 at KL 9.000,"
            " while the reward model's own score goes +0.600 -> +1.400") in md
    assert "along best of n by the RM the judge's mean is still rising" in md
    assert "![the gold judge and the reward model against sqrt(KL to SFT) on held-out continuations]" \
           "(report_preference.png)" in md
    assert "| The ship sails on<br>Into the night, | and dark (-0.20) | and joy is &lt;b>here&lt;/b> (+0.60) |" in md
    page = (metrics / "report.html").read_text()
    assert 'id="preference"' in page and "&lt;b&gt;here" in page
    assert (metrics / "report_preference.png").read_bytes()[:4] == b"\x89PNG"
    paired = json.loads((metrics / "paired.json").read_text())
    assert paired["ppo_vs_sft"]["continuation"]["delta"] == pytest.approx(0.18)


def test_the_over_optimisation_line_says_where_a_saturating_gold_stops_rising():
    """A judge that saturates (its mean near its ceiling from some KL on, its highest point far
    beyond): the line names the peak and, before it, the first KL with 95% of the peak's gain."""
    from llm.eval.report import preference_overopt_line
    rows = {"continuation_kl_seq": [0.0, 2.0, 50.0, 200.0, 400.0], "continuation_gold": [0.1, 0.3, 0.96, 0.99, 0.98],
            "continuation_rm": [0.0, 0.5, 3.0, 3.9, 3.8]}
    line = preference_overopt_line({"ppo_rm_val.tsv": rows})
    assert line == ("Over-optimisation on the preference: along PPO on the RM alone the judge's mean peaks at KL"
                    " 200 (+0.990) (95% of that gain first at KL 50.000: +0.960) and ends at +0.980 at KL 400,"
                    " while the reward model's own score goes +3.900 -> +3.800.")


def test_without_continuations_the_preference_section_is_left_out(metrics):
    _run(metrics)
    assert "## The continuation preference" not in (metrics / "report.md").read_text()
    assert (metrics / "report_preference.png").read_bytes()[:4] == b"\x89PNG"   # the placeholder (a DVC out)


def test_a_ppo_rm_on_passages_alone_says_why_it_has_no_math_curve(metrics):
    """ppo_rm.tsv without the verifier's accuracy (its rollouts were passages): the section says so
    and points to the preference's curve, rather than calling the history missing."""
    _write(metrics / "plots/ppo_rm.tsv", "step\treward\tkl\tkl_seq\n1\t0.1\t0.0\t0.0\n2\t0.3\t0.02\t0.5\n")
    _run(metrics)
    md = (metrics / "report.md").read_text()
    assert "rolled out no math (ppo.continuation_share 1.0)" in md and "No per-step history" not in md


def test_a_stage_that_did_not_run_in_this_checkout_keeps_the_committed_report_cards_time(tmp_path):
    """Stage times live in runs/<stage>/run.json, which a clone lacks: those stages keep the time
    the report card committed at HEAD recorded (marked *); a stage that ran here shows its own."""
    import subprocess

    from llm.eval.report import COMMITTED, committed_seconds, stage_times
    from llm.eval.report_render import _time_cells
    m = tmp_path / "metrics"
    m.mkdir()
    (m / "report.md").write_text("# Report card\n\n| prepare | sft | rankers |\n|---|---|---|\n| – | 1622 s | 106 s* |\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "run"]):
        subprocess.run(git + args, cwd=tmp_path, check=True)
    (m / "report.md").write_text("uncommitted: not read")
    assert committed_seconds(m) == {"sft": 1622.0, "rankers": 106.0}
    data = {"stages": {"sft": {}, "rankers": {"stage_time_s": 50.0}}, "samples": {},
            "committed_seconds": committed_seconds(m)}
    assert stage_times(data) == [("prepare", None, ""), ("sft", 1622.0, COMMITTED), ("rankers", 50.0, "stage_time_s")]
    assert _time_cells(data) == [("prepare", "–"), ("sft", "1622 s*"), ("rankers", "50 s")]
    assert committed_seconds(tmp_path / "not-a-checkout") == {}
