"""bench/sft_more.py: continuing SFT on its own conversations lowers their loss, writes the model
directory with what was done, and a missing data file is named."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT, load_script

SCRIPT = ROOT / "bench" / "sft_more.py"


def test_continued_sft_fits_its_conversations_and_writes_the_model(tmp_path, capsys):
    from tests.test_grpo import make_workspace
    b = load_script(SCRIPT)
    make_workspace(tmp_path, "ppo")
    rows = [{"id": f"c{i}", "source": "generated/math_en",
             "messages": [{"role": "user", "content": f"What is {i} + 2?"},
                          {"role": "assistant", "content": f"{i} + 2 = {i + 2}\n#### {i + 2}"}]} for i in range(4)]
    (tmp_path / "data/clean_sft").mkdir(parents=True)
    (tmp_path / "data/clean_sft/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "more"
    assert b.main(["--sft", str(tmp_path / "models/sft"), "--data", str(tmp_path / "data/clean_sft"),
                   "--out", str(out), "--updates", "40", "--batch", "4", "--lr", "1e-2"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["updates"] == 40 and line["loss_last100"] < line["loss_first"]
    from llm.nn.artifacts import load_model_dir
    _, _, meta = load_model_dir(out)
    assert meta["stage"] == "sft_more" and meta["control"]["updates"] == 40


def test_a_missing_data_file_is_named(tmp_path):
    b = load_script(SCRIPT)
    with pytest.raises(SystemExit, match=r"train.jsonl: not found; run `dvc repro clean_sft`"):
        b.main(["--data", str(tmp_path), "--out", str(tmp_path / "x")])
