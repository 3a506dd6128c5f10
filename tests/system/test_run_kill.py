"""SIGKILL of a real always-on agent together with its run process (the agent leads its
process group; the switch kills the group) at exact points of its run's life
(``DFL_TEST_CRASH_AT=<state>:<before|after>``, no sleeps), then a restart without the
switch: the run ends recorded ``finished`` with its model deployed exactly once.

The points: right after the ledger says ``admitted``, ``training`` or ``deploying``, right after the ledger says ``trained`` (the final checkpoint saved, nothing
deployed), in the middle of the deployment (the new version's files written under
``models/.tmp-*``, not yet moved into place), right after the version is installed but
before the ledger says ``deployed``, and before the ledger says ``finished``.  ``tests/unit/test_run_crash.py`` covers every
state boundary in-process with the same run manager, ledger and deployment.

And a federation's member killed mid-run, back after the others finished the run: it adopts
the run's final model from a member that deployed it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto
from tests.system.test_agent_logs import _wait
from tests.system.test_store_agent import SHAPE, drop

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _ledger(state):
    from dfl_agent.runtime.service.ledger import read_entries

    return read_entries(state)


def _agent(path, log, crash_at=None):
    env = {k: v for k, v in os.environ.items() if k != "DFL_TEST_CRASH_AT"}
    if crash_at:
        env["DFL_TEST_CRASH_AT"] = crash_at
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


#: crash point -> (the state the ledger holds after the kill, versions installed by then)
POINTS = {"admitted:after": ("admitted", []), "training:after": ("training", []),
          "trained:after": ("trained", []), "deploying:after": ("deploying", []), "deploying:mid": ("deploying", []),
          "deployed:before": ("deploying", [1]), "recorded:before": ("deployed", [1])}


@needs_mosquitto
@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", list(POINTS))
def test_agent_killed_during_deployment_deploys_its_model_once_after_restart(tmp_path, at):
    from dfl_agent.deploy import ModelStore, verify_folder

    state = tmp_path / "state"
    with start_broker("mosquitto") as broker:
        cfg = config_from_dict({
            "federation": f"runkill{os.getpid()}", "node_id": "dev1", "state_dir": str(state),
            "algorithm": {"name": "local", "rounds": 1},
            "training": {"epochs": 1, "batch_size": 32, "threads": 1},
            "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.2},
            "model": {"size": "small"}, "deploy": {"onnx": False},
            "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 1.0},
            "discovery": {"mdns": False},
        })
        path = tmp_path / "node.toml"
        path.write_text(dump_toml(cfg))
        for k in range(3):
            drop(state / "spool", f"a{k}.npz", 60, k)
        log_path = tmp_path / "agent.log"
        log = open(log_path, "ab")
        proc = _agent(path, log, crash_at=at)
        assert proc.wait(180) == -signal.SIGKILL, log_path.read_text()[-3000:]  # killed at the point
        (run_id, entry), = _ledger(state).items()
        recorded, installed = POINTS[at]
        models = ModelStore(state)
        assert entry["state"] == recorded and models.versions() == installed
        if at == "deploying:mid":  # the version's files were being written, not yet in place
            assert list(models.root.glob(".tmp-*"))
        proc = _agent(path, log)
        try:
            deadline = time.time() + 180
            while _ledger(state)[run_id]["state"] != "finished" and time.time() < deadline:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                time.sleep(0.2)
            assert _ledger(state)[run_id]["state"] == "finished", log_path.read_text()[-3000:]
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log_path.read_text()[-3000:]
        assert models.versions() == [1] and models.current_version() == 1, log_path.read_text()[-3000:]
        assert verify_folder(models.folder(1))["run_id"] == run_id
        assert not list(models.root.glob(".tmp-*"))
        text = log_path.read_text()
        assert text.count("deployed model v") == 1 and "nothing to run" not in text
        if recorded in ("admitted", "training"):  # admitted again, trained again, deployed once
            assert "resumes from state" not in text and "run process" in text
        else:
            assert f"resumes from state {recorded}" in text


@needs_mosquitto
@pytest.mark.timeout(420)
def test_a_member_killed_mid_run_adopts_the_runs_final_model_once_the_others_finished(tmp_path):
    """Three always-on agents on their sample stores, signatures required (the run signed by
    an operator, every status signed), the default compression and ``quorum``.  s2 is
    SIGKILLed with its run process in round 3 or later of a fedavg run; s0 and s1 finish it
    without s2 and deploy.  Restarted after that, s2 restores its checkpoint, sees most of the
    run's members report it finished, trains no more round of it, and adopts the run's final
    model (round 30) from a member that deployed it, through its deploy gate: one version, of
    this run, recorded ``finished`` with ``model = adopted``.  Before, such a member ended with
    nothing deployed, and then with the model of its checkpoint (the round it had reached)."""
    import re

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dfl_agent.deploy import ModelStore, verify_folder
    from dfl_agent.runtime.shared.descriptor import operator_certificate
    from dfl_agent.security.keys import enroll_local, public_key_b64, save_certificate, save_private_key

    ids, fed, fed_key = ("s0", "s1", "s2"), f"killdeploy{os.getpid()}", Ed25519PrivateKey.generate()
    states = {n: tmp_path / n for n in ids}
    logs = {n: tmp_path / f"{n}.log" for n in ids}
    op, key = tmp_path / "operator", Ed25519PrivateKey.generate()
    op.mkdir()
    save_private_key(key, op / "operator_key.pem")
    save_certificate(operator_certificate(fed_key, fed, "alice", public_key_b64(key)), op / "operator_cert.json")
    procs: dict[str, subprocess.Popen] = {}

    def wait_until(cond, what, timeout):
        _wait(cond, timeout, list(logs.values()), what)

    def rounds(n, rid):
        from dfl_agent.runtime.service.retention import read_records

        return read_records(states[n] / "runs" / rid)  # gzipped once the run ended

    with start_broker("mosquitto") as broker:
        try:
            for j, n in enumerate(ids):
                enroll_local(fed_key, fed, n, states[n])
                text = dump_toml(config_from_dict({
                    "federation": fed, "node_id": n, "state_dir": str(states[n]),
                    "training": {"epochs": 1, "batch_size": 32, "threads": 1},
                    "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.2},
                    "model": {"size": "small"}, "deploy": {"tolerance": 1.0, "onnx": False},
                    "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 0.5},
                    "discovery": {"mdns": False, "min_peers": 2, "start_timeout": 60, "heartbeat_timeout": 3.0},
                    "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)},
                }))
                (tmp_path / f"{n}.toml").write_text(re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n)*", "", text + "\n"))
                for k in range(3):
                    drop(states[n] / "spool", f"a{k}.npz", 60, 10 * j + k)
                procs[n] = _agent(tmp_path / f"{n}.toml", open(logs[n], "ab"))
            wait_until(lambda: all(_samples(states[n]) == 180 for n in ids), "every store filled", 120)
            rid = subprocess.run(
                [sys.executable, "-m", "dfl_agent.cli.dflctl", "run", "submit", "--broker", broker.endpoint,
                 "--federation", fed, "--operator-dir", str(op), "--algorithm", "fedavg", "--rounds", "30",
                 "--model-size", "small", "--min-members", "3", "--option", "round_timeout=4",
                 "--training", "steps=40"], capture_output=True, text=True, check=True, timeout=60).stdout.strip()
            wait_until(lambda: len(rounds("s2", rid)) >= 3, "s2 in round 3", 180)
            os.killpg(procs["s2"].pid, signal.SIGKILL)  # the agent and its run process: a power cut
            procs["s2"].wait(30)
            assert _ledger(states["s2"])[rid]["state"] == "training"
            wait_until(lambda: all(_ledger(states[n]).get(rid, {}).get("state") == "finished" for n in ("s0", "s1")),
                       "s0 and s1 finish the run without s2", 240)
            reached = max(r["round"] for r in rounds("s2", rid))
            assert reached < 30
            procs["s2"] = _agent(tmp_path / "s2.toml", open(logs["s2"], "ab"))
            wait_until(lambda: _ledger(states["s2"]).get(rid, {}).get("state") == "finished", "s2 records it finished",
                       120)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    for n in ids:  # one version each, of this run
        models = ModelStore(states[n])
        assert models.versions() == [1] and verify_folder(models.folder(1))["run_id"] == rid, logs[n].read_text()[-3000:]
    text = logs["s2"].read_text()
    assert "most of the run's members report it finished" in text, text[-3000:]
    assert len(re.findall(rf"deployed model v1 \(run {rid}, round 30\)", text)) == 1, text[-3000:]
    man = verify_folder(ModelStore(states["s2"]).folder(1))
    assert man["round"] == 30 and man["adopted_from"]["node"] in ("s0", "s1"), man  # the run's final model
    src = verify_folder(ModelStore(states[man["adopted_from"]["node"]]).folder(1))
    assert man["files"]["model.safetensors"]["sha256"] == src["files"]["model.safetensors"]["sha256"]
    entry = _ledger(states["s2"])[rid]
    assert (entry["model"], entry["adopted_from"], entry["version"]) == ("adopted", man["adopted_from"]["node"], 1)
    assert max(r["round"] for r in rounds("s2", rid)) == reached  # no round trained alone after its return


def _samples(state) -> int:
    """The samples in a device's store (0 before it exists)."""
    from dfl_agent.store.sqlite import SampleStore, StoreError

    try:
        store = SampleStore(state, create=False)
    except StoreError:
        return 0
    try:
        return len(store.load(store.snapshot())[0])
    finally:
        store.close()
