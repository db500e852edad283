"""Stage `ppo`: PPO of the SFT model against a reward model or the math verifier.

    dvc repro ppo        (dvc.yaml passes the paths: `python -m stages.ppo --help`)

Reads the `common` and `ppo` sections of params.yaml and

    --sft     the policy's starting point (a value head is added on its trunk) and the frozen reference
    --rm      the reward model (a model directory with a "reward" head), used when
              ppo.reward_source is rm, or rm+verifier (its score plus the verifier's reward,
              llm.sample.rewards.rm_verifier_reward)
    --data    train.jsonl: math problems whose questions are the rollout prompts (ppo.levels);
              val.jsonl: held-out problems (the first ppo.eval_problems)
    --continuation  passages to continue (prepare's continue/): train.jsonl, a
              ppo.continuation_share of each step's prompts, rewarded by the reward model alone;
              test.jsonl, the first ppo.continuation_eval measured at every evaluation with the
              gold judge (llm/sample/gold.py), which never rewards the policy. Read only when those
              keys are above 0.
    --sft-data  SFT's cleaned conversations (train.jsonl, the clean_sft stage's): with ppo.ptx_coef
              above 0, every minibatch adds ppo.ptx_coef times the supervised loss on
              ppo.minibatch_size of them (InstructGPT's PPO-ptx), so that PPO on passages does not
              wear away the math and the tasks SFT taught. Read only then.

Each step samples ppo.rollout_prompts prompts, one response each, scores them (RM or verifier),
adds the per-token KL penalty (ppo.kl_estimator, coefficient from the adaptive KL controller),
runs GAE and ppo.epochs passes of clipped-surrogate + clipped-value + entropy updates over
minibatches (llm/post/ppo.py). A KL outside [kl_alert_low, kl_alert_high] is reported as an ALERT.
With `common.nproc` > 1 it runs under torchrun: each rank rolls out and scores a share of
the prompts, and the trajectory is one process's up to the order of float sums (llm/post/shares.py).
Held-out exact match (greedy), held-out reward (sampled responses scored the same way) and KL
to the reference are measured before the first step, every ppo.eval_every steps and at the end;
with ppo.continuation_eval also, on held-out passages, the gold judge's mean score of the policy's
continuations, the reward model's, the win rate against the reference's continuation of the same
passage (by the gold judge) and the KL there: along the run, the over-optimisation curve.

`--variant ppo_rm` (dvc.yaml's stage ppo_rm) runs it as `ppo_rm` with ppo.reward_source forced to
rm, no KL penalty (init_kl_coef 0, adaptive_kl off) and no supervised term (ptx_coef 0), everything
else from the `ppo` section (the same seed, so the same prompts), for ppo.overopt_steps steps where
that is set (0: ppo.max_steps): the reward model alone, the proxy that the over-optimisation curve
of the report sets against the gold (the verifier's accuracy of the same rollouts; on held-out
passages, the gold judge) along the KL to SFT, measured and not penalised, as in Gao, Schulman and
Hilton's runs. A penalty would stop the policy where the penalty balances the reward (an adaptive
one pulls it back once the KL passes its target), and the curve would show the penalty, not where
the gold stops following the proxy; for the same reason it has no KL gate (max_kl forced to 1e6,
"no limit"): without a penalty its KL on held-out math prompts is what it measures, and it has gone
from 0.04 to 0.47 nats/token between seeds. Its metrics and meta.json record the variant and what
it forces; the forced values are in its fingerprint.

Quality gate (the stage exits 1 with a message and writes no model): final held-out KL above
ppo.max_kl (ppo_rm: none).

Writes the PPO model directory (LM and value heads), its metrics (reward and exact match at
start vs end, `reward_trend`: the change of the line fitted to every step's reward with its 95%
interval, final KL, KL coefficient, alerts, time split), the curves
(ppo{.tsv,_val.tsv,.png}) and the run directory (checkpoints and TensorBoard events; a
persisted DVC out, so a killed run resumes).
"""
from __future__ import annotations

import sys
from pathlib import Path

from llm.config import CommonConfig, PPOConfig, fingerprint
from llm.data.batching import derive_seed
from llm.runtime import Runtime
from llm.fileio import sha256_file
from llm.stage import training_outputs

STAGE = "ppo"
INPUTS = {"sft": "the SFT model directory (the policy's start and the frozen reference)",
          "rm": "the reward model directory (read when ppo.reward_source uses it)",
          "data": "math problems: train.jsonl (rollout prompts), val.jsonl (held out)",
          "continuation": "passages to continue: train.jsonl (rollout prompts), test.jsonl (held out)",
          "sft_data": "SFT's conversations (train.jsonl), trained on beside PPO when ppo.ptx_coef > 0"}
OUTPUTS = training_outputs("the PPO model directory")
# name: the keys of the ppo section it forces
VARIANTS = {"ppo_rm": {"reward_source": "rm", "init_kl_coef": 0.0, "adaptive_kl": False, "max_kl": 1e6,
                       "ptx_coef": 0.0}}


def run(common: CommonConfig, cfg: PPOConfig, rt: Runtime, *, sft: Path, rm: Path, data: Path, run_dir: Path,
        model: Path, metrics: Path, plots: Path, continuation: Path | None = None, sft_data: Path | None = None,
        progress: bool = True, name: str = STAGE) -> dict:
    import dataclasses

    from llm.post.ppo import PPO
    from llm.post.rl import finish_rl_stage, setup_rl_stage
    from llm.post.shares import step_generator

    if name == "ppo_rm" and cfg.overopt_steps:   # the over-optimisation run goes on past ppo's steps
        cfg = dataclasses.replace(cfg, max_steps=cfg.overopt_steps)

    setup = setup_rl_stage(name, common, cfg, rt.device, sft=sft, data=data, levels=(cfg.levels,),
                           reward_source=cfg.reward_source, rm=rm, section=STAGE, overrides=VARIANTS.get(name),
                           continuation=continuation, continuation_share=cfg.continuation_share,
                           continuation_eval=cfg.continuation_eval)
    policy, tok = setup.policy, setup.tokenizer
    policy.add_head("value", seed=derive_seed(setup.seed, "value_head"))
    source = {"rm": f"the reward model {rm}", "verifier": "the verifier",
              "rm+verifier": f"the reward model {rm} plus the verifier"}[cfg.reward_source]
    n_passages = round(cfg.continuation_share * cfg.rollout_prompts)
    if rt.is_main:
        mixed = (f"; {n_passages} of {cfg.rollout_prompts} prompts a step are passages to continue, rewarded by"
                 f" the reward model alone" if n_passages else "")
        print(f"{name}: reward from {source}{mixed};"
              f" {setup.train_problems} train problems ({setup.pool.dropped} too long), {len(setup.val)}"
              f" held-out; {policy.summary()}; {rt.world_size} process(es)", flush=True)

    def prompts_fn(step: int):
        n_math = cfg.rollout_prompts - n_passages
        ids, problems = (setup.pool.sample(n_math, cfg.levels, step_generator(setup.seed, "prompts", step))
                         if n_math else ([], []))
        if n_passages:
            more_ids, more = setup.passages.sample(n_passages, step_generator(setup.seed, "passages", step))
            ids, problems = ids + more_ids, problems + more
        return ids, problems

    ptx = None
    if cfg.ptx_coef > 0:
        ptx, n_conv = sft_batches(sft_data, tok, seq_len=policy.config.seq_len, batch_size=cfg.minibatch_size)
        setup.inputs["sft_data"] = sha256_file(sft_data / "train.jsonl")
        setup.fingerprint = fingerprint(common, cfg, setup.inputs)
        if rt.is_main:
            print(f"{name}: each minibatch adds {cfg.ptx_coef} x the supervised loss on {cfg.minibatch_size} of"
                  f" {n_conv} SFT conversations ({sft_data / 'train.jsonl'})", flush=True)
    algo = PPO(policy, setup.ref, cfg, prompts_fn=prompts_fn, reward_fn=setup.reward_fn,
               stop_ids=(tok.end_id, tok.eot_id), pad_id=tok.pad_id, seed=setup.seed,
               log=(lambda m: print(m, file=sys.stderr, flush=True)) if rt.is_main else (lambda m: None), rt=rt,
               ptx=ptx)
    return finish_rl_stage(setup, algo, cfg, rt, run_dir=run_dir, model=model, metrics=metrics,
                           plots=plots, progress=progress,
                           extra_metrics=lambda result: {"reward_source": cfg.reward_source,
                                                         "kl_coef_final": algo.kl_ctl.value,
                                                         "kl_alerts": algo.alert.alerts})


def sft_batches(sft_data: Path | None, tok, *, seq_len: int, batch_size: int):
    """(batch function, conversations): `batch(generator)` is batch_size of SFT's training
    conversations (sft_data/train.jsonl, rendered with the chat template, cut to seq_len), drawn
    uniformly with the generator, as SFT's loss sees them (loss on the assistant's tokens)."""
    import torch

    from llm.data.batching import pad_collate
    from llm.data.template import render_all
    from llm.fileio import DataError, read_jsonl

    if sft_data is None:
        raise ValueError("ppo.ptx_coef > 0 needs SFT's conversations (--sft-data: the clean_sft stage's output)")
    path = sft_data / "train.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; run `dvc repro clean_sft` first (ppo.ptx_coef > 0 reads it),"
                                f" or set ppo.ptx_coef: 0")
    examples, _ = render_all([row["messages"] for row in read_jsonl(path)], tok, seq_len + 1)
    if not examples:
        raise DataError(f"{path}: no conversation with an assistant token within {seq_len + 1} tokens;"
                        f" ppo.ptx_coef > 0 has nothing to train on")

    def batch(g):
        pick = torch.randint(len(examples), (batch_size,), generator=g).tolist()
        return pad_collate([examples[i][0] for i in pick], pad_id=tok.pad_id, loss_masks=[examples[i][1] for i in pick])
    return batch, len(examples)


def main(argv: list[str] | None = None) -> int:
    from llm.post.rl import rl_stage_main
    return rl_stage_main(STAGE, __doc__, run, argv, inputs=INPUTS, outputs=OUTPUTS, variants=VARIANTS)


if __name__ == "__main__":
    raise SystemExit(main())
