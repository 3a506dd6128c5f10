"""A crashed device shows as offline: always-on agents in the production configuration
(signatures required, TLS with per-device passwords and the shipped ACL) on a real mosquitto;
one agent's process is SIGKILLed.  Its last will, signed when its connection opened, is what the
broker publishes: ``dflctl peers`` shows ``offline (last will)`` with the device's verified
trust, and ``dflctl status`` shows ``offline`` instead of the last status it retained.  Started
again, it shows as its status says (the will of its earlier connection is stale)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import mosquitto_path
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.security.keys import enroll_local, public_key_b64
from tests.system.conftest import needs_mosquitto
from tests.system.test_production_combination import _tls_broker
from tests.system.test_store_agent import SHAPE

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(180), needs_mosquitto]
DFLCTL = [sys.executable, "-m", "dfl_agent.cli.dflctl"]


def _configs(d: Path, port: int, passwords: dict[str, str], ids: tuple[str, ...]) -> dict[str, Path]:
    """One always-on agent per id (no [algorithm]: it waits for runs), signatures required, TLS."""
    fed = f"crash{os.getpid()}"
    fed_key = Ed25519PrivateKey.generate()
    paths = {}
    for nid in ids:
        enroll_local(fed_key, fed, nid, d / nid)
        cfg = config_from_dict({
            "federation": fed, "node_id": nid, "state_dir": str(d / nid),
            "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4},
            "model": {"size": "small"}, "deploy": {"onnx": False},
            "mqtt": {"broker": f"127.0.0.1:{port}", "tls_ca": str(d / "ca.crt"), "username": nid,
                     "password": passwords[nid], "heartbeat_interval": 1.0},
            "discovery": {"mdns": False},
            "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)},
        })
        text = re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n|\n)*", "", dump_toml(cfg))  # no default run
        paths[nid] = d / f"{nid}.toml"
        paths[nid].write_text(text)
    return paths


def _start(path: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _dflctl(*args: str) -> str:
    p = subprocess.run([*DFLCTL, *args], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "250"})
    assert p.returncode == 0, p.stderr
    return p.stdout


def _peers(config: Path) -> dict[str, dict]:
    return {r["node_id"]: r for r in json.loads(_dflctl("peers", "--config", str(config), "--json"))["peers"]}


def _status_states(config: Path) -> dict[str, str]:
    """Each node's ``state`` cell in ``dflctl status`` (the table a user reads)."""
    rows = {}
    for line in _dflctl("status", "--config", str(config)).splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if len(cells) > 1 and cells[0] in ("p0", "p1"):
            rows[cells[0]] = cells[1]
    return rows


def _observer(config: Path):
    """An in-process observer of the federation (what ``dflctl`` reads), for the waits."""
    import argparse

    from dfl_agent.cli.fleet import target, trust_guard
    from dfl_agent.cli.observer import Observer

    obs = Observer(target(argparse.Namespace(config=str(config))))
    obs.guard = trust_guard(obs.target)
    return obs.start()


def _wait(pred, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_sigkilled_always_on_agent_shows_offline_by_its_signed_last_will(tmp_path):
    """At 75535c2: ``peers`` showed the killed device ``untrusted: unsigned`` (its will was
    bare JSON) and ``status`` its last retained state (``idle``) as if it were running."""
    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed")
    broker, port, passwords = _tls_broker(tmp_path)
    ids = ("p0", "p1")
    paths = _configs(tmp_path, port, passwords, ids)
    logs = {nid: tmp_path / f"{nid}.log" for nid in ids}
    procs = {nid: _start(paths[nid], logs[nid]) for nid in ids}
    obs = None
    try:
        obs = _observer(paths["p0"])
        _wait(lambda: all(obs.snapshot()[0].get(n, {}).get("state") == "idle" for n in ids), "both agents idle")
        before = obs.snapshot()[0]["p1"]
        os.killpg(procs["p1"].pid, signal.SIGKILL)  # the supervisor (and anything it started)
        procs["p1"].wait(10)
        _wait(lambda: obs.snapshot()[1].get("p1", {}).get("state") == "offline", "p1's last will")
        rows = _peers(paths["p0"])
        assert rows["p1"]["state"] == "offline (last will)", rows["p1"]
        assert rows["p1"]["trust"] == "device" and rows["p1"]["verified"], rows["p1"]  # its signature verified
        assert rows["p0"]["state"] == "idle" and rows["p0"]["trust"] == "device", rows["p0"]
        assert _status_states(paths["p0"]) == {"p0": "idle", "p1": "offline (last will)"}
        # started again: its new connection's statuses make the old connection's will stale
        procs["p1"] = _start(paths["p1"], logs["p1"])
        _wait(lambda: obs.snapshot()[0]["p1"].get("time", 0) > before["time"] + 1, "p1's statuses again")
        assert _status_states(paths["p0"]) == {"p0": "idle", "p1": "idle"}
    finally:
        if obs is not None:
            obs.stop()
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        broker.terminate()
        broker.wait(10)
