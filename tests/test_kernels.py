"""llm/kernels.py: each hand-written backward equals the plain PyTorch path, and one switch turns them all off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm import kernels
from llm.config import ModelConfig
from llm.nn.losses import IGNORE_INDEX, cross_entropy_sum, masked_lm_loss
from llm.nn.model import GPT, apply_rope, rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")

V = 61


def test_rmsnorm_matches_torch_in_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = (1 + 0.3 * torch.randn(16, dtype=torch.float64, generator=g)).requires_grad_()
    torch.autograd.gradcheck(lambda x, w: kernels.RMSNorm.apply(x, w, 1e-5), (x, w))
    torch.autograd.gradcheck(lambda x: kernels.RMSNorm.apply(x, None, 1e-5), (x,))
    gy = torch.randn(3, 5, 16, dtype=torch.float64, generator=g)
    ours = torch.autograd.grad(kernels.RMSNorm.apply(x, w, 1e-5), (x, w), gy)
    ref = torch.autograd.grad(F.rms_norm(x, (16,), w, 1e-5), (x, w), gy)
    torch.testing.assert_close(kernels.RMSNorm.apply(x, w, 1e-5), F.rms_norm(x, (16,), w, 1e-5))
    torch.testing.assert_close(ours, ref)


def test_swiglu_function_matches_autograd_of_the_plain_path():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 16, dtype=torch.float64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(kernels.SwiGLU.apply, (h,))
    gate, up = h.chunk(2, dim=-1)
    plain = F.silu(gate) * up
    gy = torch.randn(3, 5, 8, dtype=torch.float64, generator=g)
    torch.testing.assert_close(kernels.SwiGLU.apply(h), plain)
    torch.testing.assert_close(torch.autograd.grad(kernels.SwiGLU.apply(h), h, gy)[0],
                               torch.autograd.grad(plain, h, gy)[0])


def test_split_rope_function_matches_autograd_of_the_plain_path():
    nh, nkv, hd, T = 4, 2, 8, 5
    cfg = ModelConfig(vocab_size=V, seq_len=16, n_layer=1, n_head=nh, n_kv_head=nkv, n_embd=nh * hd)
    freqs = torch.view_as_complex(rope_tables(cfg)[:T])[None, :, None]  # (1, T, 1, hd/2)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, T, nh + 2 * nkv, hd, generator=g, requires_grad=True)
    ours = kernels.SplitRope.apply(qkv, freqs, nh, nkv)
    qk, v = qkv.split([nh + nkv, nkv], dim=2)
    plain = (*apply_rope(qk, freqs).split([nh, nkv], dim=2), v)
    # upstream gradients laid out as attention's backward gives them: (B, heads, T, hd) transposed
    gys = [torch.randn(2, n, T, hd, generator=g).transpose(1, 2) for n in (nh, nkv, nkv)]
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for used in ((0, 1, 2), (0,), (1, 2)):  # an output without gradient counts as zero
        ga = torch.autograd.grad([ours[i] for i in used], qkv, [gys[i] for i in used], retain_graph=True)[0]
        gb = torch.autograd.grad([plain[i] for i in used], qkv, [gys[i] for i in used], retain_graph=True)[0]
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("V", [7, 300, 5000])  # one block, several blocks, a last partial block
def test_blocked_cross_entropy_matches_torch(V):
    g = torch.Generator().manual_seed(V)
    N = 2 * max(1, (1 << 18) // V) + 3
    logits = (3 * torch.randn(N, V, generator=g)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::4] = IGNORE_INDEX
    ours = cross_entropy_sum(logits, targets)
    assert ours.grad_fn is not None and "CrossEntropySum" in type(ours.grad_fn).__name__
    ref = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(ours, ref)
    ref_grad = torch.autograd.grad(ref, logits, retain_graph=True)[0]
    torch.testing.assert_close(torch.autograd.grad(2.5 * ours, logits)[0], 2.5 * ref_grad)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, IGNORE_INDEX, 3])
    torch.autograd.gradcheck(lambda x: kernels.CrossEntropySum.apply(x, t, False), (x,))
    # overwrite_logits: the same gradient, written over the logits; a second backward is refused
    h = logits.detach().clone().requires_grad_()
    big = h * 1.0
    loss = cross_entropy_sum(big, targets, overwrite_logits=True)
    torch.testing.assert_close(loss, ref)
    loss.backward(retain_graph=True)
    torch.testing.assert_close(h.grad, ref_grad)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.no_grad():  # without autograd: torch's own, the same number
        torch.testing.assert_close(cross_entropy_sum(logits, targets), ref.detach())


def _grad_fn_names(t: torch.Tensor) -> set[str]:
    """Every autograd node type in the graph behind t."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("on", [True, False])
def test_the_switch_decides_which_path_a_training_step_takes(on):
    cfg = ModelConfig(vocab_size=V, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    kernels.set_enabled(on)
    try:
        loss, _ = masked_lm_loss(model(idx[:, :-1]), idx[:, 1:])
    finally:
        kernels.set_enabled(True)
    ours = {n for n in _grad_fn_names(loss) if n.startswith(("RMSNorm", "SplitRope", "SwiGLU", "CrossEntropySum"))}
    assert ours == ({"RMSNormBackward", "SplitRopeBackward", "SwiGLUBackward", "CrossEntropySumBackward"} if on
                    else set())


def test_a_training_step_gives_the_same_gradients_with_the_kernels_on_and_off():
    cfg = ModelConfig(vocab_size=V, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for on in (True, False):
        model = GPT(cfg, seed=0).double()
        kernels.set_enabled(on)
        try:
            loss, _ = masked_lm_loss(model(idx[:, :-1]), idx[:, 1:])
            loss.backward()
        finally:
            kernels.set_enabled(True)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)  # the loss runs in fp32


def test_torch_compile_traces_the_plain_path_in_one_graph():
    """Under torch.compile the kernels step aside: dynamo traces the plain code, which inductor
    fuses itself, in one graph (with the kernels traced, their `out=` writes broke this 2-layer
    model into 12 graphs)."""
    import torch._dynamo

    cfg = ModelConfig(vocab_size=V, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    assert kernels.enabled() and kernels.active(torch.zeros(1))  # outside compile: the kernels
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(model)(idx)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
