"""Cancel stays cancelled (real mosquitto, a real ``dfl-agent run`` process, ``dflctl run``
as a subprocess): a run is submitted and cancelled, then its captured submission is
published again, retained, over the cancelled copy; a node enrolled after the cancel
starts, reads the run's retained cancel record before the descriptor, refuses the
replayed run (counted as ``cancelled``) and never queues it, and ``dflctl run list``
still shows the run cancelled."""

from __future__ import annotations

import json
import signal
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.fleet import fetch_retained, publish_retained
from dfl_agent.cli.observer import Observer
from dfl_agent.runtime.shared.descriptor import cancel_topic, operator_certificate, run_topic
from dfl_agent.security.keys import public_key_b64, save_certificate, save_private_key
from tests.system.conftest import needs_mosquitto
from tests.system.test_runs import _config, _start, dflctl
from tests.unit.test_state_version import read_cancelled

pytestmark = [pytest.mark.slow, pytest.mark.integration, needs_mosquitto]


def test_a_replayed_submission_after_a_cancel_is_refused_by_a_node_enrolled_later(tmp_path):
    fed = "cancel-" + str(int(time.time() * 1000) % 100000)
    fed_key = Ed25519PrivateKey.generate()
    op = tmp_path / "operator"
    op.mkdir()
    key = Ed25519PrivateKey.generate()
    save_private_key(key, op / "operator_key.pem")
    save_certificate(operator_certificate(fed_key, fed, "alice", public_key_b64(key)), op / "operator_cert.json")
    with start_broker("mosquitto") as broker:
        b = ["--broker", broker.endpoint, "--federation", fed]
        rid = dflctl("run", "submit", *b, "--operator-dir", str(op), "--algorithm", "fedavg", "--rounds", "1",
                     "--not-after", "2h")
        captured = fetch_retained(broker.endpoint, run_topic(fed, rid))  # what an eavesdropper keeps
        assert captured is not None and json.loads(captured)["payload"]["not_after"] > time.time() + 3600
        assert dflctl("run", "cancel", rid, *b, "--operator-dir", str(op)) == f"cancelled {rid}"
        assert fetch_retained(broker.endpoint, cancel_topic(fed, rid)) is not None
        publish_retained(broker.endpoint, run_topic(fed, rid), captured)  # the replay: the live copy again
        assert fetch_retained(broker.endpoint, run_topic(fed, rid)) == captured

        path = _config(tmp_path, fed, "late", 0, broker.endpoint, fed_key)  # enrolled after the cancel
        proc = _start(tmp_path, "late", path)
        obs = Observer(broker.endpoint, fed).start()
        log = tmp_path / "late.log"
        try:
            end = time.monotonic() + 120
            while time.monotonic() < end:
                st = obs.snapshot()[0].get("late", {})
                if st.get("state") == "idle" and (st.get("runs_refused") or {}).get("cancelled"):
                    break
                assert proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.3)
            else:
                raise AssertionError(f"no idle status with a refusal\n{log.read_text()[-3000:]}")
            time.sleep(2.0)  # a few idle passes: the run must not be queued or started meanwhile
            st = obs.snapshot()[0]["late"]
            assert {k: v for k, v in st["runs_refused"].items() if v} == {"cancelled": 1}, st
            assert st["run"] is None and st["state"] == "idle", st
            text = log.read_text()
            assert f"refused run descriptor on {run_topic(fed, rid)}: cancelled" in text, text
            assert f"run {rid} (fedavg" not in text, text  # never queued
            assert not (tmp_path / "late" / "runs" / rid).exists()  # never started
            assert rid in read_cancelled(tmp_path / "late")  # remembered in its run ledger
            listed = json.loads(dflctl("run", "list", *b, "--json"))["runs"]
            assert [(r["run_id"], r["state"], r["cancel_record"]) for r in listed] == [(rid, "cancelled", True)]
        finally:
            obs.stop()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert "Traceback" not in log.read_text()
    assert proc.returncode == 0, proc.returncode
