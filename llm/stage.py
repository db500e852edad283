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
`--no-progress`. A stage with `variants` ({name: {key: value}}) also takes `--variant NAME`:
it then runs as the stage NAME (messages, and the file names its `work` derives from
`args.variant`) from its own params section with those keys forced, so that dvc.yaml can
run it twice, as `ppo` and as `ppo_rm`, and `dvc exp run -S ppo.lr=...` reruns both.
`work(args, common, cfg, rt)` does the stage's work with `args.<name>` as
Paths and returns the line to print (None on ranks > 0).

`setup`: for stages that run a model, `llm.runtime.setup_runtime` (threads, the CPU kernels
switch, the device and dtype, the process group). Data stages pass none and get rt=None.
(This module imports torch only to launch processes, and never llm/runtime.py, so editing
the training code never reruns a data stage under DVC.)

Several processes (`torchrun=True` and common.nproc x common.nnodes > 1): the stage checks
what it can before starting anything (the params' divisibility by the number of processes,
common.nproc against the GPUs present) and then runs itself under torchrun's launcher,
`torch.distributed.run` (the code behind the `torchrun` command, called in-process so that
its failures can be reported in one line): common.nproc processes on this machine, on one
machine `--standalone`, on several a c10d rendezvous at common.rdzv_endpoint that every
other machine joins with `python -m llm.stage join <stage>` (docs/scale.md). Each process
runs the same `python -m stages.<name> ...` with torchrun's environment, so the code path is
the one of a single process. What the launcher reports:

- a rendezvous that does not complete within common.rdzv_timeout (an endpoint that cannot be
  reached, a machine that never joins): "<stage>: the rendezvous at HOST:PORT ...", exit 1;
- a process that fails: the launcher stops the others, and the stage prints the failing
  rank's own message (a stage error, an exception, or the signal that killed it), exit 1;
- SIGTERM/SIGINT: passed on to the processes, which checkpoint and stop (llm/train/loop.py).

A ConfigError from the params, or any error a user, an input file or a full disk can cause
(STAGE_ERRORS, plus the stage's own `errors`; a full disk names the file being written, or else
the stage's outputs), prints "<stage>: <message>" on stderr and returns 1 (under
the launcher the message goes to it, and it prints the failing rank's); anything else is a
bug and keeps its traceback. A refused params file adds one line (`params_hint`): under
`dvc repro` the stage's outputs are gone by then (DVC deletes them before running it), and
`dvc checkout <stage>` brings the previous ones back from the cache. The process group is torn down whatever happens.

    python -m llm.stage join <stage> [--params params.yaml]

runs the command dvc.yaml gives <stage> (eval@<model> for one of eval's), to join from
another machine the run that `dvc repro <stage>` starts on the head one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

from llm.config import CommonConfig, ConfigError, load_sections
from llm.errors import CheckpointError, DiskFullError, NonFiniteError, QualityGateError
from llm.fileio import DataError, naming_full_disk

# What a user, an input file or a full disk can cause; anything else is a bug and keeps its traceback.
STAGE_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError, ValueError, FileNotFoundError,
                                             CheckpointError, NonFiniteError, QualityGateError, DiskFullError)

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


def params_hint(stage: str, params: str | Path) -> str:
    """The line added to a refused params file: `dvc repro` deleted the stage's outputs before
    running it (DVC removes a stage's outs first), and the cache still holds the previous ones."""
    return (f"fix the key in {params}, then `dvc repro`; or get {stage}'s previous outputs back (`dvc repro`"
            f" removed them before running it): `dvc checkout {stage}` from the DVC cache, `git checkout -- <path>`"
            f" for those kept in git (`cache: false` in dvc.yaml)")


def _stage_error(stage: str, e: Exception, params: str | Path | None = None) -> int:
    msg = str(e)  # some messages (quality gates) already start with the stage's name
    line = msg if msg.startswith(f"{stage}: ") else f"{stage}: {msg}"
    if isinstance(e, ConfigError) and params is not None:
        line += "\n" + params_hint(stage, params)
    if not _tell_launcher(line, stage_error=True):
        print(line, file=sys.stderr)
    return 1


def _tell_launcher(message: str, *, stage_error: bool) -> bool:
    """Under torchrun's launcher, leave `message` in the error file it reads when this process
    exits non-zero (it then reports one failing rank instead of every rank repeating the same
    line); False when there is no launcher to tell."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE") if under_torchrun() else None
    if not path:
        return False
    rank = os.environ.get("RANK", "?")
    now = time.time()  # "timestamp" is whole seconds (what torchrun reads); "time" orders the failures
    Path(path).write_text(json.dumps({"message": message, "timestamp": int(now), "time": now, "rank": rank,
                                      "stage_error": stage_error}), encoding="utf-8")
    return True


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def stage_main(stage: str, doc: str, argv: list[str] | None, *, work: Work, inputs: dict[str, str],
               outputs: dict[str, str], section: str | None = None,
               setup: Callable[[CommonConfig], Any] | None = None, torchrun: bool = False,
               errors: tuple[type[Exception], ...] = (),
               options: Callable[[argparse.ArgumentParser], object] | None = None,
               module: str | None = None, variants: dict[str, dict[str, Any]] | None = None) -> int:
    """`python -m stages.<stage> --<input> PATH ... --<output> PATH ... [--params FILE]`; returns the exit status.

    doc       the stage's docstring: its first paragraph is --help's description, the rest the epilog
    section   the params section the stage reads besides `common` (default: the stage's name)
    options   options(parser) adds the stage's other command-line options
    torchrun  the stage runs as several processes when common.nproc x common.nnodes > 1
    module    what each process runs (`python -m <module> argv`; default stages.<stage>)
    variants  {name: {key: value}}: `--variant name` forces those keys of the section and runs
              as `name` (args.variant; the stage's name without the option)
    """
    argv = sys.argv[1:] if argv is None else argv
    description, _, epilog = doc.partition("\n\n")
    ap = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    ap.add_argument("--params", default="params.yaml", help="the params file (default: %(default)s)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    for title, paths in (("inputs (dvc.yaml passes them)", inputs), ("outputs (dvc.yaml passes them)", outputs)):
        group = ap.add_argument_group(title)
        for name, what in paths.items():
            group.add_argument(_option(name), dest=name, type=Path, required=True, metavar="PATH", help=what)
    if options is not None:
        options(ap)
    if variants:
        what = "; ".join(f"{v}: " + ", ".join(f"{k}={x}" for k, x in keys.items()) for v, keys in variants.items())
        ap.add_argument("--variant", choices=sorted(variants), default=stage,
                        help=f"run as this variant of the stage, with these keys of its section forced: {what}")
    args = ap.parse_args(argv)
    section = section or stage
    module = module or f"stages.{stage}"
    stage = getattr(args, "variant", stage)  # from here on, the name it runs as
    try:
        sections = load_sections(["common", section], args.params)
        common, cfg = sections["common"], sections[section]
        if stage in (variants or {}):
            cfg = forced(cfg, variants[stage], section, f"--variant {stage}")
    except ConfigError as e:
        return _stage_error(stage, e, args.params)

    def guarded(rt: Any) -> str | None:  # a full disk anywhere in the stage: one line naming what was written
        with naming_full_disk(*(f"{_option(n)} {getattr(args, n)}" for n in outputs)):
            return work(args, common, cfg, rt)

    if setup is None:
        try:
            summary = guarded(None)
        except (*STAGE_ERRORS, *errors) as e:
            return _stage_error(stage, e, args.params)
    else:
        if common.world_size > 1 and not torchrun:
            print(f"{stage}: runs in one process (common.nproc={common.nproc} applies to the stages that run"
                  f" under torchrun)", flush=True)
        elif common.world_size > 1 and not under_torchrun():
            try:
                check_placement(common, cfg, section)
            except ConfigError as e:
                return _stage_error(stage, e, args.params)
            return launch(stage, module, argv, common)
        rt = None
        try:
            rt = setup(common)
            summary = guarded(rt)
        except (*STAGE_ERRORS, *errors) as e:
            return _stage_error(stage, e, args.params)
        except Exception as e:  # a bug: the traceback goes to stderr, its last line to the launcher
            _tell_launcher(f"{type(e).__name__}: {e}", stage_error=False)
            raise
        finally:
            if rt is not None:
                rt.close()
    if summary is not None:
        print(summary)
    return 0


def forced(cfg: Any, values: dict[str, Any], section: str, where: str) -> Any:
    """`cfg` (a section's dataclass) with the keys of `values` set to them, checked as params.yaml
    would be (a ConfigError names `where` and the dotted key)."""
    from llm.config import from_dict
    return from_dict(type(cfg), {**dataclasses.asdict(cfg), **values}, where, section)


# ---------------------------------------------------------------------------
# Several processes: checks, the launcher, joining from another machine

def check_placement(common: CommonConfig, cfg: Any, section: str) -> None:
    """What can be checked before any process starts: that the section's per-step work shares
    out equally over common.world_size processes (its `check_world`), and that a machine has a
    GPU for each of its common.nproc processes when they run on GPUs. Raises ConfigError."""
    problems = list(cfg.check_world(section, common)) if hasattr(cfg, "check_world") else []
    import torch
    on_gpu = common.device == "cuda" or (common.device == "auto" and torch.cuda.is_available())
    if on_gpu:
        count = torch.cuda.device_count()
        if common.nproc > count:
            problems.append(f"common.nproc: {common.nproc} processes per machine, one per GPU, but this machine has"
                            f" {count} GPU(s) (torch.cuda.device_count()); set common.nproc to at most {count},"
                            f" or common.device: cpu to run the processes on the CPU")
    if problems:
        raise ConfigError(problems)


def rendezvous(common: CommonConfig) -> tuple[str, str]:
    """(endpoint, id) of a several-machine run, with the environment variables they name read
    now; an unset one is a ConfigError naming the key and the variable."""
    out, problems = [], []
    for key in ("rdzv_endpoint", "rdzv_id"):
        value = getattr(common, key)
        got = os.path.expandvars(value)
        if "$" in got:
            problems.append(f"common.{key}: {value!r} names an environment variable that is not set on this"
                            f" machine; export it on every machine before the stage starts")
        out.append(got)
    if problems:
        raise ConfigError(problems)
    return out[0], out[1]


def torchrun_args(common: CommonConfig, module: str, argv: list[str]) -> list[str]:
    """The `torchrun` arguments that run `python -m module argv` as this run's processes."""
    out = [f"--nnodes={common.nnodes}", f"--nproc-per-node={common.nproc}", "--max-restarts=0"]
    if common.nnodes == 1:
        out.append("--standalone")
    else:
        endpoint, run_id = rendezvous(common)
        t = common.rdzv_timeout
        out += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
                f"--rdzv-conf=join_timeout={t},read_timeout={t}"]
    return out + ["-m", module, *argv]


def launch(stage: str, module: str, argv: list[str], common: CommonConfig) -> int:
    """Run the stage as common.nproc processes on this machine (of common.world_size in all) under
    torch.distributed.run, and turn its failures into one line; returns the exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        args = torchrun_args(common, module, argv)
    except ConfigError as e:
        return _stage_error(stage, e)
    endpoint = rendezvous(common)[0] if common.nnodes > 1 else ""
    where = (f"{common.nproc} processes on this machine" if common.nnodes == 1 else
             f"{common.nproc} processes on each of {common.nnodes} machines, meeting at {endpoint}"
             f" (the others join with `python -m llm.stage join {stage}`)")
    print(f"{stage}: {where}: torchrun {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    try:
        torchrun.run(torchrun.parse_args(args))
    except ChildFailedError as e:
        print(failure_line(stage, e.failures, common.world_size), file=sys.stderr, flush=True)
        return 1
    except RendezvousError as e:
        print(f"{stage}: the rendezvous at {endpoint} (common.rdzv_endpoint, job"
              f" {rendezvous(common)[1]!r}) did not complete in {time.monotonic() - t0:.0f} s (common.rdzv_timeout="
              f"{common.rdzv_timeout}): {type(e).__name__}: {e}. Check that the endpoint's host is reachable"
              f" from here and the port is free there, and that all {common.nnodes} machines run the stage with"
              f" the same params", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # the processes got the signal too: they checkpoint and stop
        print(f"{stage}: {e.sigval.name}: stopped the processes", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


# How a collective fails when a peer process has gone: a consequence, never the root cause
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted")


def failure_line(stage: str, failures: dict[int, Any], world: int) -> str:
    """One line naming the rank whose failure came first in the chain of causes, and why;
    `failures` is torchrun's {rank: ProcessFailure}. In order: a stage error (the message the
    rank would have printed), an exception (a bug), a death by a signal other than SIGTERM (the
    OOM killer's SIGKILL, a crash), a SIGTERM (usually the launcher stopping the others), a
    collective that failed because a peer had gone, anything else; ties go to the earliest."""
    def data(f) -> dict:
        d = f.error_file_data if isinstance(f.error_file_data, dict) else {}
        return d if d.get("message") != "<NONE>" else {}  # torchrun's stand-in when there is no error file

    def kind(f) -> int:
        if data(f).get("stage_error"):
            return 0
        if data(f):
            return 4 if any(p in f.message for p in _PEER_GONE) else 1
        if f.exitcode < 0:
            return 3 if f.exitcode == -15 else 2
        return 5

    rank, f = min(failures.items(), key=lambda rf: (kind(rf[1]), data(rf[1]).get("time", rf[1].timestamp), rf[0]))
    if data(f):  # its own message, even if the launcher's SIGTERM then caught it shutting down
        why = f.message.removeprefix(f"{stage}: ")
    elif f.exitcode < 0:
        why = f"killed by {f.signal_name()} (exit code {f.exitcode})"
    else:
        why = f"exit code {f.exitcode} (no message; see its output above)"
    others = sorted(r for r in failures if r != rank)
    tail = f"; rank(s) {', '.join(map(str, others))} stopped with it" if others else ""
    return f"{stage}: rank {rank} of {world} failed: {why}{tail}"


def join_command(stage: str, dvc_yaml: str | Path = "dvc.yaml") -> list[str]:
    """The argv (after `python -m`) of `stage` as dvc.yaml runs it; `eval@sft` names one item of a foreach."""
    import yaml
    name, _, item = stage.partition("@")
    stages = yaml.safe_load(Path(dvc_yaml).read_text(encoding="utf-8")).get("stages", {})
    if name not in stages:
        raise ConfigError([f"{dvc_yaml}: no stage {name!r}; stages: {', '.join(stages)}"])
    st = stages[name]
    if "foreach" in st:
        if item not in st["foreach"]:
            raise ConfigError([f"{dvc_yaml}: {name} runs once per item; name one: "
                               + ", ".join(f"{name}@{x}" for x in st["foreach"])])
        cmd = st["do"]["cmd"].replace("${item}", item)
    else:
        cmd = st["cmd"]
    argv = shlex.split(cmd)
    if argv[:2] != ["python", "-m"]:
        raise ConfigError([f"{dvc_yaml}: stage {stage}: expected `python -m ...`, got {cmd!r}"])
    return argv[2:]


def main(argv: list[str] | None = None) -> int:
    """`python -m llm.stage join <stage>`: run dvc.yaml's command of <stage> here, to join from
    another machine the several-machine run that `dvc repro <stage>` starts on the head one."""
    ap = argparse.ArgumentParser(prog="python -m llm.stage", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("join", help="join another machine's run of a stage (common.nnodes > 1)")
    j.add_argument("stage", help="the stage, as `dvc repro` names it: pretrain, grpo, eval@sft, ...")
    j.add_argument("--dvc-yaml", default="dvc.yaml", help="the pipeline file (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        module, *stage_argv = join_command(args.stage, args.dvc_yaml)
        params = stage_argv[stage_argv.index("--params") + 1] if "--params" in stage_argv else "params.yaml"
        common = load_sections(["common"], params)["common"]
        if common.nnodes < 2:
            raise ConfigError([f"{params}: common.nnodes is {common.nnodes}: there is no other machine to join;"
                               f" run the stage with `dvc repro {args.stage}`"])
    except ConfigError as e:
        print(f"join: {e}", file=sys.stderr)
        return 1
    import importlib
    print(f"join: {args.stage}: python -m {module} {' '.join(stage_argv)}", flush=True)
    return importlib.import_module(module).main(stage_argv)


if __name__ == "__main__":
    raise SystemExit(main())
