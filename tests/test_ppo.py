"""PPO (llm/post/ppo.py) with its KL controller and alerts, and stage `ppo`.

GAE, the clipped surrogate, the clipped value loss and the KL estimators are tested in
tests/test_losses.py; here: how PPO assembles them, learning a synthetic reward, resume,
and the stage end to end with a reward model and with the verifier.
"""
from __future__ import annotations


import pytest
import torch

from llm.config import PPOConfig
from llm.nn.losses import gae
from llm.post.ppo import PPO, KLAlert, KLController, token_rewards
from llm.post.rl import run_rl
from llm.train.metrics import read_metrics
from tests.test_grpo import (CPU, PAD, PROMPTS, RL_BASE, STOP, Killed, _killing, _same_rows, make_workspace, mean,
                             run_stage, target_fraction, tiny)


pytestmark = pytest.mark.usefixtures("one_thread")


def ppo_cfg(**kw) -> PPOConfig:
    base = dict(RL_BASE, epochs=2, minibatch_size=16, rollout_prompts=32, reward_source="verifier", vf_coef=0.5,
                value_clip=0.2, ent_coef=0.0, gamma=1.0, lam=0.95, whiten_advantages=True, kl_estimator="k1",
                init_kl_coef=0.01, adaptive_kl=False, kl_target=0.1, kl_horizon=1000, kl_alert_low=0.0,
                kl_alert_high=100.0)
    base.update(kw)
    return PPOConfig(**base)


def ppo(cfg: PPOConfig, reward_fn=target_fraction, log=print) -> PPO:
    prompts = (PROMPTS * 8)[: cfg.rollout_prompts]
    return PPO(tiny(("lm", "value")), tiny(), cfg, prompts_fn=lambda step: (prompts, [{}] * len(prompts)),
               reward_fn=reward_fn, stop_ids=(STOP,), pad_id=PAD, seed=0, log=log)


def test_ppo_learns_a_synthetic_reward_within_a_few_dozen_steps(tmp_path):
    cfg = ppo_cfg(max_steps=15)
    res = run_rl(ppo(cfg), cfg, CPU, stage="ppo", run_dir=tmp_path, fingerprint="fp", progress=False)
    r = [row["reward"] for row in res.history]
    assert mean(r[:3]) < 0.2
    assert mean(r[-3:]) > 0.6 and mean(r[-3:]) > mean(r[:3]) + 0.4, r
    row = res.history[-1]
    for k in ("reward", "reward_std", "kl", "kl_seq", "kl_coef", "non_score_reward", "entropy", "clip_ratio",
              "approxkl", "policy_loss", "value_loss", "vf_clipfrac", "response_length", "lr", "rollout_s",
              "scoring_s", "update_s"):
        assert k in row and row[k] == row[k], k
    assert row["clip_ratio"] > 0  # the second epoch sees a moved policy


def test_ppo_with_the_entropy_bonus_and_k3_trains(tmp_path):
    cfg = ppo_cfg(max_steps=2, ent_coef=0.05, kl_estimator="k3", whiten_advantages=False, minibatch_size=5)
    res = run_rl(ppo(cfg), cfg, CPU, stage="ppo", run_dir=tmp_path, fingerprint="fp", progress=False)
    assert all(r["kl"] >= 0 and r["entropy"] > 0 for r in res.history)


def test_score_goes_on_the_last_response_token_and_gae_carries_it_back():
    score = torch.tensor([1.0, -2.0])
    kl = torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.3, 0.1, 0.2, 0.4]])
    lengths = torch.tensor([2, 4])
    r = token_rewards(score, kl, 0.5, lengths)
    torch.testing.assert_close(r, torch.tensor([[-0.05, 0.9, 0.0, 0.0], [-0.15, -0.05, -0.1, -2.2]]))
    mask = torch.arange(4)[None] < lengths[:, None]
    adv, ret = gae(r, torch.zeros(2, 4), mask, gamma=1.0, lam=1.0)
    # with zero values and gamma = lambda = 1 the return is the reward-to-go
    torch.testing.assert_close(ret[0, :2], torch.tensor([0.85, 0.9]))
    torch.testing.assert_close(ret[1], torch.tensor([-2.5, -2.35, -2.3, -2.2]))


def test_adaptive_kl_controller_follows_ziegler():
    c = KLController(0.1, adaptive=True, target=0.1, horizon=100)
    c.update(0.2, n_steps=10)            # error clipped to +0.2: coef *= 1 + 0.2 * 10/100
    assert c.value == pytest.approx(0.1 * 1.02)
    c.update(0.075, n_steps=10)          # error -0.25 -> -0.2
    assert c.value == pytest.approx(0.1 * 1.02 * 0.98)
    c.update(0.11, n_steps=50)           # error 0.1: *= 1.05
    assert c.value == pytest.approx(0.1 * 1.02 * 0.98 * 1.05)
    fixed = KLController(0.1, adaptive=False, target=0.1, horizon=100)
    fixed.update(5.0, n_steps=100)
    assert fixed.value == 0.1
    with pytest.raises(ValueError, match="kl_target > 0"):
        KLController(0.1, adaptive=True, target=0.0, horizon=1)


def test_kl_alert_reports_leaving_the_band_once_per_excursion():
    a = KLAlert(0.05, 0.2, window=1)
    assert a.check(0.0, 1) is None               # starting at 0 is not an alert
    assert a.check(0.1, 2) is None
    msg = a.check(0.3, 3)
    assert msg and "above kl_alert_high=0.2" in msg and "step 3" in msg
    assert a.check(0.4, 4) is None               # still out: reported once
    assert a.check(0.1, 5) is None
    assert "below kl_alert_low=0.05" in a.check(0.01, 6)
    assert a.alerts == 2
    b = KLAlert(0.05, 0.2, window=1)
    assert b.check(0.5, 1) is not None           # too high is an alert even at the start


def test_kl_alert_at_the_end_when_kl_never_reached_the_band():
    a = KLAlert(0.05, 0.2, window=2)
    for i in range(1, 6):
        assert a.check(0.004, i) is None         # below the band from the start: not an alert yet
    msg = a.finish(5)
    assert msg and "stayed below kl_alert_low=0.05 for the whole run" in msg and a.alerts == 1
    b = KLAlert(0.05, 0.2, window=1)
    b.check(0.1, 1), b.check(0.01, 2)            # entered the band, then left it: reported when it left
    assert b.alerts == 1 and b.finish(2) is None and b.alerts == 1
    c = KLAlert(0.05, 0.2, window=1)
    c.check(0.1, 1)
    assert c.finish(1) is None                   # inside the band


def test_kl_alert_smooths_over_a_window():
    a = KLAlert(0.05, 0.2, window=3)
    for i, kl in enumerate([0.1, 0.1, 0.1, 0.04, 0.1, 0.04, 0.1], 1):  # flickers below 0.05 alone
        assert a.check(kl, i) is None
    assert a.check(0.01, 8) is None and "below" in a.check(0.01, 9)     # mean (0.1+0.01+0.01)/3 < 0.05
    assert a.alerts == 1


def test_ppo_logs_kl_alerts_and_adapts_the_coefficient(tmp_path):
    logs = []
    cfg = ppo_cfg(max_steps=3, kl_alert_low=0.0, kl_alert_high=1e-6, adaptive_kl=True, kl_target=1e-3, kl_horizon=32)
    algo = ppo(cfg, log=logs.append)
    res = run_rl(algo, cfg, CPU, stage="ppo", run_dir=tmp_path, fingerprint="fp", progress=False)
    assert any("ALERT" in m for m in logs)
    kls, coefs = [r["kl"] for r in res.history], [r["kl_coef"] for r in res.history]
    assert kls[0] == 0.0 and kls[1] > 1e-3        # step 1 samples from the reference itself
    assert coefs[0] == 0.01
    assert coefs[1] == pytest.approx(0.01 * 0.8)  # KL below target: the penalty shrinks (clipped)
    assert coefs[2] == pytest.approx(0.01 * 0.8 * 1.2)  # above: it grows
    # a band the KL never reaches from below is reported once, after the last step
    logs.clear()
    quiet = ppo_cfg(max_steps=2, kl_alert_low=10.0, kl_alert_high=20.0)
    run_rl(ppo(quiet, log=logs.append), quiet, CPU, stage="ppo", run_dir=tmp_path / "low", fingerprint="fp",
           progress=False)
    assert len(logs) == 1 and "ALERT step 2" in logs[0] and "stayed below kl_alert_low=10.0" in logs[0]


def test_a_killed_ppo_run_resumes_and_matches_the_uninterrupted_run(tmp_path):
    cfg = ppo_cfg(max_steps=4, checkpoint_every=2, adaptive_kl=True, kl_target=0.01, kl_horizon=50)
    full = ppo(cfg)
    a = run_rl(full, cfg, CPU, stage="ppo", run_dir=tmp_path / "a", fingerprint="fp", progress=False)
    with pytest.raises(Killed):
        run_rl(ppo(cfg, reward_fn=_killing(target_fraction, 4)), cfg, CPU, stage="ppo", run_dir=tmp_path / "b",
               fingerprint="fp", progress=False)
    again = ppo(cfg)
    b = run_rl(again, cfg, CPU, stage="ppo", run_dir=tmp_path / "b", fingerprint="fp", progress=False)
    assert b.resumed_from == 2
    _same_rows(b.history, a.history)  # includes kl_coef: the controller's state was restored
    assert again.kl_ctl.value == full.kl_ctl.value
    for k, v in full.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k]), k


def test_ppo_needs_a_value_head():
    with pytest.raises(ValueError, match="value head"):
        PPO(tiny(), tiny(), ppo_cfg(), prompts_fn=None, reward_fn=None, stop_ids=(STOP,), pad_id=PAD, seed=0)


def _ptx_batch():
    """A fixed SFT-like batch: a prompt the loss skips, then an answer of one repeated token."""
    from llm.data.batching import pad_collate
    seqs = [PROMPTS[i] + [7] * 6 for i in range(4)]
    masks = [[False] * len(PROMPTS[i]) + [True] * 6 for i in range(4)]
    return pad_collate(seqs, pad_id=PAD, loss_masks=masks)


def _sft_loss(model) -> float:
    from llm.train.trainer import supervised_lm_loss
    with torch.no_grad():
        loss_sum, n = supervised_lm_loss(model, _ptx_batch())
    return float(loss_sum / n)


def test_ptx_trains_the_supervised_loss_on_sft_conversations_beside_ppo(tmp_path):
    """PPO-ptx: with ptx_coef > 0 every minibatch adds the supervised loss on a batch the ptx function
    draws (one draw per minibatch), logged as ptx_loss; the policy then fits that batch far better
    than PPO alone leaves it, on the same rollouts' reward."""
    draws = []

    def ptx(g):
        draws.append(torch.randint(1000, (1,), generator=g).item())
        return _ptx_batch()

    models = {}
    for coef in (0.0, 5.0):
        cfg = ppo_cfg(max_steps=3, ptx_coef=coef)
        prompts = (PROMPTS * 8)[: cfg.rollout_prompts]
        algo = PPO(tiny(("lm", "value")), tiny(), cfg, prompts_fn=lambda step: (prompts, [{}] * len(prompts)),
                   reward_fn=target_fraction, stop_ids=(STOP,), pad_id=PAD, seed=0, ptx=ptx)
        res = run_rl(algo, cfg, CPU, stage="ppo", run_dir=tmp_path / str(coef), fingerprint="fp", progress=False)
        models[coef] = algo.model
        assert ("ptx_loss" in res.history[-1]) == (coef > 0)
    start = _sft_loss(tiny(("lm", "value")))
    assert draws and len(draws) == 3 * 2 * 2    # steps x epochs x minibatches, and none at coef 0
    assert len(set(draws[:4])) > 1               # each minibatch draws afresh
    assert _sft_loss(models[5.0]) < 0.5 * min(start, _sft_loss(models[0.0]))


def test_ptx_needs_sft_conversations():
    with pytest.raises(ValueError, match="ptx_coef > 0 needs SFT's conversations"):
        PPO(tiny(("lm", "value")), tiny(), ppo_cfg(ptx_coef=1.0), prompts_fn=None, reward_fn=None, stop_ids=(STOP,),
            pad_id=PAD, seed=0)


# ---------------------------------------------------------------------------
# the stage, end to end in a temp dir


@pytest.mark.slow
@pytest.mark.parametrize("source", ["rm", "rm+verifier"])
def test_ppo_stage_with_a_reward_model_end_to_end(tmp_path, source):
    make_workspace(tmp_path, "ppo", {"reward_source": source}, rm=True)
    p = run_stage(tmp_path, "ppo")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "reward from the reward model" in p.stdout
    m = read_metrics(tmp_path / "metrics/ppo.json")  # with its run file (timings, samples)
    assert m["reward_trend_lo"] <= m["reward_trend"] <= m["reward_trend_hi"]
    # each held-out problem's reward at the start and the end: the same draws as the evaluations
    start, end = m["heldout_rewards_start"], m["heldout_rewards_end"]
    assert len(start) == len(end) > 0
    assert sum(start) / len(start) == pytest.approx(m["heldout_reward_start"], abs=1e-9)
    assert sum(end) / len(end) == pytest.approx(m["heldout_reward"], abs=1e-9)
    assert m["heldout_reward_delta_lo"] <= m["heldout_reward_delta"] <= m["heldout_reward_delta_hi"]
    for k in ("reward_start", "reward_end", "final_kl", "kl_coef_final", "kl_alerts", "math_exact_match",
              "math_exact_match_start", "math_exact_match_delta", "heldout_reward", "heldout_reward_start",
              "heldout_reward_delta", "heldout_kl", "generation_fraction"):
        assert k in m, k
    assert m["reward_source"] == source and m["steps"] == 4
    if source == "rm+verifier":  # the RM part of the held-out reward, on its own
        assert {"rm_score", "rm_score_start", "rm_score_delta"} <= set(m)
        assert "plus the verifier" in p.stdout
    head = (tmp_path / "metrics/plots/ppo.tsv").read_text().splitlines()[0].split("\t")
    assert head[0] == "step" and {"value_loss", "vf_clipfrac", "kl_coef", "kl", "reward"} <= set(head)
    from llm.nn.artifacts import load_model_dir
    model, _, meta = load_model_dir(tmp_path / "models/ppo")
    assert model.head_names == ("lm", "value") and meta["inputs"]["reward"] == "rm-fp"


@pytest.mark.slow
def test_ppo_stage_with_the_verifier_and_the_kl_gate(tmp_path):
    make_workspace(tmp_path, "ppo", {"max_kl": 1.0e-9})
    last_good = tmp_path / "metrics/plots/ppo.tsv"  # the curves of an earlier run that passed
    last_good.parent.mkdir(parents=True, exist_ok=True)
    last_good.write_text("step\treward\n1\t0.5\n")
    p = run_stage(tmp_path, "ppo")
    assert p.returncode == 1 and "reward from the verifier" in p.stdout
    assert "ppo: quality gate failed: final KL" in p.stderr and "no model was written" in p.stderr
    assert not (tmp_path / "models/ppo").exists()
    assert last_good.read_text() == "step\treward\n1\t0.5\n"  # a failed run publishes no curves
    assert (tmp_path / "runs/ppo/plots/ppo.tsv").is_file()     # they stay in its run directory


@pytest.mark.slow
def test_ppo_rm_runs_the_ppo_section_with_the_reward_model_alone(tmp_path):
    """dvc.yaml's ppo_rm: the ppo section (here with the verifier) run under its own name with the
    reward source forced to rm; its files, metrics and meta.json say so."""
    make_workspace(tmp_path, "ppo", {"reward_source": "verifier"}, rm=True)
    p = run_stage(tmp_path, "ppo_rm")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ppo_rm: reward from the reward model" in p.stdout
    m = read_metrics(tmp_path / "metrics/ppo_rm.json")
    from stages.ppo import VARIANTS
    forced = {"reward_source": "rm", "init_kl_coef": 0.0, "adaptive_kl": False, "max_kl": 1e6, "ptx_coef": 0.0}
    assert VARIANTS["ppo_rm"] == forced
    assert m["reward_source"] == "rm" and m["variant_of"] == "ppo" and m["overrides"] == forced
    head = (tmp_path / "metrics/plots/ppo_rm.tsv").read_text().splitlines()[0].split("\t")
    assert {"reward", "accuracy", "kl", "kl_seq"} <= set(head)   # the over-optimisation curve's columns
    from llm.nn.artifacts import load_model_dir
    _, _, meta = load_model_dir(tmp_path / "models/ppo_rm")
    assert meta["stage"] == "ppo_rm" and meta["overrides"] == forced
    assert not (tmp_path / "models/ppo").exists() and (tmp_path / "runs/ppo_rm").is_dir()


@pytest.mark.slow
def test_ppo_rm_has_no_kl_gate(tmp_path):
    """The KL limit that stops ppo (here far below any KL) does not stop ppo_rm, whose KL with no
    penalty is what it measures."""
    make_workspace(tmp_path, "ppo", {"reward_source": "verifier", "max_kl": 1.0e-9}, rm=True)
    p = run_stage(tmp_path, "ppo_rm")
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_metrics(tmp_path / "metrics/ppo_rm.json")["final_kl"] > 1.0e-9


@pytest.mark.slow
def test_ppo_rm_goes_on_for_overopt_steps_and_ppo_does_not(tmp_path):
    """ppo.overopt_steps is the over-optimisation run's length: ppo_rm takes that many steps, ppo
    its max_steps. ppo_rm has no KL penalty (its coefficient 0 throughout) where ppo's adaptive
    controller moves it from init_kl_coef every step (here with a target no KL sits at)."""
    import yaml
    make_workspace(tmp_path, "ppo", {"reward_source": "verifier", "max_steps": 2, "overopt_steps": 4,
                                     "adaptive_kl": True, "kl_target": 1e-9, "kl_horizon": 4}, rm=True)
    for stage, steps in (("ppo_rm", 4), ("ppo", 2)):
        p = run_stage(tmp_path, stage)
        assert p.returncode == 0, p.stderr[-3000:]
        m = read_metrics(tmp_path / f"metrics/{stage}.json")
        assert m["steps"] == steps
        init = yaml.safe_load((tmp_path / "params.yaml").read_text())["ppo"]["init_kl_coef"]
        assert m["kl_coef_final"] == 0.0 if stage == "ppo_rm" else 0 < m["kl_coef_final"] != init, (stage, m)


@pytest.mark.slow
def test_ppo_stage_with_ptx_reads_sft_conversations_and_says_so(tmp_path):
    """ppo.ptx_coef > 0: the stage trains on --sft-data's train.jsonl beside PPO (its curves carry
    ptx_loss, its meta.json the file's hash); without that file it stops and names it."""
    import json
    make_workspace(tmp_path, "ppo", {"ptx_coef": 1.0})
    p = run_stage(tmp_path, "ppo")
    assert p.returncode == 1 and "data/clean_sft/train.jsonl: not found; run `dvc repro clean_sft` first" in p.stderr
    d = tmp_path / "data/clean_sft"
    d.mkdir(parents=True)
    rows = [{"id": f"c{i}", "source": "generated/math_en",
             "messages": [{"role": "user", "content": f"What is {i} + 2?"},
                          {"role": "assistant", "content": f"{i} + 2 = {i + 2}\n#### {i + 2}"}]} for i in range(6)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = run_stage(tmp_path, "ppo")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "each minibatch adds 1.0 x the supervised loss on 2 of 6 SFT conversations" in p.stdout
    head = (tmp_path / "metrics/plots/ppo.tsv").read_text().splitlines()[0].split("\t")
    assert "ptx_loss" in head
    from llm.nn.artifacts import load_model_dir
    _, _, meta = load_model_dir(tmp_path / "models/ppo")
    assert "sft_data" in meta["inputs"]


def _passages(root, n_train=6, n_test=4):
    import json
    d = root / "data/prepared/continue"
    d.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        rows = [{"id": f"continue-{split}-{i}", "prompt": f"Continue this passage:\nWhat is {i} + 1?",
                 "passage": f"What is {i} + 1?", "reference": "x", "source": "shakespeare/w"} for i in range(n)]
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_ppo_on_passages_to_continue_rewards_them_with_the_rm_and_measures_the_gold_judge(tmp_path):
    """ppo.continuation_share: half of each step's prompts are passages, scored by the reward model
    alone (the math half by the verifier); ppo.continuation_eval: held-out passages measured at each
    evaluation: the gold judge, the reward model, the win rate against the reference, the KL."""
    make_workspace(tmp_path, "ppo", {"reward_source": "verifier", "continuation_share": 0.5, "continuation_eval": 4},
                   rm=True)
    _passages(tmp_path)
    p = run_stage(tmp_path, "ppo")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 of 4 prompts a step are passages to continue" in p.stdout
    assert "held-out continuations: gold judge" in p.stdout
    m = read_metrics(tmp_path / "metrics/ppo.json")
    for k in ("continuation_gold", "continuation_gold_start", "continuation_gold_delta", "continuation_rm",
              "continuation_rm_start", "continuation_kl", "continuation_win", "continuation_repetition"):
        assert k in m, k
    assert 0.0 <= m["continuation_win"] <= 1.0 and m["continuation_kl"] >= 0.0
    assert -1.0 <= m["continuation_gold"] <= 1.0
    val = (tmp_path / "metrics/plots/ppo_val.tsv").read_text().splitlines()
    head = val[0].split("\t")
    assert {"continuation_gold", "continuation_rm", "continuation_win", "continuation_kl"} <= set(head)
    first = dict(zip(head, val[1].split("\t")))
    assert float(first["continuation_win"]) == 0.5 and float(first["continuation_kl"]) == pytest.approx(0, abs=1e-6)
    train = (tmp_path / "metrics/plots/ppo.tsv").read_text().splitlines()[0].split("\t")
    assert {"continuation_rm", "continuation_gold", "accuracy"} <= set(train)   # both halves logged apart
    from llm.nn.artifacts import load_model_dir
    _, _, meta = load_model_dir(tmp_path / "models/ppo")
    assert {"continuation_train", "continuation_test", "reward"} <= set(meta["inputs"])


def test_passages_without_a_reward_model_are_refused(tmp_path):
    import yaml

    from llm.config import CommonConfig
    from llm.post.rl import setup_rl_stage
    sec = make_workspace(tmp_path, "ppo", {"reward_source": "verifier", "continuation_share": 0.5})
    _passages(tmp_path)
    cfg = PPOConfig(**sec)
    common = CommonConfig(**yaml.safe_load((tmp_path / "params.yaml").read_text())["common"])
    with pytest.raises(ValueError, match=r"passages to continue \(ppo.continuation_share / continuation_eval\) needs a"
                                         r" reward model directory \(--rm\)"):
        setup_rl_stage("ppo", common, cfg, "cpu", sft=tmp_path / "models/sft", data=tmp_path / "data/prepared/rl",
                       levels=([1, 2],), continuation=tmp_path / "data/prepared/continue", continuation_share=0.5)


def test_continuation_heldout_returns_each_passage_gold_in_item_order(tmp_path):
    """sampled_kl batches the passages by prompt length; the gold scores come back in item order
    (each matches its own passage's continuation, whatever its batch)."""
    from llm.data.tokenizer import Tokenizer
    from llm.nn.model import GPT, ModelConfig
    from llm.post.heldout import continuation_heldout
    from llm.sample import gold
    tok = Tokenizer.train(["joy and love and hope", "grief and hate", "the ship sails"] * 4, vocab_size=300,
                          min_frequency=1, jieba=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, seq_len=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    policy, rm = GPT(cfg, seed=0), GPT(cfg, heads=("lm", "reward"), seed=1)
    items = [{"prompt": "Continue this passage:\n" + "joy " * n, "passage": "joy " * n} for n in (7, 1, 4, 2, 9)]
    texts = {}
    orig = gold.gold_score

    def spy(text, passage):
        texts[passage] = text
        return orig(text, passage)
    gold.gold_score = spy
    try:
        numbers, rows = continuation_heldout(policy, policy, rm, tok, items, max_new_tokens=6, temperature=1.0,
                                             seed=3, batch_size=2)
        g = [r["gold"] for r in rows]
    finally:
        gold.gold_score = orig
    assert len(g) == len(items) and numbers["continuation_kl"] == pytest.approx(0.0, abs=1e-6)
    assert g == [orig(texts[it["passage"]], it["passage"]) for it in items]
    assert numbers["continuation_gold"] == pytest.approx(sum(g) / len(g))
