"""The reward model: pair encoding and batches, the reward read at the last
real token, the Bradley-Terry loss_fn, learning a toy preference, and the `reward` stage end to
end with its quality gate.

`make_workspace` builds a tiny pipeline directory (tokenizer, SFT model, prefs, math and task
prompts, params.yaml) that tests/test_pairs.py and tests/test_dpo.py use too.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from llm.config import ModelConfig, TrainConfig
from llm.data.generators import math_problem, preference_pair, task, task_preference_pair
from llm.data.preference import EncodedPair, collate_pairs, encode_pairs, fixed_pair_batches, pair_batches
from llm.data.template import render
from llm.data.tokenizer import Tokenizer
from llm.nn.artifacts import load_model_dir, save_model_dir
from llm.nn.model import GPT
from llm.nn.reward_model import (RewardModel, bradley_terry_loss, evaluate_pairs, pair_metrics, reward, reward_loss_fn,
                                 score_sequences)
from llm.runtime import Runtime
from llm.train.metrics import read_metrics
from llm.train.trainer import train
from tests.conftest import ROOT, common_params, dvc_command

CPU = Runtime(torch.device("cpu"))
N_OWN_TRAIN, N_OWN_VAL = 24, 12  # make_workspace's comparisons of SFT's own answers
pytestmark = pytest.mark.usefixtures("one_thread")


def test_bradley_terry_hand_computed():
    rc, rr = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # -log sigmoid(1) = 0.31326, -log sigmoid(-1) = 1.31326
    assert bradley_terry_loss(rc, rr).item() == pytest.approx((0.3132617 + 1.3132617) / 2, abs=1e-6)
    # smoothing 0.1: 0.9 * 0.31326 + 0.1 * 1.31326 = 0.41326 for the first pair
    assert bradley_terry_loss(rc[:1], rr[:1], label_smoothing=0.1).item() == pytest.approx(0.4132617, abs=1e-6)
    # a margin shifts the logit: -log sigmoid(1 - 0.5)
    assert bradley_terry_loss(rc[:1], rr[:1], margin=0.5).item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5))), abs=1e-6)


# ---------------------------------------------------------------------------
# A tiny workspace for stage tests

def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def tcfg(**kw) -> dict:
    """A training section (TrainConfig keys) for stage tests: a few steps, no frills."""
    base = dict(max_steps=4, batch_size=4, grad_accum=1, distributed="ddp", lr=1.0e-3, min_lr=1.0e-4, warmup_steps=1,
                weight_decay=0.0, beta1=0.9, beta2=0.95, grad_clip=1.0, eval_every=2, eval_batches=2, log_every=1,
                optimizer="adamw", muon_lr=0.02,
                checkpoint_every=2, keep_checkpoints=2, nonfinite_policy="raise", nonfinite_budget=0,
                activation_checkpointing=False, compile=False)
    base.update(kw)
    return base


def params(**sections) -> dict:
    """params.yaml for the workspace: common + reward + pairs + dpo, overridable per section."""
    p = {
        "common": common_params(),
        "reward": {"bucket_width": 16, "label_smoothing": 0.1, "margin": 0.0, "min_accuracy": 0.0,
                   "generated_share": 0.5, "logprob_feature": False, "train_trunk": True, "head_init": "random",
                   **tcfg()},
        "pairs": {"n_prompts": 12, "math_fraction": 0.5, "temperatures": [0.7, 1.1], "samples_per_temperature": 2,
                  "max_new_tokens": 12, "batch_size": 8, "adversarial_fraction": 0.05, "tie_epsilon": 1.0e-3,
                  "tie_break": "first", "val_fraction": 0.25, "verify_tasks": False, "continuation_prompts": 0,
                  "gold_margin": 0.1},
        "dpo": {"bucket_width": 16, "beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0, "max_kl": 10.0,
                "kl_prompts": 4, "max_new_tokens": 8, "trainable": ["*"], **tcfg()},
    }
    for name, over in sections.items():
        p[name].update(over)
    return p


def write_params(ws: Path, **sections) -> None:
    (ws / "params.yaml").write_text(yaml.safe_dump(params(**sections), sort_keys=False))


def tiny_gpt(vocab_size: int, seed: int = 0, heads=("lm",)) -> GPT:
    return GPT(ModelConfig(vocab_size=vocab_size, seq_len=128, n_layer=2, n_head=2, n_kv_head=2, n_embd=32),
               heads=heads, seed=seed)


def make_workspace(ws: Path, *, n_train: int = 48, n_val: int = 16, reward_model: bool = False) -> Path:
    """models/sft (random tiny GPT), data/prepared/prefs, data/prepared/rl/train.jsonl,
    data/clean_sft/train.jsonl (task conversations) and params.yaml under `ws`."""
    rng = random.Random(0)
    prefs = [preference_pair(rng, rng.choice([1, 2]), "en", 0.3) if i % 2 else task_preference_pair(rng)
             for i in range(n_train + n_val)]
    for i, p in enumerate(prefs):
        p["id"] = f"pref-{i}"
    _write_jsonl(ws / "data/prepared/prefs/train.jsonl", prefs[:n_train])
    _write_jsonl(ws / "data/prepared/prefs/val.jsonl", prefs[n_train:])
    # comparisons of "SFT's own answers" as the samples stage writes them (here: more generated
    # pairs, with the SFT likelihoods it records; the real stage is tested in tests/test_pairs.py)
    own_rng = random.Random(1)  # its own generator: the other data stay as they were
    own = [preference_pair(own_rng, 1, "en", 0.0) for _ in range(N_OWN_TRAIN + N_OWN_VAL)]
    for i, p in enumerate(own):
        p.update(id=f"samples-{i}", kind="math", sft_logp_chosen=-0.5 - (i % 3 == 0), sft_logp_rejected=-1.0)
    _write_jsonl(ws / "data/samples/train.jsonl", own[:N_OWN_TRAIN])
    _write_jsonl(ws / "data/samples/val.jsonl", own[N_OWN_TRAIN:])
    math = [math_problem(rng, rng.choice([1, 2]), "en") for _ in range(40)]
    _write_jsonl(ws / "data/prepared/rl/train.jsonl",
                 [{"id": f"math-train-{i}", "question": m.question, "answer": str(m.answer), "level": 1, "lang": "en",
                   "source": "generated/math"} for i, m in enumerate(math)])
    tasks = [task(rng) for _ in range(40)]
    convs = [{"id": f"task-train-{i}", "source": f"generated/task_{t.kind}",
              "messages": [{"role": "user", "content": t.prompt}, {"role": "assistant", "content": t.answer}]}
             for i, t in enumerate(tasks)]
    convs += [{"id": f"math-sft-{i}", "source": "generated/math_en",
               "messages": [{"role": "user", "content": m.question}, {"role": "assistant", "content": m.solution}]}
              for i, m in enumerate(math[:10])]
    _write_jsonl(ws / "data/clean_sft/train.jsonl", convs)
    texts = [m.question + "\n" + m.solution for m in math] + [t.prompt + " " + t.answer for t in tasks]
    texts += [p["chosen"] + " " + p["rejected"] for p in prefs]
    tok = Tokenizer.train(texts * 2, vocab_size=360, max_pairs=10_000, min_frequency=2, required_tokens=["####"],
                          jieba=False)
    save_model_dir(ws / "models/sft", tiny_gpt(tok.vocab_size, seed=1), tok, {"stage": "sft", "fingerprint": "sft-fp"})
    if reward_model:
        save_model_dir(ws / "models/reward", tiny_gpt(tok.vocab_size, seed=2, heads=("lm", "reward")), tok,
                       {"stage": "reward", "fingerprint": "rm-fp"})
    write_params(ws)
    return ws


def run_stage(ws: Path, stage: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([*dvc_command(stage), "--no-progress"], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------
# Encoding and batches

@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    rng = random.Random(1)
    texts = [math_problem(rng, 1, "en").question for _ in range(30)] + ["#### 12 castle garden"] * 5
    return Tokenizer.train(texts, vocab_size=300, max_pairs=5000, min_frequency=2, jieba=False)


def test_encoded_pair_is_the_chat_template_with_the_answer_as_response(tok):
    rec = {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 7 + 5?"}],
           "chosen": "7 + 5 = 12\n#### 12", "rejected": "#### 13", "kind": "wrong_answer"}
    (pair,), kept, dropped = encode_pairs([rec], tok, max_tokens=128)
    assert kept == [0] and dropped == 0 and pair.kind == "wrong_answer"
    for side in ("chosen", "rejected"):
        ids, mask = render(rec["prompt"] + [{"role": "assistant", "content": rec[side]}], tok)
        assert getattr(pair, side) == ids
        assert mask == [i >= pair.prompt_len for i in range(len(ids))]  # response = answer + <|end|>
    # too long for the context: dropped and counted, never truncated
    assert encode_pairs([rec], tok, max_tokens=len(pair.chosen) - 1)[2] == 1


def test_collate_pairs_stacks_chosen_then_rejected_right_padded():
    pairs = [EncodedPair([1, 2, 3, 4], [1, 2, 5], 2, "a"), EncodedPair([1, 6], [1, 7, 8, 9, 9], 1, "b")]
    b = collate_pairs(pairs, pad_id=0, ref_chosen=torch.tensor([-1.0, -2.0]), ref_rejected=torch.tensor([-3.0, -4.0]))
    assert b["idx"].tolist() == [[1, 2, 3, 4, 0], [1, 6, 0, 0, 0], [1, 2, 5, 0, 0], [1, 7, 8, 9, 9]]
    assert b["attention_mask"].sum(1).tolist() == [4, 2, 3, 5]
    assert b["response_mask"].int().tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert float(b["weight"]) == 2.0 and b["ref_rejected"].tolist() == [-3.0, -4.0]


def test_reward_is_read_at_the_last_real_token_left_and_right_padding():
    gpt = tiny_gpt(50, seed=3, heads=("lm", "reward"))
    with torch.no_grad():
        gpt.reward_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    gpt.eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 9, 6, 1)]
    alone = torch.stack([reward(gpt, torch.tensor([s]))[0] for s in seqs])  # (4,): no padding at all
    assert len(set(alone.tolist())) == 4
    # right padding, through the batched scorer the stages use (sorted by length inside)
    right = score_sequences(gpt, seqs, pad_id=49, batch_size=3)
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)
    # left padding, through RewardModel.forward (the training path)
    T = max(map(len, seqs))
    idx = torch.tensor([[49] * (T - len(s)) + s for s in seqs])
    mask = torch.tensor([[False] * (T - len(s)) + [True] * len(s) for s in seqs])
    torch.testing.assert_close(RewardModel(gpt)(idx, mask), alone, atol=1e-5, rtol=0)
    # the pad token's value must not matter
    torch.testing.assert_close(RewardModel(gpt)(idx.masked_fill(~mask, 7), mask), alone, atol=1e-5, rtol=0)


def test_the_likelihood_feature_adds_the_weighted_mean_log_prob_of_the_response_tokens():
    V, MARK = 50, 5
    gpt = tiny_gpt(V, seed=3, heads=("lm", "reward"))
    plain = tiny_gpt(V, seed=3, heads=("lm", "reward"))
    with torch.no_grad():
        gpt.reward_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
        plain.reward_head.weight.copy_(gpt.reward_head.weight)
    gpt.add_head("reward_logprob", marker=MARK)
    with torch.no_grad():
        gpt.reward_logprob_head.weight.fill_(0.7)
    gpt.eval()
    plain.eval()
    # prompt ... MARK response; the second row has an earlier MARK in its prompt (only the last counts)
    seqs = [[1, 2, MARK, 7, 8, 9], [3, MARK, 4, MARK, 6], [2, MARK]]

    def by_hand(s):
        logp = torch.log_softmax(gpt(torch.tensor([s]))[0], -1)       # (T, V)
        start = max(i for i, t in enumerate(s) if t == MARK) + 1
        lps = [float(logp[t - 1, s[t]]) for t in range(start, len(s))]
        return sum(lps) / len(lps) if lps else 0.0                    # nothing after the marker: 0

    with torch.no_grad():
        want = torch.tensor([float(reward(plain, torch.tensor([s]))[0]) + 0.7 * by_hand(s) for s in seqs])
    torch.testing.assert_close(score_sequences(gpt, seqs, pad_id=V - 1, batch_size=3), want, atol=1e-5, rtol=0)
    T = max(map(len, seqs))                                            # left padding, the training path
    idx = torch.tensor([[V - 1] * (T - len(s)) + s for s in seqs])
    mask = torch.tensor([[False] * (T - len(s)) + [True] * len(s) for s in seqs])
    torch.testing.assert_close(RewardModel(gpt)(idx, mask), want, atol=1e-5, rtol=0)
    # a padded position holding the marker's id is not a marker: right padding puts it after the answer
    torch.testing.assert_close(score_sequences(gpt, seqs, pad_id=MARK, batch_size=3), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"row 0 has no response marker \(token id 5"):
        reward(gpt, torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="needs marker="):
        plain.add_head("reward_logprob")
    with pytest.raises(ValueError, match="needs the 'lm' and 'reward' heads"):
        tiny_gpt(V, heads=("lm",)).add_head("reward_logprob", marker=MARK)


def test_a_reward_model_with_the_likelihood_feature_loads_it_with_its_reward_head(tmp_path):
    tok = Tokenizer.train(["Tom has 3 apples. 3 + 2 = 5 #### 5"] * 4, vocab_size=300, min_frequency=1, jieba=False)
    gpt = tiny_gpt(tok.vocab_size, seed=3, heads=("lm", "reward"))
    gpt.add_head("reward_logprob", marker=tok.special["<|assistant|>"])
    with torch.no_grad():
        gpt.reward_logprob_head.weight.fill_(0.3)
    save_model_dir(tmp_path / "rm", gpt, tok, {"stage": "reward"})
    seq = render([{"role": "user", "content": "Tom has 3"}, {"role": "assistant", "content": "#### 5"}], tok)[0]
    want = reward(gpt.eval(), torch.tensor([seq]))
    # asking for the reward head brings the feature (and the LM head it reads) along: same rewards
    rm, _, _ = load_model_dir(tmp_path / "rm", heads=("reward",))
    assert set(rm.head_names) == {"lm", "reward", "reward_logprob"}
    assert int(rm.reward_logprob_head.marker) == tok.special["<|assistant|>"]
    torch.testing.assert_close(reward(rm.eval(), torch.tensor([seq])), want)
    lm, _, _ = load_model_dir(tmp_path / "rm", heads=("lm",))          # the LM alone, as export loads it
    assert lm.head_names == ("lm",) and lm.reward_logprob_head is None


def test_reward_loss_fn_is_the_summed_bradley_terry_loss_with_accuracy_and_margin():
    class Fixed(torch.nn.Module):  # "rewards" = the first token of each row
        def forward(self, idx, attention_mask=None):
            return idx[:, 0].float()
    b = {"idx": torch.tensor([[2], [0], [1], [1]]), "attention_mask": torch.ones(4, 1, dtype=torch.bool),
         "weight": torch.tensor(2.0)}
    loss, w, extras = reward_loss_fn(0.1, 0.0)(Fixed(), b)
    rc, rr = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    assert loss.item() == pytest.approx(2 * bradley_terry_loss(rc, rr, 0.1).item())
    # -(0.9 log s(1) + 0.1 log s(-1)) + -(0.9 log s(-1) + 0.1 log s(1)) = -(log s(1) + log s(-1))
    s = lambda z: math.log(1 / (1 + math.exp(-z)))
    assert loss.item() == pytest.approx(-(s(1) + s(-1)), abs=1e-5)
    assert float(w) == 2.0 and extras["accuracy"].item() == 1.0 and extras["margin"].item() == pytest.approx(0.0)


def test_pair_metrics():
    m = pair_metrics(torch.tensor([1.0, 2.0, 0.0, 3.0]), torch.tensor([0.0, 2.0, 1.0, 1.0]), ["a", "a", "b", "b"])
    assert m["accuracy"] == 0.5 and m["margin"] == pytest.approx(0.5)  # a tie is not a win
    assert m["by_kind"] == {"a": {"n": 2, "accuracy": 0.5, "margin": 0.5},
                            "b": {"n": 2, "accuracy": 0.5, "margin": 0.5}}
    assert m["reward_chosen_mean"] == 1.5 and m["reward_rejected_std"] == pytest.approx(math.sqrt(0.5))


def test_evaluate_pairs_reports_the_head_alone_the_likelihood_baseline_and_the_generated_pairs():
    V, MARK = 50, 5
    gpt = tiny_gpt(V, seed=3, heads=("lm", "reward"))
    gpt.add_head("reward_logprob", marker=MARK)
    with torch.no_grad():
        gpt.reward_logprob_head.weight.fill_(50.0)   # the feature decides
    gpt.eval()
    g = random.Random(0)
    pair = lambda kind: EncodedPair([1, MARK] + [g.randrange(6, 40) for _ in range(3)],
                                    [1, MARK] + [g.randrange(6, 40) for _ in range(4)], 2, kind)
    val, generated = [pair("math") for _ in range(12)], [pair("task") for _ in range(5)]
    records = [{"sft_logp_chosen": -1.0, "sft_logp_rejected": -2.0}, {"sft_logp_chosen": -3.0, "sft_logp_rejected": -2.0},
               {"sft_logp_chosen": -1.0, "sft_logp_rejected": -1.5},
               {}]                                                   # the last carries no likelihood
    weight = gpt.reward_logprob_head.weight.detach().clone()

    m = evaluate_pairs(gpt, val, sft_records=records, generated=generated, pad_id=V - 1, batch_size=4)
    score = lambda model, pairs: pair_metrics(
        score_sequences(model, [p.chosen for p in pairs], pad_id=V - 1, batch_size=4),
        score_sequences(model, [p.rejected for p in pairs], pad_id=V - 1, batch_size=4), [p.kind for p in pairs])
    assert {k: m[k] for k in score(gpt, val)} == score(gpt, val)
    assert m["sft_likelihood_accuracy"] == pytest.approx(2 / 3)
    assert (m["generated_accuracy"], m["generated_by_kind"]) == (score(gpt, generated)["accuracy"],
                                                                  score(gpt, generated)["by_kind"])
    head_alone = tiny_gpt(V, seed=3, heads=("lm", "reward")).eval()
    assert m["accuracy_without_likelihood"] == score(head_alone, val)["accuracy"] != m["accuracy"]
    assert torch.equal(gpt.reward_logprob_head.weight, weight)          # the feature is back afterwards
    plain = evaluate_pairs(head_alone, val, sft_records=[], generated=generated, pad_id=V - 1, batch_size=4)
    assert plain["accuracy_without_likelihood"] is None and plain["sft_likelihood_accuracy"] is None


# ---------------------------------------------------------------------------
# Learning happens

def _toy_pairs(n: int, seed: int) -> list[EncodedPair]:
    """Prompt: <bos> instruction filler... <sep>; the instruction (1 = "say something high",
    2 = "say something low") decides which answer half of the vocabulary is preferred."""
    g = random.Random(seed)
    out = []
    for _ in range(n):
        ins = g.choice([1, 2])
        prompt = [0, ins] + [g.randrange(3, 20) for _ in range(g.randint(1, 6))] + [3]
        high, low = g.randrange(30, 40), g.randrange(20, 30)
        good, bad = (high, low) if ins == 1 else (low, high)
        out.append(EncodedPair(prompt + [good], prompt + [bad], len(prompt), "high" if ins == 1 else "low"))
    return out


@pytest.mark.slow
def test_rm_learns_a_toy_preference_to_90_percent_on_held_out_pairs(tmp_path):
    gpt = GPT(ModelConfig(vocab_size=41, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), seed=0)
    gpt.add_head("reward", seed=1)
    train_pairs, val_pairs = _toy_pairs(512, 0), _toy_pairs(128, 1)
    cfg = TrainConfig(**tcfg(max_steps=200, batch_size=16, lr=3e-3, min_lr=3e-4, warmup_steps=10, eval_every=100,
                             checkpoint_every=200))
    model = RewardModel(gpt)
    before = score_sequences(gpt, [p.chosen for p in val_pairs] + [p.rejected for p in val_pairs], pad_id=40,
                             batch_size=64)
    res = train(model, cfg, CPU, stage="rm-toy", seed=3,
                batches=pair_batches(train_pairs, batch_size=16, bucket_width=4, seed=3, pad_id=40),
                loss_fn=reward_loss_fn(0.1, 0.0), val_batches=fixed_pair_batches(val_pairs, batch_size=64, pad_id=40),
                run_dir=tmp_path / "run", fingerprint="fp", progress=False)
    r = score_sequences(gpt, [p.chosen for p in val_pairs] + [p.rejected for p in val_pairs], pad_id=40,
                        batch_size=64)
    n = len(val_pairs)
    acc_before = pair_metrics(before[:n], before[n:])["accuracy"]
    acc = pair_metrics(r[:n], r[n:])["accuracy"]
    assert acc >= 0.9, (acc, res.val_history)
    assert acc_before < 0.75  # it was learned, not there from the start
    assert res.metrics["val_accuracy"] == pytest.approx(acc)  # the loop's val extras agree with the scorer


# ---------------------------------------------------------------------------
# The stage

@pytest.mark.slow
@pytest.mark.parametrize("logprob_feature", [False, True])
def test_reward_stage_end_to_end(tmp_path, logprob_feature):
    ws = make_workspace(tmp_path)
    write_params(ws, reward={"logprob_feature": logprob_feature})
    run = run_stage(ws, "reward")
    assert run.returncode == 0, run.stderr
    m = read_metrics(ws / "metrics/reward.json")  # with its run file (timings, samples)
    for k in ("accuracy", "margin", "reward_chosen_mean", "reward_chosen_std", "reward_rejected_mean",
              "reward_rejected_std", "train_loss", "steps", "train_time_s"):
        assert m[k] is not None, k
    # the held-out numbers are on SFT's own answers; the generated pairs are reported beside them
    assert m["n_pairs"] == N_OWN_VAL and m["steps"] == 4 and set(m["by_kind"]) == {"math"}
    assert {"wrong_answer", "broken_format"} & set(m["generated_by_kind"])
    assert sum(v["n"] for v in m["generated_by_kind"].values()) == 16 and m["generated_accuracy"] is not None
    # generated_share 0.5: as many generated pairs as own ones (all 48 would be more)
    assert m["train_pairs_own"] == m["train_pairs_generated"] == N_OWN_TRAIN
    assert m["sft_likelihood_accuracy"] == pytest.approx(8 / 12)  # every third chosen answer is the less likely
    assert (m["accuracy_without_likelihood"] is not None) == logprob_feature
    model, rm_tok, meta = load_model_dir(ws / "models/reward")
    assert model.head_names == (("lm", "reward", "reward_logprob") if logprob_feature else ("lm", "reward"))
    assert meta["stage"] == "reward"
    assert meta["reward_stats"]["std"] == pytest.approx(m["reward_std"])
    # the saved model reproduces the reported accuracy
    recs = [json.loads(x) for x in (ws / "data/samples/val.jsonl").read_text().splitlines()]
    pairs, _, _ = encode_pairs(recs, rm_tok, 128)
    r = score_sequences(model, [p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id=rm_tok.pad_id,
                        batch_size=8)
    n = len(pairs)
    assert pair_metrics(r[:n], r[n:])["accuracy"] == pytest.approx(m["accuracy"])
    if logprob_feature:  # without the feature: the head alone
        model.reward_logprob_head.weight.data.zero_()
        r = score_sequences(model, [p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id=rm_tok.pad_id,
                            batch_size=8)
        assert pair_metrics(r[:n], r[n:])["accuracy"] == pytest.approx(m["accuracy_without_likelihood"])
    for f in ("reward.tsv", "reward_val.tsv", "reward.png"):
        assert (ws / "metrics/plots" / f).is_file(), f
    header = (ws / "metrics/plots/reward.tsv").read_text().splitlines()[0].split("\t")
    assert header[0] == "step" and {"loss", "accuracy", "margin"} <= set(header)


@pytest.mark.slow
@pytest.mark.parametrize("logprob_feature", [False, True])
def test_reward_stage_linear_probe_trains_only_the_head(tmp_path, logprob_feature):
    """reward.train_trunk: false: the trunk and LM head come out exactly as in SFT; the head learns."""
    ws = make_workspace(tmp_path)
    write_params(ws, reward={"logprob_feature": logprob_feature, "train_trunk": False})
    run = run_stage(ws, "reward")
    assert run.returncode == 0, run.stderr
    sft = dict(load_model_dir(ws / "models/sft")[0].named_parameters())
    rm = dict(load_model_dir(ws / "models/reward")[0].named_parameters())
    assert all(torch.equal(rm[n], p) for n, p in sft.items())
    heads = {"reward_head.weight", "reward_head.bias"} | ({"reward_logprob_head.weight"} if logprob_feature else set())
    assert set(rm) - set(sft) == heads
    if logprob_feature:  # the feature's weight starts at 1 and learns
        assert float(rm["reward_logprob_head.weight"]) != 1.0


@pytest.mark.slow
def test_quality_gate_fails_on_an_untrained_rm_and_keeps_the_previous_outputs(tmp_path):
    ws = make_workspace(tmp_path)
    write_params(ws, reward=dict(min_accuracy=0.99, max_steps=1, warmup_steps=0, lr=1.0e-8, min_lr=0.0))
    (ws / "models/reward").mkdir(parents=True)
    (ws / "models/reward/previous.txt").write_text("previous")
    (ws / "metrics").mkdir()
    (ws / "metrics/reward.json").write_text('{"accuracy": 0.95}\n')
    run = run_stage(ws, "reward")
    assert run.returncode == 1
    assert "reward.min_accuracy=0.99" in run.stderr and "held-out accuracy on SFT's own answers" in run.stderr
    assert "no model was written" in run.stderr
    assert sorted(p.name for p in (ws / "models/reward").iterdir()) == ["previous.txt"]
    assert (ws / "metrics/reward.json").read_text() == '{"accuracy": 0.95}\n'
    assert not (ws / "metrics/plots/reward.tsv").exists()
    failed = json.loads((ws / "runs/reward/failed_metrics.json").read_text())
    assert failed["accuracy"] < 0.99 and failed["n_pairs"] == N_OWN_VAL


@pytest.mark.slow
def test_head_init_zero_starts_the_reward_as_the_likelihood_feature_alone(tmp_path):
    from llm.nn.reward_model import response_logprob
    ws = make_workspace(tmp_path)
    write_params(ws, reward=dict(logprob_feature=True, head_init="zero", max_steps=1, warmup_steps=0, lr=1.0e-12,
                                 min_lr=0.0))
    run = run_stage(ws, "reward")
    assert run.returncode == 0, run.stderr
    rm, tok, _ = load_model_dir(ws / "models/reward")
    assert float(rm.reward_head.weight.abs().max()) < 1e-9 and abs(float(rm.reward_head.bias)) < 1e-9
    seq = render([{"role": "user", "content": "What is 7 + 5?"}, {"role": "assistant", "content": "#### 12"}], tok)[0]
    idx = torch.tensor([seq])
    with torch.no_grad():
        feature = response_logprob(rm.eval(), idx, rm.hidden_states(idx))
        assert float(reward(rm, idx)[0]) == pytest.approx(float(rm.reward_logprob_head.weight * feature[0]), abs=1e-6)


@pytest.mark.slow
def test_without_comparisons_of_sfts_own_answers_the_reward_model_learns_from_the_generated_pairs(tmp_path):
    """A weak SFT model whose samples never disagree (the smoke profile's): the samples stage
    writes empty comparison files, and the reward stage trains and tests on the generated pairs."""
    ws = make_workspace(tmp_path)
    for f in ("train.jsonl", "val.jsonl"):
        (ws / "data/samples" / f).write_text("")
    run = run_stage(ws, "reward")
    assert run.returncode == 0, run.stderr
    assert "no comparisons of SFT's own answers" in run.stdout + run.stderr
    m = read_metrics(ws / "metrics/reward.json")
    assert m["held_out_on"] == "generated" and m["n_pairs"] == 16 and m["train_pairs_generated"] == 0


@pytest.mark.slow
def test_a_missing_comparison_file_is_an_error_naming_it_not_a_silent_fallback(tmp_path):
    """Only an empty comparison file means "no comparisons"; a missing one is a broken samples
    output, and the stage says which file instead of training on the generated pairs alone."""
    ws = make_workspace(tmp_path)
    (ws / "data/samples" / "val.jsonl").unlink(missing_ok=True)
    run = run_stage(ws, "reward")
    assert run.returncode != 0
    assert "val.jsonl" in run.stderr and "Traceback" not in run.stderr


def test_continuation_agreement_is_the_rank_correlation_on_held_out_single_continuations(tmp_path):
    """llm/post/continuation.py `agreement_on_samples` (the reward stage's): the reward model's score of each held-out
    continuation against the gold judge's, by rank; nothing where the samples hold none."""
    from llm.eval.paired import spearman
    from llm.nn.artifacts import load_model_dir
    from llm.post.continuation import agreement_on_samples
    from llm.nn.reward_model import score_sequences
    from llm.data.preference import encode_response
    from llm.data.template import render_prompt
    ws = make_workspace(tmp_path)
    gpt, tok, _ = load_model_dir(ws / "models/sft", heads=("lm",))
    gpt.add_head("reward", seed=3)
    texts = ["With joy I greet thee", "With grief I curse thee", "The ship sails on", "And love and hope"]
    prompts = [{"id": f"c{i}", "prompt": [{"role": "user", "content": f"Continue this passage:\nline {i}"}],
                "check": "gold", "split": split, "answer": f"line {i}",
                "samples": [{"text": t, "verifier": g} for t, g in zip(texts, [0.8, -0.7, 0.0, 0.9])]}
               for i, split in enumerate(["val", "train", "val"])]
    prompts.append({"id": "m", "prompt": [{"role": "user", "content": "What is 1 + 1?"}], "check": "math",
                    "split": "val", "answer": "2", "samples": [{"text": "#### 2", "verifier": 1.2}]})
    _write_jsonl(ws / "data/samples/samples.jsonl", prompts)
    got = agreement_on_samples(gpt, ws / "data/samples/samples.jsonl", tok, batch_size=4, device="cpu")
    assert got["continuation_samples"] == 8          # the two held-out passages' continuations, no math
    seqs = [encode_response(render_prompt(p["prompt"], tok), t, tok) for p in (prompts[0], prompts[2]) for t in texts]
    scores = score_sequences(gpt, seqs, pad_id=tok.pad_id, batch_size=4).tolist()
    assert got["continuation_spearman"] == pytest.approx(spearman([0.8, -0.7, 0.0, 0.9] * 2, scores))
    assert agreement_on_samples(gpt, ws / "nothing.jsonl", tok, batch_size=4, device="cpu") == {}
