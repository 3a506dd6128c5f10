"""The command line starts without torch: building ``dflctl``'s parser and running its
fleet commands' help must not import torch (a torch-free member has none), and the
shown help covers every option."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

# torch is made unimportable (sys.modules["torch"] = None) so that an accidental
# import fails loudly instead of merely being slow.
_PROBE = r"""
import sys
sys.modules["torch"] = None
{body}
leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")
                if sys.modules[m] is not None)
print("LEAKED", leaked)
"""


def _probe(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PROBE.format(body=body)], capture_output=True, text=True, check=False,
                          timeout=60)


@pytest.mark.parametrize("argv", [["--version"], ["peers", "--help"], ["status", "--help"], ["watch", "--help"],
                                  ["doctor", "--help"], ["keys", "show", "--help"], ["predict", "--help"],
                                  ["--help"]])
def test_dflctl_commands_start_without_torch(argv: list[str]) -> None:
    body = ("from dfl_agent.cli.dflctl import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n")
    r = _probe(body)
    assert r.returncode == 0, r.stderr
    assert "LEAKED []" in r.stdout, r.stdout
    assert "import of torch halted" not in r.stderr


def test_dfl_infer_starts_without_torch() -> None:
    body = ("from dfl_agent.cli.infer import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code in (0, None)\n"
            "import dfl_agent.inference.member, dfl_agent.transport.wire\n")
    r = _probe(body)
    assert r.returncode == 0, r.stderr
    assert "dfl-infer " in r.stdout and "LEAKED []" in r.stdout


def test_family_names_match_models() -> None:
    from dfl_agent.cli.dflctl import FAMILY_NAMES
    from dfl_agent.models.families import FAMILIES

    assert tuple(sorted(FAMILIES)) == FAMILY_NAMES


def _walk(p: argparse.ArgumentParser):
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for child in a.choices.values():
                yield from _walk(child)
        else:
            yield p, a


def test_every_option_has_help_and_top_level_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from dfl_agent.cli.dflctl import build_parser

    p = build_parser()
    missing = [f"{q.prog} {a.option_strings or a.dest}" for q, a in _walk(p) if not a.help]
    assert missing == []
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    out = capsys.readouterr().out
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices) >= 12
    for name in sub.choices:
        assert f"\n    {name}" in out, name
    with pytest.raises(SystemExit):
        p.parse_args(["demo", "--help"])
    demo = " ".join(capsys.readouterr().out.split())
    assert "(default: 5)" in demo and "(default: dfl-demo)" in demo  # --nodes, --out
