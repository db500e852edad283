"""Loss functions against hand-computed values and their named invariants."""
from __future__ import annotations

import math

import pytest
import torch

from llm.nn.losses import (aggregate, gae, group_advantages, kl_estimate, masked_lm_loss, masked_mean, ppo_policy_loss,
                           ppo_value_loss, whiten)


def test_gae_hand_computed():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.5)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]))
    assert torch.allclose(ret, adv + v)


def test_gae_with_gamma_lambda_one_is_returns_minus_values():
    torch.manual_seed(0)
    r, v = torch.randn(4, 6), torch.randn(4, 6)
    m = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 1 + [0] * 5, [1] * 3 + [0] * 3], dtype=torch.bool)
    adv, _ = gae(r, v, m, gamma=1.0, lam=1.0)
    mr = r * m
    returns = torch.flip(torch.cumsum(torch.flip(mr, [1]), 1), [1])  # reward-to-go within the valid prefix
    assert torch.allclose(adv, (returns - v) * m, atol=1e-6)


def test_clipped_surrogate_has_zero_gradient_outside_the_clip_range():
    old = torch.zeros(1, 4)
    # ratios e^0.5 > 1.2 with A > 0, e^-0.5 < 0.8 with A < 0: clipped, no gradient;
    # ratio 1.0: inside, gradient -A.
    logp = torch.tensor([[0.5, -0.5, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, stats = ppo_policy_loss(logp, old, adv, torch.ones(1, 4, dtype=torch.bool), clip_epsilon=0.2)
    loss.sum().backward()
    assert logp.grad[0, :2].abs().max() == 0
    assert torch.allclose(logp.grad[0, 2:], torch.tensor([-1.0, 1.0]))
    assert stats["clip_ratio"].item() == pytest.approx(0.5)


def test_value_loss_clipping():
    v = torch.tensor([[2.0]], requires_grad=True)
    loss, frac = ppo_value_loss(v, torch.tensor([[0.0]]), torch.tensor([[3.0]]), torch.ones(1, 1, dtype=torch.bool),
                                value_clip=0.5)
    # clipped value 0.5 is further from the return: loss 0.5 * (0.5 - 3)^2, no gradient through v
    assert loss.item() == pytest.approx(0.5 * 2.5 ** 2)
    assert frac.item() == 1.0
    loss.backward()
    assert v.grad.item() == 0


def test_value_clip_fraction_counts_no_rounding_ties():
    # |v - old| = 0.019 is far inside the clip, yet old + (v - old) != v in float32 and lands a
    # hair further from the return: `l2 > l1` alone would call this token clipped
    old, v, ret = (torch.tensor([[x]]) for x in (0.007501894608139992, -0.011231518350541592, -0.026114098727703094))
    assert old + (v - old) != v and ((old + (v - old) - ret) ** 2 > (v - ret) ** 2)
    loss, frac = ppo_value_loss(v, old, ret, torch.ones(1, 1, dtype=torch.bool), value_clip=0.2)
    assert frac.item() == 0.0
    assert loss.item() == pytest.approx(0.5 * (v - ret).item() ** 2)


def test_k3_is_nonnegative_and_zero_when_policies_match():
    torch.manual_seed(0)
    a, b = torch.randn(100).log_softmax(0), torch.randn(100).log_softmax(0)
    assert (kl_estimate(a, b, "k3") >= 0).all()
    assert torch.equal(kl_estimate(a, a, "k3"), torch.zeros(100))
    assert torch.equal(kl_estimate(a, a, "k1"), torch.zeros(100))


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    true_kl = (p * (p / q).log()).sum()
    g = torch.Generator().manual_seed(0)
    s = torch.multinomial(p, 200_000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        est = kl_estimate(p.log()[s], q.log()[s], kind).mean()
        assert est.item() == pytest.approx(true_kl.item(), abs=0.01)


def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.2, 0.2, 0.2, 0.2]])
    adv, zero = group_advantages(r)
    assert zero.tolist() == [False, True]
    assert torch.equal(adv[1], torch.zeros(4))
    assert torch.isfinite(adv).all()
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1, 0]
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std + 1e-4))


def test_aggregations():
    x = torch.tensor([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(x, m, "grpo").item() == pytest.approx((1.0 + 2.0) / 2)
    assert aggregate(x, m, "dapo").item() == pytest.approx(4.0 / 3)
    assert aggregate(x, m, "dr_grpo").item() == pytest.approx(4.0 / 6)


def test_all_masked_batch_is_finite_with_zero_gradient():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.full((2, 5), -100)
    loss, n = masked_lm_loss(logits, targets)
    loss.backward()
    assert n.item() == 0 and loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    x = torch.randn(3, 4, requires_grad=True)
    empty = torch.zeros(3, 4, dtype=torch.bool)
    for out in (masked_mean(x, empty), aggregate(x, empty, "grpo"), aggregate(x, empty, "dapo"),
                whiten(x, empty).sum()):
        assert torch.isfinite(out) and out.item() == 0


def test_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([True, True, True, False])
    w = whiten(x, m)
    assert w[3] == 0
    assert w[:3].mean().abs() < 1e-6 and w[:3].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)


def test_answer_logprob_equals_sequence_logprob_with_its_gradient():
    # right padding, answers of different lengths, a row with no answer token at all
    from llm.nn.losses import answer_logprob, sequence_logprob
    from llm.nn.model import GPT, ModelConfig
    model = GPT(ModelConfig(vocab_size=50, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), seed=0)
    idx = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(4, 12, dtype=torch.bool)
    attn[1, 9:] = attn[3, 6:] = False
    resp = torch.zeros(4, 12, dtype=torch.bool)
    resp[0, 5:], resp[1, 3:9], resp[2, 11:] = True, True, True  # row 3: no answer
    grads = []
    for fn in (sequence_logprob, answer_logprob):
        model.zero_grad(set_to_none=True)
        lp = fn(model, idx, attn, resp)
        (lp * torch.tensor([1.0, -2.0, 0.5, 3.0])).sum().backward()
        grads.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = grads
    assert b.shape == (4,) and b[3] == 0 and (a[:3] < 0).all()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)


def test_ignore_index_is_defined_once():
    """The batches write it and the losses and kernels skip it: one definition keeps them agreeing."""
    import ast

    from tests.conftest import ROOT
    where = [f.name for f in sorted((ROOT / "llm").rglob("*.py"))
             for n in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
             if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "IGNORE_INDEX" for t in n.targets)]
    assert where == ["kernels.py"]
