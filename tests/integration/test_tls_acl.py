"""TLS with server verification, per-device passwords and the ACLs of
``deploy/mosquitto/dfl.acl`` on a real mosquitto."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import ssl
import subprocess
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dfl_agent.cli.broker import free_port, mosquitto_path
from dfl_agent.cli.cli_security import add_acl_user, add_mosquitto_password
from dfl_agent.cli.lab.tls import sign_certificate
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import node_transport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
ACL = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto" / "dfl.acl"


_cert = sign_certificate  # the lab's CA code (dfl_agent.cli.lab.tls)


def _pem(obj, path: Path):
    if isinstance(obj, x509.Certificate):
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))


def make_ca(d: Path, name: str) -> tuple:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = _cert(subject, key, subject, key, ca=True)
    _pem(cert, d / f"{name}.crt")
    return key, cert


@pytest.fixture
def tls_broker(tmp_path):
    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed")
    ca_key, ca = make_ca(tmp_path, "ca")
    make_ca(tmp_path, "otherca")
    skey = ec.generate_private_key(ec.SECP256R1())
    server = _cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), ca_key, ca.subject, skey,
                   san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    _pem(server, tmp_path / "server.crt")
    _pem(skey, tmp_path / "server.key")
    passwords = {}
    for user in ("a", "b"):
        passwords[user] = f"pw-{user}-{os.urandom(4).hex()}"
        add_mosquitto_password(tmp_path / "passwd", user, passwords[user])
        add_acl_user(tmp_path / "dfl.acl", user)  # the shipped ACL + the device's block, as keys enroll writes it
    if (tmp_path / "passwd").read_text().startswith("a:pw-"):
        pytest.skip("mosquitto_passwd not installed: password file would be in clear")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text("\n".join([
        "per_listener_settings false", "persistence false", "log_dest stderr",
        f"listener {port} 127.0.0.1", f"cafile {tmp_path / 'ca.crt'}", f"certfile {tmp_path / 'server.crt'}",
        f"keyfile {tmp_path / 'server.key'}", "allow_anonymous false",
        f"password_file {tmp_path / 'passwd'}", f"acl_file {tmp_path / 'dfl.acl'}",
        # as root, mosquitto would drop to user "mosquitto", who cannot read the test's files
        *(["user root"] if os.geteuid() == 0 else []), "",
    ]))
    proc = subprocess.Popen([mosquitto_path(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "broker.log", "wb"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield {"endpoint": f"127.0.0.1:{port}", "port": port, "dir": tmp_path, "passwords": passwords}
    proc.terminate()
    proc.wait(5)


def _transport(broker, node_id, fed, ca="ca.crt", password=None, **kw):
    return node_transport(node_id, fed, broker=broker["endpoint"], peers=PeerTable(node_id, fed),
                          descriptor={}, tls_ca=str(broker["dir"] / ca), username=node_id,
                          password=password or broker["passwords"][node_id], connect_timeout=4.0, **kw)


async def _until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return pred()


async def test_tls_passwords_and_acls(tls_broker, federation):
    got_a, got_b = [], []
    a = _transport(tls_broker, "a", federation)
    b = _transport(tls_broker, "b", federation)
    await a.start(lambda f, w: got_a.append(f), lambda n, d: None)
    await b.start(lambda f, w: got_b.append(f), lambda n, d: None)
    try:
        await a.broadcast(b"DFL-hello-from-a")
        await a.send("b", b"DFL-unicast-a-to-b")
        assert await _until(lambda: len(got_b) == 2), got_b
        # a raw client logged in as "a" tries to speak as "b": the ACL drops it
        spy = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="a-raw", protocol=mqtt.MQTTv311)
        spy.tls_set(ca_certs=str(tls_broker["dir"] / "ca.crt"), cert_reqs=ssl.CERT_REQUIRED)
        spy.username_pw_set("a", tls_broker["passwords"]["a"])
        spy.connect("127.0.0.1", tls_broker["port"])
        spy.loop_start()
        spy.publish(f"dfl/{federation}/node/b/out", b"DFL-forged-as-b", qos=1).wait_for_publish(5)
        spy.publish(f"dfl/{federation}/node/b/presence", b'{"state":"offline"}', qos=1).wait_for_publish(5)
        # ... and reading b's inbox is not allowed either
        spied = []
        spy.on_message = lambda c, u, m: spied.append(m.payload)
        spy.subscribe(f"dfl/{federation}/node/b/inbox", qos=1)
        await asyncio.sleep(0.5)
        await a.send("b", b"DFL-second-unicast")
        await b.broadcast(b"DFL-from-b")
        assert await _until(lambda: b"DFL-from-b" in got_a and b"DFL-second-unicast" in got_b)
        await asyncio.sleep(0.3)
        spy.loop_stop()
        spy.disconnect()
        assert b"DFL-forged-as-b" not in got_a
        assert spied == []
    finally:
        await a.stop()
        await b.stop()


async def test_server_verification_and_passwords_are_enforced(tls_broker, federation):
    wrong_ca = _transport(tls_broker, "a", federation, ca="otherca.crt")
    with pytest.raises(ConnectionError):
        await wrong_ca.start(lambda f, w: None, lambda n, d: None)
    wrong_pw = _transport(tls_broker, "a", federation, password="not-the-password")
    with pytest.raises(ConnectionError):
        await wrong_pw.start(lambda f, w: None, lambda n, d: None)
    plain = node_transport("a", federation, broker=tls_broker["endpoint"], peers=PeerTable("a", federation),
                           descriptor={}, username="a", password=tls_broker["passwords"]["a"], connect_timeout=3.0)
    with pytest.raises(ConnectionError):
        await plain.start(lambda f, w: None, lambda n, d: None)
