"""The runtime stays readable: no module of ``agent/runtime/`` is over 600 lines, and no
function (or method) in it is over 80 lines.  Walks the sources with ``ast``; nothing is
imported."""

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

