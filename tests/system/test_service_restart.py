"""A real always-on agent restarted: what it must remember across the restart - the store's
seed file taken once, and its refusal and drop counters."""

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
from dfl_agent.runtime.config import config_from_dict, dump_toml
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
def test_a_restarted_agent_keeps_its_seed_once(tmp_path):
    """An always-on agent on the sample store with a seed file of 400 samples under
    ``data.path``: the store holds them once the agent serves (it does not wait on an empty
    store), and still 400 after a restart."""
    rng = np.random.default_rng(0)
    (tmp_path / "seed").mkdir()
    buf = io.BytesIO()
    np.savez(buf, x=rng.normal(size=(400, 3, 16)).astype(np.float32), y=rng.integers(0, 4, 400))
    (tmp_path / "seed" / "train.npz").write_bytes(buf.getvalue())
    state = tmp_path / "state"
    with start_broker("mosquitto") as broker:
        cfg = config_from_dict({
            "federation": f"restart{os.getpid()}", "node_id": "dev1", "state_dir": str(state),
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
            log = tmp_path / f"agent{start}.log"
            logs.append(log)
            proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.daemon", "run", "--config", str(path)],
                                    stdout=open(log, "w"), stderr=subprocess.STDOUT)
            try:
                _wait(lambda: "waiting for runs" in log.read_text(), 60, proc, log, "the agent to serve")
                st = _data_status(state)
                assert st["samples"] == 400 and st["ingested_files"] == 1, st
                assert st["seed"]["name"] == "train.npz" and st["seed"]["samples"] == 400
            finally:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert "seeded the sample store with 400 samples" in logs[0].read_text()
        assert "seeded the sample store" not in logs[1].read_text()
