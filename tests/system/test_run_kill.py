"""SIGKILL of a real always-on agent together with its run process (the agent leads its
process group; the switch kills the group) at exact points of its run's life
(``DFL_TEST_CRASH_AT=<state>:<before|after>``, no sleeps), then a restart without the
switch: the run ends recorded ``finished`` with its model deployed exactly once.

The points: right after the ledger says ``admitted``, ``training`` or ``deploying``, right after the ledger says ``trained`` (the final checkpoint saved, nothing
deployed), in the middle of the deployment (the new version's files written under
``models/.tmp-*``, not yet moved into place), right after the version is installed but
before the ledger says ``deployed``, and before the ledger says ``finished``.  ``tests/unit/test_run_crash.py`` covers every
state boundary in-process with the same run manager, ledger and deployment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto
from tests.system.test_store_agent import SHAPE, drop

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _ledger(state):
    try:
        return json.loads((state / "runs" / "ledger.json").read_text())
    except (OSError, ValueError):
        return {}


def _agent(path, log, crash_at=None):
    env = {k: v for k, v in os.environ.items() if k != "DFL_TEST_CRASH_AT"}
    if crash_at:
        env["DFL_TEST_CRASH_AT"] = crash_at
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.daemon", "run", "--config", str(path)],
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
