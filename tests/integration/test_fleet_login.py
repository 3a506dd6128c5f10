"""The fleet commands against a login-protected broker, as the enroll-devices how-to sets it
up: a real mosquitto with ``allow_anonymous false``, the password file and ACL that
``dflctl keys enroll`` writes, and the credentials snippet it writes for an operator, used
as ``--config``.  ``peers``, ``status``, ``run submit`` and ``run list`` work; a wrong
password, an unknown host and a TLS failure are one line naming why, exit 3; a mistyped
federation names the real one, exit 1; an unsigned federation shows ``unverified``."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from dfl_agent.cli.broker import mosquitto_path
from dfl_agent.cli.dflctl import main as dflctl
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import CERT_FILE, KEY_FILE, load_certificate, load_private_key
from tests.integration.conftest import login_mosquitto
from tests.integration.test_tls_acl import tls_broker  # noqa: F401 - a fixture: mosquitto with TLS and logins

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.skipif(mosquitto_path() is None or shutil.which("mosquitto_passwd") is None,
                                 reason="mosquitto and mosquitto_passwd are not installed")]
FED = "site"
NAME = "a-run-whose-name-alone-takes-more-than-half-of-eighty-columns"
SHIPPED_ACL = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto" / "dfl.acl"


def _password(creds: Path) -> str:
    return creds.read_text().split('password = "')[1].split('"')[0]


@pytest.fixture(scope="module")
def site():
    """A federation ``site`` with device ``n1`` and operator ``op`` enrolled, its broker, a
    signed presence and status of n1 (signed with n1's key and certificate, published as
    n1), and ``op.toml``: the operator's credentials snippet plus the broker's address."""
    d = Path(tempfile.mkdtemp(prefix="dfl-fleet-", dir="/tmp"))
    d.chmod(0o755)  # the broker's own user must enter it
    try:
        assert dflctl(["keys", "federation-init", "--dir", str(d)]) == 0
        assert dflctl(["keys", "enroll", "n1", "--federation", FED, "--dir", str(d),
                       "--state-dir", str(d / "state-n1")]) == 0
        assert dflctl(["keys", "enroll", "op", "--role", "operator", "--federation", FED, "--dir", str(d),
                       "--state-dir", str(d / "state-op")]) == 0
        acl = d / "dfl.acl"
        if not acl.exists():  # written by keys enroll; older versions left it to the reader
            acl.write_text(SHIPPED_ACL.read_text() + "\nuser n1\ntopic read dfl/+/node/+/presence\n"
                           "topic read dfl/+/node/+/status\n\nuser op\ntopic write dfl/+/run/+\ntopic read dfl/#\n")
        with login_mosquitto(d / "mosquitto.passwd", acl, d) as endpoint:
            op = d / "op.toml"
            op.write_text((d / "credentials" / "op.toml").read_text().replace(
                "[mqtt]\n", f'[mqtt]\nbroker = "{endpoint}"\n'))
            s = d / "state-n1"
            guard = SecurityGuard("n1", load_private_key(s / KEY_FILE), TrustStore(FED),
                                  certificate=load_certificate(s / CERT_FILE))
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="n1-test")
            c.username_pw_set("n1", _password(d / "credentials" / "n1.toml"))
            c.connect("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
            c.loop_start()
            now = time.time()
            for topic, payload in (
                    (f"dfl/{FED}/node/n1/presence", guard.sign_control("presence", {
                        "state": "online", "node_id": "n1", "time": now,
                        "descriptor": {"broker": endpoint, "algorithm": "fedavg", "cert": guard.certificate}}, FED)),
                    (f"dfl/{FED}/node/n1/status", guard.sign_control("status", {
                        "node_id": "n1", "state": "idle", "time": now, "round": 0}, FED)),
                    # the same device in an unsigned federation (no [security] on its side)
                    ("dfl/open/node/n1/presence", json.dumps({"state": "online", "node_id": "n1", "time": now,
                                                              "descriptor": {"broker": endpoint}}).encode())):
                info = c.publish(topic, payload, qos=1, retain=True)
                info.wait_for_publish(5)
                assert info.is_published()
            c.loop_stop()
            c.disconnect()
            yield {"dir": d, "endpoint": endpoint, "op": op}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = dflctl(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_peers_status_and_runs_with_the_operators_config(site, capsys):
    cfg = str(site["op"])
    rc, out, err = _run(capsys, "peers", "--config", cfg, "--json")
    assert rc == 0, err
    peers = json.loads(out)["peers"]
    assert [(p["node_id"], p["trust"], p["address"]) for p in peers] == [("n1", "device", "-")]
    rc, out, err = _run(capsys, "status", "--config", cfg)
    assert rc == 0 and "n1" in out and "idle" in out, err
    rc, out, err = _run(capsys, "run", "submit", "--config", cfg, "--operator-dir", str(site["dir"] / "state-op"),
                        "--algorithm", "fedavg", "--rounds", "2", "--min-members", "1", "--name", NAME,
                        "--no-wait")  # n1's status is a fixture: it never answers
    assert rc == 0, err
    rid = out.strip()
    assert rid.startswith("r-") and "\n" not in rid  # the id alone on stdout, for RID=$(dflctl run submit ...)
    assert f"submitted run {rid} ({NAME}) to federation {FED} on {site['endpoint']}: fedavg, 2 rounds" in err, err
    assert f"follow it: dflctl run show {rid} --config {cfg}" in err
    rc, out, err = _run(capsys, "run", "list", "--config", cfg, "--json")
    assert rc == 0, err
    runs = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert runs[rid]["trust"] == "operator" and runs[rid]["submitter"] == "op"
    rc, out, err = _run(capsys, "run", "list", "--config", cfg)  # piped: every column in full, as peers
    assert rc == 0, err
    row = next(line for line in out.splitlines() if rid in line)
    assert NAME in row and "operator" in row and len(row) > 80, out
    rc, out, err = _run(capsys, "watch", "--config", cfg, "--json", "--count", "1")  # the same runs as run list
    assert rc == 0, err
    watched = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert watched[rid]["trust"] == "operator" and watched[rid]["submitter"] == "op", watched


def test_a_device_account_neither_submits_nor_cancels_and_is_told_why(site, capsys):
    """``--config`` of a device (its credentials snippet from ``keys enroll``, whose
    ``[security]`` requires signatures): unsigned, nothing is sent (exit 2, naming
    --operator-dir); signed by the operator but sent on the device's broker account, the
    shipped ACL refuses the publish and mosquitto says so in its MQTT 5 PUBACK (0x87): exit 1
    with the broker's reason, and the run does not exist; a cancel likewise."""
    from dfl_agent.cli import fleet
    from dfl_agent.cli.fleet import fetch_retained
    from dfl_agent.runtime.shared.descriptor import cancel_topic

    d, op, op_dir = site["dir"], str(site["op"]), str(site["dir"] / "state-op")
    n1 = d / "n1.toml"
    n1.write_text((d / "credentials" / "n1.toml").read_text().replace(
        "[mqtt]\n", f'[mqtt]\nbroker = "{site["endpoint"]}"\n'))
    submit = ("run", "submit", "--config", str(n1), "--algorithm", "fedavg", "--rounds", "1", "--run-id", "r-dev")
    rc, out, err = _run(capsys, *submit)
    assert rc == 2 and out == "", err
    assert "refuse unsigned runs (security.require_signatures of --config is on); nothing was sent: give " \
           "--operator-dir" in err, err
    rc, out, err = _run(capsys, *submit, "--operator-dir", op_dir)
    assert rc == 1 and out == "", err
    assert f"broker {site['endpoint']} refused the publish on dfl/{FED}/run/r-dev: Not authorized (MQTT reason " \
           "code 0x87); its ACL does not let user 'n1' publish runs" in err, err
    assert err.rstrip().endswith("run r-dev was not published"), err
    rc, out, err = _run(capsys, "run", "list", "--config", op, "--json")
    assert rc == 0 and "r-dev" not in [r["run_id"] for r in json.loads(out)["runs"]], out
    rc, out, err = _run(capsys, "run", "submit", "--config", op, "--operator-dir", op_dir, "--algorithm", "fedavg",
                        "--rounds", "1", "--no-wait")
    assert rc == 0, err
    rid = out.strip()
    rc, out, err = _run(capsys, "run", "cancel", rid, "--config", str(n1), "--operator-dir", op_dir)
    assert rc == 1 and "(MQTT reason code 0x87)" in err and f"run {rid} was not cancelled" in err, err
    assert fetch_retained(fleet.target(argparse.Namespace(config=op)), cancel_topic(FED, rid), absent_after=0.5) is None


def test_wrong_password_is_one_line_naming_not_authorised(site, tmp_path):
    wrong = tmp_path / "pw"
    wrong.write_text("not-the-password\n")
    for argv in (["peers"], ["run", "submit", "--algorithm", "fedavg", "--rounds", "1"]):
        r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", *argv, "--config", str(site["op"]),
                            "--password-file", str(wrong)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 3, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert "not authorised as user 'op'" in r.stderr, r.stderr


def test_anonymous_user_is_not_authorised(site, capsys):
    rc, _, err = _run(capsys, "peers", "--broker", site["endpoint"], "--federation", FED)
    assert rc == 3 and "not authorised without a user name" in err, err


def test_mistyped_federation_names_the_real_one(site, capsys):
    rc, out, err = _run(capsys, "peers", "--config", str(site["op"]), "--federation", "stie")
    assert rc == 1 and out == "", out
    assert "no presence or status from federation 'stie'" in err and "did you mean --federation site?" in err, err
    rc, out, err = _run(capsys, "run", "list", "--config", str(site["op"]), "--federation", "stie")
    assert rc == 1 and "federations seen there: " in err and "site (1 node)" in err, err


def test_unsigned_federation_shows_unverified_not_untrusted(site, tmp_path, capsys):
    """A node.toml without [security] (an unsigned federation): nodes are "unverified", as
    with --broker/--federation; the signed federation of the same config stays verified."""
    plain = tmp_path / "plain.toml"
    plain.write_text(site["op"].read_text().split("[security]")[0].replace(f'federation = "{FED}"',
                                                                           'federation = "open"'))
    rc, out, err = _run(capsys, "peers", "--config", str(plain), "--json")
    assert rc == 0, err
    assert [(p["node_id"], p["trust"], p["address"]) for p in json.loads(out)["peers"]] == [("n1", "unverified", "-")]


def test_unknown_host_and_refused_port_say_so(capsys):
    rc, _, err = _run(capsys, "peers", "--broker", "no-such-host.invalid:1883", "--timeout", "3")
    assert rc == 3 and err.startswith("dflctl: unknown host 'no-such-host.invalid'") and err.count("\n") == 1, err
    rc, _, err = _run(capsys, "run", "list", "--broker", "127.0.0.1:1", "--timeout", "3")
    assert rc == 3 and "connection refused by 127.0.0.1:1" in err, err


def test_unsigned_federation_config_on_an_open_broker(mosquitto_broker, federation, tmp_path, capsys):
    """The same on a broker without logins: ``--config`` and ``--broker/--federation`` agree."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{federation}")
    c.connect("127.0.0.1", mosquitto_broker.port)
    c.loop_start()
    c.publish(f"dfl/{federation}/node/n1/presence", json.dumps({"state": "online", "node_id": "n1",
                                                                 "time": time.time()}), qos=1,
              retain=True).wait_for_publish(5)
    c.loop_stop()
    c.disconnect()
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'federation = "{federation}"\n\n[mqtt]\nbroker = "{mosquitto_broker.endpoint}"\n')
    views = []
    for argv in (["--config", str(cfg)], ["--broker", mosquitto_broker.endpoint, "--federation", federation]):
        rc, out, err = _run(capsys, "peers", *argv, "--json")
        assert rc == 0, err
        views.append([(p["node_id"], p["trust"]) for p in json.loads(out)["peers"]])
    assert views == [[("n1", "unverified")]] * 2


def test_tls_failures_say_so(tls_broker, federation, tmp_path, capsys):  # noqa: F811 - the imported fixture
    """A CA that did not sign the broker's certificate, and plain MQTT to a TLS listener: one
    line each, exit 3; the right CA logs in (and the empty federation is exit 1, not a table)."""
    pw = tmp_path / "pw"
    pw.write_text(tls_broker["passwords"]["a"] + "\n")
    login = ["--broker", tls_broker["endpoint"], "--federation", federation, "-u", "a", "--password-file", str(pw)]
    rc, _, err = _run(capsys, "peers", *login, "--cafile", str(tls_broker["dir"] / "otherca.crt"))
    assert rc == 3 and err.startswith(f"dflctl: TLS failure with {tls_broker['endpoint']}: certificate verify "
                                      "failed") and err.count("\n") == 1, err
    rc, _, err = _run(capsys, "peers", *login)
    assert rc == 3 and "closed the connection before answering (a TLS listener? give --cafile" in err, err
    rc, _, err = _run(capsys, "peers", *login, "--cafile", str(tls_broker["dir"] / "ca.crt"))
    assert rc == 1 and f"no presence or status from federation {federation!r}" in err, err
