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
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
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
        return subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                              stdout=out, stderr=subprocess.STDOUT, timeout=240, check=False).returncode


@needs_mosquitto
def test_two_runs_on_a_growing_store_deploy_one_version_each(tmp_path):
    import paho.mqtt.client as mqtt

    from dfl_agent.cli.dflctl import main as dflctl
    from dfl_agent.deploy import ModelStore, verify_folder
    from dfl_agent.security.keys import load_private_key
    from tests.unit.test_deploy import verify_announcement

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
        from dfl_agent.runtime.node.checkpoint import snapshot_from_checkpoint

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
        proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
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


WRITER = """
import io, os, sys, time
import numpy as np
from pathlib import Path
from tests.system.test_store_agent import windows
spools, per_file, files, period = [Path(p) for p in sys.argv[4:]], int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
for k in range(files):  # the application: one file per spool every `period` seconds
    t0 = time.monotonic()
    for j, spool in enumerate(spools):
        x, y = windows(per_file, 1000 + 100 * j + k)
        buf = io.BytesIO()
        np.savez(buf, x=x, y=y, t=np.full(per_file, time.time()))
        (spool / f".w{k}.npz.tmp").write_bytes(buf.getvalue())
        os.replace(spool / f".w{k}.npz.tmp", spool / f"w{k}.npz")
    time.sleep(max(0.0, period - (time.monotonic() - t0)))
"""


def _data_status(state):
    r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "data", "status", "--state-dir", str(state),
                        "--json"], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(r.stdout)


def _run_metrics(state):
    """``{run_id: [records]}`` from the per-run metrics files."""
    from dfl_agent.runtime.service.retention import read_records

    out: dict[str, list] = {}
    for f in sorted((state / "runs").glob("*/")):  # metrics.jsonl, gzipped once the run ended
        for rec in read_records(f):
            out.setdefault(rec["run"], []).append(rec)
    return out


@needs_mosquitto
@pytest.mark.timeout(900)
def test_three_agents_two_runs_growing_stores_one_deployment_per_run(tmp_path):
    """Three always-on agents on their sample stores: the default run (fedavg, 2 rounds),
    then a writer process drops files into every spool at a fixed rate, then a run
    submitted with ``dflctl run submit``.  The second run trains on more samples (data
    status and the run metrics), and every agent deploys exactly one version per run."""
    import signal

    from dfl_agent.deploy import ModelStore, verify_folder

    fed, ids = f"three{os.getpid()}", ["s0", "s1", "s2"]
    states = {n: tmp_path / n for n in ids}
    procs, logs = {}, {n: tmp_path / f"{n}.log" for n in ids}

    def tail(n):
        return f"--- {n}\n" + logs[n].read_text()[-2500:]

    def wait_until(cond, what, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            for n, p in procs.items():
                assert p.poll() is None, f"{n} exited: " + tail(n)
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(tail(n) for n in ids))

    with start_broker("mosquitto") as broker:
        try:
            for j, n in enumerate(ids):
                cfg = config_from_dict({
                    "federation": fed, "node_id": n, "state_dir": str(states[n]),
                    "algorithm": {"name": "fedavg", "rounds": 2},
                    "training": {"epochs": 1, "batch_size": 32, "threads": 1},
                    "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4,
                             "spool_interval": 0.5},
                    # no ONNX export here (the one-agent test covers the daemon's ONNX path)
                    "model": {"size": "small"}, "deploy": {"tolerance": 1.0, "onnx": False},
                    "mqtt": {"broker": broker.endpoint, "heartbeat_interval": 1.0},
                    "discovery": {"mdns": False, "min_peers": 2, "start_timeout": 600},
                })
                path = tmp_path / f"{n}.toml"
                path.write_text(dump_toml(cfg))
                drop(states[n] / "spool", "seed.npz", 60, j)  # little data to start with
                procs[n] = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config",
                                             str(path)], stdout=open(logs[n], "w"), stderr=subprocess.STDOUT)
            models = {n: ModelStore(states[n]) for n in ids}
            # run 1: the default run, on the 60 seed samples
            wait_until(lambda: all(m.current_version() == 1 for m in models.values()), "run 1's deployments", 420)
            before = {n: _data_status(states[n]) for n in ids}
            assert all(s["samples"] == 60 for s in before.values()), before
            # between the runs: the application writes 4 files of 30 samples into each spool, one every 0.5 s
            w = subprocess.run([sys.executable, "-c", WRITER, "30", "4", "0.5", *(str(states[n] / "spool") for n in ids)],
                               cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True,
                               text=True, timeout=120)
            assert w.returncode == 0, w.stderr
            wait_until(lambda: all(_data_status(states[n])["samples"] == 180 for n in ids), "ingestion", 120)
            rid = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "run", "submit", "--broker",
                                  broker.endpoint, "--federation", fed, "--algorithm", "fedavg", "--rounds", "2",
                                  "--model-size", "small", "--min-members", "3"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout.strip()
            wait_until(lambda: all(m.current_version() == 2 for m in models.values()), "run 2's deployments", 420)
        finally:
            for p in procs.values():
                p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    after = {n: _data_status(states[n]) for n in ids}
    for n in ids:
        assert after[n]["samples"] == 180 and after[n]["ingested_files"] == 5 and after[n]["rejected"] == 0, after[n]
        m = models[n]
        assert m.versions() == [1, 2] and m.current_version() == 2, tail(n)  # one version per run
        v1, v2 = verify_folder(m.folder(1)), verify_folder(m.folder(2))
        assert v2["run_id"] == rid and v1["run_id"] != rid and v1["algorithm"] == v2["algorithm"] == "fedavg"
        assert v1["round"] == v2["round"] == 2
        assert not v1["onnx"] and "model.onnx" not in v2["files"]  # deploy.onnx = false
        runs = _run_metrics(states[n])
        assert set(runs) == {v1["run_id"], rid}, runs.keys()
        first, second = ({r["train_samples"] for r in runs[k]} for k in (v1["run_id"], rid))
        assert len(first) == len(second) == 1 and second.pop() > first.pop(), runs  # run 2 trained on more
        assert {r["round"] for r in runs[rid]} == {1, 2} and all(r["neighbours"] >= 1 for r in runs[rid])
        assert v2["validation_samples"] > v1["validation_samples"]
