"""Stage `reward`: the reward model, a scalar head on the SFT trunk trained on preference pairs.

    dvc repro reward        (dvc.yaml passes the paths: `python -m stages.reward --help`)

Reads the `common` and `reward` sections of params.yaml, the SFT model (trunk, LM head and
tokenizer), the comparisons of SFT's own answers that the samples stage labelled with the
verifier (data/samples/{train,val}.jsonl) and the generated preference pairs (a right worked
answer against a one-step slip or a broken format; {train,val}.jsonl: {"id", "prompt":
[messages], "chosen", "rejected", "kind"}).

Training pairs: every comparison of SFT's own answers, plus generated pairs making
`reward.generated_share` of the whole (drawn at random, seeded). The held-out pairs are the
comparisons of SFT's own answers to held-out prompts: what PPO asks of the reward model, any
two of the policy's answers to one problem. (Where SFT's samples never disagree the stage
warns and falls back to the generated pairs alone; `held_out_on` says which.)

The model is the SFT model plus a `Linear(n_embd, 1)` reward head read at the last real token
(llm/nn/reward_model.py, right for any padding side). With `reward.logprob_feature` the reward also adds
a learned weight (starting at 1) times the mean log-probability the model's own LM head gives
the answer's tokens. With `reward.train_trunk: false` only the head and that weight learn (a
linear probe). Each answer is rendered with the chat template as prompt + answer + <|end|>; pairs
longer than the context are dropped and counted. Loss: Bradley-Terry
`-log sigmoid(r_chosen - r_rejected - margin)` with labels smoothed by `reward.label_smoothing`,
trained with llm/train/trainer.py (one batch = B pairs, weight B; checkpoints, resume, non-finite
policy and `torchrun` as in every training stage).

After training, every held-out pair is scored: accuracy (r_chosen > r_rejected), mean margin,
reward mean/std of chosen and rejected, the same per kind (math, arithmetic, the task kinds,
continuation: the pairs the gold judge labelled),
and beside them what the SFT model's own likelihood ranks right on the same pairs
(`sft_likelihood_accuracy`, the baseline to beat), the accuracy with the likelihood feature
switched off (`accuracy_without_likelihood`: what the learned head ranks by itself) and the
accuracy on the generated pairs (`generated_accuracy`, `generated_by_kind`). Where the samples hold
continuations of passages (pairs.continuation_prompts), `continuation_spearman` is the rank
correlation of the reward model's score of each single continuation of the val-split passages
with the gold judge's (llm/post/continuation.py `agreement_on_samples`). Quality gate:
held-out accuracy on SFT's own answers below `reward.min_accuracy` fails the stage with exit
code 1 and the numbers; then neither the model nor the metrics nor the plots are written (the
previous outputs stay; the failed run's metrics are in <run dir>/failed_metrics.json).

Writes the reward model directory (heads lm + reward [+ reward_logprob]; meta.json carries the
held-out reward mean/std for reward normalisation downstream), its metrics, the curves
(reward{.tsv,_val.tsv,.png}) and the run directory (checkpoints; a persisted DVC out).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from llm.config import CommonConfig, RewardConfig, fingerprint
from llm.data.batching import derive_seed
from llm.data.preference import fixed_pair_batches, load_pair_splits, pair_batches
from llm.data.template import ROLE_TOKENS
from llm.fileio import sha256_tree
from llm.nn.optim import set_trainable
from llm.nn.reward_model import RewardModel, evaluate_pairs, reward_loss_fn
from llm.post.continuation import agreement_on_samples
from llm.runtime import Runtime, full_model_state, setup_runtime
from llm.stage import stage_main, training_outputs
from llm.train.finish import Gate, finish_stage, run_plots
from llm.train.trainer import train

STAGE = "reward"
INPUTS = {"sft": "the SFT model directory", "data": "generated preference pairs: train.jsonl, val.jsonl",
          "samples": "comparisons of the SFT model's own answers, labelled by the verifier (the samples stage)"}
OUTPUTS = training_outputs("the reward model directory")


def run(common: CommonConfig, cfg: RewardConfig, rt: Runtime, *, sft: Path, data: Path, samples: Path,
        run_dir: Path, model: Path, metrics: Path, plots: Path, progress: bool = True) -> dict | None:
    from llm.nn.artifacts import load_model_dir
    from llm.nn.model import GPT

    t0 = time.perf_counter()
    gpt, tok, sft_meta = load_model_dir(sft, device="cpu", heads=("lm",))
    gpt.add_head("reward", seed=derive_seed(common.seed, STAGE, "head"))
    if cfg.logprob_feature:
        gpt.add_head("reward_logprob", marker=tok.special[ROLE_TOKENS["assistant"]])
        if cfg.head_init == "zero":  # the reward starts as the likelihood; the head learns what improves on it
            torch.nn.init.zeros_(gpt.reward_head.weight)
            torch.nn.init.zeros_(gpt.reward_head.bias)
    generated = load_pair_splits(data, tok, gpt.config.seq_len)
    own = _load_own(samples, tok, gpt.config.seq_len)   # comparisons of SFT's own answers, or None
    if own is None:  # SFT's samples never disagreed where a verifier could tell (a weak model, or no verifier)
        print(f"{STAGE}: warning: no comparisons of SFT's own answers in {samples}; training and testing on the"
              f" generated pairs alone", flush=True)
        own = generated
        n_gen = 0
    else:
        n_gen = generated_count(cfg.generated_share, len(own.train), len(generated.train))
    rng = random.Random(derive_seed(common.seed, STAGE, "generated"))
    train_pairs = own.train + rng.sample(generated.train, n_gen)
    val_pairs = own.val  # the held-out comparisons of SFT's own answers: what the gate reads
    inputs = {"sft": sft_meta.get("fingerprint", ""), "data": sha256_tree(data), "samples": sha256_tree(samples)}
    fp = fingerprint(common, cfg, inputs)
    seed = derive_seed(common.seed, STAGE)
    batches = pair_batches(train_pairs, batch_size=cfg.batch_size, bucket_width=cfg.bucket_width, seed=seed,
                           pad_id=tok.pad_id, rank=rt.rank, world_size=rt.world_size)
    val_batches = fixed_pair_batches(val_pairs, batch_size=cfg.batch_size, pad_id=tok.pad_id,
                                     n_batches=cfg.eval_batches)
    if rt.is_main:
        print(f"{STAGE}: SFT's own answers {own.summary()}; generated {generated.summary()}, {n_gen} of them"
              f" trained on (reward.generated_share {cfg.generated_share}); {gpt.summary()}", flush=True)

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
    held = evaluate_pairs(out_model, val_pairs, sft_records=[own.val_records[i] for i in own.val_kept],
                          generated=generated.val, pad_id=tok.pad_id, batch_size=2 * cfg.batch_size,
                          device=rt.device, autocast=rt.autocast)
    out = {
        **{k: v for k, v in held.items() if k not in _BESIDE},
        "min_accuracy": cfg.min_accuracy,
        "held_out_on": "generated" if own is generated else "own",
        **{k: held[k] for k in _BESIDE},
        **agreement_on_samples(out_model, Path(samples) / "samples.jsonl", tok, batch_size=2 * cfg.batch_size,
                               device=rt.device, autocast=rt.autocast),
    }
    m = result.metrics
    out.update({
        "train_loss": m["train_loss"], "val_loss": m.get("val_loss"), "train_accuracy": _last(result, "accuracy"),
        "steps": m["steps"], "train_pairs": len(train_pairs), "train_pairs_own": len(own.train),
        "train_pairs_generated": n_gen, "dropped_too_long": own.dropped + generated.dropped,
        "tokens_seen": m["tokens_seen"], "tokens_per_s": m["tokens_per_s"], "train_time_s": m["train_time_s"],
        "num_threads": m["num_threads"],
        "threads_steps": m["threads_steps"],
        "nonfinite_skips": m["nonfinite_skips"], "stage_time_s": time.perf_counter() - t0,
    })
    return finish_stage(STAGE, gates=[_accuracy_gate(out, cfg)], run_dir=run_dir, model=model, weights=out_model.cpu(),
                        tokenizer=tok,
                        meta={"stage": STAGE, "fingerprint": fp, "inputs": inputs, "parent": str(sft),
                              "steps": result.step,
                              "reward_stats": {"mean": held["reward_mean"], "std": held["reward_std"],
                                               "on": f"{samples}/val.jsonl"}},
                        plots=plots, metrics=metrics, numbers=out)


# evaluate_pairs' numbers beside the held-out pair metrics, in the metrics file's order
_BESIDE = ("sft_likelihood_accuracy", "by_kind", "generated_accuracy", "generated_by_kind",
           "accuracy_without_likelihood")


def _accuracy_gate(out: dict, cfg: RewardConfig) -> Gate:
    """The stage's gate: held-out accuracy on SFT's own answers, with the weakest kinds beside it."""
    worst = sorted(out["by_kind"].items(), key=lambda kv: kv[1]["accuracy"])[:3]
    return Gate("held-out accuracy on SFT's own answers", out["accuracy"], "min", "reward.min_accuracy",
                cfg.min_accuracy,
                detail=f"on {out['n_pairs']} pairs (SFT's likelihood: {_fmt(out['sft_likelihood_accuracy'])}),"
                       f" margin {out['margin']:.3f}; weakest kinds: "
                       + ", ".join(f"{k} {v['accuracy']:.3f} (n={v['n']})" for k, v in worst),
                advice="Train longer (reward.max_steps), adjust reward.lr, or lower reward.min_accuracy if this"
                       " is expected")


def _load_own(samples: Path, tok, seq_len: int):
    """The samples stage's comparisons (PairSplits), or None when either side is empty (the stage
    found no prompt whose samples disagree) or has no pair that fits seq_len. A missing file is
    an error, named by load_pair_splits."""
    from llm.fileio import DataError
    if any((f := Path(samples) / name).is_file() and f.stat().st_size == 0 for name in ("train.jsonl", "val.jsonl")):
        return None
    try:
        return load_pair_splits(samples, tok, seq_len)
    except DataError as e:
        if "pair fits in seq_len" in str(e):  # load_pair_splits: no train or no val pair fits
            return None
        raise


def generated_count(share: float, n_own: int, n_available: int) -> int:
    """How many generated pairs make `share` of the training set beside n_own pairs of SFT's own
    answers (all that are available when they are fewer)."""
    if share <= 0:
        return 0
    return min(n_available, round(share * n_own / (1 - share)))


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _last(result, key: str) -> float | None:
    """Mean of `key` over the last log_every-ish rows of the training history."""
    rows = [r[key] for r in result.train_history[-10:] if r.get(key) is not None]
    return sum(rows) / len(rows) if rows else None


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: RewardConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt, sft=args.sft, data=args.data, samples=args.samples, run_dir=args.run_dir,
                model=args.model, metrics=args.metrics, plots=args.plots, progress=not args.no_progress)
        if m is None:  # ranks > 0
            return None
        return (f"{STAGE}: ranks {m['accuracy']:.1%} of {m['n_pairs']} held-out pairs of SFT's own answers right"
                f" (gate {cfg.min_accuracy}; SFT's likelihood {_fmt(m['sft_likelihood_accuracy'])}, without the"
                f" likelihood feature {_fmt(m['accuracy_without_likelihood'])}), generated pairs"
                f" {m['generated_accuracy']:.1%}; wrote {args.model}/ and {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
