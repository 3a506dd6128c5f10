"""Install hints name real things: the wheel file or ``scripts/setup.sh``, never a bare
``dfl-agent`` on a package index (the package is on none: pip answers 'No matching
distribution found')."""

import re
import sys
from pathlib import Path

import pytest
import tomllib

import dfl_agent

ROOT = Path(__file__).resolve().parents[2]
#: ``pip install 'dfl-agent[onnx]'``, ``pip install --no-deps dfl-agent``, ``reinstall 'dfl-agent[har]'``
_BARE = re.compile(r"""(?:pip3? install|reinstall)\s+(?:--?[\w-]+\s+)*['"]?dfl[-_]agent(?:\[|['"\s`]|$)""", re.M)


def _sources() -> list[Path]:
    import dfl_agent.cli

    files = []
    for pkg in (Path(dfl_agent.__file__).parent, Path(dfl_agent.cli.__file__).parent):  # agent/ and tools/
        files += sorted(pkg.rglob("*.py")) + sorted(pkg.rglob("*.md"))
    files += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "bench").rglob("*.py"))
    return files + [ROOT / "README.md"]


def test_no_hint_names_a_bare_package_install():
    found = [f"{p}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}"
             for p in _sources() for text in [p.read_text(encoding="utf-8")] for m in _BARE.finditer(text)]
    assert not found, "hints naming an index install:\n" + "\n".join(found)
    for p in _sources():
        if p.suffix == ".py":
            assert "dfl-agent[" not in p.read_text(encoding="utf-8"), p


#: an extra named in a hint or a doc: ``WHEEL[a,b]``, ``dfl-agent[a]``, ``'.[a]'``, ``extra_hint("a")``
_EXTRA = re.compile(r"""(?:\.whl|dfl[-_]agent)\[([\w,-]+)\]|['"]\.\[([\w,-]+)\]|extra_hint\(['"]([\w-]+)['"]\)""")


def test_every_extra_a_hint_or_page_names_exists():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {(p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else str(p), e)
             for p in _sources() for m in _EXTRA.finditer(p.read_text(encoding="utf-8"))
             for e in ",".join(g for g in m.groups() if g).split(",")}
    assert {e for _, e in named} >= {"train", "plot", "onnx", "privacy"}  # the pattern finds them
    assert not [n for n in named if n[1] not in extras], sorted(n for n in named if n[1] not in extras)


def test_extra_hint_names_this_versions_wheel_and_the_setup_script():
    from dfl_agent.extras import SETUP_EXTRAS, SETUP_TEST_EXTRAS, extra_hint

    assert extra_hint("onnx").startswith(f"pip install 'dfl_agent-{dfl_agent.__version__}-py3-none-any.whl[onnx]'")
    assert extra_hint("onnx").endswith("in a source checkout: scripts/setup.sh --test)")
    assert extra_hint("train").endswith("in a source checkout: scripts/setup.sh)")
    assert extra_hint("inference").endswith("in a source checkout: .venv/bin/pip install -e '.[inference]')")
    setup = (ROOT / "scripts/setup.sh").read_text(encoding="utf-8")  # the script installs what the hint says
    default = re.search(r'^EXTRAS="([^"]+)"', setup, re.M).group(1).split(",")
    test_more = re.search(r'EXTRAS="\$EXTRAS,([^"]+)"', setup).group(1).split(",")
    assert (sorted(SETUP_EXTRAS), sorted(SETUP_TEST_EXTRAS)) == (sorted(default), sorted(test_more))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(SETUP_EXTRAS) | set(SETUP_TEST_EXTRAS) <= set(extras)


def test_the_onnx_and_plot_hints_users_see_name_the_wheel(monkeypatch):
    pytest.importorskip("torch")
    from dfl_agent.models.onnx_export import OnnxExportError, export_onnx
    from dfl_agent.runtime.node.metrics import PLOT_HINT

    assert ".whl[plot]" in PLOT_HINT and "dfl-agent[" not in PLOT_HINT
    import torch

    monkeypatch.setitem(sys.modules, "onnx", None)  # as in a venv without the onnx extra
    with pytest.raises(OnnxExportError) as exc:
        export_onnx(torch.nn.Linear(3, 2), (3,))
    msg = str(exc.value)
    assert f"dfl_agent-{dfl_agent.__version__}-py3-none-any.whl[onnx]" in msg and "dfl-agent[" not in msg, msg
