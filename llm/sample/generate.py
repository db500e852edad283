"""Sampling from a GPT with a KV cache.

    gen = generate(model, [prompt_ids, ...], max_new_tokens=96, temperature=0.7, top_p=0.9,
                   stop_ids=(tok.end_id,), pad_id=tok.pad_id,
                   generator=torch.Generator().manual_seed(seed))
    gen.responses()   # list of token lists, without the stop token

Prompts of different lengths are LEFT-padded to the longest, P; the model numbers positions
from the attention mask, so padding changes nothing for the real tokens. One prefill call
fills the cache with the prompts, then each step feeds one token per row. A row that emits a
stop token is done: it keeps emitting `pad_id` (masked out), and the loop ends early once every
row is done.

Decoding is bound by Python overhead for small models and by reading the weights and the
cache at larger ones (bench/generate.py measures both regimes), so the loop runs under
inference_mode, computes logits only at the last position, builds no per-step masks when no
prompt is padded (one query against all cached keys), and samples by inverse CDF with one
random number per row (see `sample_next`). After the prefill, each step of the default
architecture on the CPU runs through `FastDecoder` (its weights copied to the layout that
matrix-vector products read fastest); `fast=False` keeps every step on the model's own path.

Threads: small-batch decoding is many tiny ops; on a CPU shared with other work, one torch
thread is often faster than two (bench/generate.py --threads 1).

Used by SFT eval, the pairs stage and the PPO/GRPO rollouts; `Generation.logprobs` are the
behaviour-policy log-probs those losses need.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from llm.nn.model import GPT, NORM_EPS, mlp_hidden


class KVCache:
    """Preallocated keys and values for every layer: (n_layer, B, n_kv_head, max_len, head_dim).

    `GPT.hidden_states(idx, mask, kv_cache=cache)` appends idx's T positions: the first call is
    the prefill (the prompts), later calls decode. `mask` (B, max_len) records which cached
    positions are real tokens, `n_real` (B,) how many each row has (= the next position id).
    Only [:length] is ever read, and every position below `length` has been written, so the
    storage can start uninitialised.
    """

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.n_real = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self._k_layers, self._v_layers = list(self.k.unbind(0)), list(self.v.unbind(0))  # per-layer views
        self.length = 0          # positions filled so far (same for every row)
        self.padded = False      # any False in mask[:, :length]: attention needs a key mask
        self._start = 0

    @classmethod
    def for_model(cls, model: GPT, batch_size: int, max_len: int | None = None,
                  dtype: torch.dtype | None = None) -> "KVCache":
        c = model.config
        max_len = c.seq_len if max_len is None else max_len
        if max_len > c.seq_len:
            raise ValueError(f"KVCache: max_len={max_len} is longer than the model's seq_len={c.seq_len}")
        p = model.wte.weight
        return cls(c.n_layer, batch_size, c.n_kv_head, max_len, c.head_dim, device=p.device,
                   dtype=dtype or p.dtype)

    def reset(self) -> None:
        self.mask.zero_()
        self.n_real.zero_()
        self.length, self.padded = 0, False

    def reserve(self, T: int) -> int:
        """Claim T more positions; returns where they start. Called once per forward."""
        if self.length + T > self.max_len:
            raise ValueError(f"KVCache overflow: {self.length} cached + {T} new positions > max_len={self.max_len};"
                             f" allocate a longer cache (at most the model's seq_len)")
        self._start = self.length
        self.length += T
        return self._start

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, n_kv_head, T, hd) at the reserved positions; return all keys/values
        so far (B, n_kv_head, length, hd) as views."""
        s, e = self._start, self.length
        kl, vl = self._k_layers[layer], self._v_layers[layer]  # (B, n_kv_head, max_len, hd)
        kl.narrow(2, s, e - s).copy_(k)
        vl.narrow(2, s, e - s).copy_(v)
        return kl.narrow(2, 0, e), vl.narrow(2, 0, e)


class FastDecoder:
    """One decoding step (one new token per row) of the default architecture on the CPU: the
    same math as GPT.hidden_states with a KVCache, in fewer and faster operations. What the
    batch-1 profile pointed at (bench/generate.py measures each against the plain path):

      - weight layout: each weight matrix is copied once per `generate` call as (in, out),
        contiguous, so the product with a row is x @ W over rows in memory order; with the
        model's nn.Linear (out, in) layout torch's x @ W^T ran the same products slower at
        batch 1, and no faster at batch 64 (bench/README.md);
      - residual adds inside the products (addmm), q/k/v in one product and gate/up in one;
      - RoPE writes the rotated keys straight into the preallocated cache (no copy after it),
        and the step's views of the cache are taken once for all layers.
    The price: a second copy of the weight matrices while `generate` runs. The same numbers up
    to float rounding; tests/test_generate.py checks the logits against the model's own cached
    path at every step. `supports(model)` says which models qualify (rmsnorm, rope, swiglu, no
    biases, an LM head, fp32 on the CPU); the rest decode through GPT.hidden_states, and so does
    everything with generate(..., fast=False).
    """

    def __init__(self, model: GPT):
        c = model.config
        self.nh, self.nkv, self.hd, self.H = c.n_head, c.n_kv_head, c.head_dim, mlp_hidden(c)

        def t(lin: torch.nn.Linear) -> torch.Tensor:  # (out, in) -> (in, out), contiguous
            return lin.weight.detach().t().contiguous()

        self.wte = model.wte.weight.detach()                                 # (V, C)
        self.layers = [(b.norm_1.weight, t(b.attn.qkv), t(b.attn.proj), b.norm_2.weight, t(b.mlp.fc), t(b.mlp.proj))
                       for b in model.blocks]
        self.norm_f, self.lm = model.norm_f.weight, t(model.lm_head)         # (C,), (C, V)
        self.rope = model.rope_freqs                                         # (seq_len, hd/2, 2): cos, sin

    @staticmethod
    def supports(model: GPT) -> bool:
        c, p = model.config, model.wte.weight
        return (c.norm == "rmsnorm" and c.pos == "rope" and c.mlp == "swiglu" and not c.bias
                and model.lm_head is not None and p.device.type == "cpu" and p.dtype == torch.float32)

    def step(self, tok: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tok (B,) long, the newest token of each row -> logits (B, V) float32 for the next one;
        appends the token's keys and values to `cache` (as model.hidden_states(tok[:, None], None,
        kv_cache=cache) would)."""
        nh, nkv, hd, H = self.nh, self.nkv, self.hd, self.H
        B, C = tok.shape[0], self.wte.shape[1]
        start = cache.reserve(1)
        L = start + 1
        cache.mask[:, start] = True
        if cache.padded:  # each row at its own position; keys of padding masked out
            rope = torch.view_as_complex(self.rope[cache.n_real])[:, None]   # (B, 1, hd/2)
            mask = cache.mask[:, None, None, :L]                             # (B, 1, 1, L)
        else:
            rope = torch.view_as_complex(self.rope[start])                   # (hd/2,)
            mask = None
        cache.n_real += 1
        # this step's slot and all keys/values so far, for every layer at once: (n_layer, B, nkv, ...)
        k_new = torch.view_as_complex(cache.k[:, :, :, start].unflatten(-1, (-1, 2))).unbind(0)  # (B, nkv, hd/2)
        v_new = cache.v[:, :, :, start].unflatten(-1, (-1, 2)).unbind(0)     # (B, nkv, hd/2, 2)
        k_all, v_all = cache.k[:, :, :, :L].unbind(0), cache.v[:, :, :, :L].unbind(0)  # (B, nkv, L, hd)
        x = F.embedding(tok, self.wte)                                       # (B, C)
        for layer, (w1, wqkv, wo, w2, wfc, wp) in enumerate(self.layers):
            h = F.rms_norm(x, (C,), w1, NORM_EPS)
            qkv = torch.mm(h, wqkv).view(B, nh + 2 * nkv, hd // 2, 2)       # (B, nh + 2 nkv, hd/2, 2)
            qk = torch.view_as_complex(qkv[:, :nh + nkv])                    # (B, nh + nkv, hd/2) complex
            torch.mul(qk[:, nh:], rope, out=k_new[layer])                    # rotated keys, into the cache
            v_new[layer].copy_(qkv[:, nh + nkv:])
            q = torch.view_as_real(qk[:, :nh] * rope).view(B, nh, 1, hd)     # (B, nh, 1, hd)
            y = F.scaled_dot_product_attention(q, k_all[layer], v_all[layer], attn_mask=mask,
                                               enable_gqa=nkv != nh)         # (B, nh, 1, hd)
            x = torch.addmm(x, y.view(B, nh * hd), wo)                       # x + attention output
            g = torch.mm(F.rms_norm(x, (C,), w2, NORM_EPS), wfc)             # (B, 2H): [gate | up]
            x = torch.addmm(x, F.silu(g[:, :H]).mul_(g[:, H:]), wp)          # x + MLP output
        return torch.mm(F.rms_norm(x, (C,), self.norm_f, NORM_EPS), self.lm)  # (B, V)


@dataclass
class Generation:
    """Prompts (left-padded to prompt_len) and their continuations, N = steps actually taken."""
    tokens: torch.Tensor          # (B, P + N) long
    attention_mask: torch.Tensor  # (B, P + N) bool: real prompt tokens + response_mask
    prompt_len: int               # P
    response_mask: torch.Tensor   # (B, N) bool: generated tokens up to and including the stop token
    logprobs: torch.Tensor        # (B, N) float32: log p(token) under softmax(logits / temperature); 0 where masked
    stopped: torch.Tensor | None = None  # (B,) bool: the row ended with a stop token (not cut by length)

    def responses(self) -> list[list[int]]:
        """Generated token ids per row, without the stop token and padding."""
        out = []
        resp = self.tokens[:, self.prompt_len:]
        for i in range(resp.shape[0]):
            ids = resp[i][self.response_mask[i]].tolist()
            if self.stopped is not None and bool(self.stopped[i]) and ids:
                ids = ids[:-1]
            out.append(ids)
        return out


def excluded(probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Which tokens top-k and then top-p sampling rule out: bool (B, V), True = excluded.

    probs (B, V): a softmax. Top-k keeps the k most likely tokens; top-p then keeps, of the
    renormalised remainder, the smallest set of most likely tokens whose mass reaches top_p
    (the most likely token always stays). Tokens tied with the last kept one are kept too.
    Without top-k, only the 64 most likely tokens are ranked when the nucleus fits in them
    (a trained model's usually does): on the CPU a full sort of a (64, 4096) batch costs
    ~10x that topk, 17 ms per decoding step.
    """
    V = probs.shape[-1]
    k = top_k if 0 < top_k < V else V
    if k < V:
        top = torch.topk(probs, k, dim=-1).values      # (B, k), descending
        if top_p >= 1.0:
            return probs < top[:, -1:]
        total = top.sum(-1, keepdim=True)              # the nucleus is a share of the top-k mass
    else:
        if top_p >= 1.0:
            return torch.zeros_like(probs, dtype=torch.bool)
        total = 1.0
        top = torch.topk(probs, min(64, V), dim=-1).values  # (B, 64), descending
        if not bool((top.sum(-1) >= top_p).all()):     # some nucleus is wider: rank everything
            top = torch.sort(probs, dim=-1, descending=True).values  # (B, V)
    before = top.cumsum(-1) - top                      # mass strictly above each ranked token
    n_keep = (before < top_p * total).sum(-1, keepdim=True).clamp_(min=1)  # (B, 1)
    return probs < top.gather(-1, n_keep - 1)          # below the smallest kept probability


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (B, V) with -inf outside the top-k / top-p set (see `excluded`)."""
    return logits.masked_fill(excluded(F.softmax(logits, dim=-1), top_k, top_p), float("-inf"))


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None, row_offset: int = 0,
                total_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) float32 -> (token (B,) long, log-prob (B,) float32).

    temperature 0 is greedy (argmax, log-prob under softmax(logits)). Otherwise the token is
    drawn from the top-k/top-p filtered softmax(logits / temperature) and its log-prob is
    reported under the unfiltered softmax(logits / temperature), the distribution the RL
    losses recompute.

    Two departures from the obvious code, both for speed and both checked by
    tests/test_generate.py: the log-prob is log_softmax + gather, the same numbers as
    torch.distributions.Categorical(logits=...).log_prob(tok) without its logsumexp (~5x a
    log_softmax on the CPU); and the draw is by inverse CDF with one uniform number per row
    from `generator`, where torch.multinomial draws one exponential per vocabulary entry
    (6 ms of every decoding step at batch 64 x 4096 on the CPU).

    row_offset, total_rows: these B rows are rows row_offset .. row_offset + B - 1 of a batch
    of total_rows that other processes sample the rest of; total_rows uniforms are drawn and
    these rows use theirs, so a row's token does not depend on how the batch is shared out.
    """
    if temperature == 0.0:
        tok = logits.argmax(-1)                         # (B,)
        logp = F.log_softmax(logits, dim=-1)            # (B, V)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    if generator is None:
        raise ValueError("sample_next: sampling needs a torch.Generator; library code never uses the global RNG")
    logp = F.log_softmax(logits / temperature, dim=-1)  # (B, V)
    probs = logp.exp()
    if (0 < top_k < logits.shape[-1]) or top_p < 1.0:
        probs = probs.masked_fill(excluded(probs, top_k, top_p), 0.0)
    # inverse CDF: the first index whose cumulative mass exceeds u ~ U[0, total); a token with
    # zero probability spans an empty interval and can never be drawn
    cdf = probs.cumsum(-1)                              # (B, V)
    B = cdf.shape[0]
    total = B if total_rows is None else total_rows
    u = torch.rand(total, 1, generator=generator, device=cdf.device, dtype=cdf.dtype)  # (total, 1)
    u = u[row_offset:row_offset + B] * cdf[:, -1:]                                        # (B, 1)
    tok = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)  # (B, 1)
    return tok.squeeze(1), logp.gather(1, tok).squeeze(1)


MIN_TEMPERATURE = 1e-6


def sampling_problem(*, temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None) -> str | None:
    """Why these sampling settings are unusable (None = fine); the arguments left None are not checked.

    Every comparison is written so that NaN fails it. temperature is 0 (greedy) or a finite
    number >= MIN_TEMPERATURE: logits / 1e-320 overflow to inf, the softmax becomes NaN and
    nothing sensible is drawn, while at 1e-6 sampling already is argmax in float32.
    """
    if temperature is not None and not (temperature == 0.0 or MIN_TEMPERATURE <= temperature < float("inf")):
        return (f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g},"
                f" got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        return f"top_k must be an integer >= 0 (0 = off), got {top_k!r}"
    if top_p is not None and not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1] (1 = off), got {top_p!r}"
    return None


def generate(model: GPT, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] = (), pad_id: int,
             generator: torch.Generator | None = None, row_offset: int = 0, total_rows: int | None = None,
             stream: Callable[[torch.Tensor], bool | None] | None = None, fast: bool = True) -> Generation:
    """Continue each prompt by up to max_new_tokens tokens. See the module docstring.

    row_offset, total_rows: the prompts are rows row_offset.. of a batch of total_rows
    shared out over processes (data-parallel RL); every step draws total_rows random numbers
    and these rows use theirs (`sample_next`), so each row samples exactly what it would in
    one process sampling the whole batch. Default: the prompts are the whole batch.

    stream, if given, is called after every step with the (B,) tokens just emitted (pad_id for
    rows already done); if it returns True, generation ends after that step (a server uses
    this for stop strings and for clients that went away). Sampling (temperature > 0) needs a seeded `generator` on the model's
    device: library code never draws from the global RNG. fast=False decodes through
    model.hidden_states even where FastDecoder supports the model (the plain path, to compare).

    One function on purpose: prefill, then the decode loop with its per-row bookkeeping, read in
    the order the tokens are made (the hot loop is in here, so it is not split into calls).
    """
    cfg = model.config
    B = len(prompts)
    if B == 0:
        raise ValueError("generate: no prompts")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"generate: prompt {lengths.index(0)} is empty; every prompt needs at least one token")
    P = max(lengths)
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if P + max_new_tokens > cfg.seq_len:
        raise ValueError(f"generate: longest prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) ="
                         f" {P + max_new_tokens} exceeds the model's seq_len={cfg.seq_len};"
                         f" shorten the prompt or lower max_new_tokens")
    problem = sampling_problem(temperature=temperature, top_k=top_k, top_p=top_p)
    if problem:
        raise ValueError(f"generate: {problem}")
    if total_rows is not None and not 0 <= row_offset <= total_rows - B:
        raise ValueError(f"generate: rows {row_offset}..{row_offset + B - 1} are not inside a batch of {total_rows}")
    device = model.wte.weight.device
    if temperature > 0.0:
        if generator is None:
            raise ValueError("generate: sampling (temperature > 0) needs generator=torch.Generator(device)"
                             ".manual_seed(seed); use temperature=0 for greedy decoding")
        if generator.device.type != device.type:
            raise ValueError(f"generate: the generator is on {generator.device}, the model on {device}")
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {cfg.vocab_size}): {bad[:5]}")

    # left-pad the prompts to P: (B, P)
    rows = [[pad_id] * (P - len(p)) + list(p) for p in prompts]
    tokens = torch.tensor(rows, dtype=torch.long, device=device)
    prompt_mask = torch.tensor([[False] * (P - n) + [True] * n for n in lengths], device=device)
    padded = min(lengths) < P

    N = max_new_tokens
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device) if stop_ids else None
    toks, lps, lives = [], [], []                        # one (B,) tensor per step
    was_training = model.training
    model.eval()
    # inference_mode: less per-op bookkeeping than no_grad, which matters at batch 1; the
    # results are cloned out of it below so that training code can use them freely
    with torch.inference_mode():
        try:
            cache = KVCache.for_model(model, B, P + N)
            decoder = FastDecoder(model) if fast and FastDecoder.supports(model) else None
            done = torch.zeros(B, dtype=torch.bool, device=device)
            hidden = model.hidden_states(tokens, prompt_mask if padded else None, kv_cache=cache)  # (B, P, C)
            logits = model.logits(hidden[:, -1])        # (B, V): left padding puts every last token at P-1
            for i in range(N):
                tok, lp = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                      generator=generator, row_offset=row_offset,
                                      total_rows=total_rows)  # (B,), (B,)
                if stop is not None:
                    live = ~done
                    tok.masked_fill_(done, pad_id)
                    lp.masked_fill_(done, 0.0)
                    lives.append(live)
                    done |= torch.isin(tok, stop) & live
                toks.append(tok)
                lps.append(lp)
                halt = stream is not None and bool(stream(tok))
                if halt or i == N - 1 or (stop is not None and bool(done.all())):
                    break
                # done rows are fed their pad as a "real" token: their outputs are discarded, and
                # an unpadded cache keeps the mask-free fast path
                if decoder is not None:
                    logits = decoder.step(tok, cache)   # (B, V)
                else:
                    hidden = model.hidden_states(tok[:, None], None, kv_cache=cache)  # (B, 1, C)
                    logits = model.logits(hidden[:, -1])  # (B, V)
        finally:
            model.train(was_training)
        out = torch.stack(toks, 1)                       # (B, n)
        resp_mask = torch.stack(lives, 1) if stop is not None else torch.ones_like(out, dtype=torch.bool)
        gen = Generation(tokens=torch.cat([tokens, out], dim=1),
                         attention_mask=torch.cat([prompt_mask, resp_mask], dim=1),
                         prompt_len=P, response_mask=resp_mask, logprobs=torch.stack(lps, 1),
                         stopped=done if stop is not None else torch.zeros(B, dtype=torch.bool, device=device))
    for f in ("tokens", "attention_mask", "response_mask", "logprobs", "stopped"):
        setattr(gen, f, getattr(gen, f).clone())         # normal tensors, usable with autograd
    return gen
