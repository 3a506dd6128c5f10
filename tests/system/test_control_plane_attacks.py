"""An outsider on the broker (paho, no key) attacks the control plane of two signed
agents (``security.require_signatures``): a fake retained "finished" status with a huge
round, the same signed with an enrolled device's own key (a2, which never runs: one
insider is no majority of the run's members), a ghost node's presence with fake
heartbeats, a replayed genuine presence, a spoofed "gated" status and a forged "offline" of a live member, unsigned frames
naming the receiver as sender, and a member-signed model frame (a1's key) of a far
future round with tensors of the wrong shape.  Every attack fails: both agents start
(nothing says the federation finished), train every round with each other and with
nobody else (no round waits for a ghost, no live member is left out, nothing is
skipped), every forged message is counted (read from ``dflctl status --json``), and
``dflctl peers --json --config`` marks the ghosts untrusted."""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.context import Message
from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import enroll_local, load_or_create_key, public_key_b64
from dfl_agent.transport import wire
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]
ROUNDS = 6


def _publish(client, topic, obj, retain=False):
    payload = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)


@needs_mosquitto
def test_outsider_cannot_steer_the_control_plane(tmp_path):
    fed = "ctl-" + str(int(time.time() * 1000) % 100000)
    fed_key = Ed25519PrivateKey.generate()
    node = lambda n, leaf: f"dfl/{fed}/node/{n}/{leaf}"  # noqa: E731
    with start_broker("mosquitto") as broker:
        out = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="outsider")
        out.connect(broker.host, broker.port)
        out.loop_start()
        now = time.time()
        # before the agents start: the federation "finished" at a huge round, and a ghost
        _publish(out, node("ghost-fin", "status"), {"node_id": "ghost-fin", "state": "finished",
                                                    "round": 10**6, "time": now, "heartbeat": 1}, retain=True)
        _publish(out, node("ghost", "presence"), {"state": "online", "node_id": "ghost", "time": now,
                                                  "descriptor": {"broker": broker.endpoint, "algorithm": "fedavg"}},
                 retain=True)
        # an insider: enrolled device a2 signs a retained "finished" status with its own key
        a2_cert = enroll_local(fed_key, fed, "a2", tmp_path / "a2")
        insider = SecurityGuard("a2", load_or_create_key(tmp_path / "a2"), TrustStore(fed), certificate=a2_cert)
        _publish(out, node("a2", "status"), insider.sign_control(
            "status", {"node_id": "a2", "state": "finished", "round": 999999, "time": now, "heartbeat": 1}, fed),
            retain=True)
        paths, procs, certs = [], [], []
        for i in range(2):
            state = tmp_path / f"a{i}"
            certs.append(enroll_local(fed_key, fed, f"a{i}", state))
            cfg = config_from_dict({
                "federation": fed, "node_id": f"a{i}", "state_dir": str(state),
                "algorithm": {"name": "fedavg", "rounds": ROUNDS, "options": {"round_timeout": 20.0}},
                "data": {"dataset": "digits", "partition": "iid", "num_nodes": 2, "node_index": i},
                "model": {"size": "small"},
                "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 1.0},
                "discovery": {"min_peers": 1, "start_timeout": 60.0},
                "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)},
            })
            path = tmp_path / f"a{i}.toml"
            path.write_text(dump_toml(cfg))
            paths.append(path)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                stdout=open(tmp_path / f"a{i}.log", "w"), stderr=subprocess.STDOUT))

        # capture a1's genuine (signed) presence to replay it later
        captured: list[bytes] = []
        seen = threading.Event()

        def on_message(client, userdata, msg):
            if msg.topic == node("a1", "presence") and b'"online"' in msg.payload and not captured:
                captured.append(bytes(msg.payload))
                seen.set()

        out.on_message = on_message
        out.subscribe(node("a1", "presence"), qos=1)
        assert seen.wait(120), (tmp_path / "a1.log").read_text()[-3000:]
        assert json.loads(captured[0]).get("sig", "").startswith("ed25519:")

        frame = wire.encode(Message("model", 1, {}, meta={}, recipient="a0"), federation=fed, sender="a0")
        # a frame signed with member a1's own key: a far future round, tensors of the wrong shape
        a1 = SecurityGuard("a1", load_or_create_key(tmp_path / "a1"), TrustStore(fed), certificate=certs[1])

        def future_frame():
            msg = Message("model", 10**6, {"w": np.ones(3, np.float32)}, meta={"samples": 5}, recipient="a0")
            return wire.encode(msg, federation=fed, sender="a1", sign=a1.sign, cert=a1.certificate)

        deadline = time.time() + 120
        attacks = 0
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            t = time.time()
            _publish(out, node("ghost", "status"), {"node_id": "ghost", "state": "training", "round": 1,
                                                    "time": t, "heartbeat": attacks}, retain=True)
            _publish(out, node("a1", "status"), {"node_id": "a1", "state": "training", "round": 1,
                                                 "gated": "battery 5%", "time": t}, retain=True)
            _publish(out, node("a1", "presence"), {"state": "offline", "node_id": "a1", "time": t}, retain=True)
            _publish(out, node("a1", "presence"), captured[0], retain=True)  # replayed genuine presence
            _publish(out, node("a0", "inbox"), frame)  # unsigned, naming a0 itself as sender
            _publish(out, node("a0", "inbox"), future_frame())  # member-signed, future round, bad tensors
            attacks += 1
            time.sleep(0.5)
        out.loop_stop()
        for i, p in enumerate(procs):
            assert p.wait(timeout=60) == 0, (tmp_path / f"a{i}.log").read_text()[-3000:]
        assert attacks >= 2

        peers = json.loads(subprocess.run(
            [sys.executable, "-m", "dfl_agent.cli.dflctl", "peers", "--json", "--config", str(paths[0])],
            capture_output=True, text=True, timeout=60, check=True).stdout)
        bare = json.loads(subprocess.run(
            [sys.executable, "-m", "dfl_agent.cli.dflctl", "peers", "--json", "--broker", broker.endpoint,
             "--federation", fed], capture_output=True, text=True, timeout=60, check=True).stdout)
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "dfl_agent.cli.dflctl", "status", "--json", "--config", str(paths[0])],
            capture_output=True, text=True, timeout=60, check=True).stdout)

    for i in range(2):
        log = (tmp_path / f"a{i}.log").read_text()
        assert "Traceback" not in log
        rounds = [json.loads(x) for x in (tmp_path / f"a{i}" / "metrics.jsonl").read_text().splitlines()]
        rounds = [r for r in rounds if "round" in r and "round_seconds" in r]
        # the node trained every round (no "finished" start, nothing skipped) ...
        assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1)), log[-2000:]
        # ... with its live peer in every round (a forged offline/gated never dropped it),
        # and no round waited for the ghost (its deadline is 20 s; round 1 includes the
        # other agent's start-up)
        assert all(r.get("neighbours") == 1 for r in rounds), [(r["round"], r.get("neighbours"), r.get("missing")) for r in rounds]
        assert all(r["round_seconds"] < 15 for r in rounds[1:]), [r["round_seconds"] for r in rounds]
    # every forged message was dropped and counted, as a0's status document reports it
    st = status["nodes"]["a0"]
    control, errors = st["control_dropped"], st["errors"]
    assert control.get("status_unsigned", 0) >= 2, st  # the ghosts' and the spoofed gated status
    assert control.get("presence_unsigned", 0) >= 2, st  # the ghost's presence, the forged offline
    assert control.get("presence_replay", 0) >= 1, st  # the replayed genuine presence
    assert set(control) <= {k for k in errors}, st  # control drops are among all drops
    assert errors.get("self_addressed", 0) >= 1, st
    # the member-signed future-round frame was counted as incompatible and skipped nothing
    assert errors.get("incompatible", 0) >= 1, st
    assert st["rounds_skipped"] == 0 and st["round"] == ROUNDS, st
    trust = {r["node_id"]: r for r in peers["peers"]}
    # a0's topics hold what it signed; a1's were overwritten by the outsider's forgeries
    assert trust["a0"]["verified"] and trust["a0"]["trust"] == "device", trust
    assert not trust["a1"]["verified"], trust
    for ghost in ("ghost", "ghost-fin"):
        assert not trust[ghost]["verified"] and trust[ghost]["trust"].startswith("untrusted"), trust[ghost]
    assert all(r["trust"] == "unverified" and not r["verified"] for r in bare["peers"]), bare
