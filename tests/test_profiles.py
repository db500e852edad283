"""Every profile renders to a valid params file."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from llm.config import load_params_text
from llm.profile import ConfigError, available, render, to_yaml, validate
from tests.conftest import ROOT

PROFILES = ROOT / "env" / "profiles"


def test_the_five_profiles_exist():
    assert set(available(PROFILES)) >= {"smoke", "cpu", "gpu-13m", "gpu-77m", "gpu-406m"}


@pytest.mark.parametrize("name", available(PROFILES))
def test_every_profile_validates(name):
    params = load_params_text(validate(name, PROFILES))
    if name.startswith("gpu"):
        assert params.common.device == "cuda" and params.common.dtype == "bf16"
        assert params.pretrain.model.preset == name.removeprefix("gpu-")


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


def test_use_writes_params_atomically(tmp_path, monkeypatch):
    from llm import profile
    monkeypatch.chdir(ROOT)
    out = tmp_path / "params.yaml"
    assert profile.main(["use", "smoke", "--params", str(out)]) == 0
    assert out.read_text().startswith("# profile: smoke")
    assert profile.main(["use", "nonexistent", "--params", str(out)]) == 1
    assert out.read_text().startswith("# profile: smoke")  # untouched on error


def test_memory_estimate_adds_up_and_scales_with_the_batch():
    from llm.profile import memory_estimate

    params, _ = render("gpu-77m", PROFILES)
    est = memory_estimate(params)
    parts = est["weights_grads_adam_gib"] + est["activations_gib"] + est["logits_gib"] + 1.0
    assert est["total_gib"] == pytest.approx(parts)
    # 16 bytes per parameter for fp32 weights, gradients and two AdamW moments
    assert est["weights_grads_adam_gib"] == pytest.approx(16 * est["n_params_m"] * 1e6 / 1024 ** 3)
    params["pretrain"]["batch_size"] *= 2
    doubled = memory_estimate(params)
    assert doubled["activations_gib"] == pytest.approx(2 * est["activations_gib"])
    assert doubled["logits_gib"] == pytest.approx(2 * est["logits_gib"])
    params["pretrain"]["activation_checkpointing"] = True
    assert memory_estimate(params)["activations_gib"] < doubled["activations_gib"] / 2


@pytest.mark.parametrize("name,card_gib", [("gpu-13m", 24), ("gpu-77m", 40), ("gpu-406m", 80)])
def test_each_gpu_profile_is_estimated_to_fit_its_card(name, card_gib):
    from llm.profile import memory_estimate

    params, _ = render(name, PROFILES)
    assert memory_estimate(params)["total_gib"] < 0.9 * card_gib
