"""Acceptance (issue 11): an intruder process on the real broker publishes a
well-formed unsigned update, wrongly signed ones and a replay of a captured genuine
update to a signed federation.  Nothing reaches a model; every one is counted in the
node's status under its reason."""

import subprocess
import sys
import threading
import time

import paho.mqtt.client as mqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.context import Message
from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.observer import Observer
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import enroll_local, public_key_b64
from dfl_agent.transport import wire
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]
ROUNDS = 5


@needs_mosquitto
def test_unsigned_wrongly_signed_and_replayed_updates_are_rejected(tmp_path):
    fed = "signed-" + str(int(time.time() * 1000) % 100000)
    fed_key = Ed25519PrivateKey.generate()
    with start_broker("mosquitto") as broker:
        procs = []
        for i in range(2):
            state = tmp_path / f"a{i}"
            enroll_local(fed_key, fed, f"a{i}", state)
            cfg = config_from_dict({
                "federation": fed, "node_id": f"a{i}", "state_dir": str(state),
                "algorithm": {"rounds": ROUNDS, "options": {"round_timeout": 8.0}},
                "data": {"dataset": "digits", "partition": "iid", "num_nodes": 2, "node_index": i},
                "model": {"size": "small"},
                "mqtt": {"broker": broker.endpoint},
                "discovery": {"min_peers": 1, "start_timeout": 60.0},
                "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)},
            })
            path = tmp_path / f"a{i}.toml"
            path.write_text(dump_toml(cfg))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                stdout=open(tmp_path / f"a{i}.log", "w"), stderr=subprocess.STDOUT))

        # the intruder: capture a1's genuine broadcast, then attack a0's inbox
        captured: list[bytes] = []
        got_one = threading.Event()
        spy = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")

        def on_message(client, userdata, msg):
            if msg.payload[:3] == b"DFL" and not captured:
                captured.append(bytes(msg.payload))
                got_one.set()

        spy.on_message = on_message
        spy.connect(broker.host, broker.port)
        spy.subscribe(f"dfl/{fed}/node/a1/out", qos=1)
        spy.loop_start()
        assert got_one.wait(120), (tmp_path / "a1.log").read_text()[-3000:]
        genuine = wire.decode(captured[0], federation=fed)
        assert wire.raw_header(captured[0])["sig"].startswith("ed25519:")

        def update(rnd):  # a well-formed, poisoned model update for a0's next rounds
            tensors = {k: (v * 0 + 1e3).astype(v.dtype) if v.dtype.kind == "f" else v
                       for k, v in genuine.tensors.items()}
            return Message(genuine.kind, rnd, tensors, meta=dict(genuine.meta), recipient="a0")

        stranger = SecurityGuard("mallory", Ed25519PrivateKey.generate(), TrustStore(fed))
        impostor = SecurityGuard("a1", Ed25519PrivateKey.generate(), TrustStore(fed))
        attacks = []
        for rnd in range(genuine.round, ROUNDS + 1):
            attacks += [
                wire.encode(update(rnd), federation=fed, sender="a1"),  # unsigned
                wire.encode(update(rnd), federation=fed, sender="a1", sign=impostor.sign),  # bad signature
                wire.encode(update(rnd), federation=fed, sender="mallory", sign=stranger.sign),  # unknown
            ]
        attacks.append(captured[0])  # replay of the genuine update
        for frame in attacks:
            spy.publish(f"dfl/{fed}/node/a0/inbox", frame, qos=1).wait_for_publish(5)
        spy.loop_stop()
        spy.disconnect()

        obs = Observer(broker.endpoint, fed).start()
        for p in procs:
            assert p.wait(timeout=180) == 0, (tmp_path / "a0.log").read_text()[-3000:]
        obs.settle()
        statuses = obs.snapshot()[0]
        obs.stop()
    s0, s1 = statuses["a0"], statuses["a1"]
    assert s0["state"] == "finished" and s0["round"] == ROUNDS
    errors = s0["errors"]
    n = ROUNDS + 1 - genuine.round
    assert errors.get("unsigned", 0) == n
    assert errors.get("bad_signature", 0) == n
    assert errors.get("unknown_sender", 0) == n
    assert errors.get("replay", 0) >= 1
    # no poisoned model reached a0: it learned like its honest peer
    # (an accepted 1e3-filled model would leave it near chance, 0.1)
    assert s0["global_accuracy"] > 0.5 and abs(s0["global_accuracy"] - s1["global_accuracy"]) < 0.1
    assert "Traceback" not in (tmp_path / "a0.log").read_text()
