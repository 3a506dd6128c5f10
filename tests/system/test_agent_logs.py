"""What real agents log about their broker and their peers (real mosquitto, real ``dfl-agent``
processes): a broker stopped under an always-on agent is one WARNING, its return an INFO line
with the outage's duration; a SIGKILLed peer is a WARNING naming it, a peer stopped with
SIGTERM an INFO clean leave; the end of a run is no departure at all."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.integration, needs_mosquitto]

AGENT = [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run"]
#: a line of the agent's text log that says a peer left, died or went away
DEPARTURE = re.compile(r"peer \S+ (left|lost its connection|not heard from)")


def _wait(cond, timeout: float, logs: list[Path], what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    # the head too: an agent that never got going says why at its start
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[:1500]}\n[...]\n{p.read_text()[-2500:]}" for p in logs)
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def _config(tmp: Path, fed: str, nid: str, broker: str, algorithm: dict | None = None, **sections) -> Path:
    raw = {"federation": fed, "node_id": nid, "state_dir": str(tmp / nid),
           "data": {"dataset": "digits", "partition": "iid", **sections.pop("data", {})},
           "model": {"size": "small"}, "training": {"steps": 2},
           "mqtt": {"broker": broker, "heartbeat_interval": 0.5, **sections.pop("mqtt", {})},
           "discovery": {"mdns": False, **sections.pop("discovery", {})}, **sections}
    if algorithm is not None:
        raw["algorithm"] = algorithm
    text = dump_toml(config_from_dict(raw))
    if algorithm is None:  # no default run: an always-on agent that waits for runs
        text = re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n|\n)*", "", text)
    path = tmp / f"{nid}.toml"
    path.write_text(text)
    return path


def _start(tmp: Path, nid: str, path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*AGENT, *args, "--config", str(path)], stdout=open(tmp / f"{nid}.log", "w"),
                            stderr=subprocess.STDOUT)


def test_an_always_on_agent_logs_its_broker_lost_and_back_with_the_outage(tmp_path):
    """mosquitto stopped for ~2 s under an idle always-on agent: one WARNING "lost broker",
    then one INFO "back after N s" (at 0c2393f the agent logged nothing at all)."""
    with start_broker("mosquitto") as broker:
        path = _config(tmp_path, "outage", "s0", broker.endpoint)
        proc = _start(tmp_path, "s0", path)
        log = tmp_path / "s0.log"
        try:
            _wait(lambda: "waiting for runs" in log.read_text(), 60, [log], "the agent to serve")
            time.sleep(1.0)  # connected
            broker.stop()
            _wait(lambda: "lost broker" in log.read_text(), 20, [log], "the lost broker's line")
            time.sleep(2.0)
            broker.start()
            _wait(lambda: "back after" in log.read_text(), 30, [log], "the broker's return")
            assert proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    lost = re.findall(rf"WARNING \S+: s0: lost broker {broker.endpoint} \(.+\); reconnecting", text)
    back = re.findall(rf"INFO \S+: s0: broker {broker.endpoint} back after (\d+\.\d) s \(\d+ reconnection attempts\)",
                      text)
    assert len(lost) == 1 and len(back) == 1, text
    assert 1.5 <= float(back[0]) < 30, text
    assert "Traceback" not in text


def test_a_killed_peer_is_a_warning_and_a_stopped_one_a_clean_leave(tmp_path):
    """Three training agents: c is SIGKILLed - a logs a WARNING naming c; then b stops with
    SIGTERM - a logs its clean leave at INFO, and never b's last will (a stop used to close its
    broker session without a DISCONNECT about one time in three, and the broker then published
    b's will after its "offline: stopping" presence)."""
    _killed_and_stopped(tmp_path / "try1")


def _killed_and_stopped(tmp_path):
    """One attempt: c is SIGKILLed - a logs a WARNING naming c (at 0c2393f: INFO "peer c left
    (offline)", invisible to ``journalctl -p warning``); then b stops with SIGTERM - a logs its
    clean leave at INFO."""
    tmp_path.mkdir(parents=True)
    with start_broker("mosquitto") as broker:
        ids = ("a", "b", "c")
        procs = {}
        for i, nid in enumerate(ids):
            path = _config(tmp_path, "departures", nid, broker.endpoint, {"name": "fedavg", "rounds": 100000},
                           # keepalive 3 s: the broker publishes a dead agent's will after ~4.5 s
                           data={"num_nodes": 3, "node_index": i}, mqtt={"keepalive": 3},
                           discovery={"min_peers": 2})
            procs[nid] = _start(tmp_path, nid, path, "--once")
        logs = [tmp_path / f"{n}.log" for n in ids]
        a_log = logs[0]
        try:
            _wait(lambda: all(re.search(r"round \d+ done", p.read_text()) for p in logs), 120, logs,
                  "a round on every agent")
            procs["c"].kill()
            procs["c"].wait(10)
            _wait(lambda: re.search(r"WARNING \S+: a: peer c ", a_log.read_text()), 30, logs, "a's warning about c")
            procs["b"].send_signal(signal.SIGTERM)
            assert procs["b"].wait(60) == 0
            _wait(lambda: "peer b left" in a_log.read_text(), 30, logs, "b's leave in a's log")
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                p.wait(60)
    text = a_log.read_text()
    assert re.search(r"WARNING \S+: a: peer c (lost its connection|not heard from)", text), text[-3000:]
    assert "peer c left" not in text
    assert re.search(r"INFO dfl_agent.peers: a: peer b left \(goodbye\)", text), text[-3000:]
    assert not re.search(r"WARNING \S+: a: peer b ", text), text[-3000:]


def test_the_end_of_a_run_logs_no_departure(tmp_path):
    """Two agents finish a 2-round run: neither logs that the other left (at 0c2393f every
    agent logged "peer X left (offline)" for its peers at the end of every run); the goodbye
    was heard and logged at DEBUG as the end of the peer's run.  When both finish within a few
    milliseconds, neither is still listening when the other's goodbye arrives (nothing to log):
    the run is repeated, up to ten times, until one of them heard it.  One attempt heard it in 8
    of 12 with the full suite running beside it, and three attempts in a row missed it in one CI
    run; ten miss together about once in 10^4 to 10^5 suites."""
    heard = False
    for attempt in range(10):
        texts = _two_finish(tmp_path / f"try{attempt}")
        for text in texts.values():
            assert "finished 2 rounds" in text, text[-3000:]
            assert not DEPARTURE.search(text), DEPARTURE.search(text)
        heard = any(re.search(r"DEBUG dfl_agent.peers: n\d: peer n\d ended its run", t) for t in texts.values())
        if heard:
            break
    assert heard


def _two_finish(tmp_path):
    """One attempt: two ``--once`` agents run 2 rounds; their logs."""
    tmp_path.mkdir(parents=True)
    with start_broker("mosquitto") as broker:
        ids = ("n0", "n1")
        procs = [_start(tmp_path, nid, _config(tmp_path, "runend", nid, broker.endpoint,
                                               {"name": "fedavg", "rounds": 2},
                                               data={"num_nodes": 2, "node_index": i},
                                               discovery={"min_peers": 1}, runtime={"log_level": "debug"}),
                        "--once")
                 for i, nid in enumerate(ids)]
        try:
            assert [p.wait(120) for p in procs] == [0, 0]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return {nid: (tmp_path / f"{nid}.log").read_text() for nid in ids}
