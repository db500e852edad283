"""llm/export.py (HF Llama export, checked with `transformers` as a client) and
llm/artifacts.py (model directories: round trip, missing and corrupt files)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from llm.artifacts import ArtifactError, MissingArtifactError, load_model_dir, save_model_dir
from llm.config import ModelConfig
from llm.export import ExportError, export_hf, export_problems, main
from llm.model import GPT
from llm.reward_model import reward
from llm.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TEXT = ["To be, or not to be, that is the question: 12 + 7 = 19\n#### 19",
        "Whether 'tis nobler in the mind to suffer the slings and arrows", "小明有 3 个苹果。"] * 5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(TEXT, vocab_size=300, min_frequency=1, jieba=False)


def model(vocab: int, seed: int = 0, heads=("lm",), **kw) -> GPT:
    base = dict(vocab_size=vocab, seq_len=64, n_layer=2, n_head=4, n_kv_head=4, n_embd=32)
    base.update(kw)
    m = GPT(ModelConfig(**base), heads=heads, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # larger than init so attention is sharp and layout mistakes show up
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return m.eval()


def hf_load(path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()


# ---------------------------------------------------------------------------
# export


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=2, tie_embeddings=False), dict(n_kv_head=1, bias=True),
                                dict(norm_affine=False, rope_base=500.0)])
def test_transformers_loads_the_export_and_gives_the_same_logits(tmp_path, kw):
    m = model(97, **kw)
    export_hf(m, None, tmp_path / "hf")
    hf = hf_load(tmp_path / "hf")
    idx = torch.randint(0, 97, (3, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = m(idx), hf(idx).logits
    assert ours.abs().max() > 1.0  # not a near-constant output that anything would match
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_left_padded_batches_agree_when_hf_gets_our_position_ids(tmp_path):
    m = model(97, n_kv_head=2)
    export_hf(m, None, tmp_path / "hf")
    hf = hf_load(tmp_path / "hf")
    idx = torch.randint(1, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :7] = False
    with torch.no_grad():
        ours = m(idx, mask)
        theirs = hf(idx, attention_mask=mask.long(), position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(theirs[mask], ours[mask], atol=1e-4, rtol=0)


def test_the_logit_check_detects_a_wrong_rope_layout(tmp_path, monkeypatch):
    """Exporting q/k rows in our pair layout, without the rotate_half permutation, must fail
    the 1e-4 check: the test above can tell the two layouts apart."""
    import llm.export as ex
    m = model(97)
    monkeypatch.setattr(ex, "rope_permutation", lambda hd: torch.arange(hd))
    export_hf(m, None, tmp_path / "hf")
    idx = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf_load(tmp_path / "hf")(idx).logits - m(idx)).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize("kw,reason", [(dict(norm="layernorm"), "RMSNorm"), (dict(pos="learned"), "RoPE"),
                                       (dict(mlp="gelu"), "SwiGLU")])
def test_configs_llama_cannot_express_are_refused_with_the_reason(tmp_path, kw, reason):
    m = model(97, **kw)
    assert any(reason in p for p in export_problems(m.config))
    with pytest.raises(ExportError, match=reason):
        export_hf(m, None, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_cli_exports_a_model_directory_with_tokenizer_and_chat_template(tmp_path, tok, capsys):
    transformers = pytest.importorskip("transformers")
    from llm.chat import render_prompt

    m = model(tok.vocab_size, heads=("lm", "value"))
    save_model_dir(tmp_path / "sft", m, tok, {"stage": "sft"})
    assert main([str(tmp_path / "sft"), str(tmp_path / "hf")]) == 0
    assert "left out heads ['value']" in capsys.readouterr().out
    hf = hf_load(tmp_path / "hf")
    idx = torch.randint(0, tok.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, m(idx), atol=1e-4, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in TEXT[:3] + ["unseen words: xylophone 9876 ok?"]:
        assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 7?"}]
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert hf_tok.encode(text, add_special_tokens=False) == render_prompt(msgs, tok)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.end_id and cfg["pad_token_id"] == tok.pad_id


def test_cli_refuses_with_a_message(tmp_path, tok, capsys):
    save_model_dir(tmp_path / "m", model(tok.vocab_size, mlp="relu"), tok, {"stage": "x"})
    assert main([str(tmp_path / "m"), str(tmp_path / "hf")]) == 1
    assert "SwiGLU" in capsys.readouterr().err
    assert main([str(tmp_path / "nothing"), str(tmp_path / "hf")]) == 1
    assert "nothing: no model directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# model directories


def test_model_directory_round_trip(tmp_path, tok):
    m = model(tok.vocab_size, heads=("lm", "value", "reward"), n_kv_head=2, pos="learned", norm="layernorm")
    meta = {"stage": "reward", "fingerprint": "abc", "inputs": {"data": "123"}}
    save_model_dir(tmp_path / "rm", m, tok, meta)
    assert sorted(os.listdir(tmp_path / "rm")) == ["config.json", "meta.json", "model.safetensors", "tokenizer"]
    m2, tok2, meta2 = load_model_dir(tmp_path / "rm")
    assert m2.config == m.config and m2.head_names == m.head_names and tok2.sha256() == tok.sha256()
    assert meta2["stage"] == "reward" and meta2["fingerprint"] == "abc" and meta2["format_version"] == 1
    assert meta2["n_params"] == m.n_params() and "created" not in meta2
    first = (tmp_path / "rm" / "meta.json").read_bytes()
    save_model_dir(tmp_path / "rm", m, tok, meta)  # the same model again: the same bytes
    assert (tmp_path / "rm" / "meta.json").read_bytes() == first
    assert m2.state_dict().keys() == m.state_dict().keys()
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    idx = torch.randint(0, tok.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m(idx), m2.eval()(idx)) and torch.equal(reward(m, idx), reward(m2, idx))
    only_lm, _, _ = load_model_dir(tmp_path / "rm", heads=("lm",))
    assert only_lm.head_names == ("lm",) and only_lm.n_params() < m.n_params()


def test_loading_a_subset_of_heads_of_an_untied_model(tmp_path, tok):
    m = model(tok.vocab_size, heads=("lm", "reward"), tie_embeddings=False)
    save_model_dir(tmp_path / "rm", m, tok, {"stage": "reward"})
    rm, _, _ = load_model_dir(tmp_path / "rm", heads=("reward",))
    idx = torch.randint(0, tok.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reward(rm, idx), reward(m, idx))
    assert rm.lm_head is None


def test_tied_embeddings_stay_tied_after_loading(tmp_path, tok):
    save_model_dir(tmp_path / "m", model(tok.vocab_size), tok, {"stage": "pretrain"})
    m2, _, _ = load_model_dir(tmp_path / "m")
    assert m2.lm_head.weight is m2.wte.weight


def test_missing_heads_and_files_are_named(tmp_path, tok):
    save_model_dir(tmp_path / "sft", model(tok.vocab_size), tok, {"stage": "sft"})
    with pytest.raises(ArtifactError, match=r"heads \['reward'\] are not saved .*add_head"):
        load_model_dir(tmp_path / "sft", heads=("lm", "reward"))
    with pytest.raises(MissingArtifactError, match="nope: no model directory"):
        load_model_dir(tmp_path / "nope")
    (tmp_path / "sft" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"sft/model.safetensors: missing"):
        load_model_dir(tmp_path / "sft")


def test_corrupt_files_are_named(tmp_path, tok):
    save_model_dir(tmp_path / "m", model(tok.vocab_size), tok, {"stage": "sft"})
    f = tmp_path / "m" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in a weight
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"m/model.safetensors: sha256 does not match"):
        load_model_dir(tmp_path / "m")
    f.write_bytes(b"garbage")  # and without a recorded hash: the reader itself refuses it
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    meta.pop("files")
    (tmp_path / "m" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="model.safetensors: not a readable safetensors file"):
        load_model_dir(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="config.json: not valid JSON"):
        load_model_dir(tmp_path / "m")


def test_a_failed_save_leaves_the_previous_directory_intact(tmp_path, tok):
    save_model_dir(tmp_path / "m", model(tok.vocab_size, seed=1), tok, {"stage": "sft"})
    before = (tmp_path / "m" / "model.safetensors").read_bytes()

    class Broken:
        def save(self, d):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_model_dir(tmp_path / "m", model(tok.vocab_size, seed=2), Broken(), {"stage": "sft"})
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp directory left behind
