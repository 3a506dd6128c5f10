"""A deeply nested JSON value retained on the broker does not stop an always-on agent
(real mosquitto, a real ``dfl-agent run`` process, ``dflctl run submit`` as a subprocess).

The issue's value: 100,000 ``[`` and as many ``]`` (200 KB), retained on
``dfl/{fed}/node/x/status`` and on a run descriptor topic, published before the agent
starts (a retained value comes back on every restart).  ``json.loads`` raises
RecursionError on it, which used to end the agent's run listener thread: runs submitted
afterwards never started, while the status heartbeat went on.  Now every value is parsed
with a size and nesting-depth limit first: the 200 KB one is dropped as ``oversized``
(64 KiB per status or descriptor), a 60 KB one nested 30,000 deep as ``too_deep``, both
counted in the agent's status, and a run submitted afterwards starts and finishes.
``dflctl run list`` marks that (unsigned) run unverified, and hides it given trust material.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.service.retention import read_records
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.security.keys import public_key_b64
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration, needs_mosquitto]

DEEP_200K = b"[" * 100_000 + b"]" * 100_000  # over the 64 KiB limit of a status or descriptor
DEEP_60K = b"[" * 30_000 + b"]" * 30_000  # under it, nested far deeper than 32


def _retained(broker: str, topic: str, timeout: float = 5.0) -> bytes | None:
    """The retained message on ``topic``, read by a fresh client (nothing cached)."""
    from dfl_agent.cli.fleet import fetch_retained

    return fetch_retained(broker, topic, timeout=timeout, absent_after=1.0)


def _ledger(state: Path) -> dict:
    from dfl_agent.runtime.service.ledger import read_entries

    return read_entries(state)


def test_deep_retained_values_are_dropped_and_runs_still_start_and_finish(tmp_path):
    fed = "deep-" + str(int(time.time() * 1000) % 100000)
    state = tmp_path / "a0"
    with start_broker("mosquitto") as broker:
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
        pub.connect(broker.host, broker.port)
        pub.loop_start()
        for topic, value in ((f"dfl/{fed}/node/x/status", DEEP_200K), (f"dfl/{fed}/node/y/status", DEEP_60K),
                             (f"dfl/{fed}/run/r-deep", DEEP_200K), (f"dfl/{fed}/run/r-deep2", DEEP_60K)):
            pub.publish(topic, value, qos=1, retain=True).wait_for_publish(5)
        pub.loop_stop()
        pub.disconnect()

        cfg = config_from_dict({
            "federation": fed, "node_id": "a0", "state_dir": str(state),
            "data": {"dataset": "digits", "partition": "iid", "num_nodes": 1, "node_index": 0},
            "model": {"size": "small"}, "training": {"steps": 3},
            "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 0.5},
            "discovery": {"min_peers": 0, "mdns": False},
        })
        path = tmp_path / "a0.toml"  # no [algorithm]: no default run, the agent waits for runs
        path.write_text(re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n)*", "", dump_toml(cfg) + "\n"))
        log = tmp_path / "a0.log"
        proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT)
        try:
            def idle_status() -> dict:
                raw = _retained(broker.endpoint, f"dfl/{fed}/node/a0/status")
                st = json.loads(raw) if raw else {}
                return st.get("payload", st) if isinstance(st, dict) else {}

            deadline = time.monotonic() + 60
            while idle_status().get("state") != "idle":
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
            time.sleep(1.0)  # the retained values have reached the agent's lobby by now

            r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "run", "submit", "--broker",
                                broker.endpoint, "--federation", fed, "--algorithm", "fedavg", "--rounds", "1",
                                "--option", "round_timeout=10"], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            rid = r.stdout.strip().split()[-1]

            deadline = time.monotonic() + 45
            while _ledger(state).get(rid, {}).get("state") != "finished":
                assert proc.poll() is None, log.read_text()[-3000:]
                assert _ledger(state).get(rid, {}).get("state") in (  # not ended any other way
                    None, "admitted", "waiting_for_members", "training", "trained", "deploying", "deployed", "kept"), \
                    _ledger(state)
                assert time.monotonic() < deadline, (
                    f"run {rid} did not finish: ledger {_ledger(state)}, status {idle_status()}\n"
                    + log.read_text()[-3000:])
                time.sleep(0.3)
            assert read_records(state / "runs" / rid)  # it trained (its round records, gzipped once it ended)

            deadline = time.monotonic() + 10
            while ((st := idle_status()).get("state"), (st.get("run") or {}).get("state")) != ("idle", "finished") \
                    and time.monotonic() < deadline:  # the lobby's idle status after the run
                time.sleep(0.3)
            # both values dropped and counted under their own reason, in the agent's status
            assert st["control_dropped"] == {"status_oversized": 1, "status_too_deep": 1}, st
            assert st["runs_refused"] == {"oversized": 1, "too_deep": 1}, st
            assert proc.poll() is None  # still serving

            # dflctl run list: without trust material every entry is marked unverified (the deep
            # values are no run messages at all); with it, the unsigned run is hidden and counted
            def run_list(*args: str) -> tuple[dict, str]:
                r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "run", "list", "--json", *args],
                                   capture_output=True, text=True, timeout=60)
                assert r.returncode == 0, r.stderr
                return json.loads(r.stdout), r.stderr

            listed, _ = run_list("--broker", broker.endpoint, "--federation", fed)
            assert [(v["run_id"], v["trust"], v["verified"]) for v in listed["runs"]] == [(rid, "unverified", False)]
            trusted = tmp_path / "operator.toml"
            trusted.write_text(dump_toml(config_from_dict({
                "federation": fed, "mqtt": {"broker": broker.endpoint},
                "security": {"federation_key": public_key_b64(Ed25519PrivateKey.generate())}})))
            listed, err = run_list("--config", str(trusted))
            assert listed["runs"] == [] and listed["hidden"] == {"unsigned": 1}, listed
            assert "1 run descriptor(s) hidden" in err
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert "Traceback" not in log.read_text()
