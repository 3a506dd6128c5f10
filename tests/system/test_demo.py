"""The main job end to end: real agent processes, a real broker, mDNS on 127.0.0.1."""

import json
import subprocess
import sys

import pytest

from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _demo(tmp_path, *args, timeout=300):
    out = tmp_path / "report"
    r = subprocess.run(
        [sys.executable, "-m", "dfl_agent.cli.dflctl", "demo", "--no-live", "--out", str(out), *args],
        capture_output=True, text=True, timeout=timeout,
    )
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    return r, out, summary


@needs_mosquitto
def test_demo_completes_with_the_summary_contract(tmp_path):
    r, out, s = _demo(tmp_path, "--nodes", "3", "--rounds", "3", "--broker", "mosquitto", "--algorithm", "fedavg")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for key in ("algorithm", "nodes", "rounds_completed", "global_accuracy", "local_accuracy", "bytes_sent",
                "bytes_received", "wall_seconds", "local_only_global_accuracy"):
        assert key in s
    assert s["rounds_completed"] == 3 and s["nodes"] == 3 and not s["failed"]
    assert set(s["local_only_global_accuracy"]) >= {"mean", "per_node"}
    assert s["bytes_sent"] > 0
    assert (out / "accuracy.png").exists() and (out / "metrics.jsonl").exists()
    # every node found its peers: each round averaged 2 neighbours
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 9 and all(rec["neighbours"] == 2 for rec in records)


@needs_mosquitto
def test_killing_an_agent_never_stalls_a_round_past_its_deadline(tmp_path):
    timeout = 15.0
    r, out, s = _demo(tmp_path, "--nodes", "3", "--rounds", "5", "--kill", "2@2", "--round-timeout", str(timeout),
                      "--algorithm", "fedavg")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(s["killed"]) == 1
    survivors = [n for n in s["rounds_per_node"] if n not in s["killed"]]
    assert all(s["rounds_per_node"][n] == 5 for n in survivors)
    assert s["max_round_seconds"] <= timeout + 5.0


def test_demo_over_amqtt_with_mqtt_311(tmp_path):
    pytest.importorskip("amqtt")
    r, out, s = _demo(tmp_path, "--nodes", "2", "--rounds", "2", "--broker", "amqtt", "--protocol", "3.1.1",
                      "--algorithm", "fedavg")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert s["rounds_completed"] == 2 and s["broker"] == "amqtt"


@needs_mosquitto
def test_default_demo_is_dfml_with_three_or_more_architectures(tmp_path):
    r, out, s = _demo(tmp_path, "--nodes", "3", "--rounds", "4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert s["algorithm"] == "dfml" and s["rounds_completed"] == 4 and not s["failed"]
    assert len({json.dumps(v, sort_keys=True) for v in s["model_specs"].values()}) == 3


@needs_mosquitto
def test_dfml_demo_survives_a_killed_agent_within_two_token_timeouts(tmp_path):
    timeout = 10.0  # invite timeout; token timeout = 2 x this
    r, out, s = _demo(tmp_path, "--nodes", "4", "--rounds", "6", "--kill", "0@2", "--round-timeout", str(timeout))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    survivors = [n for n in s["rounds_per_node"] if n not in s["killed"]]
    assert all(s["rounds_per_node"][n] == 6 for n in survivors)
    # a round whose aggregator died completes within two token timeouts (plus compute)
    assert s["max_round_seconds"] <= 2 * (2 * timeout) + 15.0


@needs_mosquitto
@pytest.mark.parametrize("algorithm", ["dechw", "defkt", "heterofl"])
def test_other_algorithms_run_on_real_agent_processes(tmp_path, algorithm):
    extra = ["--models", "H1"] if algorithm == "heterofl" else []
    r, out, s = _demo(tmp_path, "--nodes", "3", "--rounds", "3", "--algorithm", algorithm, *extra)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert s["algorithm"] == algorithm and s["rounds_completed"] == 3 and not s["failed"]
    assert s["bytes_sent"] > 0
