"""The commands the documentation shows are commands the package has.

Every ``dflctl``, ``dfl-agent`` and ``dfl-infer`` line in a ``bash`` block of the tutorials,
the how-to guides and the README is parsed by the real argument parser, so a renamed command
or option fails here (in seconds) before a reader meets it. The tutorials' install block
installs the torch version that ``scripts/setup.sh`` and ``scripts/check_install.sh`` install;
``check_install.sh`` (run by CI) proves that install path on a fresh virtual environment.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
from pathlib import Path

import pytest

from dfl_agent.cli import gen_reference as g

ROOT = Path(__file__).resolve().parents[2]
PROGS = ("dflctl", "dfl-agent", "dfl-infer")
_OPERATOR = re.compile(r"^[<>|&;]+$")


def doc_pages() -> list[Path]:
    """README.md and every page under docs/ (the generated reference is not hand-written)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if p.name not in ("config.md", "cli.md") or p.parent.name != "reference"]


def bash_blocks(page: Path) -> list[str]:
    """The ``bash`` fenced blocks of a page, in order."""
    return re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def command_lines(block: str) -> list[list[str]]:
    """The argument vectors of the package's commands in one shell block.

    Continuation lines are joined; a line is split at ``&&``, ``||``, ``;``, ``|`` and ``&``;
    a command ends at its first redirection; a leading ``VAR=value``, ``sudo`` or
    ``nice -n 10`` is skipped; a path before the program name (``.venv/bin/dflctl``) is
    dropped. Reader's notation is not passed to the parser: ``<placeholder>`` becomes a word,
    ``[--optional]`` and ``...`` are left out, and `` / `` separates alternatives.
    """
    out: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"<[A-Za-z0-9_ .:/-]+>", "PLACEHOLDER", line)
        try:
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            tokens = list(lex)
        except ValueError:
            continue
        segments: list[list[str]] = [[]]
        for tok in tokens:
            if tok in ("&&", "||", ";", "|", "&", "/"):
                segments.append([])
            else:
                segments[-1].append(tok)
        for seg in segments:
            words: list[str] = []
            for tok in seg:
                if _OPERATOR.match(tok):  # a redirection ends the command
                    if words and words[-1].isdigit():
                        words.pop()  # the 2 of 2>&1
                    break
                if tok == "..." or (tok.startswith("[") and tok.endswith("]")):
                    continue
                words.append(tok)
            while words and (re.match(r"^[A-Za-z_]+=", words[0]) or words[0] in ("sudo", "exec", "then", "do", "time")):
                words = words[1:]
            if words[:1] == ["nice"]:
                words = words[3:] if words[1:2] == ["-n"] else words[1:]
            if words and words[0].rsplit("/", 1)[-1] in PROGS:
                out.append([words[0].rsplit("/", 1)[-1], *words[1:]])
    return out


@functools.lru_cache(maxsize=1)
def _parsers() -> dict[str, argparse.ArgumentParser]:
    return dict(g.build_parsers())


def _all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in doc_pages():
        for block in bash_blocks(page):
            for argv in command_lines(block):
                found.append((page.relative_to(ROOT).as_posix(), argv))
    return found


def test_command_lines_are_extracted() -> None:
    block = 'for i in 0 1 2; do\n  dfl-agent run --once --config "node$i.toml" > "node$i.log" 2>&1 &\ndone\n' \
            "nice -n 10 .venv/bin/dflctl demo --nodes 3 \\\n  --rounds 2 | tail\nX=1 dflctl peers  # comment\n"
    assert command_lines(block) == [["dfl-agent", "run", "--once", "--config", "node$i.toml"],
                                    ["dflctl", "demo", "--nodes", "3", "--rounds", "2"],
                                    ["dflctl", "peers"]]


def test_the_tutorials_show_commands() -> None:
    pages = {p for p, _ in _all_commands()}
    for tutorial in ("first-federation.md", "live-data.md", "demo.md"):
        assert f"docs/tutorials/{tutorial}" in pages


@pytest.mark.parametrize("page,argv", _all_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_documented_command_parses(page: str, argv: list[str]) -> None:
    parser = _parsers()[argv[0]]
    try:
        parser.parse_args(argv[1:])
    except SystemExit as e:  # argparse exits 2 on an unknown command or option; --help/--version exit 0
        assert e.code == 0, f"{page}: `{' '.join(argv)}` is not a valid command line"


def test_install_block_pins_the_tested_torch() -> None:
    tut = (ROOT / "docs" / "tutorials" / "first-federation.md").read_text(encoding="utf-8")
    install = next(b for b in re.findall(r"```bash\n(.*?)```", tut, flags=re.S) if b.startswith("# tutorial: install"))
    setup_version = re.search(r'TORCH_VERSION="\$\{TORCH_VERSION:-([0-9.]+)\}"', (ROOT / "scripts" / "setup.sh").read_text())
    check_version = re.search(r'TORCH_VERSION="\$\{TORCH_VERSION:-([0-9.]+)\}"',
                              (ROOT / "scripts" / "check_install.sh").read_text())
    assert setup_version and check_version and setup_version.group(1) == check_version.group(1)
    assert f"torch=={setup_version.group(1)}" in install
    assert "-m build --wheel" in install and "[train,har]" in install and "dflctl --version" in install


def test_every_algorithm_is_documented() -> None:
    """Each registered algorithm has a row in the algorithms overview and is named on the
    architecture page (a new algorithm cannot land undocumented)."""
    from dfl_agent.algorithms.base import available

    overview = (ROOT / "docs" / "explanation" / "algorithms" / "index.md").read_text(encoding="utf-8")
    architecture = (ROOT / "docs" / "explanation" / "architecture.md").read_text(encoding="utf-8")
    names = list(available())
    assert "fedavg" in names and "dfml" in names
    assert [n for n in names if f"`{n}`" not in overview] == []
    assert [n for n in names if f"`{n}`" not in architecture] == []


#: errors a documentation snippet may raise because it shows placeholders, not real files or keys
_PLACEHOLDER_ERRORS = ("file not found", "is not base64")


def config_snippets() -> list[tuple[str, str]]:
    """(page, TOML text) of every ``toml`` block and every ``<<TOML`` heredoc in a ``bash``
    block of the README and the documentation; a shell ``$i`` becomes ``0``."""
    out = []
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        snippets = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
        for block in bash_blocks(page):
            snippets += re.findall(r"<<'?TOML'?\n(.*?)\nTOML", block, flags=re.S)
        out += [(page.relative_to(ROOT).as_posix(), s.replace("${i}", "0").replace("$i", "0")) for s in snippets]
    return out


def test_documented_configurations_are_valid(tmp_path) -> None:
    """Every configuration the documentation shows is TOML whose keys and types the agent
    accepts (a renamed or retyped key fails here); a field-lab scenario (a ``[lab]`` table)
    is one the lab accepts (the wheels its ``[releases]`` name are the reader's to build: each
    is checked with a stand-in wheel, so a fresh checkout needs none)."""
    import zipfile
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    from dfl_agent.runtime.shared.config import ConfigError, config_from_dict

    snippets = config_snippets()
    pages = {p for p, _ in snippets}
    assert {"README.md", "docs/tutorials/first-federation.md", "docs/tutorials/live-data.md"} <= pages
    bad = []
    from dfl_agent.cli.lab import scenario

    for page, text in snippets:
        try:
            doc = tomllib.loads(text)
            if "lab" in doc:  # a field-lab scenario, checked as the lab reads it
                if isinstance(doc.get("releases"), dict):
                    wheel = tmp_path / "dfl_agent-0.0.0-py3-none-any.whl"
                    with zipfile.ZipFile(wheel, "w") as z:
                        z.writestr("dfl_agent/__init__.py", "")
                    doc["releases"] = {name: str(wheel) for name in doc["releases"]}
                scenario.parse(doc, page)
            else:
                config_from_dict(doc)
        except scenario.ScenarioError as exc:
            bad.append(f"{page}: scenario: {exc}")
        except ConfigError as exc:
            if not any(p in str(exc) for p in _PLACEHOLDER_ERRORS):
                bad.append(f"{page}: {exc}")
        except tomllib.TOMLDecodeError as exc:
            bad.append(f"{page}: not TOML: {exc}")
    assert bad == [], "\n".join(bad)


def _commands(block: str) -> list[str]:
    """The command lines of a shell block: continuations joined, no comments, no subshell parentheses."""
    lines = [ln.split(" #", 1)[0].strip() for ln in block.replace("\\\n", " ").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#") and ln not in ("(", ")")]


def test_install_blocks_stop_at_the_first_error() -> None:
    """A block of several commands that installs with pip runs under ``set -euo pipefail``: when
    the torch line fails, the next line must not go on to pull a CUDA build from the default index."""
    found, bad = 0, []
    for page in doc_pages():
        for block in bash_blocks(page):
            cmds = _commands(block)
            if len(cmds) < 2 or not any(re.search(r"\bpip3? install\b", c) for c in cmds):
                continue
            found += 1
            if cmds[0] != "set -euo pipefail":
                bad.append(f"{page.relative_to(ROOT)}: {cmds[:2]}")
    assert not bad, "install blocks that go on after a failed line:\n" + "\n".join(bad)
    assert found >= 4, found  # the install page's blocks and the tutorials' install blocks
