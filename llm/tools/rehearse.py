"""Rehearse a profile: its whole DAG at the profile's real model shapes, cut short, on the CPU.

    python -m llm.rehearse gpu-13m [--keep]

A GPU profile cannot run here, but everything except the device can: the layers, width, heads,
vocabulary and context of the model; every stage's code path at those shapes; the files each
stage hands the next. `rehearse` copies the working tree (the files git tracks or would track:
uncommitted edits included, data/ and models/ not) into a scratch directory, writes its
params.yaml from the profile with the cuts below, asks DVC for the stages and their commands in
order (`dvc repro --dry --force`: dvc.yaml's templating and `foreach` resolved by DVC itself),
runs each command there in turn and prints one table:

    stage, ok or the error (its last line), seconds, peak resident memory of the stage's
    process tree (os.wait4), the most weights + gradients + optimizer state it holds at once
    (exact, from the shapes) and llm/nn/memory.py's estimate of its largest phase, both at the
    rehearsal's own settings (fp32 on the CPU, the cut batch sizes), so the estimate can be
    read against the measured peak.

It stops at the first failing stage, and fails a tokenizer that stopped short of the profile's
vocab_size (the models would be smaller than the profile's). Before starting it compares the
largest estimate with the memory the machine has available and refuses (exit 2) with both
figures when it does not fit. bench/gpu_check.py runs the same rehearsal on a GPU in bf16
(`run(..., device="cuda")`).
Each stage's persisted outputs (the training checkpoints: `persist: true` in dvc.yaml) are
deleted once it has passed, so the scratch needs about one checkpoint of disk, not six.

What is cut, and why (everything else keeps the profile's value, so the shapes are real):

    common.device cpu, dtype fp32, nproc 1         the machine this runs on
    prepare.*_train/_val/_test, math_pretrain_docs  generated data down to what every stage needs
    tokenizer.min_frequency 1                       so the smaller corpus still gives the profile's
                                                    vocab_size (pairs seen once are merged too)
    *.max_steps 1, warmup_steps 0                   one optimizer step proves the step runs
    every batch_size / minibatch_size 1,            the smallest batch; grad_accum 1; one epoch
      grad_accum 1, epochs 1, rollout_prompts 1,
      prompts_per_step 1, group_size 2 (its minimum)
      except pairs.batch_size 16                    the 16 prompts in one generate call per
                                                    temperature, not 48 calls (221 s at 77m)
    eval_every, checkpoint_every, log_every 1;      evaluation and checkpointing run once, on
      eval_batches 1                                the single step
    sft.average_last 1                              one step writes one checkpoint to average
    *.max_new_tokens 8                              generation proves the KV-cache path in 8 steps
    sft.eval_math_problems, *.eval_problems,        one problem or prompt each
      *.kl_prompts, eval.* and rankers.* counts 1 (2 samples); prepare.tier_test 3;
      pairs.n_prompts 16 (pairs for DPO's train and val
      splits); eval.sample_prompts its first
    pairs.verify_tasks false                        a one-step model gets no task right: every
                                                    verified prompt would tie and leave DPO no
                                                    pairs; the reward model ranks them instead
    reward.min_accuracy 0, *.max_kl 1e6,            quality gates off: a one-step model is
      grpo.max_zero_std_steps 1000                  not meant to pass them
    pretrain/sft/reward/dpo.compile false           torch.compile on a CPU costs minutes, and
                                                    is a GPU speed setting
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from llm.config import ConfigError
from llm.nn.memory import GIB, format_table, stage_memory
from llm.tools.profile import render, to_yaml

ROOT = Path(__file__).resolve().parents[2]

STEPS = {"max_steps": 1, "warmup_steps": 0, "eval_every": 1, "eval_batches": 1, "log_every": 1,
         "checkpoint_every": 1, "batch_size": 1, "grad_accum": 1, "compile": False}
RL = {"max_steps": 1, "warmup_steps": 0, "minibatch_size": 1, "epochs": 1, "max_new_tokens": 8, "eval_every": 1,
      "eval_problems": 1, "checkpoint_every": 1, "max_kl": 1e6}
CUTS: dict[str, dict] = {
    "common": {"device": "cpu", "dtype": "fp32", "nproc": 1},
    "prepare": {"math_train": 600, "math_val": 50, "math_test": 60, "math_pretrain_docs": 200, "task_train": 200,
                "task_val": 20, "task_test": 3, "arithmetic_test": 14, "arithmetic_train": 40, "pref_train": 200, "pref_val": 40,
                "tier_test": 3},
    "tokenizer": {"min_frequency": 1},
    "pretrain": STEPS,
    "sft": {**STEPS, "eval_math_problems": 1, "max_new_tokens": 8, "average_last": 1},
    "reward": {**STEPS, "min_accuracy": 0.0},
    "pairs": {"n_prompts": 16, "batch_size": 16, "max_new_tokens": 8, "verify_tasks": False},
    "dpo": {**STEPS, "kl_prompts": 1, "max_new_tokens": 8, "max_kl": 1e6},
    "ppo": {**RL, "rollout_prompts": 1},
    "grpo": {**RL, "prompts_per_step": 1, "group_size": 2, "max_zero_std_steps": 1000},
    "eval": {"math_problems": 1, "pass_k": 1, "pass_k_problems": 1, "max_new_tokens": 8, "ppl_batches": 1,
             "rm_prompts": 1, "kl_prompts": 1, "batch_size": 1, "tier_problems": 1, "tier_pass_k": 2,
             "tier_pass_k_problems": 1},
    "rankers": {"problems": 1, "samples": 2, "max_new_tokens": 8, "batch_size": 1},
}


def cut(params: dict, device: str = "cpu") -> dict:
    """A profile's params with the rehearsal's cuts (see the module docstring); a new dict.
    device "cuda": the same cuts in bf16 on a GPU (bench/gpu_check.py's DAG part). A cut key the
    params lack is an error: a renamed key must not leave its stage uncut."""
    out = copy.deepcopy(params)
    for section, values in CUTS.items():
        for k, v in values.items():
            if k not in out[section]:
                raise KeyError(f"llm/tools/rehearse.py cuts {section}.{k}, which the params do not have")
            out[section][k] = v
    out["eval"]["sample_prompts"] = out["eval"]["sample_prompts"][:1]
    if device == "cuda":
        out["common"].update(device="cuda", dtype="bf16")
    return out


OUTPUTS = {".git", ".venv", "data", "models", "runs", "tmp"}  # at the top of the repository
CACHES = {"__pycache__", ".pytest_cache", ".hypothesis"}


def _not_source(src: Path):
    """shutil.copytree's ignore: outputs at the top, caches anywhere, DVC's cache and tmp."""
    def ignore(d: str, names: list[str]) -> set[str]:
        here = Path(d)
        out = {n for n in names if n in CACHES or n.endswith(".pyc")}
        if here == src:
            out |= OUTPUTS & set(names)
        if here == src / ".dvc":
            out |= {"cache", "tmp"} & set(names)
        return out
    return ignore


def scratch_copy(src: Path, dest: Path) -> int:
    """Copy the files git tracks or would track (not ignored) from `src` into `dest`; returns how many.

    Uncommitted edits are rehearsed too; ignored outputs (data/, models/, runs/) are not copied.
    Outside a git work tree (a bare copy of one), everything but those outputs and caches.
    """
    try:
        p = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=src,
                           capture_output=True)
    except OSError:  # no git on this machine
        p = None
    if p is None or p.returncode:  # not a git work tree (e.g. a copy of one): everything but outputs and caches
        shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True, ignore=_not_source(src))
        n = sum(1 for f in dest.rglob("*") if f.is_file())
        _git_init(dest)
        return n
    names = p.stdout.decode().split("\0")
    n = 0
    for name in dict.fromkeys(names):
        f = src / name
        if not name or name.split("/")[0] == ".venv" or not (f.is_file() or f.is_symlink()):
            continue  # deleted in the work tree, or the venv link
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest / name, follow_symlinks=False)
        n += 1
    _git_init(dest)
    return n


def _git_init(dest: Path) -> None:
    """DVC wants a git repository; without git (a machine with no DVC either) a saved plan stands in."""
    if shutil.which("git"):
        subprocess.run(["git", "init", "-q"], cwd=dest, check=True)


NO_DVC = ("DVC is not installed here (no `dvc` on PATH): install env/requirements.txt; on a machine where nothing"
          " can be installed, save the plan where DVC is (`python -m llm.rehearse NAME --save-plan FILE`,"
          " or bench/gpu_check.py --save-dag-plan FILE) and pass it with --plan FILE (gpu_check: --dag-plan FILE)")


def dry_run(repo: Path, env: dict) -> str:
    """`dvc repro --dry --force` in `repo`: its output, which names every stage and command in order."""
    if not shutil.which("dvc", path=env.get("PATH")):
        raise RuntimeError(NO_DVC)
    p = subprocess.run(["dvc", "repro", "--dry", "--force"], cwd=repo, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"`dvc repro --dry --force` failed in {repo}:\n{p.stdout}{p.stderr}")
    return p.stdout


def stage_commands(repo: Path, env: dict) -> list[tuple[str, list[str]]]:
    """[(stage, [command, ...])] in the order `dvc repro` would run them, from DVC itself."""
    return parse_dry_run(dry_run(repo, env))


PLAN_HEAD = "# rehearsal plan: `dvc repro --dry --force` for dvc.yaml + params.yaml of sha256 "


def plan_key(repo: Path) -> str:
    """What a saved plan is valid for: the sha256 of dvc.yaml and the rehearsal's params.yaml."""
    h = hashlib.sha256()
    for f in ("dvc.yaml", "params.yaml"):
        h.update((repo / f).read_bytes())
    return h.hexdigest()


def load_plan(path: Path, repo: Path) -> list[tuple[str, list[str]]]:
    """The stages of a plan `run(..., save_plan=...)` wrote, refused when it was saved for another dvc.yaml or
    params.yaml (an edited pipeline or profile, or another profile or device)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise RuntimeError(f"plan {path}: {e.strerror or e}") from None
    head, _, body = text.partition("\n")
    if not head.startswith(PLAN_HEAD):
        raise RuntimeError(f"plan {path}: line 1 is not a rehearsal plan's header ({PLAN_HEAD!r}...);"
                           f" save it with --save-plan")
    saved, key = head[len(PLAN_HEAD):].strip(), plan_key(repo)
    if saved != key:
        raise RuntimeError(f"plan {path} was saved for another dvc.yaml or params.yaml (sha256 {saved[:12]}...,"
                           f" here {key[:12]}...): save it again from this work tree, for this profile and device")
    return parse_dry_run(body)


def parse_dry_run(text: str) -> list[tuple[str, list[str]]]:
    """Stages and commands from `dvc repro --dry` output ("Running stage 'x':" then "> cmd" lines)."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("Running stage '") and line.rstrip().endswith("':"):
            out.append((line[len("Running stage '"):line.rstrip().rindex("'")], []))
        elif line.startswith("> ") and out:
            out[-1][1].append(line[2:])
    if not out or not all(cmds for _, cmds in out):
        raise RuntimeError(f"could not read the stages from `dvc repro --dry` output:\n{text}")
    return out


def declared(repo: Path, stage: str, kind: str, persist: bool = False) -> list[Path]:
    """The `kind` entries (outs, metrics) dvc.yaml declares for `stage`, literal paths only;
    with persist, only the outs marked `persist: true` (the training checkpoints)."""
    st = yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))["stages"].get(stage, {})
    out = []
    for o in st.get(kind, []) if isinstance(st, dict) else []:
        path, opts = next(iter(o.items())) if isinstance(o, dict) else (o, {})
        if "${" not in path and (not persist or (isinstance(opts, dict) and opts.get("persist"))):
            out.append(repo / path)
    return out


def shape_problem(repo: Path, stage: str) -> str:
    """Why the stage's outputs are not at the profile's shapes, or "": a tokenizer that stopped
    short of the requested vocab_size (its metrics say so) would make every model smaller."""
    for f in declared(repo, stage, "metrics"):
        try:
            m = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(m, dict) and m.get("requested_vocab_size", m.get("vocab_size")) != m.get("vocab_size"):
            return f"vocab_size {m['vocab_size']}, not the profile's {m['requested_vocab_size']}"
    return ""


@dataclass
class Row:
    stage: str
    ok: bool
    error: str
    seconds: float
    peak_rss: int            # bytes, the stage's process tree
    exact: int | None        # weights + gradients + optimizer of the largest phase, bytes
    estimate: int | None     # that phase's estimated total, bytes


def run_stage(cmds: list[str], repo: Path, env: dict, log: Path) -> tuple[int, float, int]:
    """Run a stage's commands in `repo` (output to `log`): (exit status, seconds, peak RSS bytes)."""
    t0, peak, rc = time.perf_counter(), 0, 0
    with open(log, "ab") as f:
        for cmd in cmds:
            p = subprocess.Popen(cmd, shell=True, cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(p.pid, 0)  # rusage of the child and what it waited for
            p.returncode = rc = os.waitstatus_to_exitcode(status)
            peak = max(peak, usage.ru_maxrss * 1024)  # KiB on Linux
            if rc:
                break
    return rc, time.perf_counter() - t0, peak


def last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    return lines[-1][:160] if lines else "(no output)"


def estimates(params: dict) -> dict[str, tuple[int, int]]:
    """{stage: (the most weights + gradients + optimizer it holds at once, exact; the estimated total of
    its largest phase)}."""
    return {name: (max(sum(p.parts.get(k, 0) for k in ("weights", "gradients", "optimizer")) for p in sm.phases),
                   sm.peak.total) for name, sm in stage_memory(params).items()}


def available_memory() -> int:
    """Bytes this process could still allocate: MemAvailable, capped by a cgroup (v2) limit."""
    have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                have = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            have = min(have, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return have


def table(rows: list[Row]) -> list[str]:
    def gib(v: int | None) -> str:
        return "-" if v is None else f"{v / GIB:.2f}"
    cells = [["stage", "result", "seconds", "peak RSS GiB", "exact w+g+opt GiB", "estimate GiB"]]
    cells += [[r.stage, "ok" if r.ok else f"FAILED: {r.error}", f"{r.seconds:.0f}", gib(r.peak_rss), gib(r.exact),
               gib(r.estimate)] for r in rows]
    return format_table(cells)


def rehearse(name: str, *, keep: bool = False, **kw) -> int:
    """`python -m llm.rehearse NAME`: 0 every stage passed, 1 one failed, 2 refused."""
    return run(name, keep=keep, **kw)[0]


def run(name: str, *, keep: bool = False, src: Path = ROOT, only: list[str] | None = None, tmp: Path | None = None,
        device: str = "cpu", plan: Path | None = None, save_plan: Path | None = None, real: bool = False,
        nproc: int = 1) -> tuple[int, list[Row]]:
    """The rehearsal: (exit status, one Row per stage run). `only`: run just these stages (the
    first ones of the DAG; a test's shortcut); `tmp`: where the scratch directory goes (default:
    the system's temporary directory); `device`: "cuda" runs the stages on a GPU in bf16.
    `save_plan`: write the stages DVC lists (for this work tree, profile and device) to that file
    and stop; `plan`: take the stages from such a file instead of from DVC, for a machine that
    has no DVC and cannot install it (a lent GPU machine with no network). `real`: nothing cut, the
    profile as it is with common.nproc = `nproc` (bench/gpu_check.py's speedrun; on "cpu" in fp32)."""
    from llm.config import load_params_text

    rehearsal = render(name, src / "env" / "profiles")[0]
    if real:
        rehearsal["common"]["nproc"] = nproc
        if device == "cpu":
            rehearsal["common"].update(device="cpu", dtype="fp32")
    else:
        rehearsal = cut(rehearsal, device)
    how = "at its own step counts" if real else "every stage cut to one step (llm/tools/rehearse.py)"
    text = to_yaml(rehearsal, name, f"{'run' if real else 'rehearsal'} of {name}: {how}")
    load_params_text(text, f"{name} (rehearsal)")  # the cuts must leave a valid params file
    est = estimates(rehearsal)
    need, worst = max((e[1], s) for s, e in est.items())
    have = available_memory()
    m = rehearsal["pretrain"]["model"]
    where = "fp32 on the CPU" if device == "cpu" else f"{rehearsal['common']['dtype']} on the GPU"
    print(f"rehearse {name}: GPT {m['preset']} ({m['n_layer']} layers x {m['n_embd']}, {m['n_head']} heads,"
          f" seq_len {m['seq_len']}, vocab {rehearsal['tokenizer']['vocab_size']}), {where}, {how}; largest estimate {need / GIB:.1f} GiB ({worst}), {have / GIB:.1f} GiB"
          f" of host memory available", flush=True)
    if device == "cpu" and need > have and save_plan is None:
        print(f"rehearse {name}: refused: stage {worst} is estimated at {need / GIB:.1f} GiB of memory and this"
              f" machine has {have / GIB:.1f} GiB available; free memory or rehearse on a larger machine",
              file=sys.stderr)
        return 2, []
    scratch = Path(tempfile.mkdtemp(prefix=f"rehearse-{name}-", dir=tmp))
    repo = scratch / "repo"
    repo.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1", "DVC_NO_ANALYTICS": "1"}
    rows: list[Row] = []
    try:
        n = scratch_copy(src, repo)
        (repo / "params.yaml").write_text(text, encoding="utf-8")
        if save_plan is not None:
            out = dry_run(repo, env)
            Path(save_plan).write_text(f"{PLAN_HEAD}{plan_key(repo)}\n{out}", encoding="utf-8")
            print(f"rehearse {name}: the {len(parse_dry_run(out))} stages DVC lists for {device} written to"
                  f" {save_plan}", flush=True)
            return 0, []
        stages = load_plan(plan, repo) if plan is not None else stage_commands(repo, env)
        print(f"rehearse {name}: {n} files copied to {repo}; {len(stages)} stages"
              f"{f' (from the plan {plan})' if plan is not None else ''}: {', '.join(s for s, _ in stages)}",
              flush=True)
        for stage, cmds in stages:
            if only is not None and stage not in only:
                continue
            log = scratch / f"{stage}.log"
            rc, secs, peak = run_stage(cmds, repo, env, log)
            error = f"exit {rc}: {last_line(log)}" if rc else shape_problem(repo, stage)
            exact, total = est.get(stage.split("@")[0], (None, None))
            rows.append(Row(stage, not error, error, secs, peak, exact, total))
            print(f"rehearse {name}: {stage}: {'ok' if not error else 'FAILED: ' + error} in {secs:.0f} s, peak"
                  f" {peak / GIB:.2f} GiB", flush=True)
            if error:
                keep = True
                print(f"rehearse {name}: {stage} failed; its output is in {log}", file=sys.stderr)
                break
            for path in declared(repo, stage, "outs", persist=True):
                shutil.rmtree(path, ignore_errors=True)
    finally:
        if save_plan is None:
            print("\n".join(["", *table(rows)]), flush=True)
        if keep:
            print(f"rehearse {name}: scratch copy kept in {scratch}", flush=True)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return (0 if rows and all(r.ok for r in rows) else 1), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run a profile's whole DAG at its model shapes on the CPU, each stage"
                                 " cut to one step.", epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="a profile of env/profiles/ (`python -m llm.profile list`)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    ap.add_argument("--save-plan", metavar="FILE", help="write the stages DVC lists for this rehearsal to FILE"
                    " and stop (for a machine without DVC)")
    ap.add_argument("--plan", metavar="FILE", help="take the stages from a --save-plan FILE instead of asking DVC")
    args = ap.parse_args(argv)
    try:
        return rehearse(args.name, keep=args.keep, plan=args.plan, save_plan=args.save_plan)
    except ConfigError as e:
        print(f"rehearse: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
