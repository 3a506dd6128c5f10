"""scripts/check_doc_figures.py: a measured figure in README.md or docs/*.md names a committed
file under bench/ (in its paragraph, list or table, or the block next to it in its section),
or is allowed with a reason. The repository's own pages pass; the rules are checked on small
pages written here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_doc_figures.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_doc_figures", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_the_documentation_names_a_source_for_every_figure() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _site(tmp_path: Path, readme: str, bench: tuple[str, ...] = ("bench/x/run.py",)) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    for rel in bench:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("", encoding="utf-8")
    return tmp_path


def test_figures_are_found_outside_code_only() -> None:
    m = _load()
    block = m.Block("README.md", 1, "", "It took 2.5 minutes, 49.6 MB, 0.25 ms, 93 %, 0.61× and 1,580 MB; "
                    "`--timeout 30s` and 3 rounds of 2 × 4 copies on 2 cores with Python 3.10 are no figures.")
    assert block.figures() == ["2.5 minutes", "49.6 MB", "0.25 ms", "93 %", "0.61×", "1,580 MB"]


def test_an_unsourced_figure_fails_and_a_committed_source_passes(tmp_path: Path) -> None:
    m = _load()
    root = _site(tmp_path, "# T\n\nThe demo takes about 2.5 minutes.\n\n```\nsleep 30s  # 12 MB\n```\n")
    problems = m.check(root, allowed=[])
    assert len(problems) == 1 and problems[0].startswith("README.md:3: figures 2.5 minutes")
    (root / "README.md").write_text("# T\n\nThe demo takes about 2.5 minutes (`bench/x/run.py`).\n")
    assert m.check(root, allowed=[]) == []
    (root / "README.md").write_text("# T\n\nThe demo takes about 2.5 minutes (`bench/x/missing.py`).\n")
    assert len(m.check(root, allowed=[])) == 1  # a file that is not there is no source


def test_a_table_is_sourced_by_the_sentence_next_to_it_in_its_section(tmp_path: Path) -> None:
    m = _load()
    table = "| n | time |\n|---|---|\n| 10 | 86.5 s |\n"
    root = _site(tmp_path, f"# T\n\nMeasured with `bench/x/run.py`:\n\n{table}\n## Other\n\n{table}")
    problems = m.check(root, allowed=[])
    assert len(problems) == 1 and problems[0].startswith("README.md:11:")


def test_allowances_need_their_text_and_stale_ones_fail(tmp_path: Path) -> None:
    m = _load()
    root = _site(tmp_path, "# T\n\nThe largest payload is 256 KiB by default.\n")
    allowed = [("README.md", "The largest payload", "configuration default")]
    assert m.check(root, allowed=allowed) == []
    stale = [*allowed, ("README.md", "no such text", "gone")]
    assert m.check(root, allowed=stale) == ["README.md: allowance no longer needed (gone): 'no such text'"]


def test_the_shipped_allowances_are_few_and_give_reasons() -> None:
    m = _load()
    assert len(m.ALLOWED) <= 15
    assert all(reason.strip() for _, _, reason in m.ALLOWED)
