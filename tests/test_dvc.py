"""dvc.yaml agrees with params.yaml and with the code."""
from __future__ import annotations

import ast
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
    script = ROOT / (stage["cmd"].split("-m ")[1].split()[0].replace(".", "/") + ".py")
    declared = {(e if isinstance(e, str) else next(iter(e))).split(".")[0] for e in stage.get("params", [])}
    tree = ast.parse(script.read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "load_sections"]
    assert calls, f"stage {name}: {script.name} never calls load_sections"
    for node in calls:
        arg = node.args[0]
        assert isinstance(arg, ast.List), "load_sections takes a literal list of section names"
        used = {e.value if isinstance(e, ast.Constant) else consts[e.id] for e in arg.elts}
        assert used <= declared, f"stage {name} loads {used - declared} but dvc.yaml does not list it"
