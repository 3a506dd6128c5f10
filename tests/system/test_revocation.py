"""Revoking a device of a live federation, on real agent processes: three always-on agents
on a TLS broker with per-device passwords and the shipped ACL, signatures required, the
shipped default compression.  The operator runs ``dflctl keys revoke p2`` while they train:

* within one status heartbeat the other two drop p2's frames (``revoked`` in their status
  errors) and leave it out of their live peers;
* ``dflctl peers`` (with a node's configuration: its trust material) shows p2 ``revoked``;
* p2, still connected with its credentials, cannot clear or replace the list (the shipped ACL
  lets only the operator account write it), and its model never reaches the others again:
  no round record of theirs after the revocation names it among the neighbours used.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import mosquitto_path
from dfl_agent.cli.fleet import FleetTarget, observer_guard
from dfl_agent.cli.observer import Observer
from dfl_agent.runtime.shared.config import load_config
from dfl_agent.security.keys import save_private_key
from tests.system.conftest import needs_mosquitto
from tests.system.test_production_combination import IDS, _tls_broker, start_agents, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(180)]
ROUNDS = 5000  # more than the test lets them train: it stops them mid-run
HEARTBEAT = 1.0  # mqtt.heartbeat_interval of the agents (s)


def _records(d: Path, nid: str) -> list[dict]:
    from dfl_agent.runtime.service.retention import read_records

    out = []
    for path in sorted((d / nid / "runs").glob("*/")):  # metrics.jsonl, gzipped once the run ended
        out += read_records(path)
    return [r for r in out if "neighbour_ids" in r]


def _dflctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", *args], capture_output=True, text=True,
                          timeout=60)


def _wait(pred, timeout: float, what: str, d: Path) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            logs = "\n".join(f"--- {n}\n" + (d / f"{n}.log").read_text()[-2500:] for n in IDS)
            pytest.fail(f"{what} did not happen within {timeout:.0f}s\n{logs}")
        time.sleep(0.1)
    return time.monotonic() - t0


@needs_mosquitto
def test_a_revoked_device_is_dropped_within_a_heartbeat_and_trains_with_nobody(tmp_path):
    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed")
    fed_key = Ed25519PrivateKey.generate()
    fed_dir = tmp_path / "federation"
    fed_dir.mkdir()
    save_private_key(fed_key, fed_dir / "federation_key.pem")
    broker, port, passwords = _tls_broker(tmp_path, users=("operator",))
    (tmp_path / "operator.pw").write_text(passwords["operator"] + "\n")
    procs: list[subprocess.Popen] = []
    obs = None
    try:
        fed = start_agents(procs, tmp_path, port, passwords, ROUNDS, lambda nid: {
            # small and fast: the digits data set, a small model, two steps a round
            "data": {"dataset": "digits", "num_nodes": len(IDS)}, "model": {"size": "small"},
            "training": {"steps": 10}, "mqtt": {"heartbeat_interval": HEARTBEAT}},
            fed_key=fed_key, once=False)
        cfg0 = load_config(tmp_path / "p0.toml")
        obs = Observer(FleetTarget(broker=f"127.0.0.1:{port}", federation=fed, username="operator",
                                   password=passwords["operator"], tls_ca=str(tmp_path / "ca.crt")))
        obs.guard = observer_guard(cfg0)
        obs.start()

        def used_p2(nid: str) -> bool:
            return any("p2" in r["neighbour_ids"] for r in _records(tmp_path, nid))

        # the federation trains with p2: its updates reach p0 and p1
        _wait(lambda: used_p2("p0") and used_p2("p1"), 120, "p2's model reaching p0 and p1", tmp_path)
        fed_args = ["--broker", f"127.0.0.1:{port}", "--federation", fed, "--cafile", str(tmp_path / "ca.crt")]
        r = _dflctl("keys", "revoke", "p2", "--reason", "stolen", "--dir", str(fed_dir), *fed_args,
                    "-u", "operator", "--password-file", str(tmp_path / "operator.pw"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "published revocation list 1 retained on" in r.stdout, r.stdout
        assert "remove p2's broker account" in r.stdout

        def status(nid: str) -> dict:
            return obs.snapshot()[0].get(nid) or {}

        def drops_p2(nid: str) -> bool:
            st = status(nid)
            return st.get("errors", {}).get("revoked", 0) > 0 and "p2" not in (st.get("live_peers") or ["p2"])

        took = _wait(lambda: drops_p2("p0") and drops_p2("p1"), 20, "p0 and p1 dropping p2's frames", tmp_path)
        rounds_then = {n: status(n).get("round", 0) for n in ("p0", "p1")}
        print(f"p0 and p1 dropped p2's frames {took:.1f}s after 'dflctl keys revoke' returned "
              f"(heartbeat {HEARTBEAT:g}s); rounds then {rounds_then}")
        # within one status heartbeat of the list, plus the statuses' own publication (and slack
        # for a loaded machine): not a timeout of membership (30 s)
        assert took < 4 * HEARTBEAT + 6, took
        for n in ("p0", "p1"):
            assert status(n).get("revocation_list") == 1 and status(n).get("revoked") == ["p2"], status(n)
        # dflctl peers with a node's configuration shows p2 revoked
        r = _dflctl("peers", "--json", "--config", str(tmp_path / "p0.toml"))
        assert r.returncode == 0, r.stderr
        peers = {row["node_id"]: row for row in json.loads(r.stdout)["peers"]}
        assert (peers["p2"]["trust"], peers["p2"]["state"], peers["p2"]["revoked"]) == ("revoked", "revoked",
                                                                                        "stolen"), peers["p2"]
        assert peers["p0"]["trust"] == peers["p1"]["trust"] == "device"
        # p2, still connected, cannot clear the list: the shipped ACL lets only the operator write it
        from dfl_agent.cli.fleet import PublishRefused, fetch_retained, publish_retained

        p2 = FleetTarget(broker=f"127.0.0.1:{port}", federation=fed, username="p2", password=passwords["p2"],
                         tls_ca=str(tmp_path / "ca.crt"))
        with pytest.raises(PublishRefused):
            publish_retained(p2, f"dfl/{fed}/revocations", b"", timeout=5)
        assert b'"number":1' in (fetch_retained(p2, f"dfl/{fed}/revocations") or b"")  # devices read it
        # p0 and p1 go on training together, three more rounds each, without p2
        _wait(lambda: all(status(n).get("round", 0) >= rounds_then[n] + 3 for n in ("p0", "p1")), 60,
              "three more rounds on p0 and p1", tmp_path)
    finally:
        if obs is not None:
            obs.stop()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                pass
        stop_all(procs, broker)
    for nid in ("p0", "p1"):
        records = sorted(_records(tmp_path, nid), key=lambda r: r["round"])
        # the round in progress when the list arrived may hold an update received before it
        after = [r for r in records if r["round"] > rounds_then[nid] + 1]
        assert len(after) >= 2, (nid, rounds_then[nid], [r["round"] for r in records])
        assert all("p2" not in r["neighbour_ids"] for r in after), [(r["round"], r["neighbour_ids"]) for r in after]
        assert any(r["neighbour_ids"] for r in after), after  # p0 and p1 still train with each other
        log = (tmp_path / f"{nid}.log").read_text()
        assert "revocation list 1 of federation" in log and "Traceback" not in log
