"""Stage `eval`: measure one model against held-out data and against SFT.

    python -m stages.eval <model> [--params params.yaml]      # model: base | sft | ppo | grpo | dpo

dvc.yaml runs it once per model (`foreach`). Reads the `common` and `eval` sections of
params.yaml and

    models/<model>/                  the model evaluated
    models/sft/                      the reference for KL and for the win rate
    models/reward/                   the reward model that scores the answers
    data/prepared/rl/test.jsonl      held-out math problems (never in any training split)
    data/prepared/tasks/test.jsonl   instruction tasks no policy trains on (may be empty)
    data/prepared/arithmetic/test.jsonl  bare calculations, "What is 7 + 5?" (may be empty)
    data/tokens/val.bin, meta.json   held-out pretraining text, for perplexity and bits per byte

and computes (llm/evaluate.py evaluate_model): perplexity and bits per byte on
`eval.ppl_batches` fixed windows of val.bin; greedy exact match on the first
`eval.math_problems` test problems, overall, per level and per language (English, Chinese),
and the share of answers in the `#### N` format, with Wilson intervals at `eval.confidence`;
greedy exact match on every instruction task (overall and per kind) and every arithmetic
question; pass@k and the sampled accuracy (`eval.pass_k` samples at `eval.temperature` on
`eval.pass_k_problems` problems) with bootstrap intervals; the reward model's mean score of
the greedy answers to `eval.rm_prompts` problems and the win rate against SFT's greedy answers
to the same prompts (ties count half); KL to SFT on `eval.kl_prompts` prompts (responses sampled
from the model at temperature 1; 0 for SFT itself); the Detoxify toxicity rate when
`eval.detoxify_checkpoint` is set, else "unavailable"; greedy answers to `eval.sample_prompts`.
Sampling is seeded from (common.seed, part): two runs give the same file.

Writes

    metrics/eval/<model>.json          flat metrics (numbers; "toxicity": "unavailable" at most),
                                       for `dvc metrics diff`
    metrics/eval/<model>_samples.json  sample generations, math and RM samples, timings (not metrics)
    metrics/eval/<model>_items.jsonl   one line per scored item: its outcome (right or wrong, or a
                                       score) and the clipped response (llm/evaluate.py ITEM_SETS);
                                       the report pairs these with the parent model's
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llm.batching import derive_seed, fixed_windows, open_tokens
from llm.config import CommonConfig, ConfigError, EvalConfig, load_sections
from llm.fileio import DataError, atomic_write_json, read_jsonl, write_jsonl

STAGE = "eval"
MODELS = ("base", "sft", "ppo", "grpo", "dpo")
MODEL_DIR = Path("models")
TEST = Path("data/prepared/rl/test.jsonl")
TASKS = Path("data/prepared/tasks/test.jsonl")
ARITHMETIC = Path("data/prepared/arithmetic/test.jsonl")
TOKENS = Path("data/tokens")
OUT = Path("metrics/eval")


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
    return list(read_jsonl(path))


def run(name: str, common: CommonConfig, cfg: EvalConfig, *, models: Path = MODEL_DIR, test: Path = TEST,
        tasks: Path = TASKS, arithmetic: Path = ARITHMETIC, tokens: Path = TOKENS, out: Path = OUT,
        device: str | None = None) -> tuple[dict, dict]:
    """Evaluate models/<name>; write and return (metrics, samples)."""
    from llm.artifacts import load_model_dir
    from llm.evaluate import evaluate_model
    from llm.trainer import resolve_device

    if name not in MODELS:
        raise ValueError(f"eval: unknown model {name!r}; expected one of {', '.join(MODELS)}")
    dev = device or str(resolve_device(common))
    model, tok, meta = load_model_dir(models / name, device=dev, heads=("lm",))
    if name == "sft":
        ref = model
    else:
        ref, ref_tok, _ = load_model_dir(models / "sft", device=dev, heads=("lm",))
        if ref_tok.sha256() != tok.sha256():
            raise DataError(f"{models / name} and {models / 'sft'} use different tokenizers; KL and win rate"
                            f" compare token by token and need the same one")
    rm, rm_tok, _ = load_model_dir(models / "reward", device=dev)
    if "reward" not in rm.head_names:
        raise DataError(f"{models / 'reward'}: has heads {list(rm.head_names)}, no 'reward' head")
    if rm_tok.sha256() != tok.sha256():
        raise DataError(f"{models / 'reward'} uses another tokenizer than {models / name}")

    tmeta = _token_meta(tokens / "meta.json")
    if tmeta["tokenizer_sha256"] != tok.sha256():
        raise DataError(f"{tokens}/meta.json: val.bin was made with another tokenizer than {models / name}"
                        f" ({tmeta['tokenizer_sha256'][:12]}... vs {tok.sha256()[:12]}...)")
    val = open_tokens(tokens / "val.bin", tmeta["dtype"])
    val_batches = fixed_windows(val, seq_len=model.config.seq_len, batch_size=cfg.batch_size,
                                n_batches=cfg.ppl_batches)
    problems = list(read_jsonl(test))
    if len(problems) < cfg.math_problems:
        raise DataError(f"{test}: {len(problems)} problems, fewer than eval.math_problems={cfg.math_problems};"
                        f" lower it or raise prepare.math_test")

    toxicity = None
    if cfg.detoxify_checkpoint:
        from llm.clean import load_toxicity_scorer
        try:
            toxicity = load_toxicity_scorer(cfg.detoxify_checkpoint, device=dev)
        except (FileNotFoundError, ValueError) as e:  # the loader names clean_sft's key; this is eval's
            raise type(e)(str(e).replace("clean_sft.detoxify_checkpoint", "eval.detoxify_checkpoint")) from None

    metrics, extras = evaluate_model(model, tok, cfg, seed=derive_seed(common.seed, STAGE), problems=problems,
                                     tasks=_optional_jsonl(tasks), arithmetic=_optional_jsonl(arithmetic),
                                     val_batches=val_batches, bytes_per_token=tmeta["val_bytes"] / tmeta["val_tokens"],
                                     ref=ref, rm=rm, toxicity=toxicity, toxicity_threshold=cfg.toxicity_threshold)
    items = extras.pop("items")
    samples = {"model": name, "model_fingerprint": meta.get("fingerprint", ""), "device": dev, **extras}
    atomic_write_json(out / f"{name}.json", metrics)
    atomic_write_json(out / f"{name}_samples.json", samples)
    write_jsonl(out / f"{name}_items.jsonl", items)
    return metrics, samples


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("model", choices=MODELS)
    ap.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    try:
        sections = load_sections(["common", "eval"], args.params)
    except ConfigError as e:
        print(f"{STAGE}: {e}", file=sys.stderr)
        return 1
    common, cfg = sections["common"], sections["eval"]
    threads = cfg.num_threads or common.num_threads
    if threads:
        import torch
        torch.set_num_threads(threads)
    try:
        m, s = run(args.model, common, cfg)
    except (ConfigError, DataError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"{STAGE} {args.model}: {e}", file=sys.stderr)
        return 1
    parts = [f"math exact match {m['math_exact_match']:.1%} [{m['math_exact_match_lo']:.1%},"
             f" {m['math_exact_match_hi']:.1%}]"]
    for key, label in (("task_exact_match", "tasks"), ("arithmetic_exact_match", "arithmetic")):
        if key in m:
            parts.append(f"{label} {m[key]:.1%}")
    if "val_bpb" in m:
        parts.insert(0, f"val bits/byte {m['val_bpb']:.4f}")
    if "math_pass_at_k" in m:
        parts.append(f"pass@{m['math_pass_k']} {m['math_pass_at_k']:.1%}")
    if "rm_score" in m:
        parts.append(f"RM score {m['rm_score']:.3f}")
    if "win_rate_vs_sft" in m:
        parts.append(f"win rate vs SFT {m['win_rate_vs_sft']:.1%}")
    if "kl_to_sft" in m:
        parts.append(f"KL to SFT {m['kl_to_sft']:.3f}")
    print(f"{STAGE} {args.model}: " + ", ".join(parts) + f"; {s['timing_s']['total']:.1f} s;"
          f" wrote {OUT / args.model}.json", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
