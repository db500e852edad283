"""PPO for language models, one rollout batch per step.

    algo = PPO(policy, ref, cfg, prompts_fn=..., reward_fn=..., stop_ids=(tok.end_id,), pad_id=tok.pad_id, seed=s)
    llm.post.rl.finish_rl_stage(setup, algo, cfg, rt, ...)    # runs llm.train.loop.run_loop

The policy is the SFT model with a value head on the same trunk (`GPT.add_head("value")`);
the reference is a frozen copy of the SFT model. One step:

  1. rollout (llm/sample/rollout.py): rollout_prompts prompts, one sampled response each, KV cache,
     behaviour log-probs recorded;
  2. scoring, all under no_grad: one forward of the policy for the old log-probs and old
     values (V_t read at the state before response token t), one of the reference for its
     log-probs, and the score of each response (reward model or verifier);
  3. rewards per token: -kl_coef * KL_t with KL_t the k1 or k3 estimate of
     log pi_old(a_t) vs log ref(a_t), plus the score at the last response token (the stop
     token, or the last one generated when cut at max_new_tokens);
  4. GAE (gamma, lam) over response tokens -> advantages and returns; advantages whitened
     over the batch's response tokens;
  5. `epochs` passes over shuffled minibatches of minibatch_size rollouts, each one an
     optimizer step on
        policy_loss + vf_coef * value_loss - ent_coef * entropy
     with the clipped surrogate (clip_epsilon), the clipped value loss (value_clip), both
     token means (llm/nn/losses.py); with ptx_coef > 0 (InstructGPT's PPO-ptx) plus
        ptx_coef * the supervised loss on minibatch_size of SFT's training conversations,
     drawn afresh for each minibatch (`ptx`), so that what SFT taught and the reward does not
     ask for (math, when the reward is about verse) is trained on while PPO moves the rest;
  6. the adaptive KL controller sees this batch's mean per-token KL (KLController),
     and a KL outside [kl_alert_low, kl_alert_high] is reported (KLAlert); after the
     last step (cfg.max_steps), so is a KL that never reached that band.

Per-step row (TRL names where TRL has one): reward (mean score), reward_std, non_score_reward
(mean per-response KL penalty), kl (mean per-token), kl_seq, kl_coef, entropy, clip_ratio,
approxkl, policy_loss, value_loss, vf_clipfrac, ptx_loss (with ptx), loss, grad_norm, response_length,
stop_rate, accuracy / format_rate (verifier statistics of the rollouts, when known),
rollout_s / scoring_s / update_s, tokens_per_s.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from llm.config import PPOConfig
from llm.nn.losses import gae, kl_estimate, masked_mean, ppo_policy_loss, ppo_value_loss, whiten
from llm.post.shares import Shares, rollout_stats, step_generator, update_epochs
from llm.runtime import Runtime
from llm.sample.rewards import RewardFn
from llm.sample.rollout import Rollout, response_forward, rollout
from llm.train.loop import Updater
from llm.train.trainer import supervised_lm_loss

PromptsFn = Callable[[int], tuple[list[list[int]], list[dict]]]
PtxFn = Callable[[torch.Generator], dict[str, Tensor]]   # a batch of SFT conversations (llm/data/batching.py)


# ---------------------------------------------------------------------------
# KL control and alerts

class KLController:
    """The per-token KL penalty coefficient.

    Adaptive (Ziegler et al. 2019, as TRL's AdaptiveKLController): after each rollout batch
        coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon
    with n_steps the batch's number of rollouts. Fixed: coef stays init_kl_coef.
    """

    def __init__(self, init_kl_coef: float, *, adaptive: bool, target: float, horizon: int):
        if adaptive and target <= 0:
            raise ValueError(f"adaptive KL control needs kl_target > 0, got {target}")
        self.value, self.adaptive, self.target, self.horizon = init_kl_coef, adaptive, target, horizon

    def update(self, kl: float, n_steps: int) -> None:
        if not self.adaptive:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class KLAlert:
    """Reports when KL leaves [low, high].

    The KL checked is the mean of the last `window` steps, so one noisy batch near a bound
    does not flip the state back and forth. KL starts at 0 (policy = reference), so being
    below `low` is only an alert after KL has once been inside the band; above `high` is
    always one. Each change of side is reported once. `finish()` at the end of a run reports
    a KL that never reached the band at all (the policy barely left the reference).
    """

    def __init__(self, low: float, high: float, window: int = 5):
        self.low, self.high, self.window = low, high, window
        self.recent: list[float] = []
        self.side = "start"
        self.entered = False
        self.alerts = 0

    def check(self, kl: float, step: int) -> str | None:
        self.recent = (self.recent + [kl])[-self.window:]
        kl = sum(self.recent) / len(self.recent)
        side = "low" if kl < self.low else "high" if kl > self.high else "ok"
        msg = None
        if side == "ok":
            self.entered = True
        elif side != self.side and (side == "high" or self.entered):
            self.alerts += 1
            bound = f"above kl_alert_high={self.high}" if side == "high" else f"below kl_alert_low={self.low}"
            msg = f"ALERT step {step}: kl {kl:.4f} (mean of the last {len(self.recent)} steps) is {bound}"
        self.side = side
        return msg

    def finish(self, step: int) -> str | None:
        """After the last step: an alert if KL stayed below the band for the whole run."""
        if self.entered or self.side != "low":
            return None
        self.alerts += 1
        kl = sum(self.recent) / len(self.recent)
        return (f"ALERT step {step}: kl {kl:.4f} (mean of the last {len(self.recent)} steps) stayed below"
                f" kl_alert_low={self.low} for the whole run: the policy barely moved from the reference")

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "side": self.side, "entered": self.entered, "alerts": self.alerts}

    def load_state_dict(self, state: dict) -> None:
        self.recent = [float(x) for x in state["recent"]]
        self.side, self.entered, self.alerts = state["side"], bool(state["entered"]), int(state["alerts"])


# ---------------------------------------------------------------------------
# The algorithm

def token_rewards(score: Tensor, kl: Tensor, kl_coef: float, lengths: Tensor) -> Tensor:
    """Per-token rewards: -kl_coef * kl (B, N) everywhere, plus score (B,) at each row's last
    response token (index lengths - 1; every response has at least one token)."""
    rewards = -kl_coef * kl
    rows = torch.arange(len(score), device=score.device)
    rewards[rows, lengths - 1] += score
    return rewards


class Scored(NamedTuple):
    """A step's rollouts (this rank's rows) with what its update needs of them, each (B, N)."""
    ro: Rollout
    mask: Tensor        # response tokens
    old_lp: Tensor      # log pi_old of the sampled tokens, 0 off the responses
    old_values: Tensor  # V_old at the state before each response token, 0 off the responses
    adv: Tensor         # GAE advantages (whitened over the global batch)
    returns: Tensor     # the value targets

# the statistics of step 5, each a token mean over a minibatch (TRL's names)
STATS = ("policy_loss", "value_loss", "entropy", "clip_ratio", "approxkl", "vf_clipfrac", "loss")


class PPO:
    def __init__(self, policy: nn.Module, ref: nn.Module, cfg: PPOConfig, *, prompts_fn: PromptsFn,
                 reward_fn: RewardFn, stop_ids: Sequence[int], pad_id: int, seed: int,
                 log: Callable[[str], None] = print, rt: Runtime | None = None, ptx: PtxFn | None = None):
        if policy.value_head is None:
            raise ValueError("PPO: the policy needs a value head; call policy.add_head('value') first")
        self.model, self.ref, self.cfg, self.rt = policy, ref, cfg, rt
        if cfg.ptx_coef > 0 and ptx is None:
            raise ValueError("PPO: ptx_coef > 0 needs SFT's conversations (ptx, a batch function)")
        self.prompts_fn, self.reward_fn = prompts_fn, reward_fn
        self.ptx = ptx if cfg.ptx_coef > 0 else None
        self.stop_ids, self.pad_id, self.seed, self.log = tuple(stop_ids), pad_id, seed, log
        self.kl_ctl = KLController(cfg.init_kl_coef, adaptive=cfg.adaptive_kl, target=cfg.kl_target,
                                   horizon=cfg.kl_horizon)
        self.alert = KLAlert(cfg.kl_alert_low, cfg.kl_alert_high)
        ref.eval().requires_grad_(False)

    def state_dict(self) -> dict:
        return {"kl_ctl": self.kl_ctl.state_dict(), "alert": self.alert.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.alert.load_state_dict(state["alert"])

    def step(self, step: int, updater: Updater) -> dict[str, float]:
        cfg, policy, T = self.cfg, self.model, self.cfg.temperature
        device = next(policy.parameters()).device

        # 1. rollout: this rank's share of the step's prompts (the global list is the same on every rank)
        t0 = time.perf_counter()
        prompts, problems = self.prompts_fn(step)
        share = Shares.of(len(prompts), 1, self.rt)
        prompts, problems = prompts[share.lo:share.hi], problems[share.lo:share.hi]
        ro = rollout(policy, prompts, max_new_tokens=cfg.max_new_tokens, temperature=T, stop_ids=self.stop_ids,
                     pad_id=self.pad_id, generator=step_generator(self.seed, "rollout", step, device),
                     row_offset=share.lo, total_rows=share.total)
        t1 = time.perf_counter()

        mask = ro.response_mask                                             # (B, N)
        with torch.no_grad():
            # 2. scoring: old log-probs and values, the reference's log-probs, the score
            old = response_forward(policy, ro, T, values=True)
            ref_lp = response_forward(self.ref, ro, T).logprobs            # (B, N)
            score, rstats = self.reward_fn(ro, problems)                   # (B,)
            score = score.to(device)
            old_lp, old_values = old.logprobs.masked_fill(~mask, 0.0), old.values.masked_fill(~mask, 0.0)
            # 3. per-token rewards: KL penalty everywhere, the score at the last response token
            kl_tok = kl_estimate(old_lp, ref_lp, cfg.kl_estimator).masked_fill(~mask, 0.0)   # (B, N)
            kl_coef = self.kl_ctl.value
            rewards = token_rewards(score, kl_tok, kl_coef, ro.lengths)     # (B, N)
            # 4. GAE; advantages whitened over the global batch's response tokens
            adv, returns = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:
                adv = whiten(adv, mask, reduce=share.reduce)
        lengths = share.gather(ro.lengths).to(device).float()              # (B_all,)
        t2 = time.perf_counter()

        # 5. epochs of minibatch updates of clipped surrogate + clipped value loss - entropy bonus
        batch = Scored(ro, mask, old_lp, old_values, adv, returns)
        ptx_gen = step_generator(self.seed, "ptx", step) if self.ptx else None
        stats = update_epochs(updater, share, torch.arange(share.total),
                              partial(self.minibatch_loss, batch, ptx_gen=ptx_gen),
                              lengths=lengths, epochs=cfg.epochs, minibatch_size=cfg.minibatch_size, seed=self.seed,
                              step=step, device=device, stat_keys=STATS + (("ptx_loss",) if self.ptx else ()))
        t3 = time.perf_counter()

        # 6. KL control and alerts, on the global batch
        kl_sum, n_tok, kl_seq_sum, score_sum, score_sq = share.sums(
            kl_tok.double().sum(), mask.sum(), kl_tok.double().sum(1).sum(), score.double().sum(),
            (score.double() ** 2).sum())
        kl = kl_sum / max(n_tok, 1.0)
        self.kl_ctl.update(kl, n_steps=share.total)
        self.check_kl(kl, step)

        rollouts, n_tokens = rollout_stats(share, ro, rstats)
        B_all = share.total
        reward = score_sum / B_all
        reward_var = (score_sq - B_all * reward ** 2) / (B_all - 1) if B_all > 1 else 0.0
        return {"reward": reward, "reward_std": max(reward_var, 0.0) ** 0.5,
                "non_score_reward": -kl_coef * kl_seq_sum / B_all,
                "kl": kl, "kl_seq": kl_seq_sum / B_all, "kl_coef": kl_coef, **stats, **rollouts,
                "kl_alerts": self.alert.alerts, "rollout_s": t1 - t0, "scoring_s": t2 - t1, "update_s": t3 - t2,
                "tokens_per_s": n_tokens / (t3 - t0)}

    def minibatch_loss(self, b: Scored, rows: Tensor, idx: Tensor, w: float, *,
                       ptx_gen: torch.Generator | None = None) -> tuple[Tensor, dict]:
        """Step 5 on this rank's `rows` of one minibatch: policy_loss + vf_coef * value_loss -
        ent_coef * entropy, each a token mean over the rows times `w` (llm.post.shares.update_epochs),
        plus ptx_coef * ptx_loss (the supervised token mean on a batch of SFT's conversations drawn
        from `ptx_gen`, the same on every rank, times `w`) when ptx is on."""
        cfg, m = self.cfg, b.mask[rows]
        out = response_forward(self.model, b.ro.select(rows), cfg.temperature, values=True, entropy=True,
                               entropy_grad=cfg.ent_coef > 0)
        pg_tok, pst = ppo_policy_loss(out.logprobs, b.old_lp[rows], b.adv[rows], m, cfg.clip_epsilon)
        policy_loss = masked_mean(pg_tok, m) * w
        value_loss, vf_clipfrac = ppo_value_loss(out.values, b.old_values[rows], b.returns[rows], m, cfg.value_clip)
        value_loss = value_loss * w
        entropy = masked_mean(out.entropy, m) * w
        loss = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy
        extra = {}
        if self.ptx is not None:
            device = b.mask.device
            sft_batch = {k: v.to(device) for k, v in self.ptx(ptx_gen).items()}
            loss_sum, n_tok = supervised_lm_loss(self.model, sft_batch)
            ptx_loss = loss_sum / n_tok.clamp(min=1) * w
            loss = loss + cfg.ptx_coef * ptx_loss
            extra["ptx_loss"] = ptx_loss.detach()
        return loss, {"policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
                      "entropy": entropy.detach(), "clip_ratio": w * pst["clip_ratio"], "approxkl": w * pst["approxkl"],
                      "vf_clipfrac": w * vf_clipfrac, **extra, "loss": loss.detach()}

    def check_kl(self, kl: float, step: int) -> None:
        """Step 6's alerts: KL outside the band, and after the last step a KL that never reached it."""
        for msg in (self.alert.check(kl, step + 1),
                    self.alert.finish(step + 1) if step + 1 == self.cfg.max_steps else None):
            if msg:
                self.log(f"ppo: {msg}")
