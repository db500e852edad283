"""GRPO: group-relative policy optimisation, one group batch per step.

    algo = GRPO(policy, ref, cfg, prompts_fn=..., reward_fn=..., stop_ids=(tok.end_id,), pad_id=tok.pad_id, seed=s)
    llm.rl.finish_rl_stage(setup, algo, cfg, rt, ...)    # runs llm.loop.run_loop

No value function: the baseline is the group. One step:

  1. rollout: prompts_per_step prompts (oversample times as many with dynamic sampling), each
     repeated group_size (G) times, sampled in one batch with the KV cache; the behaviour
     log-probs recorded by the sampler are the "old" log-probs of the ratio
     (tests/test_rollout.py: they equal a recomputed forward in fp32; under bf16/fp16 autocast
     they are recomputed by one no_grad forward instead);
  2. scoring: reward per completion (the verifier), advantages
     A = (r - mean_group) / (std_group + 1e-4), exactly 0 for a group whose rewards are all
     equal (llm.losses.group_advantages; counted in frac_reward_zero_std), the same for every
     token of a completion; with `step_credit` > 0, plus step_credit x the verifier's credit of
     each token (+1 on the result of a right worked step, -1 on a slip: llm.rewards.step_credit),
     a process-level signal that says where an answer went wrong; the reference
     log-probs from one no_grad forward of the frozen SFT model (skipped when beta = 0).
     Dynamic sampling (oversample > 1, as DAPO): only the first prompts_per_step groups, in
     draw order, whose outcome rewards differ go on to step 3; an all-right or all-wrong group
     has a zero outcome advantage, and once the policy is good most groups agree, so a step
     would otherwise train on a few groups. Fewer such groups than
     prompts_per_step: the step trains on those it has;
  3. `epochs` passes over shuffled minibatches of completions; per token
        clipped surrogate(ratio, A, clip_epsilon) + beta * k3(pi, ref)
     reduced by `loss_agg` (grpo: per-sequence mean then batch mean; dr_grpo: sum over
     tokens / (B * max_new_tokens); dapo: token mean over the minibatch). With beta = 0 the
     completions with A = 0 contribute exactly nothing, so they are left out of forward and
     backward and the loss is rescaled to the full minibatch's normaliser: the same gradient
     for a fraction of the work (tests/test_grpo.py checks the equality).

Quality gate: if every group of a step has zero reward variance for
max_zero_std_steps consecutive steps, nothing is being learned (all wrong or all right);
the step raises llm.errors.QualityGateError with the numbers.

Per-step row (TRL names): reward, reward_std (mean within-group std, as TRL), frac_reward_zero_std,
kl (mean per-token k3 under the current policy), entropy (of the sampling distribution, estimated
as the mean -log pi_old of the sampled tokens), clip_ratio and approxkl (over the completions that
went through the update), policy_loss, loss, grad_norm, response_length, stop_rate, accuracy /
format_rate (verifier statistics), groups_trained (the groups step 3 saw: prompts_per_step, or
fewer under dynamic sampling), rollout_s / scoring_s / update_s, tokens_per_s.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from llm.config import GRPOConfig
from llm.losses import aggregate, group_advantages, kl_estimate, masked_mean, ppo_policy_loss
from llm.errors import QualityGateError
from llm.loop import Updater
from llm.rewards import RewardFn, step_credit
from llm.rl import Mean, Shares, gather_rows, global_sums, minibatches, step_generator
from llm.rollout import response_forward, rollout
from llm.runtime import Runtime

PromptsFn = Callable[[int], tuple[list[list[int]], list[dict]]]


class GRPO:
    def __init__(self, policy: nn.Module, ref: nn.Module | None, cfg: GRPOConfig, *, prompts_fn: PromptsFn,
                 reward_fn: RewardFn, stop_ids: Sequence[int], pad_id: int, seed: int, tokenizer=None,
                 rt: Runtime | None = None):
        if cfg.beta > 0 and ref is None:
            raise ValueError("GRPO: beta > 0 needs a reference model")
        if cfg.step_credit > 0 and tokenizer is None:
            raise ValueError("GRPO: step_credit > 0 needs the tokenizer (to find each step's result tokens)")
        self.model, self.ref, self.cfg, self.tokenizer, self.rt = policy, ref, cfg, tokenizer, rt
        self.prompts_fn, self.reward_fn = prompts_fn, reward_fn
        self.stop_ids, self.pad_id, self.seed = tuple(stop_ids), pad_id, seed
        self.zero_std_streak = 0
        if ref is not None:
            ref.eval().requires_grad_(False)

    def state_dict(self) -> dict:
        return {"zero_std_streak": self.zero_std_streak}

    def load_state_dict(self, state: dict) -> None:
        self.zero_std_streak = int(state["zero_std_streak"])

    def step(self, step: int, updater: Updater) -> dict[str, float]:
        cfg, policy, rt = self.cfg, self.model, self.rt
        device = next(policy.parameters()).device
        T, G = cfg.temperature, cfg.group_size

        # 1. rollout: every prompt G times; this rank's share of the groups ----------------
        t0 = time.perf_counter()
        prompts, problems = self.prompts_fn(step)                          # the global list, the same on every rank
        share = Shares.of(len(prompts), G, rt)                              # rows [lo, hi) of B_all = n * G
        first, last = share.lo // G, share.hi // G
        prompts, problems = prompts[first:last], problems[first:last]
        n = len(prompts)
        ro = rollout(policy, [p for p in prompts for _ in range(G)], max_new_tokens=cfg.max_new_tokens,
                     temperature=T, stop_ids=self.stop_ids, pad_id=self.pad_id,
                     generator=step_generator(self.seed, "rollout", step, device),
                     row_offset=share.lo, total_rows=share.total)
        t1 = time.perf_counter()

        # 2. scoring ---------------------------------------------------------------------
        mask = ro.response_mask                                             # (B, N), B = n * G (this rank's)
        B = len(ro)
        rewards, rstats = self.reward_fn(ro, [p for p in problems for _ in range(G)])   # (B,)
        grouped = rewards.float().view(n, G)
        adv, zero_std = group_advantages(grouped)                           # (n, G), (n,)
        # per token: the group-relative outcome advantage, plus the verifier's step credit
        # (+1 on right step results, -1 on a slip) when grpo.step_credit > 0
        adv = adv.reshape(B, 1).expand(B, mask.shape[1]).to(device)         # (B, N)
        if cfg.step_credit > 0:
            adv = adv + cfg.step_credit * step_credit(self.tokenizer, ro).to(device)
        old_lp = ro.logprobs                                                # (B, N) behaviour log-probs
        ref_lp = None
        with torch.no_grad():
            if torch.is_autocast_enabled(device.type):
                # bf16/fp16: decode-step and full-sequence numerics differ by ~1e-2, so take the
                # ratio's denominator from the same kind of forward as its numerator
                old_lp = response_forward(policy, ro, T).logprobs
            if cfg.beta > 0:
                ref_lp = response_forward(self.ref, ro, T).logprobs         # (B, N)
        # what every rank needs of the others' rows (B_all,): response lengths, and which rows
        # have a nonzero advantage somewhere (the others add nothing to the loss when beta = 0)
        lengths_all = gather_rows(ro.lengths, rt).to(device).float()
        informative_all = gather_rows((adv != 0).any(1), rt).to(device)
        trained = torch.arange(share.total)                                 # the global rows step 3 sees
        if cfg.oversample > 1:
            trained = first_informative_groups(gather_rows(zero_std, rt), cfg.prompts_per_step, G)
        t2 = time.perf_counter()

        (reward_sum, std_sum, n_zero, ent_sum, n_resp, len_sum, stop_sum, n_tokens, *rvals) = global_sums(
            [rewards.double().sum(), grouped.std(dim=1).sum(), zero_std.sum(), (-ro.logprobs * mask).sum(),
             mask.sum(), ro.lengths.sum(), ro.stopped.sum(), ro.attention_mask.sum(),
             *(v * B for v in rstats.values())], rt)
        n_all, B_all = len(lengths_all) // G, share.total
        self.zero_std_streak = self.zero_std_streak + 1 if n_zero == n_all else 0
        if self.zero_std_streak >= cfg.max_zero_std_steps:
            raise QualityGateError(
                f"grpo: quality gate failed: no informative group (every group's rewards were equal) for"
                f" {self.zero_std_streak} consecutive steps up to step {step + 1} (grpo.max_zero_std_steps="
                f"{cfg.max_zero_std_steps}); last mean reward {reward_sum / B_all:.3f}. The prompts are"
                f" too hard (or too easy) for this policy: use easier grpo.curriculum_levels, a longer"
                f" grpo.curriculum_steps, a larger grpo.group_size or a higher grpo.temperature")

        # 3. epochs of minibatch updates ----------------------------------------------------
        # Minibatches are a permutation of the global batch; this rank works on its rows of
        # each and scales its loss by its part of the minibatch's normaliser (`part`), so the
        # ranks' losses sum to the minibatch's loss. With beta = 0 a completion whose advantage
        # is 0 (its group had equal rewards) adds exactly nothing to the loss, so only the
        # others go through forward and backward, with the same normaliser.
        skip_zero = ref_lp is None
        stats = Mean()
        for epoch in range(cfg.epochs):
            g = step_generator(self.seed, f"minibatch-{epoch}", step)
            for idx in minibatches(len(trained), cfg.minibatch_size, g):
                idx = trained[idx].to(device)
                kept = idx[informative_all[idx]] if skip_zero else idx       # the rows with a loss, all ranks
                rows = share.local(kept)                                     # this rank's, local indices
                part = _normaliser_part(rows, idx, mask, lengths_all, cfg.loss_agg)
                if len(kept) == 0:  # a zero loss: AdamW still takes its (momentum) step, as on the full batch
                    loss = sum(p.sum() for p in updater.params) * 0.0
                    applied, gnorm = updater.minimize(loss)
                    stats.add(grad_norm=gnorm, skipped=float(not applied))
                    stats.add_share(loss=0.0, policy_loss=0.0)
                    continue
                if len(rows) == 0:  # none of the minibatch's rows is this rank's: it still joins the update
                    loss = sum(p.sum() for p in updater.params) * 0.0
                    pg, pst, kl_mb, tok_mb = 0.0, {"clip_ratio": 0.0, "approxkl": 0.0}, 0.0, 0.0
                else:
                    mb, m = ro.select(rows), mask[rows]
                    lp = response_forward(policy, mb, T).logprobs                 # (b, N)
                    a = adv[rows]                                                  # (b, N)
                    pg_tok, pst = ppo_policy_loss(lp, old_lp[rows], a, m, cfg.clip_epsilon)
                    per_tok = pg_tok
                    kl_mb = 0.0
                    if ref_lp is not None:
                        kl_tok = kl_estimate(lp, ref_lp[rows], "k3")               # (b, N), >= 0
                        per_tok = pg_tok + cfg.beta * kl_tok
                        kl_mb = masked_mean(kl_tok.detach(), m)
                    loss = aggregate(per_tok, m, cfg.loss_agg, max_len=cfg.max_new_tokens) * part
                    pg = part * aggregate(pg_tok.detach(), m, cfg.loss_agg, max_len=cfg.max_new_tokens)
                    tok_mb = float(lengths_all[kept].sum())
                applied, gnorm = updater.minimize(loss)
                # token-mean statistics: this rank's mean weighted by its share of the kept tokens
                w = float(mask[rows].sum()) / tok_mb if tok_mb else 0.0
                stats.add(grad_norm=gnorm, skipped=float(not applied))
                stats.add_share(policy_loss=pg, loss=loss.detach(), clip_ratio=w * pst["clip_ratio"],
                                approxkl=w * pst["approxkl"])
                if ref_lp is not None:
                    stats.add_share(kl=w * kl_mb)
        t3 = time.perf_counter()

        res = stats.result(rt)
        res.setdefault("kl", 0.0)  # beta = 0: no reference, KL not tracked in training
        for k in ("clip_ratio", "approxkl"):
            res.setdefault(k, 0.0)  # no informative completion this step: nothing was clipped
        # entropy of the sampling distribution, estimated by -log pi_old(a_t) of the sampled tokens
        # (unbiased, and free: no (B, N, V) softmax over all completions)
        res["entropy"] = ent_sum / max(n_resp, 1.0)
        return {"reward": reward_sum / B_all, "reward_std": std_sum / n_all,
                "frac_reward_zero_std": n_zero / n_all, "groups_trained": len(trained) / G, **res,
                "response_length": len_sum / B_all, "stop_rate": stop_sum / B_all,
                **{k: v / B_all for k, v in zip(rstats, rvals)}, "rollout_s": t1 - t0, "scoring_s": t2 - t1,
                "update_s": t3 - t2, "tokens_per_s": n_tokens / (t3 - t0)}


def first_informative_groups(zero_std: Tensor, k: int, group_size: int) -> Tensor:
    """The rows of the first k groups (in draw order) whose rewards differ, given each group's
    zero-variance flag (n_groups,): dynamic sampling's batch, as global row indices."""
    groups = (~zero_std.bool()).nonzero().flatten()[:k]                   # (<= k,)
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()


def _normaliser_part(rows: Tensor, idx: Tensor, mask: Tensor, lengths_all: Tensor, loss_agg: str) -> float:
    """This rank's `rows` share of minibatch `idx`'s loss normaliser (all ranks' parts sum to the
    normaliser's share that the kept rows carry): for grpo and dr_grpo the sequences, for dapo
    the response tokens. `aggregate` over `rows` times this part is the rows' share of the
    minibatch's loss; in one process with every row kept it is exactly 1."""
    if loss_agg == "dapo":
        return float(mask[rows].sum()) / max(float(lengths_all[idx].sum()), 1.0)
    return len(rows) / len(idx) if len(idx) else 0.0  # no row at all: dynamic sampling found no group
