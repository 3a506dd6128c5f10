"""The generated reference: every config key and every CLI command/option has a description."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from dfl_agent.cli import gen_reference as g
from dfl_agent.runtime.shared import config as cfgmod


def test_every_config_field_has_a_description() -> None:
    assert g.missing_config_help() == []


@dataclasses.dataclass
class _Sec:
    ok: int = cfgmod.described(1, help="documented")
    bare: int = 2


@dataclasses.dataclass
class _Top:
    sec: _Sec = dataclasses.field(default_factory=_Sec)


def test_a_config_field_without_description_is_reported() -> None:
    assert g.missing_config_help(_Top) == ["config key sec", "config key sec.bare"]


def test_every_command_and_option_has_help() -> None:
    parsers = g.build_parsers()
    assert [p for p, _ in parsers] == ["dflctl", "dfl-agent", "dfl-infer"]
    assert g.missing_cli_help(parsers) == []


def test_a_command_or_option_without_help_is_reported() -> None:
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--good", help="fine")
    p.add_argument("--bad")
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("quiet")  # no help=
    s.add_argument("thing")
    assert g.missing_cli_help([("x", p)]) == ["option `x --bad BAD`", "command `x quiet`", "option `x quiet thing`"]


def test_reference_lists_every_key_and_command(tmp_path) -> None:
    written = g.write(tmp_path)
    assert {p.name for p in written} == {"config.md", "cli.md"}
    config_md = (tmp_path / "config.md").read_text()
    for k in g.config_fields():
        assert f"| `{k.key}` | {k.type} |" in config_md
    assert "| `mqtt.chunk_size` | integer | 262144 (256 KiB); less with a slow `link_rate` |" in config_md
    assert "| `mqtt.max_frame_bytes` | integer | `67108864` |" in config_md
    cli_md = (tmp_path / "cli.md").read_text()
    for prog, parser in g.build_parsers():
        for cmd in g.walk_parser(prog, parser):
            assert f"`{cmd.path}`" in cli_md
    for path in ("dflctl demo", "dflctl keys enroll", "dfl-agent check-config", "dfl-infer predict"):
        assert f"`{path}`" in cli_md
    assert g.write(tmp_path) == []  # unchanged text is not rewritten


# -- user-facing wording of the documentation ------------------------------------------------

_ROOT = Path(__file__).resolve().parents[2]

#: Phrases that are development notes, not documentation: issue numbers, the machine or
#: session a figure was taken in, internal paper ids, paths outside the repository.
_FORBIDDEN = [
    (re.compile(r"\bissues?[ -]#?\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w&/#`])#\d{1,4}\b"), "an issue number"),
    (re.compile(r"\bthis (machine|task|session)\b", re.I), "a note about where it was written"),
    (re.compile(r"\bdevelopment machine\b", re.I), "a note about where it was written"),
    (re.compile(r"\b(other|previous|second|third|fourth|earlier|later|next) sessions?\b", re.I),
     "a note about where it was written"),
    (re.compile(r"\bseeds? 0\d\d\b", re.I), "an internal paper id (cite the paper)"),
    (re.compile(r"\.\./shared|/work/", re.I), "a path outside the repository"),
]
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)|<((?:https?|ftp)://[^>]+)>")
_URL = re.compile(r"\b(?:https?|ftp)://|\bwww\.|\bgithub\.com/", re.I)


def user_doc_files(root: Path = _ROOT) -> list[Path]:
    """The user-facing Markdown files: docs/ (minus the generated reference), README.md,
    CHANGELOG.md and every Markdown file under bench/ (READMEs and result tables)."""
    files = [root / "README.md", root / "CHANGELOG.md"]
    files += sorted(p for p in (root / "docs").rglob("*.md")
                    if p.relative_to(root).as_posix() not in ("docs/reference/config.md", "docs/reference/cli.md"))
    files += sorted((root / "bench").rglob("*.md"))
    return [p for p in files if p.exists()]


def wording_problems(path: Path, root: Path = _ROOT) -> list[str]:
    """Development notes and links outside the repository in one Markdown file.

    Code (fenced blocks and inline spans) is not prose: a URL in a command is allowed there,
    an issue number is not. Returns ``"file:line: what"`` strings; empty when clean.
    """
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root).as_posix()
    out: list[str] = []

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    for rx, what in _FORBIDDEN:
        for m in rx.finditer(text):
            out.append(f"{rel}:{line_of(m.start())}: {what}: {m.group(0)!r}")
    prose = _CODE.sub(lambda m: " " * len(m.group(0)), text)  # keep offsets
    for m in _LINK.finditer(prose):
        target = m.group(1) or m.group(2)
        if _URL.match(target) or target.startswith(("//", "mailto:")):
            out.append(f"{rel}:{line_of(m.start())}: a link outside the repository: {target}")
            continue
        if target.startswith("#"):
            continue
        dest = (path.parent / target.split("#", 1)[0]).resolve()
        if not dest.is_relative_to(root.resolve()):
            out.append(f"{rel}:{line_of(m.start())}: a link outside the repository: {target}")
    for m in _URL.finditer(prose):
        if not any(lm.start() <= m.start() < lm.end() for lm in _LINK.finditer(prose)):
            out.append(f"{rel}:{line_of(m.start())}: a link outside the repository: {prose[m.start():m.start() + 40]!r}")
    return out


def test_user_docs_have_no_development_notes_or_outside_links() -> None:
    files = user_doc_files()
    assert any(p.name == "README.md" and p.parent.name == "bench" for p in files)
    problems = [p for f in files for p in wording_problems(f)]
    assert problems == [], "\n".join(problems)


def test_wording_check_catches_each_kind(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    bad = tmp_path / "docs" / "page.md"
    bad.write_text(
        "Measured in issue 8 on this machine (#12).\n"
        "See [the paper](https://example.org/p) and [ALGORITHMS](../../shared/ALGORITHMS.md).\n"
        "As seed 003 says, from the previous session: www.example.org\n"
        "`pip install x --index-url https://ok.example/simple` and [ok](other.md) are fine.\n",
        encoding="utf-8")
    problems = wording_problems(bad, tmp_path)
    text = "\n".join(problems)
    assert "issue 8" in text and "'#12'" in text and "this machine" in text
    assert "https://example.org/p" in text and "../../shared/ALGORITHMS.md" in text
    assert "seed 003" in text and "previous session" in text and "www.example.org" in text
    assert "ok.example" not in text and "other.md" not in text
