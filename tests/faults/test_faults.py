"""Fault injection on real agent processes and a real mosquitto (CI-sized; the full
runs and their report are in bench/faults/).

* kill -9 of random agents, restarted (``runtime.rejoin``), plus a broker restart
  mid-run: every agent finishes all rounds, no round lasts longer than two round
  deadlines.
* netem (root only: network namespaces): 200 ms delay and 10% loss on every agent's
  link; the federation completes its rounds.
"""

import pytest

from dfl_agent.cli.chaos import ChaosOptions, netns_available, run_chaos
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(400)]


@needs_mosquitto
def test_kill_restart_and_broker_restart(tmp_path):
    # rounds take ~0.3 s: 100 of them leave time for the killed agent's restart (start-up:
    # torch import, data) to rejoin; the broker restart comes when all three run again
    o = ChaosOptions(out=str(tmp_path / "chaos"), nodes=3, rounds=100, round_timeout=8.0, schedule="rounds",
                     kill_every=3, chaos_seconds=3, broker_restart_at=10, restart_delay=1.0, seed=1,
                     start_timeout=90.0, max_seconds=300.0)  # a stalled run fails with its report, not the pytest-timeout
    r = run_chaos(o, log=lambda *a: None)
    kills = [e for e in r["events"] if e["event"] == "kill"]
    assert kills and any(e["event"] == "broker_restart" for e in r["events"]), r["events"]
    assert r["completed"], r["nodes"]
    assert r["max_steady_round_seconds"] <= 2 * o.round_timeout, r["nodes"]
    assert r["stalls"] == 0


@needs_mosquitto
@pytest.mark.skipif(not netns_available(), reason="needs root, ip, tc and a kernel with sch_netem")
def test_netem_loss_and_delay(tmp_path):
    o = ChaosOptions(out=str(tmp_path / "netem"), nodes=3, rounds=4, round_timeout=20.0, faults=False,
                     netem="delay 200ms loss 10%", start_timeout=120.0)
    r = run_chaos(o, log=lambda *a: None)
    assert r["completed"], r["nodes"]
