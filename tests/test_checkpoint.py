"""Checkpoints: round trip, verification (truncated, bit-flipped, NaN, unfinished), staleness, retention."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from llm.train.checkpoint import (MANIFEST, MODEL_FILE, STATE_TENSORS, CheckpointError, find_resume,
                                  list_checkpoints, load_checkpoint, prune, quarantine_stale, save_checkpoint)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            self.emb.weight.normal_(generator=g)


def _state(step: int):
    g = torch.Generator().manual_seed(step)
    return {"optimizer": {"state": {0: {"exp_avg": torch.randn(3, 2, generator=g), "step": torch.tensor(3.0)}},
                          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0], "foreach": None}]},
            "rng": g.get_state(),  # uint8
            "history": [{"step": 1, "loss": 2.5}, {"step": 2, "loss": float("nan")}],
            "batches": {"draws": step}}


def _save(run, step, fp="fp", keep=5, model=None):
    return save_checkpoint(run, step, model_state=(model or Tied()).state_dict(), train_state=_state(step),
                           fingerprint=fp, keep=keep)


def test_round_trip_is_exact(tmp_path):
    m = Tied()
    p = _save(tmp_path, 7, model=m)
    ck = load_checkpoint(p)
    assert ck.step == 7 and ck.fingerprint == "fp"
    ref = _state(7)
    st = ck.train_state
    assert torch.equal(st["optimizer"]["state"][0]["exp_avg"], ref["optimizer"]["state"][0]["exp_avg"])
    assert st["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # tuple kept
    assert list(st["optimizer"]["state"]) == [0]  # int key kept
    assert st["rng"].dtype == torch.uint8 and torch.equal(st["rng"], ref["rng"])
    assert st["history"][0] == {"step": 1, "loss": 2.5} and math.isnan(st["history"][1]["loss"])
    m2 = Tied()
    with torch.no_grad():
        m2.emb.weight.zero_()
    m2.load_state_dict(ck.model_state)
    assert torch.equal(m2.emb.weight, m.emb.weight) and m2.head.weight is m2.emb.weight


def test_tied_weight_is_stored_once_and_manifest_is_complete(tmp_path):
    from safetensors.torch import load_file
    p = _save(tmp_path, 1)
    stored = load_file(str(p / MODEL_FILE))
    assert "head.weight" not in stored and "emb.weight" in stored
    manifest = json.loads((p / MANIFEST).read_text())
    assert set(manifest["files"]) == {MODEL_FILE, STATE_TENSORS, "state.json"}
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())


def _warnings():
    seen: list[str] = []
    return seen, seen.append


def test_truncated_newest_is_named_and_previous_used(tmp_path):
    _save(tmp_path, 1)
    p2 = _save(tmp_path, 2)
    f = p2 / MODEL_FILE
    f.write_bytes(f.read_bytes()[:-10])
    seen, warn = _warnings()
    ck, stale = find_resume(tmp_path, "fp", warn=warn)
    assert ck.step == 1 and not stale
    assert len(seen) == 1 and str(f) in seen[0] and "truncated" in seen[0]


def test_bit_flip_is_detected(tmp_path):
    _save(tmp_path, 1)
    p2 = _save(tmp_path, 2)
    f = p2 / STATE_TENSORS
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    seen, warn = _warnings()
    ck, _ = find_resume(tmp_path, "fp", warn=warn)
    assert ck.step == 1 and str(f) in seen[0] and "sha256" in seen[0]


def test_nan_holding_checkpoint_is_detected(tmp_path):
    _save(tmp_path, 1)
    m = Tied()
    with torch.no_grad():
        m.norm.weight[2] = float("nan")
    p2 = _save(tmp_path, 2, model=m)  # hashes are right: only the values are bad
    seen, warn = _warnings()
    ck, _ = find_resume(tmp_path, "fp", warn=warn)
    assert ck.step == 1 and str(p2) in seen[0] and "norm.weight" in seen[0] and "non-finite" in seen[0]


def test_unfinished_write_without_manifest_is_skipped(tmp_path):
    _save(tmp_path, 1)
    p2 = _save(tmp_path, 2)
    (p2 / MANIFEST).unlink()
    seen, warn = _warnings()
    assert find_resume(tmp_path, "fp", warn=warn)[0].step == 1
    assert "no manifest.json" in seen[0]


@pytest.mark.parametrize("hostile, says", [
    ("sparse", "bytes, more than the 65536 this file can hold"),  # 1 GB that would be read whole
    ("nested", "unreadable manifest"),                           # RecursionError in json
    ("directory", "is a directory, not a regular file"),
    ("fifo", "is a FIFO, not a regular file"),                   # reading it would wait for a writer
])
def test_a_hostile_manifest_is_skipped_in_bounded_time_and_memory(tmp_path, hostile, says):
    import os

    from tests.conftest import bounded
    _save(tmp_path, 1)
    p2 = _save(tmp_path, 2)
    m = p2 / MANIFEST
    m.unlink()
    if hostile == "sparse":
        with open(m, "wb") as f:
            f.truncate(1 << 30)
    elif hostile == "nested":
        m.write_text("[" * 20_000 + "]" * 20_000)
    elif hostile == "directory":
        m.mkdir()
    else:
        os.mkfifo(m)
    seen, warn = _warnings()
    with bounded(seconds=5, memory=64 << 20):
        assert find_resume(tmp_path, "fp", warn=warn)[0].step == 1
    assert str(m) in seen[0] and says in seen[0]


def test_all_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    for s in (1, 2):
        p = _save(tmp_path, s)
        (p / STATE_TENSORS).write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as e:
        find_resume(tmp_path, "fp", warn=lambda m: None)
    msg = str(e.value)
    assert "ckpt-00000001" in msg and "ckpt-00000002" in msg and "Refusing to start over" in msg


def test_other_fingerprint_is_never_resumed(tmp_path):
    _save(tmp_path, 1, fp="old")
    _save(tmp_path, 2, fp="old")
    ck, stale = find_resume(tmp_path, "new", warn=lambda m: None)
    assert ck is None and [p.name for p in stale] == ["ckpt-00000002", "ckpt-00000001"]
    dest = quarantine_stale(tmp_path, stale)
    assert list_checkpoints(tmp_path) == [] and sorted(p.name for p in (dest / "old").iterdir()) == [
        "ckpt-00000001", "ckpt-00000002"]


def test_empty_run_dir_is_a_fresh_start(tmp_path):
    assert find_resume(tmp_path / "nothing", "fp") == (None, [])


def test_retention_keeps_the_newest_two_and_clears_killed_writes(tmp_path):
    (tmp_path / ".ckpt-00000009.abc.tmp").mkdir()  # what a killed atomic_dir leaves
    for s in (1, 2, 3, 4):
        _save(tmp_path, s, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 3]
    assert not (tmp_path / ".ckpt-00000009.abc.tmp").exists()
    assert prune(tmp_path, 2) == []


def test_keep_below_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match=">= 2"):
        _save(tmp_path, 1, keep=1)


def test_state_json_mismatch_with_manifest_is_caught(tmp_path):
    """Swapping state.json between checkpoints (and fixing the hashes) is still caught."""
    from llm.fileio import sha256_file
    p1, p2 = _save(tmp_path, 1), _save(tmp_path, 2)
    (p2 / "state.json").write_bytes((p1 / "state.json").read_bytes())
    man = json.loads((p2 / MANIFEST).read_text())
    man["files"]["state.json"] = {"sha256": sha256_file(p2 / "state.json"),
                                  "bytes": (p2 / "state.json").stat().st_size}
    (p2 / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match="disagree"):
        load_checkpoint(p2)


# ---------------------------------------------------------------------------
# A params change sets checkpoints aside and never deletes them; going back resumes them.

def _names(d) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("ckpt-*"))


def test_a_params_round_trip_resumes_from_stale_and_deletes_nothing(tmp_path):
    for s in (1, 2):
        _save(tmp_path, s, fp="a")
    ck, stale = find_resume(tmp_path, "b", warn=lambda m: None)  # switch to b: a's are set aside
    quarantine_stale(tmp_path, stale)
    for s in (1, 2, 3):
        _save(tmp_path, s, fp="b")
    ck, stale = find_resume(tmp_path, "a", warn=lambda m: None)  # back to a
    assert ck.step == 2 and ck.fingerprint == "a" and ck.path == tmp_path / "stale" / "a" / "ckpt-00000002"
    quarantine_stale(tmp_path, stale)
    assert _names(tmp_path) == ["stale/a/ckpt-00000001", "stale/a/ckpt-00000002", "stale/b/ckpt-00000001",
                                "stale/b/ckpt-00000002", "stale/b/ckpt-00000003"]
    _save(tmp_path, 3, fp="a", keep=2)  # a moves on: its own history comes back and is pruned as usual
    assert _names(tmp_path) == ["ckpt-00000002", "ckpt-00000003", "stale/b/ckpt-00000001",
                                "stale/b/ckpt-00000002", "stale/b/ckpt-00000003"]
    ck, stale = find_resume(tmp_path, "b", warn=lambda m: None)
    assert ck.step == 3 and ck.path.parent.name == "b"


def test_a_different_checkpoint_of_the_same_name_is_never_dropped(tmp_path):
    """Same params and step, other bytes (another device, say): both are kept; a byte-identical copy is not."""
    lin = nn.Linear(2, 2)
    (tmp_path / "stale" / "a").mkdir(parents=True)
    _save(tmp_path / "elsewhere", 1, fp="a").rename(tmp_path / "stale" / "a" / "ckpt-00000001")
    _save(tmp_path, 1, fp="a", model=lin)
    assert _names(tmp_path) == ["ckpt-00000001", "stale/a/ckpt-00000001"]
    quarantine_stale(tmp_path, find_resume(tmp_path, "x", warn=lambda m: None)[1])
    assert _names(tmp_path) == ["stale/a.2/ckpt-00000001", "stale/a/ckpt-00000001"]
    _save(tmp_path, 1, fp="a", model=lin)  # the bytes of stale/a.2's: that copy goes, the other stays
    assert _names(tmp_path) == ["ckpt-00000001", "stale/a/ckpt-00000001"]


def test_a_broken_stale_checkpoint_of_this_run_is_skipped_with_a_warning(tmp_path):
    for s in (1, 2):
        _save(tmp_path, s, fp="a")
    quarantine_stale(tmp_path, find_resume(tmp_path, "b", warn=lambda m: None)[1])
    f = tmp_path / "stale" / "a" / "ckpt-00000002" / MODEL_FILE
    f.write_bytes(f.read_bytes()[:-10])
    seen, warn = _warnings()
    ck, stale = find_resume(tmp_path, "a", warn=warn)
    assert ck.step == 1 and stale == [] and str(f) in seen[0]


def test_legacy_flat_stale_checkpoints_are_still_found(tmp_path):
    """Earlier versions moved stale checkpoints straight into stale/."""
    p = _save(tmp_path, 4, fp="a")
    (tmp_path / "stale").mkdir()
    p.rename(tmp_path / "stale" / p.name)
    assert find_resume(tmp_path, "a", warn=lambda m: None)[0].step == 4


@pytest.mark.slow
def test_cpu_smoke_cpu_resumes_the_cpu_run_in_the_training_loop(tmp_path, capsys):
    """The training loop end to end: params A (killed at step 5), then B, then A again."""
    pytest.importorskip("numpy")
    from tests.test_trainer import Inject, losses, run, same_weights, tcfg, tiny_model
    ref, ref_model = run(tmp_path / "ref", tcfg(), fingerprint="A")

    def crash(model, batch, loss):
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path / "run", tcfg(), fingerprint="A", loss_fn=Inject(4, crash))  # during step 5; newest ckpt 4
    b, _ = run(tmp_path / "run", tcfg(lr=1e-3), fingerprint="B")
    assert b.resumed_from is None
    a, model = run(tmp_path / "run", tcfg(), fingerprint="A", model=tiny_model(seed=9))
    assert a.resumed_from == 4 and losses(a)[4:] == losses(ref)[4:] and same_weights(model, ref_model)
    assert _names(tmp_path / "run") == ["ckpt-00000006", "ckpt-00000008", "stale/B/ckpt-00000006",
                                        "stale/B/ckpt-00000008"]
    assert run(tmp_path / "run", tcfg(lr=1e-3), fingerprint="B")[0].resumed_from == 8
