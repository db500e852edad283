"""Hand-written CPU backward passes: the speed tricks, kept apart from the plain math.

llm/nn/model.py and llm/nn/losses.py read as plain PyTorch. At four places they ask `active(x)` and,
when it says yes, call a function from here instead: the same numbers (up to float rounding)
with a backward written by hand. Each one exists because a profile of the CPU training step
showed the plain version's backward paying for memory traffic that the math does not need:

- `RMSNorm`: F.rms_norm is a chain of generic ops on the CPU (pow, mean, rsqrt, mul, ...);
  forward + backward here cost about half, and the norms run 2 n_layer + 1 times per step.
- `SplitRope`: q/k/v split plus RoPE; the plain backward undoes the rotation and then
  assembles dL/dqkv with two `cat`s, here one pass writes it.
- `SwiGLU`: silu(gate) * up; the plain backward `cat`s the two halves of dL/d[gate|up], here
  both are written into one tensor.
- `CrossEntropySum`: the language-model loss a cache-sized block of rows at a time, its gradient
  written over the logits' own memory; F.cross_entropy makes three fresh (tokens x vocab)
  arrays per step (86 vs 136 ms at 2048 x 8192 on one core, measured alone, alternating).

One switch turns all four off: `common.cpu_kernels: false` in params.yaml (the stages call
`set_enabled`), or `set_enabled(False)` in your own code. Off, the model runs the plain path
everywhere, which is what CUDA, inference and torch.compile always run: `active` is true only
on the CPU with autograd recording, outside torch.compile. tests/test_kernels.py checks every kernel against the plain path in
values and gradients, and the model's tests run with the switch on and off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# The target of a position that is not supervised (F.cross_entropy's default ignore_index). Defined
# here, the lowest module that reads it; llm.data.batching writes it and llm.nn.losses imports it from here.
IGNORE_INDEX = -100

_enabled = True


def set_enabled(on: bool) -> None:
    """Turn the hand-written kernels on (the default) or off (the plain PyTorch path everywhere)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def active(x: Tensor) -> bool:
    """True where a kernel here should replace the plain code: switched on, on the CPU, autograd on,
    and not inside torch.compile.

    CUDA (fused kernels), torch.compile (which fuses the plain code itself; an autograd.Function
    writing into `out=` views breaks its graph) and inference keep the plain tensor code."""
    return (_enabled and x.device.type == "cpu" and torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


class RMSNorm(torch.autograd.Function):
    """x / sqrt(mean(x^2) + eps) * w (w may be None) with a hand-written backward."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor | None, eps: float) -> Tensor:
        C = x.shape[-1]
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(C).add_(eps).rsqrt_()  # (..., 1)
        xhat = x * r                                   # (..., C)
        ctx.save_for_backward(xhat, w, r)
        return xhat * w if w is not None else xhat

    @staticmethod
    def backward(ctx, g: Tensor):
        xhat, w, r = ctx.saved_tensors
        gxhat = g * w if w is not None else g          # dL/dxhat
        # xhat = x r with r = (mean(x^2) + eps)^-1/2:  dL/dx = r (gxhat - xhat * mean(gxhat * xhat))
        dot = torch.linalg.vecdot(gxhat, xhat, dim=-1).unsqueeze(-1).div_(xhat.shape[-1])  # (..., 1)
        gx = torch.addcmul(gxhat, xhat, dot, value=-1.0).mul_(r)
        gw = (g * xhat).flatten(0, -2).sum(0) if (w is not None and ctx.needs_input_grad[1]) else None
        return gx, gw, None


def _rotate(x: Tensor, freqs: Tensor) -> Tensor:
    """The rotation of llm.nn.model.apply_rope, op for op: adjacent pairs of x times complex freqs."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (B, T, H, hd/2) complex
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)  # (B, T, H, hd)


class SplitRope(torch.autograd.Function):
    """qkv (B, T, nh + 2 nkv, hd) -> q, k rotated by RoPE, and v.

    The same numbers as `split` + `apply_rope` + `split`, whose backward autograd assembles with
    two cats (q with k, then qk with v) after the inverse rotation. Here the backward rotates
    dL/dq and dL/dk by conj(freqs) straight into one dL/dqkv and copies dL/dv beside them: one
    pass over the (B, T, 3C) gradient instead of three. Needs fp32/fp64 (complex pairs).
    """

    @staticmethod
    def forward(ctx, qkv: Tensor, freqs: Tensor, nh: int, nkv: int):
        qk, v = qkv.split([nh + nkv, nkv], dim=2)
        q, k = _rotate(qk, freqs).split([nh, nkv], dim=2)
        ctx.save_for_backward(freqs)
        ctx.nh, ctx.nkv = nh, nkv
        return q, k, v

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor, gv: Tensor):
        (freqs,) = ctx.saved_tensors                   # autograd passes zeros for unused outputs
        nh, nkv = ctx.nh, ctx.nkv
        B, T, _, hd = gv.shape
        g = torch.empty(B, T, nh + 2 * nkv, hd, dtype=gv.dtype, device=gv.device)  # dL/dqkv
        conj = freqs.conj()  # a rotation's inverse is the rotation by -angle: cos - i sin
        for grad, lo, n in ((gq, 0, nh), (gk, nh, nkv)):
            if grad.stride(-1) != 1 or grad.storage_offset() % 2 or any(st % 2 for st in grad.stride()[:-1]):
                grad = grad.contiguous()               # not viewable as complex pairs (written-out attention)
            torch.mul(torch.view_as_complex(grad.unflatten(-1, (-1, 2))), conj,
                      out=torch.view_as_complex(g.narrow(2, lo, n).unflatten(-1, (-1, 2))))
        g.narrow(2, nh + nkv, nkv).copy_(gv)
        return g, None, None, None


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up from h = [gate | up] (..., 2H) -> (..., H)."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate)                               # (..., H)
        ctx.save_for_backward(h, a)
        return a * up

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        h, a = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        gh = torch.empty_like(h)
        ggate, gup = gh.chunk(2, dim=-1)
        torch.mul(g, a, out=gup)                       # d/d up = g silu(gate)
        torch.mul(g, up, out=ggate)                    # d/d a = g up, then through silu, in place
        torch.ops.aten.silu_backward.grad_input(ggate, gate, grad_input=ggate)
        return gh


class CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of (N, V) logits, computed a cache-sized block of rows at a time.

    The forward only reads the logits (logsumexp per row) and the backward writes
    softmax(logits) * dL/dloss minus the one-hot once, each block while it is in the cache.
    `overwrite`: the gradient takes the logits' memory (see llm.nn.losses.cross_entropy_sum).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, overwrite: bool) -> Tensor:
        N, V = logits.shape
        rows = max(1, (1 << 18) // V)                  # ~1 MB of fp32 logits per block
        valid = targets != IGNORE_INDEX                # (N,)
        t = torch.where(valid, targets, 0)             # (N,) any index for ignored rows
        lse = torch.empty(N, dtype=logits.dtype, device=logits.device)
        for s in range(0, N, rows):
            torch.logsumexp(logits[s: s + rows], dim=-1, out=lse[s: s + rows])
        picked = logits.gather(1, t[:, None]).squeeze(1)  # (N,) logit of the target
        ctx.save_for_backward(logits, lse, t, valid)
        ctx.rows, ctx.overwrite = rows, overwrite
        return ((lse - picked) * valid).sum()          # sum over rows of -log softmax[target]

    @staticmethod
    def backward(ctx, g: Tensor):
        logits, lse, t, valid = ctx.saved_tensors
        w = (g * valid).to(logits.dtype)[:, None]      # (N, 1) dL/dloss, 0 on ignored rows
        # overwrite: the gradient takes the logits' memory, already paged in; a fresh (N, V)
        # tensor costs a page fault per 4 KB on first write (~100 ms of a training step at
        # 2048 x 8192 on one core, in torch.profiler)
        grad = logits if ctx.overwrite else torch.empty_like(logits)  # (N, V)
        for s in range(0, logits.shape[0], ctx.rows):
            block = grad[s: s + ctx.rows]
            torch.sub(logits[s: s + ctx.rows], lse[s: s + ctx.rows, None], out=block)
            block.exp_().mul_(w[s: s + ctx.rows])     # softmax * dL/dloss
        grad.scatter_add_(1, t[:, None], -w)           # minus the one-hot of the target
        return grad, None, None
