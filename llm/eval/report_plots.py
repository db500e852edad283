"""The report's figures: training curves and the per-model evaluation.

    png, titles = curves_png(curves)    # curves: {tsv name: {column: [floats]}} (llm/eval/report.py read_tsv)
    png = eval_png(evals)               # evals: {model: metrics/eval/<model>.json}
    png = overopt_png(curve)            # curve: llm.eval.report.overoptimisation of ppo_rm's steps
    png = preference_png(pcurves)       # pcurves: llm.eval.report.preference_curves

Training curves: one panel per quantity, so that no panel mixes units (reward and accuracy
are different panels; the held-out math accuracy of PPO and GRPO share one). A per-step
series is drawn raw and faint under its moving average over ~2% of the run, the smoothing of
the training stages' own curves (llm/train/monitor.py `smooth`); short series (held-out evaluations
every few hundred steps) are drawn as points joined by lines. A rate (accuracy, pairs ranked
right) is drawn on its whole range, 0 to 100%, so that a change of a point looks like one; a
held-out rate logged with its interval is drawn with it as a band. The KL during RL is each
run's sampled training estimate, its estimator named in the legend (k1 can fall below 0).

Every legend sits outside the plots, in a row of its own under its panel (the models' legend of
the evaluation above the whole figure), so it never covers a line, a label or another legend.

Over-optimisation (Gao, Schulman and Hilton 2022): PPO against the reward model alone
(ppo_rm), each step a point at sqrt(KL to SFT) of its rollouts, the RM score (the proxy it is
trained on) and the verifier's accuracy (the gold) in two panels with their moving averages
along the KL axis, and the gold's peak marked.

The continuation preference: the gold judge's mean (left) and the reward model's mean (right,
the proxy) against sqrt(KL to SFT per continuation), along PPO's held-out evaluations, along PPO
on the reward model alone, and along the reward model's best-of-n of SFT's samples (its KL bound,
with the judge's own pick of n dashed: the most any ranker could reach).

Evaluation: accuracy per skill as grouped bars with 95% intervals, on a row of its own; under
it the win rate against SFT and KL to SFT (nats/token, as everywhere) on a log axis, because
the base model's KL (a different model) is orders of magnitude above the others' and would
flatten every other on a linear one. SFT's KL to itself is 0 and an estimate below zero is
sampling noise of the estimator around zero: neither has a place on a log axis, so each is
written at the bottom of the panel instead.

matplotlib (Agg backend), imported lazily; PNG bytes carry no version string, so the same
inputs give the same bytes.
"""
from __future__ import annotations

import io
import math

MODELS = ("base", "sft", "ppo", "ppo_rm", "grpo", "grpo_random", "dpo")
COLORS = {"base": "#8c8c8c", "sft": "#1f77b4", "ppo": "#ff7f0e", "ppo_rm": "#ffbb78", "grpo": "#2ca02c",
          "grpo_random": "#98df8a", "dpo": "#9467bd"}

# (title, y label, [(tsv file, column, legend)]); series or files that are missing are skipped
PANELS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("pretraining loss", "nats/token", (("pretrain.tsv", "loss", "train"),
                                          ("pretrain_val.tsv", "val_loss", "held-out"))),
    ("SFT loss", "nats/token", (("sft.tsv", "loss", "train"), ("sft_val.tsv", "val_loss", "held-out"))),
    ("reward model accuracy", "pairs ranked right", (("reward.tsv", "accuracy", "train"),
                                                     ("reward_val.tsv", "val_accuracy", "held-out"))),
    ("DPO loss", "loss", (("dpo.tsv", "loss", "train"), ("dpo_val.tsv", "val_loss", "held-out"))),
    ("DPO preference accuracy", "pairs ranked right", (("dpo.tsv", "rewards_accuracy", "train"),
                                                       ("dpo_val.tsv", "val_rewards_accuracy", "held-out"))),
    ("PPO reward", "reward", (("ppo.tsv", "reward", "rollouts"), ("ppo_val.tsv", "reward", "held-out"))),
    ("GRPO reward", "reward", (("grpo.tsv", "reward", "rollouts"), ("grpo_val.tsv", "reward", "held-out"))),
    ("GRPO against its control", "rollout accuracy (verifier)", (("grpo.tsv", "accuracy", "GRPO"),
                                                                   ("grpo_random.tsv", "accuracy",
                                                                    "shuffled rewards (grpo_random)"))),
    ("held-out math accuracy during RL", "exact match", (("ppo_val.tsv", "math_exact_match", "PPO"),
                                                         ("ppo_rm_val.tsv", "math_exact_match", "PPO, RM only"),
                                                         ("grpo_val.tsv", "math_exact_match", "GRPO"),
                                                         ("grpo_random_val.tsv", "math_exact_match",
                                                          "GRPO, shuffled rewards"))),
    ("KL to SFT during RL", "nats/token, estimated", (("ppo.tsv", "kl", "PPO (ppo.kl_estimator)"),
                                                      ("ppo_rm.tsv", "kl", "PPO, RM only (ppo.kl_estimator)"),
                                                      ("grpo.tsv", "kl", "GRPO (k3)"),
                                                      ("grpo_random.tsv", "kl", "GRPO, shuffled rewards (k3)"))),
)
RATES = ("exact match", "pairs ranked right", "rollout accuracy (verifier)")  # y labels of 0-to-1 panels
SMOOTH_MIN_POINTS = 20  # shorter series are drawn as they are


def _plt():
    import matplotlib
    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt
    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})  # no version string: same bytes per run
    _plt().close(fig)
    return buf.getvalue()


def curves_png(curves: dict[str, dict[str, list[float]]]) -> tuple[bytes | None, list[str]]:
    """One figure, a panel per quantity that has data; (png or None, the titles drawn)."""
    fig, titles = curves_figure(curves)
    return (_png(fig) if fig is not None else None), titles


def curves_figure(curves: dict[str, dict[str, list[float]]]):
    """(the matplotlib figure of `curves_png` or None, the titles drawn)."""
    panels = []
    for title, ylabel, series in PANELS:
        lines = []
        for f, col, legend in series:
            cols = curves.get(f) or {}
            if col in cols and "step" in cols:
                # a held-out rate is logged with its interval (col_lo, col_hi): drawn as a band
                lo, hi = (cols.get(f"{col}_{end}") or [math.nan] * len(cols[col]) for end in ("lo", "hi"))
                pts = [(s, y, a, b) for s, y, a, b in zip(cols["step"], cols[col], lo, hi) if math.isfinite(y)]
                if pts:
                    lines.append((pts, legend))
        if lines:
            panels.append((title, ylabel, lines))
    if not panels:
        return None, []
    from llm.train.monitor import smooth

    entries = max(len(lines) + _below_zero(lines) for _, _, lines in panels)
    fig, axes, legend_rows = _panel_grid(len(panels), ncol=3, width=4.4, height=3.0, legend_lines=entries)
    for ax, legend_row, (title, ylabel, lines) in zip(axes, legend_rows, panels):
        for i, (pts, legend) in enumerate(lines):
            xs, ys, los, his = zip(*pts)
            color = f"C{i}"
            band = all(math.isfinite(v) for v in los + his)
            if band:
                ax.fill_between(xs, los, his, color=color, alpha=0.15, lw=0)
                legend += " (shaded: interval)"
            if len(xs) >= SMOOTH_MIN_POINTS:
                window = max(2, len(xs) // 50)
                ax.plot(xs, ys, "-", lw=0.7, color=color, alpha=0.25)
                ax.plot(xs, smooth(list(ys), window), "-", lw=1.6, color=color,
                        label=f"{legend} (mean of {window})")
            else:  # a series that never moved says its value: matplotlib pads its axis, but may not tick it
                same = len(set(ys)) == 1
                ax.plot(xs, ys, "o-", lw=1.2, ms=3.5, color=color, label=f"{legend}: {ys[0]:.3g} throughout" if same
                        else legend)
        if _below_zero(lines):  # an estimate below 0 (k1): KL itself is not
            ax.axhline(0.0, color="k", lw=0.8, ls=":", label="0 (KL is never below; a k1 estimate can be)")
        if ylabel in RATES:  # the whole range: a change of one point looks like one, not like a climb
            _rate_axis(ax)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        _legend_below(ax, legend_row)
    return fig, [t for t, _, _ in panels]


def _rate_axis(ax) -> None:
    """A rate's whole range, 0 to 100%."""
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(_plt().FuncFormatter(lambda y, _: f"{100 * y:.0f}%"))


def _below_zero(lines) -> bool:
    return any(y < 0 for pts, _ in lines for _, y, _, _ in pts)


def _panel_grid(n: int, ncol: int, width: float, height: float, legend_lines: int = 1):
    """(figure, n plot axes, n legend axes): panels in rows of `ncol`, each with a row of its own
    under it for its legend (one entry a line, up to `legend_lines`), so that a legend never
    covers a line, a label or another legend. Constrained layout keeps ticks, labels and legends apart."""
    plt = _plt()
    ncol = min(ncol, n)
    nrow = math.ceil(n / ncol)
    legend_height = 0.15 + 0.15 * legend_lines  # inches: 7 pt entries
    fig = plt.figure(figsize=(width * ncol, (height + legend_height) * nrow), layout="constrained")
    grid = fig.add_gridspec(2 * nrow, ncol, height_ratios=[height, legend_height] * nrow)
    axes = [fig.add_subplot(grid[2 * (k // ncol), k % ncol]) for k in range(n)]
    legend_rows = [fig.add_subplot(grid[2 * (k // ncol) + 1, k % ncol]) for k in range(n)]
    for ax in legend_rows:
        ax.axis("off")
    return fig, axes, legend_rows


def _legend_below(ax, legend_row) -> None:
    """`ax`'s legend at the top of its own row under it, one entry a line."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        legend_row.legend(handles, labels, loc="upper center", fontsize=7, frameon=False)


# (metrics key, label) of the accuracy panel, in order; a skill no model has is left out
SKILL_BARS = (("math_exact_match", "math"), ("math_exact_match_en", "English\nmath"),
              ("math_exact_match_zh", "Chinese\nmath"), ("math_format_rate", "#### N\nformat"),
              ("task_exact_match", "instruction\ntasks"), ("arithmetic_exact_match", "bare\narithmetic"),
              ("math_sample_accuracy", "sampled\nmath"))


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def eval_png(evals: dict[str, dict]) -> bytes | None:
    """Accuracy per skill, win rate vs SFT and KL to SFT (log axis) per model, 95% intervals."""
    fig = eval_figure(evals)
    return _png(fig) if fig is not None else None


def eval_figure(evals: dict[str, dict]):
    """The matplotlib figure of `eval_png`, or None."""
    models = [m for m in MODELS if m in evals]
    skills = [(k, label) for k, label in SKILL_BARS if any(_num(evals[m].get(k)) for m in models)]
    win = [m for m in models if _num(evals[m].get("win_rate_vs_sft"))]
    kl = [m for m in models if _num(evals[m].get("kl"))]
    panels = [p for p, present in (("skills", skills), ("win", win), ("kl", kl)) if present]
    if not panels:
        return None
    plt = _plt()
    widths = {"skills": max(3.0, 0.55 * len(skills) * max(1, len(models)) / 2.2),
              "win": max(2.6, 0.4 * len(win) + 0.5), "kl": max(2.8, 0.4 * len(kl) + 0.5)}
    # the skills on a row of their own, the win rate and KL under them: a figure about as wide as
    # the page, so that the page shows it near its own size
    under = [p for p in panels if p != "skills"]
    ratios = [widths[p] for p in under] or [widths["skills"]]
    spare = widths["skills"] - sum(ratios) if skills else 0.0
    if spare > 0:
        under, ratios = under + ["."], ratios + [spare]
    mosaic = ([["skills"] * len(ratios)] if skills else []) + ([under] if set(under) - {"."} else [])
    fig, axes_of = plt.subplot_mosaic(mosaic, width_ratios=ratios, figsize=(sum(ratios) + 0.6, 3.5 * len(mosaic) + 0.5),
                                      layout="constrained")
    axes = [axes_of[p] for p in panels]
    for ax, panel in zip(axes, panels):
        if panel == "skills":
            w = 0.8 / max(1, len(models))
            for j, m in enumerate(models):
                xs, vals, err_lo, err_hi = [], [], [], []
                for i, (k, _) in enumerate(skills):
                    v = evals[m].get(k)
                    if _num(v):
                        xs.append(i + (j - (len(models) - 1) / 2) * w)
                        vals.append(v)
                        err_lo.append(max(0.0, v - evals[m].get(f"{k}_lo", v)))
                        err_hi.append(max(0.0, evals[m].get(f"{k}_hi", v) - v))
                ax.bar(xs, vals, width=w, yerr=[err_lo, err_hi], capsize=2, color=COLORS.get(m), label=m,
                       error_kw={"lw": 0.8})
            ax.set_xticks(range(len(skills)), [label for _, label in skills], fontsize=8)
            _rate_axis(ax)
            ax.set_title("accuracy by skill (greedy; sampled: T=1)", fontsize=10)
        elif panel == "win":
            vals = [evals[m]["win_rate_vs_sft"] for m in win]
            lo = [max(0.0, v - evals[m].get("win_rate_vs_sft_lo", v)) for m, v in zip(win, vals)]
            hi = [max(0.0, evals[m].get("win_rate_vs_sft_hi", v) - v) for m, v in zip(win, vals)]
            ax.bar(win, vals, yerr=[lo, hi], capsize=3, color=[COLORS.get(m) for m in win])
            ax.axhline(0.5, color="gray", ls="--", lw=0.8)
            _rate_axis(ax)
            ax.set_title("win rate vs SFT (RM judge)", fontsize=10)
        else:
            _kl_panel(ax, kl, evals)
        if panel != "skills" and len(ax.get_xticks()) > 4:  # many model names: written vertically, so that
            plt.setp(ax.get_xticklabels(), rotation=90)     # long ones (grpo_random) keep clear of their neighbours
        ax.tick_params(labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # the models, when the skills panel is drawn
    fig.legend(handles, labels, loc="outside upper center", ncol=max(1, len(labels)), fontsize=8, frameon=False,
               title="error bars: 95% intervals", title_fontsize=8)
    return fig


def _kl_panel(ax, models: list[str], evals: dict[str, dict]) -> None:
    """KL to SFT per model as points on a log axis; 0 and negative estimates written as text."""
    pos = {m: evals[m]["kl"] for m in models if evals[m]["kl"] > 0}
    floor = min(pos.values()) / 10 if pos else 1e-3
    top = max(max((evals[m].get("kl_hi", v) for m, v in pos.items()), default=1.0), floor * 100) * 3
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, top)
    for i, m in enumerate(models):
        v = evals[m]["kl"]
        if v > 0:
            lo = evals[m].get("kl_lo", v)
            hi = evals[m].get("kl_hi", v)
            ax.errorbar([i], [v], yerr=[[v - max(lo, floor / 3)], [max(0.0, hi - v)]], fmt="o", ms=6,
                        color=COLORS.get(m), capsize=3)
            ax.annotate(f"{v:.2g}", (i, max(v, hi)), textcoords="offset points", xytext=(0, 4), ha="center",
                        va="bottom", fontsize=6.5)  # above its interval, clear of the neighbours
        else:  # staggered, so that neighbours' labels do not overlap
            text = "0\n(itself)" if v == 0 else f"{v:.1g}\n(< 0: noise)"
            ax.text(i, floor / 2 * (4 if i % 2 else 1), text, ha="center", va="bottom", fontsize=6.5,
                    color=COLORS.get(m))
    ax.set_xticks(range(len(models)), models)
    ax.set_xlim(-0.6, len(models) - 0.4)
    ax.set_title("KL to SFT, nats/token (log)", fontsize=10)


def placeholder_png(text: str) -> bytes:
    """A small image saying what is missing (a DVC out must exist even before its data does)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.0, 1.2))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, wrap=True)
    return _png(fig)


def overopt_png(curve: dict | None) -> bytes | None:
    """Proxy (RM score) and gold (verifier accuracy) against sqrt(KL to SFT), one panel each, the
    steps as faint points under their moving average, the gold's peak marked (llm.eval.report.overoptimisation)."""
    fig = overopt_figure(curve)
    return _png(fig) if fig is not None else None


def overopt_figure(curve: dict | None):
    """The matplotlib figure of `overopt_png`, or None."""
    if not curve:
        return None
    fig, axes, legend_rows = _panel_grid(2, ncol=2, width=4.5, height=3.2, legend_lines=1)
    x = curve["sqrt_kl"]
    for ax, legend_row, (key, label, color) in zip(axes, legend_rows, (("proxy", "RM score (proxy)", "C1"),
                                                                      ("gold", "verifier accuracy (gold)", "C2"))):
        ax.plot(x, curve[key], "o", ms=2.5, color=color, alpha=0.3)
        ax.plot(x, curve[f"{key}_smooth"], "-", lw=1.6, color=color, label=f"mean of {curve['window']}")
        if key == "gold":  # a rate: its whole range, as in the training curves
            _rate_axis(ax)
            ax.axvline(curve["peak_sqrt_kl"], color="k", lw=0.8, ls="--",
                       label="still rising at the end" if curve["still_rising"] else
                       "highest at the start: never rose" if curve.get("never_rose") else
                       f"peak at sqrt(KL) {curve['peak_sqrt_kl']:.3g}")
        _labelled(ax, legend_row, f"ppo_rm: {label}", "sqrt(KL to SFT), KL in nats per response", label)
    return fig


def _labelled(ax, legend_row, title: str, xlabel: str, ylabel: str) -> None:
    """A panel's title, axis labels, grid and its legend in its own row."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    _legend_below(ax, legend_row)


def _samples_axis(ax, legend_row, title: str, xlabel: str, ylabel: str) -> None:
    """A rate (0-100%) against a number of samples on a log2 axis, with its legend in its own row."""
    ax.set_xscale("log", base=2)
    _rate_axis(ax)
    _labelled(ax, legend_row, title, xlabel, ylabel)


def tiers_png(samples: dict[str, dict]) -> bytes | None:
    """pass@k against k (log axis) per difficulty tier, a line per model, from each model's
    samples file ("tier_pass_curves": {tier: [pass@1, ..., pass@n]}); None when no model has one."""
    fig = tiers_figure(samples)
    return _png(fig) if fig is not None else None


def tiers_figure(samples: dict[str, dict]):
    """The matplotlib figure of `tiers_png`, or None."""
    from llm.eval.paired import TIER_LABELS
    models = [m for m in MODELS if (samples.get(m) or {}).get("tier_pass_curves")]
    tiers = [t for t in TIER_LABELS if any(t in samples[m]["tier_pass_curves"] for m in models)]
    if not tiers:
        return None
    fig, axes, legend_rows = _panel_grid(len(tiers), ncol=3, width=3.6, height=3.0, legend_lines=len(models))
    for ax, legend_row, t in zip(axes, legend_rows, tiers):
        for i, m in enumerate(models):
            curve = samples[m]["tier_pass_curves"].get(t)
            if curve:
                ks = list(range(1, len(curve) + 1))
                ax.plot(ks, curve, "-o", ms=2.5, lw=1.4, color=f"C{i}", label=m)
        _samples_axis(ax, legend_row, f"tier: {TIER_LABELS[t]}", "k (samples)", "pass@k")
    return fig


RANKER_COLUMNS = (("likelihood", "SFT's likelihood"), ("per_token", "likelihood per token"),
                  ("reward_model", "reward model"), ("dpo_implicit", "DPO implicit reward"),
                  ("agreement", "agreement"), ("generative_verifier", "generative verifier"))


def rankers_png(curve: dict[str, list[float]] | None) -> bytes | None:
    """Best-of-n accuracy against n (log axis), a line per ranker, pass@n and a random pick dashed,
    from plots/rankers.tsv's columns; None without it."""
    fig = rankers_figure(curve)
    return _png(fig) if fig is not None else None


def rankers_figure(curve: dict[str, list[float]] | None):
    """The matplotlib figure of `rankers_png`, or None."""
    if not curve or not curve.get("n"):
        return None
    lines = [(k, label) for k, label in RANKER_COLUMNS if k in curve]
    fig, axes, legend_rows = _panel_grid(1, ncol=1, width=5.5, height=3.4, legend_lines=len(lines) + 2)
    ax, legend_row = axes[0], legend_rows[0]
    n = curve["n"]
    for i, (k, label) in enumerate(lines):
        ax.plot(n, curve[k], "-o", ms=2.5, lw=1.4, color=f"C{i}", label=label)
    if "pass_at_n" in curve:
        ax.plot(n, curve["pass_at_n"], "--", lw=1.2, color="k", label="pass@n (a perfect ranker)")
    if "random" in curve:
        ax.plot(n, curve["random"], ":", lw=1.2, color="0.4", label="a random pick (sampled accuracy)")
    _samples_axis(ax, legend_row, "rankers: the top-ranked of n samples, right?", "n (samples ranked)",
                  "best-of-n accuracy (exact checker)")
    return fig


def preference_png(pcurves: dict[str, dict] | None) -> bytes | None:
    """The gold and the proxy against sqrt(KL) on the continuation preference (module docstring);
    None without any run that measured them."""
    fig = preference_figure(pcurves)
    return _png(fig) if fig is not None else None


def preference_figure(pcurves: dict[str, dict] | None):
    """The matplotlib figure of `preference_png`, or None."""
    if not pcurves:
        return None
    fig, axes, legend_rows = _panel_grid(2, ncol=2, width=4.5, height=3.2, legend_lines=len(pcurves) + 1)
    for ax, legend_row, (key, label) in zip(axes, legend_rows, (("gold", "gold judge's mean (VADER)"),
                                                              ("proxy", "reward model's mean (proxy)"))):
        for i, (name, c) in enumerate(pcurves.items()):
            style = "-" if "n" in c else "-o"
            ax.plot(c["sqrt_kl"], c[key], style, ms=3, lw=1.5, color=f"C{i}", label=name)
            if key == "gold" and "ceiling" in c:
                ax.plot(c["sqrt_kl"], c["ceiling"], "--", lw=1.0, color=f"C{i}", alpha=0.7,
                        label="the judge's own pick of n (ceiling)")
        _labelled(ax, legend_row, f"continuations: {label}", "sqrt(KL to SFT), KL in nats per continuation", label)
    return fig
