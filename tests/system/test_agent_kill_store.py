"""End-to-end SIGKILL of a real agent on its sample store: the agent is killed again and
again while it ingests its spool, trains its run and deploys, then runs to the end.
Afterwards every spool file is in the store exactly once (no sample lost or duplicated),
nothing is left half-ingested in the spool, and every deployed version passes its
manifest's hash check with ``current`` pointing at one of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto
from tests.system.test_store_agent import SHAPE, drop

pytestmark = [pytest.mark.slow, pytest.mark.integration]
FILES, PER_FILE = 150, 8


def _agent(path, log):
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT)


def committed_checkpoints(state):
    """The checkpoint manifests on disk (``round-*.json``, written last: the commit record of a
    checkpoint), of a ``--once`` run (``state/checkpoints``) or of a submitted run."""
    return sorted(state.glob("checkpoints/round-*.json")) + sorted(state.glob("runs/*/checkpoints/round-*.json"))


@needs_mosquitto
def test_agent_killed_while_ingesting_training_and_deploying_loses_and_duplicates_nothing(tmp_path):
    from dfl_agent.deploy import ModelStore, verify_folder

    state = tmp_path / "state"
    with start_broker("mosquitto") as broker:
        cfg = config_from_dict({
            "federation": f"kill{os.getpid()}", "node_id": "dev1", "state_dir": str(state),
            "algorithm": {"name": "local", "rounds": 3},
            "training": {"epochs": 1, "batch_size": 32, "threads": 1},
            "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.2},
            "model": {"size": "small"}, "deploy": {"tolerance": 1.0, "onnx": False},
            "runtime": {"checkpoint": True},
            "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 1.0},
            "discovery": {"mdns": False},
        })
        path = tmp_path / "node.toml"
        path.write_text(dump_toml(cfg))
        for i in range(FILES):
            drop(state / "spool", f"f{i:02d}.npz", PER_FILE, i)
        log = open(tmp_path / "agent.log", "ab")
        spool = state / "spool"
        left = lambda: len([p for p in spool.iterdir() if p.suffix == ".npz"])  # noqa: E731
        partial = []
        # 1) killed while it ingests: as soon as the spool starts to empty
        for _ in range(3):
            if left() < FILES // 2:
                break
            proc = _agent(path, log)
            deadline = time.time() + 120
            while left() == FILES and proc.poll() is None and time.time() < deadline:
                time.sleep(0.005)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            partial.append(left())
        # 2) killed during its run: once its first checkpoint is committed. Not at the log line
        # "round 1 done": that line is written while the round's checkpoint is still being saved
        # in a worker thread, so under load a kill there came before any checkpoint existed and
        # the restarted agent had nothing to resume from.
        proc = _agent(path, log)
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline:
            if committed_checkpoints(state):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the agent ended before it could be killed mid-run"
        assert committed_checkpoints(state), "no checkpoint within 180 s"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = _agent(path, log)
        rc = proc.wait(240)
        log.close()
        text = (tmp_path / "agent.log").read_text(errors="replace")
        assert rc == 0, text[-3000:]
        # the first kill hit the agent in the middle of ingesting its spool
        assert 0 < partial[0] < FILES, (partial, text[-3000:])
        assert "resumed from checkpoint" in text  # the run killed mid-way went on from its checkpoint
    st = json.loads(subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "data", "status", "--state-dir",
                                    str(state), "--json"], capture_output=True, text=True, check=True).stdout)
    assert st["samples"] == FILES * PER_FILE, st  # every sample exactly once
    assert st["ingested_files"] == FILES and st["rejected"] == 0, st
    assert not [p for p in (state / "spool").iterdir() if p.suffix == ".npz"]  # nothing left behind
    models = ModelStore(state)
    versions = models.versions()
    assert versions and models.current_version() in versions, (versions, text[-2000:])
    for v in versions:
        verify_folder(models.folder(v))  # raises on a missing file or a hash mismatch
