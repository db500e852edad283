"""Preference pairs: reading and encoding, batches, reward-model scoring, pair selection,
DPO reference log-probs and the KL to a reference model.

Shared by stages/reward.py, stages/pairs.py and stages/dpo.py. A pair record
(data/prepared/prefs, data/pairs) is

    {"id", "prompt": [{"role", "content"}, ...], "chosen": str, "rejected": str, "kind": str, ...}

and each answer is rendered with the chat template as `render_prompt(prompt) + answer + <|end|>`
(the same tokens `llm.chat.render` gives the conversation prompt + [assistant answer]). The
response mask is True on the answer tokens and the closing <|end|>: what DPO scores.

Batches stack the B chosen sequences and then the B rejected ones into one right-padded
(2B, T) batch, so one forward pass scores both sides; `weight` = B pairs (the trainer's
loss unit). `RewardModel` is the training view of a GPT with a reward head: its forward
returns the (B,) rewards read at each row's last real token (`GPT.reward`), so DDP sees the
reward computation inside forward() and the LM head is never computed.

Pair selection (`choose_pair`, `preference_score`, `break_format`) and the KL of a
policy to its reference along the policy's own samples (`policy_kl`) live here too, so the
stages stay orchestration.
"""
from __future__ import annotations

import contextlib
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm.batching import BucketBatchSampler, ExampleBatches
from llm.chat import ROLE_TOKENS, render_prompt
from llm.fileio import DataError, read_jsonl
from llm.generate import generate
from llm.losses import bradley_terry_loss, dpo_loss, sequence_logprob
from llm.rewards import parse_answer, to_number

Batch = dict[str, Tensor]


# ---------------------------------------------------------------------------
# Records and encoding

def validate_pair(obj: Any) -> str | None:
    """Why a JSON object is not a usable preference pair, or None (for `read_jsonl(validate=...)`)."""
    if not isinstance(obj, dict):
        return "expected a JSON object"
    prompt = obj.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return "'prompt' must be a non-empty list of messages"
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or m.get("role") not in ROLE_TOKENS or not isinstance(m.get("content"), str):
            return f"prompt[{i}] must be {{'role': system|user|assistant, 'content': str}}"
    for k in ("chosen", "rejected"):
        if not isinstance(obj.get(k), str):
            return f"'{k}' must be a string"
    if obj["chosen"] == obj["rejected"]:
        return "'chosen' and 'rejected' are the same text"
    return None


@dataclass
class EncodedPair:
    """Token ids of one pair: prompt + answer + <|end|> for each side, sharing the prompt."""
    chosen: list[int]
    rejected: list[int]
    prompt_len: int   # the response starts at this position in both sequences
    kind: str = ""

    @property
    def length(self) -> int:
        return max(len(self.chosen), len(self.rejected))


def encode_response(prompt_ids: Sequence[int], response: str, tokenizer) -> list[int]:
    """prompt ids (ending with <|assistant|>) + the response's tokens + <|end|>."""
    return [*prompt_ids, *tokenizer.encode(response, allowed_special="none"), tokenizer.end_id]


def encode_pairs(records: Sequence[dict], tokenizer, max_tokens: int) -> tuple[list[EncodedPair], list[int], int]:
    """Encode pair records; those longer than max_tokens (the model's seq_len) are dropped.

    Returns (pairs, the record index of each pair, number dropped). Truncating instead would
    cut the end of an answer, where the reward is read and where the two answers differ.
    """
    out, kept, dropped = [], [], 0
    for i, r in enumerate(records):
        p = render_prompt(r["prompt"], tokenizer)
        c, j = encode_response(p, r["chosen"], tokenizer), encode_response(p, r["rejected"], tokenizer)
        if max(len(c), len(j)) > max_tokens:
            dropped += 1
            continue
        out.append(EncodedPair(c, j, len(p), str(r.get("kind", ""))))
        kept.append(i)
    return out, kept, dropped


@dataclass
class PairSplits:
    """The train and val pairs of a pair directory, encoded (`load_pair_splits`)."""
    train: list[EncodedPair]
    val: list[EncodedPair]
    val_records: list[dict]   # every val record, as read
    val_kept: list[int]       # the record index of each val pair
    dropped_train: int        # records longer than seq_len, left out
    dropped_val: int
    seq_len: int

    @property
    def dropped(self) -> int:
        return self.dropped_train + self.dropped_val

    def summary(self) -> str:
        return (f"{len(self.train)} train / {len(self.val)} val pairs ({self.dropped_train} + {self.dropped_val}"
                f" dropped: longer than seq_len={self.seq_len})")


def load_pair_splits(data: str | Path, tokenizer, seq_len: int) -> PairSplits:
    """Read data/{train,val}.jsonl (each record checked by `validate_pair`) and encode them with
    `encode_pairs`. Raises DataError when no train or no val pair fits in seq_len."""
    data = Path(data)
    train_recs = list(read_jsonl(data / "train.jsonl", validate=validate_pair))
    val_recs = list(read_jsonl(data / "val.jsonl", validate=validate_pair))
    train, _, dropped_train = encode_pairs(train_recs, tokenizer, seq_len)
    val, val_kept, dropped_val = encode_pairs(val_recs, tokenizer, seq_len)
    if not train or not val:
        raise DataError(f"{data}: no {'train' if not train else 'val'} pair fits in seq_len={seq_len}"
                        f" ({dropped_train} train and {dropped_val} val pairs are longer)")
    return PairSplits(train=train, val=val, val_records=val_recs, val_kept=val_kept, dropped_train=dropped_train,
                      dropped_val=dropped_val, seq_len=seq_len)


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, prompt_lens: Sequence[int] | None = None
              ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Right-pad token lists: idx (N, T) long, attention_mask (N, T) bool and, given the prompt
    lengths, response_mask (N, T) bool (True from prompt_len to the end of each sequence)."""
    N, T = len(seqs), max(len(s) for s in seqs)
    idx = torch.full((N, T), pad_id, dtype=torch.long)
    mask = torch.zeros((N, T), dtype=torch.bool)
    resp = torch.zeros((N, T), dtype=torch.bool) if prompt_lens is not None else None
    for i, s in enumerate(seqs):
        idx[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, :len(s)] = True
        if resp is not None:
            resp[i, prompt_lens[i]:len(s)] = True
    return idx, mask, resp


def collate_pairs(pairs: Sequence[EncodedPair], *, pad_id: int, ref_chosen: Tensor | None = None,
                  ref_rejected: Tensor | None = None) -> Batch:
    """One batch of B pairs: rows 0..B-1 chosen, B..2B-1 rejected.

    Returns idx (2B, T) long, attention_mask (2B, T) bool, response_mask (2B, T) bool,
    weight () float = B, and with reference log-probs (B,) each also ref_chosen, ref_rejected.
    """
    if not pairs:
        raise ValueError("collate_pairs: empty batch")
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    lens = [p.prompt_len for p in pairs] * 2
    idx, mask, resp = pad_right(seqs, pad_id, lens)
    batch = {"idx": idx, "attention_mask": mask, "response_mask": resp,
             "weight": torch.tensor(float(len(pairs)))}
    if ref_chosen is not None:
        batch["ref_chosen"], batch["ref_rejected"] = ref_chosen.float(), ref_rejected.float()
    return batch


def pair_batches(pairs: Sequence[EncodedPair], *, batch_size: int, bucket_width: int, seed: int, pad_id: int,
                 rank: int = 0, world_size: int = 1, ref: tuple[Tensor, Tensor] | None = None) -> ExampleBatches:
    """An endless, resumable batch source over pairs, bucketed by length (llm/batching.py)."""
    sampler = BucketBatchSampler([p.length for p in pairs], batch_size=batch_size, bucket_width=bucket_width,
                                 seed=seed, rank=rank, world_size=world_size)
    return ExampleBatches(sampler, _maker(pairs, pad_id, ref))


def fixed_pair_batches(pairs: Sequence[EncodedPair], *, batch_size: int, pad_id: int, n_batches: int | None = None,
                       ref: tuple[Tensor, Tensor] | None = None) -> list[Batch]:
    """Validation batches: the pairs in order (the first n_batches * batch_size; None = all)."""
    n = len(pairs) if n_batches is None else min(len(pairs), n_batches * batch_size)
    make = _maker(pairs, pad_id, ref)
    return [make(list(range(i, min(i + batch_size, n)))) for i in range(0, n, batch_size)]


def _maker(pairs, pad_id, ref) -> Callable[[list[int]], Batch]:
    def make(ix: list[int]) -> Batch:
        sel = [pairs[i] for i in ix]
        if ref is None:
            return collate_pairs(sel, pad_id=pad_id)
        t = torch.as_tensor(ix, dtype=torch.long)
        return collate_pairs(sel, pad_id=pad_id, ref_chosen=ref[0][t], ref_rejected=ref[1][t])
    return make


# ---------------------------------------------------------------------------
# Reward model

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
        return self.gpt.reward(idx, attention_mask)  # (B,) float32

    def flops_per_token(self) -> int:
        return self.gpt.flops_per_token()


def reward_loss_fn(label_smoothing: float, margin: float) -> Callable:
    """loss_fn for llm.trainer.train over `collate_pairs` batches and a (wrapped) RewardModel.

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
                    device: torch.device | str = "cpu", autocast: Callable[[], Any] | None = None) -> Tensor:
    """Reward of each token list (N,) float32, in input order, from a GPT with a reward head
    or a RewardModel. Batched by length (less padding), right-padded, eval mode.

    autocast: a context-manager factory run around each forward, e.g. `Runtime.autocast`
    (bf16 on CUDA); None = full precision.
    """
    if not seqs:
        return torch.zeros(0)
    score = model if isinstance(model, RewardModel) else model.reward  # GPT.reward: the same numbers
    was = model.training
    model.eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = torch.empty(len(seqs))
    try:
        for s in range(0, len(order), batch_size):
            ix = order[s:s + batch_size]
            idx, mask, _ = pad_right([seqs[i] for i in ix], pad_id)
            with (autocast or contextlib.nullcontext)():
                r = score(idx.to(device), mask.to(device))
            out[torch.as_tensor(ix)] = r.float().cpu()
    finally:
        model.train(was)
    return out


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


# ---------------------------------------------------------------------------
# Choosing pairs from scored samples

def choose_pair(scores: Sequence[float], tie_epsilon: float) -> tuple[int, int] | None:
    """(index of the best sample, index of the worst) or None for a tie (best - worst <= tie_epsilon).

    The first best and the first worst win among equals, so the choice is deterministic.
    """
    if len(scores) < 2:
        return None
    best = max(range(len(scores)), key=lambda i: scores[i])
    worst = min(range(len(scores)), key=lambda i: scores[i])
    if not scores[best] - scores[worst] > tie_epsilon:
        return None
    return best, worst


_JUST_ABOVE_HALF = math.nextafter(0.5, 1.0)
_JUST_BELOW_ONE = math.nextafter(1.0, 0.0)


def preference_score(r_chosen: float, r_rejected: float) -> float:
    """sigmoid(r_chosen - r_rejected), kept strictly inside (0.5, 1).

    For a non-tied pair the difference is positive, so the score is above 0.5; float64
    rounds sigmoid(d) to exactly 1.0 for d > ~37 (and to 0.5 for d < ~1e-16), which the
    clamp moves to the nearest representable value inside the interval.
    """
    d = r_chosen - r_rejected
    if not d > 0:
        raise ValueError(f"preference_score: r_chosen {r_chosen} is not above r_rejected {r_rejected}")
    s = 1.0 / (1.0 + math.exp(-d)) if d < 700 else 1.0
    return min(max(s, _JUST_ABOVE_HALF), _JUST_BELOW_ONE)


def break_format(response: str, answer: str, rng: random.Random) -> str | None:
    """An adversarial rejected answer: the same worked solution with its final `#### N` line
    removed or mangled, so the content is still right and only the format is wrong.

    Returns None when `response` is not a right, well-formatted answer to `answer`. Every
    candidate is checked with the verifier's parser: correct value, not formatted.
    """
    value, formatted = parse_answer(response)
    target = to_number(answer)
    if not formatted or value is None or target is None or value != target:
        return None
    lines = response.rstrip().splitlines()
    body, n = lines[:-1], lines[-1].strip()[4:].strip()
    variants = [body + [f"The answer is {n}."], body + [n], body + [f"### {n}"], body + [f"Answer: {n}"],
                body + [f"#### {n} is the answer"], body + [f"{n} ####"]]
    if body:
        variants.append(list(body))
    rng.shuffle(variants)
    for v in variants:
        text = "\n".join(v)
        val, fmt = parse_answer(text)
        if not fmt and val == target:
            return text
    return None


# ---------------------------------------------------------------------------
# DPO

@torch.no_grad()
def reference_logprobs(model: nn.Module, pairs: Sequence[EncodedPair], *, pad_id: int, batch_size: int,
                       device: torch.device | str = "cpu", autocast: Callable[[], Any] | None = None
                       ) -> tuple[Tensor, Tensor]:
    """Sequence log-probs (masked sum over response tokens, llm.losses.sequence_logprob) of the
    chosen and rejected answers of every pair under `model`: two (N,) float32 tensors.

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
                lp = sequence_logprob(model, b["idx"].to(device), b["attention_mask"].to(device),
                                      b["response_mask"].to(device)).float().cpu()  # (2B,)
            t = torch.as_tensor(ix)
            ref_c[t], ref_r[t] = lp[:len(ix)], lp[len(ix):]
    finally:
        model.train(was)
    return ref_c, ref_r


def dpo_loss_fn(beta: float, loss_type: str, label_smoothing: float) -> Callable:
    """loss_fn for llm.trainer.train over `collate_pairs` batches with ref_chosen/ref_rejected.

    Only the policy runs: log pi of both answers in one forward, the reference's come from the
    batch. Returns (DPO loss summed over the B pairs, B, extras summed over pairs):
    rewards_chosen, rewards_rejected (beta * (log pi - log ref)), rewards_margin,
    rewards_accuracy (rewards_chosen > rewards_rejected), as TRL's rewards/* metrics.
    """
    def loss_fn(model: nn.Module, batch: Batch):
        lp = sequence_logprob(model, batch["idx"], batch["attention_mask"], batch["response_mask"])  # (2B,)
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
    pol_c, pol_r = reference_logprobs(policy, pairs, pad_id=pad_id, batch_size=batch_size, device=device,
                                      autocast=autocast)
    losses, rc, rr = dpo_loss(pol_c, pol_r, ref[0], ref[1], beta, loss_type, label_smoothing)
    m = pair_metrics(rc, rr, [p.kind for p in pairs])
    return {"n_pairs": len(pairs), "loss": float(losses.double().mean()),
            "rewards_chosen": m["reward_chosen_mean"], "rewards_rejected": m["reward_rejected_mean"],
            "rewards_margin": m["margin"], "rewards_accuracy": m["accuracy"],
            "logps_chosen": float(pol_c.double().mean()), "logps_rejected": float(pol_r.double().mean()),
            "by_kind": {k: {"n": v["n"], "rewards_accuracy": v["accuracy"], "rewards_margin": v["margin"]}
                        for k, v in m["by_kind"].items()}}


@torch.no_grad()
def policy_kl(policy: nn.Module, reference: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
              batch_size: int, pad_id: int, stop_ids: Sequence[int], generator: torch.Generator,
              autocast: Callable[[], Any] | None = None) -> dict[str, float]:
    """KL(policy || reference) along the policy's own samples, exactly per token.

    For each prompt x, one response y ~ policy(. | x) is sampled at temperature 1 (no top-k/p),
    up to max_new_tokens tokens including the stop token. At every response position t,

        KL_t = sum_v pi(v | x, y_<t) * (log pi(v | x, y_<t) - log ref(v | x, y_<t))

    over the whole vocabulary (not a one-sample estimate). Returns
      kl:        mean KL_t over all sampled response tokens of all prompts (nats per token)
      kl_seq:    mean over prompts of sum_t KL_t (an estimate of the sequence-level KL)
      kl_tokens: the number of response tokens measured
    """
    was = policy.training
    policy.eval()
    reference.eval()
    tok_sum, seq_sums, n_tok = 0.0, [], 0
    try:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for s in range(0, len(order), batch_size):
            chunk = [prompts[i] for i in order[s:s + batch_size]]
            room = min(max_new_tokens, policy.config.seq_len - max(map(len, chunk)))
            if room < 1:
                raise ValueError(f"policy_kl: a prompt of {max(map(len, chunk))} tokens leaves no room in"
                                 f" seq_len {policy.config.seq_len}")
            gen = generate(policy, chunk, room, temperature=1.0, stop_ids=stop_ids, pad_id=pad_id,
                           generator=generator)
            P = gen.prompt_len
            with (autocast or contextlib.nullcontext)():
                lp = F.log_softmax(policy(gen.tokens, attention_mask=gen.attention_mask).float(), -1)
                lq = F.log_softmax(reference(gen.tokens, attention_mask=gen.attention_mask).float(), -1)
            # logits at position P-1+t predict response token t: (B, N, V)
            lp, lq = lp[:, P - 1:-1], lq[:, P - 1:-1]
            kl = (lp.exp() * (lp - lq)).sum(-1)                  # (B, N)
            m = gen.response_mask.to(kl.dtype)                   # (B, N)
            per_seq = (kl * m).sum(1)                            # (B,)
            tok_sum += float(per_seq.sum())
            n_tok += int(m.sum())
            seq_sums += per_seq.tolist()
    finally:
        policy.train(was)
    return {"kl": tok_sum / max(n_tok, 1), "kl_seq": sum(seq_sums) / max(len(seq_sums), 1), "kl_tokens": n_tok}
