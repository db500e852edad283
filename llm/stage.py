"""The `main()` of every stage: arguments, params, the runtime, and errors as one line.

Every `stages/<name>.py` ends the same way:

    def main(argv=None) -> int:
        return stage_main("sft", __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, torchrun=True)

and `dvc.yaml` runs it with every path it reads and writes on the command line, so each path
is written once, in dvc.yaml (tests/test_dvc.py checks each one against the stage's deps and
outs):

    python -m stages.sft --base models/base --data data/clean_sft ... --model models/sft ...

`inputs` and `outputs` name the stage's path options and say what each holds; they are
required, and `--help` lists them. Every stage also takes `--params FILE` and
`--no-progress`. `work(args, common, cfg, rt)` does the stage's work with `args.<name>` as
Paths and returns the line to print (None on ranks > 0).

`setup`: for stages that run a model, `llm.runtime.setup_runtime` (threads, the CPU kernels
switch, the device and dtype, the process group); with `torchrun=True` and common.nproc > 1
the stage re-runs itself under `torchrun --standalone --nproc_per_node=<nproc>`. Data stages
pass none and get rt=None. (This module imports neither torch nor llm/runtime.py, so editing
the training code never reruns a data stage under DVC.)

A ConfigError from the params, or any error a user or an input file can cause (STAGE_ERRORS,
plus the stage's own `errors`), prints "<stage>: <message>" on stderr and returns 1; anything
else is a bug and keeps its traceback. The process group is torn down whatever happens.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

from llm.config import CommonConfig, ConfigError, load_sections
from llm.errors import CheckpointError, NonFiniteError, QualityGateError
from llm.fileio import DataError

# What a user or an input file can cause; anything else is a bug and keeps its traceback.
STAGE_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError, ValueError, FileNotFoundError,
                                             CheckpointError, NonFiniteError, QualityGateError)

Work = Callable[[argparse.Namespace, Any, Any, Any], "str | None"]


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


# Outputs that DVC does not track: a stage's working directory, kept between runs and git-ignored.
# A killed run resumes from it, and an experiment that changes it leaves the baseline unchanged.
UNTRACKED_OUTPUTS = frozenset({"run_dir"})


def training_outputs(model: str) -> dict[str, str]:
    """The outputs every training stage has: its run directory, model, metrics and curves."""
    return {"run_dir": "checkpoints, TensorBoard events and live curves (kept between runs; not a DVC output)",
            "model": model, "metrics": "the metrics JSON", "plots": "the dvc plots directory"}


def _stage_error(stage: str, e: Exception) -> int:
    msg = str(e)  # some messages (quality gates) already start with the stage's name
    print(msg if msg.startswith(f"{stage}: ") else f"{stage}: {msg}", file=sys.stderr)
    return 1


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def stage_main(stage: str, doc: str, argv: list[str] | None, *, work: Work, inputs: dict[str, str],
               outputs: dict[str, str], section: str | None = None,
               setup: Callable[[CommonConfig], Any] | None = None, torchrun: bool = False,
               errors: tuple[type[Exception], ...] = (),
               options: Callable[[argparse.ArgumentParser], object] | None = None) -> int:
    """`python -m stages.<stage> --<input> PATH ... --<output> PATH ... [--params FILE]`; returns the exit status.

    doc       the stage's docstring: its first paragraph is --help's description, all of it the epilog
    section   the params section the stage reads besides `common` (default: the stage's name)
    options   options(parser) adds the stage's other command-line options
    """
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    ap.add_argument("--params", default="params.yaml", help="the params file (default: %(default)s)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    for title, paths in (("inputs (dvc.yaml passes them)", inputs), ("outputs (dvc.yaml passes them)", outputs)):
        group = ap.add_argument_group(title)
        for name, what in paths.items():
            group.add_argument(_option(name), dest=name, type=Path, required=True, metavar="PATH", help=what)
    if options is not None:
        options(ap)
    args = ap.parse_args(argv)
    section = section or stage
    try:
        sections = load_sections(["common", section], args.params)
    except ConfigError as e:
        return _stage_error(stage, e)
    common, cfg = sections["common"], sections[section]
    if setup is None:
        try:
            summary = work(args, common, cfg, None)
        except (*STAGE_ERRORS, *errors) as e:
            return _stage_error(stage, e)
    else:
        if common.nproc > 1 and not torchrun:
            print(f"{stage}: runs in one process (common.nproc={common.nproc} applies to the stages that train"
                  f" under torchrun)", flush=True)
        elif common.nproc > 1 and not under_torchrun():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={common.nproc}",
                   "-m", f"stages.{stage}", *argv]
            print(f"{stage}: common.nproc={common.nproc}: re-running under torchrun: {' '.join(cmd[1:])}", flush=True)
            os.execv(sys.executable, cmd)  # does not return
        rt = None
        try:
            rt = setup(common)
            summary = work(args, common, cfg, rt)
        except (*STAGE_ERRORS, *errors) as e:
            return _stage_error(stage, e)
        finally:
            if rt is not None:
                rt.close()
    if summary is not None:
        print(summary)
    return 0
