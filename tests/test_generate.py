"""llm/sample/generate.py: KV cache == full recomputation, sampling rules, stops, padding, streaming."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical

from llm.config import ModelConfig
from llm.nn.model import GPT
from llm.sample.generate import FastDecoder, Generation, KVCache, filter_logits, generate, sample_next, sampling_problem

V, PAD = 53, 0


pytestmark = pytest.mark.usefixtures("one_thread")


def model(seed: int = 0, **kw) -> GPT:
    base = dict(vocab_size=V, seq_len=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    base.update(kw)
    m = GPT(ModelConfig(**base), seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # sharper than init so that sampling and argmax are not near-uniform
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.15)
    return m.eval()


def prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g).tolist() for n in lengths]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------
# the cache


@pytest.mark.parametrize("impl", ["sdpa", "manual"])
@pytest.mark.parametrize("pos", ["rope", "learned"])
@pytest.mark.parametrize("lengths", [(7, 7, 7), (3, 9, 6)])
def test_cached_decoding_gives_the_logits_of_full_recomputation_at_every_step(impl, pos, lengths):
    m = model(attn_impl=impl, pos=pos)
    ps = prompts(lengths)
    P = max(lengths)
    idx = torch.tensor([[PAD] * (P - len(p)) + p for p in ps])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in ps])
    cache = KVCache.for_model(m, len(ps), max_len=P + 12)
    with torch.no_grad():
        step_logits = m(idx, mask if min(lengths) < P else None, kv_cache=cache)[:, -1]
        for _ in range(12):
            full = m(idx, mask)[:, -1]
            torch.testing.assert_close(step_logits, full, atol=1e-5, rtol=1e-5)
            nxt = step_logits.argmax(-1, keepdim=True)           # (B, 1)
            idx = torch.cat([idx, nxt], 1)
            mask = torch.cat([mask, torch.ones_like(nxt, dtype=torch.bool)], 1)
            step_logits = m(nxt, kv_cache=cache)[:, -1]
    assert cache.length == P + 12


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=4), dict(norm_affine=False)])
@pytest.mark.parametrize("lengths", [(6, 6), (2, 9)])
def test_the_fast_decoding_step_gives_the_logits_of_the_model_cached_path(kw, lengths):
    m = model(**kw)
    assert FastDecoder.supports(m)
    ps = prompts(lengths)
    P = max(lengths)
    idx = torch.tensor([[PAD] * (P - len(p)) + p for p in ps])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in ps]) if min(lengths) < P else None
    plain, fast = KVCache.for_model(m, 2, max_len=P + 10), KVCache.for_model(m, 2, max_len=P + 10)
    with torch.inference_mode():
        nxt = m(idx, mask, kv_cache=plain)[:, -1].argmax(-1)
        m(idx, mask, kv_cache=fast)
        dec = FastDecoder(m)
        for _ in range(10):
            want = m(nxt[:, None], kv_cache=plain)[:, -1]
            got = dec.step(nxt, fast)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            nxt = want.argmax(-1)
    for f in ("k", "v", "mask", "n_real"):
        torch.testing.assert_close(getattr(fast, f), getattr(plain, f), atol=1e-5, rtol=1e-5)
    assert fast.length == plain.length == P + 10


def test_models_the_fast_step_does_not_cover_decode_through_the_model():
    for kw in (dict(pos="learned"), dict(mlp="gelu"), dict(norm="layernorm"), dict(bias=True)):
        m = model(**kw)
        assert not FastDecoder.supports(m)
        out = generate(m, prompts([4]), 6, temperature=0.0, pad_id=PAD)
        assert out.tokens.shape == (1, 10)
    m = model()
    fast = generate(m, prompts([3, 7]), 12, temperature=0.0, pad_id=PAD)
    plain = generate(m, prompts([3, 7]), 12, temperature=0.0, pad_id=PAD, fast=False)
    assert torch.equal(fast.tokens, plain.tokens)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_with_a_cache_matches_one_pass():
    m = model()
    idx = torch.tensor(prompts([20, 20]))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad():
        full = m(idx, mask)
        for padded in (False, True):
            cache = KVCache.for_model(m, 2, max_len=20)
            a = m(idx[:, :8], mask[:, :8] if padded else None, kv_cache=cache)
            b = m(idx[:, 8:15], mask[:, 8:15] if padded else None, kv_cache=cache)
            c = m(idx[:, 15:], None, kv_cache=cache)
            ref = full if padded else m(idx)
            torch.testing.assert_close(torch.cat([a, b, c], 1)[mask if padded else slice(None)],
                                       ref[mask if padded else slice(None)], atol=1e-5, rtol=1e-5)


def test_cache_overflow_and_over_long_requests_raise_clear_errors():
    m = model()
    cache = KVCache.for_model(m, 1, max_len=10)
    with torch.no_grad():
        m(torch.ones(1, 8, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match=r"KVCache overflow: 8 cached \+ 3 new positions > max_len=10"):
            m(torch.ones(1, 3, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="seq_len=48"):
        KVCache.for_model(m, 1, max_len=49)
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\) \+ max_new_tokens \(9\) = 49 exceeds .*seq_len=48"):
        generate(m, prompts([40]), 9, temperature=0, pad_id=PAD)
    cache.reset()
    assert cache.length == 0 and not cache.padded


# ---------------------------------------------------------------------------
# greedy, sampling, filtering


def test_temperature_zero_is_greedy_argmax_of_full_recomputation():
    m = model()
    p = prompts([5])[0]
    out = generate(m, [p], 15, temperature=0.0, pad_id=PAD)
    seq = list(p)
    with torch.no_grad():
        for _ in range(15):
            seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
    assert out.tokens[0].tolist() == seq
    assert out.responses() == [seq[5:]]
    assert out.response_mask.all() and out.prompt_len == 5


def test_batched_prompts_of_different_lengths_match_one_at_a_time():
    m = model()
    ps = prompts([2, 9, 5, 1])
    batch = generate(m, ps, 10, temperature=0.0, pad_id=PAD).responses()
    alone = [generate(m, [p], 10, temperature=0.0, pad_id=PAD).responses()[0] for p in ps]
    assert batch == alone


def test_seeded_sampling_is_reproducible_and_the_seed_matters():
    m = model()
    ps = prompts([4, 6])
    kw = dict(temperature=1.0, top_k=20, top_p=0.95, pad_id=PAD)
    a = generate(m, ps, 20, generator=gen(1), **kw)
    b = generate(m, ps, 20, generator=gen(1), **kw)
    c = generate(m, ps, 20, generator=gen(2), **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    state = torch.random.get_rng_state()
    generate(m, ps, 5, generator=gen(3), **kw)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is never used
    with pytest.raises(ValueError, match="generator"):
        generate(m, ps, 5, temperature=0.7, pad_id=PAD)


def allowed_set(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Written out independently of filter_logits: top-k first, then the smallest nucleus >= top_p."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    if top_k:
        order = order[:top_k]
    probs = F.softmax(logits[order], dim=0)
    keep, mass = [], 0.0
    for i, p in zip(order, probs.tolist()):
        keep.append(i)
        mass += p
        if mass >= top_p:
            break
    return set(keep)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.5), (10, 0.8), (1, 1.0), (0, 0.05)])
def test_top_k_and_top_p_never_sample_outside_the_allowed_set(top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 40, generator=g) * 2
    allowed = [allowed_set(row, top_k, top_p) for row in logits]
    filt = filter_logits(logits, top_k, top_p)
    assert [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in filt] == allowed
    seen = [set() for _ in range(4)]
    for _ in range(300):
        tok, _ = sample_next(logits, temperature=1.0, top_k=top_k, top_p=top_p, generator=g)
        for b in range(4):
            assert int(tok[b]) in allowed[b]
            seen[b].add(int(tok[b]))
    if top_k == 5:
        assert seen == allowed  # and the allowed tokens do get sampled


def test_samples_follow_the_filtered_distribution():
    """Inverse-CDF draws: frequencies match the renormalised top-k/top-p probabilities."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])).expand(20000, 5)
    g = torch.Generator().manual_seed(0)
    for top_k, top_p, want in [(0, 1.0, [0.4, 0.3, 0.15, 0.1, 0.05]), (2, 1.0, [4 / 7, 3 / 7, 0, 0, 0]),
                               (0, 0.8, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])]:
        tok, _ = sample_next(logits, temperature=1.0, top_k=top_k, top_p=top_p, generator=g)
        freq = torch.bincount(tok, minlength=5).float() / len(tok)
        torch.testing.assert_close(freq, torch.tensor(want), atol=0.012, rtol=0)


def test_top_p_nucleus_wider_than_the_first_topk_window():
    """A flat distribution needs more than 64 tokens for the nucleus: the window must grow."""
    logits = -torch.arange(1000.0).expand(2, 1000) * 1e-3
    logits = logits[:, torch.randperm(1000, generator=torch.Generator().manual_seed(0))]
    kept = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in filter_logits(logits, 0, 0.5)]
    assert kept == [allowed_set(r, 0, 0.5) for r in logits] and len(kept[0]) > 300


def test_logprobs_are_categorical_logprobs_of_the_tempered_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 30, generator=g)
    for t in (0.0, 0.7, 1.3):
        tok, lp = sample_next(logits, temperature=t, top_k=7, top_p=0.9, generator=g)
        ref = Categorical(logits=logits / (t or 1.0)).log_prob(tok)
        torch.testing.assert_close(lp, ref)


def test_generation_logprobs_match_a_full_forward_of_the_result():
    """What PPO relies on: the rollout's log-probs are the model's log-probs of those tokens."""
    m = model()
    out = generate(m, prompts([3, 8, 5]), 12, temperature=0.8, stop_ids=(7, 11), pad_id=PAD, generator=gen(0))
    with torch.no_grad():
        logits = m(out.tokens, out.attention_mask)             # (B, P+N, V)
    P, N = out.prompt_len, out.response_mask.shape[1]
    lp = F.log_softmax(logits[:, P - 1: P + N - 1] / 0.8, -1).gather(2, out.tokens[:, P:, None]).squeeze(2)
    rm = out.response_mask
    torch.testing.assert_close(out.logprobs[rm], lp[rm], atol=1e-5, rtol=1e-5)
    assert (out.logprobs[~rm] == 0).all()


# ---------------------------------------------------------------------------
# stops, padding, streaming


def test_stop_tokens_end_rows_which_then_emit_pad_and_the_loop_ends_early():
    m = model()
    ps = prompts([4, 4, 4], seed=3)
    free = generate(m, ps, 20, temperature=0.0, pad_id=PAD)
    # stop at whatever row 0 emits third: row 0 then ends at step 3
    stop = int(free.tokens[0, 4 + 2])
    out = generate(m, ps, 20, temperature=0.0, stop_ids=(stop,), pad_id=PAD)
    for b in range(3):
        r = free.tokens[b, 4:].tolist()
        cut = r.index(stop) + 1 if stop in r else 20
        assert out.response_mask[b].tolist()[:cut] == [True] * cut
        assert not out.response_mask[b, cut:].any()
        assert (out.tokens[b, 4 + cut:] == PAD).all()
        assert out.tokens[b, 4:4 + cut].tolist() == r[:cut]
        assert out.responses()[b] == (r[:cut - 1] if stop in r[:cut] else r[:cut])
        assert bool(out.stopped[b]) == (stop in r)
    assert out.attention_mask[:, 4:].equal(out.response_mask)
    if all(stop in free.tokens[b, 4:].tolist() for b in range(3)):
        assert out.tokens.shape[1] < 4 + 20


def test_all_rows_stopping_ends_generation_at_once():
    m = model()
    ps = prompts([3, 3])
    first = generate(m, ps, 1, temperature=0.0, pad_id=PAD).tokens[:, -1].tolist()
    out = generate(m, ps, 30, temperature=0.0, stop_ids=first, pad_id=PAD)
    assert out.tokens.shape == (2, 4) and out.responses() == [[], []] and out.stopped.all()


def test_streaming_receives_every_step():
    m = model()
    ps = prompts([2, 6])
    got = []
    out = generate(m, ps, 9, temperature=0.0, pad_id=PAD, stream=lambda t: got.append(t.clone()))
    assert torch.equal(torch.stack(got, 1), out.tokens[:, out.prompt_len:])


def test_a_stream_callback_returning_true_ends_generation_after_that_step():
    m = model()
    full = generate(m, prompts([4]), 12, temperature=0.0, pad_id=PAD)
    seen = []
    out = generate(m, prompts([4]), 12, temperature=0.0, pad_id=PAD,
                   stream=lambda t: seen.append(int(t[0])) or len(seen) == 5)
    assert len(seen) == 5 and out.responses() == [full.responses()[0][:5]]
    assert not out.stopped.any()  # ended by the caller, not by a stop token


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e-320), "temperature"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k")])
def test_unusable_sampling_settings_are_refused_before_any_work(kw, match):
    assert match in sampling_problem(**kw)
    with pytest.raises(ValueError, match=match):
        generate(model(), [[1, 2]], 2, pad_id=PAD, generator=gen(0), **{"temperature": 1.0, **kw})


def test_the_smallest_allowed_temperature_still_samples_finite_logprobs():
    out = generate(model(), prompts([3]), 6, temperature=1e-6, pad_id=PAD, generator=gen(0))
    assert sampling_problem(temperature=1e-6, top_k=0, top_p=1.0) is None
    assert torch.isfinite(out.logprobs).all()


def test_generate_restores_training_mode_and_validates_input():
    m = model().train()
    generate(m, prompts([3]), 2, temperature=0.0, pad_id=PAD)
    assert m.training
    with pytest.raises(ValueError, match="empty"):
        generate(m, [[1, 2], []], 2, temperature=0.0, pad_id=PAD)
    with pytest.raises(ValueError, match="outside"):
        generate(m, [[1, V]], 2, temperature=0.0, pad_id=PAD)
    with pytest.raises(ValueError, match="top_p"):
        generate(m, [[1]], 2, temperature=1.0, top_p=0.0, pad_id=PAD, generator=gen(0))


def test_generation_responses_strip_padding_and_the_stop_token():
    g = Generation(tokens=torch.tensor([[0, 5, 6, 9, 0], [4, 5, 6, 7, 8]]),
                   attention_mask=torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool(),
                   prompt_len=2, response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]).bool(),
                   logprobs=torch.zeros(2, 3), stopped=torch.tensor([True, False]))
    assert g.responses() == [[6], [6, 7, 8]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_bf16_training_is_finite_and_greedy_cached_decoding_matches_recomputation():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, seq_len=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    model = GPT(cfg, seed=0).cuda()
    x = torch.randint(0, 97, (4, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    gen = generate(model, [[1, 2, 3], [4, 5]], 8, temperature=0.0, pad_id=0)
    for row, prompt in zip(gen.responses(), [[1, 2, 3], [4, 5]]):
        ids = list(prompt)
        for _ in range(len(row)):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids], device="cuda"))[0, -1].argmax()))
        assert ids[len(prompt):] == row
