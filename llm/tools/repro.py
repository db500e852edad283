"""`dvc repro` with independent stages side by side: `python -m llm.repro [-j N] [TARGET ...]`.

    python -m llm.repro              # the whole pipeline, as many stages at a time as usable CPUs
    python -m llm.repro -j 1         # one at a time, in the same order `dvc repro` would choose
    python -m llm.repro eval@grpo    # that stage and what it depends on
    python -m llm.repro --dry-run    # the plan: every stage, what it waits for, its priority
    python -m llm.repro -f -s eval@sft eval@ppo   # rerun just those two, up to date or not (timing them)

`dvc repro` runs one stage at a time. Every stage of this pipeline but pretraining's steps runs
on one thread (llm/threads.py says why), so on a 2-core machine `dvc repro` leaves a core idle
for most of the run, while GRPO, its control, PPO on the reward model alone, DPO and most
evaluations depend on nothing the others make. This command reads the pipeline's graph from DVC
and runs `dvc repro --single-item STAGE` for each stage once every stage it depends on has
finished, up to --jobs of them at a time. DVC still decides whether a stage is up to date and
runs, caches and records it in dvc.lock exactly as `dvc repro` does (DVC releases its repository
lock while a stage's command runs, so independent stages may run at once: DVC's documented way to
run parallel branches); a `dvc repro` afterwards finds nothing to do.

Which ready stage goes first: the one with the longest chain of work still behind it, each
stage weighted by the seconds it took the last time this command ran it (runs/repro/seconds.json,
beside the per-stage logs runs/repro/<stage>.log), or else by the seconds the stages recorded in
metrics/ on their last run, or else by the committed report card's row of stage times
(metrics/report.md, in git: what a fresh clone has), 60 s a stage where none of them has a figure. A stage that
fails stops the run: no new stage starts, the running ones finish, and the command prints the
failed stage's last lines and its log's path and exits 1. Ctrl-C stops every running stage.

The results do not depend on what ran beside a stage: each stage fixes its own thread count
(pretraining's `auto` keeps only counts that train one thread's bits; llm/threads.py) and its
own seeds. A GPU profile (`common.device: cuda`) defaults to one stage at a time, since two
stages would share one card's memory.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

LOG_DIR = Path("runs/repro")
DEFAULT_SECONDS = 60.0
LOCK_BUSY = "Unable to acquire lock"  # another dvc process holds the repository lock for a moment
LOCK_RETRIES = 120


def pipeline_graph(root: Path = Path(".")) -> dict[str, list[str]]:
    """{stage: [stages it depends on]} for every stage of dvc.yaml (`eval@sft` for a foreach item),
    read through DVC's own index, so it is the graph `dvc repro` follows."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        graph = repo.index.graph
        stages = [s for s in graph.nodes if getattr(s, "cmd", None)]
        names = {s: s.addressing for s in stages}
        return {names[s]: sorted(names[d] for d in graph.successors(s) if d in names) for s in stages}


def upstream(graph: dict[str, list[str]], targets: list[str]) -> dict[str, list[str]]:
    """The part of `graph` that `targets` need: them and everything they depend on."""
    unknown = [t for t in targets if t not in graph]
    if unknown:
        raise SystemExit(f"llm.repro: no stage {', '.join(unknown)} in dvc.yaml (stages: {', '.join(graph)})")
    keep, todo = set(), list(targets)
    while todo:
        s = todo.pop()
        if s not in keep:
            keep.add(s)
            todo.extend(graph[s])
    return {s: deps for s, deps in graph.items() if s in keep}


def priorities(graph: dict[str, list[str]], seconds: dict[str, float]) -> dict[str, float]:
    """Each stage's own seconds plus the longest chain of seconds that waits on it (the
    critical-path rule: start first what the most work is queued behind)."""
    dependents: dict[str, list[str]] = {s: [] for s in graph}
    for s, deps in graph.items():
        for d in deps:
            dependents[d].append(s)
    rank: dict[str, float] = {}

    def visit(s: str) -> float:
        if s not in rank:
            rank[s] = seconds.get(s, DEFAULT_SECONDS) + max((visit(t) for t in dependents[s]), default=0.0)
        return rank[s]

    for s in graph:
        visit(s)
    return rank


@dataclass
class Running:
    stage: str
    proc: subprocess.Popen
    log: Path
    started: float
    tries: int = 1
    fh: object = field(default=None, repr=False)


def _log_name(stage: str) -> str:
    return stage.replace("@", "_at_").replace("/", "_") + ".log"


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def default_jobs(params: Path = Path("params.yaml")) -> int:
    """Usable CPUs; 1 when params.yaml puts the stages on a GPU (`common.device: cuda`)."""
    try:
        import yaml

        device = str((yaml.safe_load(params.read_text()) or {}).get("common", {}).get("device", "cpu"))
    except (OSError, ValueError):
        device = "cpu"
    if device.startswith("cuda"):
        return 1
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def known_seconds(log_dir: Path = LOG_DIR, metrics: Path = Path("metrics")) -> tuple[dict[str, float], str]:
    """({stage: seconds}, where they came from) for the priorities (module docstring)."""
    try:
        got = json.loads((log_dir / "seconds.json").read_text())
        return {k: float(v) for k, v in got.items()}, str(log_dir / "seconds.json")
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    if metrics.is_dir():
        from llm.eval.report import collect, stage_times

        try:
            got = {s: t for s, t, _ in stage_times(collect(metrics)) if t is not None}
        except (OSError, ValueError, KeyError, TypeError):
            got = {}
        if got:
            return got, f"the seconds recorded in {metrics}/"
        got = report_seconds(metrics / "report.md")
        if got:
            return got, f"the stage times of {metrics / 'report.md'}"
    return {}, f"{DEFAULT_SECONDS:.0f} s a stage"


def report_seconds(report: Path) -> dict[str, float]:
    """{stage: seconds} from the report card's table of stage times (llm/eval/report.py
    stage_seconds_row); {} when it cannot be read."""
    from llm.eval.report import stage_seconds_row

    try:
        return stage_seconds_row(report.read_text(encoding="utf-8"))
    except OSError:
        return {}


def run(graph: dict[str, list[str]], jobs: int, *, dvc: list[str], log_dir: Path = LOG_DIR,
        metrics: Path = Path("metrics"), force: bool = False, say=print, poll: float = 0.5) -> int:
    """Run every stage of `graph` through `dvc repro --single-item`, up to `jobs` at a time
    (module docstring). 0 when every stage finished, 1 when one failed, 130 on Ctrl-C."""
    log_dir.mkdir(parents=True, exist_ok=True)
    times_file = log_dir / "seconds.json"
    seconds, _ = known_seconds(log_dir, metrics)
    rank = priorities(graph, seconds)
    done: set[str] = set()
    waiting = sorted(graph, key=lambda s: -rank[s])
    running: list[Running] = []
    failed: str | None = None
    t0 = time.monotonic()
    report: list[tuple[str, float, str]] = []

    def stamp() -> str:
        return f"[{time.monotonic() - t0:6.0f} s]"

    def launch(stage: str, tries: int = 1) -> Running:
        log = log_dir / _log_name(stage)
        fh = open(log, "w", encoding="utf-8")
        argv = [*dvc, "repro", "--single-item", *(["--force"] if force else []), stage]
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        return Running(stage, proc, log, time.monotonic(), tries, fh)

    try:
        while waiting or running:
            while failed is None and len(running) < jobs:
                ready = [s for s in waiting if all(d in done for d in graph[s])]
                if not ready:
                    break
                stage = ready[0]
                waiting.remove(stage)
                running.append(launch(stage))
                say(f"{stamp()} start  {stage} ({len(running)} running, {len(waiting)} waiting)")
            if not running:
                break  # a failure left stages that will not start
            time.sleep(poll)
            for r in list(running):
                rc = r.proc.poll()
                if rc is None:
                    continue
                r.fh.close()
                running.remove(r)
                text = r.log.read_text(errors="replace")
                if rc != 0 and LOCK_BUSY in text and r.tries < LOCK_RETRIES:
                    time.sleep(1.0)  # DVC's repository lock was held by the other stage for a moment
                    running.append(launch(r.stage, r.tries + 1))
                    continue
                took = time.monotonic() - r.started
                if rc != 0:
                    failed = failed or r.stage
                    report.append((r.stage, took, f"failed (exit status {rc})"))
                    say(f"{stamp()} FAILED {r.stage} after {took:.0f} s (exit status {rc}); its log, {r.log}, ends:")
                    say(_tail(r.log))
                    continue
                ran = "Running stage" in text
                done.add(r.stage)
                if ran:
                    seconds[r.stage] = round(took, 1)
                report.append((r.stage, took, "ran" if ran else "up to date"))
                say(f"{stamp()} done   {r.stage} in {took:.0f} s ({'ran' if ran else 'up to date'})")
    except KeyboardInterrupt:
        for r in running:
            with_signal(r.proc, signal.SIGINT)
        for r in running:
            r.proc.wait()
        say(f"{stamp()} stopped: Ctrl-C; the stages that finished are in dvc.lock")
        return 130
    finally:
        times_file.write_text(json.dumps(seconds, indent=1, sort_keys=True) + "\n")

    wall = time.monotonic() - t0
    ran = [(s, t) for s, t, how in report if how == "ran"]
    say(f"llm.repro: {len(ran)} stage(s) ran, {sum(how == 'up to date' for _, _, how in report)} up to date, in"
        f" {wall / 60:.1f} min with up to {jobs} at a time (the stages' own times add up to"
        f" {sum(t for _, t in ran) / 60:.1f} min); logs in {log_dir}/")
    if failed:
        say(f"llm.repro: {failed} failed; not started: {', '.join(waiting) or 'none'}. Fix it and run again:"
            f" the finished stages are recorded and will not rerun")
        return 1
    return 0


def with_signal(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group of a `dvc repro` (DVC and the stage it runs)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llm.repro", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="*", help="stages to bring up to date, with what they depend on (default: all)")
    ap.add_argument("-j", "--jobs", type=int, default=0,
                    help="stages at a time; 0 = the usable CPUs (1 on a GPU profile)")
    ap.add_argument("-s", "--single-item", action="store_true",
                    help="only the named targets, not what they depend on (as `dvc repro -s`)")
    ap.add_argument("-f", "--force", action="store_true",
                    help="run the stages even where DVC finds them up to date (as `dvc repro -f`)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    args = ap.parse_args(argv)
    if not Path("dvc.yaml").is_file():
        print("llm.repro: no dvc.yaml here; run it from the repository's root", file=sys.stderr)
        return 2
    try:
        graph = pipeline_graph()
    except Exception as e:  # DVC's own errors (a dvc.yaml it cannot parse, a missing dependency file...)
        print(f"llm.repro: DVC could not read the pipeline: {e}{f' ({e.__cause__})' if e.__cause__ else ''};"
              f" `dvc dag` shows the same problem", file=sys.stderr)
        return 2
    if args.targets:
        graph = upstream(graph, args.targets)
        if args.single_item:  # the targets alone; a target still waits for any target it needs, however far up
            graph = {s: sorted(t for t in upstream(graph, [s]) if t in args.targets and t != s)
                     for s in graph if s in args.targets}
    elif args.single_item:
        print("llm.repro: -s/--single-item needs the stages to run", file=sys.stderr)
        return 2
    jobs = args.jobs if args.jobs > 0 else default_jobs()
    if args.dry_run:
        seconds, source = known_seconds()
        rank = priorities(graph, seconds)
        print(f"llm.repro: {len(graph)} stages, up to {jobs} at a time; priority = seconds of the longest chain"
              f" from the stage on ({source})")
        for s in sorted(graph, key=lambda s: -rank[s]):
            print(f"  {s:<20} {rank[s]:8.0f}  after {', '.join(graph[s]) or '-'}")
        return 0
    return run(graph, jobs, dvc=[sys.executable, "-m", "dvc"], force=args.force)


if __name__ == "__main__":
    raise SystemExit(main())
