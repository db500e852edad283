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
            mods = [node.module] if node.module != "llm" else [f"llm.{a.name}" for a in node.names]
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
    needed = _llm_imports(ROOT / script, set()) - {"llm/__init__.py"}
    missing = sorted(needed - deps)
    assert not missing, f"dvc.yaml stage {name}: deps lack {missing}"


@pytest.mark.parametrize("name,stage", list(_stage_defs()))
def test_stage_reads_only_its_declared_sections(name, stage):
    """Every stage's main() is `stage_main(<stage>, ...)`, which loads `common` and the stage's own
    section (or `section=`): that section must be the one dvc.yaml lists."""
    script = ROOT / (stage["cmd"].split("-m ")[1].split()[0].replace(".", "/") + ".py")
    declared = {(e if isinstance(e, str) else next(iter(e))).split(".")[0] for e in stage.get("params", [])}
    tree = ast.parse(script.read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "stage_main"]
    assert len(calls) == 1, f"stage {name}: {script.name} should end in one stage_main(...) call"
    call = calls[0]
    arg = next((k.value for k in call.keywords if k.arg == "section"), call.args[0])
    section = arg.value if isinstance(arg, ast.Constant) else consts[arg.id]
    assert {"common", section} <= declared, f"stage {name} loads {section!r} but dvc.yaml lists {sorted(declared)}"


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
    stage's deps (or a directory of them), every output option one of its outs, metrics or plots;
    and every data dep and out must be reached through some option."""
    import importlib

    module = importlib.import_module(stage["cmd"].split("-m ")[1].split()[0])
    opts, _ = _path_args(stage["cmd"])
    inputs, outputs = getattr(module, "INPUTS", {}), getattr(module, "OUTPUTS", {})
    assert set(opts) - {"params"} == set(inputs) | set(outputs), f"stage {name}: options {sorted(opts)}"
    deps = [d for d in _declared_paths(stage, "deps") if not d.startswith(("llm/", "stages/"))]
    outs = sum((_declared_paths(stage, k) for k in ("outs", "metrics", "plots")), [])
    for key in inputs:
        assert any(_covers(opts[key], d) for d in deps), f"stage {name}: --{key} {opts[key]} is not among its deps"
    for key in outputs:
        assert any(_covers(opts[key], o) for o in outs), f"stage {name}: --{key} {opts[key]} is not among its outs"
    for path in deps + outs:
        assert any(_covers(p, path) for p in opts.values()), f"stage {name}: {path} is passed by no option"
