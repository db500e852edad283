"""GRPO: group-relative policy optimisation, one group batch per step.

    algo = GRPO(policy, ref, cfg, prompts_fn=..., reward_fn=..., stop_ids=(tok.end_id,), pad_id=tok.pad_id, seed=s)
    llm.post.rl.finish_rl_stage(setup, algo, cfg, rt, ...)    # runs llm.train.loop.run_loop

No value function: the baseline is the group. One step:

  1. rollout: prompts_per_step prompts (oversample times as many with dynamic sampling), each
     repeated group_size (G) times, sampled in one batch with the KV cache; the behaviour
     log-probs recorded by the sampler are the "old" log-probs of the ratio
     (tests/test_rollout.py: they equal a recomputed forward in fp32; under bf16/fp16 autocast
     they are recomputed by one no_grad forward instead);
  2. scoring: reward per completion (the verifier), advantages
     A = (r - mean_group) / (std_group + 1e-4), exactly 0 for a group whose rewards are all
     equal (llm.nn.losses.group_advantages; counted in frac_reward_zero_std), the same for every
     token of a completion; with `step_credit` > 0, plus step_credit x the verifier's credit of
     each token (+1 on the result of a right worked step, -1 on a slip: llm.sample.rewards.step_credit),
     a process-level signal that says where an answer went wrong. With `reward_control`
     shuffled (a control), the step's rewards are first permuted at random across all its
     samples (`shuffled_rewards`) and step credit is left out: the advantages then have the
     real reward's scale and noise but say nothing about which answer is right; the
     accuracy logged is still the real one. The reference
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
max_zero_std_steps consecutive steps, nothing is being learned (all wrong or all right):
`stalled()` ends the run (llm.train.loop.run_loop's stop_early) and `zero_std_gate` fails it at the
stage's end (llm/train/finish.py: the numbers in failed_metrics.json, no model written).

Per-step row (TRL names): reward, reward_std (mean within-group std, as TRL), frac_reward_zero_std,
kl (mean per-token k3 under the current policy), entropy (of the sampling distribution, estimated
as the mean -log pi_old of the sampled tokens), clip_ratio and approxkl (over the completions that
went through the update), policy_loss, loss, grad_norm, response_length, stop_rate, accuracy /
format_rate (verifier statistics), groups_trained (the groups step 3 saw: prompts_per_step, or
fewer under dynamic sampling), rollout_s / scoring_s / update_s, tokens_per_s.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from llm.config import GRPOConfig
from llm.nn.losses import aggregate, group_advantages, kl_estimate, masked_mean, ppo_policy_loss
from llm.post.shares import Shares, rollout_stats, step_generator, update_epochs
from llm.runtime import Runtime
from llm.sample.rewards import RewardFn, step_credit
from llm.sample.rollout import Rollout, response_forward, rollout
from llm.train.finish import Gate
from llm.train.loop import Updater

PromptsFn = Callable[[int], tuple[list[list[int]], list[dict]]]


class Scored(NamedTuple):
    """A step's rollouts (this rank's rows) with what its update needs of them, each (B, N)."""
    ro: Rollout
    mask: Tensor            # response tokens
    old_lp: Tensor          # log pi_old of the sampled tokens
    ref_lp: Tensor | None   # log ref of them (None when beta = 0)
    adv: Tensor             # the advantage of each token

# the statistics of step 3 (TRL's names); "kl" too when beta > 0
STATS = ("policy_loss", "loss", "clip_ratio", "approxkl")


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
        cfg, policy, G = self.cfg, self.model, self.cfg.group_size
        device = next(policy.parameters()).device

        # 1. rollout: every prompt G times; this rank's share of the groups (the global list is
        #    the same on every rank)
        t0 = time.perf_counter()
        prompts, problems = self.prompts_fn(step)
        share = Shares.of(len(prompts), G, self.rt)                         # rows [lo, hi) of B_all = n_all * G
        prompts, problems = prompts[share.lo // G:share.hi // G], problems[share.lo // G:share.hi // G]
        ro = rollout(policy, [p for p in prompts for _ in range(G)], max_new_tokens=cfg.max_new_tokens,
                     temperature=cfg.temperature, stop_ids=self.stop_ids, pad_id=self.pad_id,
                     generator=step_generator(self.seed, "rollout", step, device),
                     row_offset=share.lo, total_rows=share.total)
        t1 = time.perf_counter()

        # 2. scoring: a reward per completion, group-relative advantages (plus step credit), the
        #    old and the reference log-probs
        rewards, rstats = self.reward_fn(ro, [p for p in problems for _ in range(G)])   # (B,)
        if cfg.reward_control == "shuffled":  # the control: the same rewards, given to random samples
            rewards = self.shuffled(share, rewards, step)
        adv, zero_std = group_advantages(rewards.float().view(len(prompts), G))   # (n, G), (n,)
        batch = self.scored(ro, adv)
        # the rows step 3 trains on (dynamic sampling: those of the first informative groups),
        # and with beta = 0 the rows that carry a loss (a nonzero advantage somewhere)
        trained = torch.arange(share.total)
        if cfg.oversample > 1:
            trained = first_informative_groups(share.gather(zero_std), cfg.prompts_per_step, G)
        informative = share.gather((batch.adv != 0).any(1)).to(device) if batch.ref_lp is None else None
        lengths = share.gather(ro.lengths).to(device).float()              # (B_all,)
        t2 = time.perf_counter()
        row, entropy, rollouts, n_tokens = self.rollout_numbers(share, ro, rewards, zero_std, rstats, step)

        # 3. epochs of minibatch updates of clipped surrogate + beta * k3
        stat_keys = STATS + (("kl",) if batch.ref_lp is not None else ())
        stats = update_epochs(updater, share, trained, partial(self.minibatch_loss, batch, lengths),
                              lengths=lengths, epochs=cfg.epochs, minibatch_size=cfg.minibatch_size, seed=self.seed,
                              step=step, device=device, stat_keys=stat_keys, carries_loss=informative)
        t3 = time.perf_counter()

        for k in ("kl", "clip_ratio", "approxkl"):
            stats.setdefault(k, 0.0)  # beta = 0: KL not tracked; no informative completion: nothing clipped
        return {**row, "groups_trained": len(trained) / G, **stats, "entropy": entropy, **rollouts,
                "rollout_s": t1 - t0, "scoring_s": t2 - t1, "update_s": t3 - t2, "tokens_per_s": n_tokens / (t3 - t0)}

    def scored(self, ro: Rollout, adv: Tensor) -> Scored:
        """Step 2's per-token advantages and log-probs of this rank's rollouts."""
        cfg, device = self.cfg, next(self.model.parameters()).device
        mask = ro.response_mask                                             # (B, N)
        B = len(ro)
        # per token: the group-relative outcome advantage, plus the verifier's step credit
        # (+1 on right step results, -1 on a slip) when grpo.step_credit > 0
        adv = adv.reshape(B, 1).expand(B, mask.shape[1]).to(device)         # (B, N)
        if cfg.step_credit > 0 and cfg.reward_control == "none":  # the control keeps no trace of correctness
            adv = adv + cfg.step_credit * step_credit(self.tokenizer, ro).to(device)
        old_lp = ro.logprobs                                                # (B, N) behaviour log-probs
        ref_lp = None
        with torch.no_grad():
            if torch.is_autocast_enabled(device.type):
                # bf16/fp16: decode-step and full-sequence numerics differ by ~1e-2, so take the
                # ratio's denominator from the same kind of forward as its numerator
                old_lp = response_forward(self.model, ro, cfg.temperature).logprobs
            if cfg.beta > 0:
                ref_lp = response_forward(self.ref, ro, cfg.temperature).logprobs   # (B, N)
        return Scored(ro, mask, old_lp, ref_lp, adv)

    def shuffled(self, share: Shares, rewards: Tensor, step: int) -> Tensor:
        """This rank's rows of the step's rewards permuted across all its samples (every rank's,
        so the permutation is one process's), seeded by (seed, step): grpo.reward_control shuffled."""
        everyone = share.gather(rewards)                                    # (B_all,)
        mixed = shuffled_rewards(everyone, step_generator(self.seed, "reward_control", step))
        return mixed[share.lo:share.hi].to(rewards.device, rewards.dtype)   # (B,)

    def rollout_numbers(self, share: Shares, ro: Rollout, rewards: Tensor, zero_std: Tensor, rstats: dict,
                        step: int) -> tuple[dict, float, dict, float]:
        """The rollouts' numbers on the global batch (the row's reward columns, the entropy, llm.post.shares.
        rollout_stats' row and token count); counts the steps in a row whose groups' rewards are all equal."""
        G = self.cfg.group_size
        reward_sum, std_sum, n_zero, ent_sum, n_resp = share.sums(
            rewards.double().sum(), rewards.float().view(-1, G).std(dim=1).sum(), zero_std.sum(),
            (-ro.logprobs * ro.response_mask).sum(), ro.response_mask.sum())
        n_all, B_all = share.total // G, share.total
        self.zero_std_streak = self.zero_std_streak + 1 if n_zero == n_all else 0
        rollouts, n_tokens = rollout_stats(share, ro, rstats)
        row = {"reward": reward_sum / B_all, "reward_std": std_sum / n_all, "frac_reward_zero_std": n_zero / n_all}
        # entropy of the sampling distribution, estimated by -log pi_old(a_t) of the sampled tokens
        # (unbiased, and free: no (B, N, V) softmax over all completions)
        return row, ent_sum / max(n_resp, 1.0), rollouts, n_tokens

    def stalled(self) -> bool:
        """Every group's rewards equal for max_zero_std_steps steps in a row: the run learns nothing
        (the same on every rank: the count reads global sums)."""
        return self.zero_std_streak >= self.cfg.max_zero_std_steps

    def zero_std_gate(self, history: Sequence[dict]) -> Gate:
        """The quality gate of a `stalled` run, for llm.train.finish.finish_stage; `history` is the run's
        rows (llm.train.loop.LoopResult.history)."""
        last = history[-1] if history else {"step": 0, "reward": float("nan")}
        return Gate("consecutive steps with no informative group (every group's rewards equal)",
                    self.zero_std_streak, "under", "grpo.max_zero_std_steps", self.cfg.max_zero_std_steps,
                    detail=f"up to step {last['step']}; last mean reward {last['reward']:.3f}",
                    advice="The prompts are too hard (or too easy) for this policy: use easier grpo.curriculum_levels,"
                           " a longer grpo.curriculum_steps, a larger grpo.group_size or a higher grpo.temperature")

    def minibatch_loss(self, b: Scored, lengths: Tensor, rows: Tensor, idx: Tensor, w: float) -> tuple[Tensor, dict]:
        """Step 3 on this rank's `rows` of minibatch `idx`: the per-token loss aggregated by loss_agg,
        times this rank's part of the minibatch's normaliser (the ranks' losses sum to the
        minibatch's); the token-mean statistics times `w` (llm.post.shares.update_epochs)."""
        cfg, m = self.cfg, b.mask[rows]
        part = _normaliser_part(rows, idx, b.mask, lengths, cfg.loss_agg)
        lp = response_forward(self.model, b.ro.select(rows), cfg.temperature).logprobs   # (b, N)
        pg_tok, pst = ppo_policy_loss(lp, b.old_lp[rows], b.adv[rows], m, cfg.clip_epsilon)
        per_tok, stats = pg_tok, {}
        if b.ref_lp is not None:
            kl_tok = kl_estimate(lp, b.ref_lp[rows], "k3")                  # (b, N), >= 0
            per_tok = pg_tok + cfg.beta * kl_tok
            stats["kl"] = w * masked_mean(kl_tok.detach(), m)
        loss = aggregate(per_tok, m, cfg.loss_agg, max_len=cfg.max_new_tokens) * part
        pg = part * aggregate(pg_tok.detach(), m, cfg.loss_agg, max_len=cfg.max_new_tokens)
        return loss, {"policy_loss": pg, "loss": loss.detach(), "clip_ratio": w * pst["clip_ratio"],
                      "approxkl": w * pst["approxkl"], **stats}


def shuffled_rewards(rewards: Tensor, generator: torch.Generator) -> Tensor:
    """`rewards` (n,) in a random order: the same values, so the same mean and spread, but none
    tied to the answer it was earned by (a control that tells what the reward's information,
    rather than its scale and noise, does to the policy)."""
    return rewards[torch.randperm(len(rewards), generator=generator)]


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
