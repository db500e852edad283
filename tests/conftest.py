"""Shared test setup: offline hub settings, the repo root, small helpers and shared fixtures."""
from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import pytest

from llm.runtime import X86_MACHINES  # imports torch, but runs no operation

# The whole test session runs the AVX2 kernels the cpu profile asks for (`common.cpu_capability`):
# a stage run in this process refuses a level that an earlier test's operation already fixed.
# PyTorch reads the level at its first operation, so this must come before any test runs one.
if platform.machine().lower() in X86_MACHINES:
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

# Hub look-ups wait 25-80 s before failing when there is no network; tests never need them.
for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DVC_NO_ANALYTICS"):
    os.environ.setdefault(_k, "1")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def load_script(path: Path, name: str | None = None):
    """Import a script that is not in a package (bench/*.py, env/check_env.py) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dvc_command(stage: str, item: str | None = None) -> list[str]:
    """A stage's command as dvc.yaml writes it (paths relative to the project root), with this
    interpreter as `python`; `item` fills a foreach stage's ${item}. Tests that run a stage in a
    scratch layout run exactly what `dvc repro` runs."""
    import shlex
    import sys

    import yaml

    st = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    cmd = (st["do"] if "foreach" in st else st)["cmd"]
    if item is not None:
        cmd = cmd.replace("${item}", item)
    argv = shlex.split(cmd)
    assert argv[0] == "python", f"dvc.yaml stage {stage}: expected `python -m ...`, got {cmd!r}"
    return [sys.executable, *argv[1:]]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a rendezvous or a process group's store)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def common_params(**over) -> dict:
    """A complete `common` params section for a test's params file (override any key)."""
    from llm.config import CommonConfig, to_dict

    base = CommonConfig(seed=7, device="cpu", dtype="auto", nproc=1, num_threads=1, cpu_kernels=True)
    return {**to_dict(base), **over}


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a whole module: tiny models run fastest that way (and the CI box has
    two shared cores). A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch  # here, not at the top: most test modules never touch torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """`reference_runs(case, strategy=None)`: the (json, weights) of an uninterrupted run of
    tests/test_trainer.py's CASES[case], by one process (strategy None) or by 2 gloo ranks under
    `strategy`; run on first use, once per session for tests/test_trainer.py and tests/test_scale.py.
    One interpreter runs every one-process case, one launch of 2 ranks every distributed one:
    starting Python with torch costs a few seconds here, more than a run of the tiny model."""
    from tests.test_trainer import CASES, STRATEGIES, _child_run, _launch2, _result

    root = tmp_path_factory.mktemp("reference_runs")
    done: set[str] = set()

    def get(case: str, strategy: str | None = None):
        side = "two" if strategy else "one"
        if side not in done:
            if strategy:
                runs = [{**opt, "distributed": st, "run_dir": str(root / f"{c}-{st}"), "out": str(root / f"{c}-{st}")}
                        for st in STRATEGIES for c, opt in CASES.items() if st in opt.get("strategies", STRATEGIES)]
                res = _launch2(runs)
                assert [rc for rc, _ in res] == [0, 0], res
            else:
                runs = [{**opt, "run_dir": str(root / c), "out": str(root / c)} for c, opt in CASES.items()]
                rc, out = _child_run(runs)
                assert rc == 0, out
            done.add(side)
        return _result(str(root / (f"{case}-{strategy}" if strategy else case)))
    return get


class Unbounded(AssertionError):
    """A block took longer, or more memory, than `bounded` allows."""


def _proc_status(field: str) -> int | None:
    import re
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


@contextlib.contextmanager
def bounded(seconds: float = 10.0, memory: int = 2 << 30):
    """Run a block and fail (Unbounded) if it takes more than `seconds` or its peak resident
    memory rises more than `memory` bytes above where it started.

    Linux measures the peak exactly (VmHWM, reset through /proc/self/clear_refs) and a hard
    address-space limit of 2 * memory above the current size stops a runaway allocation before
    it takes the machine; a timer interrupts a runaway Python loop after 2 * seconds.
    Elsewhere only the time is checked."""
    import resource
    import signal
    import time

    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        start_rss = _proc_status("VmRSS")
    except OSError:
        start_rss = None
    size = _proc_status("VmSize")
    old_as = resource.getrlimit(resource.RLIMIT_AS)
    if size is not None:
        resource.setrlimit(resource.RLIMIT_AS, (size + 2 * memory, old_as[1]))

    def timeout(signum, frame):
        raise Unbounded(f"still running after {2 * seconds:.0f} s")

    old_handler = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, 2 * seconds)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, old_as)
    took = time.perf_counter() - t0
    if took > seconds:
        raise Unbounded(f"took {took:.1f} s, more than {seconds} s")
    peak = _proc_status("VmHWM")
    if start_rss is not None and peak is not None and peak - start_rss > memory:
        raise Unbounded(f"peak memory rose {(peak - start_rss) / 2 ** 20:.0f} MiB, more than {memory / 2 ** 20:.0f} MiB")
