"""The training loop: schedule, optimizer groups, accumulation, non-finite policy, exact resume, signals, DDP.

Subprocess tests (SIGKILL, DDP/FSDP with 2 gloo processes) run this file's `_child`
function in a fresh interpreter: `python -c "...; test_trainer._child(argv)"`.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llm.config import CommonConfig, ConfigError, ModelConfig, TrainConfig
from llm.data.batching import WindowSampler, fixed_windows
from llm.errors import NonFiniteError
from llm.nn.model import GPT
from llm.nn.optim import build_optimizer, build_optimizers, lr_at, param_groups, set_lr, set_trainable
from llm.runtime import Runtime, enable_activation_checkpointing, resolve_device, resolve_dtype
from llm.train.metrics import read_metrics
from llm.train.monitor import Plots
from llm.train.trainer import accumulate_gradients, lm_loss, supervised_lm_loss, train
from tests.conftest import dvc_command, free_port

ROOT = Path(__file__).resolve().parents[1]
TOKENS = np.random.default_rng(0).integers(0, 64, 6000).astype(np.uint16)
CPU = Runtime(torch.device("cpu"))
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(dropout: float = 0.1, seed: int = 0) -> GPT:
    return GPT(ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=16,
                           dropout=dropout), seed=seed)


def tcfg(**kw) -> TrainConfig:
    base = dict(max_steps=8, batch_size=4, grad_accum=2, lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.1,
                beta1=0.9, beta2=0.95, grad_clip=1.0, eval_every=4, eval_batches=2, log_every=2,
                checkpoint_every=2, keep_checkpoints=2, nonfinite_policy="raise", nonfinite_budget=0,
                activation_checkpointing=False, compile=False)
    base.update(kw)
    return TrainConfig(**base)


class MaskEveryThird:
    """A batch source whose targets after tokens divisible by 3 are masked (as SFT masks its
    prompts): the same positions whatever the process count or micro-batch split."""

    def __init__(self, src):
        self.src = src

    def next_batch(self):
        return mask_every_third(self.src.next_batch())

    def state_dict(self):
        return self.src.state_dict()

    def load_state_dict(self, state):
        self.src.load_state_dict(state)


def mask_every_third(batch):
    return {**batch, "targets": batch["targets"].masked_fill(batch["idx"] % 3 == 0, -100)}


def run(run_dir, cfg=None, *, model=None, loss_fn=lm_loss, fingerprint="fp", rt=CPU, tsv=None, png=None, tb_dir=None,
        masked=False, **kw):
    cfg = cfg or tcfg()
    model = model if model is not None else tiny_model()
    src = WindowSampler(TOKENS, seq_len=16, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, seed=1,
                        rank=rt.rank, world_size=rt.world_size)
    val = fixed_windows(TOKENS, seq_len=16, batch_size=4, n_batches=cfg.eval_batches)
    if masked:
        src, val = MaskEveryThird(src), [mask_every_third(b) for b in val]
    res = train(model, cfg, rt, stage="test", seed=7, batches=src, loss_fn=loss_fn, val_batches=val,
                run_dir=run_dir, fingerprint=fingerprint, plots=Plots(tsv=tsv, png=png, tb_dir=tb_dir), progress=False,
                **kw)
    return res, model


class Inject:
    """lm_loss, with `action(model, batch, loss_sum) -> loss_sum` on the training calls of one step attempt."""

    def __init__(self, attempt: int, action, grad_accum: int = 2):
        self.attempt, self.action, self.accum, self.calls = attempt, action, grad_accum, 0
        self.snapshots: list = []

    def __call__(self, model, batch):
        loss_sum, w = lm_loss(model, batch)
        if model.training:
            a = self.calls // self.accum  # 0-based optimizer-step attempt
            self.calls += 1
            if a == self.attempt:
                loss_sum = self.action(model, batch, loss_sum)
        return loss_sum, w


def losses(res):
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in res.train_history]


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------
# Schedule and optimizer groups

def test_lr_schedule_values():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0  # cosine starts at the peak
    assert lr_at(9, **kw) == pytest.approx(0.55)  # halfway: (lr + min_lr) / 2
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(100, **kw) == pytest.approx(0.1)
    assert lr_at(6, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)))
    assert lr_at(0, lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=10) == 1.0
    with pytest.raises(ValueError):
        lr_at(-1, **kw)


def test_param_groups_no_decay_on_norms_biases_embeddings():
    m = GPT(ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=16, bias=True,
                        pos="learned", tie_embeddings=True))
    groups = {g["name"]: g for g in param_groups(m, 0.1)}
    decay, no_decay = set(groups["decay"]["param_names"]), set(groups["no_decay"]["param_names"])
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert {"wte.weight", "wpe.weight"} <= no_decay
    assert all("norm" not in n and not n.endswith("bias") for n in decay)
    assert any(n.endswith("bias") for n in no_decay) and any("norm" in n for n in no_decay)
    assert "lm_head.weight" not in decay | no_decay  # tied: the same tensor as wte, listed once
    n_listed = sum(p.numel() for g in groups.values() for p in g["params"])
    assert n_listed == m.n_params()


def test_set_trainable_freezes_what_no_glob_names_and_the_optimizer_leaves_it_out():
    m = GPT(ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=16))
    kept = set_trainable(m, ["norm_f.weight", "blocks.1.*"], "dpo.trainable")
    assert kept == [n for n, _ in m.named_parameters() if n == "norm_f.weight" or n.startswith("blocks.1.")]
    assert {n for n, p in m.named_parameters() if p.requires_grad} == set(kept)
    listed = {n for g in param_groups(m, 0.1) for n in g["param_names"]}
    assert listed == set(kept)
    assert set_trainable(m, ["*"]) == [n for n, _ in m.named_parameters()]
    assert all(p.requires_grad for p in m.parameters())
    with pytest.raises(ValueError, match=r"dpo.trainable: \['norm_x'\] match no parameter.*norm_f.weight"):
        set_trainable(m, ["norm_f.weight", "norm_x"], "dpo.trainable")


def test_build_optimizer_is_fused_adamw_with_our_groups_and_betas():
    """Two steps of the optimizer every stage uses (fused on the CPU) against AdamW written out."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_kv_head=2, n_embd=16, bias=True))
    cfg = tcfg(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95)
    opt = build_optimizer(m, cfg, "cpu")
    assert all(g["fused"] for g in opt.param_groups)
    params = {n: p for n, p in m.named_parameters()}
    decay = {n for g in param_groups(m, cfg.weight_decay) if g["name"] == "decay" for n in g["param_names"]}
    state = {n: (p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}
    for t in (1, 2):
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        for n, (w, mom, var) in state.items():
            g = grads[n]
            mom.mul_(0.9).add_(0.1 * g)
            var.mul_(0.95).add_(0.05 * g * g)
            if n in decay:
                w.mul_(1 - 1e-2 * 0.1)
            w.sub_(1e-2 * (mom / (1 - 0.9 ** t)) / ((var / (1 - 0.95 ** t)).sqrt() + 1e-8))
    for n, (w, _, _) in state.items():
        torch.testing.assert_close(params[n].detach(), w, rtol=1e-5, atol=1e-6, msg=n)


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    """nanochat's split: Muon on the transformer blocks' weight matrices; the embedding, an untied
    LM head, norms and biases in AdamW's groups (decay and no_decay as with AdamW alone)."""
    m = GPT(ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=16, bias=True,
                        tie_embeddings=False))
    muon, adamw = build_optimizers(m, tcfg(optimizer="muon", muon_lr=0.02), "cpu")
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {g["name"]: set(g["param_names"]) for opt in (muon, adamw) for g in opt.param_groups}
    blocks = {f"blocks.{i}.{w}.weight" for i in (0, 1) for w in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert names["muon"] == blocks
    assert names["decay"] == {"lm_head.weight"}
    assert "wte.weight" in names["no_decay"] and "blocks.0.attn.qkv.bias" in names["no_decay"]
    assert set().union(*names.values()) == {n for n, _ in m.named_parameters()}  # each parameter somewhere
    assert [type(o) for o in build_optimizers(m, tcfg(), "cpu")] == [torch.optim.AdamW]


def test_the_schedule_scales_muons_lr_as_it_scales_adamws():
    m = tiny_model()
    opts = build_optimizers(m, tcfg(optimizer="muon", lr=3e-3, muon_lr=0.03), "cpu")
    set_lr(opts, 1.5e-3)  # half the peak
    lrs = {g["name"]: g["lr"] for opt in opts for g in opt.param_groups}
    assert lrs == {"muon": pytest.approx(0.015, rel=1e-12), "no_decay": 1.5e-3}  # tied head: no AdamW decay group


# ---------------------------------------------------------------------------
# Gradient accumulation

def test_k_micro_batches_give_the_gradients_of_one_batch():
    torch.manual_seed(0)
    m = tiny_model(dropout=0.0)
    big = WindowSampler(TOKENS, seq_len=16, batch_size=6, seed=2).next_batch()
    # uneven masking: a naive mean of per-micro-batch means would weight tokens unequally
    big["targets"][0, 3:] = -100
    big["targets"][1, :] = -100
    big["targets"][4, 10:] = -100
    parts = [{k: v[s] for k, v in big.items()} for s in (slice(0, 2), slice(2, 3), slice(3, 6))]

    def grads(micro):
        m.zero_grad(set_to_none=True)
        stats, _ = accumulate_gradients(m, micro, lm_loss, CPU)
        return stats, [p.grad.clone() for p in m.parameters()]

    s1, g1 = grads([big])
    s3, g3 = grads(parts)
    assert s1[1] == s3[1] == (big["targets"] != -100).sum()  # same total weight
    assert float(s1[0]) == pytest.approx(float(s3[0]), rel=1e-6)
    for a, b in zip(g1, g3):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # the test can fail: averaging per-micro-batch means gives other gradients
    m.zero_grad(set_to_none=True)
    for b in parts:
        s, w = lm_loss(m, b)
        (s / w / len(parts)).backward()
    assert max((a - p.grad).abs().max().item() for a, p in zip(g1, m.parameters())) > 1e-4


def test_supervised_lm_loss_is_lm_loss_at_the_supervised_positions():
    m = tiny_model(dropout=0.0)
    b = WindowSampler(TOKENS, seq_len=16, batch_size=4, seed=2).next_batch()
    b["targets"][0, :11] = -100  # a prompt
    b["targets"][1, :] = -100    # nothing supervised
    b["attention_mask"] = torch.ones_like(b["idx"], dtype=torch.bool)
    b["attention_mask"][2, 13:] = False  # right padding, its targets masked
    b["targets"][2, 13:] = -100
    out = []
    for fn in (lm_loss, supervised_lm_loss):
        m.zero_grad(set_to_none=True)
        loss, w = fn(m, b)
        loss.backward()
        out.append((loss.detach(), int(w), [p.grad.clone() for p in m.parameters()]))
    (la, wa, ga), (lb, wb, gb) = out
    assert wa == wb == int((b["targets"] != -100).sum()) == 5 + 0 + 13 + 16
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=0.0)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    # the logits it computes are the full forward's rows at those positions, in row-major order
    keep = b["targets"] != -100
    with torch.no_grad():
        full = m(b["idx"], attention_mask=b["attention_mask"])
        torch.testing.assert_close(m(b["idx"], attention_mask=b["attention_mask"], logits_at=keep), full[keep])


def test_all_masked_batch_is_finite_with_zero_gradient():
    m = tiny_model(dropout=0.0)
    b = WindowSampler(TOKENS, seq_len=16, batch_size=2, seed=2).next_batch()
    b["targets"][:] = -100
    stats, _ = accumulate_gradients(m, [b], lm_loss, CPU)
    assert float(stats[0]) == 0.0 and all(float(p.grad.abs().sum()) == 0.0 for p in m.parameters())


def test_activation_checkpointing_gives_the_same_gradients():
    b = WindowSampler(TOKENS, seq_len=16, batch_size=2, seed=2).next_batch()
    out = []
    for ac in (False, True):
        m = tiny_model(dropout=0.0)
        if ac:
            assert enable_activation_checkpointing(m) == 2
        accumulate_gradients(m, [b], lm_loss, CPU)
        out.append([p.grad for p in m.parameters()])
    for a, c in zip(*out):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------
# Exact resume, signals, staleness

@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_a_crash_is_bitwise_identical(tmp_path, optimizer):
    cfg = tcfg(optimizer=optimizer)
    ref, ref_model = run(tmp_path / "ref", cfg, tsv=tmp_path / "ref.tsv")

    def crash(model, batch, loss):
        raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "run", cfg, loss_fn=Inject(5, crash), tsv=tmp_path / "run.tsv")  # during step 6; newest ckpt: 4
    res, model = run(tmp_path / "run", cfg, model=tiny_model(seed=99), tsv=tmp_path / "run.tsv")
    assert res.resumed_from == 4
    assert losses(res) == losses(ref)  # every per-step loss, lr and grad norm, bit for bit
    assert [r["val_loss"] for r in res.val_history] == [r["val_loss"] for r in ref.val_history]
    assert same_weights(model, ref_model)
    rows = (tmp_path / "run.tsv").read_text().splitlines()
    assert [int(r.split("\t")[0]) for r in rows[1:]] == list(range(1, 9))  # each step once
    ref_rows = (tmp_path / "ref.tsv").read_text().splitlines()
    assert [r.split("\t")[1] for r in rows] == [r.split("\t")[1] for r in ref_rows]  # loss column


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path):
    ref, ref_model = run(tmp_path / "ref", tsv=tmp_path / "ref.tsv")

    def term(model, batch, loss):
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))  # the handler sets a flag; the step finishes
        return loss

    sent: list = []

    with pytest.raises(SystemExit) as e:
        run(tmp_path / "run", loss_fn=Inject(2, term), tsv=tmp_path / "run.tsv")  # during step 3
    assert e.value.code == 128 + signal.SIGTERM
    assert (tmp_path / "run" / "ckpt-00000003" / "manifest.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    (tmp_path / "run.tsv").unlink()  # as `dvc repro` does with outputs before re-running a stage
    res, model = run(tmp_path / "run", model=tiny_model(seed=5), tsv=tmp_path / "run.tsv")
    assert res.resumed_from == 3 and losses(res) == losses(ref) and same_weights(model, ref_model)
    rows = [r.split("\t") for r in (tmp_path / "run.tsv").read_text().splitlines()]
    ref_rows = [r.split("\t") for r in (tmp_path / "ref.tsv").read_text().splitlines()]
    assert [r[:4] for r in rows] == [r[:4] for r in ref_rows]  # step, loss, lr, grad_norm: all 8 rows


def test_corrupt_newest_checkpoint_resumes_the_previous_one(tmp_path, capsys):
    ref, ref_model = run(tmp_path / "ref", tcfg(max_steps=4))
    run(tmp_path / "run", tcfg(max_steps=4))
    f = tmp_path / "run" / "ckpt-00000004" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    res, model = run(tmp_path / "run", tcfg(max_steps=4), model=tiny_model(seed=3))
    assert res.resumed_from == 2 and str(f) in capsys.readouterr().out
    assert losses(res) == losses(ref) and same_weights(model, ref_model)


def test_params_change_starts_fresh_instead_of_resuming(tmp_path, capsys):
    run(tmp_path / "run", tcfg(max_steps=4), fingerprint="params-A")
    res, _ = run(tmp_path / "run", tcfg(max_steps=4, lr=1e-3), fingerprint="params-B")
    out = capsys.readouterr().out
    assert res.resumed_from is None and res.train_history[0]["step"] == 1
    assert "fresh start" in out and "fingerprint differs" in out
    assert sorted(p.name for p in (tmp_path / "run" / "stale" / "params-A").iterdir()) == ["ckpt-00000002",
                                                                                          "ckpt-00000004"]


def test_finished_run_rerun_returns_its_metrics_without_training(tmp_path):
    a, _ = run(tmp_path / "run", tcfg(max_steps=2))
    b, _ = run(tmp_path / "run", tcfg(max_steps=2), model=tiny_model(seed=4))
    assert b.resumed_from == 2 and losses(a) == losses(b) and b.metrics["val_loss"] == a.metrics["val_loss"]


# ---------------------------------------------------------------------------
# Non-finite policy

def _nan(model, batch, loss):
    return loss * float("nan")


def test_nan_loss_with_raise_names_the_step(tmp_path):
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite loss.*no update was applied"):
        run(tmp_path, loss_fn=Inject(2, _nan))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_nan_loss_with_skip_changes_nothing_and_is_counted(tmp_path, monkeypatch, optimizer):
    import llm.train.loop as loop
    made = []
    real_build = loop.build_optimizers
    monkeypatch.setattr(loop, "build_optimizers", lambda *a, **k: made.extend(real_build(*a, **k)) or made)
    calls, snaps = [0], []

    def snapshot(model):
        ps = list(model.parameters())
        return ([p.detach().clone() for p in ps],
                [{k: v.clone() for opt in made for k, v in opt.state.get(p, {}).items()} for p in ps])

    def loss_fn(model, batch):
        s, w = lm_loss(model, batch)
        if model.training:
            attempt, micro = divmod(calls[0], 2)
            calls[0] += 1
            if micro == 0 and attempt in (3, 4):  # before the NaN attempt, and before its retry
                snaps.append(snapshot(model))
            if attempt == 3:
                s = s * float("nan")
        return s, w

    res, _ = run(tmp_path, tcfg(nonfinite_policy="skip", nonfinite_budget=1, optimizer=optimizer), loss_fn=loss_fn)
    assert res.metrics["nonfinite_skips"] == 1 and res.step == 8
    (p_before, o_before), (p_after, o_after) = snaps
    assert all(torch.equal(a, b) for a, b in zip(p_before, p_after))  # no parameter moved
    for a, b in zip(o_before, o_after):  # no moment, no Adam step count, no Muon momentum changed
        assert a.keys() in ({"step", "exp_avg", "exp_avg_sq"}, {"momentum_buffer"})
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the schedule did not advance: the retry is step 4 with step 4's lr
    assert res.train_history[3]["lr"] == lr_at(3, lr=3e-3, min_lr=3e-4, warmup_steps=2, max_steps=8)


def test_infinite_gradient_norm_is_caught(tmp_path):
    def inf_grad(model, batch, loss):
        next(model.parameters()).register_hook(lambda g: g * float("inf"))  # loss stays finite
        return loss

    with pytest.raises(NonFiniteError, match="step 2: non-finite gradient norm"):
        run(tmp_path, loss_fn=Inject(1, inf_grad))


def test_skip_budget_is_enforced(tmp_path):
    calls = [0]

    def nan_from_step_3(model, batch):
        s, w = lm_loss(model, batch)
        if model.training:
            calls[0] += 1
            if calls[0] > 4:
                s = s * float("nan")
        return s, w

    with pytest.raises(NonFiniteError, match="3 non-finite updates, above test.nonfinite_budget=2"):
        run(tmp_path, tcfg(nonfinite_policy="skip", nonfinite_budget=2), loss_fn=nan_from_step_3)


# ---------------------------------------------------------------------------
# Devices

def test_resolve_device_and_dtype_on_cpu():
    common = CommonConfig(seed=0, device="auto", dtype="auto", nproc=1, num_threads=0, cpu_kernels=True)
    if not torch.cuda.is_available():
        assert resolve_device(common) == torch.device("cpu")
        with pytest.raises(ConfigError, match="common.device: cuda"):
            resolve_device(CommonConfig(seed=0, device="cuda", dtype="auto", nproc=1, num_threads=0, cpu_kernels=True))
    assert resolve_dtype(common, torch.device("cpu")) == torch.float32
    with pytest.raises(ConfigError, match="common.dtype: bf16 needs a CUDA device"):
        resolve_dtype(CommonConfig(seed=0, device="cpu", dtype="bf16", nproc=1, num_threads=0, cpu_kernels=True), torch.device("cpu"))


def test_fp16_with_grad_scaler_trains_and_resumes(tmp_path):
    """The CUDA fp16 path (autocast + GradScaler), exercised on CPU, where both exist."""
    fp16 = Runtime(torch.device("cpu"), dtype=torch.float16)
    ref, _ = run(tmp_path / "fp32", tcfg(max_steps=4), model=tiny_model(dropout=0.0))
    a, model_a = run(tmp_path / "a", tcfg(max_steps=4), model=tiny_model(dropout=0.0), rt=fp16)
    assert all(abs(x[1] - y[1]) < 2e-2 for x, y in zip(losses(a), losses(ref)))
    from llm.train.checkpoint import load_checkpoint
    scaler = load_checkpoint(tmp_path / "a" / "ckpt-00000004").train_state["updater"]["scaler"]
    assert scaler["scale"] > 0
    with pytest.raises(RuntimeError, match="simulated"):
        run(tmp_path / "b", tcfg(max_steps=4), model=tiny_model(dropout=0.0), rt=fp16,
            loss_fn=Inject(2, lambda m, b, loss: (_ for _ in ()).throw(RuntimeError("simulated"))))
    b, model_b = run(tmp_path / "b", tcfg(max_steps=4), model=tiny_model(dropout=0.0, seed=3), rt=fp16)
    assert b.resumed_from == 2 and losses(b) == losses(a) and same_weights(model_a, model_b)


def test_fp16_overflow_is_left_to_the_scaler_not_the_policy(tmp_path):
    def inf_grad_once(model, batch, loss):
        p = next(model.parameters())
        handle = p.register_hook(lambda g: (handle.remove(), g * float("inf"))[1])
        return loss

    fp16 = Runtime(torch.device("cpu"), dtype=torch.float16)
    res, _ = run(tmp_path / "a", tcfg(max_steps=4), rt=fp16, loss_fn=Inject(1, inf_grad_once))  # policy: raise
    assert res.metrics["amp_overflows"] == 1 and res.metrics["nonfinite_skips"] == 0 and res.step == 4

    def inf_grad_always(model, batch, loss):
        next(model.parameters()).register_hook(lambda g: g * float("inf"))
        return loss

    calls = [0]

    def always(model, batch):  # gradients that overflow at any scale: the policy decides, no endless loop
        s, w = lm_loss(model, batch)
        if model.training:
            calls[0] += 1
            if calls[0] > 2:
                s = inf_grad_always(model, batch, s)
        return s, w

    with pytest.raises(NonFiniteError, match="non-finite gradient norm"):
        run(tmp_path / "b", tcfg(max_steps=40), rt=fp16, loss_fn=always)


def test_outputs_tsv_png_tensorboard(tmp_path):
    res, _ = run(tmp_path / "run", tcfg(max_steps=4), tsv=tmp_path / "plots" / "test.tsv",
                 png=tmp_path / "plots" / "test.png", tb_dir=tmp_path / "tb")
    header = (tmp_path / "plots" / "test.tsv").read_text().splitlines()[0].split("\t")
    assert header[0] == "step" and {"loss", "lr", "grad_norm", "weight", "tokens_per_s", "step_s"} <= set(header)
    val = (tmp_path / "plots" / "test_val.tsv").read_text().splitlines()
    assert val[0].split("\t")[:3] == ["step", "val_loss", "val_ppl"] and len(val) == 1 + 2  # steps 0 and 4
    assert (tmp_path / "plots" / "test.png").read_bytes()[:4] == b"\x89PNG"
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb" / "fp").iterdir())  # per fingerprint
    assert all(r["weight"] == 2 * 4 * 16 for r in res.train_history)  # grad_accum x batch x seq_len targets
    m = res.metrics
    assert m["steps"] == 4 and m["tokens_seen"] == 4 * 2 * 4 * 16 and m["nonfinite_skips"] == 0
    assert m["val_loss"] < res.val_history[0]["val_loss"]


# ---------------------------------------------------------------------------
# Subprocess runs: SIGKILL and distributed

def _child(argv: list[str]) -> None:
    """Entry point of the subprocess runs. argv: a JSON object of options, or a list of them run
    one after the other in this one interpreter (starting Python with torch costs a few seconds
    here, more than a run of the tiny model; every run seeds each step, so what ran before it
    in the process changes nothing)."""
    opts = json.loads(argv[0])
    opts = opts if isinstance(opts, list) else [opts]
    torch.set_num_threads(1)
    rt = CPU
    if any(opt.get("distributed") for opt in opts):
        assert all(opt.get("distributed") for opt in opts), "a list of runs is all distributed or all one-process"
        from llm.runtime import setup_runtime
        rt = setup_runtime(CommonConfig(seed=0, device="cpu", dtype="auto", nproc=2, num_threads=1, cpu_kernels=True))
    for opt in opts:
        _child_one(opt, rt)
    if rt.distributed:
        import torch.distributed as dist
        dist.destroy_process_group()


def _child_one(opt: dict, rt: Runtime) -> None:
    if opt.get("kill_in_save"):  # SIGKILL while checkpoint N is half written
        import llm.train.checkpoint as ck
        real = ck.save_file

        def save_file(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            if Path(filename).parent.name.startswith(f".ckpt-{opt['kill_in_save']:08d}"):
                os.kill(os.getpid(), signal.SIGKILL)
        ck.save_file = save_file
    loss_fn = supervised_lm_loss if opt.get("supervised") else lm_loss
    if opt.get("kill_at_attempt") is not None:
        loss_fn = Inject(opt["kill_at_attempt"], lambda m, b, loss: os.kill(os.getpid(), signal.SIGKILL))
    if opt.get("term_at_attempt") is not None and rt.rank == 0:  # only rank 0 gets the signal
        sent: list = []

        def term_once(m, b, loss):
            if not sent:
                sent.append(os.kill(os.getpid(), signal.SIGTERM))
            return loss
        loss_fn = Inject(opt["term_at_attempt"], term_once, grad_accum=2 // rt.world_size)  # micro-batches per rank
    cfg = tcfg(**{"distributed": opt.get("distributed") or "ddp", **opt.get("cfg", {})})
    model = tiny_model(dropout=opt.get("dropout", 0.1))
    if opt.get("trainable"):
        set_trainable(model, opt["trainable"])
    res, model = run(opt["run_dir"], cfg, model=model, loss_fn=loss_fn, rt=rt, masked=bool(opt.get("supervised")))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rt.distributed))
    if rt.is_main:  # (a collective under FSDP: every rank gathers, rank 0 writes)
        from safetensors.torch import save_file
        sd = {k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"}
        save_file(sd, opt["out"] + ".safetensors")
        Path(opt["out"] + ".json").write_text(json.dumps({"losses": losses(res), "resumed_from": res.resumed_from}))


def _spawn(opt: dict | list[dict], env: dict | None = None) -> subprocess.Popen:
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; import test_trainer;"
            f" test_trainer._child(sys.argv[1:])")
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(opt)], cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _child_run(opt: dict | list[dict]) -> tuple[int, str]:
    p = _spawn(opt)
    out, _ = p.communicate(timeout=300)
    return p.returncode, out


def _result(out: str):
    from safetensors.torch import load_file
    return json.loads(Path(out + ".json").read_text()), load_file(out + ".safetensors")


def _assert_same(a, b, exact=True, atol=0.0):
    (ja, wa), (jb, wb) = a, b
    if exact:
        assert ja["losses"] == jb["losses"]
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    else:
        for x, y in zip(ja["losses"], jb["losses"], strict=True):
            assert x[0] == y[0] and abs(x[1] - y[1]) <= atol, (x, y)
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol)


# The uninterrupted runs that the subprocess tests compare against (tests/conftest.py's
# `reference_runs` runs each once per session). "dropout" is the run the kill/resume tests
# repeat (dropout on: its masks follow the sample); the other cases run without dropout, so that
# 1 and 2 processes see the same numbers. A case's "strategies" limits its 2-rank runs (FSDP2
# refuses Muon).
FROZEN = ["norm_f.weight", "blocks.1.mlp.*"]
CASES = {"dropout": {"dropout": 0.1}, "plain": {"dropout": 0.0}, "supervised": {"dropout": 0.0, "supervised": True},
         "frozen": {"dropout": 0.0, "trainable": FROZEN},
         "muon": {"dropout": 0.0, "cfg": {"optimizer": "muon"}, "strategies": ["ddp"]}}
STRATEGIES = ("ddp", "fsdp")


@pytest.mark.slow
def test_sigkill_after_step_k_then_resume_is_bitwise_identical(tmp_path, reference_runs):
    rc, out = _child_run({"run_dir": str(tmp_path / "run"), "out": str(tmp_path / "x"), "kill_at_attempt": 6})
    assert rc == -signal.SIGKILL, out  # killed during step 7, after checkpoint 6
    rc, out = _child_run({"run_dir": str(tmp_path / "run"), "out": str(tmp_path / "run")})
    assert rc == 0, out
    got = _result(str(tmp_path / "run"))
    assert got[0]["resumed_from"] == 6
    _assert_same(got, reference_runs("dropout"))


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, reference_runs):
    run_dir = tmp_path / "run"
    rc, out = _child_run({"run_dir": str(run_dir), "out": str(tmp_path / "x"), "kill_in_save": 4})
    assert rc == -signal.SIGKILL, out
    assert [p.name for p in sorted(run_dir.iterdir()) if p.name.startswith("ckpt-")] == ["ckpt-00000002"]
    assert any(p.name.startswith(".ckpt-00000004") for p in run_dir.iterdir())  # the half-written one
    rc, out = _child_run({"run_dir": str(run_dir), "out": str(tmp_path / "run")})
    assert rc == 0, out
    got = _result(str(tmp_path / "run"))
    assert got[0]["resumed_from"] == 2
    _assert_same(got, reference_runs("dropout"))
    assert not any(p.name.startswith(".ckpt-") for p in run_dir.iterdir())  # cleaned by the next save


# Global batch 8 sequences per step in both: 1 process runs both micro-batches of 4, 2 processes one each.
DDP_TOL = 1e-5  # absolute, on per-step losses (~4.1) and on every final weight (fp32 sum order differs)


def _launch2(opt: dict | list[dict]) -> list[tuple[int, str]]:
    """Run _child(opt) as 2 gloo ranks (the env torchrun would set), return (rc, output) per rank."""
    port = free_port()
    procs = [_spawn(opt, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                          "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    return [(p.returncode, out) for p, out in ((p, p.communicate(timeout=300)[0]) for p in procs)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, case", [("ddp", "dropout"), ("fsdp", "dropout"), ("ddp", "muon")])
def test_distributed_sigterm_then_resume_is_bitwise_identical(tmp_path, strategy, case, reference_runs):
    """SIGTERM on rank 0 only: every rank stops at the same step, one checkpoint (with Muon's and
    AdamW's states under `muon`), exact resume."""
    base = {**CASES[case], "distributed": strategy}
    stop = _launch2({**base, "run_dir": str(tmp_path / "run"), "out": str(tmp_path / "x"), "term_at_attempt": 4})
    assert [rc for rc, _ in stop] == [128 + signal.SIGTERM] * 2, stop
    assert (tmp_path / "run" / "ckpt-00000005" / "manifest.json").is_file()
    again = _launch2({**base, "run_dir": str(tmp_path / "run"), "out": str(tmp_path / "run")})
    assert [rc for rc, _ in again] == [0, 0], again
    got = _result(str(tmp_path / "run"))
    assert got[0]["resumed_from"] == 5
    _assert_same(got, reference_runs(case, strategy))


def _two_match_one(reference_runs, case: str, strategy: str):
    one, two = reference_runs(case), reference_runs(case, strategy)
    dl = max(abs(x[1] - y[1]) for x, y in zip(one[0]["losses"], two[0]["losses"]))
    dw = max((one[1][k] - two[1][k]).abs().max().item() for k in one[1])
    print(f"{case}, {strategy}: max |loss diff| {dl:.2e}, max |weight diff| {dw:.2e} (tolerance {DDP_TOL})")
    _assert_same(one, two, exact=False, atol=DDP_TOL)
    return one, two


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_gloo_processes_match_one_process(reference_runs, strategy):
    _two_match_one(reference_runs, "plain", strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_logits_at_supervised_positions_two_processes_match_one(reference_runs, strategy):
    """SFT's loss passes the positions through the DDP and FSDP2 wrappers' forward."""
    _two_match_one(reference_runs, "supervised", strategy)


@pytest.mark.slow
def test_muon_two_processes_match_one(reference_runs):
    """Muon under DDP: every rank orthogonalises the same summed gradient."""
    _two_match_one(reference_runs, "muon", "ddp")


@pytest.mark.slow
def test_muon_under_fsdp_is_refused_naming_the_keys(tmp_path):
    got = _launch2({**CASES["muon"], "distributed": "fsdp", "run_dir": str(tmp_path / "run"), "out": str(tmp_path / "x")})
    assert all(rc != 0 and "test.optimizer: muon does not run under test.distributed: fsdp" in out for rc, out in got), got


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_parameters_stay_put_and_two_processes_match_one(reference_runs, strategy):
    """What dpo.trainable does (set_trainable), under DDP and FSDP2: the frozen weights come out
    exactly as they went in, the trained ones move, and 2 ranks give 1 process's result."""
    one, two = _two_match_one(reference_runs, "frozen", strategy)
    init = {k: v for k, v in tiny_model(dropout=0.0).state_dict().items() if k != "lm_head.weight"}
    for got in (one, two):
        moved = {k for k in init if not torch.equal(got[1][k], init[k])}
        assert moved == {"norm_f.weight", "blocks.1.mlp.fc.weight", "blocks.1.mlp.proj.weight"}


@pytest.mark.slow
def test_compile_gives_the_eager_losses(tmp_path):
    eager, _ = run(tmp_path / "e", tcfg(max_steps=3), model=tiny_model(dropout=0.0))
    comp, _ = run(tmp_path / "c", tcfg(max_steps=3, compile=True), model=tiny_model(dropout=0.0))
    assert all(abs(x[1] - y[1]) < 1e-5 for x, y in zip(losses(eager), losses(comp)))


def _stage_project(root: Path, nproc: int) -> None:
    """A throwaway project dir: tokenizer, token shards and params for `python -m stages.pretrain`."""
    import yaml
    from llm.data.tokenizer import Tokenizer
    text = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings"
            " and arrows of outrageous fortune, or to take arms against a sea of troubles. ") * 30
    tok = Tokenizer.train([text], vocab_size=300, max_pairs=10000, min_frequency=2)
    tok.save(root / "models" / "tokenizer")
    ids = np.array(tok.encode(text * 4), dtype=np.uint16)
    (root / "data" / "tokens").mkdir(parents=True)
    n = int(len(ids) * 0.9)
    ids[:n].tofile(root / "data" / "tokens" / "train.bin")
    ids[n:].tofile(root / "data" / "tokens" / "val.bin")
    nbytes = len((text * 4).encode())
    (root / "data" / "tokens" / "meta.json").write_text(json.dumps({
        "dtype": "uint16", "train_tokens": n, "val_tokens": len(ids) - n, "train_bytes": round(nbytes * 0.9),
        "val_bytes": round(nbytes * 0.1), "tokenizer_sha256": tok.sha256(), "vocab_size": tok.vocab_size}))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["common"].update(nproc=nproc, num_threads=1, device="cpu")
    params["pretrain"].update(max_steps=20, batch_size=4, grad_accum=2, warmup_steps=2, eval_every=10,
                              eval_batches=2, log_every=5, checkpoint_every=10)
    params["pretrain"]["model"].update(preset="custom", seq_len=32, n_layer=2, n_embd=32, n_head=2, n_kv_head=2)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.slow
def test_pretrain_stage_under_torchrun_writes_every_output(tmp_path):
    """`python -m stages.pretrain` with common.nproc: 2 re-runs itself under torchrun (DDP, gloo)."""
    _stage_project(tmp_path, nproc=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(dvc_command("pretrain"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "2 processes on this machine: torchrun" in out and "2 process(es)" in out
    m = read_metrics(tmp_path / "metrics" / "pretrain.json")  # the metrics and the run file
    for k in ("train_loss", "val_loss", "val_ppl", "val_bpb", "unigram_bpb", "tokens_seen", "tokens_per_s", "mfu",
              "nonfinite_skips", "n_params"):
        assert k in m, k
    assert m["world_size"] == 2 and m["tokens_seen"] == 20 * 2 * 4 * 32 and m["mfu"] is None  # CPU: no peak
    val = (tmp_path / "metrics" / "plots" / "pretrain_val.tsv").read_text().splitlines()
    first_bpb = float(val[1].split("\t")[val[0].split("\t").index("val_bpb")])
    assert m["val_bpb"] < first_bpb  # it learned something
    from llm.nn.artifacts import load_model_dir
    model, tok, meta = load_model_dir(tmp_path / "models" / "base")
    assert meta["stage"] == "pretrain" and model.n_params() == m["n_params"] and tok.vocab_size == 300
    assert (tmp_path / "metrics" / "plots" / "pretrain.png").is_file()
    assert sorted(p.name for p in (tmp_path / "runs" / "pretrain").glob("ckpt-*")) == ["ckpt-00000010",
                                                                                         "ckpt-00000020"]
    assert any((tmp_path / "runs" / "pretrain" / "tb").iterdir())


def test_sft_batches_without_replay_are_the_bucket_batches_they_always_were():
    """sft.replay_fraction 0 (the default) hands the loop exactly the batches of the length-bucket
    sampler and the padding collate, as SFT built them before replay existed; above 0 the same
    conversations come first in every batch."""
    from llm.data.batching import BucketBatchSampler, ExampleBatches, conversation_batches, pad_collate, replay_rows
    g = torch.Generator().manual_seed(0)
    examples = [(ids := torch.randint(5, 50, (int(n),), generator=g).tolist(), [j % 3 == 0 for j in range(len(ids))])
                for n in torch.randint(3, 40, (60,), generator=g)]
    today = ExampleBatches(BucketBatchSampler([len(ids) for ids, _ in examples], batch_size=8, bucket_width=5, seed=9),
                           lambda ix: pad_collate([examples[i][0] for i in ix], pad_id=0,
                                                  loss_masks=[examples[i][1] for i in ix]))
    default = conversation_batches(examples, pad_id=0, batch_size=8, bucket_width=5, seed=9)
    replayed = conversation_batches(examples, pad_id=0, batch_size=8, bucket_width=5, seed=9,
                                    replay=np.arange(500, dtype=np.uint16), replay_fraction=0.25)
    for _ in range(30):
        a, b, c = today.next_batch(), default.next_batch(), replayed.next_batch()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert all(torch.equal(a[k], c[k][:len(a["idx"])]) for k in a)
        assert len(c["idx"]) == len(a["idx"]) + replay_rows(len(a["idx"]), 0.25)
