"""Average the weights of a training run's last checkpoints into a model directory.

    python -m llm.average runs/sft models/sft models/sft_avg            (the last 2)
    python -m llm.average runs/sft models/sft models/sft_avg --last 4

A model at the end of training depends on its last few batches: its held-out loss still moves
between its last checkpoints, and runs that differ only in the order of their batches differ
in what they score. The uniform mean of the weights at the run's last N checkpoints (summed in
float64, cast back to each tensor's dtype) smooths that out; whether the smoother model is the
better one is a measurement, kept in docs/log.md. This tool writes that mean as a
model directory like the one the stage wrote, so `python -m stages.eval`, `llm.chat`,
`llm.serve` and `llm.export` take it as they take any other.

    run_dir   the stage's run directory (runs/sft): its `ckpt-<step>` folders, each verified
              (sizes, sha256, finite tensors) before it is read; stale/ is never used
    like      the model directory the stage wrote from that run (models/sft): its config,
              heads and tokenizer are kept; the checkpoints must carry its fingerprint (the
              same params and inputs), so a run directory from other params is refused
    out       the new model directory (written atomically; an existing one only with --force, and
              only a model directory this project wrote and nobody changed since, its meta.json
              listing every file and its sha256; never an input or a directory holding one); its
              meta.json names the steps averaged and keeps the stage's provenance

SFT itself writes such a mean when `sft.average_last` is above 1 (the `cpu` profile keeps the
final weights); this tool gives any N, for any stage's run, as a model directory of its own.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

import torch

from llm.errors import DiskFullError
from llm.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

KEPT_META = ("stage", "fingerprint", "inputs", "parent", "steps")


def average_states(states: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The elementwise mean of state dicts with the same names, shapes and dtypes. `states` may be
    a generator: one state is held at a time, beside a float64 running sum."""
    total: dict[str, torch.Tensor] = {}
    like: dict[str, tuple[torch.Size, torch.dtype]] = {}  # state 0's shapes and dtypes, not its tensors
    n = 0
    for s in states:
        if n == 0:
            ints = [k for k, t in s.items() if not t.is_floating_point()]
            if ints:
                raise ValueError(f"average_states: {ints[:8]} are not floating point; only floats can be averaged")
            like = {k: (t.shape, t.dtype) for k, t in s.items()}
            total = {k: t.detach().to(torch.float64) for k, t in s.items()}
        else:
            if s.keys() != like.keys():
                diff = sorted(set(s) ^ set(like))
                raise ValueError(f"average_states: state {n} has other tensors than state 0: {diff[:8]}")
            bad = [k for k in like if (s[k].shape, s[k].dtype) != like[k]]
            if bad:
                raise ValueError(f"average_states: state {n} differs from state 0 in shape or dtype at {bad[:8]}")
            for k in total:
                total[k] += s[k].detach().to(torch.float64)
        n += 1
    if n == 0:
        raise ValueError("average_states: no state dicts to average")
    return {k: (t / n).to(like[k][1]) for k, t in total.items()}


def average_checkpoints(run_dir: str | Path, last: int, *, fingerprint: str, names: Iterable[str],
                        source: str = "this run") -> tuple[dict[str, torch.Tensor], list[int]]:
    """The mean of the model weights `names` at the newest `last` checkpoints of `run_dir`, and
    their steps (ascending). The checkpoints are read one at a time, each verified
    (llm.train.checkpoint.load_checkpoint) and required to carry `fingerprint` (`source` names where
    that fingerprint comes from, for the error)."""
    run_dir, names = Path(run_dir), set(names)
    if last < 1:
        raise ValueError(f"--last must be at least 1, got {last}")
    found = list_checkpoints(run_dir)  # newest first
    if len(found) < last:
        raise ValueError(f"{run_dir}: {len(found)} checkpoint(s) ({', '.join(p.name for _, p in found) or 'none'}),"
                         f" fewer than the {last} to average; average fewer (--last, or sft.average_last), or keep"
                         f" more (<stage>.keep_checkpoints)")
    steps: list[int] = []

    def states():
        for _, path in found[:last]:
            c = load_checkpoint(path)
            if c.fingerprint != fingerprint:
                raise CheckpointError(f"{path}: comes from other params or inputs than {source} (fingerprint"
                                      f" {c.fingerprint[:12]}, not {str(fingerprint)[:12]}); average the run that"
                                      f" wrote {source}")
            missing = sorted(names - set(c.model_state))
            if missing:
                raise CheckpointError(f"{path}: lacks {missing[:8]}, which {source} has")
            steps.append(c.step)
            yield {k: v for k, v in c.model_state.items() if k in names}

    state = average_states(states())
    return state, sorted(steps)


def average_run(run_dir: str | Path, like: str | Path, out: str | Path, last: int = 2, force: bool = False) -> dict:
    """Write the mean of the last `last` checkpoints of `run_dir` as a model directory `out`
    shaped like `like`; returns the new directory's meta. The checkpoints must carry `like`'s
    fingerprint; nothing is written unless all of them pass (average_checkpoints). `out` must be
    new or empty, or (`force`) a model directory as save_model_dir wrote it, unchanged
    (llm.nn.artifacts.is_model_dir); never one of the inputs, inside one or above one
    (llm.fileio.check_target)."""
    from llm.fileio import check_target
    from llm.nn.artifacts import is_model_dir, load_model_dir, save_model_dir

    run_dir, like, out = Path(run_dir), Path(like), Path(out)
    check_target(out, inputs=[run_dir, like], force=force, kind="model directory", replaceable=is_model_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no run directory here (run the stage first, e.g. `dvc repro sft`)")
    model, tokenizer, meta = load_model_dir(like)
    state, steps = average_checkpoints(run_dir, last, fingerprint=meta.get("fingerprint"),
                                       names=model.state_dict(), source=str(like))
    model.load_state_dict(state, strict=True)
    new_meta = {k: meta[k] for k in KEPT_META if k in meta}
    new_meta["averaged_checkpoints"] = steps
    new_meta["averaged_from"] = str(run_dir)
    save_model_dir(out, model, tokenizer, new_meta)
    return new_meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llm.average", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("run_dir", type=Path, help="the stage's run directory, e.g. runs/sft")
    ap.add_argument("like", type=Path, help="the model directory the stage wrote from it, e.g. models/sft")
    ap.add_argument("out", type=Path, help="the averaged model directory to write, e.g. models/sft_avg")
    ap.add_argument("--last", type=int, default=2, help="how many of the newest checkpoints (default: %(default)s)")
    ap.add_argument("--force", action="store_true",
                    help="replace `out` if it is a model directory this project wrote, unchanged (its meta.json lists"
                         " every file and its hash; never the run's or `like`, nor a directory of other things);"
                         " the new one is written beside it and swapped in")
    args = ap.parse_args(argv)
    try:
        meta = average_run(args.run_dir, args.like, args.out, last=args.last, force=args.force)
    except (FileNotFoundError, ValueError, CheckpointError, DiskFullError) as e:
        print(f"average: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # atomic_dir has removed its temp dir; out is as it was
        print(f"average: interrupted; {args.out} is as it was", file=sys.stderr)
        return 130
    steps = meta["averaged_checkpoints"]
    print(f"average: steps {', '.join(map(str, steps))} of {args.run_dir} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
