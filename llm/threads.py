"""How many CPU threads torch uses: `common.num_threads`.

    n = apply_num_threads(common.num_threads)   # once, when a stage starts (llm/runtime.py setup_runtime)

`auto` (the default) applies one rule, once per process:

    usable  = the CPUs this process may run on (os.sched_getaffinity), capped by a cgroup CPU quota
    busy    = how many of those CPUs other processes kept busy during a 0.3 s look at /proc/stat
              (this process's own CPU time taken out), rounded to the nearest whole CPU
    threads = max(1, usable - busy)

Why: torch's intra-op threads meet at a barrier after every parallel op, so one thread that
the OS has handed to another process holds up all the others. Next to one other CPU-bound
process, 2 threads ran the `pretrain` step 2.7x slower than 1 thread on the 2-core reference
machine (bench/threads.py; bench/README.md); a count that leaves the busy CPUs alone does not
collapse. The count is decided once, not re-checked between steps, so that a run does not
change its arithmetic halfway.

Reproducibility: the count depends on the machine and on its load when the stage starts, and a
different count can change floating-point results (how reductions are split between threads).
Same machine, same load class -> same count -> the same numbers. On the reference 2-core
machine, 1, 2 and 4 threads train bit-identical weights for the `pretrain` model and 3 threads
do not (bench/threads.py); where bitwise reruns matter on other machines, set a fixed
`common.num_threads`. The chosen count is printed, and the training stages record it in their
metrics as `num_threads`.

An integer >= 1 is used as given; 0 leaves torch's own default (one thread per core).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

SAMPLE_SECONDS = 0.3
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # "<quota> <period>" or "max <period>" (cgroup v2)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (a container limited to 2 CPUs on a 64-core host gets 2)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _cpu_ticks(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks summed over `cpus`, from /proc/stat."""
    busy = total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def _own_ticks() -> int:
    """This process's user + system clock ticks, all threads (/proc/self/stat fields 14, 15)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def busy_cpus(seconds: float = SAMPLE_SECONDS) -> float:
    """How many of this process's CPUs other processes kept busy over `seconds`, e.g. 1.0 when
    one CPU-bound process runs beside us. 0.0 where /proc is not available."""
    try:
        cpus = os.sched_getaffinity(0)
        b0, t0 = _cpu_ticks(cpus)
        o0 = _own_ticks()
        time.sleep(seconds)
        b1, t1 = _cpu_ticks(cpus)
        o1 = _own_ticks()
    except (AttributeError, OSError, ValueError):
        return 0.0
    if t1 <= t0:
        return 0.0
    per_cpu = (t1 - t0) / len(cpus)  # ticks one CPU had in the interval
    return max(0.0, (b1 - b0) - (o1 - o0)) / per_cpu


def choose_num_threads(usable: int, busy: float) -> int:
    """The `auto` rule: max(1, usable - busy rounded half up). Pure, for tests and benches."""
    return max(1, usable - math.floor(busy + 0.5))


def apply_num_threads(setting: int | str) -> int:
    """Set torch's intra-op thread count from `common.num_threads` and return the count in use.

    setting: "auto" (the rule in the module docstring), an int >= 1 (used as given) or 0
    (torch's default, left alone)."""
    import torch

    if setting == "auto":
        usable, busy = usable_cpus(), busy_cpus()
        n = choose_num_threads(usable, busy)
        print(f"threads: {n} (common.num_threads: auto; {usable} usable CPUs, {busy:.2f} busy with other"
              f" processes)", flush=True)
        torch.set_num_threads(n)
    elif isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        if setting:
            torch.set_num_threads(setting)
    else:
        raise ValueError(f"common.num_threads: expected 'auto' or an int >= 0, got {setting!r}")
    return torch.get_num_threads()
