"""The fleet commands' one option group (:mod:`dfl_agent.cli.fleet`): every fleet command
takes it, ``--config`` gives the node's broker, credentials, TLS files and trust material,
and each option given overrides the configuration's value."""

from __future__ import annotations

import argparse

import pytest

from dfl_agent.cli import fleet
from dfl_agent.cli.dflctl import build_parser
from dfl_agent.cli.dflctl import main as dflctl

FLEET_COMMANDS = (["peers"], ["status"], ["watch"], ["doctor"], ["run", "submit"], ["run", "list"],
                  ["run", "show"], ["run", "cancel"])
OPTIONS = ("--config", "--broker", "--federation", "-u", "--username", "--password-file", "--cafile", "--cert",
           "--key", "--timeout")


def _sub(parser: argparse.ArgumentParser, path: list[str]) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("path", FLEET_COMMANDS, ids=" ".join)
def test_every_fleet_command_takes_the_connection_group(path):
    p = _sub(build_parser(), path)
    group = next(g for g in p._action_groups if g.title == "connection")
    assert [o for a in group._group_actions for o in a.option_strings] == [
        "--config", "--broker", "--federation", "-u", "--username", "--password-file", "--cafile", "--cert", "--key",
        "--timeout"]


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{**{k: None for k in ("config", "broker", "federation", "username", "password_file",
                                                       "cafile", "cert", "key")}, **kw})


def test_config_gives_broker_credentials_tls_and_options_override(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("")
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'federation = "site"\n\n[mqtt]\nbroker = "b.lan:8883"\nusername = "n1"\npassword = "s3cret"\n'
                   f'tls_ca = "{ca}"\nprotocol = "3.1.1"\n')
    t = fleet.target(_args(config=str(cfg)))
    assert (t.broker, t.federation, t.username, t.password, t.tls_ca, t.protocol) == (
        "b.lan:8883", "site", "n1", "s3cret", str(ca), "3.1.1")
    assert "s3cret" not in repr(t)
    pw = tmp_path / "pw"
    pw.write_text("other\nignored\n")
    t = fleet.target(_args(config=str(cfg), broker="x:1", federation="f", username="op", password_file=str(pw),
                           cafile="/ca2"))
    assert (t.broker, t.federation, t.username, t.password, t.tls_ca) == ("x:1", "f", "op", "other", "/ca2")
    assert fleet.target(_args()) == fleet.FleetTarget("127.0.0.1:1883", "default")


def test_unsigned_config_verifies_nothing_signed_config_does(tmp_path):
    plain = tmp_path / "plain.toml"
    plain.write_text('federation = "open"\n')
    assert fleet.trust_guard(fleet.target(_args(config=str(plain)))) is None  # every node "unverified"
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dfl_agent.security.keys import public_key_b64

    signed = tmp_path / "signed.toml"
    signed.write_text(f'federation = "site"\n\n[security]\nrequire_signatures = true\n'
                      f'federation_key = "{public_key_b64(Ed25519PrivateKey.generate())}"\n')
    assert fleet.trust_guard(fleet.target(_args(config=str(signed)))) is not None


@pytest.mark.parametrize("argv, message", [
    (["--cert", "c.pem"], "--cert and --key go together"),
    (["--cert", "c.pem", "--key", "k.pem"], "--cert needs --cafile"),
    (["--password-file", "/nonexistent/pw"], "--password-file: cannot read /nonexistent/pw"),
    (["--cafile", "/nonexistent/ca.crt"], "cannot load the TLS files (/nonexistent/ca.crt)"),
])
def test_bad_connection_options_are_usage_errors(argv, message, capsys):
    assert dflctl(["peers", "--broker", "127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
