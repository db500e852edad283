"""Preference-pair generation: pair choice and ties, preference_score bounds, adversarial
format-broken pairs, and the `samples` and `pairs` stages end to end."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from llm.config import CommonConfig, PairsConfig
from llm.data.preference import validate_pair
from llm.post.pairs import break_format, choose_pair, preference_score
from llm.sample.generate import Generation
from llm.sample.rewards import math_reward, parse_answer
from llm.train.metrics import read_metrics
from tests.test_reward import make_workspace, params, run_stage


def test_choose_pair_takes_best_and_worst_and_calls_near_equal_scores_a_tie():
    assert choose_pair([0.2, 1.2, 0.0, 1.2], 1e-3) == (1, 2)  # first best, first worst
    assert choose_pair([1.0, 1.0, 1.0], 1e-3) is None          # exact tie
    assert choose_pair([0.5, 0.5004, 0.5009], 1e-3) is None    # within tie_epsilon
    assert choose_pair([0.5, 0.5011], 1e-3) == (1, 0)
    assert choose_pair([0.5, 0.5 + 1e-9], 0.0) == (1, 0)       # epsilon 0: any difference counts
    assert choose_pair([3.0], 0.0) is None                     # one sample is no pair


def test_likelihood_tie_break_takes_the_most_likely_of_the_best_and_of_the_worst():
    from llm.post.pairs import choose_pairs
    prompt = {"id": "p", "prompt": [{"role": "user", "content": "q"}], "answer": "4", "source": "s", "kind": "math"}
    smp = [{"text": t, "score": s, "logp": lp, "rm": 0.0, "temperature": 1.0}
           for t, s, lp in [("right a", 1.2, -9.0), ("wrong a", 0.2, -3.0), ("right b", 1.2, -2.0),
                            ("wrong b", 0.2, -1.0), ("wrong c", 0.2, -8.0)]]
    first, _, _ = choose_pairs([prompt], [smp], 1e-3)
    likely, _, _ = choose_pairs([prompt], [smp], 1e-3, tie_break="likelihood")
    assert (first[0]["chosen"], first[0]["rejected"]) == ("right a", "wrong a")
    assert (likely[0]["chosen"], likely[0]["rejected"]) == ("right b", "wrong b")  # the model's likeliest of each


def test_add_likelihoods_is_the_answers_sequence_log_prob(tmp_path):
    from llm.data.preference import encode_response
    from llm.nn.artifacts import load_model_dir
    from llm.nn.losses import sequence_logprob
    from llm.post.pairs import add_likelihoods
    ws = make_workspace(tmp_path)
    policy, tok, _ = load_model_dir(ws / "models/sft")
    prompt_ids = [tok.encode("What is 2 + 2?"), tok.encode("Say hi")]
    samples = [[{"text": "2 + 2 = 4\n#### 4"}, {"text": "#### 5"}], [{"text": "hi"}]]
    add_likelihoods(samples, prompt_ids, policy, tok, batch_size=2, device="cpu")
    for ids, smp in zip(prompt_ids, samples):
        for x in smp:
            seq = torch.tensor([encode_response(ids, x["text"], tok)])
            resp = torch.zeros_like(seq, dtype=torch.bool)
            resp[0, len(ids):] = True
            want = float(sequence_logprob(policy.eval(), seq, torch.ones_like(resp), resp)[0])
            assert x["logp"] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("d", [1e-300, 1e-17, 1e-3, 0.2, 1.2, 10.0, 37.0, 50.0, 1e6])
def test_preference_score_lies_strictly_between_one_half_and_one(d):
    s = preference_score(1.0 + d, 1.0) if d > 1e-15 else preference_score(d, 0.0)
    assert 0.5 < s < 1.0
    if 1e-3 <= d <= 10:
        assert s == pytest.approx(1 / (1 + math.exp(-d)))


def test_preference_score_refuses_a_non_positive_difference():
    for rc, rr in ((1.0, 1.0), (0.0, 0.5)):
        with pytest.raises(ValueError, match="not above"):
            preference_score(rc, rr)


def test_break_format_keeps_the_content_and_breaks_only_the_format():
    good = "12 + 7 = 19\n19 * 2 = 38\n#### 38"
    seen = set()
    for seed in range(40):
        bad = break_format(good, "38", random.Random(seed))
        value, formatted = parse_answer(bad)
        assert value == 38 and not formatted and "#### 38" != bad.splitlines()[-1].strip()
        assert math_reward(bad, "38") == 1.0 and math_reward(good, "38") == 1.2
        seen.add(bad)
    assert len(seen) >= 4  # several ways to break it
    assert break_format("12 + 7 = 19\n#### 20", "19", random.Random(0)) is None   # wrong: not adversarial material
    assert break_format("12 + 7 = 19", "19", random.Random(0)) is None            # already unformatted
    assert break_format("#### 19", "19", random.Random(0)) is not None            # no body: still breakable


# ---------------------------------------------------------------------------
# The stage

def _check_outputs(ws, cfg: dict) -> tuple[dict, list[dict], list[dict]]:
    m = read_metrics(ws / "metrics/pairs.json")  # with its run file (timings, inputs)
    train = [json.loads(x) for x in (ws / "data/pairs/train.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (ws / "data/pairs/val.jsonl").read_text().splitlines()]
    recs = train + val
    assert len(recs) == m["pairs"] and len(train) == m["train_pairs"] and len(val) == m["val_pairs"]
    for r in recs:
        assert validate_pair(r) is None, r
        assert 0.5 < r["preference_score"] < 1.0
        assert r["reward_chosen"] - r["reward_rejected"] > cfg["tie_epsilon"]  # ties never make it out
        assert r["preference_score"] == pytest.approx(1 / (1 + math.exp(r["reward_rejected"] - r["reward_chosen"])))
        verified = r["kind"] in ("math", "adversarial_format") or (cfg.get("verify_tasks")
                                                                    and r["source"].startswith("generated/"))
        assert (r["scorer"] == "verifier") == verified
    assert not {r["prompt_id"] for r in train} & {r["prompt_id"] for r in val}  # split by prompt
    natural = m["pairs"] - m["adversarial"]
    assert natural + m["ties_dropped"] == m["prompts"]  # every prompt gives one pair or one tie
    assert (ws / "metrics/plots/pairs.tsv").read_text().startswith("preference_score\tpairs")
    return m, train, val


@pytest.mark.slow
def test_pairs_stage_drops_ties_and_keeps_scores_in_the_open_interval(tmp_path):
    ws = make_workspace(tmp_path, reward_model=True)
    for stage in ("samples", "pairs"):
        run = run_stage(ws, stage)
        assert run.returncode == 0, run.stderr
    m, train, val = _check_outputs(ws, params()["pairs"])
    # a random SFT model never answers the math right: every math prompt is a verifier tie
    assert m["ties_dropped_by_scorer"]["verifier"] == m["prompt_sources"]["math"] == 6
    assert m["ties_dropped"] >= 6 and m["pairs_by_scorer"]["rm"] == m["pairs"] > 0
    assert m["responses"] == 12 * 2 * 2
    assert set(m["by_temperature"]) == {"0.7", "1.1"}
    assert m["preference_score"]["min"] > 0.5 and m["preference_score"]["max"] < 1.0


def _fake_generate(tok, solutions: dict[str, tuple[str, str]], references: dict[str, str] | None = None):
    """A stand-in for llm.sample.generate.generate: math prompts get the right solution at temperature
    0.7, and at 1.1 the right one for even-answer questions and a wrong one otherwise; task
    prompts get a temperature-dependent word, or with `references` their reference answer at
    0.7."""
    def gen(model, prompts, max_new_tokens, *, temperature, stop_ids, pad_id, generator, **kw):
        texts = []
        for ids in prompts:
            q = tok.decode([i for i in ids if i not in tok.special.values()])
            if q in solutions:
                sol, ans = solutions[q]
                right = temperature < 1.0 or int(ans) % 2 == 0
                texts.append(sol if right else sol.rsplit("#### ", 1)[0] + f"#### {int(ans) + 1}")
            elif references and temperature < 1.0:
                texts.append(references[q])
            else:
                texts.append("castle" if temperature < 1.0 else "garden garden")
        rows = [tok.encode(t) + [tok.end_id] for t in texts]
        P, N = max(map(len, prompts)), max(map(len, rows))
        tokens = torch.tensor([[pad_id] * (P - len(p)) + list(p) + r + [pad_id] * (N - len(r))
                               for p, r in zip(prompts, rows)])
        resp = torch.tensor([[True] * len(r) + [False] * (N - len(r)) for r in rows])
        prompt_mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
        return Generation(tokens=tokens, attention_mask=torch.cat([prompt_mask, resp], 1), prompt_len=P,
                          response_mask=resp, logprobs=torch.zeros(resp.shape),
                          stopped=torch.ones(len(rows), dtype=torch.bool))
    return gen


def _run_pairs(ws, p: dict, out) -> dict:
    """The samples and pairs stages in this process (so a monkeypatched generate applies) on the
    workspace's models and data with params `p`, the samples written beside `out` and the pairs to
    `out`; returns the pairs stage's metrics."""
    import stages.pairs as pairs_stage
    import stages.samples as samples_stage
    common, cfg = CommonConfig(**p["common"]), PairsConfig(**p["pairs"])
    samples = out.with_name(out.name + "-samples")
    samples_stage.run(common, cfg, "cpu", sft=ws / "models/sft", math=ws / "data/prepared/rl/train.jsonl",
                      sft_data=ws / "data/clean_sft/train.jsonl", out=samples, metrics=ws / "metrics/samples.json",
                      progress=False)
    return pairs_stage.run(common, cfg, "cpu", samples=samples, rm=ws / "models/reward", out=out,
                           metrics=ws / "metrics/pairs.json", plots=ws / "metrics/plots")


def test_pairs_run_injects_adversarial_format_pairs_and_labels_math_by_the_verifier(tmp_path, monkeypatch):
    from llm.nn.artifacts import load_model_dir
    ws = make_workspace(tmp_path, reward_model=True)
    _, tok, _ = load_model_dir(ws / "models/sft")
    rl = [json.loads(x) for x in (ws / "data/prepared/rl/train.jsonl").read_text().splitlines()]
    solutions = {}
    for r in rl:
        a = int(r["answer"])
        solutions[r["question"]] = (f"{a} = {a}\n#### {a}", r["answer"])
    monkeypatch.setattr("llm.sample.generate.generate", _fake_generate(tok, solutions))
    p = params(pairs={"n_prompts": 30, "math_fraction": 0.6, "adversarial_fraction": 0.2, "val_fraction": 0.2})
    m = _run_pairs(ws, p, ws / "data/pairs")
    m2, train, val = _check_outputs(ws, p["pairs"])
    assert m2 == json.loads(json.dumps(m))
    recs = train + val
    math_recs = [r for r in recs if r["kind"] == "math"]
    odd = [q for q, (_, a) in solutions.items() if int(a) % 2]
    # odd answers: right at 0.7, wrong at 1.1 -> a verifier pair (1.2 vs 0.2); even: all right -> a tie
    assert math_recs and all(r["reward_chosen"] == 1.2 and r["reward_rejected"] == 0.2 for r in math_recs)
    assert all(r["prompt"][0]["content"] in odd for r in math_recs)
    assert m["ties_dropped_by_scorer"]["verifier"] == m["prompt_sources"]["math"] - len(math_recs)
    adv = [r for r in recs if r["adversarial"]]
    natural = m["pairs"] - m["adversarial"]
    assert len(adv) == m["adversarial"] == round(0.2 * natural / 0.8) > 0
    for r in adv:
        assert r["kind"] == "adversarial_format" and r["scorer"] == "verifier"
        ans = solutions[r["prompt"][0]["content"]][1]
        assert math_reward(r["chosen"], ans) == 1.2 and math_reward(r["rejected"], ans) == 1.0
        assert r["preference_score"] == pytest.approx(1 / (1 + math.exp(-0.2)))
    # tied prompts are used first: adversarial prompts come from even answers, not from the natural pairs
    assert not {r["prompt_id"] for r in adv} & {r["prompt_id"] for r in math_recs}
    assert m["rm_accuracy_on_adversarial_pairs"] is not None


def test_reference_check_verifies_generated_tasks_and_calculations_only():
    from llm.post.pairs import reference_check, verify
    assert reference_check("generated/task_reverse", "eltsac") == ("eltsac", "exact")
    assert reference_check("generated/arithmetic", "12 * 5 = 60\n#### 60") == ("60", "math")
    assert reference_check("generated/arithmetic", "12 * 5 = 60") == (None, None)  # no #### line: the RM's
    assert reference_check("my_chats", "Hello!") == (None, None)
    task = {"answer": "2, 5, 58", "check": "exact"}
    assert verify(" 2, 5, 58\n", task) == 1.2 and verify("2, 58, 5", task) == 0.0
    assert verify("12 * 5 = 60\n#### 60", {"answer": "60", "check": "math"}) == 1.2
    assert verify("Hi", {"answer": None, "check": None}) is None


def test_verify_tasks_labels_task_pairs_by_their_reference_answers(tmp_path, monkeypatch):
    from llm.nn.artifacts import load_model_dir
    ws = make_workspace(tmp_path, reward_model=True)
    _, tok, _ = load_model_dir(ws / "models/sft")
    rl = [json.loads(x) for x in (ws / "data/prepared/rl/train.jsonl").read_text().splitlines()]
    solutions = {r["question"]: (f"{r['answer']} = {r['answer']}\n#### {r['answer']}", r["answer"]) for r in rl}
    convs = [json.loads(x) for x in (ws / "data/clean_sft/train.jsonl").read_text().splitlines()]
    references = {c["messages"][0]["content"]: c["messages"][1]["content"] for c in convs}
    monkeypatch.setattr("llm.sample.generate.generate", _fake_generate(tok, solutions, references))
    runs = {}
    for verify_tasks in (False, True):
        p = params(pairs={"n_prompts": 30, "math_fraction": 0.4, "adversarial_fraction": 0.2, "val_fraction": 0.2,
                          "verify_tasks": verify_tasks})
        out = ws / f"pairs-{verify_tasks}"
        runs[verify_tasks] = _run_pairs(ws, p, out)
        recs = [json.loads(x) for f in ("train", "val") for x in (out / f"{f}.jsonl").read_text().splitlines()]
        tasks = [r for r in recs if r["kind"].startswith("task_")]
        assert tasks
        if verify_tasks:
            # the reference (sampled at 0.7) against "garden garden" (1.1), every one by the verifier
            for r in tasks:
                assert r["scorer"] == "verifier" and r["chosen"] == references[r["prompt"][0]["content"]]
                assert (r["reward_chosen"], r["reward_rejected"]) == (1.2, 0.0)
            assert runs[True]["by_temperature"]["0.7"]["task_correct"] == 1.0
            assert runs[True]["by_temperature"]["1.1"]["task_correct"] == 0.0
        else:
            assert all(r["scorer"] == "rm" for r in tasks)
            assert "task_correct" not in runs[False]["by_temperature"]["0.7"]
        assert all(r["kind"] == "adversarial_format" or r["kind"] in ("math",) or r["kind"].startswith("task_")
                   for r in recs)
        assert all(r["prompt"][0]["content"] in solutions for r in recs if r["adversarial"])  # math prompts only
    # math is scored the same either way
    assert runs[False]["by_temperature"]["1.1"]["math_correct"] == runs[True]["by_temperature"]["1.1"]["math_correct"]


def test_too_few_pairs_is_an_error_that_names_what_to_change():
    from llm.fileio import DataError
    from llm.post.pairs import too_few_pairs
    with pytest.raises(DataError, match="raise pairs.n_prompts") as plain:
        too_few_pairs(0, "pairs", False)
    assert "verify_tasks" not in str(plain.value)
    with pytest.raises(DataError, match="pairs.verify_tasks: false lets the reward model rank them"):
        too_few_pairs(0, "samples", True)


def test_splits_are_by_prompt_seeded_and_hold_out_the_asked_share():
    from llm.post.pairs import assign_splits
    prompts = [{"id": f"p{i}"} for i in range(40)]
    assign_splits(prompts, 0.25, seed=3)
    again = [{"id": f"p{i}"} for i in reversed(range(40))]  # the order they come in does not matter
    assign_splits(again, 0.25, seed=3)
    assert sum(p["split"] == "val" for p in prompts) == 10
    assert {p["id"]: p["split"] for p in prompts} == {p["id"]: p["split"] for p in again}
    other = [{"id": f"p{i}"} for i in range(40)]
    assign_splits(other, 0.25, seed=4)
    assert [p["split"] for p in other] != [p["split"] for p in prompts]


def test_comparisons_pair_every_right_answer_with_every_wrong_one_of_the_same_prompt():
    from llm.post.pairs import comparisons
    prompt = {"id": "p", "prompt": [{"role": "user", "content": "q"}], "answer": "4", "source": "s", "kind": "math"}
    smp = [{"text": t, "score": s, "temperature": 1.0, "logp_mean": lp}
           for t, s, lp in [("right a", 1.2, -0.1), ("wrong a", 0.2, -0.2), ("right b", 1.2, -0.3),
                            ("right a", 1.2, -0.1), ("unformatted", 1.0, -0.4)]]
    recs = comparisons([prompt], [smp], 1e-3)
    got = sorted((r["chosen"], r["rejected"]) for r in recs)
    assert got == sorted([("right a", "wrong a"), ("right b", "wrong a"), ("right a", "unformatted"),
                          ("right b", "unformatted"), ("unformatted", "wrong a")])  # a repeated text counts once
    assert all(r["scorer"] == "verifier" and r["sft_logp_chosen"] is not None for r in recs)
    assert comparisons([prompt], [[dict(x, score=1.2) for x in smp]], 1e-3) == []  # all right: a tie


@pytest.mark.parametrize("pairs, expected", [
    ({"n_prompts": 100000, "math_fraction": 0.0}, ["data/clean_sft/train.jsonl:", "unique non-math prompts",
                                                    "prepare.task_train"]),
    ({"n_prompts": 100000, "math_fraction": 1.0}, ["data/prepared/rl/train.jsonl:", "math questions",
                                                    "lower pairs.n_prompts"]),
])
def test_pairs_asking_for_more_prompts_than_the_data_has_is_refused_by_file(tmp_path, pairs, expected):
    from llm.fileio import DataError
    ws = make_workspace(tmp_path, reward_model=True)
    with pytest.raises(DataError) as e:
        _run_pairs(ws, params(pairs=pairs), ws / "data/pairs")
    for text in expected:
        assert text in str(e.value)
    assert not (ws / "data/pairs").exists()  # nothing written


def test_errors_sft_would_make_are_wrong_steps_the_model_itself_predicts():
    from types import SimpleNamespace

    from llm.data.template import render_prompt
    from llm.data.tokenizer import Tokenizer
    from llm.post.pairs import errors_sft_would_make
    tok = Tokenizer.train(["12 + 7 = 19\n19 * 2 = 38\n#### 38 What is 12 + 7?"] * 4, vocab_size=300,
                          min_frequency=1, jieba=False)

    class Predicts(torch.nn.Module):
        """A stand-in policy whose next-token prediction is the token that follows (it believes
        whatever is written), or with believes=False always token 0."""
        def __init__(self, believes: bool):
            super().__init__()
            self.w, self.believes = torch.nn.Parameter(torch.zeros(1)), believes
            self.config = SimpleNamespace(seq_len=128)

        def forward(self, idx):
            nxt = torch.cat([idx[:, 1:], idx[:, -1:]], 1) if self.believes else torch.zeros_like(idx)
            return torch.nn.functional.one_hot(nxt, tok.vocab_size).float()

    prompt = [{"role": "user", "content": "What is 12 + 7, doubled?"}]
    recs = [{"prompt_id": "p", "rejected": "12 + 7 = 18\n18 * 2 = 36\n#### 36"},   # a wrong step
            {"prompt_id": "p", "rejected": "12 + 7 = 19\n19 * 2 = 38\n#### 37"},   # no wrong step: not counted
            {"prompt_id": "p", "rejected": "12 + 7 = 19\n20 * 2 = 40\n#### 40"}]   # a wrong number carried
    ids = {"p": render_prompt(prompt, tok)}
    assert errors_sft_would_make(Predicts(True), tok, recs, ids) == {"with_wrong_step": 2, "sft_would_make": 2,
                                                                      "share": 1.0}
    assert errors_sft_would_make(Predicts(False), tok, recs, ids)["share"] == 0.0
    assert errors_sft_would_make(Predicts(True), tok, recs[1:2], ids)["share"] is None


def test_continuations_are_labelled_by_the_gold_judge_and_near_ties_dropped():
    from llm.post.pairs import comparisons, scorer_of, verify
    passage = "Merchant of Syracuse, plead no more;\nI am not partial to infringe our laws:"
    prompt = {"id": "c", "prompt": [{"role": "user", "content": "Continue this passage:\n" + passage}],
              "answer": passage, "check": "gold", "source": "generated/continuation", "kind": "continuation"}
    texts = ["With joy and love I greet thee, gentle friend,", "With grief and hate I curse thee, wretched foe,",
             "The ship was sailing to the town by night,", "The ship was sailing to the town by day,"]
    smp = [{"text": t, "score": verify(t, prompt), "temperature": 1.0, "logp_mean": -1.0} for t in texts]
    assert smp[0]["score"] > 0.5 and smp[1]["score"] < -0.5 and smp[2]["score"] == smp[3]["score"] == 0.0
    recs = comparisons([prompt], [smp], tie_epsilon=1e-3, gold_margin=0.1)
    got = sorted((r["chosen"], r["rejected"]) for r in recs)
    assert got == sorted([(texts[0], texts[1]), (texts[0], texts[2]), (texts[0], texts[3]),
                          (texts[2], texts[1]), (texts[3], texts[1])])   # the two neutral lines tie
    assert {r["scorer"] for r in recs} == {"gold"} == {scorer_of(prompt)}
    assert len(comparisons([prompt], [smp], tie_epsilon=1e-3, gold_margin=1.9)) == 0


def test_continuation_prompts_come_after_the_others_and_leave_them_as_they_were(tmp_path):
    from llm.fileio import write_jsonl
    from llm.post.pairs import sample_prompts
    ws = make_workspace(tmp_path, reward_model=True)
    cont = tmp_path / "continue.jsonl"
    write_jsonl(cont, [{"id": f"continue-train-{i}", "prompt": f"Continue this passage:\nline {i}\nand more",
                        "passage": f"line {i}\nand more", "reference": "x", "source": "shakespeare/w"}
                       for i in range(30)])
    base = PairsConfig(**{**params()["pairs"], "n_prompts": 20, "math_fraction": 0.5})
    math, sft = ws / "data/prepared/rl/train.jsonl", ws / "data/clean_sft/train.jsonl"
    off = sample_prompts(base, 5, math, sft)
    on = sample_prompts(PairsConfig(**{**params()["pairs"], "n_prompts": 20, "math_fraction": 0.5,
                                       "continuation_prompts": 12}), 5, math, sft, cont)
    assert on[:20] == off and len(on) == 32
    assert all(p["check"] == "gold" and p["kind"] == "continuation" and p["answer"].startswith("line ")
               for p in on[20:])
    from llm.fileio import DataError
    with pytest.raises(DataError, match="raise prepare.continuation_rl"):
        sample_prompts(PairsConfig(**{**params()["pairs"], "continuation_prompts": 31}), 5, math, sft, cont)


def test_the_score_histogram_counts_each_scorer_in_its_own_column():
    """One column per scorer (the reward model, the verifier, the gold judge of the passages):
    each pair is counted in its bin under `pairs` and under its scorer's column."""
    from llm.post.pairs import histogram
    pairs = [{"preference_score": 0.52, "scorer": "rm"}, {"preference_score": 0.99, "scorer": "verifier"},
             {"preference_score": 0.99, "scorer": "gold"}, {"preference_score": 0.76, "scorer": "gold"}]
    rows = [r.split("\t") for r in histogram(pairs, bins=4).splitlines()]
    assert rows[0] == ["preference_score", "pairs", "pairs_rm", "pairs_verifier", "pairs_gold"]
    assert [r[1:] for r in rows[1:]] == [["1", "1", "0", "0"], ["0", "0", "0", "0"], ["1", "0", "0", "1"],
                                         ["2", "0", "1", "1"]]
