"""dvc.yaml agrees with params.yaml and with the code."""
from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest
import yaml

from llm.config import section_keys
from tests.conftest import ROOT

DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _stage_defs():
    for name, st in DVC.items():
        if "foreach" in st:
            yield name, st["do"]
        else:
            yield name, st


def test_every_params_entry_exists():
    sections = section_keys()
    for name, st in _stage_defs():
        for entry in st.get("params", []):
            keys = entry if isinstance(entry, str) else next(iter(entry))
            assert keys.split(".")[0] in sections, f"dvc.yaml stage {name}: params entry {keys!r} is not a section"


def _llm_imports(path: Path, seen: set[str]) -> set[str]:
    """llm/ modules imported by a file, transitively (ignoring imports inside functions is wrong:
    lazy imports count too, so walk the whole tree)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llm":
            mods = [node.module] if node.module != "llm" else []
            mods += [f"{node.module}.{a.name}" for a in node.names
                     if (ROOT / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").is_file()]
            found.update(mods)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "llm")
    out = set()
    for mod in found:
        f = ROOT / (mod.replace(".", "/") + ".py")
        if not f.exists():
            f = ROOT / mod.replace(".", "/") / "__init__.py"
        rel = str(f.relative_to(ROOT))
        if rel not in seen:
            seen.add(rel)
            out.add(rel)
            out |= _llm_imports(f, seen)
    return out


@pytest.mark.parametrize("name,stage", list(_stage_defs()))
def test_deps_cover_the_llm_modules_a_stage_imports(name, stage):
    script = stage["cmd"].split("-m ")[1].split()[0].replace(".", "/") + ".py"
    script = script.replace("${item}", "x")
    deps = set(stage.get("deps", []))
    assert script in deps, f"stage {name}: {script} missing from deps"
    needed = {m for m in _llm_imports(ROOT / script, set()) if not m.endswith("__init__.py")}
    missing = sorted(needed - deps)
    assert not missing, f"dvc.yaml stage {name}: deps lack {missing}"


@pytest.mark.parametrize("name,stage", list(_stage_defs()))
def test_stage_reads_only_its_declared_sections(name, stage):
    """Every stage's main() is `stage_main(<stage>, ...)` (the RL stages' `rl_stage_main(<stage>, ...)`,
    which calls it), which loads `common` and the stage's own section (or `section=`): that section
    must be the one dvc.yaml lists."""
    script = ROOT / (stage["cmd"].split("-m ")[1].split()[0].replace(".", "/") + ".py")
    declared = {(e if isinstance(e, str) else next(iter(e))).split(".")[0] for e in stage.get("params", [])}
    tree = ast.parse(script.read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    calls = [n for n in ast.walk(tree)
             if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("stage_main", "rl_stage_main")]
    assert len(calls) == 1, f"stage {name}: {script.name} should end in one stage_main(...) call"
    call = calls[0]
    arg = next((k.value for k in call.keywords if k.arg == "section"), call.args[0])
    section = arg.value if isinstance(arg, ast.Constant) else consts[arg.id]
    assert {"common", section} <= declared, f"stage {name} loads {section!r} but dvc.yaml lists {sorted(declared)}"



def _variant_forces(stage: dict) -> tuple[str, set[str]]:
    """(the section the stage's script reads, the keys of it that the stage's `--variant` forces:
    none without one), from the script's `stage_main`/`rl_stage_main` call and its VARIANTS."""
    script = ROOT / (stage["cmd"].split("-m ")[1].split()[0].replace(".", "/") + ".py")
    tree = ast.parse(script.read_text())
    consts = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, (ast.Constant, ast.Dict))}
    call = next(n for n in ast.walk(tree)
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("stage_main", "rl_stage_main"))
    arg = next((k.value for k in call.keywords if k.arg == "section"), call.args[0])
    section = arg.value if isinstance(arg, ast.Constant) else consts[arg.id]
    variant = shlex.split(stage["cmd"])[shlex.split(stage["cmd"]).index("--variant") + 1] \
        if "--variant" in stage["cmd"] else None
    return section, set(consts.get("VARIANTS", {}).get(variant, {})) if variant else set()


@pytest.mark.parametrize("name,stage", list(_stage_defs()))
def test_a_stage_lists_exactly_the_params_it_reads(name, stage):
    """A stage reads `common` and its section; a variant (`--variant`, the script's VARIANTS)
    reads its section less the keys it forces, so dvc.yaml lists the others one by one: then
    `dvc exp run -S grpo.reward_control=shuffled` reruns grpo and not grpo_random, whose model
    that key cannot change, and a change to any other key reruns both."""
    import dataclasses

    from llm.config import Params, _hints
    section, forced = _variant_forces(stage)
    declared = {e if isinstance(e, str) else next(iter(e)) for e in stage.get("params", [])}
    fields = [f.name for f in dataclasses.fields(_hints(Params)[section])]
    assert forced <= set(fields), f"stage {name}: forces {sorted(forced - set(fields))}, not keys of {section}"
    if not forced and section not in declared:
        # a stage that reads some keys of another stage's section (samples: pairs' sampling keys)
        # lists them; its script must read no key of the section beyond them
        script = ROOT / (stage["cmd"].split("-m ")[1].split()[0].replace(".", "/") + ".py")
        read = {n.attr for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "cfg" and n.attr in fields}
        keys = {k.partition(".")[2] for k in declared if k.startswith(section + ".")}
        assert read <= keys <= set(fields), (f"dvc.yaml stage {name}: lists {sorted(keys - set(fields))} that"
                                             f" {section} lacks, or lacks {sorted(read - keys)} that it reads")
        return
    want = {"common"} | ({f"{section}.{k}" for k in fields if k not in forced} if forced else {section})
    assert declared == want, (f"dvc.yaml stage {name}: params should be {sorted(want)}; it lacks"
                              f" {sorted(want - declared)} and has {sorted(declared - want)} too")


def test_every_profile_holds_the_keys_dvc_yaml_lists():
    """DVC refuses to run a stage whose listed params key is missing from params.yaml."""
    from llm.tools.profile import available, render
    listed = {e if isinstance(e, str) else next(iter(e)) for _, st in _stage_defs() for e in st.get("params", [])}
    for profile in available():
        params, _ = render(profile)
        for key in listed:
            section, _, leaf = key.partition(".")
            assert section in params and (not leaf or leaf in params[section]), \
                f"env/profiles/{profile}.yaml (rendered) lacks {key}, which dvc.yaml lists"

def _path_args(cmd: str) -> tuple[dict[str, str], list[str]]:
    """(--option -> path, the other words) of a stage command."""
    words = shlex.split(cmd)
    opts, rest, i = {}, [], 0
    while i < len(words):
        if words[i].startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            opts[words[i][2:].replace("-", "_")] = words[i + 1]
            i += 2
        else:
            rest.append(words[i])
            i += 1
    return opts, rest


def _covers(a: str, b: str) -> bool:
    """One path is the other or a directory above it."""
    a, b = a.rstrip("/"), b.rstrip("/")
    return a == b or b.startswith(a + "/") or a.startswith(b + "/")


def _declared_paths(stage: dict, key: str) -> list[str]:
    return [e if isinstance(e, str) else next(iter(e)) for e in stage.get(key, [])]


@pytest.mark.parametrize("name,stage", list(_stage_defs()))
def test_every_path_is_written_once_on_the_command_line_and_declared(name, stage):
    """Each stage takes every path it reads or writes as a command-line option (its INPUTS and
    OUTPUTS), so a path is written once, here in dvc.yaml: every input option must be one of the
    stage's deps (or a directory of them), every output option one of its outs, metrics or plots
    (but for the run directory, which DVC must not track: the next test); and every data dep and
    out must be reached through some option, or be the run file of its metrics (llm/train/metrics.py)."""
    import importlib

    from llm.stage import UNTRACKED_OUTPUTS
    from llm.train.metrics import run_info_path

    module = importlib.import_module(stage["cmd"].split("-m ")[1].split()[0])
    opts, _ = _path_args(stage["cmd"])
    if "variant" in opts:  # not a path: the stage runs as this variant of its script (llm/stage.py)
        variant = opts.pop("variant")
        assert variant == name and variant in getattr(module, "VARIANTS", {}), f"stage {name}: --variant {variant}"
    inputs, outputs = getattr(module, "INPUTS", {}), getattr(module, "OUTPUTS", {})
    assert set(opts) - {"params"} == set(inputs) | set(outputs), f"stage {name}: options {sorted(opts)}"
    deps = [d for d in _declared_paths(stage, "deps") if not d.startswith(("llm/", "stages/"))]
    outs = sum((_declared_paths(stage, k) for k in ("outs", "metrics", "plots")), [])
    for key in inputs:
        assert any(_covers(opts[key], d) for d in deps), f"stage {name}: --{key} {opts[key]} is not among its deps"
    for key in set(outputs) - UNTRACKED_OUTPUTS:
        assert any(_covers(opts[key], o) for o in outs), f"stage {name}: --{key} {opts[key]} is not among its outs"
    derived = [str(run_info_path(opts["metrics"]))] if "metrics" in opts else []
    for path in deps + outs:
        assert any(_covers(p, path) for p in [*opts.values(), *derived]), f"stage {name}: {path} is passed by no option"


@pytest.mark.parametrize("name,stage", list(_stage_defs()))
def test_run_directories_are_no_dvc_output_and_git_ignored(name, stage):
    """A training stage's run directory (checkpoints, TensorBoard) is kept out of DVC: declared as
    an output, an experiment that changes it would make the committed baseline look changed
    (`dvc repro` would retrain it), `dvc repro` would delete a killed run's checkpoints, and a
    persisted output disables the run-cache. So it is on no outs list, and git ignores it."""
    import subprocess

    from llm.stage import UNTRACKED_OUTPUTS

    opts, _ = _path_args(stage["cmd"])
    outs = sum((_declared_paths(stage, k) for k in ("outs", "metrics", "plots")), [])
    for key in UNTRACKED_OUTPUTS & set(opts):
        path = opts[key]
        assert not any(_covers(path, o) for o in outs), f"stage {name}: --{key} {path} is declared as an output"
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0
        assert ignored, f"stage {name}: --{key} {path} is not git-ignored (.gitignore)"


@pytest.mark.parametrize("name,stage", list(_stage_defs()))
def test_metrics_files_have_their_run_file_declared(name, stage):
    """A stage that writes its metrics with llm.train.metrics.write_metrics (the training stages through
    llm.train.finish.finish_stage) also writes the run file (samples, provenance) beside them: dvc.yaml
    declares it as an output that is not a metric, so `dvc metrics diff` never lists it. Its
    timings go to its run directory's run.json (runs/<stage>/run.json), which is no output at all
    and git-ignored, so a rerun that makes the same models leaves dvc.lock as it was."""
    import subprocess

    from llm.train.metrics import run_info_path, timings_path

    opts, _ = _path_args(stage["cmd"])
    script = ROOT / (stage["cmd"].split("-m ")[1].split()[0].replace(".", "/") + ".py")
    if not any(f"{fn}(" in script.read_text() for fn in ("write_metrics", "finish_stage", "finish_rl_stage")):
        return
    run = str(run_info_path(opts["metrics"]))
    assert run in _declared_paths(stage, "outs"), f"stage {name}: {run} is not among its outs"
    assert run not in _declared_paths(stage, "metrics"), f"stage {name}: {run} must not be a metric"
    timings = str(timings_path(opts["metrics"], opts.get("run_dir")))
    outs = sum((_declared_paths(stage, k) for k in ("outs", "metrics", "plots")), [])
    assert not any(_covers(timings, o) for o in outs), f"stage {name}: {timings} is declared as an output"
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", timings], cwd=ROOT).returncode == 0
    assert ignored, f"stage {name}: {timings} is not git-ignored (.gitignore)"


def test_every_stage_but_eval_and_report_can_be_restored_from_the_run_cache_on_another_machine():
    """DVC restores a stage from its run-cache (params, deps and command run before, here or on
    a machine whose run records were pulled) only when it has no persisted output, and none
    uncached but metrics and plots; on another machine every output it restores must also be in
    DVC's cache, since a remote holds cached objects only (DVC 3 pushes and pulls the run records,
    not the git-tracked files they name). So the stages up to the models cache every output;
    eval@<model> and report keep their samples and pages in git for a person to read, and
    rerun (seconds to minutes) instead."""
    blocked = set()
    for name, stage in DVC.items():
        body = stage.get("do", stage)
        entries = [e for k in ("outs", "metrics", "plots") for e in body.get(k, [])]
        if any(isinstance(e, dict) and ((next(iter(e.values())) or {}).get("persist")
                                        or (next(iter(e.values())) or {}).get("cache") is False) for e in entries):
            blocked.add(name)
    assert blocked == {"eval", "report"}, sorted(blocked)
