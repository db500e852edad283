"""How many CPU threads torch uses: `common.num_threads`, and `auto`, which measures.

    n = apply_num_threads(common.num_threads)   # when a stage starts (llm/runtime.py setup_runtime)
    probe = check_counts(candidates, step_state)  # under auto, before the first step (llm/train/loop.py)
    tuner = auto_tuner(stage, say, probe["kept"])  # None: the stage stays on 1
    n = tuner.before_step(); ...one step...; tuner.after_step(seconds)
    tuner.release()                             # back to 1 for an evaluation, and after the loop

Under `auto` (the default) every stage starts on one thread, and a stage whose step keeps one
shape (`stage_candidates`) checks which counts give its step one thread's bits on this machine
(below), then measures which of those is fastest between steps. Its starting count comes from
one rule:

    usable  = the CPUs this process may run on (os.sched_getaffinity), capped by a cgroup CPU quota
    busy    = how many of those CPUs other processes kept busy during a 0.3 s look at /proc/stat
              (this process's own CPU time taken out), rounded to the nearest whole CPU
    start   = max(1, usable - busy), moved to the nearest allowed count

Why measure: torch's intra-op threads meet at a barrier after every parallel op, so one thread
that the OS has handed to another process holds up all the others; next to a CPU-bound process
two threads on two CPUs can run a step several times slower than one (bench/threads.py,
bench/README.md). A count chosen once goes stale when such a process arrives or leaves
mid-stage, and the load seen in /proc/stat does not say how much a given step suffers from it.
So between steps (never inside one) the training loop (llm/train/loop.py) asks `ThreadTuner`: every
`every` steps it runs `trial_steps` steps at each other allowed count, compares the fastest
step of each with the fastest of the last steps at the current count (a step is only ever
slowed by what else runs, so the fastest is the steadier figure), keeps the fastest count, and
doubles `every` while the choice holds (up to `max_every`; back to the first value when it
changes), so the trials cost little on a steady machine. When the load probe (/proc/stat since
the last step) shows the CPUs busy with other processes change what the starting rule would
choose, it follows the rule at once (a trial then would spend steps on the count that the new
load slows) and runs a trial `every` steps later to check. The steps used per count are
recorded (`counts`; the training stages write them to their metrics as `threads_steps`, and
every step's row of the history has its `num_threads`).

Reproducibility under `auto`: a different count can change floating-point results (how a
reduction or a matrix product is split between threads), and which counts do depends on the CPU
and the tensor shapes, so `auto` checks them on the machine it runs on. Before a stage's first
step (between steps only) the loop (llm/train/loop.py) saves the model, the optimizer, the step
body's state and the RNG, runs that same real step once at each allowed count, restores the
saved state after each (the run's own steps are the ones it would have run without the check)
and keeps only the counts whose parameters and Adam moments after the step are bit-identical
to one thread's (`check_counts`; the moments hold the gradient's bits, which the parameters
after one Adam step, about lr * sign(gradient), may not). Its cost is one step per allowed count
and a copy of the model and optimizer state; its result (`checked`, `kept`, the `cpu` model
from /proc/cpuinfo, `seconds`) goes into the stage's `threads_probe`, in
runs/<stage>/run.json beside `threads_steps`. What one step can miss: a count that rounds
differently only on shapes the checked step did not have, or only by chance on other values, or
a library whose split depends on something other than the shape and the count (memory
alignment). So the check is only used where every step has one shape: pretrain, whose batches
are batch_size windows of seq_len tokens. SFT's batches are padded to their longest example
(llm/data/batching.py BucketBatchSampler), so their shape changes from step to step, and one shape
vouches for no other: measured on the 2-core AMD EPYC machine (one step of the tiny model from
one state, padded lengths 8, 16, ..., 256), 4 threads gave one thread's bits at 28 of 32 lengths,
the longest included, and other bits at 16, 40, 80 and 88 (3 threads: other bits at 21 of
32; 2 threads: the same bits at all 32; alike with PyTorch's and MKL's own kernels and with
`common.cpu_capability: avx2`). SFT therefore stays on one thread under `auto`, like
PPO and GRPO (which train different weights with 1 and 2 threads) and the stages never checked
(the reward model, DPO, evaluation, pairs, the data cleaning), everything before and after
their loop included. What reproduces where under `auto`: every stage but pretrain runs on one
thread at any load, so a rerun on the same machine gives the same bytes; pretrain moves only
between the counts its own check kept on that machine, so it reproduces at any load too, within
what one step's check can see (above). Measured with bench/threads.py (`--rounds 0
--bitwise-steps 3`: three pretrain steps of the `cpu` profile's model at 1, 2, 3 and 4 threads
from one state): on the 2-core AMD EPYC machine 2 and 4 threads give one thread's bits and 3 does
not, with PyTorch's and MKL's own kernels and with `common.cpu_capability: avx2` alike, and the
check in the loop keeps [1, 2] there; on a 2-core Intel Xeon machine none of 2, 3 and 4 does
(PyTorch's and MKL's own kernels), so the check should keep [1] there and pretrain run on one
thread (the check itself has not run on that machine yet: its `threads_probe` will say). Across
machines nothing here promises the same bytes (docs/experiments.md).

An integer >= 1 is used as given for the whole stage; 0 leaves torch's own default (one thread
per core). Neither is revisited.
"""
from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path
from typing import Callable

SAMPLE_SECONDS = 0.3
# Stages whose every step has one shape, so that checking one step at each count (check_counts)
# says which counts train one thread's bits; under `auto` the others stay on one thread (module
# docstring: SFT's padded lengths change the answer).
COUNT_FREE_STAGES = ("pretrain",)
TRIAL_EVERY = 20      # steps between the first revisits; doubles while the choice holds
MAX_TRIAL_EVERY = 320
TRIAL_STEPS = 2       # steps timed at each candidate count per revisit; the fastest of them counts
LOAD_GAP = 2          # steps after a decision before a load change is followed
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


class LoadProbe:
    """How many of this process's CPUs other processes kept busy since the previous call, from
    /proc/stat and /proc/self/stat (a file read, no waiting: cheap enough to call between steps).
    The first call, and every call where /proc is not available, returns None."""

    def __init__(self):
        self._last: tuple[int, int, int] | None = None

    def __call__(self) -> float | None:
        try:
            cpus = os.sched_getaffinity(0)
            (busy, total), own = _cpu_ticks(cpus), _own_ticks()
        except (AttributeError, OSError, ValueError):
            return None
        last, self._last = self._last, (busy, total, own)
        if last is None or total <= last[1]:
            return None
        per_cpu = (total - last[1]) / len(cpus)  # ticks one CPU had in the interval
        return max(0.0, (busy - last[0]) - (own - last[2])) / per_cpu


def busy_cpus(seconds: float = SAMPLE_SECONDS) -> float:
    """How many of this process's CPUs other processes kept busy over `seconds`, e.g. 1.0 when
    one CPU-bound process runs beside us. 0.0 where /proc is not available."""
    probe = LoadProbe()
    probe()
    time.sleep(seconds)
    busy = probe()
    return 0.0 if busy is None else busy


def choose_num_threads(usable: int, busy: float) -> int:
    """The `auto` rule: max(1, usable - busy rounded half up). Pure, for tests and benches."""
    return max(1, usable - math.floor(busy + 0.5))


def stage_candidates(stage: str, usable: int) -> list[int]:
    """The counts `auto` may check in `stage` (module docstring): the powers of two up to `usable`
    for a stage whose steps keep one shape, [1] else."""
    if stage not in COUNT_FREE_STAGES:
        return [1]
    return [2 ** i for i in range(usable.bit_length()) if 2 ** i <= usable]


class ThreadTuner:
    """`auto` between steps: times `trial_steps` steps at each candidate count every `every`
    steps and keeps the fastest; follows the load rule when `probe` sees the load change it
    (module docstring).

        n = tuner.before_step()      # sets torch's count for the coming step; between steps only
        tuner.after_step(seconds)    # the step's wall time

    candidates: the counts allowed (stage_candidates); start: the count to begin with (moved to
    the nearest candidate); usable: the CPUs (default: the largest candidate). probe() -> CPUs
    busy with other processes since its last call, or None (LoadProbe); set_threads:
    torch.set_num_threads (both injectable for tests). A load change counts only when it changes
    what the starting rule would choose among the candidates: on 2 CPUs, a second busy CPU next
    to a first changes nothing (1 thread either way)."""

    def __init__(self, candidates: list[int], *, start: int, usable: int | None = None, every: int = TRIAL_EVERY,
                 max_every: int = MAX_TRIAL_EVERY, trial_steps: int = TRIAL_STEPS,
                 probe: Callable[[], float | None] | None = None,
                 set_threads: Callable[[int], None] | None = None):
        assert candidates and all(c >= 1 for c in candidates), candidates
        self.candidates = sorted(set(candidates))
        self.current = self._nearest(start)
        self.usable = usable if usable is not None else self.candidates[-1]
        self.first_every, self.every, self.max_every, self.trial_steps = every, every, max_every, trial_steps
        self.probe = probe if probe is not None else LoadProbe()
        self._set = set_threads if set_threads is not None else _torch_set_num_threads
        self.counts: dict[int, int] = {}         # steps run at each count
        self.trials = 0                          # revisits done
        self.follows = 0                         # load changes followed
        self._since = 0                          # steps since the last decision
        self._queue: list[int] = []              # counts still to time in the running trial
        self._times: dict[int, list[float]] = {}
        self._rule: int | None = self.current    # the starting rule's count at the last decision's load
        self._recent: list[float] = []           # seconds of the last trial_steps steps at the current count
        self.probe()  # starts its first interval: a load that changes during the first steps counts
        self._in_step: int | None = None         # the count of the step under way
        self._applied: int | None = None

    def before_step(self) -> int:
        assert self._in_step is None, "before_step twice without after_step: a count changes only between steps"
        rule = self._load_changed() if not self._queue else None  # every step: each probe covers one step
        if not self._queue and len(self.candidates) > 1:
            if rule is not None and self._since >= LOAD_GAP:
                # the load changed what the rule would choose: follow it at once (a trial would
                # spend steps on the count the new load slows) and check it by a trial soon
                self.current, self._rule, self._recent = rule, rule, []
                self._since, self.every = 0, self.first_every
                self.follows += 1
            elif self._since >= self.every:
                self._queue = [c for c in self.candidates if c != self.current for _ in range(self.trial_steps)]
                self._times = {self.current: list(self._recent)} if len(self._recent) == self.trial_steps else {}
                if not self._times:  # too few steps at the current count since it changed: time it too
                    self._queue += [self.current] * self.trial_steps
        n = self._queue[0] if self._queue else self.current
        if n != self._applied:
            self._set(n)
            self._applied = n
        self._in_step = n
        return n

    def after_step(self, seconds: float) -> None:
        n, self._in_step = self._in_step, None
        assert n is not None, "after_step without before_step"
        self.counts[n] = self.counts.get(n, 0) + 1
        if not self._queue:
            self._since += 1
            self._recent = (self._recent + [seconds])[-self.trial_steps:]
            return
        self._queue.pop(0)
        self._times.setdefault(n, []).append(seconds)
        if self._queue:
            return
        best = min(self._times, key=lambda c: (min(self._times[c]), c != self.current, c))
        self.every = min(2 * self.every, self.max_every) if best == self.current else self.first_every
        self.current, self._since = best, 0
        self._recent = self._times[best][-self.trial_steps:]
        self.trials += 1
        busy = self.probe()  # the baseline: the load over the trial's last step
        self._rule = None if busy is None else self._nearest(choose_num_threads(self.usable, busy))

    def _nearest(self, n: int) -> int:
        return min(self.candidates, key=lambda c: (abs(c - n), c))

    def _load_changed(self) -> int | None:
        """The count the starting rule would choose among the candidates at the load since the
        last probe (the last step), if it differs from the one at the last decision; else None."""
        busy = self.probe()
        if busy is None:
            return None
        now = self._nearest(choose_num_threads(self.usable, busy))
        if self._rule is None:
            self._rule = now
        return now if now != self._rule else None

    def release(self) -> None:
        """Back to one thread, the count of everything outside the steps under `auto` (evaluation,
        the stage's work before and after its loop); the next before_step sets its count again."""
        assert self._in_step is None, "release inside a step"
        self._set(1)
        self._applied = 1

    def summary(self) -> dict[str, int]:
        """{"<count>": steps run with it}: what a stage records as `threads_steps`."""
        return {str(c): k for c, k in sorted(self.counts.items())}


def _torch_set_num_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("AMD EPYC", "Intel(R) Xeon(R) ..."); elsewhere
    what the platform module says, or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def check_counts(candidates: list[int], step_state: Callable[[int], bytes | None],
                 set_threads: Callable[[int], None] | None = None) -> dict:
    """Which of `candidates` train one thread's bits on this machine (module docstring).

    step_state(n): runs one training step from the saved state with n threads set, restores the
    saved state and returns a digest of the trained state after the step (equal digests: the
    same bits), or None when the step made no update (a skipped non-finite step: nothing to
    compare, so only one thread is kept). Runs 1 first, then the others in order, and leaves one thread set.
    Returns {"checked": the counts run, "kept": [1, those with one thread's digest], "cpu":
    cpu_model(), "seconds": the check's wall time}."""
    set_threads = set_threads if set_threads is not None else _torch_set_num_threads
    counts = sorted(set(candidates) | {1})
    t0 = time.perf_counter()
    digests = {}
    try:
        for n in counts:
            set_threads(n)
            digests[n] = step_state(n)
            if digests[n] is None:
                break
    finally:
        set_threads(1)
    ref = digests.get(1)
    kept = [n for n in counts if ref is not None and digests.get(n) == ref]
    return {"checked": list(digests), "kept": kept or [1], "cpu": cpu_model(), "seconds": time.perf_counter() - t0}


def auto_tuner(stage: str, say: Callable[[str], None] = lambda m: print(m, flush=True),
               candidates: list[int] | None = None) -> ThreadTuner | None:
    """Under `auto`: the ThreadTuner of `stage`, started from the rule in the module docstring,
    or None where the stage stays on the one thread apply_num_threads set. candidates: the counts
    to move between (check_counts' `kept`); default: stage_candidates, unchecked."""
    usable = usable_cpus()
    candidates = candidates if candidates is not None else stage_candidates(stage, usable)
    if len(candidates) == 1:
        return None
    busy = busy_cpus()
    tuner = ThreadTuner(candidates, start=choose_num_threads(usable, busy), usable=usable)
    say(f"threads: {stage} starts on {tuner.current} (common.num_threads: auto; {usable} usable CPUs,"
        f" {busy:.2f} busy with other processes) and measures {tuner.candidates} between steps")
    return tuner


def apply_num_threads(setting: int | str) -> int:
    """Set torch's intra-op thread count from `common.num_threads` and return the count in use.

    setting: "auto" (one thread; the training loop may then measure others, module docstring),
    an int >= 1 (used as given) or 0 (torch's default, left alone)."""
    import torch

    if setting == "auto":
        torch.set_num_threads(1)
    elif isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        if setting:
            torch.set_num_threads(setting)
    else:
        raise ValueError(f"common.num_threads: expected 'auto' or an int >= 0, got {setting!r}")
    return torch.get_num_threads()
