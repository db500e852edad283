"""llm/nn/artifacts.py against hostile and careless model directories: every file is checked
(types, bounds, hashes, the safetensors header against the config) before a tensor is read or
a module built, so each edit below is refused by name, quickly and in little memory, even
when meta.json's hashes were recomputed to match (they guard against corruption, not an
attacker). A property test throws random edits at a directory's files."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llm.config import ModelConfig
from llm.data.tokenizer import Tokenizer
from llm.fileio import sha256_file
from llm.nn.artifacts import ArtifactError, MissingArtifactError, load_model_dir, save_model_dir
from llm.nn.model import GPT
from tests.conftest import bounded

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A small, valid model directory (never modified: tests copy it)."""
    tok = Tokenizer.train(["abc abc abd abd abe, 12 + 7 = 19 " * 20], vocab_size=300, max_pairs=1000, min_frequency=1,
                          jieba=False)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=16))
    return save_model_dir(tmp_path_factory.mktemp("m") / "sft", model, tok, {"stage": "sft", "fingerprint": "fp"})


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil
    return Path(shutil.copytree(saved, tmp_path / "sft"))


def rehash(d: Path) -> None:
    """Recompute meta.json's sha256 list, as someone who edits a file on purpose would."""
    meta = json.loads((d / "meta.json").read_text())
    meta["files"] = {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*"))
                     if p.is_file() and p.name != "meta.json" or p.is_symlink()}
    (d / "meta.json").write_text(json.dumps(meta))


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    rehash(d)


def test_the_fixture_loads(saved):
    model, tok, meta = load_model_dir(saved)
    assert model.config.n_layer == 2 and tok.vocab_size == model.config.vocab_size
    assert sorted(meta["files"]) == ["config.json", "model.safetensors", "tokenizer/tokenizer.txt",
                                     "tokenizer/tokenizer_meta.json"]


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_loading_a_model_does_not_import_the_compiler(saved, tmp_path, pos):
    """Building a model on the meta device once pulled in torch._dynamo (1.3 s of start-up in
    every process that loads a model: chat, serve, eval) through PyTorch's Python meta kernels."""
    import subprocess
    import sys
    d = saved
    if pos == "learned":
        model, tok, _ = load_model_dir(saved)
        cfg = {**vars(model.config), "pos": "learned"}
        d = save_model_dir(tmp_path / "learned", GPT(ModelConfig(**cfg)), tok, {"stage": "sft", "fingerprint": "fp"})
    code = ("import sys; from llm.nn.artifacts import load_model_dir; m, _, _ = load_model_dir(sys.argv[1]);"
            " m(m.wte.weight.new_zeros(1, 4, dtype=__import__('torch').long));"
            " print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# -- 1. config.json is checked (types, bounds, then against the tensors) before anything is built

@pytest.mark.parametrize("changes,fragment", [
    (dict(vocab_size=10 ** 12), "config.vocab_size: expected an int in [0, 1048576], got"),
    (dict(seq_len=10 ** 6), "config.seq_len: expected an int in [8, 16384], got 1000000"),
    (dict(n_layer=10 ** 6), "config.n_layer: expected an int in [1, 256], got 1000000"),
    (dict(n_layer="2"), "config.n_layer: expected an int in [1, 256], got '2' (str)"),
    (dict(init_std=float("nan")), "config.init_std: expected a finite float"),
    (dict(n_embd=4096, n_head=1), "config.n_embd: head_dim 4096 is above 1024"),
    (dict(heads=["lm", "lm"]), "heads: expected a non-empty list of distinct names"),
])
def test_an_absurd_config_is_refused_before_anything_is_allocated(saved, tmp_path, changes, fragment):
    d = _copy(saved, tmp_path)
    _edit_config(d, **changes)
    with bounded(seconds=5, memory=256 << 20), pytest.raises(ArtifactError) as e:
        load_model_dir(d)
    assert str(e.value).startswith(f"{d / 'config.json'}: invalid model config") and fragment in str(e.value)


@pytest.mark.parametrize("changes,pattern", [
    (dict(n_layer=256), r"does not match config.json: missing tensors \['blocks.10"),
    (dict(vocab_size=1 << 20, n_layer=256, n_embd=16384, n_head=16, n_kv_head=16),
     r"does not match config.json: missing tensors \['blocks.10"),
    (dict(vocab_size=1 << 20), r"wte.weight: file \(\d+, 16\) vs config \(1048576, 16\)"),
    (dict(n_embd=32), r"file \(\d+, 16\) vs config \(\d+, 32\)"),
])
def test_a_config_within_bounds_must_match_the_tensor_header(saved, tmp_path, changes, pattern):
    """256 layers 16384 wide with a 2**20 vocabulary would be 870 G parameters: the header decides first."""
    import re
    d = _copy(saved, tmp_path)
    _edit_config(d, **changes)
    with bounded(seconds=5, memory=256 << 20), pytest.raises(ArtifactError) as e:
        load_model_dir(d)
    assert str(e.value).startswith(f"{d / 'model.safetensors'}: ") and re.search(pattern, str(e.value))


def test_a_header_that_claims_more_than_the_file_holds_is_refused(saved, tmp_path):
    d = _copy(saved, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["wte.weight"]["shape"] = [300, 10 ** 9]
    raw = json.dumps(header).encode()
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    rehash(d)
    with bounded(seconds=5, memory=256 << 20), pytest.raises(ArtifactError, match="tensor 'wte.weight': bad dtype,"
                                                                                  " shape or offsets"):
        load_model_dir(d)


def _edit_header(f: Path, name: str, **changes) -> None:
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header[name].update(changes)
    raw = json.dumps(header).encode()
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, None, 4])
def test_a_header_dtype_that_is_not_a_string_is_refused(saved, tmp_path, dtype):
    d = _copy(saved, tmp_path)
    _edit_header(d / "model.safetensors", "wte.weight", dtype=dtype)
    rehash(d)
    with pytest.raises(ArtifactError, match="tensor 'wte.weight': bad dtype, shape or offsets"):
        load_model_dir(d)


def test_an_integer_weight_is_refused_naming_the_tensor(saved, tmp_path):
    """Small integers are finite and within MAX_WEIGHT, and load_state_dict would cast them."""
    from safetensors.torch import load_file, save_file
    d = _copy(saved, tmp_path)
    f = d / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(f)).items()}
    tensors["blocks.1.norm_1.weight"] = torch.ones_like(tensors["blocks.1.norm_1.weight"], dtype=torch.int32)
    save_file(tensors, str(f))
    rehash(d)
    with pytest.raises(ArtifactError, match=f"{re.escape(str(f))}: tensor dtypes do not match the model's:"
                                            f" blocks.1.norm_1.weight is I32, not F32"):
        load_model_dir(d)


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer/tokenizer.txt", "tokenizer/tokenizer_meta.json"])
def test_a_file_padded_to_100_gb_is_refused_before_it_is_hashed(saved, tmp_path, monkeypatch, name):
    """A sparse file costs no disk, but hashing it reads every byte (10 GB took 23 s)."""
    import llm.nn.artifacts

    d = _copy(saved, tmp_path)
    try:
        os.truncate(d / name, 100 << 30)
    except OSError:
        pytest.skip("this file system cannot hold a sparse file of 100 GB")
    hash_file = llm.nn.artifacts.sha256_file

    def small_only(p):
        assert os.path.getsize(p) < 1 << 30, f"hashed {p} ({os.path.getsize(p)} bytes)"
        return hash_file(p)

    monkeypatch.setattr(llm.nn.artifacts, "sha256_file", small_only)
    with bounded(seconds=5, memory=256 << 20), pytest.raises(ArtifactError, match=f"{re.escape(str(d / name))}:"
                                                                                  f" 107374182400 bytes, "):
        load_model_dir(d)


@pytest.mark.parametrize("value, fragment", [(float("nan"), "non-finite values"),
                                             (1.18e21, "magnitude 1.18e+21, beyond any trained weight")])
def test_a_weight_that_would_break_the_forward_pass_is_refused(saved, tmp_path, value, fragment):
    """A rehashed file whose one norm gain is NaN, or finite but huge (1e21 made every logit NaN:
    an overwritten byte found by the property test below), is refused naming the tensor."""
    from safetensors.torch import load_file, save_file
    d = _copy(saved, tmp_path)
    f = d / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(f)).items()}
    tensors["blocks.1.norm_1.weight"][9] = value
    save_file(tensors, str(f))
    rehash(d)
    with pytest.raises(ArtifactError, match=f"tensor 'blocks.1.norm_1.weight' holds .*{re.escape(fragment)}"):
        load_model_dir(d)


# -- 2. the directory's integrity covers every file, the tokenizer included

def test_an_edited_tokenizer_is_refused(saved, tmp_path):
    d = _copy(saved, tmp_path)
    p = d / "tokenizer" / "tokenizer.txt"
    p.write_text(p.read_text().replace("# 256 =", "# 256 (edited) =", 1))  # a comment only
    with pytest.raises(ArtifactError, match=r"tokenizer/tokenizer.txt: sha256 does not match meta.json"):
        load_model_dir(d)


def test_a_hostile_pattern_with_recomputed_hashes_is_refused_quickly(saved, tmp_path):
    d = _copy(saved, tmp_path)
    p = d / "tokenizer" / "tokenizer.txt"
    lines = p.read_text().split("\n")
    lines[1] = "pattern\t" + json.dumps(r"(a|aa)+$|\s+|.")
    p.write_text("\n".join(lines))
    (d / "tokenizer" / "tokenizer_meta.json").unlink()
    rehash(d)
    with bounded(seconds=2, memory=256 << 20), pytest.raises(ArtifactError) as e:
        load_model_dir(d)
    assert "tokenizer.txt:2: pre-split pattern" in str(e.value) and "is not one this project writes" in str(e.value)


def test_an_unlisted_file_or_a_device_in_the_directory_is_refused(saved, tmp_path):
    d = _copy(saved, tmp_path)
    (d / "tokenizer" / "extra.txt").write_text("x")
    with pytest.raises(ArtifactError, match=r"tokenizer/extra.txt: not listed in meta.json"):
        load_model_dir(d)
    (d / "tokenizer" / "extra.txt").unlink()
    if os.path.exists("/dev/zero"):
        (d / "zero").symlink_to("/dev/zero")  # hashing it would never end
        with bounded(seconds=2), pytest.raises(ArtifactError, match=r"zero: not a regular file"):
            load_model_dir(d)


def test_a_format_1_directory_still_loads_and_needs_its_tokenizer_meta(saved, tmp_path):
    """What this code wrote before: meta.json hashed the model and config only."""
    d = _copy(saved, tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    meta["format_version"] = 1
    meta["files"] = {k: v for k, v in meta["files"].items() if k in ("model.safetensors", "config.json")}
    (d / "meta.json").write_text(json.dumps(meta))
    model, tok, _ = load_model_dir(d)
    assert model.config.n_layer == 2
    p = d / "tokenizer" / "tokenizer.txt"
    lines = p.read_text().split("\n")
    n = int(lines[9].split("\t")[1])
    lines[9] = f"merges\t{n - 1}"  # drop the last merge: a smaller, still well-formed tokenizer
    del lines[10 + n - 1]
    for i in range(3, 9):  # the special tokens take the last ids
        sid, name = lines[i].split("\t")
        lines[i] = f"{int(sid) - 1}\t{name}"
    p.write_text("\n".join(lines))
    with pytest.raises(ArtifactError, match="tokenizer_meta.json: describes a different tokenizer"):
        load_model_dir(d)
    (d / "tokenizer" / "tokenizer_meta.json").unlink()
    with pytest.raises(MissingArtifactError, match="tokenizer/tokenizer_meta.json: missing"):
        load_model_dir(d)


# -- the property: any edit of any file is either a clean refusal or a valid load

def _mutate(data: bytes, kind: str, pos: float, blob: bytes) -> bytes:
    i = int(pos * len(data))
    if kind == "flip":
        return data[:i] + bytes([data[i] ^ (blob[0] if blob else 1) or 1]) + data[i + 1:] if data else blob
    if kind == "insert":
        return data[:i] + blob + data[i:]
    if kind == "delete":
        return data[:i] + data[i + len(blob) + 1:]
    if kind == "truncate":
        return data[:i]
    return data[:i] + blob + data[i + len(blob):]  # overwrite


def _json_edit(data: bytes, key_pos: float, value) -> bytes:
    """Set one key of a JSON object (a nested one for meta.json's hashes) to `value`."""
    doc = json.loads(data)
    target = doc["files"] if isinstance(doc.get("files"), dict) and doc["files"] and key_pos > 0.5 else doc
    keys = sorted(target)
    target[keys[int(key_pos * len(keys)) % len(keys)]] = value
    return json.dumps(doc).encode()


FILES = ["config.json", "meta.json", "model.safetensors", "tokenizer/tokenizer.txt", "tokenizer/tokenizer_meta.json"]
json_values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                        st.sampled_from([10 ** 6, 10 ** 12, 2 ** 31, -1, 0, 1, 3]),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                        st.lists(st.integers(0, 5), max_size=3), st.just({"a": 1}))
edits = st.one_of(
    st.tuples(st.just("bytes"), st.sampled_from(FILES), st.sampled_from(["flip", "insert", "delete", "truncate",
                                                                         "overwrite"]),
              st.floats(0, 0.999), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("json"), st.sampled_from(["config.json", "meta.json"]), st.floats(0, 0.999), json_values),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(edit_list=st.lists(edits, min_size=1, max_size=3), rehashed=st.booleans())
def test_any_edit_of_a_model_directory_is_refused_cleanly_or_loads(saved, tmp_path_factory, edit_list, rehashed):
    d = _copy(saved, tmp_path_factory.mktemp("edit"))
    for edit in edit_list:
        f = d / edit[1]
        data = f.read_bytes()
        if edit[0] == "bytes":
            f.write_bytes(_mutate(data, *edit[2:]))
        else:
            try:
                f.write_bytes(_json_edit(data, *edit[2:]))
            except (ValueError, KeyError, TypeError, ZeroDivisionError):
                continue  # an earlier edit broke the JSON; this one has nothing to set
    if rehashed:
        try:
            rehash(d)
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # meta.json itself is broken
    with bounded(seconds=10, memory=2 << 30):
        try:
            model, tok, _ = load_model_dir(d)
        except ArtifactError as e:
            assert str(e).startswith(str(d)), e  # names the directory or a file in it
            event(f"refused: {str(e)[len(str(d)):].split(':')[0] or '(dir)'}")
            return
    event("loaded")
    # a valid load: a working model and tokenizer that agree
    assert tok.vocab_size == model.config.vocab_size
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("abc 12")[: model.config.seq_len]]))
    assert bool(torch.isfinite(logits).all())


def test_a_reward_model_with_the_likelihood_feature_loads(saved, tmp_path):
    """Its marker is an int64 buffer: an integer tensor that belongs to the model."""
    model, tok, _ = load_model_dir(saved)
    model.add_head("reward")
    model.add_head("reward_logprob", marker=tok.special["<|end|>"])
    d = save_model_dir(tmp_path / "reward", model, tok, {"stage": "reward", "fingerprint": "fp"})
    loaded, _, _ = load_model_dir(d)
    assert int(loaded.reward_logprob_head.marker) == tok.special["<|end|>"]
