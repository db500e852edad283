"""GRPO (llm/post/grpo.py), the RL stages' run in the skeleton (llm/post/rl.py, llm/train/loop.py) and stage `grpo`.

The loss pieces (group advantages, clipped surrogate, k3, aggregation) are tested in
tests/test_losses.py; here: learning a synthetic reward on a tiny model, exact resume of a
killed run, the non-finite policy, the quality gates, and the stage end to end.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from llm.config import GRPOConfig, ModelConfig, RLConfig
from llm.errors import NonFiniteError, QualityGateError
from llm.nn.model import GPT
from llm.post.grpo import GRPO
from llm.post.rl import run_rl
from llm.runtime import Runtime
from llm.sample.prompts import MathPrompts
from llm.sample.rewards import rm_reward, rm_verifier_reward, verifier_reward
from llm.sample.rollout import Rollout
from llm.train.loop import Updater
from llm.train.metrics import read_metrics
from tests.conftest import ROOT, dvc_command

V, PAD, STOP, TARGET = 16, 0, 1, 3
CPU = Runtime(device=torch.device("cpu"))
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(4, V, (4,), generator=_g).tolist() for _ in range(8)]
TIME_KEYS = {"rollout_s", "scoring_s", "update_s", "step_s", "elapsed_s", "tokens_per_s"}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(heads=("lm",), seed: int = 0) -> GPT:
    return GPT(ModelConfig(vocab_size=V, seq_len=32, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), heads=heads,
               seed=seed)


def target_fraction(ro: Rollout, problems: list[dict]):
    """The synthetic reward: the share of TARGET tokens in each response (0 for an empty one)."""
    ids = ro.response_ids()
    return torch.tensor([sum(t == TARGET for t in x) / max(len(x), 1) for x in ids]), {}


RL_BASE = dict(lr=1e-2, min_lr=1e-2, warmup_steps=0, weight_decay=0.0, beta1=0.9, beta2=0.95, grad_clip=1.0, clip_epsilon=0.2,
               optimizer="adamw", muon_lr=0.02,
               max_new_tokens=8, temperature=1.0, levels=[1], eval_every=1000, eval_problems=0, max_kl=10.0,
               checkpoint_every=1000, keep_checkpoints=2, nonfinite_policy="raise", nonfinite_budget=0,
               correct_reward=1.0, format_reward=0.2, max_steps=20)


def grpo_cfg(**kw) -> GRPOConfig:
    base = dict(RL_BASE, epochs=1, minibatch_size=64, prompts_per_step=8, group_size=8, beta=0.04, loss_agg="grpo",
                curriculum_steps=0, curriculum_levels=[1], max_zero_std_steps=100, step_credit=0.0)
    base.update(kw)
    return GRPOConfig(**base)


def grpo(cfg: GRPOConfig, reward_fn=target_fraction, seed: int = 0) -> GRPO:
    n = cfg.prompts_per_step
    return GRPO(tiny(), tiny(), cfg, prompts_fn=lambda step: (PROMPTS[:n], [{}] * n), reward_fn=reward_fn,
                stop_ids=(STOP,), pad_id=PAD, seed=seed)


def mean(xs):
    return sum(xs) / len(xs)


# ---------------------------------------------------------------------------
# learning


def test_grpo_learns_a_synthetic_reward_within_a_few_dozen_steps(tmp_path):
    cfg = grpo_cfg(max_steps=20)
    res = run_rl(grpo(cfg), cfg, CPU, stage="grpo", run_dir=tmp_path, fingerprint="fp", progress=False)
    r = [row["reward"] for row in res.history]
    assert mean(r[:3]) < 0.2                      # ~1/16 at random init
    assert mean(r[-3:]) > 0.6 and mean(r[-3:]) > mean(r[:3]) + 0.4, r
    row = res.history[-1]
    for k in ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio", "approxkl",
              "policy_loss", "response_length", "lr", "rollout_s", "scoring_s", "update_s"):
        assert k in row and row[k] == row[k], k  # present and not NaN
    assert row["kl"] > 0 and 0 <= row["frac_reward_zero_std"] <= 1


@pytest.mark.parametrize("loss_agg", ["dr_grpo", "dapo"])
def test_other_loss_aggregations_and_minibatches_train(tmp_path, loss_agg):
    cfg = grpo_cfg(max_steps=2, loss_agg=loss_agg, minibatch_size=24, epochs=2, beta=0.0)
    res = run_rl(grpo(cfg), cfg, CPU, stage="grpo", run_dir=tmp_path, fingerprint="fp", progress=False)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res.history)
    assert res.history[-1]["kl"] == 0.0          # beta = 0: no reference pass
    assert res.history[-1]["clip_ratio"] >= 0.0  # later minibatches see a moved policy


def test_zero_variance_groups_give_no_policy_gradient(tmp_path):
    """Every completion of a group rewarded alike: advantages are exactly 0, so with beta = 0
    the loss is 0 and AdamW (no weight decay) leaves the weights where they were."""
    cfg = grpo_cfg(max_steps=1, beta=0.0)
    algo = grpo(cfg, reward_fn=lambda ro, p: (torch.ones(len(ro)), {}))
    before = {k: v.clone() for k, v in algo.model.state_dict().items()}
    res = run_rl(algo, cfg, CPU, stage="grpo", run_dir=tmp_path, fingerprint="fp", progress=False)
    assert res.history[0]["frac_reward_zero_std"] == 1.0 and res.history[0]["loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in algo.model.state_dict().items())


def test_step_credit_alone_pushes_up_the_credited_tokens(monkeypatch):
    """Equal outcome rewards (zero group advantage) but +1 credit on each completion's first token:
    those rows are not skipped, and one update raises the first tokens' log-probabilities."""
    import llm.post.grpo as grpo_mod
    from llm.sample.rollout import response_forward

    def first_token_credit(tokenizer, ro):
        c = torch.zeros(ro.response_mask.shape)
        c[:, 0] = 1.0
        return c
    monkeypatch.setattr(grpo_mod, "step_credit", first_token_credit)
    cfg = grpo_cfg(beta=0.0, step_credit=1.0, lr=1e-2, min_lr=1e-2)
    algo = GRPO(tiny(), None, cfg, prompts_fn=lambda s: (PROMPTS, [{}] * 8),
                reward_fn=lambda ro, p: (torch.ones(len(ro)), {}), stop_ids=(STOP,), pad_id=PAD, seed=0,
                tokenizer=object())
    from llm.post.shares import step_generator
    from llm.sample.rollout import rollout
    ro = rollout(algo.model, [p for p in PROMPTS for _ in range(8)], max_new_tokens=8, temperature=1.0,
                 stop_ids=(STOP,), pad_id=PAD, generator=step_generator(0, "rollout", 0))
    with torch.no_grad():
        before = response_forward(algo.model, ro, 1.0).logprobs[:, 0]
    algo.step(0, Updater(algo.model, cfg, CPU, stage="grpo"))
    with torch.no_grad():
        after = response_forward(algo.model, ro, 1.0).logprobs[:, 0]
    assert float((after - before).mean()) > 0.05
    with pytest.raises(ValueError, match="step_credit > 0 needs the tokenizer"):
        GRPO(tiny(), None, cfg, prompts_fn=None, reward_fn=None, stop_ids=(STOP,), pad_id=PAD, seed=0)


class GradRecorder(Updater):
    """Backward only: keeps the gradients of minimize() instead of stepping."""

    def minimize(self, loss):
        loss.backward()
        self.grads = [p.grad.clone() for p in self.params]
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return True, 0.0


@pytest.mark.parametrize("loss_agg", ["grpo", "dr_grpo", "dapo"])
def test_leaving_zero_advantage_completions_out_gives_the_same_gradient(loss_agg):
    """beta = 0 skips completions of zero-variance groups; beta = 1e-30 (no skip, a KL term that
    cannot change a float32 gradient) is the full computation."""
    def half_informative(ro, problems):  # groups of prompts 0-3 vary, groups of prompts 4-7 are all 0
        got = [float(TARGET in ids) for ids in ro.response_ids()]
        return torch.tensor([g if p["i"] < 4 else 0.0 for g, p in zip(got, problems)]), {}

    grads = []
    for beta in (0.0, 1e-30):
        cfg = grpo_cfg(beta=beta, loss_agg=loss_agg)
        algo = GRPO(tiny(), tiny(), cfg, prompts_fn=lambda s: (PROMPTS, [{"i": i} for i in range(8)]),
                    reward_fn=half_informative, stop_ids=(STOP,), pad_id=PAD, seed=0)
        up = GradRecorder(algo.model, cfg, CPU, stage="grpo")
        row = algo.step(0, up)
        grads.append(up.grads)
    assert 0.5 <= row["frac_reward_zero_std"] < 1.0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_dynamic_sampling_picks_the_first_groups_whose_rewards_differ():
    from llm.post.grpo import first_informative_groups
    zero_std = torch.tensor([True, False, True, False, False])
    assert first_informative_groups(zero_std, 2, 3).tolist() == [3, 4, 5, 9, 10, 11]
    assert first_informative_groups(zero_std, 9, 2).tolist() == [2, 3, 6, 7, 8, 9]   # fewer than k: all of them
    assert first_informative_groups(torch.ones(4, dtype=torch.bool), 2, 3).numel() == 0


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_dynamic_sampling_trains_on_the_first_informative_groups_only(beta):
    """oversample 2: 16 groups are rolled out and the first 8 whose rewards differ are trained on.
    Rewarding the groups after them otherwise must leave the gradient as it was; so must
    rewarding an all-equal group before them otherwise (as long as it stays all-equal)."""
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]                      # 16 distinct prompts

    def rewards(later: float, early: float):
        def fn(ro, problems):  # group 0 all equal; groups 1-8 vary; groups 9-15 vary by `later`
            got = [float(TARGET in ids) for ids in ro.response_ids()]
            out = []
            for j, (g, p) in enumerate(zip(got, problems)):
                i = p["i"]
                out.append(early if i == 0 else g if i <= 8 else later * (j % 3))
            return torch.tensor(out), {}
        return fn

    grads, rows = [], []
    for later, early in ((1.0, 0.0), (5.0, 0.0), (1.0, 1.0)):
        cfg = grpo_cfg(beta=beta, oversample=2, minibatch_size=32)
        algo = GRPO(tiny(), tiny(), cfg, prompts_fn=lambda s: (prompts, [{"i": i} for i in range(16)]),
                    reward_fn=rewards(later, early), stop_ids=(STOP,), pad_id=PAD, seed=0)
        up = GradRecorder(algo.model, cfg, CPU, stage="grpo")
        rows.append(algo.step(0, up))
        grads.append(up.grads)
    informative = 16 * (1 - rows[0]["frac_reward_zero_std"])
    assert informative >= 9, rows[0]      # the draw gives more than 8 informative groups
    assert rows[0]["groups_trained"] == 8.0
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    # without dynamic sampling the later groups' rewards do move the gradient
    plain = []
    for later in (1.0, 5.0):
        cfg = grpo_cfg(beta=beta, minibatch_size=32, prompts_per_step=16)
        algo = GRPO(tiny(), tiny(), cfg, prompts_fn=lambda s: (prompts, [{"i": i} for i in range(16)]),
                    reward_fn=rewards(later, 0.0), stop_ids=(STOP,), pad_id=PAD, seed=0)
        up = GradRecorder(algo.model, cfg, CPU, stage="grpo")
        assert algo.step(0, up)["groups_trained"] == 16.0
        plain.append(up.grads)
    assert any(not torch.equal(a, b) for a, b in zip(*plain))


def test_dynamic_sampling_with_no_informative_group_takes_a_zero_step(tmp_path):
    cfg = grpo_cfg(max_steps=1, beta=0.0, oversample=2)
    algo = GRPO(tiny(), tiny(), cfg, prompts_fn=lambda s: (PROMPTS + PROMPTS, [{}] * 16),
                reward_fn=lambda ro, p: (torch.ones(len(ro)), {}), stop_ids=(STOP,), pad_id=PAD, seed=0)
    before = {k: v.clone() for k, v in algo.model.state_dict().items()}
    res = run_rl(algo, cfg, CPU, stage="grpo", run_dir=tmp_path, fingerprint="fp", progress=False)
    assert res.history[0]["groups_trained"] == 0.0 and res.history[0]["loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in algo.model.state_dict().items())


def test_under_autocast_the_old_logprobs_come_from_a_full_forward(tmp_path):
    """bf16 (CPU autocast here, CUDA in the GPU profiles): decode-step and full-sequence numerics
    differ, so the ratio's denominator is recomputed and starts at exactly 1."""
    cfg = grpo_cfg(max_steps=2)
    rt = Runtime(device=torch.device("cpu"), dtype=torch.bfloat16)
    res = run_rl(grpo(cfg), cfg, rt, stage="grpo", run_dir=tmp_path, fingerprint="fp", progress=False)
    assert res.history[0]["approxkl"] < 1e-9 and res.history[0]["clip_ratio"] == 0.0  # 1e-8 without the recompute
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res.history)


# ---------------------------------------------------------------------------
# the reward control (grpo.reward_control)


def _advantage_inputs(monkeypatch, cfg: GRPOConfig, steps: int = 2) -> tuple[list, list]:
    """(each step's rewards from the reward function, those group_advantages got) over `steps` steps."""
    import llm.post.grpo as grpo_mod
    given, used = [], []
    real = grpo_mod.group_advantages

    def spy(r):
        used.append(r.flatten().clone())
        return real(r)

    def reward_fn(ro, problems):
        r, stats = target_fraction(ro, problems)
        r = r + torch.arange(len(ro)) * 1e-3   # every reward distinct: any permutation shows
        given.append(r.clone())
        return r, stats

    monkeypatch.setattr(grpo_mod, "group_advantages", spy)
    algo = grpo(cfg, reward_fn=reward_fn)
    updater = Updater(algo.model, cfg, CPU, stage="grpo", say=lambda m: None, sum_gradients=True)
    for step in range(steps):
        algo.step(step, updater)
    return given, used


def test_no_reward_control_passes_the_rewards_through_bit_for_bit(monkeypatch):
    given, used = _advantage_inputs(monkeypatch, grpo_cfg(max_steps=2))
    assert grpo_cfg().reward_control == "none"
    assert all(torch.equal(g.float(), u) for g, u in zip(given, used)) and len(used) == 2


def test_shuffled_rewards_are_the_real_ones_in_a_seeded_random_order(monkeypatch):
    given, used = _advantage_inputs(monkeypatch, grpo_cfg(max_steps=2, reward_control="shuffled"))
    for g, u in zip(given, used):
        assert torch.equal(g.float().sort().values, u.sort().values)   # the same values: mean and spread kept
        assert u.mean() == pytest.approx(float(g.mean())) and u.std() == pytest.approx(float(g.std()))
        assert not torch.equal(g.float(), u)                          # but given to other samples
    assert not torch.equal(used[0].argsort(), used[1].argsort())        # a new order each step
    monkeypatch.undo()
    _, again = _advantage_inputs(monkeypatch, grpo_cfg(max_steps=2, reward_control="shuffled"))
    assert all(torch.equal(a, b) for a, b in zip(used, again))          # seeded: a rerun is identical


def test_shuffled_rewards_is_a_seeded_permutation():
    from llm.post.grpo import shuffled_rewards
    r = torch.tensor([0.0, 0.2, 1.0, 1.2, 0.0, 1.2, 0.2, 1.0])
    a = shuffled_rewards(r, torch.Generator().manual_seed(3))
    assert torch.equal(a, shuffled_rewards(r, torch.Generator().manual_seed(3)))
    assert not torch.equal(a, shuffled_rewards(r, torch.Generator().manual_seed(4)))
    assert torch.equal(a.sort().values, r.sort().values) and a.mean() == r.mean() and a.std() == r.std()


def test_the_control_leaves_out_step_credit(monkeypatch):
    """Step credit marks right and wrong step results: the control, which must say nothing about
    correctness, leaves it out."""
    import llm.post.grpo as grpo_mod
    monkeypatch.setattr(grpo_mod, "step_credit", lambda tok, ro: torch.ones(ro.response_mask.shape))
    for control, credited in (("none", True), ("shuffled", False)):
        cfg = grpo_cfg(step_credit=1.0, reward_control=control)
        algo = GRPO(tiny(), tiny(), cfg, prompts_fn=None, reward_fn=None, stop_ids=(STOP,), pad_id=PAD, seed=0,
                    tokenizer=object())
        ro = grpo_mod.rollout(algo.model, PROMPTS[:2], max_new_tokens=4, temperature=1.0, stop_ids=(STOP,),
                              pad_id=PAD, generator=torch.Generator().manual_seed(0))
        adv = algo.scored(ro, torch.zeros(2)).adv
        assert bool((adv != 0).any()) == credited, control


# ---------------------------------------------------------------------------
# resume


class Killed(Exception):
    pass


def _killing(reward_fn, at_call: int):
    calls = {"n": 0}

    def fn(ro, problems):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise Killed(f"killed at reward call {at_call}")
        return reward_fn(ro, problems)
    return fn


def _same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ({k: v for k, v in ra.items() if k not in TIME_KEYS}
                == {k: v for k, v in rb.items() if k not in TIME_KEYS})


def test_a_killed_grpo_run_resumes_and_matches_the_uninterrupted_run(tmp_path):
    cfg = grpo_cfg(max_steps=5, checkpoint_every=2)
    full = grpo(cfg)
    ref_res = run_rl(full, cfg, CPU, stage="grpo", run_dir=tmp_path / "a", fingerprint="fp", progress=False)

    first = grpo(cfg, reward_fn=_killing(target_fraction, at_call=4))  # dies in step 4, after ckpt 2
    with pytest.raises(Killed):
        run_rl(first, cfg, CPU, stage="grpo", run_dir=tmp_path / "b", fingerprint="fp", progress=False)
    assert sorted(p.name for p in (tmp_path / "b").glob("ckpt-*")) == ["ckpt-00000002"]
    again = grpo(cfg)                                                     # a fresh process, same inputs
    res = run_rl(again, cfg, CPU, stage="grpo", run_dir=tmp_path / "b", fingerprint="fp", progress=False)
    assert res.resumed_from == 2 and res.step == 5
    _same_rows(res.history, ref_res.history)
    for k, v in full.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k]), k

    other = grpo(cfg)  # another fingerprint (params or inputs changed): never resumed
    res2 = run_rl(other, cfg, CPU, stage="grpo", run_dir=tmp_path / "b", fingerprint="fp2", progress=False)
    assert res2.resumed_from is None and (tmp_path / "b" / "stale").is_dir()


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_exits(tmp_path):
    import signal

    def reward_then_term(ro, problems, calls=[0]):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of step 2
        return target_fraction(ro, problems)

    cfg = grpo_cfg(max_steps=5, checkpoint_every=100)
    with pytest.raises(SystemExit) as e:
        run_rl(grpo(cfg, reward_fn=reward_then_term), cfg, CPU, stage="grpo", run_dir=tmp_path, fingerprint="fp",
               progress=False)
    assert e.value.code == 128 + signal.SIGTERM
    assert [p.name for p in tmp_path.glob("ckpt-*")] == ["ckpt-00000002"]
    res = run_rl(grpo(cfg), cfg, CPU, stage="grpo", run_dir=tmp_path, fingerprint="fp", progress=False)
    assert res.resumed_from == 2 and res.step == 5


# ---------------------------------------------------------------------------
# non-finite policy and gates


def _nan_reward(ro, problems):
    r = torch.rand(len(ro), generator=torch.Generator().manual_seed(len(ro)))
    r[0] = float("nan")
    return r, {}


def test_nonfinite_loss_raises_before_the_optimizer_step(tmp_path):
    cfg = grpo_cfg(max_steps=1, nonfinite_policy="raise")
    algo = grpo(cfg, reward_fn=_nan_reward)
    before = {k: v.clone() for k, v in algo.model.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"grpo: step 1: non-finite loss.*no update was applied"):
        run_rl(algo, cfg, CPU, stage="grpo", run_dir=tmp_path, fingerprint="fp", progress=False)
    assert all(torch.equal(before[k], v) for k, v in algo.model.state_dict().items())


def test_nonfinite_skip_leaves_weights_and_moments_alone_within_the_budget(tmp_path):
    cfg = grpo_cfg(max_steps=2, nonfinite_policy="skip", nonfinite_budget=2)
    algo = grpo(cfg, reward_fn=_nan_reward)
    before = {k: v.clone() for k, v in algo.model.state_dict().items()}
    res = run_rl(algo, cfg, CPU, stage="grpo", run_dir=tmp_path / "a", fingerprint="fp", progress=False)
    assert res.nonfinite_skips == 2 and all(r["skipped"] == 1.0 for r in res.history)
    assert all(torch.equal(before[k], v) for k, v in algo.model.state_dict().items())
    cfg = grpo_cfg(max_steps=3, nonfinite_policy="skip", nonfinite_budget=2)
    with pytest.raises(NonFiniteError, match="above grpo.nonfinite_budget=2"):
        run_rl(grpo(cfg, reward_fn=_nan_reward), cfg, CPU, stage="grpo", run_dir=tmp_path / "b", fingerprint="fp",
               progress=False)


def test_infinite_gradient_norm_is_caught():
    m = tiny()
    up = Updater(m, grpo_cfg(), CPU, stage="grpo")
    m.wte.weight.register_hook(lambda g: g * float("inf"))
    with pytest.raises(NonFiniteError, match="non-finite gradient norm"):
        up.minimize(m.wte.weight.sum() * 1e-3)  # a finite loss


def test_no_informative_group_for_n_steps_ends_the_run_and_fails_its_gate(tmp_path):
    cfg = grpo_cfg(max_steps=10, max_zero_std_steps=3)
    algo = grpo(cfg, reward_fn=lambda ro, p: (torch.zeros(len(ro)), {}))
    res = run_rl(algo, cfg, CPU, stage="grpo", run_dir=tmp_path, fingerprint="fp", progress=False,
                 stop_early=algo.stalled)
    assert res.step == 3 and algo.stalled()                   # ended there, not at max_steps
    gate = algo.zero_std_gate(res.history)
    assert gate.failed()
    with pytest.raises(QualityGateError, match=r"no informative group.* 3 is at grpo.max_zero_std_steps=3 \(up to step 3;"):
        raise gate.error("grpo", "no model was written")
    algo.zero_std_streak = 2                                   # one step short of the limit passes
    assert not algo.stalled() and not algo.zero_std_gate(res.history).failed()


def test_rl_config_checks_levels():
    from llm.config import ConfigError, params_from_dict
    d = yaml.safe_load((ROOT / "params.yaml").read_text())
    d["grpo"]["curriculum_levels"] = [6, 2]  # 0 is allowed: problems from sources, which have no level
    d["ppo"]["kl_alert_low"] = 0.5
    with pytest.raises(ConfigError) as e:
        params_from_dict(d)
    assert "grpo.curriculum_levels[0]: expected an int in [0, 5], got 6" in str(e.value)
    assert "ppo.kl_alert_low: 0.5 is above kl_alert_high" in str(e.value)
    assert isinstance(grpo_cfg(), RLConfig)


# ---------------------------------------------------------------------------
# prompts and the verifier reward


def test_math_prompts_sample_by_level_and_drop_what_does_not_fit(tmp_path):
    from llm.data.tokenizer import Tokenizer
    tok = Tokenizer.train(["What is 2 + 3? #### 5"] * 3, vocab_size=280, min_frequency=1, jieba=False)
    problems = [{"question": "What is 2 + 3?", "answer": "5", "level": 1},
                {"question": "What is 20 + 30?", "answer": "50", "level": 2},
                {"question": "x" * 200, "answer": "1", "level": 2}]
    pool = MathPrompts(problems, tok, seq_len=64, max_new_tokens=8)
    assert pool.dropped == 1
    ids, probs = pool.sample(5, [2], torch.Generator().manual_seed(0))
    assert len(ids) == 5 and all(p["level"] == 2 and p["answer"] == "50" for p in probs)
    assert ids[0][-1] == tok.special["<|assistant|>"]
    with pytest.raises(ValueError, match="no usable problem at levels \\[3\\]"):
        pool.sample(1, [3], torch.Generator())
    # the verifier reward on hand-made responses
    resp = [tok.encode("2 + 3 = 5\n#### 5"), tok.encode("#### 6"), tok.encode("5")]
    L = max(map(len, resp)) + 1
    toks = torch.full((3, 1 + L), tok.pad_id)
    rmask = torch.zeros(3, L, dtype=torch.bool)
    for i, r in enumerate(resp):
        toks[i, 1:1 + len(r) + 1] = torch.tensor(r + [tok.end_id])
        rmask[i, :len(r) + 1] = True
    ro = Rollout(tokens=toks, attention_mask=torch.cat([torch.ones(3, 1, dtype=torch.bool), rmask], 1), prompt_len=1,
                 response_mask=rmask, logprobs=torch.zeros(3, L), stopped=torch.ones(3, dtype=torch.bool))
    r, stats = verifier_reward(tok, correct_reward=1.0, format_reward=0.2)(ro, [problems[0]] * 3)
    assert r.tolist() == pytest.approx([1.2, 0.2, 1.0])
    assert stats == pytest.approx({"accuracy": 2 / 3, "format_rate": 2 / 3})
    # ppo.reward_source rm+verifier: the RM's score plus the verifier's, both parts logged
    rm = GPT(ModelConfig(vocab_size=tok.vocab_size, seq_len=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=16),
             heads=("lm", "reward"), seed=3).eval()
    r_rm, _ = rm_reward(rm, tok)(ro, [problems[0]] * 3)
    r_both, both = rm_verifier_reward(rm, tok, correct_reward=1.0, format_reward=0.2)(ro, [problems[0]] * 3)
    assert r_both.tolist() == pytest.approx((r_rm + torch.tensor([1.2, 0.2, 1.0])).tolist())
    assert both["rm_score"] == pytest.approx(float(r_rm.mean()))
    assert both["verifier_reward"] == pytest.approx(0.8) and both["accuracy"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------
# the stage, end to end in a temp dir


def make_workspace(root: Path, stage: str, overrides: dict | None = None, rm: bool = False) -> dict:
    """A tiny repo: tokenizer + random SFT model (and RM), math data, params.yaml with `stage`."""
    from llm.data.tokenizer import Tokenizer
    from llm.nn.artifacts import save_model_dir
    qs = [(f"What is {a} + {b}?", str(a + b), 1 + (a + b) % 2) for a in range(1, 7) for b in range(1, 5)]
    text = [f"{q}\n1 + 2 = 3\n#### {s}" for q, s, _ in qs]
    tok = Tokenizer.train(text * 2, vocab_size=300, min_frequency=1, jieba=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, seq_len=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    save_model_dir(root / "models/sft", GPT(cfg, seed=0), tok, {"stage": "sft", "fingerprint": "sft-fp"})
    if rm:
        save_model_dir(root / "models/reward", GPT(cfg, heads=("lm", "reward"), seed=1), tok,
                       {"stage": "reward", "fingerprint": "rm-fp"})
    d = root / "data/prepared/rl"
    d.mkdir(parents=True)
    rows = [{"id": f"m{i}", "question": q, "answer": s, "level": lvl, "lang": "en"} for i, (q, s, lvl) in enumerate(qs)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    (d / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[20:]))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    sec = params[stage]
    sec.update(max_steps=4, lr=1.0e-2, min_lr=1.0e-2, warmup_steps=1, epochs=1, max_new_tokens=8, levels=[1, 2], eval_every=2,
               eval_problems=4, checkpoint_every=2, max_kl=100.0)
    if stage == "grpo":
        sec.update(prompts_per_step=2, group_size=4, minibatch_size=8, curriculum_steps=2, curriculum_levels=[1],
                   max_zero_std_steps=100)
    else:
        # math rollouts (the cpu profile's PPO continues passages; tests/test_ppo.py covers those)
        sec.update(rollout_prompts=4, minibatch_size=2, reward_source="rm" if rm else "verifier",
                   continuation_share=0.0, continuation_eval=0, overopt_steps=0, ptx_coef=0.0)
    sec.update(overrides or {})
    common = dict(params["common"], num_threads=1)
    (root / "params.yaml").write_text(yaml.safe_dump({"common": common, stage: sec}, sort_keys=False))
    return sec


def run_stage(root: Path, stage: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(dvc_command(stage), cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_grpo_stage_end_to_end_and_rerun_resumes(tmp_path):
    make_workspace(tmp_path, "grpo")
    p = run_stage(tmp_path, "grpo")
    assert p.returncode == 0, p.stderr[-3000:]
    m = read_metrics(tmp_path / "metrics/grpo.json")  # with its run file (timings, samples)
    for k in ("reward_start", "reward_end", "final_kl", "math_exact_match", "math_exact_match_lo",
              "math_exact_match_hi", "math_exact_match_start", "rollout_s_total", "scoring_s_total",
              "update_s_total", "generation_fraction", "frac_reward_zero_std_mean"):
        assert k in m, k
    assert m["steps"] == 4 and 0 <= m["final_kl"] < 100
    tsv = (tmp_path / "metrics/plots/grpo.tsv").read_text().splitlines()
    assert tsv[0].split("\t")[0] == "step" and len(tsv) == 5 and "frac_reward_zero_std" in tsv[0]
    val = (tmp_path / "metrics/plots/grpo_val.tsv").read_text().splitlines()
    assert [ln.split("\t")[0] for ln in val[1:]] == ["0", "2", "4"]
    assert (tmp_path / "metrics/plots/grpo.png").stat().st_size > 0
    assert list((tmp_path / "runs/grpo/tb").glob("*/events.*"))  # one TensorBoard run per fingerprint
    from llm.nn.artifacts import load_model_dir
    model, _, meta = load_model_dir(tmp_path / "models/grpo")
    assert model.head_names == ("lm",) and meta["stage"] == "grpo" and meta["steps"] == 4
    p2 = run_stage(tmp_path, "grpo")  # finished: resumes at the last step, trains nothing
    assert p2.returncode == 0 and "resumed from" in p2.stdout and "(step 4)" in p2.stdout
    m2 = read_metrics(tmp_path / "metrics/grpo.json")
    assert m2["resumed_from"] == 4 and m2["math_samples"] and m2["math_samples"] == m["math_samples"]
    timing = {"train_time_s", "eval_time_s", "elapsed_s", "tokens_per_s", "resumed_from"}
    assert {k: v for k, v in m2.items() if k not in timing and not k.endswith("_s_total")} == \
        {k: v for k, v in m.items() if k not in timing and not k.endswith("_s_total")}


@pytest.mark.slow
def test_grpo_stage_quality_gates_fail_without_writing_a_model(tmp_path):
    make_workspace(tmp_path, "grpo", {"max_kl": 1.0e-9})
    p = run_stage(tmp_path, "grpo")
    assert p.returncode == 1
    assert "quality gate failed: final KL to the reference" in p.stderr and "grpo.max_kl=1e-09" in p.stderr
    assert not (tmp_path / "models/grpo").exists() and not (tmp_path / "metrics/grpo.json").exists()

    (tmp_path / "params.yaml").unlink()
    # near-greedy sampling: the G completions of a prompt are identical, so every group has zero variance
    make_workspace(tmp_path / "b", "grpo", {"max_zero_std_steps": 2, "temperature": 1.0e-3})
    p = run_stage(tmp_path / "b", "grpo")
    assert p.returncode == 1 and "no informative group" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "b/models/grpo").exists()
    failed = json.loads((tmp_path / "b/runs/grpo/failed_metrics.json").read_text())   # the one end-of-stage path
    assert failed["steps"] == 2 and failed["frac_reward_zero_std_mean"] == 1.0


def test_the_reward_trend_is_fitted_after_the_curriculum():
    """A curriculum's easy first steps would read as a fall: GRPO fits the trend after them."""
    from llm.post.rl import summarize
    from llm.train.loop import LoopResult
    hist = [{"step": s, "reward": 0.9 if s <= 3 else 0.5 + 0.01 * s, "kl": 0.0} for s in range(1, 11)]
    result = LoopResult(step=10, history=hist)
    after = summarize(result, trend_after=3)
    assert after["reward_trend"] == pytest.approx(0.06) and after["reward_trend_first_step"] == 4  # 0.54 -> 0.60
    assert after["reward_trend_lo"] == pytest.approx(0.06) and after["reward_trend_hi"] == pytest.approx(0.06)
    every = summarize(result)
    assert every["reward_trend"] < 0 and "reward_trend_first_step" not in every
    assert "reward_trend" not in summarize(result, trend_after=8)  # two steps left: no line


def test_the_held_out_rewards_change_is_paired_by_problem():
    from llm.post.heldout import heldout_reward_change
    start = [0.0, 1.0, 1.0, 0.2, 1.2, 0.0] * 10
    end = [x + 0.1 for x in start]  # every problem up by 0.1: no spread in the change
    ch = heldout_reward_change(start, end, seed=0)
    assert ch["delta"] == pytest.approx(0.1) and ch["lo"] == pytest.approx(0.1) and ch["hi"] == pytest.approx(0.1)
    mixed = heldout_reward_change(start, start[1:] + start[:1], seed=0)  # shuffled: no change on average
    assert mixed["delta"] == pytest.approx(0.0) and mixed["lo"] < 0 < mixed["hi"]


@pytest.mark.slow
def test_grpo_random_runs_the_grpo_section_with_shuffled_rewards(tmp_path):
    make_workspace(tmp_path, "grpo")
    p = run_stage(tmp_path, "grpo_random")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("grpo_random: ") and "rewards shuffled" in p.stdout
    m = read_metrics(tmp_path / "metrics/grpo_random.json")
    assert m["reward_control"] == "shuffled" and m["variant_of"] == "grpo"
    assert m["overrides"] == {"reward_control": "shuffled"}
    head = (tmp_path / "metrics/plots/grpo_random.tsv").read_text().splitlines()[0].split("\t")
    assert "accuracy" in head   # the verifier's real accuracy, logged as before
