"""What the benchmarks in bench/ share: the machine's state beside every figure, and paired summaries.

Every script alternates the things it compares in one process (A B A B ...), reports each
side's min/median/max and the min/median/max of the per-round ratios, and ends with one JSON
line that holds every figure together with `machine()`: the date, the CPUs this process may
use and the load average at the start and at the end of the run. On a shared machine only the
paired ratios are worth comparing between runs.
"""
from __future__ import annotations

import datetime
import os
import statistics
from typing import Callable, Sequence


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages ([] where /proc/loadavg does not exist)."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []


def machine(start_load: list[float] | None = None) -> dict:
    """Date, usable CPUs and load: pass the `loadavg()` taken when the run began."""
    from llm.threads import usable_cpus

    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "usable_cpus": usable_cpus(), "cpu_count": os.cpu_count(),
            "loadavg_start": start_load if start_load is not None else [], "loadavg_end": loadavg()}


def summary(xs: Sequence[float], digits: int = 4) -> dict:
    """{"min", "median", "max"} of xs."""
    return {"min": round(min(xs), digits), "median": round(statistics.median(xs), digits),
            "max": round(max(xs), digits)}


def ratios(a: Sequence[float], b: Sequence[float]) -> dict:
    """Summary of the per-round ratios a_i / b_i (the paired comparison)."""
    return summary([x / y for x, y in zip(a, b)], 3)


def show(s: dict, unit: str = "") -> str:
    return f"{s['min']:g}/{s['median']:g}/{s['max']:g}{unit}"


def rotations(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of `names` in each round: rotated by one every round (A B C, B C A, C A B, ...),
    so that none of them always runs first, after a warm cache, or after the slowest one."""
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)]


def timed(fn: Callable[[], object], clock: Callable[[], float] | None = None) -> tuple[float, object]:
    import time

    clock = clock or time.perf_counter
    t0 = clock()
    out = fn()
    return clock() - t0, out
