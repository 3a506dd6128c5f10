"""A real always-on agent restarted: what it must remember across the restart - the store's
seed file taken once, and its refusal counters."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _wait(cond, timeout, proc, log, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{log.read_text()[-3000:]}")


def _data_status(state):
    r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "data", "status", "--state-dir", str(state),
                        "--json"], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(r.stdout)


@needs_mosquitto
def test_a_restarted_agent_keeps_its_seed_once_and_its_counters(tmp_path):
    """An always-on agent on the sample store with a seed file of 400 samples under
    ``data.path``: the store holds them once the agent serves (it does not wait on an empty
    store), and still 400 after a restart.  A run descriptor it refused before the restart
    is still counted in the status of the restarted agent."""
    import paho.mqtt.client as mqtt

    from dfl_agent.cli.observer import Observer

    rng = np.random.default_rng(0)
    (tmp_path / "seed").mkdir()
    buf = io.BytesIO()
    np.savez(buf, x=rng.normal(size=(400, 3, 16)).astype(np.float32), y=rng.integers(0, 4, 400))
    (tmp_path / "seed" / "train.npz").write_bytes(buf.getvalue())
    state = tmp_path / "state"
    fed = f"restart{os.getpid()}"
    with start_broker("mosquitto") as broker:
        obs = Observer(broker.endpoint, fed).start()
        cfg = config_from_dict({
            "federation": fed, "node_id": "dev1", "state_dir": str(state),
            "data": {"dataset": "store", "input_shape": [3, 16], "num_classes": 4, "path": str(tmp_path / "seed"),
                     "spool_interval": 0.3},
            "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 0.5},
            "discovery": {"mdns": False},
        })
        path = tmp_path / "node.toml"
        text = dump_toml(cfg)  # without [algorithm]: no default run, the agent waits for runs
        path.write_text(re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n|\n)*", "", text))
        logs = []
        for start in range(2):
            started = time.time()
            log = tmp_path / f"agent{start}.log"
            logs.append(log)
            proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                                    stdout=open(log, "w"), stderr=subprocess.STDOUT)
            try:
                _wait(lambda: "waiting for runs" in log.read_text(), 60, proc, log, "the agent to serve")
                st = _data_status(state)
                assert st["samples"] == 400 and st["ingested_files"] == 1, st
                assert st["seed"]["name"] == "train.npz" and st["seed"]["samples"] == 400
                if start == 0:  # a malformed run descriptor, not retained: refused once, before the restart
                    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
                    host, port = broker.endpoint.rsplit(":", 1)
                    pub.connect(host, int(port))
                    pub.loop_start()
                    pub.publish(f"dfl/{fed}/run/r-bad", b"{not json", qos=1).wait_for_publish(10)
                    pub.disconnect()
                    pub.loop_stop()

                def counted() -> bool:
                    now = obs.snapshot()[0].get("dev1", {})
                    return now.get("time", 0) > started and now.get("runs_refused") == {"malformed": 1}

                _wait(counted, 30, proc, log, "the refused descriptor in the status")
            finally:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert "seeded the sample store with 400 samples" in logs[0].read_text()
        assert "seeded the sample store" not in logs[1].read_text()
        assert json.loads((state / "counters.json").read_text())["runs_refused"] == {"malformed": 1}
        obs.stop()
