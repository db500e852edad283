"""Stage `clean_sft`: dedupe, filter and decontaminate the SFT conversations.

    dvc repro clean_sft        (dvc.yaml passes the paths: `python -m stages.clean_sft --help`)

Reads the `common` and `clean_sft` sections of params.yaml and

    --sft            {train,val}.jsonl: {"id", "messages", "source"}, the conversations
    --tokenizer      token counts of the rendered chat template
    --eval-prompts   {test,val}.jsonl: the held-out math prompts to decontaminate against

and writes, each atomically:

    --out            {train,val}.jsonl: the kept records, unchanged and in input order
    --metrics        per split: in, kept, dropped per reason; seconds per step; near-dup and
                     decontam details; a capped list of dropped samples with the reason (llm/data/clean.py)

Both splits go through dedupe, near-dedupe, length and toxicity; only `train` is
decontaminated (val is not trained on, and sft/val holds the rl/val questions on purpose).
Without `clean_sft.detoxify_checkpoint` the toxicity filter does not run: a warning goes to
stderr and the metrics say "toxicity_filter": "unavailable".
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from llm.data.clean import REASONS, LazyEmbedder, clean, load_toxicity_scorer, record_problem, summarize
from llm.fileio import DataError, atomic_dir, read_jsonl, write_jsonl
from llm.train.metrics import write_metrics

INPUTS = {"sft": "the conversations: train.jsonl, val.jsonl", "tokenizer": "the tokenizer directory",
          "eval_prompts": "held-out math (test.jsonl, val.jsonl) to decontaminate against"}
OUTPUTS = {"out": "the cleaned conversations directory", "metrics": "the metrics JSON"}
SPLITS = ("train", "val")
EVAL_SPLITS = ("test", "val")


def _eval_prompts(eval_dir: Path) -> list[str]:
    out = []
    for path in (eval_dir / f"{s}.jsonl" for s in EVAL_SPLITS):
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


def run(common, cfg, device: str, *, sft: Path, tokenizer: Path, eval_prompts: Path, out: Path, metrics_path: Path,
        progress: bool = True) -> dict:
    from llm.data.template import render
    from llm.data.tokenizer import Tokenizer

    t0 = time.perf_counter()
    data = {s: list(read_jsonl(sft / f"{s}.jsonl", validate=record_problem)) for s in SPLITS}
    prompts = _eval_prompts(eval_prompts)
    tok = Tokenizer.load(tokenizer)

    def count_tokens(messages: list[dict]) -> int | None:
        rendered = render(messages, tok)
        return None if rendered is None else len(rendered[0])

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
            eval_prompts=prompts if split == "train" else None, progress=progress)
        if not kept[split]:
            raise DataError(f"clean_sft: every {split} sample was dropped ({reports[split][-1].n_in} after"
                            f" the earlier steps); check clean_sft.min_tokens/max_tokens and the decontam settings")

    metrics = summarize(reports)
    metrics["toxicity_filter"] = "applied" if scorer is not None else "unavailable"
    metrics["reasons"] = list(REASONS)
    metrics["decontam_splits"] = ["train"]
    metrics["seconds"].update(load_embedder=round(embed.load_seconds, 3), load_toxicity=round(tox_seconds, 3))
    with atomic_dir(out) as tmp:
        for split in SPLITS:
            write_jsonl(tmp / f"{split}.jsonl", kept[split])
    metrics["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    write_metrics(metrics_path, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from llm.runtime import setup_runtime
    from llm.stage import stage_main

    def work(args, common, cfg, rt) -> str:
        m = run(common, cfg, str(rt.device), sft=args.sft, tokenizer=args.tokenizer, eval_prompts=args.eval_prompts,
                out=args.out, metrics_path=args.metrics, progress=not args.no_progress)
        return "\n".join(["clean_sft:", *_summary_lines(m), f"clean_sft: wrote {args.out}/ and {args.metrics}"])

    return stage_main("clean_sft", __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      errors=(RuntimeError,))


if __name__ == "__main__":
    raise SystemExit(main())
