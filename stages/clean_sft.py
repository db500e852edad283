"""Stage `clean_sft`: dedupe, filter and decontaminate the SFT conversations.

    python -m stages.clean_sft [--params params.yaml] [--no-progress]

Reads the `common` and `clean_sft` sections of params.yaml and

    data/prepared/sft/{train,val}.jsonl     {"id", "messages", "source"}   the conversations
    models/tokenizer/                        token counts of the rendered chat template
    data/prepared/rl/{test,val}.jsonl        the held-out prompts to decontaminate against

and writes, each atomically:

    data/clean_sft/{train,val}.jsonl         the kept records, unchanged and in input order
    metrics/clean_sft.json                   per split: in, kept, dropped per reason; seconds per
                                             step; near-dup/decontam details; a capped list of
                                             dropped samples with the reason (llm/clean.py)

Both splits go through dedupe, near-dedupe, length and toxicity; only `train` is
decontaminated (val is not trained on, and sft/val holds the rl/val questions on purpose).
Without `clean_sft.detoxify_checkpoint` the toxicity filter does not run: a warning goes to
stderr and the metrics say "toxicity_filter": "unavailable".
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llm.clean import REASONS, LazyEmbedder, clean, load_toxicity_scorer, record_problem, summarize
from llm.config import ConfigError, load_sections
from llm.fileio import DataError, atomic_dir, atomic_write_json, read_jsonl, write_jsonl

SFT = Path("data/prepared/sft")
EVAL_PROMPTS = [Path("data/prepared/rl/test.jsonl"), Path("data/prepared/rl/val.jsonl")]
TOKENIZER = Path("models/tokenizer")
OUT = Path("data/clean_sft")
METRICS = Path("metrics/clean_sft.json")
SPLITS = ("train", "val")


def _device(common) -> str:
    """Where the sentence and toxicity models run (common.device), with common.num_threads applied."""
    import torch

    if common.num_threads:
        torch.set_num_threads(common.num_threads)
    if common.device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if common.device == "cuda":
        raise RuntimeError("common.device: cuda, but torch.cuda.is_available() is False; set auto or cpu")
    return "cpu"


def _eval_prompts() -> list[str]:
    out = []
    for path in EVAL_PROMPTS:
        for rec in read_jsonl(path, validate=lambda o: None if isinstance(o.get("question"), str)
                              else "missing string 'question'"):
            out.append(rec["question"])
    return out


def _summary_lines(metrics: dict) -> list[str]:
    lines = []
    for split in SPLITS:
        m = metrics[split]
        drops = ", ".join(f"{k} {v}" for k, v in m["dropped"].items() if v) or "none"
        lines.append(f"  {split:<5} in {m['in']:>6}  kept {m['kept']:>6}  dropped {m['dropped_total']:>5} ({drops})")
    nd = metrics["train"]["steps"].get("near_dedupe", {})
    lines.append(f"  near-dup: {nd.get('embedded', 0)} train samples embedded in {nd.get('groups_multi', 0)}"
                 f" instruction groups of 2+ ({nd.get('groups', 0)} groups)")
    dc = metrics["train"]["steps"].get("decontam", {})
    if dc:
        lines.append(f"  decontam: {dc['ngram']}-grams, min_overlap {dc['min_overlap']}: dropped"
                     f" {metrics['train']['dropped']['contaminated']} (plain any-overlap would drop"
                     f" {dc['samples_sharing_any_ngram']}), {dc['eval_prompts_matched']} of {dc['eval_prompts']}"
                     f" eval prompts matched")
    lines.append(f"  toxicity filter: {metrics['toxicity_filter']}")
    lines.append("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in metrics["seconds"].items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        p = load_sections(["common", "clean_sft"], args.params)
        cfg, common = p["clean_sft"], p["common"]
        device = _device(common)
        data = {s: list(read_jsonl(SFT / f"{s}.jsonl", validate=record_problem)) for s in SPLITS}
        eval_prompts = _eval_prompts()

        from llm.chat import render
        from llm.tokenizer import Tokenizer

        tok = Tokenizer.load(TOKENIZER)

        def count_tokens(messages: list[dict]) -> int | None:
            out = render(messages, tok)
            return None if out is None else len(out[0])

        scorer, tox_seconds = None, 0.0
        if cfg.detoxify_checkpoint:
            t = time.perf_counter()
            scorer = load_toxicity_scorer(cfg.detoxify_checkpoint, device)
            tox_seconds = time.perf_counter() - t
        else:
            print("\n" + "!" * 78 + "\nclean_sft: WARNING: toxicity filter UNAVAILABLE: clean_sft.detoxify_checkpoint"
                  " is empty.\n  Detoxify cannot download its weights here; no sample was checked for toxicity.\n"
                  "  Point clean_sft.detoxify_checkpoint at a local Detoxify checkpoint to enable it.\n"
                  + "!" * 78, file=sys.stderr)

        embed = LazyEmbedder(cfg.embed_batch_size, device)
        kept, reports = {}, {}
        for split in SPLITS:
            kept[split], reports[split] = clean(
                data[split], cfg, count_tokens=count_tokens, embed=embed, toxicity=scorer,
                eval_prompts=eval_prompts if split == "train" else None, progress=not args.no_progress)
            if not kept[split]:
                raise DataError(f"clean_sft: every {split} sample was dropped ({reports[split][-1].n_in} after"
                                f" the earlier steps); check clean_sft.min_tokens/max_tokens and the decontam settings")
    except (ConfigError, DataError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"clean_sft: {e}", file=sys.stderr)
        return 1

    metrics = summarize(reports)
    metrics["toxicity_filter"] = "applied" if scorer is not None else "unavailable"
    metrics["reasons"] = list(REASONS)
    metrics["decontam_splits"] = ["train"]
    metrics["seconds"].update(load_embedder=round(embed.load_seconds, 3), load_toxicity=round(tox_seconds, 3))
    with atomic_dir(OUT) as tmp:
        for split in SPLITS:
            write_jsonl(tmp / f"{split}.jsonl", kept[split])
    metrics["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    atomic_write_json(METRICS, metrics)
    print("clean_sft:")
    print("\n".join(_summary_lines(metrics)))
    print(f"clean_sft: wrote {OUT}/ and {METRICS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
