"""llm/stage.py: every stage's main(): path options from dvc.yaml, --help, one-line errors, no training code in data stages."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT

DATA_STAGES = ("prepare", "tokenizer", "tokenize", "report")


def _help(stage: str) -> str:
    r = subprocess.run([sys.executable, "-m", f"stages.{stage}", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
def test_help_lists_every_path_option_with_what_it_holds():
    import stages.sft as sft
    out = _help("sft")
    for name, what in {**sft.INPUTS, **sft.OUTPUTS}.items():
        assert f"--{name.replace('_', '-')} PATH" in out
        assert what.split(":")[0][:30] in " ".join(out.split())
    assert "dvc repro sft" in out  # the docstring says how to run it


def test_help_prints_the_docstring_once(capsys):
    """The first paragraph is the description; the epilog is the rest, not the whole docstring again."""
    import stages.tokenize as tokenize
    with pytest.raises(SystemExit):
        tokenize.main(["--help"])
    out = capsys.readouterr().out
    assert out.count(tokenize.__doc__.split("\n\n")[0]) == 1
    assert tokenize.__doc__.split("\n\n")[1].strip() in out


def test_a_missing_path_option_is_refused_by_name(capsys):
    import stages.tokenize as tokenize
    with pytest.raises(SystemExit) as e:
        tokenize.main(["--text", "x", "--tokenizer", "y", "--out", "z"])
    assert e.value.code == 2
    assert "the following arguments are required: --metrics" in capsys.readouterr().err


def test_a_params_problem_is_one_message_and_exit_status_1(tmp_path, capsys):
    import stages.prepare as prepare
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["prepare"]["math_trian"] = p["prepare"].pop("math_train")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    code = prepare.main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "out"),
                         "--metrics", str(tmp_path / "m.json")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("prepare: ") and "did you mean 'math_train'" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_full_disk_anywhere_in_a_stage_is_one_line_naming_what_it_writes(tmp_path, capsys):
    """A write outside the atomic helpers (a log appended to, a library's file) fills the disk:
    the OSError names no file, so the line names the stage's outputs."""
    import errno

    from llm.stage import stage_main

    def work(args, common, cfg, rt):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    code = stage_main("report", "doc", ["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "o")],
                      work=work, inputs={}, outputs={"out": "x"})
    err = capsys.readouterr().err
    assert code == 1 and err == f"report: --out {tmp_path / 'o'}: no space left on the device while writing one of" \
                                f" these; free space on that disk (or raise the quota) and run it again (an output" \
                                f" that was there before is left as it was)\n"


def test_a_refused_params_file_says_how_to_get_the_outputs_back(tmp_path, capsys):
    """Under `dvc repro` the stage's outputs are deleted before it reads its params: the error
    ends with the way back (fix the key and rerun, or `dvc checkout <stage>` from the cache)."""
    import stages.prepare as prepare
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["prepare"]["math_train"] = -1
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    code = prepare.main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "out"),
                         "--metrics", str(tmp_path / "m.json")])
    last = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    assert code == 1
    assert last.startswith(f"fix the key in {tmp_path / 'params.yaml'}, then `dvc repro`"), last
    assert "`dvc checkout prepare` from the DVC cache" in last and "`git checkout -- <path>`" in last


def _variant_run(tmp_path, module, argv: list[str]) -> tuple[int, dict]:
    """module.main(argv) with the real params and `run` replaced: what it was called with."""
    seen: dict = {}

    def run(common, cfg, rt, *, name, progress, **paths):
        seen.update(name=name, cfg=cfg, common=common, paths=paths)
        return {"reward_start": 0.0, "reward_end": 0.0, "final_kl": 0.0}   # what summary_line prints

    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    from llm.post.rl import rl_stage_main
    opts = [a for k in (*module.INPUTS, *module.OUTPUTS) for a in (f"--{k.replace('_', '-')}", str(tmp_path / k))]
    rl_main = lambda argv: rl_stage_main(module.STAGE, module.__doc__, run, argv, inputs=module.INPUTS,  # noqa: E731
                                         outputs=module.OUTPUTS, variants=module.VARIANTS)
    return rl_main(["--params", str(tmp_path / "params.yaml"), *opts, *argv]), seen


@pytest.mark.parametrize("stage,variant,forced", [("ppo", "ppo_rm", {"reward_source": "rm", "init_kl_coef": 0.0,
                                                                       "adaptive_kl": False, "max_kl": 1e6,
                                                                       "ptx_coef": 0.0}),
                                                   ("grpo", "grpo_random", {"reward_control": "shuffled"})])
def test_a_variant_runs_the_stage_under_its_name_with_its_keys_forced(tmp_path, stage, variant, forced):
    """`--variant NAME` (dvc.yaml's ppo_rm, grpo_random): the stage's run gets the name and its
    section with the variant's keys forced, the rest as params.yaml has it; the fingerprint of
    what it computes differs from the plain stage's."""
    import importlib

    from llm.config import fingerprint
    module = importlib.import_module(f"stages.{stage}")
    assert module.VARIANTS[variant] == forced
    code, plain = _variant_run(tmp_path, module, [])
    assert code == 0
    code, var = _variant_run(tmp_path, module, ["--variant", variant])
    assert code == 0
    assert plain["name"] == stage and var["name"] == variant
    p = yaml.safe_load((ROOT / "params.yaml").read_text())[stage]
    for key, value in forced.items():
        assert getattr(plain["cfg"], key) == p[key] != value and getattr(var["cfg"], key) == value
    assert {k: v for k, v in vars(var["cfg"]).items() if k not in forced} == {
        k: v for k, v in vars(plain["cfg"]).items() if k not in forced}
    assert fingerprint(plain["common"], plain["cfg"]) != fingerprint(var["common"], var["cfg"])
    assert plain["paths"] == var["paths"]


def test_an_unknown_variant_is_refused(tmp_path, capsys):
    import stages.ppo as ppo
    with pytest.raises(SystemExit) as e:
        _variant_run(tmp_path, ppo, ["--variant", "ppo_verifier"])
    assert e.value.code == 2 and "invalid choice: 'ppo_verifier'" in capsys.readouterr().err


def test_the_default_reward_control_leaves_the_fingerprint_as_it_was():
    """grpo.reward_control came after runs were made: at its default it does not count, so their
    checkpoints still resume."""
    import dataclasses

    from llm.config import GRPOConfig, fingerprint, load_sections
    cfg = load_sections(["grpo"], ROOT / "params.yaml")["grpo"]
    assert cfg.reward_control == "none"
    before = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(GRPOConfig)  # the other added keys as well
              if f.name != "reward_control" and not (f.metadata["added"] and getattr(cfg, f.name) == f.default)}
    assert fingerprint(cfg) == fingerprint(before)
    assert fingerprint(dataclasses.replace(cfg, reward_control="shuffled")) != fingerprint(before)


@pytest.mark.parametrize("stage", DATA_STAGES)
def test_data_stages_do_not_depend_on_the_training_code(stage):
    """Editing the model, the kernels or the loop must not rerun tokenization under DVC: the data
    stages' deps in dvc.yaml (which tests/test_dvc.py ties to their imports) name none of them."""
    deps = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["deps"])
    training = {f"llm/{m}.py" for m in ("model", "kernels", "loop", "trainer", "runtime", "losses", "optim")}
    assert not deps & training, sorted(deps & training)
