"""The Transformer: a decoder-only GPT in plain PyTorch, embedding to logits in one file.

    idx (B, T) -> wte [+ wpe] -> n_layer x Block -> final norm -> heads
    Block:  x = x + attn(norm_1(x));  x = x + mlp(norm_2(x))          (pre-norm)

Options come from `llm.config.ModelConfig`: norm `rmsnorm|layernorm`
(`norm_affine: false` = no parameters), positions `rope` (rotating adjacent pairs as complex
numbers; `llm/tools/export.py` permutes q/k rows into HF-Llama's rotate_half layout) or `learned`
(nn.Embedding with max_norm 1.0),
grouped-query attention (`n_kv_head`), MLP `swiglu|gelu|relu`, tied or untied embeddings,
dropout, bias, init normal(0, init_std) with residual projections scaled by 1/sqrt(2 n_layer).

Attention comes in two implementations that must agree (tests/test_model.py):
`manual` writes out softmax(q k^T / sqrt(head_dim) + mask) v; `sdpa` calls
F.scaled_dot_product_attention. Padding: `attention_mask` (B, T) bool, True = real token.
Positions are cumsum(mask) - 1, so a left-padded row numbers its first real token 0 and RoPE
sees the same relative positions as without padding. A padded query row may attend to itself
only, so it stays finite (its output is garbage that no real token ever reads).

Heads share one trunk: "lm" (logits), "value" (PPO critic, a scalar per position) and
"reward" (RM, a scalar per sequence read at the last real token, with its optional likelihood
feature "reward_logprob"; the reward itself is computed in llm/nn/reward_model.py).

Debug mode: `enable_debug(model)` hooks every sub-module and raises at the first one
whose output has a NaN/Inf, naming it with the output's shape and dtype. Off = no hooks.

Also here: `format_count(n)` ("1.23M") and `GPT.summary()` for the parameter count that stages
print and record. No file I/O happens in this module; see llm/nn/artifacts.py.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm import kernels
from llm.config import ModelConfig
from llm.errors import NonFiniteError
from llm.nn.reward_model import RewardLogprob

HEADS = ("lm", "value", "reward", "reward_logprob")  # reward_logprob: a feature of the reward (llm/nn/reward_model.py)
NORM_EPS = 1e-5  # rmsnorm and layernorm; llm/tools/export.py writes it as rms_norm_eps


def swiglu_hidden(n_embd: int) -> int:
    """Default SwiGLU width: 8/3 n_embd rounded up to a multiple of 32, so the three SwiGLU
    matrices hold about as many parameters as the two of a 4x GELU MLP (384 -> 1024 exactly)."""
    return 32 * math.ceil(8 * n_embd / 3 / 32)


def mlp_hidden(config: ModelConfig) -> int:
    if config.mlp_hidden:
        return config.mlp_hidden
    return swiglu_hidden(config.n_embd) if config.mlp == "swiglu" else 4 * config.n_embd


def format_count(n: int) -> str:
    """12_345_678 -> '12.35M'; 1_234 -> '1.23K'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# ---------------------------------------------------------------------------
# Building blocks


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dim; affine=False has no parameters at all."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        C = config.n_embd
        self.kind = config.norm
        self.weight = nn.Parameter(torch.ones(C)) if config.norm_affine else None
        has_bias = config.norm_affine and config.bias and config.norm == "layernorm"
        self.bias = nn.Parameter(torch.zeros(C)) if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":  # x / sqrt(mean(x^2) + eps) * w, the HF-Llama formula
            if kernels.active(x):  # the same numbers with a cheaper backward (llm/kernels.py)
                return kernels.RMSNorm.apply(x, self.weight, NORM_EPS)
            return F.rms_norm(x, x.shape[-1:], self.weight, NORM_EPS)
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, NORM_EPS)


def rope_tables(config: ModelConfig) -> torch.Tensor:
    """(seq_len, head_dim/2, 2) float32: cos and sin of angle pos * base^(-2i/head_dim)."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))  # (hd/2,)
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float32), inv_freq)     # (seq_len, hd/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) of x (B, T, H, hd) by angle pos * freq_i.

    freqs (B or 1, T, 1, hd/2) complex: cos + i sin. A pair is a complex number and the
    rotation one complex multiply, the cheapest form forward and backward on the CPU. The
    dot product of two rotated vectors depends only on their position difference
    (tests/test_model.py checks this property).
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (B, T, H, hd/2) complex
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)  # (B, T, H, hd)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads: n_head query heads share n_kv_head k/v heads."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.impl, self.rope = config.attn_impl, config.pos == "rope"
        self.dropout = config.dropout
        # q, k and v in one matmul; llm/tools/export.py splits the rows back into q/k/v_proj
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * config.head_dim,
                             bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=config.bias)  # residual

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: torch.Tensor | None,
                is_causal: bool, kv_cache: Any = None) -> torch.Tensor:
        B, T, C = x.shape
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x).view(B, T, nh + 2 * nkv, hd)   # (B, T, nh + 2 nkv, hd)
        if self.rope and kernels.active(qkv) and qkv.element_size() >= 4:  # complex pairs need fp32/fp64
            q, k, v = kernels.SplitRope.apply(qkv, rope, nh, nkv)  # the same as below, one-pass backward
        else:
            # split (not slicing): its backward is one cat instead of zero-filled full-size grads
            qk, v = qkv.split([nh + nkv, nkv], dim=2)    # (B, T, nh + nkv, hd), (B, T, nkv, hd)
            if self.rope:
                qk = apply_rope(qk, rope)                # q and k rotated in one go
            q, k = qk.split([nh, nkv], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, nkv, L, hd): all keys so far
        dropout_p = self.dropout if self.training else 0.0
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                               is_causal=is_causal, enable_gqa=nkv != nh)  # (B, nh, T, hd)
        else:
            y = self._manual(q, k, v, mask, dropout_p)
        y = self.proj(y.transpose(1, 2).reshape(B, T, nh * hd))  # (B, T, C): heads side by side
        return F.dropout(y, self.dropout, self.training) if self.dropout else y

    def _manual(self, q, k, v, mask, dropout_p):
        """softmax(q k^T / sqrt(head_dim) + mask) v, written out; the causal part is in `mask`."""
        nh, nkv = self.n_head, self.n_kv_head
        B, _, T, hd = q.shape
        L = k.shape[2]
        if nkv != nh:  # query head h reads kv head h // (nh / nkv), as HF's repeat_kv
            k = k[:, :, None].expand(B, nkv, nh // nkv, L, hd).reshape(B, nh, L, hd)
            v = v[:, :, None].expand(B, nkv, nh // nkv, L, hd).reshape(B, nh, L, hd)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, nh, T, L)
        if mask is not None:  # bool, True = may attend; broadcasts (B or 1, 1, T, L)
            att = att.masked_fill(mask.logical_not(), float("-inf"))
        att = F.softmax(att, dim=-1)
        if dropout_p > 0.0:
            att = F.dropout(att, p=dropout_p)
        return att @ v                                   # (B, nh, T, L) @ (B, nh, L, hd) -> (B, nh, T, hd)


class MLP(nn.Module):
    """swiglu: proj(silu(x W_gate) * x W_up); gelu/relu: proj(act(x W_fc))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        H = mlp_hidden(config)
        self.kind = config.mlp
        # SwiGLU's gate and up projections in one matmul: rows [0, H) gate, [H, 2H) up
        self.fc = nn.Linear(config.n_embd, 2 * H if self.kind == "swiglu" else H, bias=config.bias)
        self.proj = nn.Linear(H, config.n_embd, bias=config.bias)  # residual
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)                                   # (B, T, 2H) or (B, T, H)
        if self.kind == "swiglu":
            if kernels.active(h):
                h = kernels.SwiGLU.apply(h)              # the same as below, one-pass backward
            else:
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up                    # (B, T, H)
        elif self.kind == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        h = self.proj(h)                                 # (B, T, C)
        return F.dropout(h, self.dropout, self.training) if self.dropout else h


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm_1 = Norm(config)
        self.attn = Attention(config, layer_idx)
        self.norm_2 = Norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope, mask, is_causal, kv_cache=None):
        x = x + self.attn(self.norm_1(x), rope, mask, is_causal, kv_cache)
        return x + self.mlp(self.norm_2(x))


# ---------------------------------------------------------------------------
# The model


class GPT(nn.Module):
    """Decoder-only Transformer with "lm", "value" and "reward" heads on one trunk.

    `seed` makes initialisation reproducible without touching the global RNG: the modules are
    built on the meta device, then every tensor is filled from a private torch.Generator.
    """

    def __init__(self, config: ModelConfig, heads: tuple[str, ...] = ("lm",), *, seed: int = 0,
                 device: torch.device | str = "cpu"):
        super().__init__()
        problems = config.check("model")
        if config.vocab_size < 1:
            problems.append("model.vocab_size: must be set (>= 1); stages take it from the tokenizer")
        bad = [h for h in heads if h not in HEADS]
        if bad:
            problems.append(f"heads: unknown {bad}; expected some of {list(HEADS)}")
        if "reward_logprob" in heads and not {"lm", "reward"} <= set(heads):
            problems.append(f"heads: {list(heads)}: 'reward_logprob' is a feature of the reward and needs the"
                            f" 'lm' and 'reward' heads too")
        if problems:
            raise ValueError("invalid model config:\n  " + "\n  ".join(problems))
        self.config = config
        self.head_names: tuple[str, ...] = tuple(dict.fromkeys(heads))
        C = config.n_embd
        with torch.device("meta"):
            # given a weight, nn.Embedding does not draw one: its draw on the meta device imports
            # torch._dynamo, 1.3 s at the start of every process that loads a model (chat, eval)
            self.wte = nn.Embedding(config.vocab_size, C, _weight=torch.empty(config.vocab_size, C))
            self.wpe = nn.Embedding(config.seq_len, C, max_norm=1.0, _weight=torch.empty(config.seq_len, C)) \
                if config.pos == "learned" else None
            self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
            self.norm_f = Norm(config)
            self.lm_head = nn.Linear(C, config.vocab_size, bias=False) if "lm" in heads else None
            self.value_head = nn.Linear(C, 1) if "value" in heads else None
            self.reward_head = nn.Linear(C, 1) if "reward" in heads else None
            self.reward_logprob_head = RewardLogprob() if "reward_logprob" in heads else None
        self.to_empty(device=device)  # "meta": shapes only, e.g. to count a preset's parameters
        if self.reward_logprob_head is not None:
            self.reward_logprob_head.marker.fill_(-1)  # a buffer: to_empty left it uninitialised
        if self.lm_head is not None and config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # after to_empty, which would untie them
        # non-persistent buffers: derived from the config, never saved
        T = config.seq_len
        self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).tril_().to(device), persistent=False)
        self.register_buffer("eye", torch.eye(T, dtype=torch.bool).to(device), persistent=False)
        # real (cos, sin) pairs, viewed as complex when used: a complex buffer would lose its
        # imaginary part to a model.to(dtype)
        self.register_buffer("rope_freqs", rope_tables(config).to(device) if config.pos == "rope" else None,
                             persistent=False)
        self.init_weights(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def init_weights(self, g: torch.Generator) -> None:
        """normal(0, init_std) for matrices and embeddings, std / sqrt(2 n_layer) for the two
        residual projections per block (GPT-2), zeros for biases, ones for norm weights."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # norm weights
                p.fill_(1.0)
            else:  # drawn on the CPU from g, so the values do not depend on the device
                s = std / math.sqrt(2 * self.config.n_layer) if name.endswith(("attn.proj.weight",
                                                                               "mlp.proj.weight")) else std
                if p.device.type == "cpu":
                    p.normal_(0.0, s, generator=g)
                else:
                    p.copy_(torch.empty(p.shape).normal_(0.0, s, generator=g))

    def add_head(self, name: str, *, seed: int = 0, marker: int | None = None) -> None:
        """Attach a freshly initialised "value" or "reward" head (e.g. to a loaded SFT model), or
        the reward's likelihood feature "reward_logprob" (needs `marker`, the token id after which
        the response starts: the tokenizer's <|assistant|>)."""
        if name not in ("value", "reward", "reward_logprob"):
            raise ValueError(f"add_head: expected 'value', 'reward' or 'reward_logprob', got {name!r}")
        if name in self.head_names:
            raise ValueError(f"add_head: the model already has a {name!r} head")
        if name == "reward_logprob":
            if self.lm_head is None or self.reward_head is None:
                raise ValueError("add_head: 'reward_logprob' needs the 'lm' and 'reward' heads first")
            if marker is None or not 0 <= marker < self.config.vocab_size:
                raise ValueError(f"add_head: 'reward_logprob' needs marker=<token id in [0, {self.config.vocab_size})>,"
                                 f" got {marker!r}")
            feat = RewardLogprob()
            feat.marker.fill_(marker)
            self.reward_logprob_head = feat.to(device=self.wte.weight.device)
            self.head_names = (*self.head_names, name)
            return
        head = nn.Linear(self.config.n_embd, 1)
        with torch.no_grad():
            head.weight.normal_(0.0, self.config.init_std, generator=torch.Generator().manual_seed(seed))
            head.bias.zero_()
        p = self.wte.weight
        setattr(self, f"{name}_head", head.to(device=p.device, dtype=p.dtype))
        self.head_names = (*self.head_names, name)

    # -- the trunk ---------------------------------------------------------

    def hidden_states(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      kv_cache: Any = None) -> torch.Tensor:
        """idx (B, T) long -> hidden (B, T, C) after the final norm.

        attention_mask (B, T) bool, True = real token (None = all real). With a KVCache
        (llm/sample/generate.py) idx holds only the new tokens; keys/values of earlier calls come
        from the cache and positions continue from it.
        """
        B, T = idx.shape
        rope, pos, mask, is_causal = self._plan(B, T, idx.device, attention_mask, kv_cache)
        x = self.wte(idx)                                # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(pos)                        # pos (1 or B, T) -> (1 or B, T, C)
        if self.config.dropout:
            x = F.dropout(x, self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x, rope, mask, is_causal, kv_cache)
        return self.norm_f(x)

    def _plan(self, B: int, T: int, device: torch.device, attention_mask: torch.Tensor | None,
              kv_cache: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, bool]:
        """Positions and the attention mask, computed once per forward for all layers.

        Returns (rope rotations (1 or B, T, 1, hd/2) complex or None, pos (1 or B, T) for learned
        positions or None, mask bool broadcastable to (B, 1, T, L) or None, is_causal).
        mask None + is_causal: plain causal attention, sdpa's fastest path; mask None and not
        is_causal: every key is visible (decoding one token without padding).
        """
        if attention_mask is not None and attention_mask.shape != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, T)}")
        if kv_cache is None:
            if T > self.config.seq_len:
                raise ValueError(f"sequence of {T} tokens is longer than the model's seq_len={self.config.seq_len}")
            if attention_mask is None:
                rope, pos = self._positions_from(0, T, device)
                mask, is_causal = None, True
            else:
                m = attention_mask.bool()
                pos = (m.cumsum(1) - 1).clamp_(min=0)    # (B, T): each row's first real token is 0
                rope = self._rope_at(pos)
                # a query sees earlier real keys, and always itself so that padded rows stay finite
                mask = self.causal[:T, :T] & (m[:, None, None, :] | self.eye[:T, :T])  # (B, 1, T, T)
                is_causal = False
        else:  # idx continues the cached sequence at position `start`
            start = kv_cache.reserve(T)                  # raises if it would overflow
            L = start + T
            new = kv_cache.mask.narrow(1, start, T)      # (B, T) view
            if attention_mask is None:
                new.fill_(True)
            else:
                new.copy_(attention_mask)
                if not kv_cache.padded and not bool(new.all()):
                    kv_cache.padded = True
            if not kv_cache.padded:  # every row holds `start` real tokens: positions start..L-1
                kv_cache.n_real += T
                rope, pos = self._positions_from(start, T, device)
                if T == 1:
                    mask, is_causal = None, False
                elif start == 0:
                    mask, is_causal = None, True
                else:
                    mask, is_causal = self.causal[start:L, :L], False  # (T, L), bottom-right aligned
            else:
                pos = (kv_cache.n_real[:, None] + new.cumsum(1) - 1).clamp_(min=0)  # (B, T)
                kv_cache.n_real += new.sum(1)
                rope = self._rope_at(pos)
                key_ok = kv_cache.mask[:, None, None, :L] | self.eye[start:L, :L]  # (B, 1, T, L)
                mask = key_ok if T == 1 else self.causal[start:L, :L] & key_ok
                is_causal = False
        if is_causal and self.config.attn_impl == "manual":  # manual attention takes the mask itself
            mask, is_causal = self.causal[:T, :T], False
        return rope, pos, mask, is_causal

    def _positions_from(self, start: int, T: int, device: torch.device):
        """Positions start..start+T-1 for every row: a view of the rotation table, no gather."""
        rope = pos = None
        if self.rope_freqs is not None:
            rope = torch.view_as_complex(self.rope_freqs[start: start + T].float())[None, :, None]  # (1, T, 1, hd/2)
        if self.wpe is not None:
            pos = torch.arange(start, start + T, device=device)[None]  # (1, T)
        return rope, pos

    def _rope_at(self, pos: torch.Tensor) -> torch.Tensor | None:
        """Rotations for per-row positions pos (B, T) -> (B, T, 1, hd/2) complex."""
        if self.rope_freqs is None:
            return None
        return torch.view_as_complex(self.rope_freqs[pos].float())[:, :, None]

    # -- heads -------------------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., C) -> float32 logits (..., V)."""
        if self.lm_head is None:
            raise ValueError(f"this model has heads {list(self.head_names)}, no 'lm' head for logits")
        return self.lm_head(hidden).float()

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None, kv_cache: Any = None,
                return_hidden: bool = False, logits_at: torch.Tensor | None = None):
        """idx (B, T) long -> logits (B, T, V) float32 [, hidden (B, T, C)].

        logits_at: bool (B, T); the logits only where it is True, as (N, V) in row-major order.
        A loss that reads a few positions (SFT's assistant tokens) then skips the vocabulary
        product, the largest matrix, at all the others.
        """
        hidden = self.hidden_states(idx, attention_mask, kv_cache)
        logits = self.logits(hidden if logits_at is None else hidden[logits_at])
        return (logits, hidden) if return_hidden else logits

    def value(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, C) -> value estimates (B, T) float32."""
        if self.value_head is None:
            raise ValueError("this model has no 'value' head; call model.add_head('value') first")
        return self.value_head(hidden).squeeze(-1).float()

    # -- accounting ----------------------------------------------------------

    def n_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (a tied lm_head counts once). non_embedding: without the token
        and position embedding tables (an untied lm_head still counts)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied matrix once
        if non_embedding:
            n -= self.wte.weight.numel()
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), PaLM/nanoGPT style: 6 N + 12 L H hd T.

        N counts the weights that take part in matmuls: everything except the position table
        and, when untied, the input embedding (a lookup). Attention is counted at full T.
        """
        c = self.config
        N = self.n_params()
        if self.wpe is not None:
            N -= self.wpe.weight.numel()
        if not (self.lm_head is not None and c.tie_embeddings):
            N -= self.wte.weight.numel()
        return 6 * N + 12 * c.n_layer * c.n_head * c.head_dim * c.seq_len

    def summary(self) -> str:
        c = self.config
        return (f"GPT {c.preset}: {format_count(self.n_params())} parameters"
                f" ({format_count(self.n_params(non_embedding=True))} non-embedding);"
                f" {c.n_layer} layers x {c.n_embd} wide, {c.n_head} heads ({c.n_kv_head} kv),"
                f" seq_len {c.seq_len}, vocab {c.vocab_size}, heads {list(self.head_names)}")


# ---------------------------------------------------------------------------
# Debug mode


def enable_debug(model: nn.Module) -> None:
    """Check every sub-module's output for NaN/Inf and raise at the first one.

    Hooks run as each module finishes, so the first to fire is the innermost module that
    produced the bad value. Costs one reduction per module per forward; `disable_debug`
    removes the hooks (and with none registered there is no cost at all).
    """
    if getattr(model, "_debug_handles", None):
        return
    handles = []
    for name, module in model.named_modules():
        if module is model:
            continue
        handles.append(module.register_forward_hook(_make_check(name)))
    model._debug_handles = handles


def disable_debug(model: nn.Module) -> None:
    for h in getattr(model, "_debug_handles", None) or []:
        h.remove()
    model._debug_handles = []


def _make_check(name: str):
    def check(module: nn.Module, inputs: Any, output: Any) -> None:
        for i, t in enumerate(output if isinstance(output, (tuple, list)) else (output,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
                which = f" output[{i}]" if isinstance(output, (tuple, list)) else ""
                raise NonFiniteError(
                    f"debug: module '{name}' ({type(module).__name__}){which} produced non-finite values:"
                    f" {n_nan} NaN, {n_inf} Inf in an output of shape {tuple(t.shape)}, dtype {t.dtype};"
                    f" input shapes {[tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)]}")
    return check
