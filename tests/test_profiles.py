"""Every profile renders to a valid params file."""
from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from llm.config import load_params_text
from llm.tools.profile import (REPEAT_WARN, ConfigError, available, card_gib, data_need, render, source_bytes, to_yaml,
                               validate)
from tests.conftest import ROOT

PROFILES = ROOT / "env" / "profiles"


def test_the_profiles_exist():
    assert set(available(PROFILES)) >= {"smoke", "cpu", "gpu-13m", "gpu-77m", "gpu-406m", "gpu-speedrun",
                                        "gpu-77m-web"}


@pytest.mark.parametrize("name", available(PROFILES))
def test_every_profile_validates(name):
    params = load_params_text(validate(name, PROFILES))
    if name.startswith("gpu"):
        assert params.common.device == "cuda" and params.common.dtype == "bf16"
        assert card_gib(name, PROFILES) is not None, "a GPU profile names its card, so that `use` checks the fit"
        size = re.match(r"gpu-(\d+m)\b", name)
        if size:  # a profile named for a preset uses that preset
            assert params.pretrain.model.preset == size.group(1)


def test_the_data_check_warns_where_pretraining_repeats_the_embedded_text(capsys, monkeypatch):
    """gpu-77m reads Shakespeare and the generated math dozens of times; its web variant declares
    enough text to read it less than once; the cpu profile reads its text less than once."""
    from llm.tools import profile
    need = data_need(render("gpu-77m", PROFILES)[0], source_bytes("gpu-77m", PROFILES))
    assert need.trained == 10000 * 64 * 1 * 1024
    assert need.repeats > REPEAT_WARN
    (w,) = need.warnings("env/profiles/gpu-77m.yaml")
    assert "pretrain.max_steps x batch_size x grad_accum x model.seq_len" in w and "prepare.math_pretrain_docs" in w
    for name in ("gpu-77m-web", "cpu", "gpu-speedrun"):
        ok = data_need(render(name, PROFILES)[0], source_bytes(name, PROFILES))
        assert ok.repeats is not None and ok.repeats < REPEAT_WARN, name
        assert ok.warnings(name) == []
    monkeypatch.chdir(ROOT)
    assert profile.main(["data", "gpu-77m"]) == 0  # a warning, not a refusal
    assert "pretraining reads its text about 57 times" in capsys.readouterr().err


def test_a_hub_source_of_unknown_size_is_named_not_guessed(tmp_path):
    (tmp_path / "cpu.yaml").write_text((PROFILES / "cpu.yaml").read_text())
    web = (PROFILES / "gpu-77m-web.yaml").read_text().replace("extends: gpu-77m", "extends: cpu")
    (tmp_path / "web.yaml").write_text(web.replace("source_bytes:", "# source_bytes:"))
    need = data_need(render("web", tmp_path)[0], source_bytes("web", tmp_path))
    assert need.repeats is None
    (w,) = need.warnings("web.yaml")
    assert "prepare.pretrain_sources[0] (hub:HuggingFaceFW/fineweb-edu)" in w and "source_bytes" in w


def test_committed_params_yaml_is_the_cpu_profile():
    """params.yaml as committed is the cpu profile (skipped in a workspace where it was changed)."""
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "params.yaml"], cwd=ROOT).returncode
    if dirty:
        pytest.skip("params.yaml differs from HEAD in this workspace (a profile switch or an experiment)")
    current = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert current == render("cpu", PROFILES)[0], "run `python -m llm.profile use cpu` after editing env/profiles/cpu.yaml"


def test_overlay_with_an_unknown_key_is_refused(tmp_path):
    (tmp_path / "cpu.yaml").write_text((PROFILES / "cpu.yaml").read_text())
    (tmp_path / "bad.yaml").write_text("extends: cpu\nppo: {clip_epsilom: 0.3}\n")
    with pytest.raises(ConfigError, match="ppo.clip_epsilom: not a key of the base profile"):
        render("bad", tmp_path)


def test_overlay_with_a_bad_value_is_refused(tmp_path):
    (tmp_path / "cpu.yaml").write_text((PROFILES / "cpu.yaml").read_text())
    (tmp_path / "bad.yaml").write_text("extends: cpu\nppo: {clip_epsilon: 3.0}\n")
    with pytest.raises(ConfigError, match=r"ppo.clip_epsilon: expected a float in \[0.0, 1.0\], got 3.0"):
        validate("bad", tmp_path)


def test_rendered_yaml_round_trips_and_has_no_ambiguous_floats():
    params, desc = render("cpu", PROFILES)
    text = to_yaml(params, "cpu", desc)
    assert yaml.safe_load(text) == params
    load_params_text(text)  # would reject 3e-4-style scalars



@pytest.mark.parametrize("name", available(PROFILES))
def test_dvc_exp_run_set_param_changes_one_line_of_a_rendered_profile(name, tmp_path):
    """`dvc exp run -S section.key=value` rewrites params.yaml through DVC's own writer: a file
    written the way DVC writes lists shows only the changed key in `git diff params.yaml`."""
    from dvc.utils.hydra import apply_overrides
    params, desc = render(name, PROFILES)
    f = tmp_path / "params.yaml"
    f.write_text(to_yaml(params, name, desc), encoding="utf-8")
    before = f.read_text(encoding="utf-8").splitlines()
    apply_overrides(str(f), [f"common.seed={params['common']['seed'] + 1}"])
    after = f.read_text(encoding="utf-8").splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and changed == [
        (f"  seed: {params['common']['seed']}", f"  seed: {params['common']['seed'] + 1}")], changed[:5]

def test_use_writes_params_atomically(tmp_path, monkeypatch):
    from llm.tools import profile
    monkeypatch.chdir(ROOT)
    out = tmp_path / "params.yaml"
    assert profile.main(["use", "smoke", "--params", str(out)]) == 0
    assert out.read_text().startswith("# profile: smoke")
    assert profile.main(["use", "nonexistent", "--params", str(out)]) == 1
    assert out.read_text().startswith("# profile: smoke")  # untouched on error


def test_a_gpu_profile_that_would_not_fit_its_card_is_refused_naming_the_key(tmp_path):
    (tmp_path / "cpu.yaml").write_text((PROFILES / "cpu.yaml").read_text())
    (tmp_path / "big.yaml").write_text((PROFILES / "gpu-77m.yaml").read_text().replace("card_gib: 40", "card_gib: 16"))
    with pytest.raises(ConfigError) as e:
        validate("big", tmp_path)
    msg = str(e.value)
    assert f"{tmp_path}/big.yaml: pretrain: estimated" in msg and "lower pretrain.batch_size: 64 -> at most" in msg
    assert "the 16 GiB card less 10% headroom" in msg


def test_card_gib_must_be_a_positive_number(tmp_path):
    (tmp_path / "cpu.yaml").write_text((PROFILES / "cpu.yaml").read_text())
    (tmp_path / "bad.yaml").write_text("extends: cpu\ncard_gib: lots\n")
    with pytest.raises(ConfigError, match="bad.yaml: card_gib: expected a number of GiB > 0, got 'lots'"):
        validate("bad", tmp_path)


def test_memory_command_prints_every_stage_and_the_fit(capsys, monkeypatch):
    from llm.tools import profile
    monkeypatch.chdir(ROOT)
    assert profile.main(["memory", "gpu-13m"]) == 0
    out = capsys.readouterr().out
    for stage in ("pretrain", "sft", "reward", "pairs", "dpo", "ppo", "grpo", "eval"):
        assert f"\n{stage} " in out, stage
    assert "fits: every stage within 21.6 GiB (the 24 GiB card less 10%)" in out
    assert profile.main(["memory", "--params", "params.yaml", "--card-gib", "0.5"]) == 1
    assert "does NOT fit a 0.5 GiB card" in capsys.readouterr().out


def test_source_bytes_must_map_hub_names_to_positive_byte_counts(tmp_path):
    (tmp_path / "cpu.yaml").write_text((PROFILES / "cpu.yaml").read_text())
    (tmp_path / "bad.yaml").write_text("extends: cpu\nsource_bytes: {org/set: lots}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: source_bytes: expected \{hub name: bytes > 0\}, got"):
        source_bytes("bad", tmp_path)
