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


@pytest.mark.parametrize("stage", DATA_STAGES)
def test_data_stages_do_not_depend_on_the_training_code(stage):
    """Editing the model, the kernels or the loop must not rerun tokenization under DVC: the data
    stages' deps in dvc.yaml (which tests/test_dvc.py ties to their imports) name none of them."""
    deps = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["deps"])
    training = {f"llm/{m}.py" for m in ("model", "kernels", "loop", "trainer", "runtime", "losses", "optim")}
    assert not deps & training, sorted(deps & training)
