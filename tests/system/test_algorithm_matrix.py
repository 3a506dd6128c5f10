"""Every registered algorithm on three always-on agents (real mosquitto, mDNS on
127.0.0.1, real ``dfl-agent run`` processes, HAR data).

One operator submits all eighteen algorithms of ``dflctl algorithms`` as runs, two rounds
each, to the same three agents; the agents run them one after another.  For each run
the test asserts, from the per-run metrics the agents write:

* it finished on all three agents;
* for every algorithm that communicates: each agent received bytes, and the metrics
  name the neighbours whose models (or gradients) each round took
  (``neighbour_ids``), plus the algorithm's own evidence: DecHW's Hessian-weighted
  aggregations, CFA's consensus step, GT / local-steps synchronisations, the
  rotating aggregator's contributors (DFML, D-FedAvg, D-FedProx, HeteroFL, FedRolex,
  FedD2S's distillation, FedPer), Def-KT's knowledge transfers and the pair fusions
  of Combo and FullAvg;
* for the local baselines ``local`` and ``local_adam``: no frame was sent or received.

``local-steps`` is the GT thesis's BL baseline: it synchronises accumulated gradients
every τ epochs, so it is checked as a communicating algorithm.

Accuracy against training alone is checked by the seeded simulator tests
(tests/integration/test_algorithms_beat_local.py), not here.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.dflctl import main as dflctl_main
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.runtime.shared.descriptor import operator_certificate
from dfl_agent.security.keys import enroll_local, public_key_b64, save_certificate, save_private_key
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROUNDS = 2
IDS = ["m0", "m1", "m2"]
#: algorithm families by the evidence their round records carry
NEIGHBOURHOOD = {"fedavg", "cfa", "dechetero", "dechw"}  # every round: every neighbour's model
ROTATING = {"dfml", "dfedavg", "dfedprox", "heterofl", "fedrolex", "fedd2s", "fedper"}  # token-holder rounds
PAIRING = {"defkt", "combo", "fullavg"}  # one sender -> receiver pair per round (Q = 1)
LOCKSTEP = {"gt", "local-steps"}  # synchronised accumulated gradients
LOCAL = {"local", "local_adam"}  # exchange nothing
#: options per family: every rotating round takes all three nodes (sender_ratio 1)
OPTIONS = {**{a: ["sender_ratio=1.0", "invite_timeout=60", "token_timeout=60"] for a in ROTATING},
           **{a: ["round_timeout=60"] for a in NEIGHBOURHOOD}}


def _config(tmp: Path, fed: str, nid: str, i: int, broker: str, fed_key: Ed25519PrivateKey) -> Path:
    state = tmp / nid
    enroll_local(fed_key, fed, nid, state)
    raw = {
        "federation": fed, "node_id": nid, "state_dir": str(state),
        # a small HAR subset: each agent takes one of 30 iid shares (~200 windows)
        "data": {"dataset": "har", "partition": "iid", "num_nodes": 30, "node_index": i},
        "model": {"size": "small"}, "training": {"steps": 3},
        "mqtt": {"broker": broker, "heartbeat_interval": 1.0},
        "discovery": {"min_peers": len(IDS) - 1, "start_timeout": 60.0, "mdns": True, "interfaces": ["127.0.0.1"]},
        "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)},
        # the papers' lock step, so that every round shows each algorithm's evidence (every
        # neighbour aggregated); the agent's default, quorum, closes a round with half of them
        "runtime": {"checkpoint": False, "straggler": "paper"},
    }
    text = dump_toml(config_from_dict(raw))
    text = re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n)*", "", text + "\n")  # no default run: wait for runs
    path = tmp / f"{nid}.toml"
    path.write_text(text)
    return path


def _operator(tmp: Path, fed: str, fed_key: Ed25519PrivateKey) -> Path:
    d = tmp / "operator"
    d.mkdir()
    key = Ed25519PrivateKey.generate()
    save_private_key(key, d / "operator_key.pem")
    save_certificate(operator_certificate(fed_key, fed, "alice", public_key_b64(key)), d / "operator_cert.json")
    return d


def dflctl(*args: str) -> str:
    """``dflctl ARGS`` in this process (eighteen submissions: no interpreter start each)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = dflctl_main(list(args))
    assert rc == 0, err.getvalue()
    return out.getvalue().strip()


def _ledger(tmp: Path, nid: str) -> dict[str, dict]:
    from dfl_agent.runtime.service.ledger import read_entries

    return read_entries(tmp / nid)


def _metrics(tmp: Path, nid: str, run_id: str) -> list[dict]:
    from dfl_agent.runtime.service.retention import read_records

    return read_records(tmp / nid / "runs" / run_id)  # gzipped once the run ended


def _by_round(records: list[dict]) -> dict[int, dict]:
    return {r["round"]: r for r in records}


def check_run(algorithm: str, metrics: dict[str, list[dict]]) -> list[str]:
    """The evidence problems of one finished run (empty: the algorithm did its job).

    ``metrics``: node id -> that node's round records of the run.
    """
    problems: list[str] = []

    def need(cond: bool, what: str) -> None:
        if not cond:
            problems.append(f"{algorithm}: {what}")

    rec = {n: _by_round(rs) for n, rs in metrics.items()}
    for n in IDS:
        if algorithm in PAIRING and rec[n]:
            # a pair round does not wait for the nodes outside its pair: an agent that
            # started the run late may find round 1 done and rejoin at round 2
            need(sorted(rec[n]) == list(range(min(rec[n]), ROUNDS + 1)), f"{n} recorded rounds {sorted(rec[n])}")
        else:
            need(sorted(rec[n]) == list(range(1, ROUNDS + 1)), f"{n} recorded rounds {sorted(rec[n])}")
    if problems:
        return problems
    last = {n: rec[n][ROUNDS] for n in IDS}
    if algorithm in LOCAL:
        for n in IDS:
            need(last[n]["bytes_sent"] == 0 and not last[n].get("bytes_sent_by_kind"),
                 f"{n} sent frames {last[n].get('bytes_sent_by_kind')}")
            need(last[n]["bytes_received"] == 0, f"{n} received {last[n]['bytes_received']} bytes")
        return problems
    for n in IDS:
        need(last[n]["bytes_received"] > 0, f"{n} received no bytes")
    others = {n: set(IDS) - {n} for n in IDS}
    if algorithm in NEIGHBOURHOOD:
        for n in IDS:
            for t, r in rec[n].items():
                need(set(r.get("neighbour_ids", ())) == others[n], f"{n} round {t} aggregated {r.get('neighbour_ids')}")
                if algorithm == "dechw":
                    need(r.get("hessian_weighted") is True, f"{n} round {t} was not Hessian-weighted")
                if algorithm == "cfa":
                    need(r.get("epsilon", 0) > 0, f"{n} round {t} consensus step {r.get('epsilon')}")
            if algorithm == "dechw":
                need(last[n].get("hessian_rounds") == ROUNDS, f"{n} hessian_rounds {last[n].get('hessian_rounds')}")
    elif algorithm in LOCKSTEP:
        for n in IDS:
            for t, r in rec[n].items():  # the first and the last epoch always synchronise
                need(r.get("synchronized") is True and set(r.get("neighbour_ids", ())) == others[n],
                     f"{n} epoch {t}: synchronized {r.get('synchronized')} with {r.get('neighbour_ids')}")
            need(last[n].get("syncs") == ROUNDS, f"{n} syncs {last[n].get('syncs')}")
            need(last[n].get("sync_messages_received", 0) >= ROUNDS * 2,
                 f"{n} sync messages received {last[n].get('sync_messages_received')}")
    elif algorithm in ROTATING:
        for n in IDS:
            used = set().union(*(set(r.get("neighbour_ids", ())) for r in rec[n].values()))
            need(used == others[n], f"{n} took contributions of {sorted(used)} over the run")
        for t in range(1, ROUNDS + 1):
            agg = rec[IDS[0]][t].get("aggregator")
            need(agg in IDS and all(rec[n][t].get("aggregator") == agg for n in IDS),
                 f"round {t} aggregator {[rec[n][t].get('aggregator') for n in IDS]}")
            if agg not in IDS:
                continue
            need(set(rec[agg][t].get("neighbour_ids", ())) == others[agg],
                 f"round {t} aggregator {agg} took {rec[agg][t].get('neighbour_ids')}")
            need(rec[agg][t].get("participants") == 3, f"round {t} participants {rec[agg][t].get('participants')}")
            for n in others[agg]:
                need(rec[n][t].get("neighbour_ids") == [agg], f"round {t}: {n} applied {rec[n][t].get('neighbour_ids')}")
        if algorithm == "fedd2s":  # every round, every node distilled from the aggregated global model
            for n in IDS:
                need(last[n].get("participations") == ROUNDS and last[n].get("distillations") == ROUNDS,
                     f"{n} participations {last[n].get('participations')} "
                     f"distillations {last[n].get('distillations')}")
    elif algorithm in PAIRING:
        fused = 0
        for t in range(1, ROUNDS + 1):
            recv = [n for n in IDS if t in rec[n] and rec[n][t].get("role") == "receiver"]
            everyone = all(t in rec[n] for n in IDS)
            need(len(recv) == 1 if everyone else len(recv) <= 1, f"round {t} receivers {recv}")
            fused += len(recv)
            for n in recv:
                r = rec[n][t]
                need(r.get("fused") is True and r.get("neighbour_ids") == [r.get("partner")]
                     and r.get("partner") in others[n], f"round {t}: receiver {n} fused {r.get('fused')} "
                     f"partner {r.get('partner')} ids {r.get('neighbour_ids')}")
                if algorithm == "defkt":  # the knowledge transfer ran on the receiver's data
                    need(isinstance(r.get("transfer_kl"), float) and r["transfer_kl"] >= 0,
                         f"round {t}: {n} transfer_kl {r.get('transfer_kl')}")
        need(fused >= ROUNDS - 1, f"{fused} fusions in {ROUNDS} rounds")
    else:
        problems.append(f"{algorithm}: no evidence rule (a new algorithm: add it to a family)")
    return problems


@needs_mosquitto
def test_every_algorithm_runs_on_three_always_on_agents(tmp_path):
    fed = "matrix-" + str(int(time.time() * 1000) % 100000)
    fed_key = Ed25519PrivateKey.generate()
    algorithms = json.loads(dflctl("algorithms", "--json"))["algorithms"]
    assert len(algorithms) == 18 and set(algorithms) == NEIGHBOURHOOD | ROTATING | PAIRING | LOCKSTEP | LOCAL
    procs: dict[str, subprocess.Popen] = {}
    logs = [tmp_path / f"{n}.log" for n in IDS]
    with start_broker("mosquitto") as broker:
        b = ["--broker", broker.endpoint, "--federation", fed]
        op = _operator(tmp_path, fed, fed_key)
        try:
            for i, nid in enumerate(IDS):
                path = _config(tmp_path, fed, nid, i, broker.endpoint, fed_key)
                procs[nid] = subprocess.Popen(
                    [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                    stdout=open(tmp_path / f"{nid}.log", "a"), stderr=subprocess.STDOUT)
            runs: dict[str, str] = {}
            for algorithm in algorithms:  # queued in submission order
                opts = [x for o in OPTIONS.get(algorithm, []) for x in ("--option", o)]
                runs[algorithm] = dflctl("run", "submit", *b, "--operator-dir", str(op), "--algorithm", algorithm,
                                         "--rounds", str(ROUNDS), "--model-size", "small", "--min-members", "3",
                                         "--start-timeout", "300", "--name", algorithm, *opts)
            end = time.monotonic() + 1500
            finished_at: dict[str, float] = {}
            t0 = time.monotonic()
            while time.monotonic() < end and len(finished_at) < len(runs):
                ledgers = {n: _ledger(tmp_path, n) for n in IDS}
                for algorithm, rid in runs.items():
                    states = {ledgers[n].get(rid, {}).get("state") for n in IDS}
                    if algorithm not in finished_at and states <= {"finished", "failed", "cancelled", "declined"} \
                            and None not in states:
                        finished_at[algorithm] = time.monotonic() - t0
                if any(p.poll() is not None for p in procs.values()):
                    break
                time.sleep(1.0)
            ledgers = {n: _ledger(tmp_path, n) for n in IDS}
            problems: list[str] = []
            for algorithm, rid in runs.items():
                states = {n: ledgers[n].get(rid, {}).get("state") for n in IDS}
                if set(states.values()) != {"finished"}:
                    problems.append(f"{algorithm}: run states {states} "
                                    f"{[ledgers[n].get(rid, {}).get('reason') for n in IDS]}")
                    continue
                problems += check_run(algorithm, {n: _metrics(tmp_path, n, rid) for n in IDS})
            print("run end times (s since submission):", json.dumps({a: round(s) for a, s in finished_at.items()}))
            assert all(p.poll() is None for p in procs.values()), "an agent exited"
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs) if problems else ""
            assert not problems, "\n".join(problems) + "\n" + tails
        finally:
            for p in procs.values():
                p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    for log in logs:
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
