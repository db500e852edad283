"""The thread policy (llm/threads.py): the `auto` rule, the load sample, applying a setting."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from llm import threads
from llm.config import ConfigError, load_params_text
from tests.conftest import ROOT


@pytest.mark.parametrize("usable,busy,want", [
    (2, 0.0, 2), (2, 0.49, 2),  # an idle machine: every usable CPU
    (2, 0.5, 1), (2, 1.0, 1),   # one CPU-bound neighbour on 2 cores: 1 thread, not 2 fighting over 1 core
    (2, 2.7, 1),                # never fewer than 1
    (16, 1.2, 15), (16, 0.0, 16),
])
def test_auto_leaves_the_busy_cpus_alone(usable, busy, want):
    assert threads.choose_num_threads(usable, busy) == want


def test_busy_cpus_takes_this_process_own_time_out(monkeypatch):
    # two CPUs, 30 ticks each in the interval: 45 busy ticks, 15 of them ours -> 30 = one CPU
    ticks = iter([(100, 1000), (145, 1060)])
    own = iter([7, 22])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_cpu_ticks", lambda cpus: next(ticks))
    monkeypatch.setattr(threads, "_own_ticks", lambda: next(own))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    assert threads.busy_cpus() == pytest.approx(1.0)


def test_busy_cpus_sees_a_cpu_bound_neighbour():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert threads.busy_cpus(0.5) >= 0.6
    finally:
        hog.kill()
        hog.wait()


def test_a_cgroup_quota_caps_the_usable_cpus(tmp_path, monkeypatch):
    f = tmp_path / "cpu.max"
    monkeypatch.setattr(threads, "CGROUP_CPU_MAX", f)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    f.write_text("150000 100000\n")  # 1.5 CPUs -> 2
    assert threads.usable_cpus() == 2
    f.write_text("max 100000\n")
    assert threads.usable_cpus() == 8


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_apply_auto_sets_the_chosen_count(monkeypatch, restore_threads, capsys):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 3)
    monkeypatch.setattr(threads, "busy_cpus", lambda: 1.0)
    assert threads.apply_num_threads("auto") == 2 == torch.get_num_threads()
    assert "threads: 2 (common.num_threads: auto; 3 usable CPUs, 1.00 busy" in capsys.readouterr().out


def test_apply_a_number_uses_it_and_zero_leaves_torch_alone(restore_threads):
    assert threads.apply_num_threads(1) == 1
    torch.set_num_threads(2)
    assert threads.apply_num_threads(0) == 2
    with pytest.raises(ValueError, match="common.num_threads: expected 'auto' or an int >= 0, got 'al'"):
        threads.apply_num_threads("al")


def test_params_take_auto_or_a_count_and_nothing_else():
    d = yaml.safe_load((ROOT / "params.yaml").read_text())
    for ok in ("auto", 0, 3):
        d["common"]["num_threads"] = ok
        assert load_params_text(yaml.safe_dump(d)).common.num_threads == ok
    for bad, got in (("Auto", "'Auto' (str)"), (-1, "-1 (int)"), (2.5, "2.5 (float)"), (True, "True (bool)")):
        d["common"]["num_threads"] = bad
        with pytest.raises(ConfigError) as e:
            load_params_text(yaml.safe_dump(d))
        assert f"common.num_threads: expected one of 'auto' or an int in [0, 1024], got {got}" in str(e.value)
