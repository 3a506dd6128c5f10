"""Warm start through the real always-on path: one ``dfl-agent run`` (supervisor, run
manager, a run process per run) on the sample store, a default run recurring every few
seconds on the same data.  Each run starts from the version the previous one deployed, so
learning accumulates: v2 differs from v1 (before warm start two runs on the same data
deployed bit-identical models) and its manifest and ledger entry say it started from v1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dfl_agent.runtime.service.retention import read_records
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration, needs_mosquitto]
SHAPE = (3, 16)


def _seed_data(path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 240)
    x = rng.normal(size=(240, *SHAPE)).astype(np.float32)
    for i, c in enumerate(y):
        x[i, c % 3, (c // 3) * 8:(c // 3) * 8 + 8] += 2.0
    path.mkdir(parents=True, exist_ok=True)
    np.savez(path / "train.npz", x=x, y=y)


def test_two_runs_on_the_same_data_accumulate_from_the_deployed_model(tmp_path):
    from dfl_agent.cli.broker import start_broker
    from dfl_agent.deploy import ModelStore, verify_folder
    from dfl_agent.runtime.service.ledger import RunLedger

    state = tmp_path / "state"
    _seed_data(tmp_path / "seed")
    with start_broker("mosquitto") as broker:
        cfg = config_from_dict({
            "federation": f"warm{os.getpid()}", "node_id": "dev1", "state_dir": str(state),
            "algorithm": {"name": "local", "rounds": 1, "every": "4s"},
            "training": {"epochs": 1, "batch_size": 32, "threads": 1},
            "data": {"dataset": "store", "path": str(tmp_path / "seed"), "input_shape": list(SHAPE),
                     "num_classes": 4},
            "model": {"size": "small"}, "deploy": {"tolerance": 1.0, "onnx": False},
            "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 1.0},
            "discovery": {"mdns": False},
        })
        path = tmp_path / "node.toml"
        path.write_text(dump_toml(cfg))
        log = tmp_path / "agent.log"
        proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT)
        models = ModelStore(state)
        try:
            deadline = time.monotonic() + 120
            while len(models.versions()) < 2 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.3)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        text = log.read_text()
        assert models.versions()[:2] == [1, 2], text[-3000:]
    m1, m2 = verify_folder(models.folder(1)), verify_folder(models.folder(2))
    assert m1["started_from"] is None and m2["started_from"] == 1, (m1, m2)
    assert m1["files"]["model.safetensors"]["sha256"] != m2["files"]["model.safetensors"]["sha256"]
    # the deploy gate still compares the candidate with the deployed version on the same slice
    assert m2["deployed_accuracy"] is not None and "vs deployed v1" in m2["note"], m2["note"]
    assert f"on the same {m2['validation_samples']} samples" in m2["note"]
    assert "warm start: the run starts from fresh weights: no model is deployed on this device yet" in text
    assert "warm start: the run starts from the deployed model v1 (the deployable model)" in text
    entries = RunLedger(state).entries
    second = entries[m2["run_id"]]
    assert second["state"] == "finished" and second["started_from"] == 1 and second["init"] == "deployed", second
    assert entries[m1["run_id"]]["started_from"] is None
    first_round = read_records(state / "runs" / m2["run_id"])[0]  # gzipped once the run ended
    assert first_round["started_from"] == 1 and first_round["init"] == "deployed"
    # its learning rates start at a tenth (training.warm_start_ramp); the fresh first run's do not
    assert first_round["lr_scale"] == 0.1, first_round
    # and its output layer was first fitted to the store (training.warm_start_probe)
    probe = first_round["linear_probe"]
    assert "skipped" not in probe and probe["loss_after"] < probe["loss_before"], probe
    assert f"warm start: fitted the output layer {probe['layer']} to {probe['samples']} windows" in text
    assert "lr_scale" not in read_records(state / "runs" / m1["run_id"])[0]
