"""bench/rl_step_size.py: it refuses, with a message, a batch that carries no policy gradient."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "bench" / "rl_step_size.py"


@pytest.mark.slow
def test_a_model_without_reward_variance_is_refused_by_name(tmp_path):
    from llm.artifacts import save_model_dir
    from llm.config import ModelConfig
    from llm.model import GPT
    from llm.tokenizer import Tokenizer

    tok = Tokenizer.train(["Tom has 3 apples. He buys 2 more. 3 + 2 = 5 #### 5"] * 4, vocab_size=300,
                          min_frequency=1, jieba=False)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, seq_len=96, n_layer=1, n_head=2, n_kv_head=2, n_embd=16))
    save_model_dir(tmp_path / "sft", model, tok, {"stage": "sft"})
    rows = [{"id": f"m{i}", "question": f"Tom has {i} apples. He buys 2 more. How many?", "answer": str(i + 2),
             "level": 3, "lang": "en"} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
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
