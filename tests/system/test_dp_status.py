"""What leaves a device under differential privacy, on the wire: a real agent process on its
sample store, over a real mosquitto, trains a run under ``privacy.dp`` and deploys its model.
Every status it publishes while it trains carries no accuracy and no sample count, and its
retained model announcement no validation accuracy; the device keeps both on its disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto
from tests.system.test_store_agent import SHAPE, drop

pytestmark = [pytest.mark.slow, pytest.mark.integration]

pytest.importorskip("opacus")


def _leaks(doc, path=""):
    """Keys of ``doc`` (nested) that carry an accuracy or a sample count."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k.endswith("accuracy") or k in ("samples", "train_samples", "validation_samples", "sample_rate"):
                out.append(f"{path}{k}")
            out += _leaks(v, f"{path}{k}.")
    return out


@needs_mosquitto
def test_a_dp_device_publishes_no_accuracy_and_no_sample_count(tmp_path):
    import paho.mqtt.client as mqtt

    from dfl_agent.deploy import ModelStore

    state, fed = tmp_path / "state", f"dpst{os.getpid()}"
    with start_broker("mosquitto") as broker:
        cfg = config_from_dict({
            "federation": fed, "node_id": "dev1", "state_dir": str(state),
            "algorithm": {"name": "local", "rounds": 2},
            "training": {"epochs": 1, "batch_size": 32, "threads": 1},
            "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.5},
            "model": {"size": "small"}, "deploy": {"tolerance": 1.0},
            "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 0.5},
            "discovery": {"mdns": False},
            "privacy": {"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}},
        })
        path = tmp_path / "node.toml"
        path.write_text(dump_toml(cfg))
        for i in range(3):
            drop(state / "spool", f"a{i}.npz", 60, i)
        statuses: list[dict] = []
        announcements: list[dict] = []

        def on_message(_c, _u, msg):
            d = json.loads(msg.payload)
            if msg.topic.endswith("/status"):  # the signed control envelope: its document is the payload
                statuses.append(d["payload"] if isinstance(d, dict) and "ctl" in d else d)
            else:
                announcements.append(d)

        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        c.on_message = on_message
        host, port = broker.endpoint.rsplit(":", 1)
        c.connect(host, int(port))
        c.subscribe(f"dfl/{fed}/node/dev1/status", qos=1)
        c.subscribe(f"dfl/{fed}/node/dev1/model", qos=1)
        c.loop_start()
        try:
            with open(tmp_path / "run.log", "w") as out:
                rc = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config",
                                     str(path)], stdout=out, stderr=subprocess.STDOUT, timeout=240).returncode
            assert rc == 0, (tmp_path / "run.log").read_text()[-3000:]
            deadline = time.time() + 10
            while not announcements and time.time() < deadline:
                time.sleep(0.1)
        finally:
            c.loop_stop()
    training = [s for s in statuses if s.get("round")]
    assert training, statuses  # statuses of the rounds were seen...
    assert [k for s in statuses for k in _leaks(s)] == []  # ...and none carried an accuracy or a sample count
    assert announcements and announcements[-1]["version"] == 1 and announcements[-1]["accuracy"] is None
    manifest = ModelStore(state).manifest(1)
    assert manifest["accuracy"] > 0.3 and manifest["privacy"]  # kept on the device
