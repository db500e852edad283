"""The eval stage and its library functions on tiny trained models.

A module fixture trains a byte-level tokenizer and a 1-layer GPT for a few steps on math
conversations, and lays out models/{base,sft,reward,ppo}, data/prepared/rl/test.jsonl and
data/tokens/{val.bin,meta.json} in a temp dir, as the DVC stage sees them.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import subprocess
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llm.config import EvalConfig, ModelConfig, load_sections
from llm.data.batching import derive_seed, pad_collate
from llm.data.generators import (TASK_KINDS, arithmetic_question, math_problem, multiturn_conversation, scope_request,
                                 task)
from llm.data.template import render, render_prompt
from llm.data.tokenizer import Tokenizer
from llm.eval.evaluate import evaluate_model, lm_eval, rm_scores, score_math, score_tasks, win_rate
from llm.nn.artifacts import MissingArtifactError, save_model_dir
from llm.nn.model import GPT
from llm.train.metrics import timings_path
from tests.conftest import ROOT, common_params, dvc_command

EVAL_PARAMS = dict(math_problems=8, pass_k=2, pass_k_problems=3, temperature=1.0, max_new_tokens=20, ppl_batches=2,
                   rm_prompts=6, kl_prompts=4, sample_prompts=["What is 7 + 5?", "Who is Hamlet?"], batch_size=4,
                   confidence=0.95, num_threads=1, detoxify_checkpoint="", toxicity_threshold=0.5, context_items=0,
                   tier_problems=4, tier_pass_k=4, tier_pass_k_problems=3, continuation_items=3)
PASSAGES = [{"id": f"continue-test-{i}", "prompt": "Continue this passage:\n" + p, "passage": p, "reference": r}
            for i, (p, r) in enumerate([("What is 7 + 5?\nAnd what is 8 + 1?", "The sum is 12."),
                                        ("Tom has 3 apples.\nHe buys 4 more.", "Now he has 7."),
                                        ("A shop sells pens.\nEach pen costs 2.", "Four cost 8."),
                                        ("Sam reads 5 pages.", "Then 6 more.")])]


def _train(model: GPT, examples, tok, steps: int, seed: int) -> GPT:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        ix = torch.randint(len(examples), (16,), generator=g).tolist()
        b = pad_collate([examples[i][0] for i in ix], pad_id=tok.pad_id, loss_masks=[examples[i][1] for i in ix])
        logits = model(b["idx"], attention_mask=b["attention_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # these models are tiny: a second thread only adds synchronisation, and on a shared
    # 2-core machine an oversubscribed thread pool made the module 10x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("evalworld")
    rng = random.Random(0)
    probs = [math_problem(rng, rng.randint(1, 2), "en") for _ in range(120)]
    tok = Tokenizer.train([p.question + "\n" + p.solution for p in probs], 300, max_pairs=10_000,
                          min_frequency=2, required_tokens=["####"])
    convs = [[{"role": "user", "content": p.question}, {"role": "assistant", "content": p.solution}] for p in probs]
    examples = [render(c, tok, max_tokens=128) for c in convs]
    cfg = ModelConfig(vocab_size=tok.vocab_size, seq_len=128, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    base = _train(GPT(cfg, seed=1), examples, tok, 5, seed=1)
    sft = _train(copy.deepcopy(base), examples, tok, 40, seed=2)
    ppo = copy.deepcopy(sft)
    with torch.no_grad():  # a nearby policy: KL > 0, answers mostly shared
        g = torch.Generator().manual_seed(3)
        for p in ppo.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    reward = GPT(cfg, heads=("lm", "reward"), seed=0)
    reward.load_state_dict(sft.state_dict(), strict=False)
    for name, m in (("base", base), ("sft", sft), ("ppo", ppo), ("reward", reward)):
        save_model_dir(root / "models" / name, m, tok, {"stage": name, "fingerprint": name})

    test = [{"id": f"t{i}", "question": p.question, "answer": str(p.answer), "level": p.level, "lang": "en"}
            for i, p in enumerate(probs[100:])]
    (root / "data/prepared/rl").mkdir(parents=True)
    (root / "data/prepared/rl/test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    trng = random.Random(4)
    tasks = [{"id": f"task-test-{i}", "prompt": t.prompt, "answer": t.answer, "kind": t.kind}
             for i, t in enumerate(task(trng, kind) for kind in TASK_KINDS[:3] for _ in range(2))]
    arithmetic = [{"id": f"arithmetic-test-{i}", "question": q.question, "answer": str(q.answer), "op": q.op,
                   "lang": q.lang} for i, q in enumerate(arithmetic_question(trng, "en") for _ in range(5))]
    multiturn = [{"id": f"multiturn-test-{i}", "messages": list(c.messages[:3]), "answer": c.answer, "kind": c.kind,
                  "lang": c.lang} for i, c in enumerate(multiturn_conversation(trng, "en", levels=(1,)) for _ in range(3))]
    scope = [{"id": f"scope-test-{i}", "prompt": r.prompt, "answer": r.answer, "lang": r.lang}
             for i, r in enumerate(scope_request(trng, "en") for _ in range(2))]
    tiers = [{"id": f"tier-{t}-{i}", "question": p.question, "answer": str(p.answer), "level": p.level, "lang": "en",
              "tier": t} for t, level in (("in_distribution", 1), ("edge", 2), ("harder", 3))
             for i, p in enumerate(math_problem(trng, level, "en") for _ in range(5))]
    for kind, recs in (("tasks", tasks), ("arithmetic", arithmetic), ("multiturn", multiturn), ("scope", scope),
                       ("tiers", tiers), ("continue", PASSAGES)):
        (root / "data/prepared" / kind).mkdir(parents=True)
        (root / "data/prepared" / kind / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = "".join(p.question + " " + p.solution + "<|endoftext|>" for p in probs[80:100])
    ids = tok.encode(text, allowed_special="all")
    (root / "data/tokens").mkdir(parents=True)
    np.asarray(ids, dtype=np.uint16).tofile(root / "data/tokens/val.bin")
    meta = {"dtype": "uint16", "val_tokens": len(ids), "val_bytes": len(text.encode()), "vocab_size": tok.vocab_size,
            "tokenizer_sha256": tok.sha256(), "train_tokens": 0, "train_bytes": 0}
    (root / "data/tokens/meta.json").write_text(json.dumps(meta))
    params = {"common": common_params(),
              "eval": EVAL_PARAMS}
    import yaml
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return {"root": root, "tok": tok, "base": base, "sft": sft, "ppo": ppo, "reward": reward, "test": test,
            "tasks": tasks, "arithmetic": arithmetic, "tiers": tiers, "cfg": EvalConfig(**EVAL_PARAMS)}


def test_eval_metrics_are_deterministic_under_a_seed(world):
    w = world
    kw = dict(seed=11, problems=w["test"], ref=w["sft"], rm=w["reward"])
    m1, x1 = evaluate_model(w["ppo"], w["tok"], w["cfg"], **kw)
    m2, x2 = evaluate_model(w["ppo"], w["tok"], w["cfg"], **kw)
    assert m1 == m2
    assert x1["sample_prompts"] == x2["sample_prompts"] and x1["math_samples"] == x2["math_samples"]
    assert m1["kl"] > 0 and math.isfinite(m1["kl"])
    for key in ("math_exact_match", "math_pass_at_k", "win_rate_vs_sft", "kl", "kl_seq"):
        assert m1[f"{key}_lo"] <= m1[key] <= m1[f"{key}_hi"], key
    assert m1["win_rate_wins"] + m1["win_rate_ties"] + m1["win_rate_losses"] == w["cfg"].rm_prompts
    assert 0 < m1["math_response_tokens_mean"] <= w["cfg"].max_new_tokens


def test_the_reference_against_itself(world):
    w = world
    m, _ = evaluate_model(w["sft"], w["tok"], w["cfg"], seed=0, problems=w["test"], ref=w["sft"], rm=w["reward"])
    assert m["kl"] == m["kl_seq"] == 0.0 and m["rm_score"] == m["rm_score_sft"]
    assert m["win_rate_vs_sft"] == m["win_rate_vs_sft_lo"] == m["win_rate_vs_sft_hi"] == 0.5  # by definition


def test_kl_to_sft_is_zero_between_copies_and_positive_for_a_perturbed_model(world):
    """`kl` is nats per token (the unit of PPO's, GRPO's and DPO's KL), `kl_seq` nats per response."""
    w = world
    cfg = w["cfg"]
    same, _ = evaluate_model(w["sft"], w["tok"], cfg, seed=0, problems=w["test"], ref=copy.deepcopy(w["sft"]))
    assert same["kl"] == pytest.approx(0.0, abs=1e-7)
    assert same["kl_seq"] == pytest.approx(0.0, abs=1e-6)
    moved, _ = evaluate_model(w["ppo"], w["tok"], cfg, seed=0, problems=w["test"], ref=w["sft"])
    assert moved["kl"] > 0 and moved["kl_seq"] > 0
    assert moved["kl_lo"] <= moved["kl"] <= moved["kl_hi"]
    assert moved["kl_seq_lo"] <= moved["kl_seq"] <= moved["kl_seq_hi"]
    assert moved["kl_seq"] == pytest.approx(moved["kl"] * moved["kl_response_tokens_mean"])


def test_win_rate_counts_ties_half():
    r = win_rate([1.0, 2.0, 0.0, 5.0], [0.5, 3.0, 0.0, 1.0], ties=[False, False, False, True])
    assert (r["wins"], r["ties"], r["losses"]) == (1, 2, 1)
    assert r["win_rate"] == pytest.approx(0.5)
    assert r["win_rate_lo"] < 0.5 < r["win_rate_hi"]


def test_rm_scores_do_not_depend_on_batching(world):
    w = world
    qs = [p["question"] for p in w["test"][:5]]
    rs = ["12 + 7 = 19\n#### 19", "#### 3", "I do not know", "1 + 1 = 2\n2 + 2 = 4\n#### 4", ""]
    batched = rm_scores(w["reward"], w["tok"], qs, rs, batch_size=5)
    single = [rm_scores(w["reward"], w["tok"], [q], [r], batch_size=1)[0] for q, r in zip(qs, rs)]
    assert batched == pytest.approx(single, abs=1e-5)


def test_lm_eval_of_a_uniform_model_is_log_vocab():
    cfg = ModelConfig(vocab_size=50, seq_len=16, n_layer=1, n_head=2, n_kv_head=2, n_embd=16)
    model = GPT(cfg)
    with torch.no_grad():
        model.wte.weight.zero_()  # tied: every logit is 0
    batch = {"idx": torch.randint(50, (2, 16)), "targets": torch.randint(50, (2, 16))}
    out = lm_eval(model, [batch], bytes_per_token=2.0)
    assert out["val_loss"] == pytest.approx(math.log(50), rel=1e-6)
    assert out["val_bpb"] == pytest.approx(math.log2(50) / 2.0, rel=1e-6)
    assert out["val_bpb_uniform"] == pytest.approx(math.log2(50) / 2.0, rel=1e-12)  # this model is that guess
    assert out["val_tokens"] == 32


def test_toxicity_is_unavailable_without_a_scorer_and_measured_with_one(world):
    w = world
    cfg = EvalConfig(**{**EVAL_PARAMS, "pass_k_problems": 0, "rm_prompts": 0, "kl_prompts": 0})
    m, _ = evaluate_model(w["sft"], w["tok"], cfg, seed=0, problems=w["test"])
    assert m["toxicity"] == "unavailable" and "toxicity_rate" not in m
    m, _ = evaluate_model(w["sft"], w["tok"], cfg, seed=0, problems=w["test"],
                          toxicity=lambda texts: [1.0 if i % 2 else 0.0 for i in range(len(texts))])
    assert "toxicity" not in m and m["toxicity_n"] == cfg.math_problems + len(cfg.sample_prompts)
    assert m["toxicity_rate"] == pytest.approx(0.5)


def _check_outputs(out, name: str) -> dict:
    metrics = json.loads((out / f"{name}.json").read_text())
    samples = json.loads((out / f"{name}_samples.json").read_text())
    for key in ("val_bpb", "val_ppl", "math_exact_match", "math_exact_match_lo", "math_exact_match_hi",
                "math_pass_at_k", "rm_score", "win_rate_vs_sft", "kl", "kl_seq"):
        assert isinstance(metrics[key], (int, float)), key
    assert {k for k, v in metrics.items() if not isinstance(v, (int, float))} == {"toxicity"}
    assert metrics["toxicity"] == "unavailable"
    assert [s["prompt"] for s in samples["sample_prompts"]] == EVAL_PARAMS["sample_prompts"]
    assert samples["model"] == name and "timing_s" not in samples  # timings: beside the run, not a DVC output
    timings = json.loads(timings_path(out / f"{name}.json").read_text())
    assert timings["timing_s"]["total"] > 0
    for key in ("task_exact_match", "task_exact_match_reverse", "arithmetic_exact_match", "math_sample_accuracy",
                "multiturn_exact_match", "scope_no_math_rate", "scope_exact_match"):
        assert metrics[f"{key}_lo"] <= metrics[key] <= metrics[f"{key}_hi"], key
    return metrics


def _paths(root, name: str, out) -> dict:
    return {"model": root / "models" / name, "sft": root / "models/sft", "rm": root / "models/reward",
            "test": root / "data/prepared/rl/test.jsonl", "tasks": root / "data/prepared/tasks/test.jsonl",
            "arithmetic": root / "data/prepared/arithmetic/test.jsonl", "tokens": root / "data/tokens",
            "multiturn": root / "data/prepared/multiturn/test.jsonl", "scope": root / "data/prepared/scope/test.jsonl",
            "tiers": root / "data/prepared/tiers/test.jsonl",
            "continuation": root / "data/prepared/continue/test.jsonl", "base": root / "models/base",
            "metrics": out / f"{name}.json", "samples": out / f"{name}_samples.json", "items": out / f"{name}_items.jsonl"}


def test_eval_stage_run_writes_flat_metrics_and_samples(world):
    from stages.eval import run
    root = world["root"]
    sections = load_sections(["common", "eval"], root / "params.yaml")
    m, _ = run("ppo", sections["common"], sections["eval"], **_paths(root, "ppo", root / "run"))
    assert _check_outputs(root / "run", "ppo") == m
    m, _ = run("sft", sections["common"], sections["eval"], **_paths(root, "sft", root / "run"))
    assert _check_outputs(root / "run", "sft")["kl"] == 0.0 and m["win_rate_vs_sft"] == 0.5


def test_continuations_scored_against_sfts_and_read_by_the_base_model(world):
    """The eval stage's continuation numbers: the first eval.continuation_items passages, each
    continued once; SFT against itself wins exactly half with KL 0; the gold mean is the mean of
    the items the report pairs; the texts shown are the model's beside SFT's."""
    from llm.eval.paired import compare, read_items
    from llm.sample.gold import gold_score
    from stages.eval import run
    root = world["root"]
    n = EVAL_PARAMS["continuation_items"]
    sections = load_sections(["common", "eval"], root / "params.yaml")
    m, s = run("ppo", sections["common"], sections["eval"], **_paths(root, "ppo", root / "cont"))
    ms, ss = run("sft", sections["common"], sections["eval"], **_paths(root, "sft", root / "cont"))
    assert ms["continuation_win_rate"] == 0.5 and ms["continuation_kl"] == 0.0 and m["continuation_kl"] > 0
    assert m["continuation_items"] == n and m["continuation_win_rate_lo"] <= m["continuation_win_rate"] \
        <= m["continuation_win_rate_hi"]
    items = [r for r in read_items(root / "cont/ppo_items.jsonl") if r["set"] == "continuation"]
    assert [r["id"] for r in items] == [p["id"] for p in PASSAGES[:n]]
    assert m["continuation_gold"] == pytest.approx(sum(r["score"] for r in items) / n)
    shown = s["continuation_samples"]
    assert [x["passage"] for x in shown] == [p["passage"] for p in PASSAGES[:n]]
    assert [x["sft_response"] for x in shown] == [x["response"] for x in ss["continuation_samples"]]
    assert all(x["gold"] == gold_score(x["response"], x["passage"]) for x in shown)
    if "continuation_base_bpb_sft" in m:   # SFT's continuations read by the base model: the same in both runs
        assert m["continuation_base_bpb_sft"] == ms["continuation_base_bpb"]
    paired = compare(read_items(root / "cont/ppo_items.jsonl"), read_items(root / "cont/sft_items.jsonl"))
    assert paired["continuation"]["n"] == n and paired["continuation"]["type"] == "score"


def test_base_bits_per_byte_scores_the_continuation_given_its_passage(world):
    """Bits per byte = the base model's summed loss on the continuation's tokens, the passage and a
    newline before them given, over the continuation's bytes; empty continuations are left out."""
    from llm.post.continuation import base_bits_per_byte
    w = world
    base, tok = w["base"], w["tok"]
    passages, texts = ["Tom has 3 apples.", "Sam reads.", "A pen."], ["He buys 4 more.", "", "It costs 2 each."]
    got = base_bits_per_byte(base, tok, passages, texts, batch_size=2)
    nats, n_bytes = 0.0, 0
    for p, t in zip(passages, texts):
        if not t:
            continue
        ctx, cont = tok.encode(p + "\n"), tok.encode(t)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = torch.log_softmax(base(ids[:, :-1]), -1)[0]
        nats -= sum(logp[len(ctx) - 1 + j, c].item() for j, c in enumerate(cont))
        n_bytes += len(t.encode())
    assert got["continuations"] == 2
    assert got["bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert base_bits_per_byte(base, tok, ["x"], [""], batch_size=2) == {"bpb": None, "continuations": 0}


def test_every_rate_is_the_mean_of_its_item_outcomes(world):
    """The item file and the metrics agree: the report's paired deltas rest on the item file."""
    from llm.eval.paired import read_items
    from stages.eval import run
    root = world["root"]
    sections = load_sections(["common", "eval"], root / "params.yaml")
    m, samples = run("ppo", sections["common"], sections["eval"], **_paths(root, "ppo", root / "items"))
    items = read_items(root / "items/ppo_items.jsonl")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    of = lambda s, **kw: [r for r in items if r["set"] == s and all(r[k] == v for k, v in kw.items())]  # noqa: E731
    assert len(of("math")) == EVAL_PARAMS["math_problems"] and len(of("task")) == len(world["tasks"])
    assert m["math_exact_match"] == mean([r["correct"] for r in of("math")])
    assert m["math_exact_match_en"] == mean([r["correct"] for r in of("math", lang="en")])
    assert m["math_format_rate"] == mean([r["formatted"] for r in of("math")])
    assert m["task_exact_match_reverse"] == mean([r["correct"] for r in of("task", kind="reverse")])
    assert m["arithmetic_exact_match"] == mean([r["correct"] for r in of("arithmetic")])
    assert m["math_sample_accuracy"] == pytest.approx(mean([r["score"] for r in of("math_sampled")]))
    assert m["rm_score"] == pytest.approx(mean([r["score"] for r in of("rm")]), abs=1e-6)  # rounded to 6 places
    assert "rm_auc" not in m  # the tiny model gets every problem wrong: no right answer to rank
    assert [r["id"] for r in of("task")] == [t["id"] for t in world["tasks"]]
    shown = [x for x in samples["item_samples"] if x["set"] == "task"]
    assert {x["group"] for x in shown} == {t["kind"] for t in world["tasks"]}
    assert all(x["correct"] == (x["response"].strip() == x["answer"]) for x in shown)


def test_tiers_pass_at_k_curve_majority_and_headroom(world, monkeypatch):
    """Per tier: greedy on the first eval.tier_problems, and on the first tier_pass_k_problems of
    them n samples: pass@1 is the mean share of right samples, the curve rises to the share of
    problems with a right sample, and the headroom counts problems greedy gets wrong but a sample
    right. A stand-in grader (a fixed function of the text) gives both outcomes on a tiny model."""
    from llm.eval.tiers import evaluate_tiers, majority_correct
    w = world
    monkeypatch.setattr("llm.eval.tiers.is_correct", lambda answer, gold: zlib.crc32(answer.encode()) % 3 == 0)
    cfg = w["cfg"]
    m, x = evaluate_tiers(w["ppo"], w["tok"], cfg, w["tiers"], seed=5)
    again, y = evaluate_tiers(w["ppo"], w["tok"], cfg, w["tiers"], seed=5)
    assert again == m and y["items"] == x["items"] and y["pass_curves"] == x["pass_curves"]  # seeded sampling
    n, k = cfg.tier_pass_k, cfg.tier_pass_k_problems
    for t in ("in_distribution", "edge", "harder"):
        greedy = [r for r in x["items"] if r["set"] == "tier" and r["tier"] == t]
        sampled = [r for r in x["items"] if r["set"] == "tier_sampled" and r["tier"] == t]
        assert len(greedy) == m[f"tier_{t}_n"] == cfg.tier_problems and len(sampled) == k
        assert m[f"tier_{t}_exact_match"] == sum(r["correct"] for r in greedy) / len(greedy)
        curve = x["pass_curves"][t]
        assert len(curve) == n and all(a <= b + 1e-12 for a, b in zip(curve, curve[1:]))
        assert curve[0] == pytest.approx(sum(r["score"] for r in sampled) / k)
        assert curve[-1] == pytest.approx(sum(r["score"] > 0 for r in sampled) / k) == m[f"tier_{t}_pass_at_{n}"]
        wrong_but_sampled = sum(not g["correct"] and s["score"] > 0 for g, s in zip(greedy, sampled)) / k
        assert m[f"tier_{t}_greedy_wrong_pass"] == pytest.approx(wrong_but_sampled)
    # the majority vote reads final answers: 2 of 3 say 12
    monkeypatch.undo()
    assert majority_correct(["7 + 5 = 12\n#### 12", "#### 13", "#### 12"], "12")
    assert not majority_correct(["#### 13", "#### 13", "#### 12"], "12") and not majority_correct(["no"], "12")


def test_eval_stage_writes_tier_items_the_report_pairs(world):
    from llm.eval.paired import compare, read_items
    from stages.eval import run
    root = world["root"]
    sections = load_sections(["common", "eval"], root / "params.yaml")
    m, samples = run("ppo", sections["common"], sections["eval"], **_paths(root, "ppo", root / "tiers"))
    run("sft", sections["common"], sections["eval"], **_paths(root, "sft", root / "tiers"))
    assert set(samples["tier_pass_curves"]) == {"in_distribution", "edge", "harder"}
    assert m["tier_pass_k"] == EVAL_PARAMS["tier_pass_k"] and "tier_edge_maj_at_4" in m
    paired = compare(read_items(root / "tiers/ppo_items.jsonl"), read_items(root / "tiers/sft_items.jsonl"))
    assert paired["tier_edge"]["n"] == EVAL_PARAMS["tier_problems"] and paired["tier_edge"]["type"] == "rate"
    assert paired["tier_sampled_harder"]["n"] == EVAL_PARAMS["tier_pass_k_problems"]
    assert paired["tier_sampled_harder"]["type"] == "score"


def test_the_rankers_stage_scores_sft_answers_on_a_tier(world, monkeypatch):
    """stage rankers on the tiny models (a perturbed copy stands in for DPO's): metrics per ranker
    and the best-of-n table, whose last pass@n row is the metrics' pass_at_n. A stand-in grader
    gives right and wrong answers."""
    from llm.config import RankersConfig
    from llm.fileio import DataError
    from stages.rankers import run
    monkeypatch.setattr("llm.post.rankers.is_correct", lambda answer, gold: zlib.crc32(answer.encode()) % 3 == 0)
    root = world["root"]
    cfg = RankersConfig(problems=4, tier="edge", samples=3, temperature=1.0, max_new_tokens=12, batch_size=4,
                        confidence=0.95)
    m = run(load_sections(["common"], root / "params.yaml")["common"], cfg, "cpu", sft=root / "models/sft",
            rm=root / "models/reward", dpo=root / "models/ppo", tiers=root / "data/prepared/tiers/test.jsonl",
            metrics=root / "rankers/rankers.json", plots=root / "rankers")
    assert m["problems"] == 4 and m["tier"] == "edge"
    assert set(m["rankers"]) == {"likelihood", "per_token", "reward_model", "dpo_implicit", "agreement"}
    for r in m["rankers"].values():
        assert r["pair_accuracy"] is None or 0 <= r["pair_accuracy"] <= 1
        assert 0 <= r["best_of_n"] <= m["pass_at_n"] + 1e-9  # no ranker beats a perfect one
    rows = (root / "rankers/rankers.tsv").read_text().splitlines()
    assert rows[0].split("\t")[0] == "n" and len(rows) == 1 + cfg.samples
    assert rows[0].split("\t")[1:-2] == list(m["rankers"])  # the columns the report's figure draws, by name
    assert float(rows[-1].split("\t")[-2]) == pytest.approx(m["pass_at_n"], abs=1e-6)
    with pytest.raises(DataError, match="no problem of tier 'harder'"):
        run(load_sections(["common"], root / "params.yaml")["common"], RankersConfig(**{**cfg.__dict__, "tier": "harder",
            "problems": 1}), "cpu", sft=root / "models/sft", rm=root / "models/reward", dpo=root / "models/ppo",
            tiers=root / "data/prepared/rl/test.jsonl", metrics=root / "r2/rankers.json", plots=root / "r2")


def test_the_verifier_stage_learns_verdicts_beside_sft_and_the_rankers_read_it(world, tmp_path, capsys):
    """stage verifier on the tiny SFT model: SFT's answers labelled by the checker (every wrong one
    and as many right), SFT's conversations beside them; a model directory and held-out measures
    written; then stage rankers with it ranks as "generative_verifier", with the paired columns."""
    from dataclasses import replace

    from llm.config import RankersConfig
    from llm.runtime import Runtime
    from stages.rankers import run as rankers
    from stages.verifier import run
    root, tok = world["root"], world["tok"]
    rows = [{"id": f"math-train-{i}", "prompt": [{"role": "user", "content": t["question"]}], "answer": t["answer"],
             "kind": "math", "samples": [{"text": f"#### {t['answer']}"}, {"text": f"#### {int(t['answer']) + 1}"},
                                         {"text": f"#### {int(t['answer']) + 2}"}]} for i, t in enumerate(world["test"])]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft/train.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": t["question"]}, {"role": "assistant", "content": f"#### {t['answer']}"}],
        "source": "generated/math"}) + "\n" for i, t in enumerate(world["test"])))
    sft_cfg = replace(load_sections(["sft"], ROOT / "params.yaml")["sft"], batch_size=4, grad_accum=1,
                      eval_batches=1, eval_math_problems=3, max_new_tokens=12, log_every=1, bucket_width=8)
    cfg = replace(load_sections(["rankers"], ROOT / "params.yaml")["rankers"], verifier_steps=2,
                  verifier_val_fraction=0.3)
    common = load_sections(["common"], root / "params.yaml")["common"]
    out = tmp_path / "out"
    m = run(common, sft_cfg, cfg, Runtime(torch.device("cpu")), sft=root / "models/sft",
            samples=tmp_path / "samples.jsonl", sft_data=tmp_path / "sft", math_val=root / "data/prepared/rl/test.jsonl",
            run_dir=out / "run", model=out / "model", metrics=out / "verifier.json", plots=out / "plots",
            progress=False)
    assert m["steps"] == 2
    # verifier_sft_share 0.5: half of the 2 steps x 4 conversations it reads are SFT's, all different;
    # the verdicts (more than the other half) are read once each
    assert m["sft_conversations"] == 4 and m["verdict_repeats"] == 1 and m["verdicts_trained"] > 4
    assert 0 < m["heldout_verdicts"] == 2 * m["heldout_right"]              # one right and one wrong per problem
    for key in ("heldout_auc", "heldout_likelihood_auc", "heldout_pair_accuracy", "heldout_verdict_accuracy",
                "math_exact_match", "sft_math_exact_match"):
        assert 0 <= m[key] <= 1, key
    assert json.loads((out / "verifier.json").read_text())["steps"] == 2 and (out / "model").is_dir()
    rcfg = RankersConfig(problems=3, tier="edge", samples=3, temperature=1.0, max_new_tokens=12, batch_size=4,
                         confidence=0.95)
    r = rankers(common, rcfg, "cpu", sft=root / "models/sft", rm=root / "models/reward", dpo=root / "models/ppo",
                verifier=out / "model", tiers=root / "data/prepared/tiers/test.jsonl", metrics=out / "rankers.json",
                plots=out)
    g = r["rankers"]["generative_verifier"]
    assert 0 <= g["best_of_n"] <= r["pass_at_n"] + 1e-9
    assert g["best_of_n_vs_greedy"] == pytest.approx(g["best_of_n"] - r["greedy_accuracy"])
    assert "best_of_n_vs_likelihood" in g and "best_of_n_vs_likelihood" not in r["rankers"]["likelihood"]
    assert "generative_verifier" in (out / "rankers.tsv").read_text().splitlines()[0].split("\t")
    wrong_only = [{**r, "samples": r["samples"][1:]} for r in rows]          # nothing right to contrast
    (tmp_path / "wrong.jsonl").write_text("".join(json.dumps(r) + "\n" for r in wrong_only))
    m = run(common, sft_cfg, cfg, Runtime(torch.device("cpu")), sft=root / "models/sft", samples=tmp_path / "wrong.jsonl",
            sft_data=tmp_path / "sft", math_val=root / "data/prepared/rl/test.jsonl", run_dir=out / "run2",
            model=out / "model2", metrics=out / "v2.json", plots=out / "plots2", progress=False)
    assert m["steps"] == m["verdicts_trained"] == 0 and "WARNING" in capsys.readouterr().out
    assert (out / "plots2/verifier.png").is_file() and (out / "plots2/verifier.tsv").read_text() == "step\tloss\n"
    from llm.nn.artifacts import load_model_dir
    untaught, _, _ = load_model_dir(out / "model2", device="cpu", heads=("lm",))
    assert all(torch.equal(a, b) for a, b in zip(untaught.state_dict().values(), world["sft"].state_dict().values()))


def test_the_rankers_stage_measures_the_reward_model_against_the_gold_judge(world):
    """With passages, the rankers stage writes the reward model's best-of-n of SFT's continuations:
    n = 1 is the judge's mean, the judge's own pick bounds every pick, the KL bound starts at 0;
    without passages the table is its header alone."""
    from llm.config import RankersConfig
    from stages.rankers import CONTINUATION_COLUMNS, run
    root = world["root"]
    cfg = RankersConfig(problems=2, tier="edge", samples=2, temperature=1.0, max_new_tokens=12, batch_size=4,
                        confidence=0.95, continuation_passages=3, continuation_samples=4)
    common = load_sections(["common"], root / "params.yaml")["common"]
    paths = dict(sft=root / "models/sft", rm=root / "models/reward", dpo=root / "models/ppo",
                 tiers=root / "data/prepared/tiers/test.jsonl", continuation=root / "data/prepared/continue/test.jsonl")
    m = run(common, cfg, "cpu", **paths, metrics=root / "rc/rankers.json", plots=root / "rc")
    assert m["continuation_passages"] == 3 and m["continuation_samples"] == 4
    rows = [r.split("\t") for r in (root / "rc/rankers_continuation.tsv").read_text().splitlines()]
    assert "\t".join(rows[0]) == CONTINUATION_COLUMNS and len(rows) == 1 + 4
    table = [[float(x) for x in r] for r in rows[1:]]
    assert table[0][1] == 0.0 and all(a[1] < b[1] for a, b in zip(table, table[1:]))  # the KL bound rises with n
    assert table[0][3] == pytest.approx(m["continuation_gold_mean"], abs=1e-6)      # best of 1 = a random draw
    assert all(r[5] >= r[3] - 1e-9 for r in table)                                   # the judge's pick bounds it
    assert table[-1][3] == pytest.approx(m["continuation_best_of_n_gold"], abs=1e-6)
    assert m["continuation_spearman"] is None or -1 <= m["continuation_spearman"] <= 1
    run(common, RankersConfig(**{**cfg.__dict__, "continuation_passages": 0}), "cpu", **paths,
        metrics=root / "rc0/rankers.json", plots=root / "rc0")
    assert (root / "rc0/rankers_continuation.tsv").read_text() == CONTINUATION_COLUMNS + "\n"


def test_eval_says_whether_the_rm_score_follows_correctness(world, monkeypatch):
    """rm_auc is rm_separation of the items the stage writes: the RM's scores by the math outcomes."""
    from llm.eval.paired import read_items, rm_separation
    from stages.eval import run
    root = world["root"]
    sections = load_sections(["common", "eval"], root / "params.yaml")
    # a stand-in grader (a fixed function of the answer's text) gives right and wrong answers
    monkeypatch.setattr("llm.eval.evaluate.is_correct", lambda answer, gold: zlib.crc32(answer.encode()) % 2 == 0)
    m, _ = run("ppo", sections["common"], sections["eval"], **_paths(root, "ppo", root / "auc"))
    items = read_items(root / "auc/ppo_items.jsonl")
    n = min(EVAL_PARAMS["rm_prompts"], EVAL_PARAMS["math_problems"])
    right = [r["correct"] for r in items if r["set"] == "math"][:n]
    assert 0 < sum(right) < n and (m["rm_auc_right"], m["rm_auc_wrong"]) == (sum(right), n - sum(right))
    sep = rm_separation(items, seed=derive_seed(sections["common"].seed, "eval", "rm_auc"))
    assert (m["rm_auc"], m["rm_auc_lo"], m["rm_auc_hi"]) == (sep["auc"], sep["lo"], sep["hi"])
    assert m["rm_auc_lo"] <= m["rm_auc"] <= m["rm_auc_hi"]
    assert json.loads((root / "auc/ppo.json").read_text())["rm_auc"] == m["rm_auc"]


def test_a_missing_test_file_names_the_stage_that_writes_it(world, tmp_path):
    from stages.eval import run
    root = world["root"]
    sections = load_sections(["common", "eval"], root / "params.yaml")
    with pytest.raises(FileNotFoundError, match="tasks/test.jsonl: not found; run `dvc repro prepare` first"):
        run("sft", sections["common"], sections["eval"],
            **{**_paths(root, "sft", tmp_path), "tasks": tmp_path / "data/prepared/tasks/test.jsonl"})


def test_score_math_splits_english_and_chinese():
    problems = [{"question": "q", "answer": "3", "level": 1, "lang": lang} for lang in ("en", "en", "zh", "zh", "zh")]
    answers = ["#### 3", "#### 4", "1 + 2 = 3\n#### 3", "3", "#### 5"]
    m = score_math(problems, answers)
    assert (m["math_exact_match_en"], m["math_n_en"]) == (0.5, 2)
    assert (m["math_exact_match_zh"], m["math_n_zh"]) == (pytest.approx(2 / 3), 3)
    assert m["math_format_rate"] == 0.8 and m["math_format_rate_lo"] < 0.8 < m["math_format_rate_hi"]


def test_a_task_is_right_only_when_the_answer_is_all_there_is():
    tasks = [{"prompt": "Reverse the word: castle", "answer": "eltsac", "kind": "reverse"}] * 3 + \
            [{"prompt": "Repeat the word a 2 times.", "answer": "a a", "kind": "repeat"}]
    m, ok = score_tasks(tasks, [" eltsac\n", "The answer is: eltsac", "Eltsac", "a a"])
    assert ok == [True, False, False, True]
    assert m["task_exact_match"] == 0.5 and m["task_exact_match_reverse"] == pytest.approx(1 / 3)
    assert m["task_exact_match_repeat"] == 1.0 and m["task_n"] == 4


@pytest.mark.slow
def test_eval_stage_cli_in_a_fresh_directory(world):
    """`python -m stages.eval ppo` with cwd = the temp layout, as DVC runs it: same numbers as in-process."""
    root = world["root"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(dvc_command("eval", "ppo"), cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    metrics = _check_outputs(root / "metrics/eval", "ppo")
    from stages.eval import run
    sections = load_sections(["common", "eval"], root / "params.yaml")
    m, _ = run("ppo", sections["common"], sections["eval"], **_paths(root, "ppo", root / "again"))
    assert m == metrics
    r = subprocess.run(dvc_command("eval", "nope"), cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "invalid choice" in r.stderr


def test_eval_stage_names_a_missing_reward_model(world, tmp_path):
    from stages.eval import run
    root = world["root"]
    models = tmp_path / "models"
    for name in ("sft",):
        (models / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(root / "models" / name, models / name)
    sections = load_sections(["common", "eval"], root / "params.yaml")
    with pytest.raises(MissingArtifactError, match="models/reward"):
        run("sft", sections["common"], sections["eval"], **{**_paths(root, "sft", tmp_path / "out"),
                                                            "rm": models / "reward"})


def test_second_turns_and_out_of_scope_requests_are_scored_only_when_they_have_items(world, monkeypatch):
    """The second turn is answered with the whole earlier conversation as its prompt; its scores,
    and the out-of-scope ones, appear only with items, and every existing key stays as it was."""
    import llm.eval.evaluate as ev
    w = world
    cfg = EvalConfig(**{**EVAL_PARAMS, "pass_k_problems": 0, "rm_prompts": 0, "kl_prompts": 0})
    first = [{"role": "user", "content": "What is 7 + 5?"}, {"role": "assistant", "content": "7 + 5 = 12\n#### 12"}]
    multiturn = [{"id": "a", "messages": first + [{"role": "user", "content": "And times 2?"}], "answer": "24",
                  "kind": "followup", "lang": "en"},
                 {"id": "b", "messages": first + [{"role": "user", "content": "Reverse the word: castle"}],
                  "answer": "eltsac", "kind": "task_after_sum", "lang": "en"}]
    scope = [{"id": "c", "prompt": "Write a poem about the sea.", "answer": "I can do sums.", "lang": "en"}]
    canned = {tuple(render_prompt(multiturn[0]["messages"], w["tok"])): "12 * 2 = 24\n#### 24",
              tuple(render_prompt(multiturn[1]["messages"], w["tok"])): "castle",
              tuple(render_prompt([{"role": "user", "content": scope[0]["prompt"]}], w["tok"])): "0 - 2 = 8 #### 8"}
    real = ev.generate_replies

    def fake(model, tok, prompts, **kw):  # canned answers for the conversations, the model's for the rest
        if all(tuple(p) in canned for p in prompts):
            return [canned[tuple(p)] for p in prompts], [1] * len(prompts)
        assert not any(tuple(p) in canned for p in prompts)
        return real(model, tok, prompts, **kw)

    monkeypatch.setattr(ev, "generate_replies", fake)
    plain, _ = evaluate_model(w["sft"], w["tok"], cfg, seed=0, problems=w["test"])
    m, extras = evaluate_model(w["sft"], w["tok"], cfg, seed=0, problems=w["test"], multiturn=multiturn, scope=scope)
    new = {k: m[k] for k in set(m) - set(plain)}
    assert {k: m[k] for k in plain} == plain
    assert new["multiturn_exact_match"] == 0.5 and new["multiturn_n"] == 2
    assert new["multiturn_exact_match_followup"] == 1.0 and new["multiturn_exact_match_task_after_sum"] == 0.0
    assert new["scope_no_math_rate"] == 0.0 and new["scope_exact_match"] == 0.0 and new["scope_n"] == 1
    assert not any(k.startswith(("multiturn", "scope")) for k in plain)
    sets = [(i["set"], i["id"], i["correct"]) for i in extras["items"] if i["set"] in ("multiturn", "scope")]
    assert sets == [("multiturn", "a", True), ("multiturn", "b", False), ("scope", "c", False)]


def test_an_empty_evaluation_only_file_is_not_scored_and_a_missing_one_is_an_error(tmp_path):
    """prepare writes multiturn/scope test files empty when their counts are 0 (the cpu profile)."""
    from stages.eval import _optional_jsonl
    (tmp_path / "test.jsonl").write_text("")
    assert _optional_jsonl(tmp_path / "test.jsonl") == []
    with pytest.raises(FileNotFoundError, match="run `dvc repro prepare` first"):
        _optional_jsonl(tmp_path / "missing.jsonl")


def test_an_out_of_scope_request_after_a_first_exchange_is_asked_with_it_and_scored_per_turn(world, monkeypatch):
    """A request with a "history" (a sum asked and answered first) is answered with that
    conversation as its prompt; the no-math share is reported per turn and per language as well
    as overall, and each item says its turn."""
    import llm.eval.evaluate as ev
    w = world
    cfg = EvalConfig(**{**EVAL_PARAMS, "pass_k_problems": 0, "rm_prompts": 0, "kl_prompts": 0})
    history = [{"role": "user", "content": "What is 7 + 5?"}, {"role": "assistant", "content": "7 + 5 = 12\n#### 12"}]
    scope = [{"id": "first", "prompt": "Write a poem about the sea.", "answer": "I can do sums.", "lang": "en"},
             {"id": "second", "prompt": "Write a poem about the sea.", "answer": "I can do sums.", "lang": "en",
              "history": history},
             {"id": "zh", "prompt": "写一首关于大海的诗。", "answer": "我会算数。", "lang": "zh", "history": history}]
    canned = {tuple(render_prompt([{"role": "user", "content": scope[0]["prompt"]}], w["tok"])): "I can do sums.",
              tuple(render_prompt([*history, {"role": "user", "content": scope[1]["prompt"]}], w["tok"])):
                  "12 + 1 = 13\n#### 13",
              tuple(render_prompt([*history, {"role": "user", "content": scope[2]["prompt"]}], w["tok"])): "我会算数。"}
    real = ev.generate_replies

    def fake(model, tok, prompts, **kw):
        if all(tuple(p) in canned for p in prompts):
            return [canned[tuple(p)] for p in prompts], [1] * len(prompts)
        assert not any(tuple(p) in canned for p in prompts)
        return real(model, tok, prompts, **kw)

    monkeypatch.setattr(ev, "generate_replies", fake)
    m, extras = evaluate_model(w["sft"], w["tok"], cfg, seed=0, problems=w["test"], scope=scope)
    assert m["scope_n"] == 3 and m["scope_no_math_rate"] == pytest.approx(2 / 3)
    assert m["scope_exact_match"] == pytest.approx(2 / 3)
    assert m["scope_no_math_rate_first_turn"] == 1.0 and m["scope_n_first_turn"] == 1
    assert m["scope_no_math_rate_second_turn"] == 0.5 and m["scope_n_second_turn"] == 2
    assert m["scope_no_math_rate_en"] == 0.5 and m["scope_no_math_rate_zh"] == 1.0
    items = [(i["id"], i["turn"], i["correct"]) for i in extras["items"] if i["set"] == "scope"]
    assert items == [("first", 1, True), ("second", 2, False), ("zh", 2, True)]


def test_questions_asked_in_a_context_are_scored_beside_the_same_questions_alone(world, monkeypatch):
    """eval.context_items asks the first problems and bare calculations again after an
    out-of-scope request, after a task and under each system message, with the conversation as
    the prompt; each context's rate sits beside the same items' alone and the drop is their
    difference, and no key that existed before changes."""
    import llm.eval.evaluate as ev
    w = world
    cfg = EvalConfig(**{**EVAL_PARAMS, "pass_k_problems": 0, "rm_prompts": 0, "kl_prompts": 0, "context_items": 2})
    scope = [{"id": f"s{i}", "prompt": p, "answer": "I can do sums.", "lang": "en"}
             for i, p in enumerate(("Write a poem about the sea.", "Who was Napoleon?"))]
    tasks = w["tasks"]
    canned = {}
    for qs in (w["test"][:2], w["arithmetic"][:2]):
        for i, q in enumerate(qs):
            user = {"role": "user", "content": q["question"]}
            right, wrong = f"#### {q['answer']}", f"#### {int(q['answer']) + 1}"
            for messages, answer in (
                    ([user], right),
                    ([{"role": "user", "content": scope[i]["prompt"]}, {"role": "assistant", "content": "I can do sums."},
                      user], wrong),
                    ([{"role": "user", "content": tasks[i]["prompt"]}, {"role": "assistant", "content": tasks[i]["answer"]},
                      user], right),
                    ([{"role": "system", "content": "You are terse."}, user], right),
                    ([{"role": "system", "content": "You are a helpful assistant."}, user], wrong),
                    ([{"role": "system", "content": ev.CONTEXT_SYSTEM["system_unseen"]["en"]}, user], right)):
                canned[tuple(render_prompt(messages, w["tok"]))] = answer
    real = ev.generate_replies

    def fake(model, tok, prompts, **kw):  # canned answers where there is one, the model's for the rest
        rest = [p for p in prompts if tuple(p) not in canned]
        theirs = iter(real(model, tok, rest, **kw)[0] if rest else [])
        return [canned[tuple(p)] if tuple(p) in canned else next(theirs) for p in prompts], [1] * len(prompts)

    monkeypatch.setattr(ev, "generate_replies", fake)
    kw = dict(seed=0, problems=w["test"], arithmetic=w["arithmetic"], scope=scope, tasks=tasks)
    plain, _ = evaluate_model(w["sft"], w["tok"], EvalConfig(**{**cfg.__dict__, "context_items": 0}), **kw)
    m, extras = evaluate_model(w["sft"], w["tok"], cfg, **kw)
    assert {k: m[k] for k in plain} == plain and not any(k.startswith("context") for k in plain)
    for name in ("math", "arithmetic"):
        p = f"context_{name}"
        assert m[f"{p}_n"] == 2 and m[f"{p}_alone"] == m[f"{p}_alone_en"] == 1.0
        expected = {"after_scope": 0.0, "after_task": 1.0, "system_short": 1.0, "system_helpful": 0.0,
                    "system_unseen": 1.0}
        assert {c: m[f"{p}_{c}"] for c in expected} == expected
        assert {c: m[f"{p}_{c}_drop"] for c in expected} == {c: 1.0 - v for c, v in expected.items()}
        assert m[f"{p}_after_scope_drop_lo"] == m[f"{p}_after_scope_drop_hi"] == 1.0  # every pair lost it
    items = [i for i in extras["items"] if i["set"] == "context"]
    assert len(items) == 2 * 2 * 5 and len({i["id"] for i in items}) == 20
    assert {i["id"] for i in items if not i["correct"]} == {
        f"{n}:{c}:{q['id']}" for n, qs in (("math", w["test"]), ("arithmetic", w["arithmetic"])) for q in qs[:2]
        for c in ("after_scope", "system_helpful")}


def test_a_context_whose_conversation_leaves_no_room_for_the_answer_is_left_out_and_counted(world, monkeypatch):
    """A conversation longer than seq_len - max_new_tokens is not asked (its answer would be cut
    and count as wrong, or the prompt would not fit at all); the count of those left out is in the
    metrics and the rest are scored as before."""
    w = world
    cfg = EvalConfig(**{**EVAL_PARAMS, "pass_k_problems": 0, "rm_prompts": 0, "kl_prompts": 0, "context_items": 2})
    room = w["sft"].config.seq_len - cfg.max_new_tokens
    words = "Write a poem about the sea".split()
    long_request = ""
    while len(render_prompt([{"role": "user", "content": long_request + words[0]}], w["tok"])) < room:
        long_request += words[0] + " "  # fits alone (the scope set asks it), not before a question
        words = words[1:] + words[:1]
    scope = [{"id": "long", "prompt": long_request.strip(), "answer": "I can do sums.", "lang": "en"}]
    kw = dict(seed=0, problems=w["test"], arithmetic=w["arithmetic"], scope=scope, tasks=w["tasks"])
    m, extras = evaluate_model(w["sft"], w["tok"], cfg, **kw)
    for name in ("math", "arithmetic"):
        assert m[f"context_{name}_too_long"] == 2  # both questions after the long request
        assert f"context_{name}_after_scope" not in m and f"context_{name}_after_task" in m
    items = [i for i in extras["items"] if i["set"] == "context"]
    assert not any(i["context"] == "after_scope" for i in items) and len(items) == 2 * 2 * 4
