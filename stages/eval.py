"""Stage `eval`: measure one model against held-out data and against SFT.

    dvc repro eval@sft        (dvc.yaml passes the paths: `python -m stages.eval --help`)

dvc.yaml runs it once per model (`foreach`: base, sft, ppo, ppo_rm, grpo, grpo_random, dpo). Reads the `common`
and `eval` sections of params.yaml and

    --model      the model evaluated
    --sft        the reference for KL and for the win rate
    --rm         the reward model that scores the answers
    --test       held-out math problems (never in any training split)
    --tasks      instruction tasks no policy trains on (may be empty)
    --arithmetic bare calculations, "What is 7 + 5?" (may be empty)
    --multiturn  conversations of two exchanges, the second turn to answer (may be empty)
    --scope      requests outside the model's skills, "Write a poem about the sea." (may be empty)
    --tiers      word problems by difficulty tier: in distribution, the edge, harder (may be empty)
    --continuation  held-out passages of verse to continue (continue/test.jsonl; may be empty)
    --base       the base model: its bits per byte on each continuation
    --tokens     val.bin, meta.json: held-out pretraining text, for perplexity and bits per byte

and computes (llm/eval/evaluate.py evaluate_model): perplexity and bits per byte on
`eval.ppl_batches` fixed windows of val.bin (held-out Shakespeare: `val_bpb`, lower is better,
beside `val_bpb_uniform`, a uniform guess over the vocabulary; a fine-tuned model far above the
base model has forgotten the language); greedy exact match on the first
`eval.math_problems` test problems, overall, per level and per language (English, Chinese),
and the share of answers in the `#### N` format, with Wilson intervals at `eval.confidence`;
greedy exact match on every instruction task (overall and per kind) and every arithmetic
question; greedy exact match on the second turn of every two-exchange conversation (overall, per
kind and per language: `multiturn_exact_match*`) and, for every out-of-scope request, whether
the answer has no math template (no `####`, no `a op b = c`: `scope_no_math_rate`) and whether
it is the taught statement of what the model can do (`scope_exact_match`), these keys only when
the files have items; with `eval.context_items`, the first that many test problems and bare
calculations asked again after an out-of-scope request, after an instruction task and under
three system messages (short, "You are a helpful assistant.", one no training conversation
has), scored beside the same items alone, per language, with the drop in points between them
(`context_math_*`, `context_arithmetic_*`: llm/eval/evaluate.py `score_context`); pass@k and the
sampled accuracy (`eval.pass_k` samples at `eval.temperature` on
`eval.pass_k_problems` problems) with bootstrap intervals; the reward model's mean score of
the greedy answers to `eval.rm_prompts` problems and the win rate against SFT's greedy answers
to the same prompts (ties count half); KL to SFT on `eval.kl_prompts` prompts (responses sampled
from the model at temperature 1; 0 for SFT itself); the Detoxify toxicity rate when
`eval.detoxify_checkpoint` is set, else "unavailable"; greedy answers to `eval.sample_prompts`;
and whether the reward model's score follows correctness on this model's own answers: `rm_auc`,
the share of (right, wrong) pairs among its scored greedy math answers in which the right one
scores higher (0.5 = the score says nothing about being right), with its interval and the mean
score of each group (llm/eval/paired.py rm_separation). With `eval.tier_problems`, math per
difficulty tier (llm/eval/tiers.py): greedy exact match, and on `eval.tier_pass_k_problems` of
them the pass@k curve for k = 1..`eval.tier_pass_k`, majority vote and the share of problems
greedy gets wrong while a sample is right (`tier_<tier>_*`). With `eval.continuation_items`, the
continuation preference on that many held-out passages (llm/post/continuation.py
`evaluate_continuations`): one continuation of each sampled at `eval.temperature` by the model and
by SFT with the same seed; the gold judge's mean (`continuation_gold`), the win rate against SFT's
continuation of the same passage with its Wilson interval (`continuation_win_rate*`), the reward
model's mean, KL to SFT per token and per continuation, repetition, the share the judge floors,
and the base model's bits per byte on the model's continuations and on SFT's
(`continuation_base_bpb`, `continuation_base_bpb_sft`): a win in words no verse holds shows there.
Sampling is seeded from (common.seed, part, batch): two runs give the same file. With
`common.nproc` > 1 it runs under torchrun, each rank generating and scoring a share of every
batch loop; rank 0 writes files byte for byte equal to a one-process run's (timings aside).

Writes

    --metrics    flat metrics (numbers; "toxicity": "unavailable" at most), for `dvc metrics diff`
    --samples    sample generations, math and RM samples (not metrics); the timings go to
                 runs/eval@<name>/run.json, which DVC does not track
    --items      one line per scored item: its outcome (right or wrong, or a score), no texts
                 (llm/eval/evaluate.py ITEM_SETS); the report pairs these with the parent model's
"""
from __future__ import annotations

import json
from pathlib import Path

from llm.config import CommonConfig, EvalConfig
from llm.data.batching import derive_seed, fixed_windows, open_tokens
from llm.eval.paired import rm_separation
from llm.fileio import DataError, atomic_write_json, read_jsonl, write_jsonl
from llm.train.metrics import timings_path

STAGE = "eval"
MODELS = ("base", "sft", "ppo", "ppo_rm", "grpo", "grpo_random", "dpo")
INPUTS = {"model": "the model directory evaluated", "sft": "the SFT model directory (reference for KL and win rate)",
          "rm": "the reward model directory", "test": "held-out math problems (JSONL)",
          "tasks": "evaluation-only instruction tasks (JSONL, may be empty)",
          "arithmetic": "evaluation-only bare calculations (JSONL, may be empty)",
          "multiturn": "evaluation-only two-exchange conversations (JSONL, may be empty)",
          "scope": "evaluation-only requests outside the model's skills (JSONL, may be empty)",
          "tiers": "evaluation-only word problems by difficulty tier (JSONL, may be empty)",
          "continuation": "held-out passages to continue (JSONL, may be empty)",
          "base": "the base model directory (its bits per byte on the continuations)",
          "tokens": "token shards (val.bin, meta.json): held-out text for bits per byte"}
OUTPUTS = {"metrics": "the metrics JSON", "samples": "the samples JSON (not a metric)",
           "items": "the per-item outcomes (JSONL): what the report's paired tests read"}


def _token_meta(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; run `dvc repro tokenize` first")
    meta = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in ("dtype", "val_tokens", "val_bytes", "tokenizer_sha256") if k not in meta]
    if missing:
        raise DataError(f"{path}: missing keys {missing}; re-run `dvc repro tokenize`")
    return meta


def _optional_jsonl(path: Path) -> list[dict]:
    """The records of an evaluation-only test file; a missing file is an error (prepare writes it,
    empty when its count is 0), an empty one means the skill is not scored."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; run `dvc repro prepare` first")
    if path.stat().st_size == 0:  # read_jsonl refuses a file with no records: here that means "not scored"
        return []
    return list(read_jsonl(path))


def run(name: str, common: CommonConfig, cfg: EvalConfig, *, model: Path, sft: Path, rm: Path, test: Path,
        tasks: Path, arithmetic: Path, tokens: Path, metrics: Path, samples: Path, items: Path,
        multiturn: Path | None = None, scope: Path | None = None, tiers: Path | None = None,
        continuation: Path | None = None, base: Path | None = None,
        device: str | None = None, rt=None) -> tuple[dict, dict]:
    """Evaluate the model `name` in directory `model`; write (rank 0) and return (metrics, samples).
    rt: a distributed llm.runtime.Runtime shares the work out over its ranks. multiturn, scope,
    tiers, continuation: None scores none of them (the command line always passes them); base is
    read only when continuations are scored."""
    from llm.eval.evaluate import evaluate_model
    from llm.nn.artifacts import load_model_dir
    from llm.runtime import resolve_device

    if name not in MODELS:
        raise ValueError(f"eval: unknown model {name!r}; expected one of {', '.join(MODELS)}")
    dev = device or str(resolve_device(common))
    policy, tok, meta = load_model_dir(model, device=dev, heads=("lm",))
    if Path(model).resolve() == Path(sft).resolve():
        ref = policy
    else:
        ref, ref_tok, _ = load_model_dir(sft, device=dev, heads=("lm",))
        if ref_tok.sha256() != tok.sha256():
            raise DataError(f"{model} and {sft} use different tokenizers; KL and win rate"
                            f" compare token by token and need the same one")
    rm_model, rm_tok, _ = load_model_dir(rm, device=dev)
    if "reward" not in rm_model.head_names:
        raise DataError(f"{rm}: has heads {list(rm_model.head_names)}, no 'reward' head")
    if rm_tok.sha256() != tok.sha256():
        raise DataError(f"{rm} uses another tokenizer than {model}")

    tmeta = _token_meta(tokens / "meta.json")
    if tmeta["tokenizer_sha256"] != tok.sha256():
        raise DataError(f"{tokens}/meta.json: val.bin was made with another tokenizer than {model}"
                        f" ({tmeta['tokenizer_sha256'][:12]}... vs {tok.sha256()[:12]}...)")
    val = open_tokens(tokens / "val.bin", tmeta["dtype"])
    val_batches = fixed_windows(val, seq_len=policy.config.seq_len, batch_size=cfg.batch_size,
                                n_batches=cfg.ppl_batches)
    problems = list(read_jsonl(test))
    if len(problems) < cfg.math_problems:
        raise DataError(f"{test}: {len(problems)} problems, fewer than eval.math_problems={cfg.math_problems};"
                        f" lower it or raise prepare.math_test")

    toxicity = None
    if cfg.detoxify_checkpoint:
        from llm.data.clean import load_toxicity_scorer
        try:
            toxicity = load_toxicity_scorer(cfg.detoxify_checkpoint, device=dev)
        except (FileNotFoundError, ValueError) as e:  # the loader names clean_sft's key; this is eval's
            raise type(e)(str(e).replace("clean_sft.detoxify_checkpoint", "eval.detoxify_checkpoint")) from None

    m, extras = evaluate_model(policy, tok, cfg, seed=derive_seed(common.seed, STAGE), problems=problems,
                               tasks=_optional_jsonl(tasks), arithmetic=_optional_jsonl(arithmetic),
                               multiturn=_optional_jsonl(multiturn) if multiturn else [],
                               scope=_optional_jsonl(scope) if scope else [],
                               val_batches=val_batches, bytes_per_token=tmeta["val_bytes"] / tmeta["val_tokens"],
                               ref=ref, rm=rm_model, toxicity=toxicity, toxicity_threshold=cfg.toxicity_threshold,
                               rt=rt)
    outcomes = extras.pop("items")
    tier_problems = _optional_jsonl(tiers) if tiers and cfg.tier_problems else []
    if tier_problems:
        from llm.eval.tiers import evaluate_tiers
        tm, textras = evaluate_tiers(policy, tok, cfg, tier_problems, seed=derive_seed(common.seed, STAGE), rt=rt)
        m.update(tm)
        outcomes += textras["items"]
        extras["tier_pass_curves"] = textras["pass_curves"]
        extras["timing_s"] = {**extras["timing_s"], **{f"tier_{t}": v for t, v in textras["timing_s"].items()}}
        extras["timing_s"]["total"] = round(extras["timing_s"]["total"] + sum(textras["timing_s"].values()), 3)
    passages = _optional_jsonl(continuation)[:cfg.continuation_items] if continuation and cfg.continuation_items \
        else []
    if passages:
        import time

        from llm.post.continuation import evaluate_continuations
        if base is None:
            raise DataError("eval: scoring continuations needs the base model (--base)")
        t0 = time.perf_counter()
        base_model, base_tok, _ = load_model_dir(base, device=dev, heads=("lm",))
        if base_tok.sha256() != tok.sha256():
            raise DataError(f"{base} uses another tokenizer than {model}")
        cm, citems, shown = evaluate_continuations(
            policy, ref, rm_model, base_model, tok, passages, max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, seed=derive_seed(common.seed, STAGE), batch_size=cfg.batch_size,
            confidence=cfg.confidence, rt=rt)
        m.update(cm)
        outcomes += citems
        extras["continuation_samples"] = shown
        extras["timing_s"]["continuation"] = round(time.perf_counter() - t0, 3)
        extras["timing_s"]["total"] = round(extras["timing_s"]["total"] + extras["timing_s"]["continuation"], 3)
    sep = rm_separation(outcomes, confidence=cfg.confidence, seed=derive_seed(common.seed, STAGE, "rm_auc"))
    if sep is not None:  # None without an RM, or without both right and wrong answers among those it scored
        m.update({"rm_auc": sep["auc"], "rm_auc_lo": sep["lo"], "rm_auc_hi": sep["hi"],
                  "rm_score_right": sep["mean_right"], "rm_score_wrong": sep["mean_wrong"],
                  "rm_auc_right": sep["n_right"], "rm_auc_wrong": sep["n_wrong"]})
    # the timings go beside the run's other untracked files, so that a rerun of the same model
    # writes the same samples file and leaves dvc.lock as it was
    timing = {"timing_s": extras.pop("timing_s")}
    s = {"model": name, "model_fingerprint": meta.get("fingerprint", ""), "device": dev, **extras}
    if rt is None or rt.is_main:
        atomic_write_json(timings_path(metrics), timing)
        atomic_write_json(metrics, m)
        atomic_write_json(samples, s)
        write_jsonl(items, outcomes)
    return m, {**s, **timing}


def main(argv: list[str] | None = None) -> int:
    from llm.runtime import setup_runtime
    from llm.stage import stage_main

    def work(args, common: CommonConfig, cfg: EvalConfig, rt) -> str | None:
        if cfg.num_threads:
            import torch
            torch.set_num_threads(cfg.num_threads)
        m, s = run(args.name, common, cfg, device=str(rt.device), rt=rt,
                   **{k: getattr(args, k) for k in (*INPUTS, *OUTPUTS)})
        if not rt.is_main:
            return None
        parts = [f"math exact match {m['math_exact_match']:.1%} [{m['math_exact_match_lo']:.1%},"
                 f" {m['math_exact_match_hi']:.1%}]"]
        for key, label in (("task_exact_match", "tasks"), ("arithmetic_exact_match", "arithmetic"),
                           ("multiturn_exact_match", "second turns"), ("scope_no_math_rate", "out-of-scope no math"),
                           ("context_math_after_scope", "math after an out-of-scope request"),
                           ("context_arithmetic_system_helpful", "arithmetic under \"You are a helpful assistant.\"")):
            if key in m:
                parts.append(f"{label} {m[key]:.1%}")
        k = m.get("tier_pass_k")
        for tier in ("in_distribution", "edge", "harder"):
            if f"tier_{tier}_exact_match" in m:
                sampled = f" (pass@{k} {m[f'tier_{tier}_pass_at_{k}']:.1%})" if f"tier_{tier}_pass_at_{k}" in m else ""
                parts.append(f"{tier.replace('_', ' ')} tier {m[f'tier_{tier}_exact_match']:.1%}{sampled}")
        if "val_bpb" in m:
            parts.insert(0, f"val bits/byte {m['val_bpb']:.4f}")
        if "math_pass_at_k" in m:
            parts.append(f"pass@{m['math_pass_k']} {m['math_pass_at_k']:.1%}")
        if "rm_score" in m:
            parts.append(f"RM score {m['rm_score']:.3f}")
        if "rm_auc" in m:
            parts.append(f"RM right-above-wrong AUC {m['rm_auc']:.3f}")
        if "win_rate_vs_sft" in m:
            parts.append(f"win rate vs SFT {m['win_rate_vs_sft']:.1%}")
        if "kl" in m:
            parts.append(f"KL to SFT {m['kl']:.3g} nats/token")
        if "continuation_gold" in m:
            parts.append(f"continuations: gold judge {m['continuation_gold']:+.3f}, win rate vs SFT"
                         f" {m['continuation_win_rate']:.1%} [{m['continuation_win_rate_lo']:.1%},"
                         f" {m['continuation_win_rate_hi']:.1%}], KL {m['continuation_kl']:.3g} nats/token")
        return f"{STAGE} {args.name}: " + ", ".join(parts) + f"; {s['timing_s']['total']:.1f} s; wrote {args.metrics}"

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True,
                      options=lambda ap: ap.add_argument("name", choices=MODELS, help="which model (a label)"))


if __name__ == "__main__":
    raise SystemExit(main())
