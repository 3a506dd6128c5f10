"""A real agent on the sample store: two runs, samples arriving in between, one deployed
version per run, the signed retained announcement, and the data snapshot in its checkpoints."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]
SHAPE = (3, 16)


def windows(n, seed):
    """A learnable toy task: the label is the channel/half with the largest mean."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.normal(size=(n, *SHAPE)).astype(np.float32)
    for i, c in enumerate(y):
        x[i, c % 3, (c // 3) * 8:(c // 3) * 8 + 8] += 2.0
    return x, y


def drop(spool, name, n, seed):
    x, y = windows(n, seed)
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y, t=np.full(n, time.time()))
    spool.mkdir(parents=True, exist_ok=True)
    (spool / f".{name}.tmp").write_bytes(buf.getvalue())
    os.replace(spool / f".{name}.tmp", spool / name)


def run_agent(path, log):
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", "dfl_agent.runtime.daemon", "run", "--once", "--config", str(path)],
                              stdout=out, stderr=subprocess.STDOUT, timeout=240, check=False).returncode


@needs_mosquitto
def test_two_runs_on_a_growing_store_deploy_one_version_each(tmp_path):
    import paho.mqtt.client as mqtt

    from dfl_agent.cli.dflctl import main as dflctl
    from dfl_agent.deploy import ModelStore, verify_folder
    from dfl_agent.deploy.runtime import verify_announcement
    from dfl_agent.security.keys import load_private_key

    state = tmp_path / "state"
    fed = f"store{os.getpid()}"
    with start_broker("mosquitto") as broker:
        cfg = config_from_dict({
            "federation": fed, "node_id": "dev1", "state_dir": str(state),
            "algorithm": {"name": "local", "rounds": 2},
            "training": {"epochs": 2, "batch_size": 32, "threads": 1},
            "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.5},
            "model": {"size": "small"}, "deploy": {"tolerance": 1.0},
            "runtime": {"checkpoint": True},
            "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 1.0},
            "discovery": {"mdns": False},
        })
        path = tmp_path / "node.toml"
        path.write_text(dump_toml(cfg))
        for i in range(3):
            drop(state / "spool", f"a{i}.npz", 60, i)
        assert run_agent(path, tmp_path / "run1.log") == 0, (tmp_path / "run1.log").read_text()[-3000:]
        assert dflctl(["data", "status", "--state-dir", str(state), "--json"]) == 0
        # between the runs the application adds more windows (and a broken file)
        for i in range(3, 8):
            drop(state / "spool", f"b{i}.npz", 60, i)
        (state / "spool" / "broken.npz").write_bytes(b"PK\x03\x04 not really")
        # a new run (the finished run's checkpoint is not resumed; its snapshot is not reused)
        for p in (state / "checkpoints").iterdir():
            p.unlink()
        assert run_agent(path, tmp_path / "run2.log") == 0, (tmp_path / "run2.log").read_text()[-3000:]
        logs = [(tmp_path / f"run{k}.log").read_text() for k in (1, 2)]
        sizes = [int(log.split("run snapshot of ")[1].split()[0]) for log in logs]
        assert sizes == [180, 480], sizes  # the second run trains on more samples
        models = ModelStore(state)
        assert models.versions() == [1, 2] and models.current_version() == 2  # one version per run
        for v in (1, 2):
            m = verify_folder(models.folder(v))
            assert m["round"] == 2 and m["algorithm"] == "local" and m["accuracy"] > 0.5
        # the snapshot is saved with the run's checkpoint
        from dfl_agent.store.runtime import snapshot_from_checkpoint

        ids = snapshot_from_checkpoint(state)
        assert ids is not None and len(ids) == 480
        # the signed, retained announcement
        got = []
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        statuses = []
        def _doc(raw):  # a status travels in the signed control envelope; its document is the payload
            d = json.loads(raw)
            return d["payload"] if isinstance(d, dict) and "ctl" in d else d

        c.on_message = lambda cl, u, msg: (statuses if msg.topic.endswith("/status") else got).append(
            _doc(msg.payload) if msg.topic.endswith("/status") else json.loads(msg.payload))
        host, port = broker.endpoint.rsplit(":", 1)
        c.connect(host, int(port))
        c.subscribe(f"dfl/{fed}/node/dev1/model", qos=1)
        c.subscribe(f"dfl/{fed}/node/dev1/status", qos=1)
        c.loop_start()
        deadline = time.time() + 10
        while not (got and statuses) and time.time() < deadline:
            time.sleep(0.1)
        c.loop_stop()
        assert statuses and statuses[0]["global_accuracy_source"] == "local validation"  # no global test set
        assert got and got[0]["version"] == 2 and got[0]["sha256"] == models.manifest(2)["sha256"]
        assert verify_announcement(got[0], load_private_key(state / "node_key.pem").public_key())
    st = json.loads(subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "data", "status", "--state-dir",
                                    str(state), "--json"], capture_output=True, text=True, check=True).stdout)
    assert st["samples"] == 480 and st["rejected"] == 1 and st["ingested_files"] == 8


@needs_mosquitto
def test_always_on_agent_waits_for_data_then_runs_and_deploys(tmp_path):
    """``dfl-agent run`` (always on) with an empty store: the default run waits while the spool
    is ingested; once the application has added samples it runs and deploys."""
    import signal

    from dfl_agent.deploy import ModelStore, verify_folder

    state = tmp_path / "state"
    with start_broker("mosquitto") as broker:
        cfg = config_from_dict({
            "federation": f"wait{os.getpid()}", "node_id": "dev1", "state_dir": str(state),
            "algorithm": {"name": "local", "rounds": 1},
            "training": {"epochs": 1, "batch_size": 32, "threads": 1},
            "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.3},
            "model": {"size": "small"},
            "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 1.0},
            "discovery": {"mdns": False},
        })
        path = tmp_path / "node.toml"
        path.write_text(dump_toml(cfg))
        log = tmp_path / "agent.log"
        proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.daemon", "run", "--config", str(path)],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 90
            while "waits: the sample store holds 0 samples" not in log.read_text() and time.time() < deadline:
                assert proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
            assert not (state / "models").exists()
            for k in range(3):
                drop(state / "spool", f"a{k}.npz", 60, k)
            models = ModelStore(state)
            deadline = time.time() + 180
            while models.current_version() is None and time.time() < deadline:
                assert proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.3)
            assert models.current_version() == 1, log.read_text()[-3000:]
            assert verify_folder(models.folder(1))["validation_samples"] > 0
            assert "run snapshot of 180 samples" in log.read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()[-3000:]
