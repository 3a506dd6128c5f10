"""Runs over a real mosquitto, in-process: a late booter picks up the retained run;
a run whose ``min_members`` never accept fails after ``start_timeout`` with that reason;
the idle node's status says so."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.fleet import publish_retained
from dfl_agent.cli.observer import Observer
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.lobby import RunLobby
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import (
    RunDescriptor,
    RunVerifier,
    operator_certificate,
    run_topic,
    sign_descriptor,
)
from dfl_agent.security.keys import public_key_b64

pytestmark = pytest.mark.integration


def _signed(fed, fed_key, **kw):
    op = Ed25519PrivateKey.generate()
    cert = operator_certificate(fed_key, fed, "alice", public_key_b64(op))
    d = RunDescriptor(federation=fed, algorithm="fedavg", rounds=2, submitted_at=time.time(), seq=1,
                      submitter="alice", **kw)
    return d, sign_descriptor(d, op, "alice", cert)


def test_late_booter_picks_up_the_retained_run(mosquitto_broker, federation, tmp_path):
    fed_key = Ed25519PrivateKey.generate()
    d, payload = _signed(federation, fed_key, run_id="r-late")
    publish_retained(mosquitto_broker.endpoint, run_topic(federation, d.run_id), payload)
    cfg = config_from_dict({"federation": federation, "mqtt": {"broker": mosquitto_broker.endpoint},
                            "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)}})
    lobby = RunLobby(cfg, "late", RunVerifier(federation, require_signatures=True,
                                              federation_key=public_key_b64(fed_key)))
    lobby.start()  # boots after the submission
    try:
        end = time.monotonic() + 20
        while lobby.run("r-late") is None and time.monotonic() < end:
            time.sleep(0.1)
        assert lobby.run("r-late") == d
        assert lobby.queue.next_runnable(lambda r: False).run_id == "r-late"
    finally:
        lobby.stop()


def test_run_fails_when_min_members_do_not_accept_within_start_timeout(mosquitto_broker, federation, tmp_path):
    from dfl_agent.runtime.service.daemon import serve

    fed_key = Ed25519PrivateKey.generate()
    d, payload = _signed(federation, fed_key, run_id="r-min", min_members=2, start_timeout=2.0)
    publish_retained(mosquitto_broker.endpoint, run_topic(federation, d.run_id), payload)
    cfg = config_from_dict({"federation": federation, "node_id": "solo", "state_dir": str(tmp_path),
                            "mqtt": {"broker": mosquitto_broker.endpoint, "heartbeat_interval": 0.5},
                            "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)}})

    async def main():
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve(cfg, None, stop))
        end = time.monotonic() + 30
        while not RunLedger(tmp_path).is_done("r-min") and time.monotonic() < end:  # admitted, waiting, failed
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.5)  # one more idle heartbeat
        stop.set()
        return await task

    assert asyncio.run(main()) == 0
    entry = RunLedger(tmp_path).entries["r-min"]
    assert entry["state"] == "failed"
    assert entry["reason"].startswith("start_timeout: only 1 of min_members 2 accepted")
    assert not (tmp_path / "runs" / "r-min" / "metrics.jsonl").exists()  # never trained
    obs = Observer(mosquitto_broker.endpoint, federation).start()
    obs.settle()
    st = obs.snapshot()[0]["solo"]
    obs.stop()
    assert st["state"] == "idle" and st["run"]["id"] == "r-min" and st["run"]["state"] == "failed"
    assert json.dumps(st)  # plain JSON


def test_prometheus_endpoint_answers_while_idle(mosquitto_broker, federation, tmp_path):
    """An always-on agent's /metrics answers between runs (not only while training): state
    idle, and a refused (unsigned) run descriptor counted by reason."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    from dfl_agent.cli.broker import free_port
    from dfl_agent.runtime.service.daemon import serve

    fed_key = Ed25519PrivateKey.generate()
    port = free_port()
    cfg = config_from_dict({"federation": federation, "node_id": "idler", "state_dir": str(tmp_path),
                            "mqtt": {"broker": mosquitto_broker.endpoint, "heartbeat_interval": 0.5},
                            "runtime": {"prometheus_port": port},
                            "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)}})
    unsigned = RunDescriptor(run_id="r-unsigned", federation=federation, algorithm="fedavg", rounds=1,
                             submitted_at=time.time(), seq=1)

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""

    async def main():
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve(cfg, None, stop))
        try:
            end = time.monotonic() + 30
            while "dfl_node_info" not in (text := await asyncio.to_thread(scrape)) and time.monotonic() < end:
                await asyncio.sleep(0.2)
            first = text
            await asyncio.to_thread(publish_retained, mosquitto_broker.endpoint, run_topic(federation, "r-unsigned"),
                                    sign_descriptor(unsigned, None))
            while 'dfl_runs_refused_total{reason="unsigned"} 1.0' not in text and time.monotonic() < end:
                await asyncio.sleep(0.2)
                text = await asyncio.to_thread(scrape)
            return first, text
        finally:
            stop.set()
            await task

    first, text = asyncio.run(main())
    assert 'state="idle"' in first and 'node="idler"' in first and "dfl_round 0.0" in first
    assert 'dfl_runs_refused_total{reason="unsigned"} 1.0' in text
    assert not RunLedger(tmp_path).entries  # nothing ran


def test_dflctl_submit_then_cancel_reaches_a_verifying_lobby(mosquitto_broker, federation, tmp_path):
    """``dflctl run submit`` and ``run cancel`` sign with the operator's key, certificate and
    persisted sequence numbers; a lobby that requires signatures takes the cancelled copy."""
    import subprocess
    import sys

    from dfl_agent.security.keys import save_certificate, save_private_key

    fed_key = Ed25519PrivateKey.generate()
    op = tmp_path / "alice"
    op.mkdir()
    key = Ed25519PrivateKey.generate()
    save_private_key(key, op / "operator_key.pem")
    save_certificate(operator_certificate(fed_key, federation, "alice", public_key_b64(key)), op / "operator_cert.json")
    b = ["--broker", mosquitto_broker.endpoint, "--federation", federation, "--operator-dir", str(op)]

    def dflctl(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "run", *args], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    rid = dflctl("submit", *b, "--algorithm", "fedavg", "--rounds", "3", "--models", "H1", "--training", "steps=7")
    assert json.loads((op / "operator_seq.json").read_text())  # persisted in the operator folder
    assert dflctl("cancel", rid, *b) == f"cancelled {rid}"
    cfg = config_from_dict({"federation": federation, "mqtt": {"broker": mosquitto_broker.endpoint},
                            "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)}})
    lobby = RunLobby(cfg, "n", RunVerifier(federation, require_signatures=True, federation_key=public_key_b64(fed_key)))
    lobby.start()
    try:
        end = time.monotonic() + 20
        while lobby.run(rid) is None and time.monotonic() < end:
            time.sleep(0.1)
        d = lobby.run(rid)
        assert d is not None and d.cancelled and d.seq == 2 and d.submitter == "alice"
        assert (d.model, d.training) == ({"family": "H1"}, {"steps": 7})
        assert not lobby.verifier.refused
    finally:
        lobby.stop()


@pytest.mark.slow
def test_default_run_recurs_after_k_new_samples_arrive(mosquitto_broker, federation, tmp_path):
    """``algorithm.every_samples``: an always-on node on its sample store trains its default
    run at boot, stays idle while fewer than K new samples arrived, and runs again once K
    arrived (the ledger keeps each run's snapshot; the second run's data is bigger)."""
    import numpy as np

    from dfl_agent.runtime.service.daemon import serve

    cfg = config_from_dict({
        "federation": federation, "node_id": "solo", "state_dir": str(tmp_path / "state"),
        "data": {"dataset": "store", "input_shape": [16], "num_classes": 2, "spool_interval": 0.5,
                 "validation_share": 0.25},
        "algorithm": {"name": "fedavg", "rounds": 1, "every_samples": 30},
        "model": {"size": "small"}, "training": {"steps": 2},
        "mqtt": {"broker": mosquitto_broker.endpoint, "heartbeat_interval": 0.5},
        "discovery": {"mdns": False}, "deploy": {"enabled": False},
    })
    spool = tmp_path / "state" / "spool"

    def drop(name: str, n: int) -> None:
        rng = np.random.default_rng([len(name), n])
        spool.mkdir(parents=True, exist_ok=True)
        np.savez(tmp_path / name, x=rng.normal(size=(n, 16)).astype(np.float32), y=rng.integers(0, 2, n))
        (tmp_path / name).rename(spool / name)  # whole files only

    def finished() -> list[dict]:
        e = RunLedger(tmp_path / "state").entries
        return [e[k] for k in sorted(e) if e[k]["state"] == "finished"]

    async def main():
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve(cfg, None, stop))
        try:
            drop("a.npz", 40)
            end = time.monotonic() + 240
            while len(finished()) < 1 and time.monotonic() < end and not task.done():
                await asyncio.sleep(0.2)
            drop("b.npz", 29)  # fewer than K new samples: no repeat
            await asyncio.sleep(4.0)  # several spool passes
            idle = len(finished())
            drop("c.npz", 1)  # the 30th new sample
            while len(finished()) < 2 and time.monotonic() < end and not task.done():
                await asyncio.sleep(0.2)
            return idle
        finally:
            stop.set()
            await task

    idle_runs = asyncio.run(main())
    assert idle_runs == 1
    entries = RunLedger(tmp_path / "state").entries
    ids = sorted(entries)
    assert [i.rsplit(".", 1)[1] for i in ids] == ["s0", "s1"] and ids[0][:-3] == ids[1][:-3]
    first, second = (entries[i] for i in ids)
    assert first["state"] == second["state"] == "finished"
    assert second["snapshot_last_id"] - first["snapshot_last_id"] == 30  # the new samples it trained on


def test_a_stop_leaves_cleanly_and_never_publishes_the_last_will(mosquitto_broker, federation, tmp_path):
    """Twenty stops right after the "offline: stopping" presence: a subscriber to the node's
    presence sees that presence every time and never the node's last will (paho's loop_stop
    does not flush its queue: a stop could close the socket with no DISCONNECT, and the broker
    then published the will after the goodbye, a crash to the node's peers)."""
    import paho.mqtt.client as mqtt

    from dfl_agent.transport.endpoint import parse_endpoint
    from dfl_agent.transport.mqtt import topic

    cfg = config_from_dict({"federation": federation, "mqtt": {"broker": mosquitto_broker.endpoint},
                            "state_dir": str(tmp_path)})
    seen: list[dict] = []
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    sub.on_message = lambda c, u, m: seen.append(json.loads(m.payload)) if m.payload else None
    sub.connect(*parse_endpoint(mosquitto_broker.endpoint))
    sub.subscribe(topic(federation, "leaver", "presence"), qos=1)
    sub.loop_start()
    try:
        for _ in range(20):
            lobby = RunLobby(cfg, "leaver", RunVerifier(federation, require_signatures=False))
            lobby.start()
            assert lobby.connected.wait(10)
            lobby.publish_presence(None, "stopping")
            lobby.stop()
        time.sleep(1.5)  # a will would follow the socket's close at once
    finally:
        sub.loop_stop()
        sub.disconnect()
    from dfl_agent.security.trust import WILL_REASON

    reasons = [d.get("reason") for d in seen if d.get("state") == "offline"]
    assert reasons.count("stopping") == 20 and WILL_REASON not in reasons, reasons
