"""The continuation preference's data and gold judge: passages of verse, the prompts, the judge."""
from __future__ import annotations

import random

import numpy as np
import pytest

from llm.data import continuation as cont
from llm.sample import gold

SPEECH = """ACT I. SCENE I.

DUKE.
Merchant of Syracuse, plead no more;
I am not partial to infringe our laws:
The enmity and discord which of late
Sprung from the rancorous outrage of your duke
To merchants, our well-dealing countrymen,
Who, wanting guilders to redeem their lives,
Have seal'd his rigorous statutes with their bloods,
Excludes all pity from our threat'ning looks.

Enter AEGEON, guarded.

AEGEON.
Yet this my comfort: when your words are done,
My woes end likewise with the evening sun.
Ay.
Proceed, Solinus, to procure my fall,
And by the doom of death end woes and all.
A short line.
"""


def test_passages_are_four_lines_of_one_speech_without_overlap_names_or_directions():
    got = cont.passages(SPEECH)
    assert got == [
        ("Merchant of Syracuse, plead no more;\nI am not partial to infringe our laws:",
         "The enmity and discord which of late\nSprung from the rancorous outrage of your duke"),
        ("To merchants, our well-dealing countrymen,\nWho, wanting guilders to redeem their lives,",
         "Have seal'd his rigorous statutes with their bloods,\nExcludes all pity from our threat'ning looks.")]
    # AEGEON's speech has a one-word line in every window of four: no passage from it
    assert not any("Solinus" in p + a or "comfort" in p + a for p, a in got)


def test_the_prompt_round_trips_and_other_prompts_have_no_passage():
    p = "Two thousand souls and twenty thousand ducats\nWill not debate the question of this straw:"
    assert cont.passage_of(cont.continuation_prompt(p)) == p
    assert cont.continuation_prompt(p).startswith("Continue this passage:\n")
    assert cont.passage_of("What is 7 + 5?") is None
    assert cont.passage_of("Continue this passage:\n  ") is None


def test_draw_is_seeded_distinct_and_honours_skip():
    windows = [("w", f"passage {i % 7}", f"answer {i}") for i in range(20)]
    a = cont.draw(windows, 5, random.Random(3), skip=lambda p: p == "passage 0")
    assert a == cont.draw(windows, 5, random.Random(3), skip=lambda p: p == "passage 0")
    assert len(a) == 5 and len({p for _, p, _ in a}) == 5 and all(p != "passage 0" for _, p, _ in a)
    assert len(cont.draw(windows, 50, random.Random(3))) == 7   # the works run out: fewer, no repeats


PASSAGE = "Merchant of Syracuse, plead no more;\nI am not partial to infringe our laws:"


def test_gold_prefers_the_more_positive_continuation():
    happy = "With joy and love I greet thee, gentle friend,\nAnd all our days be sweet and full of hope."
    sad = "With grief and hate I curse thee, wretched foe,\nAnd all our days be bitter, dark with woe."
    assert gold.gold_score(happy, PASSAGE) > 0.5 > -0.5 > gold.gold_score(sad, PASSAGE) > gold.FLOOR
    assert gold.gold_score(happy + " ", PASSAGE) == gold.gold_score(happy, PASSAGE)


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("Love.", "under three words"),
    ("爱与欢乐与希望永远", "not the passage's language"),
    ("good good good good good good good good", "repeats itself"),
    ("Merchant of Syracuse, plead no more; I am not partial to infringe our laws", "repeats the passage"),
])
def test_what_is_not_a_continuation_scores_the_floor(text, why):
    assert gold.gold_score(text, PASSAGE) == gold.FLOOR, why


def test_repetition_rate_counts_trigrams_said_already():
    assert gold.repetition_rate("a b c d", "") == 0.0
    assert gold.repetition_rate("a b c a b c", "") == pytest.approx(1 / 4)   # (a b c) again, of 4 trigrams
    assert gold.repetition_rate("x y z", "w x y z") == 1.0
    assert gold.repetition_rate("two words", "") == 0.0


def test_spearman_is_pearson_on_ranks_with_ties_sharing_their_rank():
    from llm.eval.paired import ranks, spearman
    assert ranks([3.0, 1.0, 3.0, 2.0]).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 1000]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_proxy_table_ranks_comparisons_beyond_the_margin_and_picks_best_of_n_exactly():
    from llm.post.continuation import continuation_stats, proxy_table
    cands = [{"passage": "p", "samples": ["a b c", "d e f", "g h i"]}]
    gold_scores = [[0.9, 0.0, -0.5]]
    proxy = [[1.0, 2.0, -3.0]]            # right on (a, i) and (d, i), wrong on (a, d)
    t = proxy_table(cands, gold_scores, proxy, margin=0.1)
    assert t["comparisons"] == 3 and t["pair_accuracy"] == pytest.approx(2 / 3)
    assert t["spearman"] == pytest.approx(0.5)
    # n = 1: the mean; n = 3: the proxy's top pick (d, 0.0); the judge's own pick: a (0.9)
    assert t["best_of_n_proxy"][0] == pytest.approx(np.mean([0.9, 0.0, -0.5]))
    assert t["best_of_n_proxy"][2] == pytest.approx(0.0) and t["best_of_n_gold"][2] == pytest.approx(0.9)
    # n = 2: of the pairs {a,d} {a,i} {d,i} the proxy picks d, a, d
    assert t["best_of_n_proxy"][1] == pytest.approx((0.0 + 0.9 + 0.0) / 3)
    s = continuation_stats(cands, [[0.9, gold.FLOOR, 0.0]])
    assert s["not_continuation"] == pytest.approx(1 / 3) and s["words"] == 3.0 and s["repetition_rate"] == 0.0


def test_with_continuations_rewards_passages_by_the_rm_and_math_by_its_own_function():
    import torch

    from llm.nn.reward_model import reward
    from llm.sample.rewards import with_continuations
    from llm.sample.rollout import Rollout
    from tests.test_grpo import tiny
    rm = tiny(("lm", "reward"))
    B, P, N = 5, 3, 4
    g = torch.Generator().manual_seed(0)
    from tests.test_grpo import V
    ro = Rollout(tokens=torch.randint(5, V, (B, P + N), generator=g), attention_mask=torch.ones(B, P + N, dtype=torch.bool),
                 prompt_len=P, response_mask=torch.ones(B, N, dtype=torch.bool), logprobs=torch.zeros(B, N),
                 stopped=torch.zeros(B, dtype=torch.bool))
    problems = [{"answer": "1"}, {"passage": "p one two"}, {"answer": "2"}, {"passage": "p three four"},
                {"answer": "3"}]
    seen = {}

    def math_fn(sub, probs):
        seen["rows"], seen["answers"] = sub.tokens.clone(), [p["answer"] for p in probs]
        return torch.tensor([10.0, 20.0, 30.0]), {"accuracy": 0.5}

    class Tok:
        def decode(self, ids):
            return "joy and love and hope"

    r, stats = with_continuations(math_fn, rm, Tok())(ro, problems)
    assert seen["answers"] == ["1", "2", "3"] and torch.equal(seen["rows"], ro.tokens[[0, 2, 4]])
    assert r[[0, 2, 4]].tolist() == [10.0, 20.0, 30.0]
    assert torch.allclose(r[[1, 3]], reward(rm, ro.tokens[[1, 3]], ro.attention_mask[[1, 3]]).float())
    assert stats["accuracy"] == 0.5 and stats["continuation_gold"] == gold.sentiment("joy and love and hope")
    only_math = with_continuations(math_fn, rm, Tok())(ro.select([0, 2, 4]), [problems[i] for i in (0, 2, 4)])
    assert only_math[1] == {"accuracy": 0.5}   # no passage: math_fn's reward and statistics as they are


def test_passage_prompts_refuse_bad_records_and_drop_what_does_not_fit(tmp_path):
    from llm.fileio import DataError, write_jsonl
    from llm.sample.prompts import PassagePrompts, read_passages

    class Tok:
        special = {}

    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"id": "a", "prompt": "Continue this passage:\nx", "passage": "x"}, {"id": "b", "prompt": ""}])
    with pytest.raises(DataError, match="missing or empty 'prompt'"):
        read_passages(path)
    import llm.sample.prompts as prompts_mod
    orig = prompts_mod.user_prompt
    prompts_mod.user_prompt = lambda text, tok: [1] * len(text)
    try:
        items = [{"id": "a", "prompt": "short", "passage": "x"}, {"id": "b", "prompt": "x" * 50, "passage": "y"}]
        pool = PassagePrompts(items, Tok(), seq_len=40, max_new_tokens=10)
        assert pool.dropped == 1 and [p["id"] for _, p in pool.items] == ["a"]
        assert pool.items[0][1] == {"id": "a", "question": "short", "passage": "x", "kind": "continuation"}
        with pytest.raises(ValueError, match="raise prepare.continuation_rl"):
            PassagePrompts(items[1:], Tok(), seq_len=40, max_new_tokens=10)
    finally:
        prompts_mod.user_prompt = orig


def test_passage_counts_beyond_what_prepare_writes_are_refused_before_a_run():
    import yaml

    from llm.config import ConfigError, params_from_dict
    from tests.conftest import ROOT
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["prepare"].update(continuation_rl=10, continuation_test=5)
    params["pairs"]["continuation_prompts"] = 11
    params["ppo"].update(continuation_eval=6, continuation_share=0.5)
    with pytest.raises(ConfigError) as e:
        params_from_dict(params)
    text = str(e.value)
    assert "pairs.continuation_prompts=11 asks for more passages than prepare.continuation_rl=10" in text
    assert "ppo.continuation_eval=6 asks for more held-out passages than prepare.continuation_test=5" in text
    params["ppo"]["continuation_share"] = 0.01
    with pytest.raises(ConfigError, match="ppo.continuation_share: 0.01 of rollout_prompts=32 rounds to no passage"):
        params_from_dict(params)
