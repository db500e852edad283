"""The reward model: a scalar head on the SFT trunk, its likelihood feature, and the Bradley-Terry loss.

    r = reward(model, idx, attention_mask)      # (B,) read at each row's last real token

A reward model is a GPT (llm/nn/model.py) with a "reward" head, `Linear(n_embd, 1)`, read at
each row's last real token (the closing <|end|> of a rendered answer), left or right padding
alike. With the optional likelihood feature (head "reward_logprob", `reward.logprob_feature`)
the reward adds a learned weight times the mean log-probability the trunk's own LM head gives
the answer tokens: the linear head reads one hidden state, the feature reads every answer
token's next-token prediction, which is how a small trunk checks each `a op b = c` of a worked
answer.

- `reward`, `response_logprob`: the score, and the feature's part of it;
- `RewardLogprob`: the feature's parameters (a weight, and the marker token after which the
  answer starts: the tokenizer's <|assistant|>);
- `RewardModel`: the training view (forward = `reward`, so DDP/FSDP see it inside forward);
- `bradley_terry_loss`, `reward_loss_fn`: -log sigmoid(r_chosen - r_rejected - margin),
  label-smoothed, as the supervised loop's loss over pair batches (llm/data/preference.py);
- `score_sequences`: the reward of many token lists, batched by length;
- `pair_metrics`: accuracy and margins of any scorer on pairs (the reward model, DPO's implicit
  reward, a likelihood), per pair kind;
- `evaluate_pairs`: the held-out evaluation the reward stage reports and gates on (accuracy on
  SFT's own answers, the likelihood baseline, the head alone, the generated pairs).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm.data.batching import pad_right
from llm.nn.losses import masked_mean, token_logprobs
from llm.runtime import sharded_map

Batch = dict[str, Tensor]


class RewardLogprob(nn.Module):
    """The optional likelihood feature of the reward (head "reward_logprob", `reward.logprob_feature`).

    weight * the mean log-probability that the model's own LM head gives the response tokens,
    the tokens after the last `marker` token (the tokenizer's <|assistant|>). The linear reward
    head reads one hidden state; this reads every response token's next-token prediction, which
    is how a small trunk checks each `a op b = c` of an answer (docs/log.md, the reward model notes).
    """

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))  # learned with the head; 1: the feature counts from the start
        self.register_buffer("marker", torch.full((1,), -1, dtype=torch.long))  # set by GPT.add_head


def reward(model: nn.Module, idx: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """idx (B, T) -> scalar reward (B,) float32 from a GPT with a "reward" head, read at each
    row's last real token (left or right padding alike), plus the likelihood feature if present."""
    if getattr(model, "reward_head", None) is None:
        raise ValueError("this model has no 'reward' head; call model.add_head('reward') first")
    hidden = model.hidden_states(idx, attention_mask)  # (B, T, C)
    B, T = idx.shape
    if attention_mask is None:
        last = torch.full((B,), T - 1, device=idx.device)
    else:
        cols = torch.arange(T, device=idx.device).expand(B, T)
        last = torch.where(attention_mask.bool(), cols, -1).amax(1)  # (B,)
        if bool((last < 0).any()):
            raise ValueError("reward: a row of attention_mask has no real token")
    h = hidden[torch.arange(B, device=idx.device), last]  # (B, C)
    r = model.reward_head(h).squeeze(-1).float()      # (B,)
    if model.reward_logprob_head is not None:
        r = r + model.reward_logprob_head.weight.float() * response_logprob(model, idx, hidden, attention_mask)
    return r


def response_logprob(model: nn.Module, idx: Tensor, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Mean log-probability (B,) float32 of each row's response tokens under the LM head:
    the real tokens after the row's last `reward_logprob_head.marker` token. hidden (B, T, C)
    is `model.hidden_states(idx, attention_mask)`; a row without the marker is an error, a row
    with nothing after it scores 0."""
    marker = model.reward_logprob_head.marker        # (1,)
    B, T = idx.shape
    real = torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    cols = torch.arange(T, device=idx.device).expand(B, T)
    start = torch.where((idx == marker) & real, cols, -1).amax(1) + 1  # (B,) first response position
    if bool((start == 0).any()):
        row = int((start == 0).nonzero()[0])
        raise ValueError(f"reward: row {row} has no response marker (token id {int(marker)}, <|assistant|>);"
                         f" the likelihood feature scores what follows it")
    # the token at position t is predicted at position t - 1
    logp = token_logprobs(model.logits(hidden[:, :-1]), idx[:, 1:])   # (B, T-1)
    resp = (cols[:, 1:] >= start[:, None]) & real[:, 1:]               # (B, T-1)
    return masked_mean(logp, resp, dim=1)


def bradley_terry_loss(r_chosen: Tensor, r_rejected: Tensor, label_smoothing: float = 0.0,
                       margin: float = 0.0) -> Tensor:
    """Mean of -log sigmoid(r_c - r_r - margin), with labels smoothed towards 0.5. Shapes (B,)."""
    z = r_chosen - r_rejected - margin
    return (-(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)).mean()



class RewardModel(nn.Module):
    """A GPT with a "reward" head, seen as a scorer: forward(idx, attention_mask) -> (B,) rewards.

    Training goes through this forward (DDP/FSDP hook into it); the rewards are read at each
    row's last real token, for left and right padding alike. An untied LM head is frozen unless
    the reward's likelihood feature reads it: otherwise it takes no part in the reward and DDP
    must not wait for its gradient.
    """

    def __init__(self, gpt: nn.Module):
        super().__init__()
        if getattr(gpt, "reward_head", None) is None:
            raise ValueError("RewardModel: the model has no 'reward' head; call model.add_head('reward') first")
        self.gpt = gpt
        uses_lm = getattr(gpt, "reward_logprob_head", None) is not None  # the likelihood feature reads it
        if gpt.lm_head is not None and gpt.lm_head.weight is not gpt.wte.weight and not uses_lm:
            gpt.lm_head.weight.requires_grad_(False)

    def forward(self, idx: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return reward(self.gpt, idx, attention_mask)  # (B,) float32

    def flops_per_token(self) -> int:
        return self.gpt.flops_per_token()


def reward_loss_fn(label_smoothing: float, margin: float) -> Callable:
    """loss_fn for llm.train.trainer.train over `collate_pairs` batches and a (wrapped) RewardModel.

    Returns (Bradley-Terry loss summed over the B pairs, B, extras): extras `accuracy`
    (pairs with r_chosen > r_rejected) and `margin` (r_chosen - r_rejected), summed.
    """
    def loss_fn(model: nn.Module, batch: Batch):
        r = model(batch["idx"], attention_mask=batch["attention_mask"])  # (2B,)
        B = r.shape[0] // 2
        rc, rr = r[:B], r[B:]
        loss = bradley_terry_loss(rc, rr, label_smoothing, margin) * B  # the mean times B = the sum
        with torch.no_grad():
            extras = {"accuracy": (rc > rr).float().sum(), "margin": (rc - rr).sum()}
        return loss, batch["weight"], extras
    return loss_fn


@torch.no_grad()
def score_sequences(model: nn.Module, seqs: Sequence[Sequence[int]], *, pad_id: int, batch_size: int,
                    device: torch.device | str = "cpu", autocast: Callable[[], Any] | None = None,
                    rt=None) -> Tensor:
    """Reward of each token list (N,) float32, in input order, from a GPT with a reward head
    or a RewardModel. Batched by length (less padding), right-padded, eval mode.

    autocast: a context-manager factory run around each forward, e.g. `Runtime.autocast`
    (bf16 on CUDA); None = full precision. rt: a distributed llm.runtime.Runtime shares the
    batches out over its ranks (llm.runtime.sharded_map); every rank gets every score.
    """
    if not seqs:
        return torch.zeros(0)
    score = model if isinstance(model, RewardModel) else (lambda i, m: reward(model, i, m))  # the same numbers
    was = model.training
    model.eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    chunks = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]

    def one(b: int) -> Tensor:
        idx, mask, _ = pad_right([seqs[i] for i in chunks[b]], pad_id)
        with (autocast or contextlib.nullcontext)():
            return score(idx.to(device), mask.to(device)).float().cpu()  # (b,)

    out = torch.empty(len(seqs))
    try:
        for ix, r in zip(chunks, sharded_map(one, len(chunks), rt)):
            out[torch.as_tensor(ix)] = r
    finally:
        model.train(was)
    return out


def evaluate_pairs(model: nn.Module, val: Sequence[Any], *, sft_records: Sequence[dict], generated: Sequence[Any],
                   pad_id: int, batch_size: int,
                   device: torch.device | str = "cpu", autocast: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Every held-out pair scored by `model` (a GPT with a reward head): `pair_metrics` of `val`
    (accuracy, margin, reward mean/std of each side, `by_kind`), and beside them the numbers below.
    `val` and `generated` hold llm.data.preference.EncodedPair (`.chosen`, `.rejected`, `.kind`); the
    model code does not import the pair reader.

    - `sft_likelihood_accuracy`: the baseline to beat, the share of `sft_records` (the val records
      behind `val`, as the samples stage wrote them) whose chosen answer the SFT model's own mean
      log-probability per token ranks higher (None where no record carries it);
    - `accuracy_without_likelihood`: the accuracy with the likelihood feature's weight zeroed, what
      the head on the trunk ranks by itself (None without the feature);
    - `generated_accuracy`, `generated_by_kind`: the same on the generated pairs.
    """
    def score(pairs: Sequence[Any]) -> dict[str, Any]:
        seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        r = score_sequences(model, seqs, pad_id=pad_id, batch_size=batch_size, device=device, autocast=autocast)
        return pair_metrics(r[:len(pairs)], r[len(pairs):], [p.kind for p in pairs])

    out = score(val)
    flags = [r["sft_logp_chosen"] > r["sft_logp_rejected"] for r in sft_records
             if r.get("sft_logp_chosen") is not None]
    out["sft_likelihood_accuracy"] = sum(flags) / len(flags) if flags else None
    out["accuracy_without_likelihood"] = None
    if "reward_logprob" in model.head_names:
        with _likelihood_feature_off(model):
            out["accuracy_without_likelihood"] = score(val)["accuracy"]
    gen = score(generated)
    out["generated_accuracy"], out["generated_by_kind"] = gen["accuracy"], gen["by_kind"]
    return out


@contextlib.contextmanager
def _likelihood_feature_off(model: nn.Module):
    """The reward model without its likelihood feature: the feature's weight zeroed, restored after."""
    w = model.reward_logprob_head.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            w.copy_(saved)


def pair_metrics(rc: Tensor, rr: Tensor, kinds: Sequence[str] | None = None) -> dict[str, Any]:
    """Held-out numbers for a scorer on pairs: rc, rr (N,) scores of chosen and rejected.

    accuracy = share of pairs with rc > rr (a tie counts as wrong), margin = mean(rc - rr),
    reward_{chosen,rejected}_{mean,std}, reward_{mean,std} over both sides, and `by_kind`
    {kind: {n, accuracy, margin}}.
    """
    n = int(rc.numel())
    if n == 0:
        raise ValueError("pair_metrics: no pairs")
    both = torch.cat([rc, rr]).double()
    out: dict[str, Any] = {
        "n_pairs": n,
        "accuracy": float((rc > rr).double().mean()),
        "margin": float((rc - rr).double().mean()),
        "reward_chosen_mean": float(rc.double().mean()), "reward_chosen_std": _std(rc),
        "reward_rejected_mean": float(rr.double().mean()), "reward_rejected_std": _std(rr),
        "reward_mean": float(both.mean()), "reward_std": _std(both),
    }
    if kinds is not None:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, k in enumerate(kinds):
            groups[k].append(i)
        out["by_kind"] = {k: {"n": len(ix), "accuracy": float((rc[ix] > rr[ix]).double().mean()),
                              "margin": float((rc[ix] - rr[ix]).double().mean())}
                          for k, ix in sorted(groups.items())}
    return out


def _std(x: Tensor) -> float:
    return float(x.double().std(unbiased=False)) if x.numel() else 0.0
