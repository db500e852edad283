"""Direct preference optimisation: the loss, the frozen reference's log-probs, and held-out metrics.

DPO (Rafailov et al. 2023) trains the policy on preference pairs against a frozen reference
(the SFT model), with no reward model and no sampling:

    h    = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
    DPO  = -log sigmoid(beta h)                                   (loss_type: sigmoid)
    cDPO = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (label_smoothing eps)
    IPO  = (h - 1 / (2 beta))^2                                    (loss_type: ipo)

`log pi(answer)` is the log-probability of the answer's tokens (and its closing <|end|>) given
the prompt: their sum for DPO, their mean for IPO, as IPO's authors (Azar et al. 2023) and TRL
define it, so that IPO's target margin 1/(2 beta) does not depend on the answer's length.
The implicit rewards are beta (log pi - log ref) of each side (TRL's rewards/* metrics).

- `answer_logprobs`: log pi of each row's answer in a pair batch (llm/data/preference.py);
- `reference_logprobs`: the same for every pair under the frozen reference, computed once
  before training so the loop never runs the reference;
- `dpo_loss`, `dpo_loss_fn`: the loss per pair, and the supervised loop's loss over batches;
- `dpo_metrics`: held-out loss, rewards, margins and accuracy, per pair kind.
The KL of the trained policy to the reference on its own samples is llm.sample.rollout.sampled_kl.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm.data.preference import Batch, EncodedPair, collate_pairs
from llm.nn.losses import answer_logprob, sequence_logprob
from llm.nn.reward_model import pair_metrics


def answer_logprobs(model: nn.Module, batch: Batch, per_token: bool = False, full_head: bool = False) -> Tensor:
    """log pi of each row's answer (the response_mask tokens), (2B,) float32: the sum over the
    answer's tokens, or with per_token their mean (an empty answer gives 0). The logits are
    computed at the answer positions only (llm.nn.losses.answer_logprob), or with full_head at
    every position (a compiled policy, whose graph cannot know how many positions are picked)."""
    logprob = sequence_logprob if full_head else answer_logprob
    lp = logprob(model, batch["idx"], batch["attention_mask"], batch["response_mask"])  # (2B,)
    if per_token:
        lp = lp / batch["response_mask"][:, 1:].sum(-1).clamp(min=1)  # the tokens sequence_logprob sums
    return lp


def dpo_loss(pi_chosen: Tensor, pi_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[Tensor, Tensor, Tensor]:
    """DPO / cDPO / IPO losses per pair, and the implicit rewards.

    All inputs (B,) answer log-probs: sums over the answer's tokens for sigmoid, means over
    them for ipo (`answer_logprobs`). Returns (losses (B,), rewards_chosen (B,),
    rewards_rejected (B,)) with reward = beta * (log pi - log ref).

      sigmoid: -(1-eps) log s(beta*h) - eps log s(-beta*h),   h = (pi_c - ref_c) - (pi_r - ref_r)
      ipo:     (h - 1/(2*beta))^2
    """
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be 'sigmoid' or 'ipo', got {loss_type!r}")
    rewards_c = beta * (pi_chosen - ref_chosen).detach()
    rewards_r = beta * (pi_rejected - ref_rejected).detach()
    return losses, rewards_c, rewards_r



@torch.no_grad()
def reference_logprobs(model: nn.Module, pairs: Sequence[EncodedPair], *, pad_id: int, batch_size: int,
                       per_token: bool = False, device: torch.device | str = "cpu",
                       autocast: Callable[[], Any] | None = None) -> tuple[Tensor, Tensor]:
    """Sequence log-probs (`answer_logprobs`: the sum over response tokens, or with per_token
    their mean) of the chosen and rejected answers of every pair under `model`: two (N,)
    float32 tensors.

    Run once before DPO training with the frozen reference, so the loop never runs it; the
    policy's held-out log-probs (`dpo_metrics`) come from here too, batched the same way.
    autocast: as in `score_sequences`.
    """
    was = model.training
    model.eval()
    ref_c, ref_r = torch.empty(len(pairs)), torch.empty(len(pairs))
    order = sorted(range(len(pairs)), key=lambda i: pairs[i].length)
    try:
        for s in range(0, len(order), batch_size):
            ix = order[s:s + batch_size]
            b = collate_pairs([pairs[i] for i in ix], pad_id=pad_id)
            with (autocast or contextlib.nullcontext)():
                lp = answer_logprobs(model, {k: v.to(device) for k, v in b.items()}, per_token).float().cpu()  # (2B,)
            t = torch.as_tensor(ix)
            ref_c[t], ref_r[t] = lp[:len(ix)], lp[len(ix):]
    finally:
        model.train(was)
    return ref_c, ref_r


def dpo_loss_fn(beta: float, loss_type: str, label_smoothing: float, full_head: bool = False) -> Callable:
    """loss_fn for llm.train.trainer.train over `collate_pairs` batches with ref_chosen/ref_rejected
    (from `reference_logprobs` with per_token = loss_type == "ipo").

    Only the policy runs: log pi of both answers in one forward, the reference's come from the
    batch. Returns (DPO loss summed over the B pairs, B, extras summed over pairs):
    rewards_chosen, rewards_rejected (beta * (log pi - log ref)), rewards_margin,
    rewards_accuracy (rewards_chosen > rewards_rejected), as TRL's rewards/* metrics.
    full_head: the logits at every position (`answer_logprobs`), for a compiled policy.
    """
    def loss_fn(model: nn.Module, batch: Batch):
        lp = answer_logprobs(model, batch, per_token=loss_type == "ipo", full_head=full_head)  # (2B,)
        B = lp.shape[0] // 2
        losses, rc, rr = dpo_loss(lp[:B], lp[B:], batch["ref_chosen"], batch["ref_rejected"], beta,
                                  loss_type, label_smoothing)  # (B,) each
        extras = {"rewards_chosen": rc.sum(), "rewards_rejected": rr.sum(), "rewards_margin": (rc - rr).sum(),
                  "rewards_accuracy": (rc > rr).float().sum()}
        return losses.sum(), batch["weight"], extras
    return loss_fn


@torch.no_grad()
def dpo_metrics(policy: nn.Module, pairs: Sequence[EncodedPair], ref: tuple[Tensor, Tensor], *, beta: float,
                loss_type: str, label_smoothing: float, pad_id: int, batch_size: int,
                device: torch.device | str = "cpu", autocast: Callable[[], Any] | None = None) -> dict[str, Any]:
    """DPO metrics of `policy` on held-out pairs, with `by_kind` accuracies.

    rewards_chosen / rewards_rejected: mean beta * (log pi - log ref) of each side;
    rewards_margin: their mean difference; rewards_accuracy: share of pairs whose chosen
    reward is strictly higher (0 for the untrained policy, where every reward is 0); loss:
    the mean DPO loss; logps_chosen / logps_rejected: mean policy sequence log-probs.
    """
    pol_c, pol_r = reference_logprobs(policy, pairs, pad_id=pad_id, batch_size=batch_size,
                                      per_token=loss_type == "ipo", device=device, autocast=autocast)
    losses, rc, rr = dpo_loss(pol_c, pol_r, ref[0], ref[1], beta, loss_type, label_smoothing)
    m = pair_metrics(rc, rr, [p.kind for p in pairs])
    return {"n_pairs": len(pairs), "loss": float(losses.double().mean()),
            "rewards_chosen": m["reward_chosen_mean"], "rewards_rejected": m["reward_rejected_mean"],
            "rewards_margin": m["margin"], "rewards_accuracy": m["accuracy"],
            "logps_chosen": float(pol_c.double().mean()), "logps_rejected": float(pol_r.double().mean()),
            "by_kind": {k: {"n": v["n"], "rewards_accuracy": v["accuracy"], "rewards_margin": v["margin"]}
                        for k, v in m["by_kind"].items()}}
