"""The generative verifier (llm/post/verifier.py): its examples, what it trains on and its score."""
import random

import numpy as np
import pytest
import torch

from llm.data.template import render, render_prompt
from llm.data.tokenizer import Tokenizer
from llm.nn.model import GPT, ModelConfig
from llm.eval.paired import separation
from llm.post.verifier import (NO, QUESTION, YES, render_verification, verification_examples, verifier_scores,
                               verify_messages)
from llm.sample.rewards import is_correct


def _row(i, answer, texts, kind="math"):
    return {"id": f"math-train-{i}", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": answer,
            "kind": kind, "samples": [{"text": t} for t in texts]}


ROWS = [_row(i, str(i + 1), [f"{i} + 1 = {i + 1}\n#### {i + 1}"] * 3 + [f"{i} + 1 = {i + 2}\n#### {i + 2}",
                                                                     f"{i} + 1 = {i + 3}\n#### {i + 3}"])
        for i in range(200)] + [_row(999, "", ["#### 1"], kind="task_sort")]


@pytest.fixture(scope="module")
def tok():
    texts = [f"{r['prompt'][0]['content']} {s['text']} {QUESTION} {YES} {NO}" for r in ROWS for s in r["samples"]]
    return Tokenizer.train(texts, 300, max_pairs=10_000, min_frequency=2, required_tokens=["####", YES, NO])


def test_examples_are_as_many_right_as_wrong_answers_per_problem_split_by_problem():
    train, val = verification_examples(ROWS, seed=0, val_fraction=0.2)
    for split in (train, val):
        per = {}
        for e in split:
            problem = e["id"].split("/")[0]
            per.setdefault(problem, []).append(e["right"])
            assert e["right"] == is_correct(e["messages"][1]["content"], str(int(problem.split("-")[2]) + 1))
            assert e["messages"][-2] == {"role": "user", "content": QUESTION}
            assert e["messages"][-1]["content"] == (YES if e["right"] else NO)
        # one distinct right answer (three copies) and two wrong ones: one of each per problem
        assert per and all(sorted(v) == [False, True] for v in per.values())
    problems = lambda s: {e["id"].split("/")[0] for e in s}  # noqa: E731
    assert not problems(train) & problems(val) and 20 <= len(problems(val)) <= 60
    assert len(problems(train) | problems(val)) == 200                      # only math rows
    assert verification_examples(ROWS, seed=0, val_fraction=0.2) == (train, val)
    assert verification_examples(ROWS, seed=1, val_fraction=0.2) != (train, val)


def test_a_problem_with_answers_of_one_kind_gives_no_example():
    rows = [_row(0, "2", ["#### 2", "2\n#### 2"]), _row(1, "2", ["#### 3", "#### 4"]),
            _row(2, "2", ["#### 2 (a)", "#### 2 (b)", "#### 2 (c)", "#### 5", "#### 6"])]
    train, val = verification_examples(rows, seed=0, val_fraction=0.01)
    assert {e["id"].split("/")[0] for e in train + val} == {"math-train-2"}
    assert sorted(e["right"] for e in train + val) == [False, False, True, True]


def test_only_the_verdict_is_trained_on(tok):
    msgs = verify_messages(ROWS[3]["prompt"], "3 + 1 = 5\n#### 5", right=False)
    ids, mask = render_verification(msgs, tok)
    assert ids == render(msgs, tok)[0]
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == [*tok.encode(NO, allowed_special="none"), tok.end_id]   # not the wrong answer it judges
    assert render_verification(msgs, tok, max_tokens=len(ids) - 1) is None


def test_the_score_is_the_log_odds_of_yes_at_the_reply_and_padding_changes_nothing(tok):
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, seq_len=96, n_layer=1, n_head=2, n_kv_head=2, n_embd=32), seed=0)
    prompts = [r["prompt"] for r in ROWS[:3]]
    answers = ["1", "1 + 1 = 2\n#### 2", "2 + 1 = 3 and a much longer answer than the others\n#### 3"]
    pids = [render_prompt(p, tok) for p in prompts]
    got = verifier_scores(model, tok, pids, answers, batch_size=2, device="cpu")
    yes, no = tok.encode(YES, allowed_special="none")[0], tok.encode(NO, allowed_special="none")[0]
    for p, a, g in zip(prompts, answers, got):
        ids = render_prompt(verify_messages(p, a), tok)               # the same ids, one at a time
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids]))[0, -1], -1)
        assert g == pytest.approx((lp[yes] - lp[no]).item(), abs=1e-5)
    assert verifier_scores(model, tok, pids[::-1], answers[::-1], batch_size=3, device="cpu") == \
        pytest.approx(got[::-1], abs=1e-5)


def test_auc():
    """The stage's AUC is the project's `separation` (llm/eval/paired.py)."""
    def auc(scores, right):
        sep = separation(scores, right, n_boot=1, rng=np.random.default_rng(0))
        return sep["auc"] if sep else None
    assert auc([3, 2, 1, 0], [True, True, False, False]) == 1.0
    assert auc([0, 1, 2, 3], [True, True, False, False]) == 0.0
    assert auc([1, 1], [True, False]) == 0.5
    assert auc([1, 2], [True, True]) is None
    rng = random.Random(0)
    s = [rng.random() for _ in range(400)]
    assert abs(auc(s, [rng.random() < 0.5 for _ in s]) - 0.5) < 0.1


def test_pair_accuracy_compares_answers_to_the_same_problem_only():
    from llm.post.verifier import pair_accuracy
    # problem a: right 2 > wrong 1; problem b: right 0 < wrong 5, tie 0 = 0; across problems never compared
    acc, n = pair_accuracy(["a", "a", "b", "b", "b"], [2, 1, 0, 5, 0], [True, False, True, False, False])
    assert n == 3 and acc == pytest.approx((1 + 0 + 0.5) / 3)
    assert pair_accuracy(["a", "b"], [1, 0], [True, False]) == (None, 0)
