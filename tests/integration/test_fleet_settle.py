"""Fleet queries wait for the broker, not a clock (real mosquitto): the observer's settle window
starts when the broker acknowledged the subscription and ends when its barrier is answered, so
``peers``, ``status``, ``run list`` and ``run show`` see every retained document of the
federation however long the connection took to come up."""

from __future__ import annotations

import json
import time

import paho.mqtt.client as mqtt
import pytest

from dfl_agent.cli import fleet
from dfl_agent.cli.dflctl import main as dflctl
from dfl_agent.cli.observer import Observer
from dfl_agent.runtime.shared.descriptor import RunDescriptor, run_topic, sign_descriptor

pytestmark = pytest.mark.integration
NODES = ("n0", "n1", "n2")


def _retain(endpoint: str, fed: str, extra: int = 0) -> str:
    """Retained presence and status of three nodes and one run (unsigned federation), and the
    statuses of ``extra`` more nodes of 2 KB each; the run id."""
    host, port = endpoint.rsplit(":", 1)
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.connect(host, int(port))
    c.loop_start()
    now = time.time()
    d = RunDescriptor(run_id="r-settle", federation=fed, algorithm="fedavg", rounds=2, submitted_at=now)
    msgs = [(run_topic(fed, d.run_id), sign_descriptor(d, None))]
    for n in NODES:
        msgs += [(f"dfl/{fed}/node/{n}/presence", json.dumps({"state": "online", "node_id": n, "time": now})),
                 (f"dfl/{fed}/node/{n}/status", json.dumps({"node_id": n, "state": "idle", "time": now, "round": 0,
                                                            "run": {"id": d.run_id, "state": "finished", "round": 2,
                                                                    "reason": ""}}))]
    msgs += [(f"dfl/{fed}/node/x{i:03d}/status", json.dumps({"node_id": f"x{i:03d}", "pad": "x" * 2000}))
             for i in range(extra)]
    for info in [c.publish(topic, payload, qos=1, retain=True) for topic, payload in msgs]:
        info.wait_for_publish(5)
    c.disconnect()
    c.loop_stop()
    return d.run_id


@pytest.fixture
def slow_connect(monkeypatch):
    """Every fleet connection waits 0.6 s before it connects (a slow network or a loaded
    machine: longer than the old 0.5 s settle window, which started at construction)."""
    real = fleet.FleetTarget.connect

    def connect(self, client, timeout=5.0):
        time.sleep(0.6)
        return real(self, client, timeout)

    monkeypatch.setattr(fleet.FleetTarget, "connect", connect)


def test_queries_see_the_retained_fleet_after_a_slow_connection(mosquitto_broker, federation, slow_connect, capsys):
    rid = _retain(mosquitto_broker.endpoint, federation)
    b = ["--broker", mosquitto_broker.endpoint, "--federation", federation]
    for _ in range(3):
        assert dflctl(["peers", *b, "--json"]) == 0, capsys.readouterr().err
        assert [r["node_id"] for r in json.loads(capsys.readouterr().out)["peers"]] == list(NODES)
    assert dflctl(["status", *b, "--json"]) == 0, capsys.readouterr().err
    assert sorted(json.loads(capsys.readouterr().out)["nodes"]) == list(NODES)
    assert dflctl(["run", "list", *b, "--json"]) == 0, capsys.readouterr().err
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]] == [rid]
    assert dflctl(["run", "show", rid, *b, "--json"]) == 0, capsys.readouterr().err
    assert sorted(json.loads(capsys.readouterr().out)["nodes"]) == list(NODES)


def test_settle_ends_on_the_barrier_with_every_retained_message(mosquitto_broker, federation):
    _retain(mosquitto_broker.endpoint, federation, extra=200)
    obs = Observer(mosquitto_broker.endpoint, federation)
    time.sleep(0.6)  # constructed long before it connects
    obs.start()
    try:
        t0 = time.monotonic()
        assert obs._synced.wait(5)  # the broker answered the barrier: every retained message is in already
        assert len(obs.snapshot()[0]) == 203
        assert obs.settle() is True
        assert time.monotonic() - t0 < 2.0
        statuses, presence = obs.snapshot()
        assert len(statuses) == 203 and sorted(presence) == list(NODES) and list(obs.runs) == ["r-settle"]
    finally:
        obs.stop()
