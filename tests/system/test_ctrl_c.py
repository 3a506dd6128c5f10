"""Ctrl-C: every ``dflctl`` command exits 130 after one line "interrupted" on stderr, also while
it starts (its modules still loading), and so do ``dfl-agent`` and ``dfl-infer``; ``dflctl
demo`` stops its agents within 5 s and still writes its report, marked incomplete.

SIGINT goes to the command's whole process group, as a terminal's Ctrl-C does (the demo's
agents and broker get it too)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from dfl_agent.cli.broker import start_broker
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.integration, needs_mosquitto]

DFLCTL = [sys.executable, "-m", "dfl_agent.cli.dflctl"]


def _wait(cond, timeout: float, what: str, *files) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(f.read_text()[-2000:] for f in files))


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT at its default, as a terminal's foreground process has it
    (a test run started in the background of a shell ignores SIGINT, and children inherit that;
    the programs rightly leave an ignored SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_ctrl_c_in_watch_is_one_line_and_exit_130(tmp_path):
    """``dflctl watch`` stopped with Ctrl-C (at 0c2393f: exit 0 and nothing said)."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with start_broker("mosquitto") as broker:
        proc = subprocess.Popen([*DFLCTL, "watch", "--broker", broker.endpoint, "--federation", "quiet",
                                 "--interval", "0.2"], stdout=open(out, "w"), stderr=open(err, "w"),
                                start_new_session=True, preexec_fn=_as_from_a_terminal)
        try:
            _wait(lambda: "peers" in out.read_text(), 60, "the first frame", out, err)
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(20) == 130, err.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert err.read_text().splitlines()[-1] == "dflctl: interrupted"
    assert "Traceback" not in err.read_text()


def test_ctrl_c_stops_the_demos_agents_within_5_s_and_leaves_a_partial_report(tmp_path):
    """``dflctl demo`` (2 agents, 1000 rounds) gets Ctrl-C after every agent did a round: all
    agents are gone within 5 s, the demo exits 130 with "interrupted", and summary.json says
    the report is incomplete and how many rounds each node did (at 0c2393f: no summary, and
    the agents were stopped one after the other, up to 15 s each)."""
    report = tmp_path / "report"
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    proc = subprocess.Popen([*DFLCTL, "demo", "--no-live", "--nodes", "2", "--rounds", "1000", "--algorithm",
                             "fedavg", "--broker", "mosquitto", "--round-timeout", "5", "--out", str(report)],
                            stdout=open(out, "w"), stderr=open(err, "w"), start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:
        ids: list[str] = []

        def a_round_each() -> bool:
            ids[:] = sorted({line.split()[0] for line in out.read_text().splitlines() if " round " in line})
            return len(ids) == 2

        _wait(a_round_each, 120, "a round on each agent", out, err)
        agents = [p.pid for p in psutil.Process(proc.pid).children()
                  if "dfl_agent.runtime.service.daemon" in " ".join(p.cmdline())]
        assert len(agents) == 2
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        _wait(lambda: all(_gone(pid) for pid in agents), 10, "the agents to stop", out, err)
        stopped_s = time.monotonic() - sent
        assert proc.wait(60) == 130, out.read_text()[-2000:] + err.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert stopped_s < 5.0, stopped_s
    assert err.read_text().splitlines()[-1] == "dflctl: interrupted", err.read_text()[-2000:]
    assert "Traceback" not in err.read_text()
    summary = json.loads((report / "summary.json").read_text())
    assert summary["complete"] is False and summary["interrupted"] is True
    # rounds_per_node: the rounds with a record in metrics.jsonl; rounds_reported: the last round
    # each node's status reported (a record may still have been waiting for its evaluation)
    assert set(summary["rounds_reported"]) == set(ids) and all(r >= 1 for r in summary["rounds_reported"].values())
    assert all(summary["rounds_per_node"][n] <= summary["rounds_reported"][n] for n in ids)
    assert "partial report (incomplete: interrupted)" in out.read_text()


def test_ctrl_c_stops_the_feed_demos_agents_and_run_processes_within_5_s(tmp_path):
    """``dflctl demo --feed`` (always-on agents, each training its run in a run process) gets
    Ctrl-C once the first run is submitted: every agent process and run process is gone within
    5 s, exit 130, and summary.json is marked incomplete with the run each agent was in."""
    report = tmp_path / "report"
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    proc = subprocess.Popen([*DFLCTL, "demo", "--feed", "--no-live", "--nodes", "2", "--rounds", "200", "--runs", "2",
                             "--broker", "mosquitto", "--out", str(report)],
                            stdout=open(out, "w"), stderr=open(err, "w"), start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:
        def agents() -> list[int]:
            return [p.pid for p in psutil.Process(proc.pid).children(recursive=True)
                    if "dfl_agent.runtime" in " ".join(p.cmdline())]

        _wait(lambda: "run 1" in out.read_text() and len(agents()) >= 2, 120, "the agents and run 1", out, err)
        time.sleep(1.0)
        pids = agents()
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        _wait(lambda: all(_gone(pid) for pid in pids), 10, "the agents to stop", out, err)
        stopped_s = time.monotonic() - sent
        assert proc.wait(60) == 130, out.read_text()[-2000:] + err.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert stopped_s < 5.0, stopped_s
    assert err.read_text().splitlines()[-1] == "dflctl: interrupted", err.read_text()[-2000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["complete"] is False and summary["interrupted"] is True and len(summary["reported"]) == 2
    assert "partial report (incomplete: interrupted)" in out.read_text()


def _program(script: str, module: str) -> list[str]:
    """The console script ``script`` of this environment (what a user runs), else ``python -m``."""
    path = Path(sys.executable).parent / script
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


def _interrupt(cmd: list[str], anchor: str, delay: float) -> tuple[int, list[str]]:
    """Start ``cmd`` with Python's import-time report on stderr (``PYTHONPROFILEIMPORTTIME``) and
    send SIGINT to its process group, as a terminal's Ctrl-C does, ``delay`` s after the import of
    module ``anchor`` completed.  Returns the exit code and the stderr lines that are not the
    import-time report."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True, preexec_fn=_as_from_a_terminal)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if not line.startswith("import time:"):
                lines.append(line.rstrip("\n"))
            elif line.rsplit("|", 1)[-1].strip() == anchor:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(60), f"{anchor} never imported: {lines[-20:]}"
        time.sleep(delay)
        assert proc.poll() is None, f"{cmd[-3:]} ended by itself before the SIGINT: {lines[-20:]}"
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    return rc, lines


#: when the SIGINT comes, after the first module of the program's own imports (argparse, which
#: each entry module imports first) loaded: within its start-up, until its command is running
STARTUP_DELAYS = (0.0, 0.03, 0.08, 0.15, 0.3, 0.6)


@pytest.fixture
def silent_broker():
    """A port that accepts TCP connections and never answers: a command waits on it until stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_ctrl_c_while_dflctl_starts_is_one_line_and_exit_130(silent_broker):
    """``dflctl peers`` interrupted at moments from its first import until it waits for the broker:
    every time exactly the line ``dflctl: interrupted`` and exit code 130 (at 75535c2 a Ctrl-C
    while the modules loaded printed a 20-36 line traceback ending in ``KeyboardInterrupt``)."""
    peers = ["peers", "--broker", silent_broker, "--federation", "x", "--timeout", "60"]
    probes = [(_program("dflctl", "dfl_agent.cli.dflctl"), "argparse", d) for d in STARTUP_DELAYS]
    probes.append((DFLCTL, "argparse", 0.05))  # python -m dfl_agent.cli.dflctl
    probes.append((_program("dflctl", "dfl_agent.cli.dflctl"), "dfl_agent.cli.observer", 0.0))  # peers running
    for cmd, anchor, delay in probes:
        rc, lines = _interrupt([*cmd, *peers], anchor, delay)
        assert (rc, lines) == (130, ["dflctl: interrupted"]), (cmd[-1], anchor, delay, rc, lines)


def test_ctrl_c_while_dfl_agent_or_dfl_infer_starts_is_one_line_and_exit_130(tmp_path, silent_broker):
    """The same for the agent (``dfl-agent run``: its start-up loads modules and checks the
    configuration before its event loop takes SIGINT over) and the inference member (``dfl-infer
    run``, also while it waits for the broker's answer: at 75535c2 that wait went on until its
    timeout, then a traceback)."""
    from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

    config = tmp_path / "node.toml"
    config.write_text(dump_toml(config_from_dict({
        "federation": "x", "node_id": "dev1", "state_dir": str(tmp_path / "state"),
        "mqtt": {"broker": silent_broker}, "discovery": {"mdns": False}})))
    agent = [*_program("dfl-agent", "dfl_agent.runtime.service.daemon"), "run", "--config", str(config)]
    infer = [*_program("dfl-infer", "dfl_agent.cli.infer"), "run", "--broker", silent_broker, "--timeout", "60",
             "--state-dir", str(tmp_path / "infer")]
    for delay in STARTUP_DELAYS[:4]:
        rc, lines = _interrupt(agent, "argparse", delay)
        # once its event loop runs, the agent logs its stop before the line
        assert rc == 130 and lines[-1] == "dfl-agent: interrupted", (delay, rc, lines)
        assert not any("Traceback" in x for x in lines), (delay, lines)
    for delay in STARTUP_DELAYS:
        rc, lines = _interrupt(infer, "argparse", delay)
        assert (rc, lines) == (130, ["dfl-infer: interrupted"]), (delay, rc, lines)
