"""Fault injection on real agent processes and a real mosquitto (CI-sized; the full
runs and their report are in bench/faults/).

* kill -9 of random agents, restarted (``runtime.rejoin``), plus a broker restart
  mid-run: every agent finishes all rounds, no round lasts longer than two round
  deadlines.
* packet loss (root only, the field lab's network: ``dfl_agent.cli.lab.net.LabNet``):
  three agents in their own namespaces, 10% random loss each way on every agent's link
  (netem where the kernel has it, else iptables ``statistic``; no delay, which needs
  netem); every round a node runs uses its peers' updates, and most nodes run every round
  (under the default quorum a node that fell behind may skip rounds or end early).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from dfl_agent.cli.chaos import ChaosOptions, run_chaos
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
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


def _lab_blocker() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "the field lab's network needs Linux and root"
    from tests.field.conftest import lab_unavailable

    return lab_unavailable()


LOSS, ROUNDS = 0.10, 4


def _dropped(lab, host: str) -> int:
    """Packets the host's loss dropped: its iptables DROP rules' counters, or netem's."""
    ns = lab.hosts[host].netns
    if lab.mechanisms.loss == "iptables":
        out = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-w", "-L", "-v", "-n", "-x"],
                             capture_output=True, text=True, check=True).stdout
        return sum(int(line.split()[0]) for line in out.splitlines() if " DROP " in f" {line} ")
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(n) for n in re.findall(r"dropped (\d+)", out))


@needs_mosquitto
def test_packet_loss_in_lab_namespaces(tmp_path):
    if why := _lab_blocker():
        pytest.skip(why)
    from dfl_agent.cli.lab.net import LabNet

    ids = ["n0", "n1", "n2"]
    with LabNet() as lab:
        lab.add_site("s")
        broker = lab.add_host("broker", "s")
        for nid in ids:
            lab.add_host(nid, "s", loss=LOSS)  # both directions of the agent's link
        conf = tmp_path / "mosquitto.conf"
        conf.write_text(f"listener 1883 {broker.address}\nallow_anonymous true\n")
        lab.popen("broker", ["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs = {}
        for i, nid in enumerate(ids):
            state = tmp_path / nid
            raw = {"federation": "loss", "node_id": nid, "state_dir": str(state),
                   "algorithm": {"name": "fedavg", "rounds": ROUNDS, "options": {"round_timeout": 30.0}},
                   "data": {"dataset": "digits", "partition": "iid", "num_nodes": 3, "node_index": i},
                   "model": {"size": "small"}, "training": {"steps": 2, "threads": 1},
                   "mqtt": {"broker": f"{broker.address}:1883", "heartbeat_interval": 1.0},
                   "discovery": {"mdns": False, "min_peers": 2, "start_timeout": 90.0},
                   "runtime": {"metrics_file": str(state / "metrics.jsonl")}}
            path = tmp_path / f"{nid}.toml"
            path.write_text(dump_toml(config_from_dict(raw)))
            procs[nid] = lab.popen(nid, [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once",
                                         "--config", str(path)],
                                   stdout=open(tmp_path / f"{nid}.log", "w"), stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + 240
        while time.monotonic() < end and any(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        codes = {nid: p.poll() for nid, p in procs.items()}
        for p in procs.values():
            lab.stop(p)
        dropped = {nid: _dropped(lab, nid) for nid in ids}
    assert all(n > 0 for n in dropped.values()), dropped  # the loss hit the agents' traffic
    logs = {nid: (tmp_path / f"{nid}.log").read_text()[-1500:] for nid in ids}
    assert codes == dict.fromkeys(ids, 0), (codes, logs)
    complete = 0
    for nid in ids:
        recs = [json.loads(line) for line in (tmp_path / nid / "metrics.jsonl").read_text().splitlines()]
        rounds = [r["round"] for r in recs]
        # the agent's default, runtime.straggler = "quorum": a node that fell behind skips towards its
        # neighbours' round, and ends its run after the round it is in once most have finished
        assert rounds == sorted(set(rounds)) and rounds[0] == 1 and rounds[-1] <= ROUNDS, (nid, rounds)
        complete += rounds[-1] == ROUNDS
        # every round used its peers' updates (none closed alone at its deadline)
        taken = [(r["round"], r["updates_taken"], r["alone"]) for r in recs]
        assert all(n >= 1 and not alone for _, n, alone in taken), (nid, taken, logs[nid])
    assert complete >= 2, complete  # most of the members ran every round
