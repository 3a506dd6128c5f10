"""A device's privacy budget through the real always-on path: one ``dfl-agent run`` (supervisor,
run manager, a run process per run) on its sample store under ``privacy.dp``, over a real
mosquitto, with a default run recurring every few seconds.  ``privacy.lifetime_epsilon`` holds one
run's spend and not two: the first run trains under DP-SGD and is settled in the privacy ledger,
the next is declined at admission, and ``dflctl status`` says why; the deployed model's manifest
carries its ε.  After a restart of the agent
the composed ε it reports (the ledger re-opened from disk) agrees with Opacus's RDPAccountant on
the ledger's history within 1 % (~25 s)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from dfl_agent.privacy.accountant import rdp_epsilon
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration, needs_mosquitto]
SHAPE = (3, 16)
SIGMA, BATCH, STEPS = 1.0, 32, 2


def _seed_data(path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 240)
    x = rng.normal(size=(240, *SHAPE)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    np.savez(path / "train.npz", x=x, y=y)


def _dflctl(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", *args], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def _wait(cond, timeout: float, what: str, log) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}\n{log.read_text()[-4000:]}")


def test_a_device_with_its_budget_spent_declines_the_next_run(tmp_path):
    pytest.importorskip("opacus")
    from dfl_agent.cli.broker import start_broker
    from dfl_agent.runtime.service.ledger import RunLedger
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger
    from dfl_agent.runtime.shared.sample_store import open_store, seed_store
    from dfl_agent.store.sqlite import validation_mask

    state, fed = tmp_path / "state", f"privacy{os.getpid()}"
    _seed_data(tmp_path / "seed")
    raw = {
        "federation": fed, "node_id": "dev1", "state_dir": str(state),
        "algorithm": {"name": "local", "rounds": 1, "every": "3s"},
        "training": {"steps": STEPS, "batch_size": BATCH, "threads": 1},
        "data": {"dataset": "store", "path": str(tmp_path / "seed"), "input_shape": list(SHAPE), "num_classes": 4},
        "model": {"size": "small"}, "deploy": {"tolerance": 1.0, "onnx": False},
        "discovery": {"mdns": False},
        "privacy": {"dp": {"max_grad_norm": 1.0, "noise_multiplier": SIGMA}},
    }
    store = open_store(config_from_dict(raw))  # seeded here as the agent would: N is known before it starts
    seed_store(store, str(tmp_path / "seed"))
    n = int((~validation_mask(store.snapshot(), 0.2)).sum())
    store.close()
    one = [(SIGMA, BATCH / n, STEPS)]
    lifetime = round((rdp_epsilon(one, 1e-5) + rdp_epsilon(one * 2, 1e-5)) / 2, 4)  # one run fits, two do not
    with start_broker("mosquitto") as broker:
        raw["privacy"]["lifetime_epsilon"] = lifetime
        raw["mqtt"] = {"broker": broker.endpoint, "heartbeat_interval": 1.0}
        path = tmp_path / "node.toml"
        path.write_text(dump_toml(config_from_dict(raw)))
        log = tmp_path / "agent.log"
        b = ["--broker", broker.endpoint, "--federation", fed]

        def start() -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                                    stdout=open(log, "a"), stderr=subprocess.STDOUT)

        def states() -> dict[str, str]:
            return {k: v.get("state") for k, v in RunLedger(state).entries.items()}

        proc = start()
        try:
            _wait(lambda: "declined" in states().values() and "finished" in states().values(), 90,
                  "a finished run, then a declined one", log)
            entries = RunLedger(state).entries
            done = next(k for k, v in entries.items() if v["state"] == "finished")
            declined = next(v for v in entries.values() if v["state"] == "declined")
            assert declined["reason"].startswith("privacy budget: the run would spend epsilon "), declined
            assert f"past privacy.lifetime_epsilon {lifetime:g}" in declined["reason"]
            # the finished run's record carries its epsilon; the ledger settled it with the steps it took
            row = PrivacyLedger(state).get(done)
            assert row["state"] == "spent" and row["steps"] == STEPS and row["sample_rate"] == pytest.approx(BATCH / n)
            assert entries[done]["privacy"]["epsilon"] == pytest.approx(rdp_epsilon(one, 1e-5), rel=1e-3)
            # the deployed model's manifest says how private it is
            from dfl_agent.deploy import ModelStore

            manifest = ModelStore(state).manifest(1)
            assert manifest["run_id"] == done and manifest["privacy"]["epsilon_run"] == pytest.approx(
                rdp_epsilon(one, 1e-5), rel=1e-3)
            assert manifest["privacy"]["epsilon_lifetime"] == manifest["privacy"]["epsilon_run"]
            assert (manifest["privacy"]["lifetime_epsilon"], manifest["privacy"]["delta"]) == (lifetime, 1e-5)
            # dflctl status: the declined run with its reason, and the budget
            _wait(lambda: "declined" in _dflctl("status", *b), 20, "a status with the declined run", log)
            table = _dflctl("status", *b)
            assert "privacy budget: the run would spend" in table and f"/{lifetime:g}" in table, table
            doc = json.loads(_dflctl("status", *b, "--json"))["nodes"]["dev1"]
            assert doc["privacy"]["lifetime_epsilon"] == lifetime and doc["privacy"]["dp"] is True
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        # a restart: the agent re-opens the ledger from disk and reports the same composed epsilon
        proc = start()
        try:
            def fresh() -> dict:
                doc = json.loads(_dflctl("status", *b, "--json"))["nodes"].get("dev1", {})
                return doc if doc.get("time", 0) > time.time() - 2 and "privacy" in doc else {}

            _wait(fresh, 60, "a status after the restart", log)
            spent = fresh()["privacy"]["epsilon_spent"]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = PrivacyLedger(state).history()
    assert acc.history == [(SIGMA, pytest.approx(BATCH / n), STEPS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert spent == pytest.approx(acc.get_epsilon(delta=1e-5), rel=0.01)
    assert spent <= lifetime
    assert "Traceback" not in log.read_text()
