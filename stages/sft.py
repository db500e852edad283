"""Stage `sft`: supervised fine-tuning of the base model on chat data.

    dvc repro sft        (dvc.yaml passes the paths: `python -m stages.sft --help`)

Reads the `common` and `sft` sections of params.yaml, the pretrained model (and its
tokenizer), the cleaned conversations ({train,val}.jsonl: {"id", "messages", "source"}) and
held-out math problems for the final exact-match check.

Each conversation is rendered with the chat template (llm/chat.py); the loss covers only
assistant tokens and their closing <|end|>. Conversations longer than the context are
cut at the end; one left with no supervised token is dropped and counted. Batches come
from a length-bucketing sampler (`sft.bucket_width`) so padding stays small; the padding
mask is combined with the causal mask inside attention. A source with fewer training
conversations than `sft.min_source_examples` is repeated whole until it has at least that
many: the generated instruction tasks of a small kind (reversing one of 30 words has 60
prompts) are otherwise a few dozen conversations among twenty thousand. At lr 1e-3 on the
`cpu` profile that taught the repeat kind but cost held-out math; at 2e-3 math and the tasks
rose together, so the `cpu` profile takes 200 with lr 2e-3 (docs/log.md). The loop is
llm/trainer.py's, with the same checkpoints, resume, non-finite policy and `torchrun` support
as pretrain.

With `sft.average_last` above 1 the model written is the mean of the weights at the run's last
that many checkpoints (llm/average.py), and its metrics give the validation loss of both. The
mean is the smoother model (lower validation loss), but over three seeds of the `cpu` profile it
was not better at math and PPO and GRPO gained less from it, so the profile writes the final
weights (docs/log.md).

Writes the SFT model directory, its metrics (train/val masked loss, assistant tokens trained,
held-out math exact match with a 95% interval), the curves (sft{.tsv,_val.tsv,.png}) and the
run directory (checkpoints; a persisted DVC out).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from llm.average import average_checkpoints
from llm.batching import BucketBatchSampler, ExampleBatches, derive_seed, pad_collate, upsample_sources
from llm.chat import render
from llm.config import CommonConfig, SFTConfig, fingerprint
from llm.fileio import DataError, read_jsonl, sha256_tree
from llm.metrics import write_metrics
from llm.monitor import Plots, publish_curves
from llm.runtime import Runtime, full_model_state, setup_runtime
from llm.stage import stage_main, training_outputs
from llm.trainer import evaluate, lm_loss, supervised_lm_loss, train

STAGE = "sft"
INPUTS = {"base": "the pretrained model directory", "data": "cleaned conversations: train.jsonl, val.jsonl",
          "math_val": "held-out math problems (JSONL) for the final exact-match check"}
OUTPUTS = training_outputs("the SFT model directory")


def render_all(records: list[dict], tokenizer, max_tokens: int) -> tuple[list[tuple[list[int], list[bool]]], int]:
    """(ids, loss_mask) per usable conversation, and how many were dropped by truncation."""
    out, dropped = [], 0
    for r in records:
        x = render(r["messages"], tokenizer, max_tokens=max_tokens)
        if x is None:
            dropped += 1
        else:
            out.append(x)
    return out, dropped


def make_batch(examples, pad_id: int):
    return lambda ix: pad_collate([examples[i][0] for i in ix], pad_id=pad_id,
                                  loss_masks=[examples[i][1] for i in ix])


def run(common: CommonConfig, cfg: SFTConfig, rt: Runtime, *, base: Path, data: Path, math_val: Path, run_dir: Path,
        model: Path, metrics: Path, plots: Path, progress: bool = True) -> dict | None:
    from llm.artifacts import load_model_dir, save_model_dir
    from llm.evaluate import math_eval
    from llm.model import GPT

    gpt, tok, base_meta = load_model_dir(base, device="cpu", heads=("lm",))
    seq_len = gpt.config.seq_len
    train_recs = list(read_jsonl(data / "train.jsonl"))
    keep, upsampled = upsample_sources([r.get("source", "") for r in train_recs], cfg.min_source_examples)
    n_records = len(train_recs)
    train_recs = [train_recs[i] for i in keep]
    val_recs = list(read_jsonl(data / "val.jsonl"))
    train_ex, dropped_train = render_all(train_recs, tok, seq_len + 1)
    val_ex, dropped_val = render_all(val_recs, tok, seq_len + 1)
    if not train_ex:
        raise DataError(f"{data}/train.jsonl: no conversation has a supervised token within seq_len={seq_len}")
    inputs = {"base": base_meta.get("fingerprint", ""), "data": sha256_tree(data)}
    fp = fingerprint(common, cfg, inputs)
    seed = derive_seed(common.seed, STAGE)

    sampler = BucketBatchSampler([len(ids) for ids, _ in train_ex], batch_size=cfg.batch_size,
                                 bucket_width=cfg.bucket_width, seed=seed, rank=rt.rank, world_size=rt.world_size)
    batches = ExampleBatches(sampler, make_batch(train_ex, tok.pad_id))
    # fixed validation batches: a seeded sample of the val conversations (shortest-first would
    # pick only the short instruction tasks), sorted by length within the sample to pad less
    g = torch.Generator().manual_seed(derive_seed(common.seed, STAGE, "val"))
    pick = torch.randperm(len(val_ex), generator=g)[: cfg.eval_batches * cfg.batch_size].tolist()
    val_sorted = sorted((val_ex[i] for i in pick), key=lambda x: len(x[0]))
    val_batches = [make_batch(val_sorted, tok.pad_id)(list(range(i, min(i + cfg.batch_size, len(val_sorted)))))
                   for i in range(0, len(val_sorted), cfg.batch_size)]
    if rt.is_main:
        print(f"{STAGE}: {len(train_ex)} train / {len(val_ex)} val conversations"
              f" ({dropped_train} + {dropped_val} dropped: nothing supervised within seq_len={seq_len});"
              f" {gpt.summary()}", flush=True)
        for source, k in sorted(upsampled.items()):
            print(f"{STAGE}: {source} repeated {k}x (fewer than min_source_examples={cfg.min_source_examples})",
                  flush=True)

    curves = run_dir / "plots"
    # the LM head only at the assistant tokens: the cpu profile's forward and backward 1.26x
    # faster (docs/log.md). A compiled model keeps the full head: selecting positions gives a
    # shape the graph cannot know in advance
    loss_fn = lm_loss if cfg.compile else supervised_lm_loss
    result = train(gpt, cfg, rt, stage=STAGE, seed=seed, batches=batches, loss_fn=loss_fn, val_batches=val_batches,
                   run_dir=run_dir, fingerprint=fp, plots=Plots(tsv=curves / f"{STAGE}.tsv",
                                                                png=curves / f"{STAGE}.png", tb_dir=run_dir / "tb"),
                   progress=progress)

    state = full_model_state(gpt, rt)
    if not rt.is_main:
        return None
    out_model = GPT(gpt.config, seed=0)
    m = dict(result.metrics)
    averaged = None
    if cfg.average_last > 1:
        # the written model is the mean of the last checkpoints (the final step's among them)
        state, averaged = average_checkpoints(run_dir, cfg.average_last, fingerprint=fp, names=state,
                                              source=f"this {STAGE} run")
    out_model.load_state_dict(state)
    if averaged:
        m["val_loss_last"] = m.get("val_loss")
        if val_batches:  # the validation loss of the model written; one process reads it
            m.update(evaluate(out_model.to(rt.device), val_batches, loss_fn, replace(rt, rank=0, world_size=1)))
        losses = (f" (val loss {m['val_loss']:.4f}; the final weights' {m['val_loss_last']:.4f})"
                  if val_batches else "")
        print(f"{STAGE}: the model is the mean of the weights at steps {', '.join(map(str, averaged))}{losses}",
              flush=True)
    out_model.eval()
    out = {
        "train_loss": m["train_loss"], "val_loss": m.get("val_loss"), "val_ppl": m.get("val_ppl"),
        "assistant_tokens_trained": int(sum(r.get("weight", 0) for r in result.train_history)),
        "tokens_seen": m["tokens_seen"], "tokens_per_s": m["tokens_per_s"], "steps": m["steps"],
        "train_conversations": len(train_ex), "dropped_truncated": dropped_train + dropped_val,
        "masked_fraction": 1 - sum(sum(mk) for _, mk in train_ex) / sum(len(mk) for _, mk in train_ex),
        "nonfinite_skips": m["nonfinite_skips"], "train_time_s": m["train_time_s"], "num_threads": m["num_threads"],
        "threads_steps": m["threads_steps"],
    }
    if upsampled:  # only then, so that a run repeating nothing writes what it wrote before the option
        out.update(train_records=n_records, sources_upsampled=len(upsampled))
    if averaged:
        out.update(averaged_steps=averaged, val_loss_last=m["val_loss_last"])
    if cfg.eval_math_problems:
        problems = list(read_jsonl(math_val))[: cfg.eval_math_problems]
        ev = math_eval(out_model.to(rt.device), tok, problems, max_new_tokens=cfg.max_new_tokens,
                       batch_size=64)
        out.update({k: v for k, v in ev.items() if k != "samples"})
        out["math_samples"] = ev["samples"][:3]
    save_model_dir(model, out_model.cpu(), tok, {"stage": STAGE, "fingerprint": fp, "inputs": inputs,
                                                 "parent": str(base), "steps": result.step,
                                                 **({"averaged_checkpoints": averaged} if averaged else {})})
    publish_curves(curves, plots, STAGE)
    write_metrics(metrics, out)
    return out


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: SFTConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt, base=args.base, data=args.data, math_val=args.math_val, run_dir=args.run_dir,
                model=args.model, metrics=args.metrics, plots=args.plots, progress=not args.no_progress)
        if m is None:  # ranks > 0
            return None
        em = m.get("math_exact_match")
        return (f"{STAGE}: val loss {m['val_loss']:.4f}"
                + (f", held-out math exact match {em:.1%} [{m['math_exact_match_lo']:.1%},"
                   f" {m['math_exact_match_hi']:.1%}]" if em is not None else "")
                + f"; wrote {args.model}/ and {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
