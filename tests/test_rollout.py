"""llm/sample/rollout.py: rollout log-probs == a recomputed forward, masks, minibatch selection, the sampled KL."""
from __future__ import annotations

import pytest
import torch

from llm.config import ModelConfig
from llm.nn.losses import sequence_logprob
from llm.nn.model import GPT
from llm.sample.rollout import response_forward, rollout, sampled_kl

V, PAD, STOP = 37, 0, 5


pytestmark = pytest.mark.usefixtures("one_thread")


def model(seed: int = 0, heads=("lm",), **kw) -> GPT:
    cfg = dict(vocab_size=V, seq_len=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    cfg.update(kw)
    m = GPT(ModelConfig(**cfg), heads=heads, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # sharper than init, so some rows stop early and others do not
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return m.eval()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, V, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("impl", ["sdpa", "manual"])
def test_rollout_logprobs_equal_a_recomputed_forward(temperature, impl):
    m = model(attn_impl=impl)
    ro = rollout(m, prompts([3, 9, 6, 9]), max_new_tokens=14, temperature=temperature, stop_ids=(STOP,),
                 pad_id=PAD, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lp = response_forward(m, ro, temperature).logprobs
    rm = ro.response_mask
    assert rm.any(1).all()
    torch.testing.assert_close(ro.logprobs[rm], lp[rm], atol=2e-5, rtol=1e-5)
    assert (ro.logprobs[~rm] == 0).all()
    # and at T = 1 the same numbers as the shared sequence log-prob of llm/nn/losses.py
    if temperature == 1.0:
        P = ro.prompt_len
        loss_mask = torch.cat([torch.zeros_like(ro.attention_mask[:, :P]), rm], 1)
        with torch.no_grad():
            per_tok = sequence_logprob(m, ro.tokens, ro.attention_mask, loss_mask, per_token=True)
        torch.testing.assert_close(per_tok[:, P - 1:][rm], lp[rm], atol=2e-5, rtol=1e-5)


def test_masks_stops_and_response_ids():
    m = model()
    ps = prompts([4, 7, 2], seed=3)
    ro = rollout(m, ps, max_new_tokens=20, temperature=1.0, stop_ids=(STOP,), pad_id=PAD,
                 generator=torch.Generator().manual_seed(0))
    P = ro.prompt_len
    assert P == 7 and ro.tokens.shape[1] == P + ro.response_mask.shape[1]
    assert ro.attention_mask[:, P:].equal(ro.response_mask)
    for b, p in enumerate(ps):  # left padding: the prompt ends at column P-1
        assert ro.tokens[b, P - len(p):P].tolist() == p
        assert not ro.attention_mask[b, :P - len(p)].any()
    ids_with, ids = ro.response_ids(keep_stop=True), ro.response_ids()
    for b in range(3):
        n = int(ro.lengths[b])
        assert ro.response_mask[b, :n].all() and not ro.response_mask[b, n:].any()  # a prefix
        if ro.stopped[b]:
            assert ids_with[b][-1] == STOP and ids[b] == ids_with[b][:-1] and STOP not in ids[b]
        else:
            assert n == 20 and ids[b] == ids_with[b]


def test_select_takes_rows_and_keeps_the_layout():
    m = model(heads=("lm", "value"))
    ro = rollout(m, prompts([3, 5, 4, 2], seed=2), max_new_tokens=8, temperature=1.0, stop_ids=(STOP,),
                 pad_id=PAD, generator=torch.Generator().manual_seed(2))
    sub = ro.select([2, 0])
    assert len(sub) == 2 and sub.prompt_len == ro.prompt_len
    assert sub.tokens.equal(ro.tokens[[2, 0]]) and sub.logprobs.equal(ro.logprobs[[2, 0]])
    with torch.no_grad():
        full = response_forward(m, ro, 1.0, values=True, entropy=True)
        part = response_forward(m, sub, 1.0, values=True, entropy=True)
    rm = sub.response_mask
    torch.testing.assert_close(part.logprobs[rm], full.logprobs[[2, 0]][rm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(part.values[rm], full.values[[2, 0]][rm], atol=1e-5, rtol=1e-5)
    assert (part.entropy[rm] > 0).all()


def test_response_forward_gradients_reach_policy_and_value_head():
    m = model(heads=("lm", "value"))
    ro = rollout(m, prompts([3, 4]), max_new_tokens=5, temperature=1.0, stop_ids=(), pad_id=PAD,
                 generator=torch.Generator().manual_seed(0))
    out = response_forward(m, ro, 1.0, values=True, entropy=True, entropy_grad=False)
    assert not out.entropy.requires_grad
    (out.logprobs.sum() + out.values.sum()).backward()
    assert m.value_head.weight.grad is not None and m.wte.weight.grad.abs().sum() > 0


def test_sampled_kl_is_zero_against_itself_and_positive_against_another_model():
    a, b = model(4), model(5)
    ps = [[1, 2, 6, 3], [1, 3, 4], [1, 2, 7, 8, 9, 3]]
    same = sampled_kl(a, a, ps, max_new_tokens=6, temperature=1.0, stop_ids=(), pad_id=PAD, seed=0,
                      batch_size=2)
    assert same.per_token == pytest.approx(0.0, abs=1e-6) and same.tokens == 3 * 6
    diff = sampled_kl(a, b, ps, max_new_tokens=6, temperature=1.0, stop_ids=(), pad_id=PAD, seed=0,
                      batch_size=2)
    assert diff.per_token > 1e-3 and diff.per_sequence == pytest.approx(diff.per_token * 6, rel=1e-5)
    assert sum(diff.sequences) / 3 == pytest.approx(diff.per_sequence)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_kl_matches_a_hand_computation_for_one_token(temperature):
    a, b = model(6), model(7)
    prompt = [1, 2, 3, 4]
    out = sampled_kl(a, b, [prompt], max_new_tokens=1, temperature=temperature, stop_ids=(), pad_id=PAD,
                     seed=0, batch_size=1)
    with torch.no_grad():  # the two next-token distributions at that temperature, over the whole vocabulary
        lp = torch.log_softmax(a(torch.tensor([prompt]))[0, -1] / temperature, -1)
        lq = torch.log_softmax(b(torch.tensor([prompt]))[0, -1] / temperature, -1)
    assert out.per_token == pytest.approx(float((lp.exp() * (lp - lq)).sum()), rel=1e-4)
    assert out.per_sequence == pytest.approx(out.per_token, rel=1e-6) and out.tokens == 1


def test_sampled_kl_shows_each_batch_of_samples_to_the_visitor_in_prompt_order():
    a, b = model(4), model(5)
    ps = [[1, 2, 6, 3, 3, 3], [1, 3], [1, 2, 7]]

    def visit(ro, ix):
        return {i: row[ro.prompt_len - len(ps[i]):]  # prompts are left-padded
                for i, row in zip(ix, ro.tokens[:, :ro.prompt_len].tolist())}
    out = sampled_kl(a, b, ps, max_new_tokens=3, temperature=1.0, stop_ids=(), pad_id=PAD, seed=0, batch_size=2,
                     visit=visit)
    assert len(out.visits) == 2  # one return value per batch, in batch order (shortest prompts first)
    assert out.visits[0] == {1: ps[1], 2: ps[2]} and out.visits[1] == {0: ps[0]}


def test_sampled_kl_batches_do_not_depend_on_each_other():
    """Each batch draws from its own generator, seeded by (seed, batch): a batch's samples are the
    same whatever ran before it, which is what lets the batches be shared out over processes."""
    a, b = model(4), model(5)
    ps = [[1, 2, 6, 3], [1, 3, 4], [1, 2, 7, 8, 9, 3], [1, 4]]
    kw = dict(max_new_tokens=4, temperature=1.0, stop_ids=(), pad_id=PAD, seed=3, batch_size=2,
              visit=lambda ro, ix: ro.response_ids())
    whole = sampled_kl(a, b, ps, **kw)
    order = sorted(range(len(ps)), key=lambda i: len(ps[i]))
    tail = sampled_kl(a, b, [ps[i] for i in order[2:]], **kw)  # the second batch alone is batch 0 here
    assert whole.visits[1] != tail.visits[0]  # another batch index, another generator
    first = sampled_kl(a, b, [ps[i] for i in order[:2]], **kw)
    assert whole.visits[0] == first.visits[0]  # batch 0 is batch 0 with or without the batches after it


def test_rollout_needs_a_positive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        rollout(model(), prompts([3]), max_new_tokens=2, temperature=0.0, stop_ids=(), pad_id=PAD,
                generator=torch.Generator())
