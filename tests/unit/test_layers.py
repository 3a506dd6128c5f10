"""The package's layer order, checked on every import statement.

A module may import only from its own layer or from the layers listed before
it (docs/explanation/architecture.md, "Layers"):

1. ``fsutil``, ``tomlcheck``, ``resources``, ``jsonbound``, ``extras``, ``onnx_model``,
   ``durations``, ``interrupt``;
2. ``learning``, ``data``, ``models``, ``security``, ``privacy``;
3. ``algorithms``;
4. ``transport``; then ``discovery``, which may import transport but not the
   reverse;
5. ``store``, ``deploy`` (pure data and files);
6. ``profiles``;
7. ``runtime``;
8. ``inference`` (may import runtime; runtime never imports inference);
9. ``cli`` (``tools/``).

The walk reads the source with :mod:`ast`, so function-local imports count
as much as module-level ones. Two exemptions: imports under ``if TYPE_CHECKING:``
never run (annotations may name a higher layer's types), and a ``__main__`` module is a
program's entry point, run and never imported (``python -m dfl_agent.inference`` starts
``dfl-infer``, which lives with the other command lines in ``tools/``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Rank of each top-level part of dfl_agent. Equal ranks may import each other,
# except where a pair is listed in ONE_WAY.
RANK: dict[str, float] = {
    "fsutil": 1,
    "tomlcheck": 1,
    "resources": 1,
    "jsonbound": 1,
    "extras": 1,
    "onnx_model": 1,
    "durations": 1,
    "interrupt": 1,
    "learning": 2,
    "data": 2,
    "models": 2,
    "security": 2,
    "privacy": 2,
    "algorithms": 3,
    "transport": 4,
    "discovery": 4.5,
    "store": 5,
    "deploy": 5,
    "profiles": 6,
    "runtime": 7,
    "inference": 8,
    "cli": 9,
}

# Known breaks that another change of the same refactoring still removes.
# Each entry: (importing module, imported part). Keep this empty when possible.
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> list[tuple[str, Path]]:
    """(dotted module name, path) for every module of the installed package."""
    out: list[tuple[str, Path]] = []
    for base, prefix in ((ROOT / "agent", "dfl_agent"), (ROOT / "tools", "dfl_agent.cli")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((".".join([prefix, *parts]), path))
    return out


def _part(module: str) -> str | None:
    """The layer key of a dfl_agent module name, None outside the package."""
    bits = module.split(".")
    if bits[0] != "dfl_agent":
        return None
    if len(bits) == 1:
        return ""
    return bits[1]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else (
                test.attr if isinstance(test, ast.Attribute) else "")
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    for sub in ast.walk(stmt):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute imported module) for every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip = _type_checking_lines(tree)
    is_pkg = path.name == "__init__.py"
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                drop = node.level - (1 if is_pkg else 0)
                base = base[: len(base) - drop] if drop else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "dfl_agent":
                # ``from dfl_agent import x``: x is the part imported.
                out.extend((node.lineno, f"dfl_agent.{a.name}") for a in node.names)
            else:
                out.append((node.lineno, target))
    return out


def violations() -> list[str]:
    """Every import that reaches a later layer, as readable lines."""
    found: list[str] = []
    for module, path in _modules():
        own = _part(module)
        if path.name == "__main__.py":
            continue
        if own is None or own not in RANK:
            continue
        for line, target in _imports(module, path):
            other = _part(target)
            if other is None or other == own or other not in RANK:
                continue
            if RANK[other] > RANK[own] and (module, other) not in ALLOWED:
                found.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {target}")
    return found


def test_every_part_has_a_layer() -> None:
    parts = {p.name for p in (ROOT / "agent").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists())}
    parts |= {p.stem for p in (ROOT / "agent").glob("*.py") if p.stem != "__init__"}
    assert parts - set(RANK) == set()


def test_imports_follow_the_layer_order() -> None:
    assert violations() == []


def test_allowlist_holds_only_live_breaks() -> None:
    """An allowlisted break that no longer exists must leave the list."""
    live: set[tuple[str, str]] = set()
    for module, path in _modules():
        for _line, target in _imports(module, path):
            other = _part(target)
            if other:
                live.add((module, other))
    assert ALLOWED - live == set()


@pytest.mark.parametrize("src,expected", [
    ("from dfl_agent.runtime import x\n", ["runtime"]),
    ("def f():\n    import dfl_agent.cli.dflctl\n", ["cli"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from dfl_agent.runtime import x\n", []),
])
def test_walk_sees_local_imports_and_skips_type_checking(
        tmp_path: Path, src: str, expected: list[str]) -> None:
    path = tmp_path / "m.py"
    path.write_text(src)
    got = [_part(t) for _l, t in _imports("dfl_agent.learning.m", path)]
    assert [g for g in got if g and g != "learning"] == expected


def test_module_names_say_what_they_hold() -> None:
    """``runtime.py`` exists only as the runtime package itself: a module elsewhere is named
    after what it holds (``deploy/gate.py``, ``inference/windows.py``, ...)."""
    stray = [str(p.relative_to(ROOT)) for p in (ROOT / "agent").rglob("runtime.py")]
    assert stray == []


def test_command_line_modules_import_no_loop() -> None:
    """The ``dfl_agent.cli`` modules import each other without a loop (function-local
    imports included): shared pieces (tables, observer, output) sit below the commands."""
    cli = {m: p for m, p in _modules() if m.startswith("dfl_agent.cli.")}
    graph = {m: {t for _l, t in _imports(m, p) if t in cli and t != m} for m, p in cli.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import loop: " + " -> ".join([*path[path.index(m):], m]))
        if m in done:
            return
        for t in sorted(graph[m]):
            visit(t, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


# -- the runtime's three lifetimes (docs/explanation/architecture.md, "Inside the runtime") ------
#: what each part of ``dfl_agent.runtime`` may import of the others: a round (``node``), a run
#: (``run``), the service (``service``) and what the service and a run share (``shared``)
RUNTIME_MAY_IMPORT = {"shared": {"shared"}, "node": {"shared", "node"}, "run": {"shared", "node", "run"},
                      "service": {"shared", "service"}}
#: parts that must never import torch, anywhere in their modules (function-local imports included)
TORCH_FREE = {"service", "shared"}


def runtime_violations() -> list[str]:
    """Imports across the runtime's cut that its lifetimes forbid: the service imports no node,
    run or torch; run and service share only the ``shared`` part (the typed pipe, the run host
    interface and the configuration)."""
    found: list[str] = []
    for module, path in _modules():
        bits = module.split(".")
        if bits[:2] != ["dfl_agent", "runtime"] or len(bits) < 4:
            continue
        own = bits[2]
        for line, target in _imports(module, path):
            t = target.split(".")
            if t[:2] == ["dfl_agent", "runtime"] and len(t) >= 3 and t[2] in RUNTIME_MAY_IMPORT \
                    and t[2] not in RUNTIME_MAY_IMPORT[own]:
                found.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {target}")
            if own in TORCH_FREE and (t[0] == "torch" or target.startswith("dfl_agent.learning.lazy")):
                found.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {target}")
    return found


def test_every_runtime_module_lives_in_one_lifetime() -> None:
    runtime = ROOT / "agent" / "runtime"
    assert sorted(p.name for p in runtime.glob("*.py")) == ["__init__.py"]  # no module outside the cut
    assert {p.name for p in runtime.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(RUNTIME_MAY_IMPORT)


def test_the_runtime_imports_follow_its_lifetimes() -> None:
    assert runtime_violations() == []


def test_the_lifetime_check_catches_a_forbidden_import(tmp_path, monkeypatch) -> None:
    service = tmp_path / "agent" / "runtime" / "service"
    service.mkdir(parents=True)
    (service / "bad.py").write_text("import torch\nfrom dfl_agent.runtime.node.node import Node\n"
                                    "from dfl_agent.runtime.run import agent\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "tools").mkdir()
    assert len(runtime_violations()) == 3
