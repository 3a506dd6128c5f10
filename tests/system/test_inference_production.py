"""The torch-free inference member in the production configuration: a mosquitto with TLS,
``allow_anonymous false``, the password file and ACL that ``dflctl keys enroll`` writes, and
``security.require_signatures = true``.

``dfl-infer run --config`` (the member's credentials from ``keys enroll``) logs in, is seen
by a training device, and installs a model only from a frame signed by an enrolled device:
an unsigned frame, a forged signature and a device certified by another federation key are
dropped and counted.  A wrong password is one line and exit code 3.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
import tomllib
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from dfl_agent.cli.broker import free_port, mosquitto_path
from tests.integration.test_tls_acl import _cert, _pem, make_ca
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(120)]
FED = "prod"
NO_TORCH = "import sys; sys.modules['torch'] = None; from dfl_agent.cli.infer import main; sys.exit(main({argv!r}))"


def _onnx(weight: float) -> bytes:
    """A tiny ONNX classifier (4 features -> 2 logits) with the exporter's input-shape metadata."""
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 2], [weight, -weight] * 4)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 2])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {"dfl.input_shape": "[4]"})
    return model.SerializeToString()


def _dflctl(*argv: str) -> None:
    r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", *argv], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def _broker(d: Path, fed_dir: Path) -> tuple[subprocess.Popen, int]:
    """mosquitto with TLS and the federation's password file and ACL (as keys enroll wrote them)."""
    ca_key, ca = make_ca(d, "ca")
    skey = ec.generate_private_key(ec.SECP256R1())
    server = _cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), ca_key, ca.subject, skey,
                   san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    _pem(server, d / "server.crt")
    _pem(skey, d / "server.key")
    port = free_port()
    (d / "mosquitto.conf").write_text("\n".join([
        "per_listener_settings false", "persistence false", "log_dest stderr",
        f"listener {port} 127.0.0.1", f"cafile {d / 'ca.crt'}", f"certfile {d / 'server.crt'}",
        f"keyfile {d / 'server.key'}", "allow_anonymous false",
        f"password_file {fed_dir / 'mosquitto.passwd'}", f"acl_file {fed_dir / 'dfl.acl'}",
        *(["user root"] if os.geteuid() == 0 else []), "",
    ]))
    proc = subprocess.Popen([str(mosquitto_path()), "-c", str(d / "mosquitto.conf")],
                            stdout=subprocess.DEVNULL, stderr=open(d / "broker.log", "wb"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, port


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@needs_mosquitto
def test_inference_member_takes_only_signed_models_over_tls(tmp_path):
    pytest.importorskip("onnx")
    from dfl_agent.algorithms.context import Message
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.discovery.presence import node_transport
    from dfl_agent.onnx_model import ONNX_KIND
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.shared.assembly import build_security
    from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
    from dfl_agent.security.keys import enroll_local, load_or_create_key
    from dfl_agent.transport import wire
    from dfl_agent.transport.chunking import iter_chunks

    fed_dir = tmp_path / "federation"
    _dflctl("keys", "federation-init", "--dir", str(fed_dir))
    for node in ("inf", "t", "x"):  # inf: the member, t: a training device, x: a forger with a login
        _dflctl("keys", "enroll", node, "--federation", FED, "--dir", str(fed_dir),
                "--state-dir", str(tmp_path / node))
    if not (fed_dir / "mosquitto.passwd").read_text().startswith("inf:$"):
        pytest.skip("mosquitto_passwd not installed: the password file would be in clear")
    # x's certificate comes from another federation key: a device this federation never enrolled
    enroll_local(Ed25519PrivateKey.generate(), FED, "x", tmp_path / "x")
    proc, port = _broker(tmp_path, fed_dir)
    broker = f"127.0.0.1:{port}"

    def config(node: str) -> Path:
        creds = tomllib.loads((fed_dir / "credentials" / f"{node}.toml").read_text())
        raw = dict(creds, state_dir=str(tmp_path / node), discovery={"mdns": node == "inf", "interfaces": ["127.0.0.1"]},
                   mqtt=dict(creds["mqtt"], broker=broker, tls_ca=str(tmp_path / "ca.crt"), heartbeat_interval=1.0))
        path = tmp_path / f"{node}.toml"
        path.write_text(dump_toml(config_from_dict(raw)))
        return path

    inf_cfg, t_cfg = config("inf"), config("t")
    try:
        # a wrong password: one line, exit 3, at once
        (tmp_path / "wrong").write_text("not-the-password\n")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", NO_TORCH.format(argv=[
            "run", "--config", str(inf_cfg), "--password-file", str(tmp_path / "wrong")])],
            capture_output=True, text=True, timeout=60)
        assert r.returncode == 3, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "not authorised as user 'inf'" in lines[0], r.stderr
        assert time.monotonic() - t0 < 15

        member = subprocess.Popen([sys.executable, "-c", NO_TORCH.format(argv=[
            "run", "--config", str(inf_cfg), "--log-level", "warning"])], stderr=subprocess.PIPE, text=True)
        from dfl_agent.runtime.shared.config import load_config

        tc = load_config(t_cfg)
        statuses: list[dict] = []
        real = _onnx(1.0)

        async def main() -> float:
            guard = build_security(tc, tmp_path / "t", "t")
            peers = PeerTable("t", FED)
            m = tc.mqtt

            def on_heartbeat(peer, status):
                peers.touch(peer)
                if peer == "inf":
                    statuses.append(status)

            tr = node_transport("t", FED, broker=broker, peers=peers, control=guard, on_heartbeat=on_heartbeat,
                                descriptor={"algorithm": "fedavg", "cert": guard.certificate},
                                username=m.username, password=m.password, tls_ca=m.tls_ca, heartbeat_interval=1.0)
            ctx = RuntimeContext(node_id="t", federation=FED, transport=tr, peers=peers, data=None, model_spec={},
                                 train=None, init_seed=0, rng=np.random.default_rng(0), security=guard)
            await ctx.start()
            try:
                async def until(pred, timeout=30.0):
                    deadline = time.monotonic() + timeout
                    while not pred():
                        assert member.poll() is None, member.stderr.read()
                        assert time.monotonic() < deadline, json.dumps(statuses[-1:])
                        await asyncio.sleep(0.1)

                # the member's signed presence is trusted (its keys-enroll certificate); it knows t
                await until(lambda: "inf" in peers.live_peers() and any("t" in s["live_peers"] for s in statuses))
                rss = _rss_mb(member.pid)
                # x, logged in with its own password, sends three model frames the member must drop
                x_key = load_or_create_key(tmp_path / "x")
                x_cert = json.loads((tmp_path / "x" / "node_cert.json").read_text())
                bad = _onnx(-1.0)

                def x_sign(body: bytes) -> str:
                    return "ed25519:" + base64.b64encode(x_key.sign(body)).decode()

                frames = [
                    wire.encode(Message(ONNX_KIND, 1, {"onnx": np.frombuffer(bad, np.uint8).copy()}, {"round": 9}),
                                federation=FED, sender="t"),  # unsigned, claims to be t
                    wire.encode(Message(ONNX_KIND, 1, {"onnx": np.frombuffer(bad, np.uint8).copy()}, {"round": 9}),
                                federation=FED, sender="t",
                                sign=x_sign),  # claims to be t, signed with another key
                    wire.encode(Message(ONNX_KIND, 1, {"onnx": np.frombuffer(bad, np.uint8).copy()}, {"round": 9}),
                                federation=FED, sender="x",  # well signed, but by another federation's device
                                sign=x_sign, cert=x_cert),
                ]
                raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="x-raw", protocol=mqtt.MQTTv5)
                raw.tls_set(ca_certs=str(tmp_path / "ca.crt"))
                raw.username_pw_set("x", tomllib.loads((fed_dir / "credentials" / "x.toml").read_text())
                                    ["mqtt"]["password"])
                raw.connect("127.0.0.1", port)
                raw.loop_start()
                try:
                    for f in frames:
                        for chunk in iter_chunks(f, 256 * 1024):
                            raw.publish(f"dfl/{FED}/node/inf/inbox", chunk, qos=1).wait_for_publish(5)
                finally:
                    raw.disconnect()
                    raw.loop_stop()
                await until(lambda: sum(statuses[-1]["errors"].values()) >= 3)
                assert not (tmp_path / "inf" / "model.onnx").exists()
                # the enrolled training device's signed model is installed
                await ctx.send("inf", Message(ONNX_KIND, 1, {"onnx": np.frombuffer(real, np.uint8).copy()},
                                              {"version": 1, "round": 1, "accuracy": 0.5}))
                await until(lambda: statuses[-1]["state"] == "serving")
                return rss
            finally:
                await ctx.stop()

        try:
            rss = asyncio.run(main())
        finally:
            member.terminate()
            _, err = member.communicate(timeout=20)
        assert member.returncode == 0, err
        s = statuses[-1]
        assert s["model_version"] == 1 and s["model_source"] == "t"
        assert (tmp_path / "inf" / "model.onnx").read_bytes() == real
        taken = [json.loads(line) for line in (tmp_path / "inf" / "models.jsonl").read_text().splitlines()]
        assert [(m["version"], m["source"]) for m in taken] == [(1, "t")]
        assert s["errors"] == {"unsigned": 1, "bad_signature": 1, "unknown_sender": 1}, s["errors"]
        assert rss < 100, f"the torch-free member uses {rss:.0f} MB"  # 57 MB measured
    finally:
        proc.terminate()
        proc.wait(5)


def _deploy(state: Path, weight: float, run_id: str, rnd: int) -> str:
    """Install a version with ``model.onnx`` in the agent's ``models/`` (what a run's deploy
    gate and its supervisor's switch leave there); returns its run id."""
    from dfl_agent.deploy import ModelStore

    spec = {"spec": {"type": "mlp", "input_shape": [4], "hidden": [], "num_classes": 2}}
    ModelStore(state).install({"model.onnx": _onnx(weight), "spec.json": json.dumps(spec).encode()},
                              {"run_id": run_id, "round": rnd, "accuracy": 0.9, "algorithm": "fedavg"})
    return run_id


def _taken(inf: Path) -> list[str]:
    path = inf / "models.jsonl"
    return [json.loads(line)["run_id"] for line in path.read_text().splitlines()] if path.exists() else []


@needs_mosquitto
@pytest.mark.timeout(180)
def test_the_supervisor_delivers_the_deployment_a_member_lacks(tmp_path):
    """A serving agent (its torch-free supervisor, no run) sends ``models/current`` to the
    member, signed, over TLS with its own login: at the member's start, after a shorter run's
    deployment (round 100 after round 300: the member keeps the newest deployment), and again
    after a copy was lost while the member was down (its status still showed the old model)."""
    pytest.importorskip("onnx")
    from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

    fed_dir = tmp_path / "federation"
    _dflctl("keys", "federation-init", "--dir", str(fed_dir))
    for node in ("inf", "t"):
        _dflctl("keys", "enroll", node, "--federation", FED, "--dir", str(fed_dir), "--state-dir", str(tmp_path / node))
    if not (fed_dir / "mosquitto.passwd").read_text().startswith("inf:$"):
        pytest.skip("mosquitto_passwd not installed: the password file would be in clear")
    proc, port = _broker(tmp_path, fed_dir)

    def config(node: str) -> Path:
        creds = tomllib.loads((fed_dir / "credentials" / f"{node}.toml").read_text())
        raw = dict(creds, state_dir=str(tmp_path / node), discovery={"mdns": False},
                   mqtt=dict(creds["mqtt"], broker=f"127.0.0.1:{port}", tls_ca=str(tmp_path / "ca.crt"),
                             heartbeat_interval=1.0))
        text = dump_toml(config_from_dict(raw))
        path = tmp_path / f"{node}.toml"
        path.write_text(re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n|\n)*", "", text))  # no default run: serving idle
        return path

    inf_cfg, t_cfg = config("inf"), config("t")
    assert tomllib.loads(t_cfg.read_text())["security"]["require_signatures"] is True
    inf = tmp_path / "inf"

    def start_member() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", NO_TORCH.format(argv=[
            "run", "--config", str(inf_cfg), "--log-level", "warning"])], stderr=subprocess.DEVNULL)

    first = _deploy(tmp_path / "t", 1.0, "run-1", 300)
    log_path = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-c", "import sys; from dfl_agent.runtime.service import daemon; "
                              f"sys.exit(daemon.main(['run', '--config', {str(t_cfg)!r}]))"],
                             stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
    member = start_member()

    def until(pred, timeout=60.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert agent.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)

    try:
        until(lambda: _taken(inf) == [first])
        second = _deploy(tmp_path / "t", 2.0, "run-2", 100)  # a shorter run, deployed later
        until(lambda: _taken(inf) == [first, second])
        member.kill()  # its retained status still says it serves run-2's model
        member.wait(10)
        third = _deploy(tmp_path / "t", 3.0, "run-3", 200)
        until(lambda: "sent deployed model v3" in log_path.read_text())  # to nobody: the copy is lost
        time.sleep(1.0)
        assert _taken(inf) == [first, second]
        member = start_member()
        until(lambda: _taken(inf) == [first, second, third])
        assert log_path.read_text().count("sent deployed model v3") == 2  # the lost copy, then the one taken
        held = json.loads((inf / "models.jsonl").read_text().splitlines()[-1])
        assert held["source"] == "t" and held["deployed"] and held["version"] == 3
        assert (inf / "model.onnx").read_bytes() == _onnx(3.0)
    finally:
        member.terminate()
        agent.terminate()
        assert agent.wait(30) == 0, log_path.read_text()[-3000:]
        member.wait(20)
        proc.terminate()
        proc.wait(5)
