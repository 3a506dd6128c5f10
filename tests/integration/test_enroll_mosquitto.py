"""``dflctl keys enroll`` writes a password file and an ACL that a real mosquitto loads the
way Debian runs it (as root, dropping to the ``mosquitto`` user before it reads them),
without a warning, and the ACL keeps its meaning: a device reads everybody's broadcasts and
its own inbox, writes any inbox, and can neither speak as another node nor read its inbox."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from dfl_agent.cli.broker import free_port, mosquitto_path
from dfl_agent.cli.dflctl import main as dflctl

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(mosquitto_path() is None or shutil.which("mosquitto_passwd") is None,
                                 reason="mosquitto and mosquitto_passwd are not installed")]
SHIPPED_ACL = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto" / "dfl.acl"


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture
def fed_dir():
    # a folder the broker's own user can enter (pytest's tmp_path is private to its owner)
    d = Path(tempfile.mkdtemp(prefix="dfl-enroll-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _client(port: int, user: str, password: str, got: list | None = None) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{user}-test", protocol=mqtt.MQTTv311)
    c.username_pw_set(user, password)
    if got is not None:
        c.on_message = lambda _c, _u, m: got.append((m.topic, m.payload))
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def test_enrolled_devices_log_in_to_mosquitto_with_the_shipped_acl(fed_dir, capsys):
    fed = "site"
    assert dflctl(["keys", "federation-init", "--dir", str(fed_dir)]) == 0
    for dev in ("a", "b"):
        assert dflctl(["keys", "enroll", dev, "--federation", fed, "--dir", str(fed_dir),
                       "--state-dir", str(fed_dir / f"state-{dev}")]) == 0
    assert dflctl(["keys", "enroll", "op", "--role", "operator", "--federation", fed, "--dir", str(fed_dir),
                   "--state-dir", str(fed_dir / "state-op")]) == 0
    out = capsys.readouterr().out
    passwd = fed_dir / "mosquitto.passwd"
    acl = fed_dir / "dfl.acl"
    port = free_port()
    conf = fed_dir / "mosquitto.conf"
    conf.write_text("\n".join([
        "per_listener_settings false", "persistence false", "log_dest stderr", f"listener {port} 127.0.0.1",
        "allow_anonymous false", f"password_file {passwd}", f"acl_file {acl if acl.exists() else SHIPPED_ACL}", ""]))
    log = fed_dir / "broker.log"
    proc = subprocess.Popen([str(mosquitto_path()), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"))
    try:
        deadline = time.monotonic() + 5
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        text = log.read_text()
        assert proc.poll() is None and "Error" not in text, text  # e.g. "Error: Unable to open pwfile"
        assert "Warning" not in text, text  # e.g. "ACL pattern 'dfl/+/run/+' does not contain '%c' or '%u'"
        assert acl.exists(), "keys enroll wrote no ACL for its devices"
        assert passwd.stat().st_mode & 0o777 == 0o640
        if os.geteuid() == 0 and _has_user("mosquitto"):  # the broker drops to it, as Debian's service runs it
            assert pwd.getpwuid(passwd.stat().st_uid).pw_name == "mosquitto"
        assert "sudo install -o mosquitto -g mosquitto -m 0640" in out  # the copy step keeps the broker's access
        creds = {dev: (fed_dir / "credentials" / f"{dev}.toml").read_text().split('password = "')[1].split('"')[0]
                 for dev in ("a", "b", "op")}
        got: list = []
        a = _client(port, "a", creds["a"], got)
        b = _client(port, "b", creds["b"])
        op = _client(port, "op", creds["op"])
        for topic in (f"dfl/{fed}/node/+/out", f"dfl/{fed}/node/+/presence", f"dfl/{fed}/node/a/inbox",
                      f"dfl/{fed}/node/b/inbox", f"dfl/{fed}/run/+", f"dfl/{fed}/run/+/cancel"):
            a.subscribe(topic, qos=1)
        time.sleep(0.3)
        for topic, payload in ((f"dfl/{fed}/node/b/out", b"b-broadcast"),        # allowed
                               (f"dfl/{fed}/node/b/presence", b"b-presence"),    # allowed
                               (f"dfl/{fed}/node/a/inbox", b"b-to-a"),           # allowed
                               (f"dfl/{fed}/node/a/out", b"b-forged-as-a"),      # denied: speaks as a
                               (f"dfl/{fed}/node/a/presence", b"b-forged"),      # denied
                               (f"dfl/{fed}/node/b/inbox", b"b-own-inbox"),      # a may not read it
                               (f"dfl/{fed}/run/r1", b"b-forged-run"),           # denied: operators only
                               (f"dfl/{fed}/run/r1/cancel", b"b-forged-cancel")):  # denied: operators only
            b.publish(topic, payload, qos=1).wait_for_publish(3)
        op.publish(f"dfl/{fed}/run/r2/cancel", b"op-cancel", qos=1).wait_for_publish(3)  # allowed, devices read it
        deadline = time.monotonic() + 3
        while len(got) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        for c in (a, b, op):
            c.loop_stop()
            c.disconnect()
        assert sorted(p for _, p in got) == [b"b-broadcast", b"b-presence", b"b-to-a", b"op-cancel"], got
        assert "Warning" not in log.read_text(), log.read_text()
    finally:
        proc.terminate()
        proc.wait(5)


def _mosquitto(conf: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([str(mosquitto_path()), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"))
    deadline = time.monotonic() + 5
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    assert proc.poll() is None, log.read_text()
    return proc


def test_a_bridge_enrolled_with_role_bridge_joins_a_site_broker_to_the_hub(fed_dir, capsys):
    """Two sites (deploy/multi-site.md): site b's broker logs in to the hub as the bridge user
    that ``keys enroll --role bridge`` made, with the login lines it wrote; the federation's
    topics cross both ways, another federation's do not."""
    fed = "site"
    assert dflctl(["keys", "federation-init", "--dir", str(fed_dir)]) == 0
    for dev in ("a", "b"):
        assert dflctl(["keys", "enroll", dev, "--federation", fed, "--dir", str(fed_dir),
                       "--state-dir", str(fed_dir / f"state-{dev}")]) == 0
    assert dflctl(["keys", "enroll", "site-b", "--role", "bridge", "--federation", fed, "--dir", str(fed_dir)]) == 0
    assert not (fed_dir / "certs").exists()  # a bridge has no certificate
    snippet = fed_dir / "credentials" / "site-b.conf"
    assert snippet.stat().st_mode & 0o777 == 0o600 and f"bridge login lines for the site broker: {snippet}" in \
        capsys.readouterr().out
    assert "user site-b\ntopic readwrite dfl/site/#\n" in (fed_dir / "dfl.acl").read_text()
    hub_port, b_port = free_port(), free_port()
    common = ["per_listener_settings false", "persistence false", "log_dest stderr", "allow_anonymous false",
              f"password_file {fed_dir / 'mosquitto.passwd'}", f"acl_file {fed_dir / 'dfl.acl'}"]
    (fed_dir / "hub.conf").write_text("\n".join([*common, f"listener {hub_port} 127.0.0.1", ""]))
    (fed_dir / "b.conf").write_text("\n".join([
        *common, f"listener {b_port} 127.0.0.1", "connection site-b-to-hub", f"address 127.0.0.1:{hub_port}",
        *[ln for ln in snippet.read_text().splitlines() if not ln.startswith("#")],
        "topic dfl/other/# both 1", "bridge_protocol_version mqttv50", "cleansession true", "try_private true",
        "notifications false", "restart_timeout 1", ""]))
    hub = _mosquitto(fed_dir / "hub.conf", hub_port, fed_dir / "hub.log")
    site_b = _mosquitto(fed_dir / "b.conf", b_port, fed_dir / "b.log")
    try:
        deadline = time.monotonic() + 10
        while "u'site-b'" not in (fed_dir / "hub.log").read_text():  # the hub let the bridge in
            assert time.monotonic() < deadline, (fed_dir / "hub.log").read_text() + (fed_dir / "b.log").read_text()
            time.sleep(0.05)
        creds = {dev: (fed_dir / "credentials" / f"{dev}.toml").read_text().split('password = "')[1].split('"')[0]
                 for dev in ("a", "b")}
        got_a: list = []
        got_b: list = []
        a = _client(hub_port, "a", creds["a"], got_a)
        b = _client(b_port, "b", creds["b"], got_b)
        a.subscribe(f"dfl/{fed}/node/+/out", qos=1)
        a.subscribe("dfl/other/node/+/out", qos=1)
        b.subscribe(f"dfl/{fed}/node/b/inbox", qos=1)
        time.sleep(0.5)
        b.publish(f"dfl/{fed}/node/b/out", b"b-broadcast", qos=1).wait_for_publish(3)  # b -> hub
        b.publish("dfl/other/node/b/out", b"other-federation", qos=1).wait_for_publish(3)  # not the bridge's
        a.publish(f"dfl/{fed}/node/b/inbox", b"a-to-b", qos=1).wait_for_publish(3)  # hub -> b
        deadline = time.monotonic() + 5
        while (not got_a or not got_b) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        for c in (a, b):
            c.loop_stop()
            c.disconnect()
        assert [p for _, p in got_a] == [b"b-broadcast"], got_a
        assert [p for _, p in got_b] == [b"a-to-b"], got_b
    finally:
        for p in (site_b, hub):
            p.terminate()
            p.wait(5)
