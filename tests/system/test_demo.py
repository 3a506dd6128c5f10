"""The main job end to end: real agent processes, a real broker, mDNS on 127.0.0.1."""

import json
import re
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
    # the amqtt broker carried the models: both agents connected to its endpoint with MQTT 3.1.1 ...
    m = re.search(r"broker: amqtt on (\S+);", r.stdout)
    assert m, r.stdout[-2000:]
    endpoint = m.group(1)
    for log in sorted((out / "logs").glob("*.log")):
        text = log.read_text()
        assert f"connecting to home broker {endpoint} (MQTT 3.1.1)" in text and f"connected to {endpoint}" in text, \
            text[-2000:]
    # ... and each round every agent averaged the other's model, received over it
    recs = _records(out)
    assert len(recs) == 2, sorted(recs)
    for n, rounds in recs.items():
        other = (set(recs) - {n}).pop()
        assert sorted(rounds) == [1, 2]
        assert all(rec["neighbour_ids"] == [other] for rec in rounds.values()), (n, rounds)
        assert rounds[2]["bytes_received"] > 0 and rounds[2]["bytes_received_by_kind"].get("model", 0) > 0


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
    check_algorithm_evidence(algorithm, _records(out))


def _records(out) -> dict[str, dict[int, dict]]:
    """node id -> round -> that node's metrics record of the round (the demo's metrics.jsonl)."""
    recs: dict[str, dict[int, dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        recs.setdefault(rec["node"], {})[rec["round"]] = rec
    return recs


def check_algorithm_evidence(algorithm: str, recs: dict[str, dict[int, dict]], rounds: int = 3) -> None:
    """Assert that each node used its neighbours' contributions the way ``algorithm`` does."""
    ids = sorted(recs)
    assert len(ids) == 3, recs
    for n in ids:
        # Def-KT's pair round does not wait for the nodes outside its pair, nor HeteroFL's
        # rotating aggregator for a node still starting: an agent that started late may find
        # round 1 done and join at round 2 (its rounds are contiguous)
        first = min(recs[n]) if algorithm in ("defkt", "heterofl") else 1
        assert sorted(recs[n]) == list(range(first, rounds + 1)), (n, sorted(recs[n]))
        assert algorithm == "defkt" or first <= 2, (n, sorted(recs[n]))
    for n in ids:
        assert recs[n][rounds]["bytes_received"] > 0, n
    if algorithm == "dechw":  # every round: both neighbours' models, weighted by their Hessians
        for n in ids:
            for t, rec in recs[n].items():
                assert set(rec["neighbour_ids"]) == set(ids) - {n}, (n, t, rec["neighbour_ids"])
                assert rec["hessian_weighted"] is True, (n, t)
            assert recs[n][rounds]["hessian_rounds"] == rounds, n
    elif algorithm == "defkt":  # every round: one receiver took the sender's model by knowledge transfer
        fused = 0
        for t in range(1, rounds + 1):
            receivers = [recs[n][t] for n in ids if t in recs[n] and recs[n][t]["role"] == "receiver"]
            everyone = all(t in recs[n] for n in ids)
            assert len(receivers) == 1 if everyone else len(receivers) <= 1, \
                (t, [recs[n][t]["role"] for n in ids if t in recs[n]])
            for rec in receivers:
                assert rec["fused"] is True and rec["neighbour_ids"] == [rec["partner"]] and rec["partner"] in ids, rec
                assert rec["transfer_kl"] >= 0 and rec["transfer_ce"] > 0, rec
                fused += 1
        assert fused >= rounds - 1, fused  # knowledge transfers happened (a late joiner may miss one round)
    elif algorithm == "heterofl":  # every round: the aggregator took contributions, its senders its update
        for t in range(1, rounds + 1):
            reported = [n for n in ids if t in recs[n]]  # a late joiner has no record of round 1
            assert len(reported) >= 2, (t, reported)
            agg = recs[reported[0]][t]["aggregator"]
            assert agg in reported and all(recs[n][t]["aggregator"] == agg for n in reported), t
            took = recs[agg][t]["neighbour_ids"]
            assert took and set(took) <= set(reported) - {agg} and recs[agg][t]["participants"] == len(took) + 1, \
                (t, agg, recs[agg][t])
            assert recs[agg][t]["contributors"] == ",".join(took)
            for n in took:
                assert recs[n][t]["neighbour_ids"] == [agg], (t, n, recs[n][t])
    else:
        raise AssertionError(f"no evidence rule for {algorithm}")
