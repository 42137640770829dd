"""The package's dependencies run one way, bottom up (docs/design.md, "Floors").

sizes, quant, models, data -> distributed -> shard -> parallel -> checkpoint -> inference,
planner -> train (inference and planner share a floor and import neither each other). Every
import a module makes (at module level or inside a function) may only reach its own floor or
one below; module-level imports form no cycle; and the core import path
(``import shardwise``) never imports the trainer or ``tomllib`` (which Python 3.10 lacks).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import shardwise

ROOT = Path(shardwise.__file__).parent
FLOORS = {"sizes": 0, "compat": 0, "quant": 0, "models": 0, "data": 0, "distributed": 1, "shard": 2,
          "parallel": 3, "checkpoint": 4, "inference": 5, "planner": 5, "train": 6}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p) for p in ROOT.rglob("*.py")}


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported shardwise module, line, at module level) for every import in ``path``;
    ``from package import submodule`` counts as importing the submodule."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in MODULES]
            if len(names) < len(subs):
                names.append(node.module)
        for name in names:
            if name.startswith("shardwise."):
                out.append((name, node.lineno, id(node) in top))
    return out


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_imports_only_reach_down():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        me = _module(path)
        mine = _floor(me)
        if mine is None:  # shardwise/__init__.py and shardwise/testing/: above everything
            continue
        for name, line, _ in _imports(path):
            theirs = _floor(name)
            if theirs is not None and theirs > mine:
                wrong.append(f"{me}:{line} imports {name} (floor {theirs} > {mine})")
    assert not wrong, "imports that reach up a floor:\n" + "\n".join(wrong)


SIBLINGS = ("inference", "planner")  # one floor, two concerns: neither depends on the other


def test_floor_siblings_do_not_import_each_other():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        me = _module(path).split(".")
        if len(me) < 2 or me[1] not in SIBLINGS:
            continue
        other = SIBLINGS[1 - SIBLINGS.index(me[1])]
        wrong += [f"{'.'.join(me)}:{line} imports {name}" for name, line, _ in _imports(path)
                  if name.split(".")[1:2] == [other]]
    assert not wrong, "\n".join(wrong)


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for name, _, top_level in _imports(path):
            if top_level and name in modules and name != m:
                graph[m].add(name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_module_level_imports_form_no_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_import_shardwise_needs_neither_the_trainer_nor_tomllib():
    code = ("import sys; import shardwise, shardwise.shard, shardwise.distributed, "
            "shardwise.checkpoint, shardwise.parallel, shardwise.models; "
            "bad = [m for m in sys.modules if m == 'tomllib' or m.startswith('shardwise.train')]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out


PY310_MISSING = ("import tomllib", "typing.Self", "datetime.UTC", "enum.StrEnum",
                 "ExceptionGroup", "asyncio.TaskGroup", "except*")


def test_the_package_is_python_3_10_source():
    """pyproject says Python >= 3.10: the sources compile under 3.10 where it is installed,
    and use no 3.11-only name (tomllib comes from shardwise.compat, which falls back to
    tomli)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for name in PY310_MISSING:
            if name == "import tomllib":  # only shardwise/compat.py imports it, guarded
                used = path.name != "compat.py" and re.search(r"^\s*(import|from) tomllib\b",
                                                              text, re.M)
            else:
                used = name in text
            if used:
                found.append(f"{path.relative_to(ROOT.parent)} uses {name}")
    assert not found, found
    py310 = _python310()
    if py310 is not None:
        out = subprocess.run([py310, "-c", _COMPILE, str(ROOT)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


# Compile every source in memory (no .pyc written next to the 3.11 ones).
_COMPILE = ("import pathlib, sys\nfor p in sorted(pathlib.Path(sys.argv[1]).rglob('*.py')):\n"
            "    compile(p.read_text(encoding='utf-8'), str(p), 'exec')")


def _python310() -> str | None:
    """A working Python 3.10 interpreter, if this machine has one."""
    import glob
    import shutil

    for candidate in [shutil.which("python3.10"),
                      *sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3.10"))]:
        if candidate and subprocess.run([candidate, "-c", "pass"],
                                        capture_output=True).returncode == 0:
            return candidate
    return None
