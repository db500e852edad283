"""Stage `sft`: supervised fine-tuning of the base model on chat data.

    dvc repro sft        (dvc.yaml passes the paths: `python -m stages.sft --help`)

Reads the `common` and `sft` sections of params.yaml, the pretrained model (and its
tokenizer), the cleaned conversations ({train,val}.jsonl: {"id", "messages", "source"}) and
held-out math problems for the final exact-match check.

Each conversation is rendered with the chat template (llm/data/template.py); the loss covers only
assistant tokens and their closing <|end|>. Conversations longer than the context are
cut at the end; one left with no supervised token is dropped and counted. Batches come from
a length-bucketing sampler (`sft.bucket_width`; llm/data/batching.py conversation_batches) so
padding stays small; the padding mask is combined with the causal mask inside attention. A source with fewer training
conversations than `sft.min_source_examples` is repeated whole until it has at least that
many: the generated instruction tasks of a small kind (reversing one of 30 words has 60
prompts) are otherwise a few dozen conversations among twenty thousand; what it costs or buys
at each learning rate is in docs/log.md. The loop is
llm/train/trainer.py's, with the same checkpoints, resume, non-finite policy and `torchrun` support
as pretrain.

With `sft.replay_fraction` above 0, each batch of conversations gets windows of the pretraining
text (--tokens train.bin, as long as the batch) appended, that share of its rows, with the loss
on every one of their tokens (llm/data/batching.py ReplayBatches): fine-tuning on conversations
alone lets the model forget the language it read in pretraining. The validation loss stays the
conversations' own; `assistant_tokens_trained` then counts the text's scored tokens too.

With `sft.average_last` above 1 the model written is the mean of the weights at the run's last
that many checkpoints (llm/train/average.py), and its metrics give the validation loss of both
(`val_loss` of the model written, `val_loss_last` of the final weights).

Writes the SFT model directory, its metrics (train/val masked loss, assistant tokens trained,
held-out math exact match with a 95% interval), the curves (sft{.tsv,_val.tsv,.png}) and the
run directory (checkpoints; a persisted DVC out).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from llm.config import CommonConfig, SFTConfig, fingerprint
from llm.data.batching import (conversation_batches, derive_seed, fixed_conversation_batches, open_tokens,
                               upsample_sources)
from llm.data.template import render_all
from llm.fileio import DataError, read_jsonl, sha256_file, sha256_tree
from llm.runtime import Runtime, full_model_state, setup_runtime
from llm.stage import stage_main, training_outputs
from llm.train.average import average_checkpoints
from llm.train.finish import finish_stage, run_plots
from llm.train.trainer import evaluate, lm_loss, supervised_lm_loss, train

STAGE = "sft"
INPUTS = {"base": "the pretrained model directory", "data": "cleaned conversations: train.jsonl, val.jsonl",
          "math_val": "held-out math problems (JSONL) for the final exact-match check",
          "tokens": "token shards (train.bin, meta.json): pretraining text, read when sft.replay_fraction > 0"}
OUTPUTS = training_outputs("the SFT model directory")


def _replay_tokens(cfg: SFTConfig, tokens: Path | None, tokenizer, inputs: dict):
    """The pretraining token shard replayed during SFT, checked against the model's tokenizer, or
    None when sft.replay_fraction is 0. Only with replay does the shard's hash join `inputs`, so a
    run without it keeps the fingerprint it had before the option."""
    if not cfg.replay_fraction:
        return None
    if tokens is None:
        raise ValueError("sft.replay_fraction > 0 needs the pretraining token shards (--tokens)")
    path = tokens / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; run `dvc repro tokenize` first (sft.replay_fraction > 0 reads it)")
    meta = json.loads(path.read_text(encoding="utf-8"))
    if meta.get("tokenizer_sha256") != tokenizer.sha256() or "dtype" not in meta:
        raise DataError(f"{path}: train.bin was made with another tokenizer than the base model's (or meta.json"
                        f" lacks dtype); re-run `dvc repro tokenize`, or set sft.replay_fraction: 0.0")
    inputs["tokens"] = sha256_file(tokens / "train.bin")
    return open_tokens(tokens / "train.bin", meta["dtype"])


def _evaluate_average(out_model, averaged: list[int], m: dict, val_batches, loss_fn, rt: Runtime) -> None:
    """The validation loss of the averaged model written (in m; the final weights' as val_loss_last)."""
    m["val_loss_last"] = m.get("val_loss")
    if val_batches:  # one process reads it
        m.update(evaluate(out_model.to(rt.device), val_batches, loss_fn, replace(rt, rank=0, world_size=1)))
    losses = (f" (val loss {m['val_loss']:.4f}; the final weights' {m['val_loss_last']:.4f})"
              if val_batches else "")
    print(f"{STAGE}: the model is the mean of the weights at steps {', '.join(map(str, averaged))}{losses}",
          flush=True)


def _math_check(model, tok, math_val: Path, cfg: SFTConfig) -> dict:
    """Greedy exact match on the first sft.eval_math_problems held-out problems, and three samples."""
    from llm.eval.evaluate import math_eval

    problems = list(read_jsonl(math_val))[: cfg.eval_math_problems]
    ev = math_eval(model, tok, problems, max_new_tokens=cfg.max_new_tokens, batch_size=64)
    return {**{k: v for k, v in ev.items() if k != "samples"}, "math_samples": ev["samples"][:3]}


def run(common: CommonConfig, cfg: SFTConfig, rt: Runtime, *, base: Path, data: Path, math_val: Path, run_dir: Path,
        model: Path, metrics: Path, plots: Path, tokens: Path | None = None, progress: bool = True) -> dict | None:
    from llm.nn.artifacts import load_model_dir
    from llm.nn.model import GPT

    gpt, tok, base_meta = load_model_dir(base, device="cpu", heads=("lm",))
    seq_len = gpt.config.seq_len
    train_recs = list(read_jsonl(data / "train.jsonl"))
    keep, upsampled = upsample_sources([r.get("source", "") for r in train_recs], cfg.min_source_examples)
    n_records = len(train_recs)
    train_recs = [train_recs[i] for i in keep]
    val_recs = list(read_jsonl(data / "val.jsonl"))
    train_ex, dropped_train = render_all([r["messages"] for r in train_recs], tok, seq_len + 1)
    val_ex, dropped_val = render_all([r["messages"] for r in val_recs], tok, seq_len + 1)
    if not train_ex:
        raise DataError(f"{data}/train.jsonl: no conversation has a supervised token within seq_len={seq_len}")
    inputs = {"base": base_meta.get("fingerprint", ""), "data": sha256_tree(data)}
    replay = _replay_tokens(cfg, tokens, tok, inputs)
    fp = fingerprint(common, cfg, inputs)
    seed = derive_seed(common.seed, STAGE)

    batches = conversation_batches(train_ex, pad_id=tok.pad_id, batch_size=cfg.batch_size,
                                   bucket_width=cfg.bucket_width, seed=seed, rank=rt.rank,
                                   world_size=rt.world_size, replay=replay, replay_fraction=cfg.replay_fraction)
    val_batches = fixed_conversation_batches(val_ex, pad_id=tok.pad_id, batch_size=cfg.batch_size,
                                             n_batches=cfg.eval_batches, seed=derive_seed(common.seed, STAGE, "val"))
    if rt.is_main:
        print(f"{STAGE}: {len(train_ex)} train / {len(val_ex)} val conversations"
              f" ({dropped_train} + {dropped_val} dropped: nothing supervised within seq_len={seq_len});"
              f" {gpt.summary()}", flush=True)
        if replay is not None:
            print(f"{STAGE}: {cfg.replay_fraction:.0%} of each batch's rows are windows of {tokens}/train.bin"
                  f" ({len(replay)} tokens of pretraining text, every token scored)", flush=True)
        for source, k in sorted(upsampled.items()):
            print(f"{STAGE}: {source} repeated {k}x (fewer than min_source_examples={cfg.min_source_examples})",
                  flush=True)

    # the LM head only at the assistant tokens: the cpu profile's forward and backward 1.26x
    # faster (docs/log.md). A compiled model keeps the full head: selecting positions gives a
    # shape the graph cannot know in advance
    loss_fn = lm_loss if cfg.compile else supervised_lm_loss
    result = train(gpt, cfg, rt, stage=STAGE, seed=seed, batches=batches, loss_fn=loss_fn, val_batches=val_batches,
                   run_dir=run_dir, fingerprint=fp, plots=run_plots(STAGE, run_dir),
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
        _evaluate_average(out_model, averaged, m, val_batches, loss_fn, rt)
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
        out.update(_math_check(out_model.to(rt.device), tok, math_val, cfg))
    return finish_stage(STAGE, run_dir=run_dir, model=model, weights=out_model.cpu(), tokenizer=tok,
                        meta={"stage": STAGE, "fingerprint": fp, "inputs": inputs, "parent": str(base),
                              "steps": result.step, **({"averaged_checkpoints": averaged} if averaged else {})},
                        plots=plots, metrics=metrics, numbers=out)


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: SFTConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt, base=args.base, data=args.data, math_val=args.math_val, run_dir=args.run_dir,
                model=args.model, metrics=args.metrics, plots=args.plots, tokens=args.tokens,
                progress=not args.no_progress)
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
