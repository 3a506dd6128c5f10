"""The always-on agent as a torch-free supervisor with a run process per run, on a real
mosquitto with real agent processes: the idle agent imports no torch; a run process killed
mid-run is retried from the run's last checkpoint; one OOM-killed by its memory cgroup is
retried once with the same limit, then the run is failed while the supervisor goes on serving."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.service.retention import read_records
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto
from tests.system.test_store_agent import SHAPE, drop

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _ledger(state: Path) -> dict:
    from dfl_agent.runtime.service.ledger import read_entries

    return read_entries(state)


def _config(tmp_path: Path, broker: str, **over) -> Path:
    doc = {
        "federation": f"sup{os.getpid()}", "node_id": "dev1", "state_dir": str(tmp_path / "state"),
        "algorithm": {"name": "local", "rounds": 1},
        "training": {"epochs": 1, "batch_size": 32, "threads": 1},
        "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4, "spool_interval": 0.2},
        "model": {"size": "small"}, "deploy": {"onnx": False},
        "mqtt": {"broker": broker, "heartbeat_interval": 1.0},
        "discovery": {"mdns": False},
    }
    for k, v in over.items():
        doc[k] = {**doc[k], **v} if isinstance(doc.get(k), dict) and v is not None else v
    text = dump_toml(config_from_dict({k: v for k, v in doc.items() if v is not None}))
    if doc["algorithm"] is None:  # no default run: the agent waits for runs
        text = re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n|\n)*", "", text)
    path = tmp_path / "node.toml"
    path.write_text(text)
    for k in range(3):
        drop(tmp_path / "state" / "spool", f"a{k}.npz", 60, k)
    return path


def _start(path: Path, log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "DFL_TEST_CRASH_AT"}
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _operator(tmp_path: Path, fed: str) -> tuple:
    """A federation key and an operator folder (key and certificate of operator "alice")."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dfl_agent.runtime.shared.descriptor import operator_certificate
    from dfl_agent.security.keys import public_key_b64, save_certificate, save_private_key

    fed_key, key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    op = tmp_path / "operator"
    op.mkdir()
    save_private_key(key, op / "operator_key.pem")
    save_certificate(operator_certificate(fed_key, fed, "alice", public_key_b64(key)), op / "operator_cert.json")
    return fed_key, op


def _wait(pred, timeout: float, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.time() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.02)


@needs_mosquitto
def test_idle_always_on_agent_imports_no_torch(tmp_path):
    """The supervisor serving, idle (no run): no torch, no SciPy (the privacy accountant's, which
    the `train` extra does not bring) and no training agent in its process (the algorithm
    registry's torch-free modules, which admission reads, are allowed)."""
    with start_broker("mosquitto") as broker:
        path = _config(tmp_path, broker.endpoint, algorithm=None)
        assert "[algorithm]" not in path.read_text()
        out = tmp_path / "modules.json"
        script = textwrap.dedent(f"""
            import json, os, signal, sys, threading
            import paho.mqtt.client as mqtt
            from dfl_agent.runtime.service import daemon
            seen = threading.Event()
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
            c.on_connect = lambda c, *a: c.subscribe("dfl/+/node/dev1/status")
            c.on_message = lambda *a: seen.set()
            host, port = {broker.endpoint!r}.rsplit(":", 1)
            c.connect(host, int(port)); c.loop_start()
            def watch():
                seen.wait(120)
                mods = sorted(m for m in sys.modules if m in ("torch", "scipy", "dfl_agent.runtime.run.agent",
                              "dfl_agent.runtime.node.node", "dfl_agent.runtime.run.run_process")
                              or m.startswith(("torch.", "scipy.")))
                open({str(out)!r}, "w").write(json.dumps({{"status": seen.is_set(), "modules": mods}}))
                os.kill(os.getpid(), signal.SIGTERM)
            threading.Thread(target=watch, daemon=True).start()
            sys.exit(daemon.main(["run", "--config", {str(path)!r}]))
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        doc = json.loads(out.read_text())
        assert doc["status"], proc.stderr[-3000:]  # it was serving: its idle status was on the broker
        assert doc["modules"] == [], doc  # and it had imported no torch, no scipy and no training agent
        assert "stopping (SIGTERM)" in proc.stderr and "stopped" in proc.stderr


@needs_mosquitto
@pytest.mark.timeout(300)
def test_run_process_killed_mid_run_is_retried_from_its_checkpoint(tmp_path):
    """SIGKILL of the run process (not the supervisor) after its first checkpoint: the
    supervisor records a retry (attempt 2), the new run process resumes from the checkpoint,
    the run finishes and deploys once; the supervisor never stopped."""
    from dfl_agent.deploy import ModelStore

    with start_broker("mosquitto") as broker:
        # 400 rounds of about 0.1 s: the run is still training when it is killed (with 40 rounds it
        # could end before the kill on a fast machine, and nothing was left to resume)
        path = _config(tmp_path, broker.endpoint, algorithm={"rounds": 400}, training={"steps": 40, "epochs": 1})
        state = tmp_path / "state"
        log_path = tmp_path / "agent.log"
        with open(log_path, "ab") as log:
            proc = _start(path, log)
            try:
                # a complete checkpoint: its manifest (round-*.json) is written last; the hidden
                # temporary file of one being written matched "*" and the kill then left none
                _wait(lambda: list((state / "runs").glob("*/checkpoints/round-*.json")) and _ledger(state), 180, proc,
                      log_path)
                pid = int(re.findall(r"run process (\d+) started", log_path.read_text())[-1])
                os.kill(pid, signal.SIGKILL)
                (run_id,) = _ledger(state)
                _wait(lambda: _ledger(state)[run_id]["state"] == "finished", 180, proc, log_path)
            finally:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(60)
        text = log_path.read_text()
        assert rc == 0, text[-3000:]
        assert "run process killed by signal 9" in text and "retry 1 of 2" in text, text[-3000:]
        assert re.search(r"resuming at round \d+", text), text[-3000:]  # from its checkpoint, not round 1
        assert _ledger(state)[run_id]["attempt"] == 2
        assert ModelStore(state).versions() == [1] and text.count("deployed model v") == 1


@needs_mosquitto
@pytest.mark.timeout(300)
def test_oom_killed_run_process_is_retried_once_then_failed_and_the_supervisor_serves(tmp_path):
    """A run process over its memory limit (``compute.memory_budget_mb``) is killed by the
    kernel in its cgroup: retried once with the same limit, then the run is ``failed``; the
    supervisor stays up and its status heartbeat goes on."""
    from dfl_agent.runtime.service.cgroup import RunCgroup

    probe = RunCgroup.create(f"probe-{os.getpid()}", 64)
    if probe is None:
        pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")
    probe.remove()
    import paho.mqtt.client as mqtt

    with start_broker("mosquitto") as broker:
        path = _config(tmp_path, broker.endpoint, profile_overrides={"compute": {"memory_budget_mb": 96}})
        state = tmp_path / "state"
        log_path = tmp_path / "agent.log"
        statuses: list[dict] = []
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        c.on_connect = lambda cl, *a: cl.subscribe(f"dfl/sup{os.getpid()}/node/dev1/status")
        c.on_message = lambda cl, u, m: statuses.append(json.loads(m.payload).get("payload")) if m.payload else None
        host, port = broker.endpoint.rsplit(":", 1)
        c.connect(host, int(port))
        c.loop_start()
        with open(log_path, "ab") as log:
            proc = _start(path, log)
            try:
                _wait(lambda: any(e.get("state") == "failed" for e in _ledger(state).values()), 180, proc, log_path)
                n = len(statuses)
                _wait(lambda: len(statuses) >= n + 2, 20, proc, log_path)  # still serving: heartbeats go on
            finally:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(60)
                c.loop_stop()
        text = log_path.read_text()
        assert rc == 0, text[-3000:]
        (entry,) = _ledger(state).values()
        assert "OOM" in entry["reason"] and entry["attempt"] == 2, entry
        assert text.count(": run process killed by the kernel's OOM killer (memory limit 96 MiB)\n") == 2, text[-3000:]
        assert "retry 1 of 1" in text
        assert statuses[-1]["state"] == "idle" and statuses[-1]["run"]["state"] == "failed"
        assert not list(Path("/sys/fs/cgroup/memory/dfl-agent").glob("run-dev1-*")) if Path(
            "/sys/fs/cgroup/memory/dfl-agent").exists() else True


@needs_mosquitto
@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", ["declined:after", "cancelled:after"])
def test_declined_and_cancelled_survive_a_kill_at_that_state(tmp_path, at):
    """SIGKILL of the agent (with its group) right after the ledger says ``declined`` (a run
    for other members) or ``cancelled`` (a run waiting for members, cancelled by the
    operator), then a restart: the run keeps that state and never trains here."""
    from tests.system.test_runs import _config as fleet_config
    from tests.system.test_runs import dflctl

    fed = f"sk{os.getpid()}"
    fed_key, op = _operator(tmp_path, fed)
    with start_broker("mosquitto") as broker:
        path = fleet_config(tmp_path, fed, "a0", 0, broker.endpoint, fed_key)
        state, log_path = tmp_path / "a0", tmp_path / "agent.log"
        b = ["--broker", broker.endpoint, "--federation", fed, "--operator-dir", str(op)]
        env = {**os.environ, "DFL_TEST_CRASH_AT": at}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            _wait(lambda: "waiting for runs" in log_path.read_text(), 60, proc, log_path)
            if at == "declined:after":
                rid = dflctl("run", "submit", *b, "--algorithm", "fedavg", "--rounds", "2", "--members", "other",
                             "--no-wait")  # killed right after it records its decline: it will not answer
            else:
                rid = dflctl("run", "submit", *b, "--algorithm", "fedavg", "--rounds", "2", "--min-members", "2")
                _wait(lambda: _ledger(state).get(rid, {}).get("state") == "waiting_for_members", 60, proc, log_path)
                dflctl("run", "cancel", rid, *b[:4], "--operator-dir", str(op))
            assert proc.wait(60) == -signal.SIGKILL, log_path.read_text()[-3000:]  # killed at the point
            recorded = at.split(":")[0]
            assert _ledger(state)[rid]["state"] == recorded
            proc = _start(path, log)
            try:
                _wait(lambda: log_path.read_text().count("waiting for runs") == 2, 60, proc, log_path)
                time.sleep(3)  # three heartbeats: the retained descriptor (and cancel) were read again
            finally:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(60)
        text = log_path.read_text()
        assert rc == 0, text[-3000:]
        assert _ledger(state)[rid]["state"] == recorded, text[-3000:]
        assert not (state / "runs" / rid / "metrics.jsonl").exists() and "run process" not in text


@needs_mosquitto
@pytest.mark.timeout(300)
def test_killed_before_kept_keeps_the_current_model_once_after_restart(tmp_path):
    """SIGKILL (with the run process) right before the ledger says ``kept`` (the gate refused
    the candidate: too few validation samples to replace the deployed model), then a restart:
    the run ends ``finished``, the deployed version is untouched, the candidate staged once."""
    from dfl_agent.deploy import ModelStore

    with start_broker("mosquitto") as broker:
        path = _config(tmp_path, broker.endpoint, deploy={"min_validation": 100000})
        state = tmp_path / "state"
        models = ModelStore(state)  # a model the device already runs
        models.install({"spec.json": b"{}", "model.safetensors": b"x"}, {"run_id": "earlier", "round": 1})
        log_path = tmp_path / "agent.log"
        env = {**os.environ, "DFL_TEST_CRASH_AT": "kept:before"}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            assert proc.wait(180) == -signal.SIGKILL, log_path.read_text()[-3000:]
            (run_id, entry), = _ledger(state).items()
            assert entry["state"] == "deploying" and (models.root / "candidate").is_dir()
            proc = _start(path, log)
            try:
                _wait(lambda: _ledger(state)[run_id]["state"] == "finished", 180, proc, log_path)
            finally:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(60)
        text = log_path.read_text()
        assert rc == 0, text[-3000:]
        assert models.versions() == [1] and models.current_version() == 1  # untouched
        staged = json.loads((models.root / "candidate" / "manifest.json").read_text())
        assert staged["run_id"] == run_id and text.count(f"model of run {run_id} not deployed") == 1, text[-3000:]
        assert "resumes from state deploying" in text and "kept out by the gate" in text


@needs_mosquitto
@pytest.mark.timeout(300)
def test_killed_while_waiting_for_members_trains_the_run_after_restart(tmp_path):
    """SIGKILL of one supervisor (with its group) right after its ledger says
    ``waiting_for_members`` for a run that needs both devices; after its restart both train
    the run to the end and deploy nothing twice."""
    from tests.system.test_runs import _config as fleet_config
    from tests.system.test_runs import dflctl

    fed = f"wm{os.getpid()}"
    fed_key, op = _operator(tmp_path, fed)
    with start_broker("mosquitto") as broker:
        paths = {n: fleet_config(tmp_path, fed, n, i, broker.endpoint, fed_key) for i, n in enumerate(("a0", "a1"))}
        logs = {n: tmp_path / f"{n}.log" for n in paths}
        files = {n: open(logs[n], "ab") for n in paths}
        env = {**os.environ, "DFL_TEST_CRASH_AT": "waiting_for_members:after"}
        a0 = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(paths["a0"])],
                              stdout=files["a0"], stderr=subprocess.STDOUT, env=env, start_new_session=True)
        a1 = _start(paths["a1"], files["a1"])
        procs = [a1]
        try:
            for n, p in (("a0", a0), ("a1", a1)):
                _wait(lambda n=n: "waiting for runs" in logs[n].read_text(), 60, p, logs[n])
            rid = dflctl("run", "submit", "--broker", broker.endpoint, "--federation", fed, "--operator-dir", str(op),
                         "--algorithm", "fedavg", "--rounds", "2", "--min-members", "2")
            assert a0.wait(60) == -signal.SIGKILL, logs["a0"].read_text()[-3000:]
            assert _ledger(tmp_path / "a0")[rid]["state"] == "waiting_for_members"
            procs.append(_start(paths["a0"], files["a0"]))
            for n, p in (("a0", procs[1]), ("a1", a1)):
                _wait(lambda n=n: _ledger(tmp_path / n).get(rid, {}).get("state") == "finished", 240, p, logs[n])
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            rcs = [p.wait(60) for p in procs]
        assert rcs == [0, 0], [logs[n].read_text()[-2000:] for n in logs]
        for n in paths:  # both trained both rounds with the other's model
            records = read_records(tmp_path / n / "runs" / rid)  # gzipped once the run ended
            assert [r["round"] for r in records if "neighbour_ids" in r] == [1, 2], (n, records)


def test_a_run_process_started_while_the_broker_is_down_reports_its_end_without_a_traceback(tmp_path):
    """The run process as the supervisor starts it, with nothing listening on the broker's port:
    it says the broker is unreachable, sends its ``end`` report and exits 3 (at 75535c2 the end
    report raised ``AttributeError: 'FedAvg' object has no attribute 'market'``: a traceback and
    exit 1, read by the supervisor as a crash)."""
    import socket

    from dfl_agent.runtime.shared.descriptor import RunDescriptor

    with socket.socket() as s:  # a free port: the broker is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = run_dir / "run.toml"
    config.write_text(dump_toml(config_from_dict({
        "federation": "down", "node_id": "dev1", "state_dir": str(tmp_path / "state"),
        "algorithm": {"name": "fedavg", "rounds": 2}, "data": {"dataset": "iris", "partition": "iid", "num_nodes": 2},
        "model": {"size": "small"}, "deploy": {"onnx": False}, "mqtt": {"broker": f"127.0.0.1:{port}"},
        "discovery": {"mdns": False}})))
    d = RunDescriptor(run_id="r1", federation="down", algorithm="fedavg", rounds=2)
    (run_dir / "descriptor.json").write_text(json.dumps(d.to_dict()))
    proc = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.run.run_process", "--config", str(config),
                           "--run-dir", str(run_dir)], input=json.dumps({"type": "start"}) + "\n",
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "could not connect to MQTT broker" in proc.stderr
    docs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert docs[-1]["type"] == "end" and docs[-1]["round"] == 0 and docs[-1]["last_round"] == 0, docs
