"""Loss functions and estimators shared by the training stages (SFT, PPO, GRPO, DPO).

Each function is a few lines of tensor code with the shapes written down, so a reader
can check it against the paper it comes from:

- `token_logprobs` / `sequence_logprob`: log p(token | prefix) and its masked sum over
  response tokens: the one sequence log-prob used by DPO, PPO and GRPO.
- `masked_lm_loss`: token cross-entropy on supervised tokens only, returned as
  (sum, count) so the trainer can weight micro-batches by tokens; `cross_entropy_sum` is its
  sum, computed in cache-sized blocks on the CPU (pretraining uses it too).
- `gae`: generalized advantage estimation over response tokens.
- `ppo_policy_loss`, `ppo_value_loss`: clipped surrogate and clipped value loss.
- `kl_estimate`: k1 and k3 estimators of KL(policy || reference) per token.
- `group_advantages`: GRPO's (r - mean) / (std + eps) within each group.
- `aggregate`: token-loss aggregation `grpo | dr_grpo | dapo`.

Every reduction over a mask stays finite when the mask is empty: it divides by
max(count, 1) and returns exactly 0 with zero gradient.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from llm import kernels
from llm.kernels import IGNORE_INDEX


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x where mask is True; 0 (not NaN) where the mask is empty."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(targets) under logits.

    logits: (B, T, V) float; targets: (B, T) long (any value where unused; clamp keeps
    ignore_index safe). Returns (B, T) float32.
    """
    logp = F.log_softmax(logits.float(), dim=-1)                        # (B, T, V)
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)


def sequence_logprob(model, idx: Tensor, attention_mask: Tensor, loss_mask: Tensor,
                     per_token: bool = False) -> Tensor:
    """Sum of log p(token) over the tokens where loss_mask is True.

    idx, attention_mask, loss_mask: (B, T). loss_mask[:, t] True means token t is a
    response token, predicted from tokens < t. Returns (B,) or, with per_token, the
    (B, T-1) per-token log-probs already multiplied by the mask.
    """
    logits = model(idx, attention_mask=attention_mask)               # (B, T, V)
    lp = token_logprobs(logits[:, :-1], idx[:, 1:])                 # (B, T-1): token t+1 given <= t
    mask = loss_mask[:, 1:].to(lp.dtype)
    return lp * mask if per_token else (lp * mask).sum(-1)


def answer_logprob(model, idx: Tensor, attention_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """`sequence_logprob`'s (B,) sums with the logits computed only where they are read.

    The logits at position t predict token t + 1, so only the positions before an answer token
    reach the vocabulary product and the log-softmax; the prompt and the padding skip both. The
    same numbers up to float rounding (tests/test_losses.py), for a DPO training step that skips
    most of the vocabulary product (docs/log.md). `model` must take `logits_at`
    (llm.nn.model.GPT); a compiled one keeps `sequence_logprob`, whose shapes its graph can know.
    """
    read = torch.zeros_like(loss_mask, dtype=torch.bool)
    read[:, :-1] = loss_mask[:, 1:]                                          # (B, T)
    logits = model(idx, attention_mask=attention_mask, logits_at=read)       # (N, V), row-major
    lp = token_logprobs(logits, idx[:, 1:][read[:, :-1]])                    # (N,)
    rows = read.nonzero(as_tuple=True)[0]                                    # (N,): their rows
    return torch.zeros(idx.shape[0], dtype=lp.dtype, device=lp.device).index_add(0, rows, lp)


def cross_entropy_sum(logits: Tensor, targets: Tensor, *, overwrite_logits: bool = False) -> Tensor:
    """sum over rows with targets != IGNORE_INDEX of -log softmax(logits)[target].

    logits (N, V), targets (N,). With autograd on the CPU in fp32 the blocked
    `llm.kernels.CrossEntropySum` (unless the kernels are switched off); elsewhere
    F.cross_entropy (fused kernels on CUDA).
    overwrite_logits=True lets the backward write the gradient over `logits`: only for a caller
    that never reads its logits after backward (llm/train/trainer.py lm_loss); a second backward
    through the same graph then fails with autograd's in-place error instead of a wrong result.
    """
    if kernels.active(logits) and logits.dtype == torch.float32 and logits.requires_grad:
        return kernels.CrossEntropySum.apply(logits, targets, overwrite_logits)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def masked_lm_loss(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy over targets != IGNORE_INDEX, and the number of such tokens.

    logits: (B, T, V); targets: (B, T) with IGNORE_INDEX where not supervised.
    An all-masked batch gives (0.0 with a zero gradient, 0).
    """
    loss = cross_entropy_sum(logits.float().flatten(0, 1), targets.flatten())
    return loss, (targets != IGNORE_INDEX).sum()


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL").

    k1 = log pi - log ref (unbiased, can be negative); k3 = (r - 1) - log r with
    r = ref/pi (unbiased, always >= 0). Shapes (B, T) -> (B, T).
    """
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl estimator must be 'k1' or 'k3', got {kind!r}")


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
           reduce: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """(x - mean) / std over the masked entries; masked-out entries become 0.

    reduce: sums a tensor over the processes that hold the rest of the batch (data-parallel
    PPO), so mean and variance are the global batch's; the identity in one process."""
    m = mask.to(x.dtype)
    n = reduce(m.sum()).clamp(min=1)
    mean = reduce((x * m).sum()) / n
    var = reduce((((x - mean) * m) ** 2).sum()) / n
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over response tokens.

    rewards, values, mask: (B, N), response token t of row b valid where mask is True
    (a contiguous prefix of each row). Beyond the last valid token the value is 0.
      delta_t = r_t + gamma * V_{t+1} - V_t
      A_t     = delta_t + gamma * lam * A_{t+1}
    Returns (advantages (B, N), returns = advantages + values), zero where mask is False.
    """
    m = mask.to(values.dtype)
    B, N = rewards.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(N)):   # N is the response length (tens of tokens): a short loop
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m[:, t]
        next_value = values[:, t] * m[:, t]
        next_adv = adv[:, t]
    return adv, (adv + values) * m


def ppo_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    clip_epsilon: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate, per token: max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi/pi_old.

    All (B, N). Returns (per-token loss (B, N), stats: clip_ratio, approxkl) so the
    caller chooses the aggregation. Outside the clip range in the direction the
    advantage pushes, the loss is constant in logp: zero gradient.
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_epsilon, 1 + clip_epsilon)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clip_ratio = masked_mean((clipped > unclipped).float(), mask)
        approxkl = masked_mean(0.5 * log_ratio ** 2, mask)
    return loss, {"clip_ratio": clip_ratio, "approxkl": approxkl}


def ppo_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                   value_clip: float) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), masked mean; and the clipped fraction:
    the share of tokens where the clamp bit and raised the loss (TRL's `l2 > l1`, without its ties).
    Where the clamp does not bite, old + (V - old) can differ from V in the last bit, and `l2 > l1`
    alone would count such a token as clipped or not by how the float sums fell."""
    delta = values - old_values
    v_clipped = old_values + torch.clamp(delta, -value_clip, value_clip)
    l1, l2 = (values - returns) ** 2, (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(l1, l2), mask)
    with torch.no_grad():
        vf_clipfrac = masked_mean(((l2 > l1) & (delta.abs() > value_clip)).float(), mask)
    return loss, vf_clipfrac


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> tuple[Tensor, Tensor]:
    """GRPO advantages (r - mean) / (std + eps) within each group.

    rewards: (n_groups, G). Returns (advantages (n_groups, G), zero_std (n_groups,) bool).
    A group whose rewards are all equal carries no signal: its advantages are exactly 0.
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # unbiased, as TRL computes it (G >= 2)
    zero_std = std.squeeze(1) < 1e-6
    adv = (rewards - mean) / (std + eps)
    return torch.where(zero_std.unsqueeze(1), torch.zeros_like(adv), adv), zero_std


def aggregate(per_token: Tensor, mask: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """Reduce a (B, N) per-token loss to a scalar.

      grpo:    mean over each sequence's tokens, then mean over sequences (original GRPO)
      dr_grpo: sum over all tokens / (B * max_len): no length normalisation (Dr. GRPO)
      dapo:    mean over all tokens of the batch (DAPO's token-level loss)
    """
    m = mask.to(per_token.dtype)
    if mode == "grpo":
        return ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    if mode == "dr_grpo":
        return (per_token * m).sum() / (per_token.shape[0] * (max_len or per_token.shape[1]))
    if mode == "dapo":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    raise ValueError(f"loss aggregation must be grpo, dr_grpo or dapo, got {mode!r}")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position: (B, T, V) -> (B, T)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
