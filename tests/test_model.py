"""llm/nn/model.py: attention implementations agree, positions, causality, heads, presets, debug mode."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llm.config import PRESETS, ModelConfig
from llm.errors import NonFiniteError
from llm.nn.model import GPT, apply_rope, disable_debug, enable_debug, format_count, mlp_hidden, \
    rope_tables, swiglu_hidden
from llm.nn.reward_model import reward


pytestmark = pytest.mark.usefixtures("one_thread")


V = 61


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, seq_len=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=32)
    base.update(kw)
    return ModelConfig(**base)


def sharpen(model: GPT, std: float = 0.2, seed: int = 0) -> GPT:
    """Re-draw weights larger than init_std so attention is far from uniform and mistakes show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.ndim == 1 else 0.0))
    return model


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def masks(B: int, T: int) -> dict[str, torch.Tensor | None]:
    left = torch.ones(B, T, dtype=torch.bool)
    right = left.clone()
    for b in range(B):
        left[b, : b * 3] = False
        right[b, T - b * 2:] = False
    mixed = left.clone()
    mixed[0, -2:] = False
    return {"none": None, "left": left, "right": right, "mixed": mixed}


# ---------------------------------------------------------------------------
# manual == sdpa


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize("mask_kind", ["none", "left", "right", "mixed"])
@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_manual_attention_equals_sdpa_in_outputs_and_gradients(n_kv_head, mask_kind, pos):
    B, T = 4, 16
    idx, mask = tokens(B, T), masks(B, T)[mask_kind]
    models = {}
    for impl in ("manual", "sdpa"):
        m = sharpen(GPT(cfg(n_kv_head=n_kv_head, pos=pos, attn_impl=impl), heads=("lm", "value")))
        logits, hidden = m(idx, mask, return_hidden=True)
        real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool)
        loss = logits[real].logsumexp(-1).mean() + m.value(hidden)[real].pow(2).mean()
        loss.backward()
        models[impl] = (m, logits)
    (mm, lm), (ms, ls) = models["manual"], models["sdpa"]
    assert torch.isfinite(lm).all() and torch.isfinite(ls).all()  # padded query rows included
    torch.testing.assert_close(lm, ls, atol=2e-5, rtol=1e-5)
    for (name, pm), (_, ps) in zip(mm.named_parameters(), ms.named_parameters()):
        assert (pm.grad is None) == (ps.grad is None), name
        if pm.grad is not None:
            torch.testing.assert_close(pm.grad, ps.grad, atol=2e-5, rtol=1e-4, msg=name)


def test_attention_scale_uses_the_real_head_dim():
    # head_dim 8 with n_embd 32: a scale of 1/sqrt(n_embd) or a missing scale would differ
    m = sharpen(GPT(cfg(attn_impl="manual")))
    blk = m.blocks[0].attn
    x = torch.randn(1, 5, 32)
    B, T, C = x.shape
    qkv = blk.qkv(x).view(B, T, 12, 8)
    rot, _ = m._positions_from(0, T, x.device)
    q, k, v = apply_rope(qkv[:, :, :4], rot), apply_rope(qkv[:, :, 4:8], rot), qkv[:, :, 8:]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    want = blk.proj((att @ v).transpose(1, 2).reshape(B, T, C))
    got = blk(x, rot, m.causal[:T, :T], False)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------
# positions


def test_rope_scores_depend_only_on_relative_position():
    freqs = torch.view_as_complex(rope_tables(cfg(seq_len=64)))  # (64, 4)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)

    def rot(x: torch.Tensor, p: int) -> torch.Tensor:
        return apply_rope(x.view(1, 1, 1, 8), freqs[p].view(1, 1, 1, 4))

    def score(m: int, n: int) -> torch.Tensor:
        return (rot(q, m) * rot(k, n)).sum()

    for m, n in [(5, 2), (7, 7), (3, 9)]:
        for shift in (1, 11, 40):
            torch.testing.assert_close(score(m, n), score(m + shift, n + shift), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 3), atol=1e-3)  # but it does depend on m - n
    # a rotation: norms are preserved, and position 0 is the identity
    torch.testing.assert_close(rot(q, 13).norm(), q.norm())
    torch.testing.assert_close(rot(q, 0).flatten(), q)


@pytest.mark.parametrize("pos", ["rope", "learned"])
@pytest.mark.parametrize("impl", ["manual", "sdpa"])
def test_padding_does_not_change_real_tokens(pos, impl):
    """Left or right padding gives the real tokens exactly the logits they have unpadded."""
    m = sharpen(GPT(cfg(pos=pos, attn_impl=impl)))
    idx = tokens(1, 10)
    ref = m(idx)[0]                                            # (10, V)
    pad = torch.full((1, 6), 3)
    left = m(torch.cat([pad, idx], 1), torch.cat([torch.zeros(1, 6, dtype=torch.bool),
                                                  torch.ones(1, 10, dtype=torch.bool)], 1))[0, 6:]
    right = m(torch.cat([idx, pad], 1), torch.cat([torch.ones(1, 10, dtype=torch.bool),
                                                   torch.zeros(1, 6, dtype=torch.bool)], 1))[0, :10]
    torch.testing.assert_close(left, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right, ref, atol=1e-5, rtol=1e-5)


def test_learned_positions_are_renormalised_to_max_norm_one():
    m = GPT(cfg(pos="learned"))
    with torch.no_grad():
        m.wpe.weight.normal_(0.0, 5.0, generator=torch.Generator().manual_seed(0))
    assert m.wpe.weight.norm(dim=1).min() > 1.5
    m(tokens(2, 12))
    norms = m.wpe.weight.norm(dim=1)
    assert (norms[:12] <= 1.0 + 1e-5).all()  # rows used in the forward are bounded
    assert (norms[12:] > 1.5).all()          # rows not looked up are untouched


# ---------------------------------------------------------------------------
# causality


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_a_later_token_never_changes_earlier_logits(impl, pos):
    m = sharpen(GPT(cfg(attn_impl=impl, pos=pos, n_kv_head=2)))
    idx = tokens(2, 16)
    base = m(idx)
    for t in (3, 9, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % V
        out = m(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=0, rtol=0)
        assert not torch.allclose(out[:, t], base[:, t])


# ---------------------------------------------------------------------------
# options and heads


@pytest.mark.parametrize("kw", [dict(norm="layernorm"), dict(norm="layernorm", norm_affine=False),
                                dict(norm="rmsnorm", norm_affine=False), dict(mlp="gelu"), dict(mlp="relu"),
                                dict(tie_embeddings=False), dict(bias=True), dict(bias=True, norm="layernorm"),
                                dict(mlp_hidden=48), dict(dropout=0.1)])
def test_every_option_builds_trains_and_counts(kw):
    m = GPT(cfg(**kw))
    logits = m(tokens(2, 8))
    F.cross_entropy(logits.view(-1, V), tokens(2, 8, seed=1).view(-1)).backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
    assert m.n_params() == sum(p.numel() for p in set(m.parameters()))
    if kw.get("norm_affine") is False:
        assert not any("norm" in n for n, _ in m.named_parameters())


def test_tied_embeddings_share_one_tensor_and_untied_do_not():
    tied, untied = GPT(cfg()), GPT(cfg(tie_embeddings=False))
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.n_params() - tied.n_params() == V * 32


def test_init_is_seeded_scaled_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = GPT(cfg(), seed=1), GPT(cfg(), seed=1), GPT(cfg(), seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.wte.weight, b.wte.weight) and not torch.equal(a.wte.weight, c.wte.weight)
    big = GPT(cfg(n_embd=256, n_head=4, n_kv_head=4, n_layer=8, vocab_size=512))
    assert big.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2*8)
    assert big.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)


def test_forward_returns_float32_logits_and_hidden_after_the_final_norm():
    m = GPT(cfg())
    seen = {}
    m.norm_f.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0]))
    logits, hidden = m(tokens(2, 8), return_hidden=True)
    assert logits.shape == (2, 8, V) and logits.dtype == torch.float32 and hidden.shape == (2, 8, 32)
    x = seen["x"]
    torch.testing.assert_close(hidden, x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # rmsnorm, w=1
    torch.testing.assert_close(logits, hidden @ m.wte.weight.T)
    with pytest.raises(ValueError, match="seq_len"):
        m(tokens(1, 33))


def test_reward_is_read_at_the_last_real_token_whatever_the_padding_side():
    m = sharpen(GPT(cfg(), heads=("lm", "reward")))
    idx = tokens(1, 9)
    pad = torch.full((1, 5), 7)
    ones, zeros = torch.ones(1, 9, dtype=torch.bool), torch.zeros(1, 5, dtype=torch.bool)
    plain = reward(m, idx)
    left = reward(m, torch.cat([pad, idx], 1), torch.cat([zeros, ones], 1))
    right = reward(m, torch.cat([idx, pad], 1), torch.cat([ones, zeros], 1))
    hidden = m.hidden_states(idx)
    torch.testing.assert_close(plain, m.reward_head(hidden[:, -1]).squeeze(-1))
    torch.testing.assert_close(left, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right, plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(reward(m, idx[:, :8]), plain)  # a different last token, a different reward
    batch = reward(m, torch.cat([torch.cat([pad, idx], 1), torch.cat([idx, pad], 1)]),
                     torch.cat([torch.cat([zeros, ones], 1), torch.cat([ones, zeros], 1)]))
    assert batch.shape == (2,)
    torch.testing.assert_close(batch, plain.expand(2), atol=1e-5, rtol=1e-5)


def test_value_head_and_add_head():
    m = GPT(cfg())
    with pytest.raises(ValueError, match="add_head"):
        m.value(torch.zeros(1, 2, 32))
    m.add_head("value")
    m.add_head("reward")
    with pytest.raises(ValueError, match="already"):
        m.add_head("value")
    _, hidden = m(tokens(2, 5), return_hidden=True)
    assert m.value(hidden).shape == (2, 5) and reward(m, tokens(2, 5)).shape == (2,)
    assert m.head_names == ("lm", "value", "reward")
    with pytest.raises(ValueError, match="unknown"):
        GPT(cfg(), heads=("lm", "critic"))


# ---------------------------------------------------------------------------
# presets and accounting


def closed_form(c: ModelConfig) -> int:
    """Parameters of rmsnorm + rope + swiglu, no bias, written out independently of the model code."""
    C, L, V_, hd = c.n_embd, c.n_layer, c.vocab_size, c.n_embd // c.n_head
    H = c.mlp_hidden or 32 * math.ceil(8 * C / 3 / 32)
    attn = C * (c.n_head + 2 * c.n_kv_head) * hd + c.n_head * hd * C
    mlp = 3 * C * H
    per_layer = attn + mlp + 2 * C  # + two norm weights
    return V_ * C * (1 if c.tie_embeddings else 2) + L * per_layer + C


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("tied", [True, False])
def test_preset_parameter_counts_match_the_formula(preset, tied):
    p = PRESETS[preset]
    c = ModelConfig(preset=preset, vocab_size=4096, n_kv_head=p["n_head"], tie_embeddings=tied, **p)
    assert GPT(c, device="meta").n_params() == closed_form(c)


@pytest.mark.parametrize("preset,millions", [("13m", 13), ("77m", 77), ("406m", 406)])
def test_gpu_presets_are_named_after_their_size(preset, millions):
    """With GPT-2's vocabulary and untied embeddings, as in the reference project."""
    p = PRESETS[preset]
    c = ModelConfig(preset=preset, vocab_size=50257, n_kv_head=p["n_head"], tie_embeddings=False, **p)
    assert abs(GPT(c, device="meta").n_params() / 1e6 - millions) < 1.0


def test_presets_are_enforced_by_the_config_check():
    assert ModelConfig(preset="tiny", **PRESETS["tiny"]).check("m") == []
    problems = ModelConfig(preset="tiny", n_embd=256, n_head=4, n_layer=4).check("m")
    assert any("preset 'tiny' has n_embd=128" in p for p in problems)
    assert any("expected one of" in p for p in ModelConfig(preset="huge").check("m"))


def test_params_yaml_uses_the_tiny_preset_size():
    from pathlib import Path

    import yaml
    model = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())["pretrain"]["model"]
    if model["preset"] == "tiny":
        assert {k: model[k] for k in PRESETS["tiny"]} == PRESETS["tiny"]


def test_mlp_default_widths():
    assert swiglu_hidden(384) == 1024 and mlp_hidden(cfg(mlp="gelu")) == 128
    assert mlp_hidden(cfg(mlp_hidden=100)) == 100


def test_flops_per_token_is_6n_plus_attention():
    m = GPT(cfg(tie_embeddings=True))
    c = m.config
    assert m.flops_per_token() == 6 * m.n_params() + 12 * c.n_layer * c.n_head * c.head_dim * c.seq_len
    learned = GPT(cfg(pos="learned", tie_embeddings=False))
    n = learned.n_params() - learned.wpe.weight.numel() - learned.wte.weight.numel()  # lookups are free
    assert learned.flops_per_token() == 6 * n + 12 * 2 * 4 * 8 * 32


def test_summary_and_format_count():
    assert format_count(1_234) == "1.23K" and format_count(12_345_678) == "12.35M"
    assert format_count(406_539_264) == "406.54M" and format_count(999) == "999"
    m = GPT(cfg())
    assert format_count(m.n_params()) in m.summary() and "2 layers x 32 wide" in m.summary()


def test_invalid_config_is_refused_with_every_problem():
    with pytest.raises(ValueError) as e:
        GPT(ModelConfig(vocab_size=0, n_embd=30, n_head=4, n_kv_head=3))
    msg = str(e.value)
    assert "vocab_size" in msg and "n_embd" in msg and "n_kv_head" in msg


# ---------------------------------------------------------------------------
# debug mode


def test_debug_mode_names_the_module_that_produced_a_nan():
    m = GPT(cfg())
    with torch.no_grad():
        m.blocks[1].mlp.fc.weight[3, 5] = float("nan")
    m(tokens(1, 4))  # off: no check, NaN flows to the logits silently
    enable_debug(m)
    with pytest.raises(NonFiniteError) as e:
        m(tokens(1, 4))
    msg = str(e.value)
    assert "'blocks.1.mlp.fc'" in msg and "(1, 4, 192)" in msg and "torch.float32" in msg
    disable_debug(m)
    m(tokens(1, 4))


def test_debug_mode_catches_inf_from_an_activation_and_costs_nothing_when_off():
    m = GPT(cfg())
    assert not any(mod._forward_hooks for mod in m.modules())
    enable_debug(m)
    assert all(len(mod._forward_hooks) == 1 for mod in m.modules() if mod is not m)
    m(tokens(1, 4))  # finite: passes
    with torch.no_grad():
        m.blocks[0].norm_2.weight.fill_(float("inf"))
    with pytest.raises(NonFiniteError, match="'blocks.0.norm_2'"):
        m(tokens(1, 4))
    disable_debug(m)
    assert not any(mod._forward_hooks for mod in m.modules())
