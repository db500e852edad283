"""params.yaml validation: every kind of error, several at once."""
from __future__ import annotations

import dataclasses
import re
import typing

import pytest
import yaml

from llm.config import (ConfigError, ModelConfig, Params, load_params, load_params_text, load_sections,
                        section_keys)
from tests.conftest import ROOT


def _base() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def _dump(d: dict) -> str:
    return yaml.safe_dump(d, sort_keys=False)


def test_params_yaml_validates():
    p = load_params(ROOT / "params.yaml")
    assert isinstance(p, Params)


def test_every_dataclass_field_is_in_params_yaml_and_back():
    data = _base()

    def leaves(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{prefix}.{k}")
            else:
                yield f"{prefix}.{k}"
    in_yaml = {k for name, sec in data.items() for k in leaves(sec, name)}
    in_code = {k for keys in section_keys().values() for k in keys}
    assert in_yaml == in_code


def test_unknown_key_gets_a_suggestion_with_line_number():
    text = (ROOT / "params.yaml").read_text().replace("  clip_epsilon: 0.1", "  clip_epsilon: 0.1\n  clip_epsilom: 0.2")
    with pytest.raises(ConfigError) as e:
        load_params_text(text, "params.yaml")
    msg = str(e.value)
    assert "ppo.clip_epsilom: unknown key; did you mean 'clip_epsilon'?" in msg
    line = text.splitlines().index("  clip_epsilom: 0.2") + 1
    assert f"params.yaml:{line}:" in msg


def test_a_renamed_key_is_answered_with_its_new_name():
    """RL sections once said `steps` and `max_grad_norm`; every training section now says `max_steps`
    and `grad_clip`. An old params file gets the new names, not a fuzzy guess."""
    d = _base()
    d["ppo"]["steps"] = d["ppo"].pop("max_steps")
    d["grpo"]["max_grad_norm"] = d["grpo"].pop("grad_clip")
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d))
    msg = str(e.value)
    assert "ppo.steps: renamed; did you mean 'max_steps'?" in msg
    assert "grpo.max_grad_norm: renamed; did you mean 'grad_clip'?" in msg
    assert "ppo.max_steps: missing key" in msg and "grpo.grad_clip: missing key" in msg


def test_every_training_section_names_the_loop_knobs_alike():
    from llm.config import LoopConfig
    loop_keys = {f.name for f in dataclasses.fields(LoopConfig)}
    for f in dataclasses.fields(Params):
        tp = typing.get_type_hints(Params)[f.name]
        if isinstance(tp, type) and issubclass(tp, LoopConfig):
            assert loop_keys <= {g.name for g in dataclasses.fields(tp)}, f.name


def test_all_problems_reported_at_once():
    d = _base()
    d["common"]["seed"] = True                  # bool for int
    d["sft"]["lr"] = "fast"                     # str for float
    d["pretrain"]["model"]["norm"] = "batchnorm"  # not a choice
    del d["dpo"]["beta"]                        # missing
    d["grpo"]["clip_epsilon"] = 1.5             # out of range
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d))
    msg = str(e.value)
    for needle in ("common.seed: expected an int >= 0, got True (bool)",
                   "sft.lr: expected a float > 0.0, got 'fast' (str)",
                   "pretrain.model.norm: expected one of 'rmsnorm', 'layernorm', got 'batchnorm'",
                   "dpo.beta: missing key",
                   "grpo.clip_epsilon: expected a float in [0.0, 1.0], got 1.5"):
        assert needle in msg, needle
    assert len(e.value.problems) == 5


def test_int_is_accepted_for_float_but_not_bool():
    d = _base()
    d["sft"]["grad_clip"] = 1
    assert load_params_text(_dump(d)).sft.grad_clip == 1.0
    d["sft"]["grad_clip"] = False
    with pytest.raises(ConfigError, match="sft.grad_clip"):
        load_params_text(_dump(d))


def test_cross_field_rules():
    d = _base()
    d["pretrain"]["model"].update(n_embd=100, n_head=3)
    d["sft"]["min_lr"] = 1.0
    d["tokenizer"]["vocab_size"] = 260
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d))
    msg = str(e.value)
    assert "pretrain.model.n_embd: 100 is not divisible by n_head=3" in msg
    assert "sft.min_lr" in msg
    assert "tokenizer.vocab_size: must be at least 256 bytes + 6 special tokens" in msg


def test_dpo_trainable_must_name_something():
    d = _base()
    d["dpo"]["trainable"] = []
    with pytest.raises(ConfigError, match=r"dpo.trainable: an empty list trains nothing; write \['\*'\]"):
        load_params_text(_dump(d))


def test_preset_fixes_the_size():
    d = _base()
    d["pretrain"]["model"].update(preset="77m", n_layer=2)
    with pytest.raises(ConfigError, match="preset '77m' has n_layer=8, got 2"):
        load_params_text(_dump(d))


@pytest.mark.parametrize("scalar,value", [("3e-3", 3e-3), ("4e-03", 4e-3), ("1E-2", 1e-2), ("3.0e-3", 3e-3)])
def test_a_float_without_a_dot_is_read_as_dvc_reads_it(scalar, value):
    """`dvc exp run -S sft.lr=3.0e-6` writes `lr: 3e-06` back, a string to PyYAML: the stages read a float."""
    text, n = re.subn(r"^  lr: .*$", f"  lr: {scalar}", (ROOT / "params.yaml").read_text(), count=1, flags=re.M)
    assert n == 1
    lr = load_params_text(text).pretrain.lr
    assert type(lr) is float and lr == value


def test_dvc_exp_run_set_param_round_trip(tmp_path):
    """What `dvc exp run -S` does to params.yaml (dvc.utils.hydra.apply_overrides), then our loader."""
    hydra = pytest.importorskip("dvc.utils.hydra")
    p = tmp_path / "params.yaml"
    p.write_text((ROOT / "params.yaml").read_text())
    hydra.apply_overrides(str(p), ["dpo.lr=3.0e-6", "dpo.min_lr=3.0e-7", "dpo.trainable=[\"*\"]",
                                    "ppo.clip_epsilon=0.2"])
    assert "3e-06" in p.read_text()  # DVC drops the dot: what PyYAML alone reads as a string
    params = load_params(p)
    assert params.dpo.lr == 3e-6 and params.dpo.trainable == ["*"] and params.ppo.clip_epsilon == 0.2


@pytest.mark.parametrize("scalar,fragment", [
    ("yes", "boolean to PyYAML but a string to DVC"),
    ("off", "boolean to PyYAML but a string to DVC"),
])
def test_yaml_1_1_vs_1_2_ambiguous_scalars_are_rejected(scalar, fragment):
    text, n = re.subn(r"^  lr: .*$", f"  lr: {scalar}", (ROOT / "params.yaml").read_text(), count=1, flags=re.M)
    assert n == 1
    with pytest.raises(ConfigError, match=fragment):
        load_params_text(text)


def test_quoted_ambiguous_scalar_is_a_plain_string():
    text = (ROOT / "params.yaml").read_text()
    assert "detoxify_checkpoint: ''" in text
    text = text.replace("detoxify_checkpoint: ''", 'detoxify_checkpoint: "yes"')
    assert load_params_text(text).clean_sft.detoxify_checkpoint == "yes"


def test_syntax_error_names_the_line(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("common:\n  seed: [1, 2\n")
    with pytest.raises(ConfigError, match=r"params.yaml:\d+: YAML syntax error"):
        load_params(f)


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="not found; run from the repository root"):
        load_params(tmp_path / "nope.yaml")


def test_stage_sees_only_its_sections(tmp_path):
    d = _base()
    d["ppo"]["clip_epsilon"] = "wide"
    f = tmp_path / "params.yaml"
    f.write_text(_dump(d))
    got = load_sections(["common", "prepare"], f)
    assert set(got) == {"common", "prepare"}
    with pytest.raises(ConfigError, match="ppo.clip_epsilon"):
        load_sections(["common", "ppo"], f)


def test_model_config_defaults_validate():
    assert ModelConfig().check("m") == []
    assert ModelConfig(n_embd=128, n_head=4).head_dim == 32


def test_source_needs_exactly_one_location():
    d = _base()
    d["prepare"]["sft_sources"] = [{"path": "", "hub": "", "hub_config": "", "split": "train",
                                    "schema": "alpaca", "field": "text", "limit": 0}]
    with pytest.raises(ConfigError, match="set exactly one of 'path'"):
        load_params_text(_dump(d))
