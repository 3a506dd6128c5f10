"""The generated reference: every config key and every CLI command/option has a description."""

from __future__ import annotations

import argparse
import dataclasses

from dfl_agent.cli import gen_reference as g
from dfl_agent.runtime import config as cfgmod


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
    assert "| `mqtt.chunk_size` | integer | `262144` |" in config_md
    cli_md = (tmp_path / "cli.md").read_text()
    for prog, parser in g.build_parsers():
        for cmd in g.walk_parser(prog, parser):
            assert f"`{cmd.path}`" in cli_md
    for path in ("dflctl demo", "dflctl keys enroll", "dfl-agent check-config", "dfl-infer predict"):
        assert f"`{path}`" in cli_md
    assert g.write(tmp_path) == []  # unchanged text is not rewritten
