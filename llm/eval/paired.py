"""Paired comparison of a model with its parent on the same evaluation items.

    child, parent = read_items("metrics/eval/ppo_items.jsonl"), read_items("metrics/eval/sft_items.jsonl")
    result = compare(child, parent, confidence=0.95, n_boot=10000, seed=1337)
    result["math_en"]   # {"n", "value", "parent_value", "delta", "lo", "hi", "p_value", "wins", ...}

Each eval@<model> writes one record per scored item (llm/eval/evaluate.py ITEM_SETS). Both models
answered the same items, so a change is measured item by item: the items both get right or
both get wrong say nothing about the change, and the noise of which items happened to be
drawn cancels. With d of n items flipping either way, the change's 95% interval is about
+-1.96 sqrt(d) / n: +-2.5 points when 40 of 500 items flip, where each model's own interval
at 70% is +-4 points wide and two such intervals overlap unless the accuracies differ by
more than about 8.

`skills(items)` names what the items measure, in report order: math overall, English, Chinese,
per level, the `#### N` format; instruction tasks overall and per kind; bare arithmetic; the
second turns of conversations and the out-of-scope answers without math, when evaluated; math
and bare arithmetic asked again in each context (after an out-of-scope request, after a task,
under each system message: `context_math_after_scope`, ...), paired over the same items asked in
that context, when evaluated; math per difficulty tier, greedy (`tier_edge`, ...) and sampled
(`tier_sampled_edge`, a score), when evaluated (llm/eval/tiers.py); the sampled math accuracy and
the reward model's score (scores, not right/wrong).

For a right/wrong skill on n paired items, with b items only the child gets right and c only
the parent:

    delta = (b - c) / n          (the change of the accuracy, exactly)
    p     = min(1, 2 P(X <= min(b, c))),  X ~ Binomial(b + c, 1/2)

the two-sided McNemar exact test: if nothing changed, each of the b + c discordant items is
as likely to favour either model. The interval of delta is the percentile bootstrap over
items; resampling n items of three types (only the child right, only the parent, the same)
is one multinomial draw of n, so each of the `n_boot` resamples costs one draw.

For a score (reward model score, sampled accuracy) delta is the mean of the per-item
differences, its interval the percentile bootstrap of that mean; there is no p-value.

`rm_separation(items)` asks a different question of one model's items: does the reward
model's score follow correctness on that model's own greedy math answers? It joins the "rm"
scores with the "math" outcomes by id and returns the AUC: the share of (right answer, wrong
answer) pairs in which the right one scores higher, ties counting half (0.5 = the score
carries nothing about being right; 1 = every right answer above every wrong one), with a
percentile bootstrap interval that resamples the right and the wrong answers separately.

`linear_trend(x, y)`: the least-squares line through a curve (an RL stage's reward per step) and
how much it says the curve moved from its first point to its last, with a t interval.

A change is called significant when the interval excludes zero and, for right/wrong skills,
McNemar's p is below 1 - confidence as well; where the two disagree (they can at the margin:
the bootstrap interval is approximate) it is "borderline", reported and not counted as a change.
Randomness: one numpy Generator per (seed, child, skill), so a run is reproducible and one
skill's resamples do not depend on which other skills exist.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

# Skills that hold right/wrong outcomes; the others hold scores.
_SCORE_SETS = {"math_sampled": ("score", "sampled math accuracy"), "rm": ("score", "reward model score"),
               "continuation": ("score", "gold judge of a continuation")}
# The items asked again in contexts (set "context": "of" names the items, "context" where they were
# asked; llm/eval/evaluate.py context_items), as the report words them.
CONTEXT_OF = {"math": "math", "arithmetic": "bare arithmetic"}
# The difficulty tiers of set "tier" (greedy) and "tier_sampled" (the share of right samples),
# in report order (llm/eval/tiers.py).
TIER_LABELS = {"in_distribution": "in distribution", "edge": "the edge", "harder": "harder, never trained on"}
CONTEXT_WHERE = {"after_scope": " after an out-of-scope request", "after_task": " after an instruction task",
                 "system_short": ' under "You are terse."', "system_helpful": ' under "You are a helpful assistant."',
                 "system_unseen": " under a system message no training conversation has"}


def read_items(path: str | Path) -> list[dict]:
    """The records of one <model>_items.jsonl (a missing file is the caller's to report)."""
    return parse_items(Path(path).read_text(encoding="utf-8"), str(path))


def parse_items(text: str, where: str) -> list[dict]:
    """The records in the text of a <model>_items.jsonl; `where` names it in errors."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}:{i}: not JSON ({e.msg}); rerun the eval stage") from None
            if not isinstance(rec, dict) or "set" not in rec or "id" not in rec:
                raise ValueError(f"{where}:{i}: expected an object with 'set' and 'id'; rerun the eval stage")
            out.append(rec)
    return out


def skills(items: Iterable[dict]) -> list[tuple[str, str, str, Callable[[dict], bool], str]]:
    """(key, label, item set, which items, outcome field) for every skill the items measure."""
    items = list(items)
    present = {r["set"] for r in items}
    langs = sorted({r.get("lang") for r in items if r["set"] == "math" and r.get("lang")},
                   key=lambda x: (x != "en", x))
    levels = sorted({r.get("level") for r in items if r["set"] == "math" and r.get("level")})
    kinds = list(dict.fromkeys(r["kind"] for r in items if r["set"] == "task" and r.get("kind")))  # file order
    contexts = list(dict.fromkeys((r.get("of"), r.get("context")) for r in items if r["set"] == "context"))
    every = lambda r: True  # noqa: E731
    lang_name = {"en": "English", "zh": "Chinese"}
    out: list[tuple[str, str, str, Callable[[dict], bool], str]] = []
    if "math" in present:
        out.append(("math", "math", "math", every, "correct"))
        out += [(f"math_{lg}", f"{lang_name.get(lg, lg)} math", "math", lambda r, lg=lg: r.get("lang") == lg, "correct")
                for lg in langs]
        out += [(f"math_level{lv}", f"math level {lv}", "math", lambda r, lv=lv: r.get("level") == lv, "correct")
                for lv in levels]
        out.append(("math_format", "#### N answer format", "math", every, "formatted"))
    if "task" in present:
        out.append(("task", "instruction tasks", "task", every, "correct"))
        out += [(f"task_{k}", f"task: {k.replace('_', ' ')}", "task", lambda r, k=k: r.get("kind") == k, "correct")
                for k in kinds]
    if "arithmetic" in present:
        out.append(("arithmetic", "bare arithmetic", "arithmetic", every, "correct"))
    if "multiturn" in present:
        out.append(("multiturn", "second turns", "multiturn", every, "correct"))
    if "scope" in present:
        out.append(("scope", "out-of-scope answers without math", "scope", every, "correct"))
    out += [(f"context_{of}_{ctx}", f"{CONTEXT_OF.get(of, of)}{CONTEXT_WHERE.get(ctx, f' in context {ctx}')}",
             "context", lambda r, of=of, ctx=ctx: r.get("of") == of and r.get("context") == ctx, "correct")
            for of, ctx in contexts]
    tiers = {r.get("tier") for r in items if r["set"] in ("tier", "tier_sampled")}
    tiers = [t for t in TIER_LABELS if t in tiers] + sorted(t for t in tiers if t not in TIER_LABELS)
    for item_set, what, field in (("tier", "math", "correct"), ("tier_sampled", "sampled math", "score")):
        if item_set in present:
            out += [(f"{item_set}_{t}", f"{what}, tier: {TIER_LABELS.get(t, t)}", item_set,
                     lambda r, t=t: r.get("tier") == t, field) for t in tiers]
    for s, (field, label) in _SCORE_SETS.items():
        if s in present:
            out.append(({"rm": "rm_score"}.get(s, s), label, s, every, field))
    return out


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs."""
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2 ** m
    return min(1.0, 2 * tail)


def percentile_interval(x: np.ndarray, confidence: float) -> tuple[float, float]:
    """The central `confidence` interval of bootstrap draws `x` (the percentile method)."""
    a = (1 - confidence) / 2
    lo, hi = np.quantile(x, [a, 1 - a])
    return float(lo), float(hi)


def bootstrap_binary(b: int, c: int, n: int, *, confidence: float, n_boot: int,
                     rng: np.random.Generator) -> tuple[float, float]:
    """Percentile bootstrap interval of (b - c) / n, resampling n paired items."""
    if n == 0:
        return 0.0, 0.0
    counts = rng.multinomial(n, [b / n, c / n, 1 - (b + c) / n], size=n_boot)  # (n_boot, 3)
    return percentile_interval((counts[:, 0] - counts[:, 1]) / n, confidence)


def bootstrap_mean(diffs: np.ndarray, *, confidence: float, n_boot: int,
                   rng: np.random.Generator) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-item differences."""
    if len(diffs) == 0:
        return 0.0, 0.0
    return percentile_interval(bootstrap_means(diffs, n_boot=n_boot, rng=rng), confidence)


def bootstrap_means(diffs: np.ndarray, *, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot,) means of resamples of `diffs` with replacement, drawn in chunks of at most ~2M
    indices (bounded memory)."""
    n = len(diffs)
    means = np.empty(n_boot)
    step = max(1, 2_000_000 // n)
    for s in range(0, n_boot, step):
        k = min(step, n_boot - s)
        means[s:s + k] = diffs[rng.integers(0, n, size=(k, n))].mean(1)
    return means


def compare(child: list[dict], parent: list[dict], *, confidence: float = 0.95, n_boot: int = 10000,
            seed: int = 0, child_name: str = "") -> dict[str, dict[str, Any]]:
    """Per skill the paired change from `parent` to `child` (records of <model>_items.jsonl).

    Items are paired by (set, id); items only one model has are left out and counted in
    "unpaired". Returns {skill: {"label", "type" ("rate" | "score"), "n", "value",
    "parent_value", "delta", "lo", "hi", "significant", "borderline", "unpaired"}, plus
    "p_value", "wins" (b) and "losses" (c) for rates}. A skill with no paired item is left out.
    """
    alpha = 1 - confidence
    for which, recs in (("child", child), ("parent", parent)):
        seen: set[tuple[str, str]] = set()
        for r in recs:
            if (r["set"], r["id"]) in seen:
                raise ValueError(f"paired: {which} {child_name}: item {r['id']!r} of set {r['set']!r} appears twice;"
                                 f" ids must be unique within a set (rerun prepare and eval)")
            seen.add((r["set"], r["id"]))
    by_key = {(r["set"], r["id"]): r for r in parent}
    out: dict[str, dict[str, Any]] = {}
    for key, label, item_set, which, field in skills(child + parent):
        mine = [r for r in child if r["set"] == item_set and which(r)]
        pairs = [(r, by_key[(item_set, r["id"])]) for r in mine if (item_set, r["id"]) in by_key]
        theirs = sum(1 for r in parent if r["set"] == item_set and which(r))
        if not pairs:
            continue
        rng = np.random.default_rng([seed, *f"{child_name}/{key}".encode()])
        n = len(pairs)
        x = np.array([float(a[field]) for a, _ in pairs])
        y = np.array([float(p[field]) for _, p in pairs])
        res: dict[str, Any] = {"label": label, "n": n, "value": float(x.mean()), "parent_value": float(y.mean()),
                               "delta": float((x - y).mean()), "unpaired": len(mine) + theirs - 2 * n}
        if field == "score":
            res["type"] = "score"
            res["lo"], res["hi"] = bootstrap_mean(x - y, confidence=confidence, n_boot=n_boot, rng=rng)
            test_says = None
        else:
            b, c = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
            res.update({"type": "rate", "wins": b, "losses": c, "p_value": mcnemar_exact(b, c)})
            res["lo"], res["hi"] = bootstrap_binary(b, c, n, confidence=confidence, n_boot=n_boot, rng=rng)
            test_says = res["p_value"] < alpha
        interval_says = res["lo"] > 0 or res["hi"] < 0
        res["significant"] = interval_says and test_says is not False
        res["borderline"] = test_says is not None and interval_says != test_says
        out[key] = res
    return out


def separation(scores, right, *, confidence: float = 0.95, n_boot: int = 2000,
               rng: np.random.Generator) -> dict[str, Any] | None:
    """How well `scores` rank the right answers above the wrong ones (`right`: one bool per
    score): {"auc", "lo", "hi", "mean_right", "mean_wrong", "n_right", "n_wrong"}, or None when
    either group is empty. auc = P(a right answer's score > a wrong one's) + P(equal) / 2 over
    all n_right x n_wrong pairs (Mann-Whitney's U / (n_right n_wrong)); lo, hi: the percentile
    bootstrap, each resample drawing n_right right and n_wrong wrong answers with replacement.
    Memory and time grow with n_boot x n, not with n_right x n_wrong."""
    x = np.asarray(scores, dtype=np.float64)
    ok = np.asarray(right, dtype=bool)
    if x.shape != ok.shape:
        raise ValueError(f"separation: {x.size} scores but {ok.size} labels")
    pos, neg = x[ok], np.sort(x[~ok])
    n1, n0 = len(pos), len(neg)
    if not n1 or not n0:
        return None
    below = np.searchsorted(neg, pos, side="left")    # wrong answers scoring less than each right one
    upto = np.searchsorted(neg, pos, side="right")    # ... less or equal

    def auc(cp: np.ndarray, cn: np.ndarray) -> np.ndarray:
        """(k,) AUCs for k resamples given as draw counts: cp (k, n1), cn (k, n0) in `neg` order."""
        c = np.concatenate([np.zeros((len(cn), 1)), np.cumsum(cn, axis=1)], axis=1)  # c[:, j] = draws among neg[:j]
        wins = c[:, below] + 0.5 * (c[:, upto] - c[:, below])                         # (k, n1)
        return (cp * wins).sum(1) / (n1 * n0)

    point = float(auc(np.ones((1, n1)), np.ones((1, n0)))[0])
    boots = np.empty(n_boot)
    step = max(1, 2_000_000 // (n1 + n0))  # bounded memory, as bootstrap_means
    for s in range(0, n_boot, step):
        k = min(step, n_boot - s)
        boots[s:s + k] = auc(rng.multinomial(n1, np.full(n1, 1 / n1), size=k),
                             rng.multinomial(n0, np.full(n0, 1 / n0), size=k))
    lo, hi = percentile_interval(boots, confidence)
    return {"auc": point, "lo": lo, "hi": hi, "mean_right": float(pos.mean()), "mean_wrong": float(neg.mean()),
            "n_right": n1, "n_wrong": n0}


def rm_separation(items: list[dict], *, confidence: float = 0.95, n_boot: int = 2000,
                  seed: int = 0) -> dict[str, Any] | None:
    """`separation` of one model's reward model scores (items of set "rm") by the outcome of
    the same greedy answers (set "math", joined by id); None without both right and wrong
    answers among the scored ones."""
    right = {r["id"]: bool(r["correct"]) for r in items if r["set"] == "math"}
    pairs = [(float(r["score"]), right[r["id"]]) for r in items if r["set"] == "rm" and r["id"] in right]
    if not pairs:
        return None
    scores, ok = zip(*pairs)
    return separation(scores, ok, confidence=confidence, n_boot=n_boot, rng=np.random.default_rng([seed, 0x524d]))


def t_quantile(p: float, df: int) -> float:
    """The p quantile (p > 0.5) of Student's t with df degrees of freedom: bisection on its CDF,
    whose density is integrated by Simpson's rule (t(2) at 0.975 is 4.303, t(10) 2.228)."""
    if df < 1 or not 0.5 < p < 1:
        raise ValueError(f"t_quantile: need df >= 1 and 0.5 < p < 1, got df={df}, p={p}")
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, n: int = 4000) -> float:  # P(T <= x) for x >= 0
        h = x / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def linear_trend(xs, ys, confidence: float = 0.95) -> dict[str, float] | None:
    """The least-squares line y = a + b x through the points: {"change", "lo", "hi", "n"}, where
    change = b (x_last - x_first) is how much the line moves over the curve and lo, hi its
    t interval (n - 2 degrees of freedom; the points taken as independent around the line, as
    an RL stage's per-step rewards are: each step draws its own prompts). None with fewer than 3
    points or a single x."""
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    n = len(x)
    sxx = float(((x - x.mean()) ** 2).sum()) if n else 0.0
    if n < 3 or sxx == 0.0:
        return None
    b = float(((x - x.mean()) * (y - y.mean())).sum()) / sxx
    resid = y - y.mean() - b * (x - x.mean())
    se = math.sqrt(float((resid ** 2).sum()) / (n - 2) / sxx)
    span = float(x.max() - x.min())
    half = t_quantile(1 - (1 - confidence) / 2, n - 2) * se * span
    return {"change": b * span, "lo": b * span - half, "hi": b * span + half, "n": n}


def ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tied = x == v
        r[tied] = r[tied].mean()
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks); None where either side is constant."""
    ra, rb = ranks(a), ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])
