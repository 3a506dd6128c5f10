"""A device that missed the end of a run gets the run's model from a member that deployed it.

Three always-on agents on their sample stores in the production configuration: signatures
required (operator-signed runs, every status and frame signed), the default compression, a
mosquitto with TLS, per-device passwords and the shipped ACL.  p2 is SIGKILLed together with its
run process (a power cut) after its run process started and before round 1 of a fedavg run; p0
and p1 finish the run without it.  Restarted, p2 sees most of the run's members report it
finished and trains no more rounds of it:

* run A: p1 deployed its model: p2 asks p1, gets the version's files (a signed ``model.files``
  frame), evaluates them on its validation slice and deploys them through its gate: its ledger
  says ``model = adopted`` from p1 with p1's version and hash, and its current version's manifest
  names run A and p1;
* run B: p0 deploys nothing (``deploy.enabled = false``) and p1's gate kept the model it had:
  no member can provide the model, and p2 records run B ``missed``, naming each member's answer,
  keeps run A's version, and ``dflctl run show`` says ``missed``.

At 75535c2 p2 recorded both runs ``finished`` with nothing deployed (no version of run A), the
same as a device that deployed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto
from tests.system.test_agent_logs import _wait
from tests.system.test_production_combination import _tls_broker
from tests.system.test_run_kill import _ledger, _samples
from tests.system.test_store_agent import SHAPE, drop

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(240), needs_mosquitto]
IDS = ("p0", "p1", "p2")  # the names _tls_broker's ACL and passwords are made for
DFLCTL = [sys.executable, "-m", "dfl_agent.cli.dflctl"]
#: how each device deploys: p0 nothing, p1 its first model only (later ones: kept by its gate,
#: which wants more validation samples than it has once a model is deployed), p2 what its gate lets
DEPLOY = {"p0": {"enabled": False}, "p1": {"min_validation": 100000}, "p2": {"tolerance": 1.0}}


def _start(path: Path, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "DFL_TEST_CRASH_AT"}
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_a_device_back_after_its_run_ended_adopts_the_runs_model_or_records_it_missed(tmp_path):
    from dfl_agent.deploy import ModelStore, verify_folder
    from dfl_agent.runtime.service.retention import read_records
    from dfl_agent.runtime.shared.descriptor import operator_certificate
    from dfl_agent.security.keys import enroll_local, public_key_b64, save_certificate, save_private_key

    broker, port, passwords = _tls_broker(tmp_path, users=("operator",))
    fed, fed_key = f"missed{os.getpid()}", Ed25519PrivateKey.generate()
    op, key = tmp_path / "operator", Ed25519PrivateKey.generate()
    op.mkdir()
    save_private_key(key, op / "operator_key.pem")
    save_certificate(operator_certificate(fed_key, fed, "alice", public_key_b64(key)), op / "operator_cert.json")
    (tmp_path / "operator.pw").write_text(passwords["operator"] + "\n")
    states = {n: tmp_path / n for n in IDS}
    logs = {n: tmp_path / f"{n}.log" for n in IDS}
    paths = {n: tmp_path / f"{n}.toml" for n in IDS}
    b = ["--broker", f"127.0.0.1:{port}", "--federation", fed, "--cafile", str(tmp_path / "ca.crt"),
         "-u", "operator", "--password-file", str(tmp_path / "operator.pw")]
    procs: dict[str, subprocess.Popen] = {}

    def wait_until(cond, what, timeout=90):
        _wait(cond, timeout, list(logs.values()), what)

    def entry(n, rid):
        return _ledger(states[n]).get(rid, {})

    def submit() -> str:
        return subprocess.run([*DFLCTL, "run", "submit", *b, "--operator-dir", str(op), "--algorithm", "fedavg",
                               "--rounds", "2", "--model-size", "small", "--min-members", "3",
                               "--option", "round_timeout=4", "--training", "steps=5", "--no-wait"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()

    def power_cut_before_round_1(rid):
        """SIGKILL of p2's agent and run process once its run process started the run (its
        metrics file exists), before its first round record."""
        metrics = states["p2"] / "runs" / rid / "metrics.jsonl"
        wait_until(metrics.exists, f"p2's run process of {rid}", 90)
        os.killpg(procs["p2"].pid, signal.SIGKILL)
        procs["p2"].wait(30)
        assert metrics.read_text() == "", "p2 was killed after round 1"  # no round record: before round 1
        assert entry("p2", rid)["state"] == "training"
        wait_until(lambda: all(entry(n, rid).get("state") == "finished" for n in ("p0", "p1")),
                   f"p0 and p1 finish {rid} without p2")
        procs["p2"] = _start(paths["p2"], logs["p2"])
        wait_until(lambda: entry("p2", rid).get("state") in ("finished", "missed"), f"p2 records {rid}")
        assert read_records(metrics.parent) == [], "p2 trained rounds of the run alone after its return"

    try:
        for n in IDS:
            enroll_local(fed_key, fed, n, states[n])
            text = dump_toml(config_from_dict({
                "federation": fed, "node_id": n, "state_dir": str(states[n]),
                "training": {"epochs": 1, "batch_size": 32, "threads": 1},
                "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.2},
                "model": {"size": "small"}, "deploy": {"onnx": False, **DEPLOY[n]},
                "mqtt": {"broker": f"127.0.0.1:{port}", "tls_ca": str(tmp_path / "ca.crt"), "username": n,
                         "password": passwords[n], "heartbeat_interval": 0.5},
                "discovery": {"mdns": False, "min_peers": 1, "start_timeout": 20, "heartbeat_timeout": 3.0},
                "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)},
            }))  # no [compression]: the shipped default; no [algorithm]: no default run, operators' runs only
            paths[n].write_text(re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n)*", "", text + "\n"))
            for k in range(2):
                drop(states[n] / "spool", f"a{k}.npz", 60, 10 * IDS.index(n) + k)
            procs[n] = _start(paths[n], logs[n])
        wait_until(lambda: all(_samples(states[n]) == 120 for n in IDS), "every store filled")

        # -- run A: p1 deployed it; p2 adopts p1's model through its own gate
        rid_a = submit()
        power_cut_before_round_1(rid_a)
        e = entry("p2", rid_a)
        assert e["state"] == "finished" and e.get("model") == "adopted", (e, logs["p2"].read_text()[-4000:])
        p1_models = ModelStore(states["p1"])
        assert p1_models.versions() == [1] and p1_models.manifest(1)["run_id"] == rid_a
        assert (e["adopted_from"], e["adopted_version"]) == ("p1", 1)
        assert e["adopted_sha256"] == p1_models.manifest(1)["sha256"]
        models = ModelStore(states["p2"])
        man = verify_folder(models.folder(models.current_version()))  # its current version, hashes checked
        assert man["run_id"] == rid_a and man["adopted_from"]["node"] == "p1" and e["version"] == man["version"]
        assert man["files"]["model.safetensors"]["sha256"] == p1_models.manifest(1)["files"]["model.safetensors"][
            "sha256"]  # the very weights p1 deployed
        assert ModelStore(states["p0"]).versions() == []

        # -- run B: no member deployed it (p0: deployment off; p1: kept by its gate): missed
        rid_b = submit()
        power_cut_before_round_1(rid_b)
        assert entry("p1", rid_b).get("model") == "kept" and ModelStore(states["p1"]).versions() == [1]
        e = entry("p2", rid_b)
        assert e["state"] == "missed", (e, logs["p2"].read_text()[-4000:])
        assert "p0: deployment is off" in e["reason"] and "p1: its deploy gate kept" in e["reason"], e["reason"]
        assert models.versions() == [1] and models.manifest(models.current_version())["run_id"] == rid_a
        wait_until(lambda: (_show(b, rid_b)["nodes"].get("p2") or {}).get("state") == "missed",
                   "dflctl run show: p2 missed", 30)
        text = subprocess.run([*DFLCTL, "run", "show", *b, rid_a], capture_output=True, text=True, check=True,
                              timeout=60).stdout
        assert re.search(r"p2: finished round \d+  model v1 adopted from p1", text), text
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        broker.terminate()
        broker.wait(10)
    for n in IDS:
        assert "Traceback" not in logs[n].read_text(), logs[n].read_text()[-3000:]


def _show(b: list[str], rid: str) -> dict:
    p = subprocess.run([*DFLCTL, "run", "show", *b, rid, "--json"], capture_output=True, text=True, timeout=60)
    return json.loads(p.stdout) if p.returncode == 0 else {"nodes": {}}
