"""The report card as markdown and as one offline HTML page (content: llm/eval/report.py).

    md = render_markdown(data, paired, head, images={"curves": "report_curves.png"})   # relative paths
    page = render_html(data, paired, head, images={"curves": png_bytes})               # inlined

The HTML page is offline: no scripts, no stylesheets or fonts from elsewhere, images embedded as
base64 PNG data URIs, and any http(s) URL appearing in model output or metrics defanged to
`hxxp(s)://`, so the page can fetch nothing (`find_urls` checks; the report stage refuses to
write a page that holds one). Model output is data: escaped in HTML, and in markdown every
`<` that could open a tag and `&` that could start an entity is escaped.
"""
from __future__ import annotations

import base64
import html
import re
from typing import Any, Sequence

from llm.eval.report import (COMMITTED, CURVES_NOTE, MARK, MODEL_LINES, MODELS, NAME, NBSP, NBSP_COMMA, PLUMBING_PROFILES, _NEG_KL,
                             _join, all_metric_rows, control_line, fixed_prompt_rows, item_sample_groups, overopt_curve,
                             overopt_line, paired_rows, stage_headline_rows, stage_summary, stage_times, summary_rows,
                             PREFERENCE_NOTE, RANKERS_NOTE, TIER_NOTE, preference_line, preference_overopt_line,
                             preference_rows, preference_samples, ranker_line, ranker_rows, tier_line, tier_rows,
                             verdict, verifier_line)

_URL = re.compile(r"(?i)\b(http)(s?)://")
PREFERENCE_COLUMNS = ("model", "gold judge", "change vs SFT", "win rate vs SFT", "RM score", "KL, nats/continuation",
                      "base bits/byte (SFT's)", "repeated trigrams", "not a continuation")
PREFERENCE_FIGURE = "the gold judge and the reward model against sqrt(KL to SFT) on held-out continuations"


MAX_SAMPLE_CHARS = 400
# a sample's mark (llm.eval.report.sample_mark) -> its symbol and CSS class
SAMPLE_MARKS = {True: ("✓", "ok"), False: ("✗", "bad"), None: ("–", "mid")}
SAMPLE_NOTE = ("greedy answers; ✓ right, ✗ wrong, – neither (a request outside the model's skills answered with no"
               " worked sum but not with the taught statement); in each group the items where the trained models"
               " differ most come first")


def _clip(text: str) -> str:
    return text if len(text) <= MAX_SAMPLE_CHARS else text[:MAX_SAMPLE_CHARS] + f" … ({len(text)} characters)"


def defang(text: str) -> str:
    """http(s):// -> hxxp(s)://: the offline page must hold no URL it could fetch."""
    return _URL.sub(lambda m: f"{m.group(1)[0]}xx{m.group(1)[3]}{m.group(2)}://", text)


def header_lines(head: dict, data: dict) -> tuple[str | None, list[tuple[str, str]]]:
    """(a warning or None, [(label, text)]) for the top of the report."""
    profile = head.get("profile")
    warning = PLUMBING_PROFILES.get(profile or "")
    desc = f": {head['profile_description']}" if head.get("profile_description") else ""
    lines = [("profile", f"{profile}{desc}" if profile
              else "unknown (params.yaml has no `# profile:` line; see `python -m llm.profile`)")]
    commit = head.get("commit") or "unknown (not a git checkout)"
    if head.get("changed"):
        commit += " with uncommitted changes to " + ", ".join(head["changed"][:8]) + (
            f" and {len(head['changed']) - 8} more" if len(head["changed"]) > 8 else "")
    lines += [("commit", commit), ("date", head.get("date", "")), ("machine", head.get("hardware", ""))]
    pre = data["stages"].get("pretrain", {})
    if pre.get("device"):
        lines.append(("training device", f"{pre['device']}, {pre.get('dtype', '?')}, {pre.get('world_size', 1)}"
                                         f" process(es) (pretraining)"))
    times = stage_times(data)
    total = sum(t for _, t, _ in times if t is not None)
    if any(t is not None for _, t, _ in times):
        untimed = [s for s, t, _ in times if t is None]
        before = [s for s, _, src in times if src == COMMITTED]
        lines.append(("wall time", f"{total / 60:.1f} min in all, as the stages recorded it (not counting process"
                                   f" start-up and model loading" + (f"; no time recorded by {_join(untimed)}"
                                                                     if untimed else "")
                      + (f"; * {_join(before)} did not run in this checkout: their times are those of the report"
                         f" card committed at HEAD" if before else "") + ")"))
    return warning, lines


def _time_cells(data: dict) -> list[tuple[str, str]]:
    return [(s, (f"{t:.0f} s" if t >= 10 else f"{t:.1f} s") + ("*" if src == COMMITTED else "") if t is not None
             else "–") for s, t, src in stage_times(data)]


_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")  # what could open an HTML tag or comment
_ENTITY = re.compile(r"&(?=#?\w+;)")          # what could be read as an entity


def _md(text: str) -> str:
    """Text for a markdown table cell: no raw HTML (model output is data), pipes and newlines kept.
    Only what markdown would read as a tag or an entity is escaped, so "p < 0.001" stays legible."""
    if not text:
        return "_(empty)_"
    text = _TAG_START.sub("&lt;", _ENTITY.sub("&amp;", _clip(text)))
    return text.replace("|", "\\|").replace("\n", "<br>")


def _no_overopt(data: dict) -> str:
    """Why the math over-optimisation curve is missing: no ppo_rm history, or one with no math
    rollouts (PPO on passages alone: its curve is the continuation preference's)."""
    if "ppo_rm.tsv" in data["curves"]:
        return ("PPO on the reward model alone rolled out no math (ppo.continuation_share 1.0): the verifier has"
                " nothing to judge; its curve on the continuation preference is in the section above.")
    return "No per-step history of PPO on the reward model alone (metrics/plots/ppo_rm.tsv)."


def render_markdown(data: dict, paired: dict, head: dict, images: dict[str, str] | None = None) -> str:
    """The report as GitHub markdown; `images` maps "curves"/"eval" to relative image paths.

    Long on purpose: the report's sections in the order a reader sees them, each a few lines
    (render_html below is the same page as HTML)."""
    images = images or {}
    out = ["# Report card", ""]
    warning, lines = header_lines(head, data)
    if warning:
        out += [f"> **{warning}**", ""]
    out += [f"- **{k}**: {_md(v)}" for k, v in lines]
    times = _time_cells(data)
    if any(t != "–" for _, t in times):
        out += ["", "| " + " | ".join(s for s, _ in times) + " |", "|" + "---|" * len(times),
                "| " + " | ".join(t for _, t in times) + " |"]
    out += ["", "## The models", "", *(f"- **{name}**: {line}." for name, line in MODEL_LINES)]
    out += ["", "## Summary", ""]
    cols, rows = summary_rows(data["evals"], paired)
    if rows:
        out += [_LEGEND, "", "| model | " + " | ".join(label for _, label in cols) + " |", "|---|" + "---|" * len(cols)]
        for r in rows:
            cells = []
            for key, _ in cols:
                c = r["cells"][key]
                txt = c["value"] + (f" {c['interval']}" if c["interval"] else "")
                if c["change"]:
                    txt += f"<br>{MARK[c['verdict']]} {c['change']}"
                cells.append(txt)
            vs = f"<br>vs {r['parent']}" if r["parent"] else ""
            out.append(f"| **{r['model']}**{vs} | " + " | ".join(cells) + " |")
        if any(r["cells"].get("kl", {}).get("value", "").endswith("†") for r in rows):
            out += ["", "† " + _NEG_KL.strip(" ()") + "."]
    else:
        out.append("_No eval metrics yet (metrics/eval/<model>.json)._")
    if images.get("eval"):
        out += ["", f"![held-out accuracy per skill, win rate and KL with 95% intervals]({images['eval']})"]
    tiers = tier_rows(data["evals"], paired)
    if tiers:
        out += ["", "## Math by difficulty tier", "", TIER_NOTE, ""]
        if line := tier_line(paired, data["evals"]):
            out += [_md(line), ""]
        for label, k, rows in tiers:
            out += [f"### {label}", "", f"| model | greedy | pass@1 | pass@{k or 'k'} | majority of 8"
                    " | greedy wrong, a sample right |", "|---|---|---|---|---|---|"]
            for r in rows:
                change = f"<br>{MARK[r['verdict']]} {r['change']}" if r["change"] else ""
                vs = f" vs {r['parent']}" if r["change"] else ""
                out.append(f"| **{r['model']}**{vs} | {r['greedy']}{change} | {r['pass_1']} | {r['pass_k']}"
                           f" | {r['maj']} | {r['headroom']} |")
            out.append("")
        if images.get("tiers"):
            out += [f"![pass@k per difficulty tier]({images['tiers']})", ""]
    out += ["", "## What each stage changed", ""]
    if not paired:
        out += ["_No paired comparison: per-item outcomes (metrics/eval/<model>_items.jsonl) are missing._", ""]
    for child in (c for c in MODELS if c in paired):
        sentence, lines = stage_summary(child, paired, data["evals"])
        out += [f"### {NAME[child]} (against {NAME[paired[child]['parent']]})", "", _md(sentence), ""]
        out += [f"- {_md(line)}" for line in lines] + ([""] if lines else [])
        out += [f"| skill | {paired[child]['parent']} | {child} | change [95% interval] | McNemar p | items"
                " | verdict |",
                "|---|---|---|---|---|---|---|"]
        out += ["| " + " | ".join(_md(c) if c else "" for c in row) + " |" for row in paired_rows(child, paired)]
        out.append("")
        if child == "grpo_random" and (line := control_line(paired)):
            out += [_md(line), ""]
    rrows = ranker_rows(data["stages"])
    if rrows:
        n = data["stages"]["rankers"].get("samples", "n")
        out += ["## Math rankers", "", RANKERS_NOTE, ""]
        for line in (ranker_line(data["stages"]), verifier_line(data["stages"])):
            if line:
                out += [_md(line), ""]
        out += [f"| ranker | pairs ranked right | against the greedy answer | best of {n} | than the likelihood's |",
                "|---|---|---|---|---|"]
        out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rrows]
        out.append("")
        if images.get("rankers"):
            out += [f"![best-of-n per ranker against the exact checker]({images['rankers']})", ""]
    prows = preference_rows(data["evals"], paired, data["curves"])
    if prows:
        out += ["## The continuation preference", "", PREFERENCE_NOTE, ""]
        for line in (preference_line(data["evals"], paired, data["curves"]), preference_overopt_line(data["curves"])):
            if line:
                out += [_md(line), ""]
        out += ["| " + " | ".join(PREFERENCE_COLUMNS) + " |", "|---|" + "---|" * (len(PREFERENCE_COLUMNS) - 1)]
        out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in prows]
        out.append("")
        if images.get("preference"):
            out += [f"![{PREFERENCE_FIGURE}]({images['preference']})", ""]
        shown = preference_samples(data["samples"])
        if shown:
            out += ["| passage | SFT | PPO |", "|---|---|---|"]
            out += [f"| {_md(x['passage'])} | {_md(x['sft_response'])} ({x['sft_gold']:+.2f}) |"
                    f" {_md(x['response'])} ({x['gold']:+.2f}) |" for x in shown]
            out.append("")
    out += ["## Over-optimisation", ""]
    curve = overopt_curve(data["curves"])
    if curve:
        out += [_md(overopt_line(curve)), ""]
        if images.get("overopt"):
            out += [f"![ppo_rm: RM score and verifier accuracy against sqrt(KL to SFT)]({images['overopt']})", ""]
    else:
        out += [f"_{_no_overopt(data)}_", ""]
    out += ["## Training curves", ""]
    out.append(f"![training curves]({images['curves']})" if images.get("curves") else "_No per-step TSVs yet._")
    out += ["", CURVES_NOTE]
    out += ["", f"## Samples ({SAMPLE_NOTE})", ""]
    groups = item_sample_groups(data["samples"], data["max_samples"])
    models = [m for m in MODELS if m in data["samples"]]
    for title, recs in groups:
        out += [f"### {title}", "", "| prompt (answer) | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
        for r in recs:
            cells = [SAMPLE_MARKS[r["by_model"][m][1]][0] + " " + _md(r["by_model"][m][0]) if m in r["by_model"]
                     else "" for m in models]
            out.append(f"| {_md(r['prompt'])}<br>(answer: {_md(r['answer'])}) | " + " | ".join(cells) + " |")
        out.append("")
    fixed = fixed_prompt_rows(data["samples"], data["max_samples"])
    if fixed:
        out += ["### Fixed prompts (no reference answer)", "", "| prompt | " + " | ".join(models) + " |",
                "|---|" + "---|" * len(models)]
        out += [f"| {_md(p)} | " + " | ".join(_md(by.get(m, "")) for m in models) + " |" for p, by in fixed]
        out.append("")
    models, rows = all_metric_rows(data["evals"])
    if rows:
        out += ["## Every eval metric", "", "Value [95% interval].", "", "| metric | " + " | ".join(models) + " |",
                "|---|" + "---|" * len(models)]
        out += [f"| {r['label']} | " + " | ".join(r["cells"][m] for m in models) + " |" for r in rows]
        out.append("")
    hl = stage_headline_rows(data["stages"])
    out += ["## Training stages", ""]
    if hl:
        out += ["| stage | measure | value |", "|---|---|---|"]
        out += [f"| {st if i == 0 or hl[i - 1][0] != st else ''} | {label} | {v} |"
                for i, (st, label, v) in enumerate(hl)]
        out += ["", "Every number a stage records is in `metrics/<stage>.json`."]
    else:
        out.append("_No stage metrics yet._")
    if data["notes"]:
        out += ["", "## Not available", ""] + [f"- {_md(n)}" for n in data["notes"]]
    return defang("\n".join(out)) + "\n"


_LEGEND = ("Value [95% interval]. Below it, the change against the parent model on the same items (sft vs base;"
           " the others vs sft; percentage points for percentages) with its paired 95% interval: ▲ / ▼"
           " significant, · not significant, ? borderline (McNemar's exact test and the bootstrap interval disagree).")

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 1.5em auto;
       max-width: 1500px; padding: 0 1em; color: #1f2328; line-height: 1.45; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #d0d7de; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #f6f8fa; }
td.num { white-space: nowrap; }
.iv { color: #59636e; font-size: 0.85em; }
.v { font-weight: 600; }
div.wide { overflow-x: auto; }  /* a table wider than the window scrolls inside it, not off the page */
table.samples pre { max-width: 20em; }
#summary { font-size: 0.82em; } #summary th { white-space: nowrap; } #summary td, #summary th { padding: 3px 6px; }
.chg { font-size: 0.85em; color: #59636e; }
.up { color: #1a7f37; font-weight: 600; } .down { color: #cf222e; font-weight: 600; } .borderline { color: #9a6700; }
.warn { background: #fff8c5; border: 1px solid #d4a72c; padding: 0.7em 1em; border-radius: 6px; font-weight: 600; }
dl.head { display: grid; grid-template-columns: max-content auto; gap: 0.15em 1em; margin: 0.8em 0; }
dl.head dt { font-weight: 600; color: #59636e; } dl.head dd { margin: 0; }
p.stage, ul.stage { max-width: 75em; } ul.stage { margin-top: -0.5em; }
pre { margin: 0; white-space: pre-wrap; font-size: 0.85em; max-width: 26em;
      font-family: ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", "Noto Sans Mono CJK SC", "Microsoft YaHei",
      monospace; }
.ok { color: #1a7f37; font-weight: 700; } .bad { color: #cf222e; font-weight: 700; }
.mid { color: #59636e; font-weight: 700; }
img { max-width: 100%; }
.note { color: #59636e; font-size: 0.9em; }
"""


def _e(text: Any) -> str:
    return html.escape(defang(str(text)))


def _response(text: str) -> str:
    """A model's answer for a <pre>: escaped, clipped, and visibly empty when it is."""
    return _e(_clip(text)) if text.strip() else '<span class="note">(empty)</span>'


def _mark_html(line: str) -> str:
    """A line of stage_summary with its leading ▲ / ▼ / ? coloured."""
    for v, mark in MARK.items():
        if line.startswith(mark + " "):
            return f'<span class="{v}">{mark}</span>{_e(line[1:])}'
    return _e(line)


def _img(png: bytes | None, alt: str) -> str:
    if not png:
        return ""
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def render_html(data: dict, paired: dict, head: dict, images: dict[str, bytes | None] | None = None) -> str:
    """The report as one offline HTML page (no URL anywhere; images inlined).

    Long on purpose: the page's sections in the order a reader sees them, each a few appends."""
    images = images or {}
    h = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', "<title>Report card</title>",
         f"<style>{_CSS}</style></head><body>", "<h1>Report card</h1>"]
    warning, lines = header_lines(head, data)
    if warning:
        h.append(f'<p class="warn" id="plumbing">{_e(warning)}</p>')
    h.append('<dl class="head">' + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in lines) + "</dl>")
    times = _time_cells(data)
    if any(t != "–" for _, t in times):
        h.append('<table id="times"><tr>' + "".join(f"<th>{_e(s)}</th>" for s, _ in times) + "</tr><tr>"
                 + "".join(f'<td class="num">{_e(t)}</td>' for _, t in times) + "</tr></table>")
    h.append("<h2>The models</h2><ul>"
             + "".join(f"<li><b>{_e(name)}</b>: {_e(line)}.</li>" for name, line in MODEL_LINES) + "</ul>")
    h.append("<h2>Summary</h2>")
    cols, rows = summary_rows(data["evals"], paired)
    if rows:
        h.append(f'<p class="note">{_e(_LEGEND)}</p>')
        h.append('<div class="wide"><table id="summary"><tr><th>model</th>'
                 + "".join(f"<th>{_e(label)}</th>" for _, label in cols) + "</tr>")
        for r in rows:
            tds = []
            for key, _ in cols:
                c = r["cells"][key]
                cell = f'<span class="v">{_e(c["value"])}</span>'
                if c["interval"]:  # the change may wrap before its interval, nowhere else
                    cell += f'<br><span class="iv">{_e(c["interval"]).replace(", ", NBSP_COMMA)}</span>'
                if c["change"]:
                    change = _e(c["change"]).replace(", ", NBSP_COMMA)
                    cell += f'<br><span class="chg {c["verdict"]}">{MARK[c["verdict"]]}{NBSP}{change}</span>'
                tds.append(f"<td>{cell}</td>")
            vs = f'<br><span class="iv">vs {_e(r["parent"])}</span>' if r["parent"] else ""
            h.append(f'<tr class="model"><th>{_e(r["model"])}{vs}</th>{"".join(tds)}</tr>')
        h.append("</table></div>")
        if any(r["cells"].get("kl", {}).get("value", "").endswith("†") for r in rows):
            h.append(f'<p class="note">† {_e(_NEG_KL.strip(" ()"))}.</p>')
    else:
        h.append('<p class="note">No eval metrics yet (metrics/eval/&lt;model&gt;.json).</p>')
    h.append(_img(images.get("eval"), "held-out accuracy per skill, win rate and KL with 95% intervals"))
    tiers = tier_rows(data["evals"], paired)
    if tiers:
        h.append('<h2 id="tiers">Math by difficulty tier</h2>')
        h.append(f'<p class="note">{_e(TIER_NOTE)}</p>')
        if line := tier_line(paired, data["evals"]):
            h.append(f'<p class="stage">{_e(line)}</p>')
        for label, k, rows in tiers:
            h.append(f"<h3>{_e(label)}</h3>")
            h.append('<div class="wide"><table class="tiers"><tr><th>model</th><th>greedy</th><th>pass@1</th>'
                     f"<th>pass@{_e(k or 'k')}</th><th>majority of 8</th><th>greedy wrong, a sample right</th></tr>")
            for r in rows:
                cell = f'<span class="v">{_e(r["greedy"])}</span>'
                if r["change"]:
                    change = _e(r["change"]).replace(", ", NBSP_COMMA)
                    cell += (f'<br><span class="chg {r["verdict"]}">{MARK[r["verdict"]]}{NBSP}{change}'
                             f' vs {_e(r["parent"])}</span>')
                h.append(f"<tr><th>{_e(r['model'])}</th><td>{cell}</td>"
                         + "".join(f'<td class="num">{_e(r[c])}</td>' for c in ("pass_1", "pass_k", "maj", "headroom"))
                         + "</tr>")
            h.append("</table></div>")
        h.append(_img(images.get("tiers"), "pass@k per difficulty tier"))
    h.append("<h2>What each stage changed</h2>")
    if not paired:
        h.append('<p class="note">No paired comparison: per-item outcomes (metrics/eval/&lt;model&gt;_items.jsonl)'
                 " are missing.</p>")
    for child in (c for c in MODELS if c in paired):
        parent = paired[child]["parent"]
        h.append(f"<h3>{_e(NAME[child])} (against {_e(NAME[parent])})</h3>")
        sentence, lines = stage_summary(child, paired, data["evals"])
        h.append(f'<p class="stage">{_e(sentence)}</p>')
        if lines:
            h.append('<ul class="stage">' + "".join(f"<li>{_mark_html(line)}</li>" for line in lines) + "</ul>")
        h.append(f"<details><summary>every skill, per level and per task kind"
                 f" ({len(paired[child]['skills'])})</summary>"
                 f'<table class="paired"><tr><th>skill</th><th>{_e(parent)}</th><th>{_e(child)}</th>'
                 "<th>change [95% interval]</th><th>McNemar p</th><th>items</th><th>verdict</th></tr>")
        for row, (s, r) in zip(paired_rows(child, paired), paired[child]["skills"].items()):
            cls = verdict(r)
            h.append("<tr>" + "".join(f'<td class="num">{_e(c)}</td>' for c in row[:-1])
                     + f'<td class="{cls}">{_e(row[-1])}</td></tr>')
        h.append("</table></details>")
        if child == "grpo_random" and (line := control_line(paired)):
            h.append(f'<p class="stage" id="control">{_e(line)}</p>')
    rrows = ranker_rows(data["stages"])
    if rrows:
        n = data["stages"]["rankers"].get("samples", "n")
        h.append('<h2 id="rankers">Math rankers</h2>')
        h.append(f'<p class="note">{_e(RANKERS_NOTE)}</p>')
        for line in (ranker_line(data["stages"]), verifier_line(data["stages"])):
            if line:
                h.append(f'<p class="stage">{_e(line)}</p>')
        h.append('<table class="rankers"><tr><th>ranker</th><th>pairs ranked right</th><th>against the greedy'
                 f" answer</th><th>best of {_e(n)}</th><th>than the likelihood's</th></tr>")
        h += ["<tr><th>" + _e(row[0]) + "</th>" + "".join(f'<td class="num">{_e(c)}</td>' for c in row[1:]) + "</tr>"
              for row in rrows]
        h.append("</table>")
        h.append(_img(images.get("rankers"), "best-of-n per ranker against the exact checker"))
    prows = preference_rows(data["evals"], paired, data["curves"])
    if prows:
        h.append('<h2 id="preference">The continuation preference</h2>')
        h.append(f'<p class="note">{_e(PREFERENCE_NOTE)}</p>')
        for line in (preference_line(data["evals"], paired, data["curves"]), preference_overopt_line(data["curves"])):
            if line:
                h.append(f'<p class="stage">{_e(line)}</p>')
        h.append('<div class="wide"><table class="preference"><tr>' + "".join(f"<th>{_e(c)}</th>"
                                                                             for c in PREFERENCE_COLUMNS) + "</tr>")
        h += ["<tr><th>" + _e(row[0]) + "</th>" + "".join(f'<td class="num">{_e(c)}</td>' for c in row[1:]) + "</tr>"
              for row in prows]
        h.append("</table></div>")
        h.append(_img(images.get("preference"), PREFERENCE_FIGURE))
        shown = preference_samples(data["samples"])
        if shown:
            h.append('<table class="samples"><tr><th>passage</th><th>SFT</th><th>PPO</th></tr>')
            h += [f"<tr><td><pre>{_e(_clip(x['passage']))}</pre></td><td><pre>{_e(_clip(x['sft_response']))}</pre>"
                  f" ({x['sft_gold']:+.2f})</td><td><pre>{_e(_clip(x['response']))}</pre> ({x['gold']:+.2f})</td></tr>"
                  for x in shown]
            h.append("</table>")
    h.append("<h2>Over-optimisation</h2>")
    curve = overopt_curve(data["curves"])
    if curve:
        h.append(f'<p class="stage" id="overopt">{_e(overopt_line(curve))}</p>')
        h.append(_img(images.get("overopt"), "ppo_rm: RM score and verifier accuracy against sqrt(KL to SFT)"))
    else:
        h.append(f'<p class="note">{_e(_no_overopt(data))}</p>')
    h.append("<h2>Training curves</h2>")
    h.append(_img(images.get("curves"), "training curves") or '<p class="note">No per-step TSVs yet.</p>')
    h.append(f'<p class="note">{_e(CURVES_NOTE)}</p>')
    h.append(f"<h2>Samples</h2><p class=\"note\">{_e(SAMPLE_NOTE[0].upper() + SAMPLE_NOTE[1:])}.</p>")
    models = [m for m in MODELS if m in data["samples"]]
    for title, recs in item_sample_groups(data["samples"], data["max_samples"]):
        h.append(f'<h3>{_e(title)}</h3><div class="wide"><table class="samples"><tr><th>prompt</th>'
                 + "".join(f"<th>{_e(m)}</th>" for m in models) + "</tr>")
        for r in recs:
            tds = []
            for m in models:
                if m not in r["by_model"]:
                    tds.append("<td></td>")
                    continue
                resp, ok = r["by_model"][m]
                symbol, css = SAMPLE_MARKS[ok]
                mark = f'<span class="{css}">{symbol}</span>'
                tds.append(f"<td>{mark}<pre>{_response(resp)}</pre></td>")
            h.append(f"<tr><td><pre>{_e(r['prompt'])}</pre><span class=\"note\">answer: {_e(r['answer'])}</span></td>"
                     + "".join(tds) + "</tr>")
        h.append("</table></div>")
    fixed = fixed_prompt_rows(data["samples"], data["max_samples"])
    if fixed:
        h.append('<h3>Fixed prompts (no reference answer)</h3>'
                 '<div class="wide"><table class="samples"><tr><th>prompt</th>'
                 + "".join(f"<th>{_e(m)}</th>" for m in models) + "</tr>")
        for p, by in fixed:
            h.append(f"<tr><td><pre>{_e(p)}</pre></td>"
                     + "".join(f"<td><pre>{_response(by[m])}</pre></td>" if m in by else "<td></td>" for m in models)
                     + "</tr>")
        h.append("</table></div>")
    models, rows = all_metric_rows(data["evals"])
    if rows:
        h.append("<h2>Every eval metric</h2><p class=\"note\">Value [95% interval].</p>"
                 "<div class=\"wide\"><table id=\"all\"><tr>"
                 "<th>metric</th>" + "".join(f"<th>{_e(m)}</th>" for m in models) + "</tr>")
        h += [f"<tr><th>{_e(r['label'])}</th>" + "".join(f'<td class="num">{_e(r["cells"][m])}</td>' for m in models)
              + "</tr>" for r in rows]
        h.append("</table></div>")
    h.append("<h2>Training stages</h2>")
    hl = stage_headline_rows(data["stages"])
    if hl:
        rows = []
        for i, (st, label, v) in enumerate(hl):
            n = sum(1 for x in hl if x[0] == st)
            first = i == 0 or hl[i - 1][0] != st
            lead = f'<th rowspan="{n}">{_e(st)}</th>' if first else ""
            rows.append(f'<tr>{lead}<td>{_e(label)}</td><td class="num">{_e(v)}</td></tr>')
        h.append('<table id="stages"><tr><th>stage</th><th>measure</th><th>value</th></tr>' + "".join(rows)
                 + "</table>")
        h.append('<p class="note">Every number a stage records is in metrics/&lt;stage&gt;.json.</p>')
    else:
        h.append('<p class="note">No stage metrics yet.</p>')
    if data["notes"]:
        h.append("<h2>Not available</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in data["notes"]) + "</ul>")
    h.append("</body></html>")
    return "\n".join(x for x in h if x) + "\n"


def find_urls(text: str) -> Sequence[str]:
    """Every http(s) URL in `text` (the offline check of tests and the report stage)."""
    return re.findall(r"(?i)https?://\S*", text)
