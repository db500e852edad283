"""DPO: the shared sequence log-prob, reference precompute, the DPO
loss_fn at initialisation (log 2), learning a toy preference, the KL to the reference, and
the `dpo` stage end to end with its KL gate."""
from __future__ import annotations

import json
import math

import pytest
import torch

from llm.config import ModelConfig, TrainConfig
from llm.data.preference import collate_pairs, fixed_pair_batches, pair_batches
from llm.nn.losses import sequence_logprob
from llm.nn.model import GPT
from llm.post.dpo import answer_logprobs, dpo_loss, dpo_loss_fn, dpo_metrics, reference_logprobs
from llm.runtime import Runtime
from llm.train.trainer import train
from tests.test_reward import _toy_pairs, _write_jsonl, make_workspace, run_stage, tcfg, write_params

CPU = Runtime(torch.device("cpu"))
pytestmark = pytest.mark.usefixtures("one_thread")


def test_dpo_hand_computed():
    pc, pr, rc, rr = map(torch.tensor, ([-10.0], [-12.0], [-11.0], [-11.0]))
    losses, rew_c, rew_r = dpo_loss(pc, pr, rc, rr, beta=0.1)
    h = (-10 + 11) - (-12 + 11)          # = 2
    assert losses.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.1 * h))), abs=1e-6)
    assert rew_c.item() == pytest.approx(0.1) and rew_r.item() == pytest.approx(-0.1)
    ipo, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo")
    assert ipo.item() == pytest.approx((2 - 1 / 0.2) ** 2)
    cdpo, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.2)
    s = lambda z: math.log(1 / (1 + math.exp(-z)))
    assert cdpo.item() == pytest.approx(-0.8 * s(0.2) - 0.2 * s(-0.2), abs=1e-6)


def test_dpo_is_log2_when_policy_equals_reference():
    lp = torch.randn(16) * 5
    lr = torch.randn(16) * 5
    losses, _, _ = dpo_loss(lp, lr, lp.clone(), lr.clone(), beta=0.1)
    assert torch.allclose(losses, torch.full((16,), math.log(2)))


def tiny(seed: int = 0, vocab: int = 41) -> GPT:
    return GPT(ModelConfig(vocab_size=vocab, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), seed=seed)


def test_sequence_logprob_is_the_masked_sum_over_response_tokens():
    class Fixed(torch.nn.Module):  # logits that do not depend on the input: log p = log_softmax(row)
        def forward(self, idx, attention_mask=None):
            return torch.log(torch.tensor([0.5, 0.25, 0.25])).expand(idx.shape[0], idx.shape[1], 3)
    idx = torch.tensor([[0, 1, 2, 0], [2, 2, 0, 0]])
    att = torch.tensor([[True] * 4, [True, True, True, False]])
    resp = torch.tensor([[False, False, True, True], [False, True, True, False]])
    lp = sequence_logprob(Fixed(), idx, att, resp)
    # row 0: tokens 2 and 0 are the response: log 0.25 + log 0.5; row 1: tokens 2 and 0
    assert lp.tolist() == pytest.approx([math.log(0.25) + math.log(0.5), math.log(0.25) + math.log(0.5)])
    per_tok = sequence_logprob(Fixed(), idx, att, resp, per_token=True)
    assert per_tok.shape == (2, 3) and per_tok[0, 0] == 0 and per_tok[1, 2] == 0  # the mask zeroes the rest


def test_reference_logprobs_do_not_depend_on_batching_or_padding():
    m = tiny(1)
    pairs = _toy_pairs(10, 5)
    ref_c, ref_r = reference_logprobs(m, pairs, pad_id=40, batch_size=3)
    for i, p in enumerate(pairs):
        for seq, ref in ((p.chosen, ref_c[i]), (p.rejected, ref_r[i])):
            idx = torch.tensor([seq])
            resp = torch.tensor([[j >= p.prompt_len for j in range(len(seq))]])
            with torch.no_grad():
                alone = sequence_logprob(m, idx, torch.ones_like(idx, dtype=torch.bool), resp)
            assert ref.item() == pytest.approx(alone.item(), abs=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_is_log2_when_the_policy_is_the_reference_end_to_end(loss_type):
    m = tiny(2)
    pairs = _toy_pairs(12, 6)
    ref = reference_logprobs(m, pairs, pad_id=40, batch_size=5)  # batched differently from the loss batch
    b = collate_pairs(pairs, pad_id=40, ref_chosen=ref[0], ref_rejected=ref[1])
    m.train()
    loss, w, extras = dpo_loss_fn(0.1, loss_type, 0.0)(m, b)
    expected = math.log(2) if loss_type == "sigmoid" else (1 / (2 * 0.1)) ** 2
    assert float(w) == 12 and loss.item() / 12 == pytest.approx(expected, abs=1e-5)
    # equal rewards up to float noise from the different batching (so "accuracy" is noise here)
    assert abs(extras["rewards_margin"].item()) < 1e-5 and abs(extras["rewards_chosen"].item()) < 1e-5
    loss.backward()  # and it has a gradient: chosen up, rejected down
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_dpo_loss_with_label_smoothing_is_still_log2_at_the_start():
    m = tiny(3)
    pairs = _toy_pairs(6, 7)
    ref = reference_logprobs(m, pairs, pad_id=40, batch_size=6)
    b = collate_pairs(pairs, pad_id=40, ref_chosen=ref[0], ref_rejected=ref[1])
    loss, _, _ = dpo_loss_fn(0.5, "sigmoid", 0.2)(m, b)
    assert loss.item() / 6 == pytest.approx(math.log(2), abs=1e-5)


def test_ipo_averages_the_log_ratios_per_answer_token():
    """IPO's h uses per-token means of the log-probs (as its authors and TRL define it): by hand."""
    m = tiny(3)
    pairs = _toy_pairs(4, 7)
    b = collate_pairs(pairs, pad_id=40)
    with torch.no_grad():
        sums = answer_logprobs(m, b)                                   # (2B,)
        means = answer_logprobs(m, b, per_token=True)
        n = b["response_mask"][:, 1:].sum(-1).float()                   # answer tokens per row
        torch.testing.assert_close(means, sums / n)
        ref = reference_logprobs(tiny(4), pairs, pad_id=40, batch_size=3, per_token=True)
        bb = collate_pairs(pairs, pad_id=40, ref_chosen=ref[0], ref_rejected=ref[1])
        loss, w, _ = dpo_loss_fn(0.5, "ipo", 0.0)(m, bb)
        B = len(pairs)
        h = (means[:B] - ref[0]) - (means[B:] - ref[1])
        assert loss.item() == pytest.approx(float(((h - 1 / (2 * 0.5)) ** 2).sum()), rel=1e-5)
        # the sigmoid loss keeps the sums
        ref_s = reference_logprobs(tiny(4), pairs, pad_id=40, batch_size=3)
        torch.testing.assert_close(ref_s[0] / n[:B], ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dpo_learns_a_toy_preference_on_held_out_pairs(tmp_path):
    m = tiny(8)
    train_pairs, val_pairs = _toy_pairs(512, 10), _toy_pairs(128, 11)
    ref_train = reference_logprobs(m, train_pairs, pad_id=40, batch_size=64)
    ref_val = reference_logprobs(m, val_pairs, pad_id=40, batch_size=64)
    before = dpo_metrics(m, val_pairs, ref_val, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, pad_id=40,
                         batch_size=64)
    cfg = TrainConfig(**tcfg(max_steps=120, batch_size=16, lr=3e-3, min_lr=3e-4, warmup_steps=10, eval_every=60,
                             checkpoint_every=120))
    res = train(m, cfg, CPU, stage="dpo-toy", seed=3,
                batches=pair_batches(train_pairs, batch_size=16, bucket_width=4, seed=3, pad_id=40, ref=ref_train),
                loss_fn=dpo_loss_fn(0.1, "sigmoid", 0.0),
                val_batches=fixed_pair_batches(val_pairs, batch_size=64, pad_id=40, ref=ref_val),
                run_dir=tmp_path / "run", fingerprint="fp", progress=False)
    after = dpo_metrics(m, val_pairs, ref_val, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, pad_id=40,
                        batch_size=64)
    assert before["rewards_accuracy"] == 0.0 and before["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert after["rewards_accuracy"] >= 0.9 and after["rewards_margin"] > 0 and after["loss"] < math.log(2)
    assert after["rewards_chosen"] > after["rewards_rejected"]
    assert res.metrics["val_rewards_accuracy"] == pytest.approx(after["rewards_accuracy"])
    assert set(after["by_kind"]) == {"high", "low"}


# ---------------------------------------------------------------------------
# The stage

def _pairs_workspace(ws):
    make_workspace(ws)
    for split in ("train", "val"):
        recs = [json.loads(x) for x in (ws / f"data/prepared/prefs/{split}.jsonl").read_text().splitlines()]
        for r in recs:
            r.update(scorer="verifier", adversarial=False, preference_score=0.77)
        _write_jsonl(ws / f"data/pairs/{split}.jsonl", recs)
    return ws


@pytest.mark.slow
def test_dpo_stage_end_to_end(tmp_path):
    ws = _pairs_workspace(tmp_path)
    run = run_stage(ws, "dpo")
    assert run.returncode == 0, run.stderr
    m = json.loads((ws / "metrics/dpo.json").read_text())
    for k in ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "kl", "kl_seq", "loss",
              "train_loss", "steps"):
        assert m[k] is not None and math.isfinite(m[k]), k
    assert m["n_pairs"] == 16 and m["steps"] == 4 and m["kl_prompts"] == 4 and m["kl"] >= 0
    assert m["rewards_margin"] == pytest.approx(m["rewards_chosen"] - m["rewards_rejected"], abs=1e-6)
    assert sum(v["n"] for v in m["by_kind"].values()) == 16
    from llm.nn.artifacts import load_model_dir
    model, _, meta = load_model_dir(ws / "models/dpo")
    assert meta["stage"] == "dpo" and model.head_names == ("lm",)
    # the baseline: the share of held-out pairs the SFT reference's own sequence log-probs rank right
    from llm.data.preference import encode_pairs
    sft, tok, _ = load_model_dir(ws / "models/sft", heads=("lm",))
    recs = [json.loads(x) for x in (ws / "data/pairs/val.jsonl").read_text().splitlines()]
    pairs, kept, _ = encode_pairs(recs, tok, sft.config.seq_len)
    rc, rr = reference_logprobs(sft, pairs, pad_id=tok.pad_id, batch_size=3)
    assert m["ref_logp_accuracy"] == pytest.approx(float((rc > rr).double().mean()))
    for kind, v in m["by_kind"].items():
        ix = [i for i, p in enumerate(pairs) if p.kind == kind]
        assert v["ref_logp_accuracy"] == pytest.approx(float((rc[ix] > rr[ix]).double().mean())), kind
    header = (ws / "metrics/plots/dpo.tsv").read_text().splitlines()[0].split("\t")
    assert header[0] == "step" and {"rewards_accuracy", "rewards_margin", "rewards_chosen"} <= set(header)
    assert "val_rewards_accuracy" in (ws / "metrics/plots/dpo_val.tsv").read_text().splitlines()[0]


@pytest.mark.slow
def test_dpo_stage_trains_only_the_parameters_dpo_trainable_names(tmp_path):
    ws = _pairs_workspace(tmp_path)
    write_params(ws, dpo=dict(trainable=["norm_f.weight"], lr=1.0e-2, min_lr=1.0e-3))
    run = run_stage(ws, "dpo")
    assert run.returncode == 0, run.stderr
    from llm.nn.artifacts import load_model_dir
    sft = dict(load_model_dir(ws / "models/sft")[0].named_parameters())
    dpo = dict(load_model_dir(ws / "models/dpo")[0].named_parameters())
    changed = {n for n, p in dpo.items() if not torch.equal(p, sft[n])}
    assert changed == {"norm_f.weight"}
    m = json.loads((ws / "metrics/dpo.json").read_text())
    assert m["trainable_params"] == sft["norm_f.weight"].numel() and m["rewards_accuracy"] > 0
    assert "training 32 of them" in run.stdout


@pytest.mark.slow
def test_dpo_trainable_glob_matching_nothing_is_an_error_naming_the_key(tmp_path):
    ws = _pairs_workspace(tmp_path)
    write_params(ws, dpo=dict(trainable=["norm_final.*"]))
    run = run_stage(ws, "dpo")
    assert run.returncode == 1
    assert "dpo.trainable" in run.stderr and "norm_final.*" in run.stderr and "norm_f.weight" in run.stderr
    assert not (ws / "models/dpo").exists()


@pytest.mark.slow
def test_dpo_kl_gate_fails_and_writes_nothing(tmp_path):
    ws = _pairs_workspace(tmp_path)
    write_params(ws, dpo=dict(max_kl=1.0e-9, lr=1.0e-2, min_lr=1.0e-3))
    run = run_stage(ws, "dpo")
    assert run.returncode == 1, run.stderr
    assert "dpo.max_kl=1e-09" in run.stderr and "no model was written" in run.stderr
    assert not (ws / "models/dpo").exists() and not (ws / "metrics/dpo.json").exists()
    assert not (ws / "metrics/plots/dpo.tsv").exists()
    assert json.loads((ws / "runs/dpo/failed_metrics.json").read_text())["kl"] > 1e-9
