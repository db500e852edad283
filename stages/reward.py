"""Stage `reward`: the reward model, a scalar head on the SFT trunk trained on preference pairs.

    dvc repro reward        (dvc.yaml passes the paths: `python -m stages.reward --help`)

Reads the `common` and `reward` sections of params.yaml, the SFT model (trunk, LM head and
tokenizer) and preference pairs ({train,val}.jsonl: {"id", "prompt": [messages], "chosen",
"rejected", "kind"}).

The model is the SFT model plus a `Linear(n_embd, 1)` reward head read at the last real token
(llm/reward_model.py, right for any padding side). With `reward.logprob_feature` the reward also adds
a learned weight (starting at 1) times the mean log-probability the model's own LM head gives
the answer's tokens: a last-token head on a 4-layer trunk cannot re-check each `a op b = c` of
an answer, the next-token predictions at every step can (docs/log.md, reward model notes). With
`reward.train_trunk: false` only the head and that weight learn (a linear probe). Each answer
is rendered with the chat template as prompt + answer + <|end|>; pairs longer than the context
are dropped and counted. Loss:
Bradley-Terry `-log sigmoid(r_chosen - r_rejected - margin)` with labels smoothed by
`reward.label_smoothing`, trained with llm/trainer.py (one batch = B pairs, weight B;
checkpoints, resume, non-finite policy and `torchrun` as in every training stage).

After training, every held-out pair is scored: accuracy (r_chosen > r_rejected), mean margin,
reward mean/std of chosen and rejected, and the same per pair kind (wrong_answer,
broken_format, the task kinds). Quality gate: held-out accuracy below
`reward.min_accuracy` fails the stage with exit code 1 and the numbers; then neither the
model nor the metrics nor the plots are written (the previous outputs stay; the failed run's
metrics are in <run dir>/failed_metrics.json).

Writes the reward model directory (heads lm + reward [+ reward_logprob]; meta.json carries the
held-out reward mean/std for reward normalisation downstream), its metrics, the curves
(reward{.tsv,_val.tsv,.png}) and the run directory (checkpoints; a persisted DVC out).
"""
from __future__ import annotations

import time
from pathlib import Path

from llm.batching import derive_seed
from llm.chat import ROLE_TOKENS
from llm.config import CommonConfig, RewardConfig, fingerprint
from llm.fileio import sha256_tree
from llm.finish import Gate, finish_stage, run_plots
from llm.optim import set_trainable
from llm.preference import fixed_pair_batches, load_pair_splits, pair_batches, pair_metrics
from llm.reward_model import RewardModel, reward_loss_fn, score_sequences
from llm.runtime import Runtime, full_model_state, setup_runtime
from llm.stage import stage_main, training_outputs
from llm.trainer import train

STAGE = "reward"
INPUTS = {"sft": "the SFT model directory", "data": "preference pairs: train.jsonl, val.jsonl"}
OUTPUTS = training_outputs("the reward model directory")


def run(common: CommonConfig, cfg: RewardConfig, rt: Runtime, *, sft: Path, data: Path, run_dir: Path, model: Path,
        metrics: Path, plots: Path, progress: bool = True) -> dict | None:
    from llm.artifacts import load_model_dir
    from llm.model import GPT

    t0 = time.perf_counter()
    gpt, tok, sft_meta = load_model_dir(sft, device="cpu", heads=("lm",))
    gpt.add_head("reward", seed=derive_seed(common.seed, STAGE, "head"))
    if cfg.logprob_feature:
        gpt.add_head("reward_logprob", marker=tok.special[ROLE_TOKENS["assistant"]])
    pairs = load_pair_splits(data, tok, gpt.config.seq_len)
    train_pairs, val_pairs = pairs.train, pairs.val
    inputs = {"sft": sft_meta.get("fingerprint", ""), "data": sha256_tree(data)}
    fp = fingerprint(common, cfg, inputs)
    seed = derive_seed(common.seed, STAGE)
    batches = pair_batches(train_pairs, batch_size=cfg.batch_size, bucket_width=cfg.bucket_width, seed=seed,
                           pad_id=tok.pad_id, rank=rt.rank, world_size=rt.world_size)
    val_batches = fixed_pair_batches(val_pairs, batch_size=cfg.batch_size, pad_id=tok.pad_id,
                                     n_batches=cfg.eval_batches)
    if rt.is_main:
        print(f"{STAGE}: {pairs.summary()}; {gpt.summary()}", flush=True)

    if not cfg.train_trunk:  # a linear probe: the SFT trunk (and its LM head) stay as they are
        set_trainable(gpt, [f"{h}_head.*" for h in gpt.head_names if h.startswith("reward")], f"{STAGE}.train_trunk")
    rm = RewardModel(gpt)
    result = train(rm, cfg, rt, stage=STAGE, seed=seed, batches=batches,
                   loss_fn=reward_loss_fn(cfg.label_smoothing, cfg.margin), val_batches=val_batches,
                   run_dir=run_dir, fingerprint=fp,
                   plots=run_plots(STAGE, run_dir),
                   progress=progress)

    state = full_model_state(rm, rt)
    if not rt.is_main:
        return None
    out_model = GPT(gpt.config, heads=gpt.head_names, seed=0)
    out_model.load_state_dict({k.removeprefix("gpt."): v for k, v in state.items()})
    out_model.to(rt.device).eval()

    # every held-out pair, not only the eval_batches the loop watched
    seqs = [p.chosen for p in val_pairs] + [p.rejected for p in val_pairs]
    r = score_sequences(out_model, seqs, pad_id=tok.pad_id, batch_size=2 * cfg.batch_size, device=rt.device,
                        autocast=rt.autocast)
    n = len(val_pairs)
    held = pair_metrics(r[:n], r[n:], [p.kind for p in val_pairs])
    m = result.metrics
    out = {
        **{k: v for k, v in held.items() if k != "by_kind"},
        "min_accuracy": cfg.min_accuracy,
        "by_kind": held["by_kind"],
        "train_loss": m["train_loss"], "val_loss": m.get("val_loss"), "train_accuracy": _last(result, "accuracy"),
        "steps": m["steps"], "train_pairs": len(train_pairs), "dropped_too_long": pairs.dropped,
        "tokens_seen": m["tokens_seen"], "tokens_per_s": m["tokens_per_s"], "train_time_s": m["train_time_s"],
        "num_threads": m["num_threads"],
        "threads_steps": m["threads_steps"],
        "nonfinite_skips": m["nonfinite_skips"], "stage_time_s": time.perf_counter() - t0,
    }
    worst = sorted(held["by_kind"].items(), key=lambda kv: kv[1]["accuracy"])[:3]
    gate = Gate("held-out accuracy", held["accuracy"], "min", "reward.min_accuracy", cfg.min_accuracy,
                detail=f"on {n} pairs, margin {held['margin']:.3f}; weakest kinds: "
                       + ", ".join(f"{k} {v['accuracy']:.3f} (n={v['n']})" for k, v in worst),
                advice="Train longer (reward.max_steps), adjust reward.lr, or lower reward.min_accuracy if this"
                       " is expected")
    return finish_stage(STAGE, gates=[gate], run_dir=run_dir, model=model, weights=out_model.cpu(), tokenizer=tok,
                        meta={"stage": STAGE, "fingerprint": fp, "inputs": inputs, "parent": str(sft),
                              "steps": result.step,
                              "reward_stats": {"mean": held["reward_mean"], "std": held["reward_std"],
                                               "on": f"{data}/val.jsonl"}},
                        plots=plots, metrics=metrics, numbers=out)


def _last(result, key: str) -> float | None:
    """Mean of `key` over the last log_every-ish rows of the training history."""
    rows = [r[key] for r in result.train_history[-10:] if r.get(key) is not None]
    return sum(rows) / len(rows) if rows else None


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: RewardConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt, sft=args.sft, data=args.data, run_dir=args.run_dir, model=args.model,
                metrics=args.metrics, plots=args.plots, progress=not args.no_progress)
        if m is None:  # ranks > 0
            return None
        return (f"{STAGE}: held-out accuracy {m['accuracy']:.3f} on {m['n_pairs']} pairs"
                f" (gate {cfg.min_accuracy}), margin {m['margin']:.3f}; wrote {args.model}/ and {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
