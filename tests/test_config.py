"""params.yaml validation: every kind of error, several at once."""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llm.config import (MAX_PARAMS_BYTES, ConfigError, ModelConfig, Params, load_params, load_params_text,
                        load_sections, section_keys)
from tests.conftest import ROOT, bounded


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
    text = (ROOT / "params.yaml").read_text().replace("  clip_epsilon: 0.2\n  max_new_tokens: 64",
                                                    "  clip_epsilon: 0.2\n  clip_epsilom: 0.2\n  max_new_tokens: 64", 1)
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
    for needle in ("common.seed: expected an int in [0, 4294967295], got True (bool)",
                   "sft.lr: expected a float in (0.0, 10.0], got 'fast' (str)",
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


def test_the_optimizer_is_chosen_per_stage_and_checked_by_key():
    d = _base()
    d["pretrain"]["optimizer"], d["sft"]["optimizer"], d["sft"]["muon_lr"] = "muon", "adamw", 0.03
    p = load_params_text(_dump(d))
    assert (p.pretrain.optimizer, p.sft.optimizer, p.sft.muon_lr, p.dpo.optimizer) == ("muon", "adamw", 0.03, "adamw")
    d["grpo"]["optimizer"] = "sgd"
    d["pretrain"]["distributed"] = "fsdp"
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d))
    assert "grpo.optimizer: expected one of 'adamw', 'muon', got 'sgd'" in str(e.value)
    assert "pretrain.optimizer: muon does not run under pretrain.distributed: fsdp" in str(e.value)
    assert len(e.value.problems) == 2


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
    ("0300", "pretrain.lr: '0300' is 192 (octal) to PyYAML but 300 to DVC; write 300"),
    ("09", "pretrain.lr: '09' is a string to PyYAML but 9 to DVC; write 9"),
    ("-012", "pretrain.lr: '-012' is -10 (octal) to PyYAML but -12 to DVC; write -12"),
    ("0o14", "pretrain.lr: '0o14' is a string to PyYAML but 12 to DVC; write 12"),
])
def test_yaml_1_1_vs_1_2_ambiguous_scalars_are_rejected(scalar, fragment):
    text, n = re.subn(r"^  lr: .*$", f"  lr: {scalar}", (ROOT / "params.yaml").read_text(), count=1, flags=re.M)
    assert n == 1
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_params_text(text)


def test_a_leading_zero_integer_is_refused_with_key_line_and_what_to_write():
    """DVC (YAML 1.2) reads `max_steps: 0300` as 300, PyYAML as octal 192: the stage would train
    for another number of steps than `dvc params diff` shows."""
    problems, line = _problems_with("sft", "max_steps", "0300")
    assert problems == [f"params.yaml:{line}: sft.max_steps: '0300' is 192 (octal) to PyYAML but 300 to DVC;"
                        f" write 300"]


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


# ---------------------------------------------------------------------------
# Absurd and hostile values: refused by the check, with the key and line, before any work.

def _leaf_fields(kind: type) -> list[tuple[str, object]]:
    """(dotted key, dataclass field) of every leaf of Params whose type is `kind`."""
    import dataclasses
    import typing

    out = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}.{f.name}")
            elif tp is kind:
                out.append((f"{prefix}.{f.name}", f))

    for name, tp in typing.get_type_hints(Params).items():
        walk(tp, name)
    return out


def _set(d: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for k in path:
        d = d[k]
    d[last] = value


def _line_of(text: str, needle: str, after: str | None = None) -> int:
    lines = text.splitlines()
    start = lines.index(after) if after else 0
    return next(i for i in range(start, len(lines)) if lines[i].strip().startswith(needle)) + 1


def _problems_with(section: str, leaf: str, value: str) -> tuple[list[str], int]:
    """The problems of params.yaml with `leaf` of `section` set to the text `value`, and its line."""
    text = (ROOT / "params.yaml").read_text()
    line = _line_of(text, f"{leaf}:", after=f"{section}:")
    lines = text.splitlines()
    lines[line - 1] = re.sub(r":.*$", f": {value}", lines[line - 1])
    with pytest.raises(ConfigError) as e:
        load_params_text("\n".join(lines) + "\n", "params.yaml")
    return e.value.problems, line


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_every_float_refuses_nan_and_infinities(bad):
    """A range check is a comparison, which NaN passes; every float is checked finite first."""
    floats = _leaf_fields(float)
    d = _base()
    for key, _ in floats:
        _set(d, key, bad)
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d), "params.yaml")
    msg = "\n".join(e.value.problems)  # all of them; the message lists the first few
    for key, _ in floats:
        assert re.search(rf"params.yaml:\d+: {re.escape(key)}: expected a finite float", msg), key


def test_every_int_has_an_upper_bound_and_one_above_it_is_refused():
    ints = _leaf_fields(int)
    assert all(f.metadata.get("hi") is not None for _, f in ints), [k for k, f in ints if f.metadata.get("hi") is None]
    d = _base()
    for key, f in ints:
        _set(d, key, f.metadata["hi"] + 1)
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d), "params.yaml")
    msg = "\n".join(e.value.problems)
    for key, f in ints:
        assert f"{key}: expected an int" in msg and f", {f.metadata['hi']}], got" in msg, key


def test_every_float_has_an_upper_bound_and_one_above_it_is_refused():
    floats = _leaf_fields(float)
    assert all(f.metadata.get("hi") is not None for _, f in floats), \
        [k for k, f in floats if f.metadata.get("hi") is None]
    d = _base()
    for key, f in floats:
        _set(d, key, f.metadata["hi"] * 2)
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d), "params.yaml")
    for key, f in floats:
        assert re.search(rf"{re.escape(key)}: expected a float in [\[(][^,]+, {re.escape(str(float(f.metadata['hi'])))}\],"
                         rf" got", "\n".join(e.value.problems)), key


def test_a_runaway_learning_rate_is_refused_with_key_and_line():
    problems, line = _problems_with("sft", "lr", "1.0e21")
    assert problems == [f"params.yaml:{line}: sft.lr: expected a float in (0.0, 10.0], got 1e+21"]


@pytest.mark.parametrize("key,value,bound", [
    ("pretrain.model.seq_len", 100000, "[8, 16384]"),
    ("pretrain.batch_size", 10 ** 12, "[1, 65536]"),
    ("pretrain.model.n_layer", 10 ** 6, "[1, 256]"),
    ("pretrain.max_steps", 10 ** 30, "[1, 100000000]"),
    ("pretrain.model.vocab_size", 10 ** 12, "[0, 1048576]"),
])
def test_runaway_sizes_are_refused_with_key_line_and_bound(key, value, bound):
    text = (ROOT / "params.yaml").read_text()
    leaf = key.rsplit(".", 1)[1]
    line = _line_of(text, f"{leaf}:", after="pretrain:")
    lines = text.splitlines()
    lines[line - 1] = re.sub(r":.*$", f": {value}", lines[line - 1])
    with pytest.raises(ConfigError) as e:
        load_params_text("\n".join(lines) + "\n", "params.yaml")
    assert f"params.yaml:{line}: {key}: expected an int in {bound}, got" in str(e.value)
    assert len(e.value.problems) == 1


@pytest.mark.parametrize("key", ["prepare.math_levels", "ppo.levels", "grpo.levels", "pairs.temperatures"])
def test_a_list_that_must_hold_something_refuses_empty(key):
    d = _base()
    _set(d, key, [])
    with pytest.raises(ConfigError, match=rf":\d+: {re.escape(key)}: expected a non-empty list, each"):
        load_params_text(_dump(d))


def test_grpo_curriculum_steps_need_curriculum_levels():
    d = _base()
    d["grpo"].update(curriculum_steps=5, curriculum_levels=[])
    with pytest.raises(ConfigError, match="grpo.curriculum_levels: curriculum_steps=5 needs at least one level"):
        load_params_text(_dump(d))
    d["grpo"].update(curriculum_steps=0)
    assert load_params_text(_dump(d)).grpo.curriculum_levels == []


def test_list_items_are_range_checked_with_their_line():
    text = (ROOT / "params.yaml").read_text().replace("math_levels:\n  - 1\n  - 2\n  - 3\n  - 4\n",
                                                      "math_levels: [1, 2, 9]\n")
    assert "math_levels: [1, 2, 9]" in text  # params.yaml writes the list as `dvc exp run -S` does
    with pytest.raises(ConfigError) as e:
        load_params_text(text, "params.yaml")
    assert e.value.problems == [f"params.yaml:{_line_of(text, 'math_levels:')}: prepare.math_levels[2]: expected an"
                                f" int in [1, 5], got 9"]


def test_a_yaml_alias_bomb_is_refused_in_bounded_time():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]  # 9**10 values
    bomb = "\n".join(lines) + "\n" + (ROOT / "params.yaml").read_text()
    with bounded(seconds=5, memory=256 << 20), pytest.raises(ConfigError, match="more than 100000 values once YAML"):
        load_params_text(bomb, "params.yaml")


def test_many_values_without_aliases_are_not_blamed_on_aliases():
    values = "zz: [" + "1," * 100_000 + "1]\n"  # 100,001 values, no alias
    with pytest.raises(ConfigError) as e:
        load_params_text((ROOT / "params.yaml").read_text() + values, "params.yaml")
    assert "more than 100000 values;" in str(e.value) and "alias" not in str(e.value)


def test_a_params_file_of_10000_unknown_keys_lists_20_and_counts_the_rest():
    d = _base()
    d["sft"].update({f"junk_{i}": 1 for i in range(10_000)})
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d), "params.yaml")
    lines = str(e.value).splitlines()
    assert len(e.value.problems) == 10_000 and lines[0] == "10000 problem(s) in params:"
    assert len(lines) == 1 + 20 + 1 and lines[-1] == "  ... and 9980 more"
    assert "sft.junk_0: unknown key" in lines[1]


@pytest.mark.parametrize("text", [
    "common: " + "[" * 20_000 + "]" * 20_000 + "\n",  # flow style: PyYAML's scanner is quadratic in the depth
    "common:\n" + "".join(f"{' ' * i}k{i}:\n" for i in range(1, 60)) + " " * 60 + "v: 1\n",
    "common:\n" + "".join(f"{' ' * i}k{i}:\n" for i in range(1, 600)) + " " * 600 + "v: 1\n",  # within MAX_PARAMS_BYTES
])
def test_deep_nesting_is_refused_quickly_without_a_traceback(text):
    with bounded(seconds=2, memory=256 << 20), pytest.raises(ConfigError, match="nested"):
        load_params_text(text, "params.yaml")


def test_a_mapping_or_list_for_a_scalar_is_shown_as_such():
    d = _base()
    d["sft"]["lr"] = {"a": 1}
    d["sft"]["max_steps"] = [1, 2]
    d["sft"]["nonfinite_policy"] = {"raise": True}
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d))
    msg = str(e.value)
    assert "_Loc" not in msg and "object at 0x" not in msg
    assert "sft.lr: expected a float in (0.0, 10.0], got a mapping (1 keys)" in msg
    assert "sft.max_steps: expected an int in [1, 100000000], got a list (2 items)" in msg
    assert "sft.nonfinite_policy: expected one of 'raise', 'skip', got a mapping (1 keys)" in msg


def test_cross_field_problems_carry_the_line_of_the_field():
    text = (ROOT / "params.yaml").read_text()
    sft = text.splitlines().index("sft:")
    lines = text.splitlines()
    at = _line_of(text, "min_lr:", after="sft:")
    lines[at - 1] = "  min_lr: 5.0"
    with pytest.raises(ConfigError) as e:
        load_params_text("\n".join(lines) + "\n", "params.yaml")
    assert len(e.value.problems) == 1 and at > sft
    assert e.value.problems[0].startswith(f"params.yaml:{at}: sft.min_lr: 5.0 is above lr=")


def test_non_utf8_names_the_line(tmp_path):
    data = (ROOT / "params.yaml").read_bytes()
    lines = data.split(b"\n")
    lines[20] = lines[20] + b"  # caf\xe9"
    f = tmp_path / "params.yaml"
    f.write_bytes(b"\n".join(lines))
    with pytest.raises(ConfigError, match=r"params.yaml:21: not valid UTF-8"):
        load_params(f)


def test_path_and_hub_both_set_is_one_problem_under_the_real_key():
    d = _base()
    d["prepare"]["sft_sources"] = [{"path": "a.jsonl", "hub": "org/set", "hub_config": "", "split": "train",
                                    "schema": "alpaca", "field": "text", "limit": 0}]
    with pytest.raises(ConfigError) as e:
        load_params_text(_dump(d), "params.yaml")
    assert len(e.value.problems) == 1
    assert re.match(r"params.yaml:\d+: prepare.sft_sources\[0\]: set exactly one of 'path'", e.value.problems[0])


def test_an_int_too_long_to_convert_is_a_problem_not_a_traceback():
    text = (ROOT / "params.yaml").read_text().replace("seed: 1337", "seed: " + "9" * 5000)
    with pytest.raises(ConfigError, match=r"<text>:\d+: cannot read '9999"):
        load_params_text(text)


def test_a_params_file_at_the_size_bound_is_refused_in_bounded_time_and_memory(tmp_path):
    """The bound is what PyYAML composes in seconds: the worst file under it (tens of thousands of
    small sections, each a problem) is refused within them, its problems listed and counted."""
    text = (ROOT / "params.yaml").read_text()
    text += "".join(f"s{i:05}: {{k: 1}}\n" for i in range((MAX_PARAMS_BYTES - len(text)) // 15))
    assert MAX_PARAMS_BYTES - 15 < len(text) <= MAX_PARAMS_BYTES
    (tmp_path / "params.yaml").write_text(text)
    with bounded(seconds=20, memory=256 << 20), pytest.raises(ConfigError) as e:
        load_params(tmp_path / "params.yaml")
    assert len(str(e.value).splitlines()) == 22 and "unknown section" in str(e.value)


def test_a_huge_file_a_directory_or_a_device_is_refused_quickly(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("common: {}\n" + "#" * (2 << 20))
    for path, fragment in ((big, f"larger than {MAX_PARAMS_BYTES} bytes"), (tmp_path, "cannot be read as a params file"),
                           (Path("/dev/zero"), f"larger than {MAX_PARAMS_BYTES} bytes")):
        if not path.exists():
            continue
        with bounded(seconds=2, memory=64 << 20), pytest.raises(ConfigError, match=fragment):
            load_params(path)


# ---------------------------------------------------------------------------
# The property: any edit of params.yaml is a clean refusal or a load whose every value is in bounds.

def _leaves_in_bounds(obj, prefix="") -> list[str]:
    """Dotted keys of loaded values outside their field's type or bounds (empty = all fine)."""
    import dataclasses
    import math
    bad = []
    for f in dataclasses.fields(obj):
        v, key, meta = getattr(obj, f.name), f"{prefix}{f.name}", f.metadata
        if dataclasses.is_dataclass(v):
            bad += _leaves_in_bounds(v, key + ".")
            continue
        for x in v if isinstance(v, list) else [v]:
            if dataclasses.is_dataclass(x):
                bad += _leaves_in_bounds(x, key + "[].")
            elif isinstance(x, float) and not math.isfinite(x):
                bad.append(key)
            elif isinstance(x, (int, float)) and not isinstance(x, bool) and (
                    (meta.get("lo") is not None and x < meta["lo"]) or (meta.get("hi") is not None and x > meta["hi"])):
                bad.append(key)
    return bad


_TEXT = (ROOT / "params.yaml").read_text()
_LINES = _TEXT.splitlines()
_VALUE_LINES = [i for i, ln in enumerate(_LINES) if re.match(r"^ +\w+: \S", ln)]
yaml_values = st.sampled_from([".nan", ".inf", "-.inf", "1e999", "10000000000000000000000000", "-1", "0", "1",
                               "2", "3.0e-4", "[]", "[1, 2]", "{a: 1}", "yes", "'x'", "~", "*nope", "&a 1",
                               "[" * 50 + "]" * 50, "2001-01-01", "0x10", "1_000", "!!python/object:os.system"])
params_edits = st.one_of(
    st.tuples(st.just("value"), st.integers(0, len(_VALUE_LINES) - 1), yaml_values),
    st.tuples(st.just("bytes"), st.integers(0, len(_TEXT)), st.binary(max_size=8), st.integers(0, 8)),
    st.tuples(st.just("bomb"), st.integers(1, 12)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edit_list=st.lists(params_edits, min_size=1, max_size=4))
def test_any_edit_of_params_is_refused_cleanly_or_loads_in_bounds(tmp_path_factory, edit_list):
    lines = list(_LINES)
    data = None
    for edit in edit_list:
        if edit[0] == "value":
            i = _VALUE_LINES[edit[1]]
            lines[i] = re.sub(r": .*$", f": {edit[2]}", lines[i])
        elif edit[0] == "bomb":  # n levels of nine aliases each: 9**n values once expanded
            n = edit[1]
            lines = ["b0: &b0 [x, x, x, x, x, x, x, x, x]"] + [
                f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 9)}]" for i in range(1, n)] + lines
    data = ("\n".join(lines) + "\n").encode()
    for edit in edit_list:
        if edit[0] == "bytes":
            _, at, blob, drop = edit
            data = data[:at] + blob + data[at + drop:]
    f = tmp_path_factory.mktemp("params") / "params.yaml"
    f.write_bytes(data)
    with bounded(seconds=10, memory=2 << 30):
        try:
            params = load_params(f)
        except ConfigError as e:
            assert e.problems and all(p.startswith(str(f)) for p in e.problems), e.problems
            event(f"refused ({len(e.problems)} problem{'s' if len(e.problems) > 1 else ''})")
            return
    event("loaded")
    assert _leaves_in_bounds(params) == []


def test_a_key_added_at_its_neutral_default_leaves_the_fingerprint_as_before():
    """`sft.min_source_examples` and `sft.average_last` came after SFT runs were made without
    them: at 0 and 1 (each conversation once, the final weights: what those runs did) the
    fingerprint is the one of the config without the keys, so their checkpoints resume; at any
    other value it is a different run."""
    from llm.config import fingerprint, to_dict
    sections = load_sections(["common", "sft"], ROOT / "params.yaml")
    added_fields = [f for f in dataclasses.fields(sections["sft"]) if f.metadata.get("added")]
    # every added key at its default (replay_fraction, set in params.yaml, came later still)
    common = sections["common"]
    sft = dataclasses.replace(sections["sft"], **{f.name: f.default for f in added_fields})
    assert (sft.min_source_examples, sft.average_last) == (0, 1)
    added = {f.name for f in added_fields}
    assert {"min_source_examples", "average_last"} <= added
    before = {k: v for k, v in to_dict(sft).items() if k not in added}
    assert fingerprint(common, sft, {"base": "x"}) == fingerprint(common, before, {"base": "x"})
    for more in (dataclasses.replace(sft, min_source_examples=500), dataclasses.replace(sft, average_last=4)):
        assert fingerprint(common, more, {"base": "x"}) != fingerprint(common, sft, {"base": "x"})


def test_an_added_key_inside_a_nested_section_is_left_out_at_its_default_too():
    from dataclasses import dataclass

    from llm.config import _f, fingerprint

    @dataclass(kw_only=True)
    class Inner:
        width: int = _f(8)
        extra: int = _f(0, added=True)

    @dataclass(kw_only=True)
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        items: list = dataclasses.field(default_factory=list)

    plain = {"inner": {"width": 8}, "items": [{"width": 8}]}
    assert fingerprint(Outer(items=[Inner()])) == fingerprint(plain)
    assert fingerprint(Outer(inner=Inner(extra=1), items=[Inner()])) != fingerprint(plain)


def test_the_config_knows_the_hardest_level_the_generator_draws():
    """llm/config.py cannot import the generators (it sits below them): its bound on every math
    level key is checked against the levels the generator has."""
    from llm.config import MAX_MATH_LEVEL
    from llm.data.generators import MAX_LEVEL, math_problem
    import random
    assert MAX_MATH_LEVEL == MAX_LEVEL
    p = math_problem(random.Random(0), MAX_LEVEL, "en")
    assert p.level == MAX_LEVEL and len(p.steps) == 4
