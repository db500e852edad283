"""GRPO: group-relative policy optimisation, one group batch per step.

    algo = GRPO(policy, ref, cfg, prompts_fn=..., reward_fn=..., stop_ids=(tok.end_id,), pad_id=tok.pad_id, seed=s)
    llm.rl.finish_rl_stage(setup, algo, cfg, rt, ...)    # runs llm.loop.run_loop

No value function: the baseline is the group. One step:

  1. rollout: prompts_per_step prompts, each repeated group_size (G) times, sampled in one
     batch with the KV cache; the behaviour log-probs recorded by the sampler are the
     "old" log-probs of the ratio (tests/test_rollout.py: they equal a recomputed forward in
     fp32; under bf16/fp16 autocast they are recomputed by one no_grad forward instead);
  2. scoring: reward per completion (the verifier), advantages
     A = (r - mean_group) / (std_group + 1e-4), exactly 0 for a group whose rewards are all
     equal (llm.losses.group_advantages; counted in frac_reward_zero_std), the same for every
     token of a completion; with `step_credit` > 0, plus step_credit x the verifier's credit of
     each token (+1 on the result of a right worked step, -1 on a slip: llm.rewards.step_credit),
     a process-level signal that says where an answer went wrong; the reference
     log-probs from one no_grad forward of the frozen SFT model (skipped when beta = 0);
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
format_rate (verifier statistics), rollout_s / scoring_s / update_s, tokens_per_s.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import nn

from llm.config import GRPOConfig
from llm.losses import aggregate, group_advantages, kl_estimate, masked_mean, ppo_policy_loss
from llm.errors import QualityGateError
from llm.loop import Updater
from llm.rewards import RewardFn, step_credit
from llm.rl import Mean, minibatches, step_generator
from llm.rollout import response_forward, rollout

PromptsFn = Callable[[int], tuple[list[list[int]], list[dict]]]


class GRPO:
    def __init__(self, policy: nn.Module, ref: nn.Module | None, cfg: GRPOConfig, *, prompts_fn: PromptsFn,
                 reward_fn: RewardFn, stop_ids: Sequence[int], pad_id: int, seed: int, tokenizer=None):
        if cfg.beta > 0 and ref is None:
            raise ValueError("GRPO: beta > 0 needs a reference model")
        if cfg.step_credit > 0 and tokenizer is None:
            raise ValueError("GRPO: step_credit > 0 needs the tokenizer (to find each step's result tokens)")
        self.model, self.ref, self.cfg, self.tokenizer = policy, ref, cfg, tokenizer
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
        cfg, policy = self.cfg, self.model
        device = next(policy.parameters()).device
        T, G = cfg.temperature, cfg.group_size

        # 1. rollout: every prompt G times ------------------------------------------------
        t0 = time.perf_counter()
        prompts, problems = self.prompts_fn(step)
        n = len(prompts)
        ro = rollout(policy, [p for p in prompts for _ in range(G)], max_new_tokens=cfg.max_new_tokens,
                     temperature=T, stop_ids=self.stop_ids, pad_id=self.pad_id,
                     generator=step_generator(self.seed, "rollout", step, device))
        t1 = time.perf_counter()

        # 2. scoring ---------------------------------------------------------------------
        mask = ro.response_mask                                             # (B, N), B = n * G
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
        t2 = time.perf_counter()

        frac_zero = float(zero_std.float().mean())
        self.zero_std_streak = self.zero_std_streak + 1 if bool(zero_std.all()) else 0
        if self.zero_std_streak >= cfg.max_zero_std_steps:
            raise QualityGateError(
                f"grpo: quality gate failed: no informative group (every group's rewards were equal) for"
                f" {self.zero_std_streak} consecutive steps up to step {step + 1} (grpo.max_zero_std_steps="
                f"{cfg.max_zero_std_steps}); last mean reward {float(rewards.mean()):.3f}. The prompts are"
                f" too hard (or too easy) for this policy: use easier grpo.curriculum_levels, a longer"
                f" grpo.curriculum_steps, a larger grpo.group_size or a higher grpo.temperature")

        # 3. epochs of minibatch updates ----------------------------------------------------
        # With beta = 0 a completion whose advantage is 0 (its group had equal rewards) adds
        # exactly nothing to the loss, so only the others go through forward and backward;
        # `share` rescales the minibatch loss to what the full minibatch would have given.
        skip_zero = ref_lp is None
        stats = Mean()
        for epoch in range(cfg.epochs):
            g = step_generator(self.seed, f"minibatch-{epoch}", step)
            for idx in minibatches(B, cfg.minibatch_size, g):
                idx = idx.to(device)
                rows, share = idx, 1.0
                if skip_zero:
                    rows = idx[(adv[idx] != 0).any(1)]
                    if cfg.loss_agg == "dapo":
                        share = float(mask[rows].sum()) / max(float(mask[idx].sum()), 1.0)
                    else:
                        share = len(rows) / len(idx)
                if len(rows) == 0:  # a zero loss: AdamW still takes its (momentum) step, as on the full batch
                    loss = sum(p.sum() for p in updater.params) * 0.0
                    applied, gnorm = updater.minimize(loss)
                    stats.add(loss=0.0, policy_loss=0.0, grad_norm=gnorm, skipped=float(not applied))
                    continue
                mb, m = ro.select(rows), mask[rows]
                lp = response_forward(policy, mb, T).logprobs                 # (b, N)
                a = adv[rows]                                                  # (b, N)
                pg_tok, pst = ppo_policy_loss(lp, old_lp[rows], a, m, cfg.clip_epsilon)
                per_tok = pg_tok
                if ref_lp is not None:
                    kl_tok = kl_estimate(lp, ref_lp[rows], "k3")               # (b, N), >= 0
                    per_tok = pg_tok + cfg.beta * kl_tok
                    stats.add(kl=masked_mean(kl_tok.detach(), m))
                loss = aggregate(per_tok, m, cfg.loss_agg, max_len=cfg.max_new_tokens) * share
                applied, gnorm = updater.minimize(loss)
                pg = aggregate(pg_tok.detach(), m, cfg.loss_agg, max_len=cfg.max_new_tokens)
                stats.add(policy_loss=share * pg,
                          clip_ratio=pst["clip_ratio"], approxkl=pst["approxkl"], loss=loss.detach(),
                          grad_norm=gnorm, skipped=float(not applied))
        t3 = time.perf_counter()

        res = stats.result()
        res.setdefault("kl", 0.0)  # beta = 0: no reference, KL not tracked in training
        for k in ("clip_ratio", "approxkl"):
            res.setdefault(k, 0.0)  # no informative completion this step: nothing was clipped
        # entropy of the sampling distribution, estimated by -log pi_old(a_t) of the sampled tokens
        # (unbiased, and free: no (B, N, V) softmax over all completions)
        res["entropy"] = float(masked_mean(-ro.logprobs, mask))
        n_tokens = int(ro.attention_mask.sum())
        return {"reward": float(rewards.mean()), "reward_std": float(grouped.std(dim=1).mean()),
                "frac_reward_zero_std": frac_zero, **res,
                "response_length": float(ro.lengths.float().mean()), "stop_rate": float(ro.stopped.float().mean()),
                **rstats, "rollout_s": t1 - t0, "scoring_s": t2 - t1, "update_s": t3 - t2,
                "tokens_per_s": n_tokens / (t3 - t0)}
