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


@pytest.fixture
def one_of_two_cpus_busy(monkeypatch):
    """Two /proc/stat reads: two CPUs, 30 ticks each in the interval, 45 busy ticks, 15 of them ours."""
    ticks = iter([(100, 1000), (145, 1060)])
    own = iter([7, 22])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_cpu_ticks", lambda cpus: next(ticks))
    monkeypatch.setattr(threads, "_own_ticks", lambda: next(own))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)


def test_busy_cpus_takes_this_process_own_time_out(one_of_two_cpus_busy):
    assert threads.busy_cpus() == pytest.approx(1.0)  # 45 - 15 = 30 ticks = one CPU


def test_the_load_probe_reads_the_time_since_its_last_call(one_of_two_cpus_busy):
    probe = threads.LoadProbe()
    assert probe() is None  # nothing to compare with yet
    assert probe() == pytest.approx(1.0)


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


def test_auto_starts_every_stage_on_one_thread_whatever_the_load(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "busy_cpus", lambda *a: 0.0)  # an idle machine
    torch.set_num_threads(2)
    assert threads.apply_num_threads("auto") == 1 == torch.get_num_threads()


def test_the_measuring_stages_start_from_the_load_rule(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 3)
    monkeypatch.setattr(threads, "busy_cpus", lambda *a: 1.0)
    said = []
    tuner = threads.auto_tuner("pretrain", said.append)
    assert tuner.candidates == [1, 2] and tuner.current == 2  # 3 - 1 busy
    assert said == ["threads: pretrain starts on 2 (common.num_threads: auto; 3 usable CPUs, 1.00 busy with"
                    " other processes) and measures [1, 2] between steps"]
    assert threads.auto_tuner("grpo", said.append) is None and len(said) == 1  # stays on 1


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


class FakeClock:
    """Step seconds by thread count, changed mid-run by the test: the machine as a test wants it."""

    def __init__(self, seconds: dict[int, float]):
        self.seconds = seconds


def run_steps(tuner: threads.ThreadTuner, clock: FakeClock, n: int) -> list[int]:
    used = []
    for _ in range(n):
        c = tuner.before_step()
        used.append(c)
        tuner.after_step(clock.seconds[c])
    return used


def test_the_tuner_moves_to_the_fastest_count_when_it_revisits():
    clock = FakeClock({1: 1.0, 2: 2.0})  # two threads slow: a competitor on the other CPU
    set_to = []
    t = threads.ThreadTuner([1, 2], start=2, every=4, probe=lambda: None, set_threads=set_to.append, trial_steps=1)
    used = run_steps(t, clock, 10)
    # 4 steps at 2; a trial step at 1 against the last step at 2: 1 wins; 4 steps later, 2 again
    assert used == [2, 2, 2, 2, 1, 1, 1, 1, 1, 2]
    assert set_to == [2, 1, 2]  # torch's count set only when it changes
    assert t.summary() == {"1": 5, "2": 5} and t.trials == 2 and t.current == 1


def test_the_tuner_keeps_a_count_that_stays_fastest_and_revisits_less_often():
    t = threads.ThreadTuner([1, 2], start=2, every=2, max_every=8, probe=lambda: None, set_threads=lambda n: None,
                             trial_steps=1)
    run_steps(t, FakeClock({1: 2.0, 2: 1.0}), 40)
    assert t.current == 2 and t.every == 8
    assert t.counts[1] == t.trials < 6  # one trial step per revisit, revisits spaced out 2, 4, 8, 8, ...


def test_a_load_change_is_followed_at_the_next_step_and_checked_later():
    busy = [0.0]
    clock = FakeClock({1: 1.0, 2: 0.6})
    t = threads.ThreadTuner([1, 2], start=2, every=1000, probe=lambda: busy[0], set_threads=lambda n: None,
                             trial_steps=1)
    assert run_steps(t, clock, 5) == [2] * 5
    clock.seconds = {1: 1.0, 2: 3.0}  # a CPU-bound process arrives during the next step ...
    assert run_steps(t, clock, 1) == [2]
    busy[0] = 1.0  # ... and the probe before the step after it sees it
    assert run_steps(t, clock, 4) == [1] * 4 and t.follows == 1 and t.trials == 0  # the rule's 1 at once
    busy[0] = 1.3  # still one busy CPU: nothing to follow
    t.every = 6  # the check: a trial step at 2 after 6 steps at 1, and 1 stays
    assert run_steps(t, clock, 8) == [1, 1, 2, 1, 1, 1, 1, 1] and t.follows == 1 and t.trials == 1


def test_the_tuner_only_uses_the_allowed_counts():
    clock = FakeClock({1: 5.0, 2: 1.0, 3: 0.1, 4: 0.9})
    t = threads.ThreadTuner([1, 2, 4], start=3, every=1, probe=lambda: None, set_threads=lambda n: None)
    used = run_steps(t, clock, 30)
    assert set(used) == {1, 2, 4} and t.current == 4  # 3 would be fastest, but it is not allowed


def test_the_count_never_changes_inside_a_step():
    t = threads.ThreadTuner([1, 2], start=1, every=1, probe=lambda: None, set_threads=lambda n: None)
    t.before_step()
    with pytest.raises(AssertionError, match="only between steps"):
        t.before_step()


@pytest.mark.parametrize("stage,usable,want", [
    ("pretrain", 2, [1, 2]), ("pretrain", 6, [1, 2, 4]), ("pretrain", 1, [1]),
    ("sft", 6, [1]),  # padded lengths change from step to step: one step's check vouches for no other

    ("grpo", 2, [1]), ("ppo", 8, [1]),  # RL steps round differently with 1 and 2 threads: one count
    ("dpo", 4, [1]), ("reward", 2, [1]),  # not checked: one count
])
def test_auto_checks_counts_only_in_a_stage_whose_steps_keep_one_shape(stage, usable, want):
    assert threads.stage_candidates(stage, usable) == want


class CountThreads:
    """A step body that only records torch's thread count inside each step."""

    def __init__(self):
        self.seen: list[int] = []

    def step(self, step, updater):
        self.seen.append(torch.get_num_threads())
        return {"loss": 1.0}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_the_loop_revisits_under_auto_and_records_the_count_of_every_step(tmp_path, monkeypatch, restore_threads):
    import functools

    from llm.config import LoopConfig
    from llm.runtime import Runtime
    from llm.train import loop

    monkeypatch.setattr(threads, "ThreadTuner", functools.partial(threads.ThreadTuner, every=2, probe=lambda: None))
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "busy_cpus", lambda *a: 0.0)  # starts on 2
    cfg = LoopConfig(max_steps=9, lr=1e-3, min_lr=1e-3, warmup_steps=0, weight_decay=0.0, beta1=0.9, beta2=0.95,
                     grad_clip=0.0, eval_every=100, checkpoint_every=100, keep_checkpoints=2,
                     nonfinite_policy="raise", nonfinite_budget=0)
    model = torch.nn.Linear(2, 2)
    rt = Runtime(torch.device("cpu"), auto_threads=True)
    body = CountThreads()
    torch.set_num_threads(1)  # as apply_num_threads("auto") leaves it
    evals = []
    res = loop.run_loop(body, loop.Updater(model, cfg, rt, stage="pretrain"), cfg, rt, stage="pretrain",
                        model=model, run_dir=tmp_path, fingerprint="fp", progress=False,
                        evaluate=lambda step: evals.append(torch.get_num_threads()) or {})
    assert evals == [1, 1]  # before the first step and after the last: on one thread
    checked, seen = body.seen[:2], body.seen[2:]
    assert checked == [1, 2] and res.threads_probe["kept"] == [1, 2]  # the check's step at each count
    assert [r["num_threads"] for r in res.history] == seen
    assert torch.get_num_threads() == 1  # after the loop, one thread again
    assert set(seen) == {1, 2}  # the trial at step 3 ran one step on the other count
    assert res.threads_steps == {"1": seen.count(1), "2": seen.count(2)}


def test_a_load_change_that_the_rule_would_not_act_on_costs_no_trial():
    busy = [1.0]  # one CPU-bound neighbour on 2 CPUs: 1 thread
    t = threads.ThreadTuner([1, 2], start=1, usable=2, every=1000, probe=lambda: busy[0], set_threads=lambda n: None,
                             trial_steps=1)
    run_steps(t, FakeClock({1: 1.0, 2: 3.0}), 3)
    busy[0] = 2.0  # a second neighbour: still 1 thread by the rule
    assert run_steps(t, FakeClock({1: 1.0, 2: 3.0}), 5) == [1] * 5 and t.trials == t.follows == 0


def test_a_load_change_during_the_first_steps_counts_too():
    busy = [0.0]  # the machine looked free when the stage chose 2 threads
    t = threads.ThreadTuner([1, 2], start=2, usable=2, every=1000, probe=lambda: busy[0], set_threads=lambda n: None,
                             trial_steps=1)
    clock = FakeClock({1: 1.0, 2: 3.0})  # ... and a CPU-bound process arrived at once
    busy[0] = 1.0
    used = run_steps(t, clock, 6)
    assert used == [2, 2, 1, 1, 1, 1]  # followed as soon as two steps are done


def test_one_slow_trial_step_does_not_decide():
    slow_once = iter([5.0])  # the first step at 1 thread meets a burst of other work
    t = threads.ThreadTuner([1, 2], start=2, every=3, probe=lambda: None, set_threads=lambda n: None, trial_steps=2)
    used = []
    for _ in range(8):
        n = t.before_step()
        used.append(n)
        t.after_step(next(slow_once, 1.0) if n == 1 else 2.0)
    assert used == [2, 2, 2, 1, 1, 1, 1, 1]  # the faster of its two trial steps (1.0 s) beats 2.0 s


def test_the_check_keeps_the_counts_with_one_threads_digest_and_leaves_one_thread():
    digests, set_to = {1: b"a", 2: b"b", 4: b"a"}, []
    probe = threads.check_counts([2, 4], digests.get, set_threads=set_to.append)
    assert probe["checked"] == [1, 2, 4] and probe["kept"] == [1, 4] and set_to == [1, 2, 4, 1]
    assert probe["cpu"] == threads.cpu_model() and probe["seconds"] >= 0
    skipped = threads.check_counts([1, 2], {1: None, 2: b"a"}.get, set_threads=set_to.append)
    assert skipped["kept"] == [1] and skipped["checked"] == [1]  # no update to compare: one thread


class CountRounding:
    """A step body whose trained bits depend on torch's thread count, as those of an op that splits
    a reduction between threads can: its gradient is scaled by 1 + (threads - 1) 2^-20, a
    difference in the last bits of every element from the first step on (a real split rounds
    differently only on some values; this one always does, so the test below never passes by chance)."""

    def __init__(self, model):
        self.model = model
        self.x = torch.randn(256, generator=torch.Generator().manual_seed(0))

    def step(self, step, updater):
        loss = (self.model.weight.reshape(-1) * self.x).sum() * (1 + (torch.get_num_threads() - 1) * 2 ** -20)
        updater.backward(loss)
        outcome, (value,), _ = updater.apply(loss.detach().reshape(1))
        return {"loss": value} if outcome == "applied" else None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def loop_bytes(tmp_path, monkeypatch, *, auto: bool, busy: float = 0.0, fixed: int = 1):
    """The parameter bytes after 6 steps of CountRounding under `auto` on 2 usable CPUs with `busy` of
    them taken by other processes (0: the load rule starts on 2), or on `fixed` threads."""
    import functools

    from llm.config import LoopConfig
    from llm.runtime import Runtime
    from llm.train import loop

    monkeypatch.setattr(threads, "ThreadTuner", functools.partial(threads.ThreadTuner, every=2, probe=lambda: None))
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(loop, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "busy_cpus", lambda *a: busy)
    cfg = LoopConfig(max_steps=6, lr=1e-2, min_lr=1e-2, warmup_steps=0, weight_decay=0.0, beta1=0.9, beta2=0.95,
                     grad_clip=0.0, eval_every=100, checkpoint_every=100, keep_checkpoints=2,
                     nonfinite_policy="raise", nonfinite_budget=0)
    model = torch.nn.Linear(256, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 256, generator=torch.Generator().manual_seed(1)) * 1e-2)
    torch.set_num_threads(1 if auto else fixed)
    run_dir = tmp_path / f"{auto}-{busy}-{fixed}"
    res = loop.run_loop(CountRounding(model), loop.Updater(model, cfg, Runtime(torch.device("cpu"), auto_threads=auto),
                                                      stage="pretrain"),
                        cfg, Runtime(torch.device("cpu"), auto_threads=auto), stage="pretrain", model=model,
                        run_dir=run_dir, fingerprint="fp", progress=False)
    return model.weight.detach().numpy().tobytes(), res


def test_a_stages_bytes_do_not_change_with_the_load_under_auto(tmp_path, monkeypatch, restore_threads):
    """Under the default `auto`, a step whose bits change with the thread count trains the same
    bytes whatever the load: the check before the first step drops 2 threads, and its own steps
    (one at 1 and one at 2 threads from the starting state) leave no trace in the run."""
    one, _ = loop_bytes(tmp_path, monkeypatch, auto=False, fixed=1)
    two, _ = loop_bytes(tmp_path, monkeypatch, auto=False, fixed=2)
    assert two != one  # this step's bits do depend on the count, so the test can fail
    idle, res = loop_bytes(tmp_path, monkeypatch, auto=True, busy=0.0)  # the load rule would run 2
    loaded, _ = loop_bytes(tmp_path, monkeypatch, auto=True, busy=1.0)  # ... and here 1
    assert idle == loaded == one
    assert res.threads_probe["checked"] == [1, 2] and res.threads_probe["kept"] == [1]
    assert res.threads_steps == {"1": 6}


def test_pretrains_step_under_auto_trains_one_threads_bytes_at_any_load(tmp_path, monkeypatch, restore_threads):
    """The real step (the GPT, lm_loss, AdamW through llm/train/trainer.py) under `auto` with the load
    rule starting on 2 threads gives the bytes of a run on one thread, on this machine whatever
    its CPU: where 2 threads round differently, the check keeps 1 alone."""
    import functools

    import numpy as np

    from llm.config import ModelConfig, TrainConfig
    from llm.data.batching import WindowSampler
    from llm.nn.model import GPT
    from llm.runtime import Runtime
    from llm.train import loop
    from llm.train.trainer import train

    monkeypatch.setattr(threads, "ThreadTuner", functools.partial(threads.ThreadTuner, every=2, probe=lambda: None))
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(loop, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "busy_cpus", lambda *a: 0.0)
    tokens = np.random.default_rng(0).integers(0, 256, 20000).astype(np.uint16)
    cfg = TrainConfig(max_steps=6, batch_size=8, grad_accum=1, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                      weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, eval_every=100, eval_batches=1,
                      log_every=1, checkpoint_every=100, keep_checkpoints=2, nonfinite_policy="raise",
                      nonfinite_budget=0, activation_checkpointing=False, compile=False)

    def trained(auto: bool):
        model = GPT(ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=64), seed=0)
        torch.set_num_threads(1)
        res = train(model, cfg, Runtime(torch.device("cpu"), auto_threads=auto), stage="pretrain", seed=3,
                    batches=WindowSampler(tokens, seq_len=64, batch_size=8, seed=1), run_dir=tmp_path / str(auto),
                    fingerprint="fp", progress=False)
        return b"".join(t.numpy().tobytes() for t in model.state_dict().values()), res.metrics

    one, _ = trained(auto=False)
    auto, m = trained(auto=True)
    assert auto == one
    assert m["threads_probe"]["checked"] == [1, 2]
    assert set(m["threads_steps"]) == {str(n) for n in m["threads_probe"]["kept"]}  # ran every count kept, no other
