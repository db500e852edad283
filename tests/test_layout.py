"""The layout of llm/ holds itself: packages by level, no import upward, no cycle, the commands run.

llm/__init__.py lists the packages lowest first. A module may import llm/'s own modules (the
ground) and any package at or below its own; never one above it, and no chain of imports may
come back to where it started (lazy imports inside functions count: they run too). The files
named after a command (`python -m llm.chat`) only forward to their module's main().
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

LLM = ROOT / "llm"
PACKAGES = ["data", "nn", "sample", "train", "eval", "post", "tools"]   # lowest first; llm/*.py below them all
COMMANDS = {"chat": "tools", "serve": "tools", "export": "tools", "profile": "tools", "rehearse": "tools",
            "repro": "tools", "seeds": "eval", "average": "train", "readme": "eval"}   # llm/<command>.py forwards; config is ground


def _module(path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _modules() -> dict[str, object]:
    return {_module(p): p for p in sorted(LLM.rglob("*.py"))
            if not (p.parent == LLM and p.stem in COMMANDS)}


def _imports(path, known: set[str]) -> list[tuple[int, str]]:
    """(line, llm module) of every import in a file, lazy ones included."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "llm":
            subs = [f"{n.module}.{a.name}" for a in n.names if f"{n.module}.{a.name}" in known]
            out += [(n.lineno, m) for m in subs] or [(n.lineno, n.module)]
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names if a.name.split(".")[0] == "llm"]
    return out


def _level(module: str) -> int:
    """0 for llm/'s own modules, i + 1 for PACKAGES[i]; a command file counts as the module it forwards to."""
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in COMMANDS:
        return PACKAGES.index(COMMANDS[parts[1]]) + 1
    return PACKAGES.index(parts[1]) + 1 if len(parts) > 2 and parts[1] in PACKAGES else 0


def test_every_module_is_in_a_package_of_the_list():
    stray = [str(p.relative_to(ROOT)) for p in LLM.rglob("*.py")
             if p.parent != LLM and p.parent.name not in PACKAGES]
    assert not stray, f"{stray}: not in a package of tests/test_layout.py PACKAGES; move them into one (or list it)"
    assert {p.name for p in LLM.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(PACKAGES)


def test_no_package_imports_one_above_it():
    mods = _modules()
    upward = [f"{p.relative_to(ROOT)}:{line} imports {m} (level {_level(m)} > {_level(mod)})"
              for mod, p in mods.items() for line, m in _imports(p, set(mods)) if _level(m) > _level(mod)]
    assert not upward, ("a package imports one above it (order: llm/*.py, then " + ", ".join(PACKAGES)
                        + "); move the module up, or the code it needs down:\n" + "\n".join(upward))


def test_the_imports_form_no_cycle():
    mods = _modules()
    graph = {mod: sorted({m for _, m in _imports(p, set(mods)) if m in mods and m != mod}) for mod, p in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle) + "; break it by moving the shared code down")
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


def test_a_package_init_is_its_docstring_alone():
    for pkg in PACKAGES:
        tree = ast.parse((LLM / pkg / "__init__.py").read_text(encoding="utf-8"))
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr) and ast.get_docstring(tree), \
            f"llm/{pkg}/__init__.py: only a docstring (code there would run on every import of the package)"


@pytest.mark.parametrize("command,pkg", sorted(COMMANDS.items()))
def test_a_command_file_only_forwards(command, pkg):
    tree = ast.parse((LLM / f"{command}.py").read_text(encoding="utf-8"))
    body = tree.body[1:]
    assert ast.get_docstring(tree) and len(body) == 2, f"llm/{command}.py: a docstring, one import, the main guard"
    imp = body[0]
    assert isinstance(imp, ast.ImportFrom) and imp.module == f"llm.{pkg}.{command}" and \
        [a.name for a in imp.names] == ["main"], f"llm/{command}.py must import main from llm.{pkg}.{command}"
    assert ast.unparse(body[1]) == "if __name__ == '__main__':\n    raise SystemExit(main())"


def test_every_command_the_docs_name_runs_its_help():
    """`python -m llm.<command> --help` for every command the README, docs/, bench/ and .ci/run name
    (at least the eight forwarding files and llm.config), all at once (each imports torch)."""
    texts = [ROOT / "README.md", ROOT / ".ci" / "run", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").rglob("*.md")]
    named = {m for f in texts for m in re.findall(r"python -m llm\.([a-z_.]+)", f.read_text(encoding="utf-8"))}
    names = sorted(named | {*COMMANDS, "config"})
    procs = {c: subprocess.Popen([sys.executable, "-m", f"llm.{c}", "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for c in names}
    for c, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and "usage:" in out, f"python -m llm.{c} --help exited {p.returncode}:\n{out[-2000:]}"
