"""bench/rl_step_size.py: it refuses, with a message, a batch that carries no policy gradient; and on a
batch that does, its gradient step moves the answers' log-probabilities the way their advantages say."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, load_script

SCRIPT = ROOT / "bench" / "rl_step_size.py"


@pytest.mark.slow
def test_a_model_without_reward_variance_is_refused_by_name(tmp_path):
    _tiny_setup(tmp_path)
    p = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "sft"), "--data",
                        str(tmp_path / "train.jsonl"), "--prompts", "2", "--group", "2", "--samples", "2",
                        "--max-new-tokens", "4", "--threads", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # a random model never writes `#### N`: every reward is 0, so no group has a signal
    assert p.returncode == 1 and "no policy gradient: all 2 groups had equal rewards" in p.stderr, p.stderr[-2000:]


def test_a_missing_model_is_named(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "nope")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "nope: not found; run `dvc repro sft` first" in p.stderr


def _tiny_setup(tmp_path):
    from llm.config import ModelConfig
    from llm.data.tokenizer import Tokenizer
    from llm.nn.artifacts import save_model_dir
    from llm.nn.model import GPT

    tok = Tokenizer.train(["Tom has 3 apples. He buys 2 more. 3 + 2 = 5 #### 5"] * 4, vocab_size=300,
                          min_frequency=1, jieba=False)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, seq_len=96, n_layer=1, n_head=2, n_kv_head=2, n_embd=16))
    save_model_dir(tmp_path / "sft", model, tok, {"stage": "sft"})
    rows = [{"id": f"m{i}", "question": f"Tom has {i} apples. He buys 2 more. How many?", "answer": str(i + 2),
             "level": 3, "lang": "en"} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_the_gradient_step_raises_the_log_probability_of_rewarded_answers(tmp_path, monkeypatch, capsys):
    import torch

    _tiny_setup(tmp_path)
    bench = load_script(SCRIPT)

    def even_first_token(tokenizer, **_):
        # a random model never answers right, so the verifier is swapped for a reward it can earn:
        # 1 when the first response token id is even (about half the samples, so groups differ)
        def reward(ro, problems):
            r = (ro.responses[:, 0] % 2 == 0).float()
            return r, {"accuracy": float(r.mean())}
        return reward

    monkeypatch.setattr(bench, "verifier_reward", even_first_token)
    monkeypatch.setattr(sys, "argv", ["rl_step_size.py", "--model", str(tmp_path / "sft"), "--data",
                                      str(tmp_path / "train.jsonl"), "--prompts", "4", "--group", "8",
                                      "--samples", "16", "--max-new-tokens", "3", "--lengths", "0.001", "10.0",
                                      "--signs", "1e-4", "--random", "1e-4", "--threads", "1"])
    torch.manual_seed(0)
    bench.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["grad_norm"] > 0 and 0.0 <= out["accuracy_before"] <= 1.0
    steps = {(r["step"], r["size"]): r for r in out["steps"]}
    assert set(steps) == {("gradient", 0.001), ("gradient", 10.0), ("sign", 1e-4), ("random sign", 1e-4)}
    # a small step along the policy gradient: answers with a positive advantage gain log-probability
    # (0.97 when written; the random step's is near 0)
    assert steps[("gradient", 0.001)]["corr_dlogp_adv"] > 0.5
    assert steps[("gradient", 0.001)]["corr_dlogp_adv"] > steps[("random sign", 1e-4)]["corr_dlogp_adv"] + 0.3
    # a long step along it makes fresh samples earn the reward far more often (0.375 -> 1.0 when written)
    assert steps[("gradient", 10.0)]["accuracy"] > out["accuracy_before"] + 0.3
