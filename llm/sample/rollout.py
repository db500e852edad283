"""The RL rollout engine: sample responses with the KV cache, then score tokens with one forward.

    ro = rollout(policy, prompts, max_new_tokens=96, temperature=1.0, stop_ids=(tok.end_id,),
                 pad_id=tok.pad_id, generator=torch.Generator().manual_seed(seed))
    ro.tokens (B, P+N), ro.attention_mask (B, P+N), ro.response_mask (B, N), ro.logprobs (B, N)
    out = response_forward(policy, ro, temperature=1.0, values=True, entropy=True)   # with grad
    out.logprobs (B, N), out.values (B, N), out.entropy (B, N)

`rollout` is `llm.sample.generate.generate` (batched, KV cache, under inference mode, rows that
emitted the stop token stop and the loop ends when all have) packaged for the update:
prompts LEFT-padded to P so every response starts at column P, `response_mask` True on
the generated tokens up to and including the stop token, and `logprobs` the behaviour
policy's log-probabilities of the sampled tokens under softmax(logits / temperature).
Sampling draws from exactly torch.distributions.Categorical(logits=logits / temperature)
(tests/test_generate.py checks the log-probs against Categorical.log_prob); generate calls
torch.multinomial with an explicit torch.Generator instead of Categorical.sample(), which
only draws from the global RNG and costs ~5x per token on the CPU.

`sampled_kl` is the one measure of KL to a reference on the policy's own samples (exact
per token over the vocabulary), used by PPO's and GRPO's held-out evaluation, DPO's gate and
the eval stage.

`response_forward` is the one place the update recomputes per-token quantities: a single
trunk pass over prompt + response, and the LM head (and the value head) only at the N
positions that predict response tokens (position P-1+t predicts response token t), so the
prompt positions never pay for the (V-wide) LM head. The value V_t is read at the same
position: the value of the state from which response token t is sampled. The reference
model uses the same function under no_grad. tests/test_rollout.py checks that a rollout's
log-probs equal `response_forward`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from llm.data.batching import derive_seed
from llm.runtime import sharded_map
from llm.sample.generate import generate


@dataclass
class Rollout:
    """Prompts (left-padded to prompt_len) with their sampled responses; N = steps actually taken."""
    tokens: Tensor          # (B, P + N) long
    attention_mask: Tensor  # (B, P + N) bool: real prompt tokens + response_mask
    prompt_len: int         # P
    response_mask: Tensor   # (B, N) bool: generated tokens up to and including the stop token
    logprobs: Tensor        # (B, N) float32: behaviour log-probs under softmax(logits / T); 0 where masked
    stopped: Tensor         # (B,) bool: the row ended with a stop token (not cut at max_new_tokens)

    @property
    def responses(self) -> Tensor:
        """(B, N) long: the response columns of `tokens` (pad after a row's stop token)."""
        return self.tokens[:, self.prompt_len:]

    @property
    def lengths(self) -> Tensor:
        """(B,) long: response tokens per row, the stop token included."""
        return self.response_mask.sum(1)

    def response_ids(self, keep_stop: bool = False) -> list[list[int]]:
        """Each row's response token ids, without padding (and without the stop token unless keep_stop)."""
        out = []
        for row, m, s in zip(self.responses.tolist(), self.response_mask.tolist(), self.stopped.tolist()):
            ids = [t for t, keep in zip(row, m) if keep]
            out.append(ids[:-1] if (s and ids and not keep_stop) else ids)
        return out

    def select(self, index: Tensor | Sequence[int]) -> "Rollout":
        """The rows `index` (a minibatch), with the same P and N."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.tokens.device)
        return Rollout(**{f.name: (getattr(self, f.name).index_select(0, idx) if f.name != "prompt_len"
                                   else self.prompt_len) for f in fields(self)})

    def __len__(self) -> int:
        return self.tokens.shape[0]


@torch.no_grad()
def rollout(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
            stop_ids: Sequence[int], pad_id: int, generator: torch.Generator, row_offset: int = 0,
            total_rows: int | None = None) -> Rollout:
    """Sample one response per prompt (repeat a prompt G times for a GRPO group).

    temperature must be > 0 (RL samples; the log-probs are those of the tempered
    distribution, which the losses recompute with the same temperature). row_offset,
    total_rows: this process's rows of a batch shared out over processes (llm.sample.generate.generate).
    """
    if temperature <= 0.0:
        raise ValueError(f"rollout: temperature must be > 0 for RL sampling, got {temperature}")
    g = generate(model, prompts, max_new_tokens, temperature=temperature, stop_ids=stop_ids, pad_id=pad_id,
                 generator=generator, row_offset=row_offset, total_rows=total_rows)
    return Rollout(tokens=g.tokens, attention_mask=g.attention_mask, prompt_len=g.prompt_len,
                   response_mask=g.response_mask, logprobs=g.logprobs, stopped=g.stopped)


@dataclass
class ResponseOutputs:
    logprobs: Tensor              # (B, N) float32, log p(response token) under softmax(logits / T)
    entropy: Tensor | None        # (B, N) float32, entropy of softmax(logits / T) at each position
    values: Tensor | None         # (B, N) float32, value head at each position
    logits: Tensor | None = None  # (B, N, V) float32 / T, when asked for (exact KL)


def response_forward(model, ro: Rollout, temperature: float, *, values: bool = False, entropy: bool = False,
                     entropy_grad: bool = True, keep_logits: bool = False) -> ResponseOutputs:
    """Per-token quantities of the response tokens of `ro` under `model` (grad follows the caller's mode).

    One trunk pass over (B, P+N); the heads see only the N positions P-1 .. P+N-2, whose
    outputs predict response tokens 0 .. N-1. The entropy carries a gradient (PPO's entropy
    bonus) unless entropy_grad=False (a metric only: no graph is recorded for it).
    """
    P = ro.prompt_len
    N = ro.response_mask.shape[1]
    mask = None if bool(ro.attention_mask.all()) else ro.attention_mask  # mask-free = sdpa's causal fast path
    hidden = model.hidden_states(ro.tokens, mask)                     # (B, P+N, C)
    h = hidden[:, P - 1: P + N - 1]                                   # (B, N, C): states before each response token
    logits = model.logits(h)                                          # (B, N, V) float32
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)                          # (B, N, V), shared by both below
    lp = logp.gather(-1, ro.responses.unsqueeze(-1)).squeeze(-1)      # (B, N) = losses.token_logprobs
    ent = None
    if entropy:
        lq = logp if entropy_grad else logp.detach()
        ent = -(lq.exp() * lq).sum(-1)                                # (B, N) = losses.entropy_from_logits
    v = model.value(h) if values else None                            # (B, N)
    return ResponseOutputs(logprobs=lp, entropy=ent, values=v, logits=logits if keep_logits else None)


@dataclass
class SampledKL:
    """KL(policy || ref) along the policy's own samples; the unit is in each field's name."""
    per_token: float              # mean over all sampled response tokens of KL_t (nats per token)
    per_sequence: float           # mean over responses of sum_t KL_t (nats per response)
    sequences: list[float]        # sum_t KL_t of each response, in prompt order
    tokens: int                   # response tokens measured (the stop tokens included)
    visits: list = field(default_factory=list)  # what `visit` returned for each batch, in batch order


@torch.no_grad()
def sampled_kl(policy, ref, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
               stop_ids: Sequence[int], pad_id: int, seed: int, batch_size: int,
               visit: Callable[[Rollout, list[int]], Any] | None = None, rt=None) -> SampledKL:
    """The one measure of "KL to the reference on sampled responses", used by PPO, GRPO, DPO and eval.

    For each prompt x one response y is sampled from the policy at `temperature` (as `rollout`),
    up to max_new_tokens tokens (fewer where the context is shorter) including the stop token.
    At every response position t, both models' next-token distributions at that temperature
    are compared exactly, over the whole vocabulary (no one-sample estimator, so no sampling
    noise at a given state):

        KL_t = sum_v pi(v | x, y_<t) (log pi(v | x, y_<t) - log ref(v | x, y_<t))

    Prompts are batched by length (less padding); batch b samples from its own generator,
    seeded by (seed, b), so a batch's samples do not depend on the batches before it. With a
    distributed `rt` (llm.runtime.Runtime) the batches are shared out over the ranks and the
    results gathered (llm.runtime.sharded_map): every rank returns the numbers one process
    would. `visit(rollout, indices)` sees each batch of samples with the prompt indices of its
    rows, on the rank that sampled it; what it returns is gathered into `visits`, in batch order.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    chunks = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    device = next(policy.parameters()).device

    def one(b: int) -> tuple[list[float], float, int, Any]:
        ix = chunks[b]
        chunk = [prompts[i] for i in ix]
        room = min(max_new_tokens, policy.config.seq_len - max(map(len, chunk)))
        if room < 1:
            raise ValueError(f"sampled_kl: a prompt of {max(map(len, chunk))} tokens leaves no room in"
                             f" seq_len {policy.config.seq_len}")
        g = torch.Generator(device=device).manual_seed(derive_seed(seed, "batch", b))
        ro = rollout(policy, chunk, max_new_tokens=room, temperature=temperature, stop_ids=stop_ids, pad_id=pad_id,
                     generator=g)
        lp = torch.log_softmax(response_forward(policy, ro, temperature, keep_logits=True).logits, -1)  # (B, N, V)
        lq = torch.log_softmax(response_forward(ref, ro, temperature, keep_logits=True).logits, -1)
        kl = (lp.exp() * (lp - lq)).sum(-1) * ro.response_mask                 # (B, N), 0 off the responses
        return (kl.sum(1).tolist(), float(kl.sum()), int(ro.response_mask.sum()),
                visit(ro, ix) if visit is not None else None)

    seq = [0.0] * len(prompts)
    total, n_tok, visits = 0.0, 0, []
    for ix, (sums, kl_sum, tokens, seen) in zip(chunks, sharded_map(one, len(chunks), rt)):
        for i, v in zip(ix, sums):
            seq[i] = v
        total += kl_sum
        n_tok += tokens
        visits.append(seen)
    return SampledKL(per_token=total / max(n_tok, 1), per_sequence=sum(seq) / max(len(seq), 1), sequences=seq,
                     tokens=n_tok, visits=visits if visit is not None else [])
