"""The runtime stays readable: no module of ``agent/runtime/`` is over 600 lines, no
function (or method) in it is over 80 lines, and no attribute of a context, a node or an
agent is assigned outside its class (in ``agent/`` and ``tools/``).  Walks the sources with
``ast``; nothing is imported."""

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "agent" / "runtime"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(RUNTIME.rglob("*.py"))


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = (node.end_lineno or node.lineno) - start + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{node.name} ({lines} lines, line {node.lineno})")
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_no_runtime_module_is_over_600_lines(path: Path) -> None:
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_MODULE_LINES, f"{path.name}: {n} lines"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_no_runtime_function_is_over_80_lines(path: Path) -> None:
    assert _long_functions(path) == [], path.name



#: what a node's owners hold and must change only through its methods (its constructor included)
OWNED = ("ctx", "context", "node", "agent")


def _outside_writes(source: str) -> list[str]:
    """``x.ctx.attr = ...``, ``node.attr += ...`` and the like: an attribute of a context, a node or
    an agent assigned from outside its class (``self.attr = ...`` in its own methods is fine)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for tt in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(tt, ast.Attribute):
                    base = tt.value
                    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                    if name in OWNED:
                        out.append(f"line {tt.lineno}: {ast.unparse(tt)} =")
    return out


def test_no_attribute_of_a_context_node_or_agent_is_assigned_outside_its_class() -> None:
    roots = [RUNTIME.parent, RUNTIME.parents[1] / "tools"]
    found = {str(p.relative_to(RUNTIME.parents[1])): w for r in roots for p in sorted(r.rglob("*.py"))
             if (w := _outside_writes(p.read_text(encoding="utf-8")))}
    assert found == {}


def test_the_outside_write_check_catches_one() -> None:
    assert _outside_writes("def f(agent):\n    agent.notifier = 1\n") == ["line 2: agent.notifier ="]
    assert _outside_writes("def f(x):\n    x.ctx.a, y = 1, 2\n") == ["line 2: x.ctx.a ="]
    assert _outside_writes("class A:\n    def f(self):\n        self.node = 1\n") == []
