"""Stage `dpo`: direct preference optimisation of the SFT model on the generated pairs.

    dvc repro dpo        (dvc.yaml passes the paths: `python -m stages.dpo --help`)

Reads the `common` and `dpo` sections of params.yaml, the SFT model (the policy's
initialisation and the frozen reference) and the pairs of stage `pairs` ({train,val}.jsonl:
{"prompt", "chosen", "rejected", "kind", ...}).

The reference is the SFT model, frozen: its log-probs of every train and val answer
(llm/post/dpo.py: the sum over the answer tokens and the closing <|end|>; their mean for IPO) are
computed once up front and ride in the batches, so the training loop runs the policy only.
Loss `dpo.loss_type`: `sigmoid` = DPO `-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`,
with `dpo.label_smoothing` > 0 conservative DPO (cDPO); `ipo` = IPO. Trained with
llm/train/trainer.py (one batch = B pairs, weight B; checkpoints, resume, torchrun as everywhere).
`dpo.trainable` names the parameters that learn, as globs: ['*'] = all of them (the profiles');
['norm_f.weight'] trains only the final norm's gains (128 numbers on `tiny`), so DPO can rescale
the SFT model's output distribution (sharpen or flatten it, per feature) but cannot fit each
training pair; the other parameters stay as in SFT. The model written is the whole model either
way.

Metrics on every held-out pair (TRL's rewards/* named with `_` because `/` is awkward
in DVC metric paths): rewards_chosen, rewards_rejected (mean beta * (log pi - log ref)),
rewards_margin, rewards_accuracy (share of pairs with rewards_chosen > rewards_rejected), per
pair kind too. `ref_logp_accuracy` (also per kind) is the baseline to read them against:
the share of held-out pairs whose chosen answer the frozen SFT reference already finds more
likely (higher sequence log-prob), roughly what a policy that only sharpens SFT's
distribution scores. KL to SFT (`kl`): for the first `dpo.kl_prompts` unique held-out
prompts, one response per prompt is sampled from the policy at temperature 1 (up to
`dpo.max_new_tokens` tokens); kl is the mean over those response tokens of the exact per-token
KL(pi(. | context) || ref(. | context)) summed over the vocabulary (nats per token);
kl_seq is the mean per-response sum (llm.sample.rollout.sampled_kl).

Quality gate: kl above `dpo.max_kl` fails the stage with exit code 1 and the numbers;
then the model, the metrics and the plots are not written (the previous outputs stay; the
run's numbers are in <run dir>/failed_metrics.json).

Writes the DPO model directory, its metrics, the curves (dpo{.tsv,_val.tsv,.png}) and the run
directory (checkpoints; a persisted DVC out).
"""
from __future__ import annotations

import time
from pathlib import Path

from llm.config import CommonConfig, DPOConfig, fingerprint
from llm.data.batching import derive_seed
from llm.data.preference import fixed_pair_batches, load_pair_splits, pair_batches
from llm.fileio import sha256_tree
from llm.nn.optim import set_trainable
from llm.nn.reward_model import pair_metrics
from llm.post.dpo import dpo_loss_fn, dpo_metrics, reference_logprobs
from llm.runtime import Runtime, full_model_state, setup_runtime
from llm.sample.rollout import sampled_kl
from llm.stage import stage_main, training_outputs
from llm.train.finish import Gate, finish_stage, run_plots
from llm.train.trainer import train

STAGE = "dpo"
INPUTS = {"sft": "the SFT model directory (the policy's start and the frozen reference)",
          "data": "preference pairs: train.jsonl, val.jsonl"}
OUTPUTS = training_outputs("the DPO model directory")


def run(common: CommonConfig, cfg: DPOConfig, rt: Runtime, *, sft: Path, data: Path, run_dir: Path, model: Path,
        metrics: Path, plots: Path, progress: bool = True) -> dict | None:
    from llm.nn.artifacts import load_model_dir
    from llm.nn.model import GPT

    t_start = time.perf_counter()
    policy, tok, sft_meta = load_model_dir(sft, device="cpu", heads=("lm",))
    reference, _, _ = load_model_dir(sft, device=rt.device, heads=("lm",))
    reference.requires_grad_(False).eval()
    set_trainable(policy, cfg.trainable, f"{STAGE}.trainable")
    n_trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    seq_len = policy.config.seq_len
    pairs = load_pair_splits(data, tok, seq_len)
    train_pairs, val_pairs = pairs.train, pairs.val
    inputs = {"sft": sft_meta.get("fingerprint", ""), "data": sha256_tree(data)}
    fp = fingerprint(common, cfg, inputs)
    seed = derive_seed(common.seed, STAGE)

    # the frozen reference, once: (N,) log-probs of every chosen and rejected answer
    t0 = time.perf_counter()
    per_token = cfg.loss_type == "ipo"
    ref_train = reference_logprobs(reference, train_pairs, pad_id=tok.pad_id, batch_size=2 * cfg.batch_size,
                                   per_token=per_token, device=rt.device, autocast=rt.autocast)
    ref_val = reference_logprobs(reference, val_pairs, pad_id=tok.pad_id, batch_size=2 * cfg.batch_size,
                                 per_token=per_token, device=rt.device, autocast=rt.autocast)
    t_ref = time.perf_counter() - t0
    if rt.is_main:
        print(f"{STAGE}: {pairs.summary()}; reference log-probs in {t_ref:.1f}s; {policy.summary()};"
              f" training {n_trainable:,} of them ({STAGE}.trainable={cfg.trainable})", flush=True)
    batches = pair_batches(train_pairs, batch_size=cfg.batch_size, bucket_width=cfg.bucket_width, seed=seed,
                           pad_id=tok.pad_id, rank=rt.rank, world_size=rt.world_size, ref=ref_train)
    val_batches = fixed_pair_batches(val_pairs, batch_size=cfg.batch_size, pad_id=tok.pad_id,
                                     n_batches=cfg.eval_batches, ref=ref_val)
    result = train(policy, cfg, rt, stage=STAGE, seed=seed, batches=batches,
                   loss_fn=dpo_loss_fn(cfg.beta, cfg.loss_type, cfg.label_smoothing, full_head=cfg.compile),
                   val_batches=val_batches, run_dir=run_dir, fingerprint=fp, plots=run_plots(STAGE, run_dir),
                   progress=progress)

    state = full_model_state(policy, rt)
    if not rt.is_main:
        return None
    out_model = GPT(policy.config, seed=0)
    out_model.load_state_dict(state)
    out_model.to(rt.device).eval()

    held = dpo_metrics(out_model, val_pairs, ref_val, beta=cfg.beta, loss_type=cfg.loss_type,
                       label_smoothing=cfg.label_smoothing, pad_id=tok.pad_id, batch_size=2 * cfg.batch_size,
                       device=rt.device, autocast=rt.autocast)
    t0 = time.perf_counter()
    prompts = heldout_prompts(pairs, tok, seq_len)[:cfg.kl_prompts]
    with rt.autocast():
        kl = sampled_kl(out_model, reference, prompts, max_new_tokens=cfg.max_new_tokens, temperature=1.0,
                        stop_ids=(tok.end_id, tok.eot_id), pad_id=tok.pad_id,
                        seed=derive_seed(common.seed, STAGE, "kl"), batch_size=2 * cfg.batch_size)
    t_kl = time.perf_counter() - t0
    m = result.metrics
    # the baseline a policy that only sharpens SFT would reach: pairs whose chosen answer the
    # frozen reference itself finds more likely (sequence log-prob)
    base = pair_metrics(ref_val[0], ref_val[1], [p.kind for p in val_pairs])
    for kind, v in held["by_kind"].items():
        v["ref_logp_accuracy"] = base["by_kind"][kind]["accuracy"]
    out = {
        **{k: v for k, v in held.items() if k != "by_kind"},
        "ref_logp_accuracy": base["accuracy"],
        "kl": kl.per_token, "kl_seq": kl.per_sequence, "kl_tokens": kl.tokens, "kl_prompts": len(prompts),
        "max_kl": cfg.max_kl,
        "by_kind": held["by_kind"],
        "train_loss": m["train_loss"], "val_loss": m.get("val_loss"), "steps": m["steps"],
        "train_pairs": len(train_pairs), "dropped_too_long": pairs.dropped, "trainable_params": n_trainable,
        "tokens_seen": m["tokens_seen"], "tokens_per_s": m["tokens_per_s"], "train_time_s": m["train_time_s"],
        "num_threads": m["num_threads"],
        "threads_steps": m["threads_steps"],
        "reference_time_s": t_ref, "kl_time_s": t_kl, "nonfinite_skips": m["nonfinite_skips"],
        "stage_time_s": time.perf_counter() - t_start,
    }
    return finish_stage(STAGE, gates=[kl_gate(out, cfg)], run_dir=run_dir, model=model, weights=out_model.cpu(), tokenizer=tok,
                        meta={"stage": STAGE, "fingerprint": fp, "inputs": inputs, "parent": str(sft),
                              "steps": result.step},
                        plots=plots, metrics=metrics, numbers=out)


def kl_gate(m: dict, cfg: DPOConfig) -> Gate:
    """Quality gate: the policy drifted too far from the SFT model (metrics `m`: kl and its counts)."""
    return Gate("KL to the SFT model in nats/token", m["kl"], "max", "dpo.max_kl", cfg.max_kl,
                detail=f"on {m['kl_tokens']} sampled tokens of {m['kl_prompts']} held-out prompts; held-out"
                       f" rewards_accuracy {m['rewards_accuracy']:.3f}",
                advice="Raise dpo.beta, lower dpo.lr or dpo.max_steps, or raise dpo.max_kl if this drift is"
                       " intended")


def heldout_prompts(pairs, tok, seq_len: int) -> list[list[int]]:
    """The held-out pairs' prompts for the KL to the SFT model: unique, in file order, shorter than
    the context."""
    from llm.data.template import render_prompt

    prompts, seen = [], set()
    for i in pairs.val_kept:
        ids = tuple(render_prompt(pairs.val_records[i]["prompt"], tok))
        if ids not in seen and len(ids) < seq_len:
            seen.add(ids)
            prompts.append(list(ids))
    return prompts


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: DPOConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt, sft=args.sft, data=args.data, run_dir=args.run_dir, model=args.model,
                metrics=args.metrics, plots=args.plots, progress=not args.no_progress)
        if m is None:  # ranks > 0
            return None
        return (f"{STAGE}: held-out rewards_accuracy {m['rewards_accuracy']:.3f} on {m['n_pairs']} pairs"
                f" (the SFT reference's own log-probs rank {m['ref_logp_accuracy']:.3f} of them right),"
                f" margin {m['rewards_margin']:.3f}; KL to SFT {m['kl']:.4f} nats/token"
                f" (gate {cfg.max_kl}); wrote {args.model}/ and {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
