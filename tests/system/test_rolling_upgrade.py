"""A held-out check of a rolling upgrade: release 0.1.0 (commit 75535c2, tag ``v0.1.0``) and this
release in one federation, then this release on the state folder 0.1.0 left.

Both releases run from their wheels (:mod:`tests.releases`: built from ``git archive`` of
0.1.0's commit and of this checkout's ``HEAD``, installed into a folder on ``PYTHONPATH``), on
this test's dependencies.  Three agents
on one mosquitto, signatures required (device certificates of one federation key), the default
compression (``auto``: CHOCO-coded q4+zstd differences for the averaging gossip), chunked frames
(``mqtt.chunk_size`` 1 KiB: every model update in 2 to 3 chunks), real mDNS on 127.0.0.1, each on its own sample store:

* ``old1``: 0.1.0's ``dfl-agent run --once``, which trained in-process at 0.1.0;
* ``old2``: 0.1.0's always-on agent, which trains in a run process;
* ``new``: this release's ``dfl-agent run --once`` (a supervisor and a run process).

They share their default run (the same ``[algorithm]``: the same run id in both releases).  The
run must finish on all three, every round of each with its peers' updates (none closed alone, no
frame dropped), and ``old2`` must deploy its model.  Then ``old2`` is upgraded in place: this
release's always-on agent starts on its state folder, migrates it (schema 1 -> 2) and serves the
same node: its id, its keys (the status verifies with the key 0.1.0 made), its deployed model and
its run history (the finished run is not trained again).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.shared.state_version import STATE_FILE, STATE_VERSION
from dfl_agent.security.keys import enroll_local, public_key_b64
from tests.releases import CHECK_ORIGIN, RELEASE_0_1_0, ReleaseUnavailable, install_release, release_env
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]
ROUNDS = 3
SHAPE = (3, 16)
OLD_DAEMON = "dfl_agent.runtime.daemon"  # 0.1.0's module (now dfl_agent.runtime.service.daemon)
NEW_DAEMON = "dfl_agent.runtime.service.daemon"


def _windows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A learnable toy task: the label is the channel and half with the largest mean."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.normal(size=(n, *SHAPE)).astype(np.float32)
    for i, c in enumerate(y):
        x[i, c % 3, (c // 3) * 8:(c // 3) * 8 + 8] += 2.0
    return x, y


def _config(path: Path, fed: str, node: str, state: Path, broker: str, fed_key: str) -> Path:
    """A configuration both releases read: only keys 0.1.0 knows (an unknown key is exit 2 there)."""
    doc = {
        "federation": fed, "node_id": node, "state_dir": str(state),
        "algorithm": {"name": "fedavg", "rounds": ROUNDS, "options": {"round_timeout": 20.0}},
        "training": {"epochs": 1, "batch_size": 32, "threads": 1},
        "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.5},
        "model": {"size": "small"},
        "deploy": {"tolerance": 1.0, "onnx": False},
        "mqtt": {"broker": broker, "heartbeat_interval": 1.0, "chunk_size": 1024},
        "discovery": {"interfaces": ["127.0.0.1"], "min_peers": 2, "start_timeout": 60.0},
        "security": {"require_signatures": True, "federation_key": fed_key},
    }
    path.write_text(tomli_w.dumps(doc))
    return path


class _Statuses:
    """The newest status document of every node of ``fed`` (the payload of its signed envelope)."""

    def __init__(self, broker: str, fed: str):
        import paho.mqtt.client as mqtt

        self.latest: dict[str, dict[str, Any]] = {}
        self.raw: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_message = self._on
        host, port = broker.rsplit(":", 1)
        self.client.connect(host, int(port))
        self.client.subscribe(f"dfl/{fed}/node/+/status", qos=1)
        self.client.loop_start()

    def _on(self, client: Any, userdata: Any, msg: Any) -> None:
        try:
            doc = json.loads(msg.payload)
        except ValueError:
            return
        doc = doc.get("payload") if isinstance(doc, dict) and "ctl" in doc else doc
        if isinstance(doc, dict):
            with self.lock:
                self.latest[msg.topic.split("/")[-2]] = doc
                self.raw[msg.topic.split("/")[-2]] = bytes(msg.payload)

    def wait(self, node: str, pred: Any, timeout: float, why: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                doc = self.latest.get(node)
            if doc is not None and pred(doc):
                return doc
            time.sleep(0.2)
        raise AssertionError(f"{node}: {why} within {timeout} s; its last status: {self.latest.get(node)}")

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def _records(state: Path) -> list[dict[str, Any]]:
    """The round records of the node's run (``runs/<run id>/metrics.jsonl``, else ``metrics.jsonl``)."""
    files = sorted(state.glob("runs/*/metrics.jsonl")) or [state / "metrics.jsonl"]
    return [json.loads(line) for f in files if f.exists() for line in f.read_text().splitlines() if line.strip()]


@needs_mosquitto
def test_release_0_1_0_and_this_release_federate_and_the_old_state_folder_migrates(tmp_path: Path) -> None:
    try:
        site = install_release(RELEASE_0_1_0, tmp_path / "v0.1.0")
        new_site = install_release("HEAD", tmp_path / "this")
    except ReleaseUnavailable as exc:
        pytest.fail(str(exc))
    old_env, new_env = release_env(site), release_env(new_site)
    for where, env in ((site, old_env), (new_site, new_env)):
        assert subprocess.run([sys.executable, "-c", CHECK_ORIGIN, str(where)], env=env).returncode == 0
    version = subprocess.run([sys.executable, "-m", OLD_DAEMON, "--version"], env=old_env, capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version == "dfl-agent 0.1.0 (wire v5)", version
    fed = f"roll{int(time.time() * 1000) % 10**8}"
    fed_key = Ed25519PrivateKey.generate()
    nodes = ("old1", "old2", "new")
    states = {n: tmp_path / n for n in nodes}
    for i, n in enumerate(nodes):
        enroll_local(fed_key, fed, n, states[n])
        x, y = _windows(150, i)
        (states[n] / "spool").mkdir(parents=True)
        np.savez(states[n] / "spool" / "w0.npz", x=x, y=y, t=np.full(len(y), time.time()))
    old2_key = (states["old2"] / "node_key.pem").read_bytes()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {n: tmp_path / f"{n}.log" for n in (*nodes, "upgraded")}
    with start_broker("mosquitto") as broker:
        watch = _Statuses(broker.endpoint, fed)
        try:
            cfgs = {n: _config(tmp_path / f"{n}.toml", fed, n, states[n], broker.endpoint,
                               public_key_b64(fed_key)) for n in nodes}
            runs = {"old1": (OLD_DAEMON, ["--once"], old_env), "old2": (OLD_DAEMON, [], old_env),
                    "new": (NEW_DAEMON, ["--once"], new_env)}
            for n, (module, once, env) in runs.items():
                with open(logs[n], "wb") as out:
                    procs[n] = subprocess.Popen([sys.executable, "-m", module, "run", "--config", str(cfgs[n]), *once],
                                                stdout=out, stderr=subprocess.STDOUT, env=env)
            for n in ("old1", "new"):
                assert procs[n].wait(timeout=150) == 0, f"{n}:\n{_tail(logs[n])}"
            idle = watch.wait("old2", lambda s: s.get("state") == "idle" and any(
                h.get("state") == "finished" for h in (s.get("run_history") or {}).values()), 60,
                "no finished run in the idle status")
            run_id = next(k for k, h in idle["run_history"].items() if h.get("state") == "finished")
            procs["old2"].send_signal(signal.SIGTERM)
            assert procs["old2"].wait(timeout=60) == 0, _tail(logs["old2"])
            # every member trained every round with its peers' updates, across the two releases
            for n in nodes:
                recs = [r for r in _records(states[n]) if r.get("node") == n and isinstance(r.get("round"), int)
                        and r["round"] >= 1]
                assert sorted({r["round"] for r in recs}) == list(range(1, ROUNDS + 1)), (n, recs)
                assert not any(r.get("alone") for r in recs), (n, [r.get("alone") for r in recs])
                assert max(r.get("live_peers", 0) for r in recs) == 2, (n, [r.get("live_peers") for r in recs])
                assert sum(r.get("dropped", 0) for r in recs) == 0, (n, _tail(logs[n]))
                # the peers' updates it used: of both others, so of both releases
                used = {p for r in recs for p in r.get("neighbour_ids") or [] if p not in (r.get("missing") or [])}
                assert used == set(nodes) - {n}, (n, used)
                # the default compression: CHOCO-coded q4+zstd differences (float32 would be a ratio of 1)
                assert min(r.get("compression_ratio", 1.0) for r in recs) > 3, (n, recs)
            ledger = json.loads((states["old2"] / "runs" / "ledger.json").read_text())
            assert ledger[run_id]["state"] == "finished"
            deployed = (states["old2"] / "models" / "current").resolve().name
            assert deployed == "v1", deployed
            assert not (states["old2"] / STATE_FILE).exists()  # 0.1.0 knows no schema version

            # -- the upgrade: this release's always-on agent on 0.1.0's state folder ----------------
            before = {p.relative_to(states["old2"]).as_posix() for p in states["old2"].rglob("*")}
            old_ledger = (states["old2"] / "runs" / "ledger.json").read_bytes()
            with open(logs["upgraded"], "wb") as out:
                procs["upgraded"] = subprocess.Popen([sys.executable, "-m", NEW_DAEMON, "run", "--config",
                                                      str(cfgs["old2"])], stdout=out, stderr=subprocess.STDOUT,
                                                     env=new_env)
            st = watch.wait("old2", lambda s: s.get("agent_version") == "0.2.0" and s.get("state") == "idle", 60,
                            "this release's idle status")
            procs["upgraded"].send_signal(signal.SIGTERM)
            assert procs["upgraded"].wait(timeout=60) == 0, _tail(logs["upgraded"])
            raw = watch.raw["old2"]
        finally:
            watch.stop()
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    # nothing lost: the node id, its keys, its deployed model, its run history
    assert st["node_id"] == "old2" and st["run_history"][run_id]["state"] == "finished", st
    assert st["wires"] == [5]
    from dfl_agent.security import SecurityGuard, TrustStore
    from dfl_agent.security.keys import load_private_key

    key = load_private_key(states["old2"] / "node_key.pem")
    assert (states["old2"] / "node_key.pem").read_bytes() == old2_key
    verifier = SecurityGuard("observer", None, TrustStore(fed, {"old2": public_key_b64(key)}), require_signatures=True)
    assert verifier.verify_control(raw, "status", "old2")[0] == "old2"  # signed with the key 0.1.0 made
    assert (states["old2"] / "models" / "current").resolve().name == "v1"
    from dfl_agent.runtime.service.ledger import read_entries

    assert read_entries(states["old2"])[run_id]["state"] == "finished"  # taken over into runs/ledger.sqlite
    doc = json.loads((states["old2"] / STATE_FILE).read_text())
    assert doc["schema"] == STATE_VERSION and [(m["from"], m["to"]) for m in doc["migrations"]] == [(1, 2)]
    assert (states["old2"] / doc["migrations"][0]["backup"] / "runs" / "ledger.json").read_bytes() == old_ledger
    after = {p.relative_to(states["old2"]).as_posix() for p in states["old2"].rglob("*")}
    # gone: what the spool and the store ingested, the ended run's resumption files (settled), and
    # 0.1.0's ledger files (kept as runs/*.json.migrated and in state-backup/)
    settled = ("checkpoints", "run.toml", "members.json", "start.json", "metrics.jsonl")  # this one gzipped
    assert not {p for p in before - after if not p.startswith(("spool", "checkpoints"))
                and p not in ("runs/ledger.json", "runs/cancelled.json")
                and not (p.startswith("runs/") and any(part in settled for part in p.split("/")))}, before - after
    log = _tail(logs["upgraded"])
    assert "schema 1 -> 2" in log and "Traceback" not in log, log
    shutil.rmtree(tmp_path / "v0.1.0", ignore_errors=True)
