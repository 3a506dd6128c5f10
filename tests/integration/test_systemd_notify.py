"""sd_notify over a real NOTIFY_SOCKET datagram socket: READY, STATUS, WATCHDOG from a
real agent process (and RELOADING on SIGHUP, STOPPING at the end); watchdog pings
stop while the event loop is blocked."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dfl_agent.runtime.service.systemd import Notifier
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.runtime.shared.logs import JournalFormatter
from tests.watchdog import watchdog_loop

pytestmark = pytest.mark.integration


class NotifySocket:
    """What systemd does: a bound AF_UNIX datagram socket; records (time, message)."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def having(self, key):
        return [(t, m) for t, m in list(self.messages) if any(line.startswith(key) for line in m.split("\n"))]

    def wait_for(self, key, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.having(key):
                return True
            time.sleep(0.05)
        return False

    def close(self):
        self._stop = True
        self.sock.close()


def test_watchdog_pings_stop_while_the_loop_is_blocked(tmp_path):
    sink = NotifySocket(tmp_path / "n.sock")
    n = Notifier(sink.path, env={"WATCHDOG_USEC": "100000"})
    assert n.watchdog_interval() == pytest.approx(0.05)
    marks = {}

    async def main():
        task = asyncio.ensure_future(watchdog_loop(n, 0.05, lambda: "running"))
        await asyncio.sleep(0.5)
        marks["block_start"] = time.monotonic()
        time.sleep(1.0)  # the event loop is stuck (a blocking call on the loop)
        marks["block_end"] = time.monotonic()
        await asyncio.sleep(0.5)
        task.cancel()

    asyncio.run(main())
    time.sleep(0.2)
    sink.close()
    pings = [t for t, _ in sink.having("WATCHDOG=1")]
    before = [t for t in pings if t < marks["block_start"]]
    during = [t for t in pings if marks["block_start"] + 0.02 < t < marks["block_end"]]
    after = [t for t in pings if t > marks["block_end"]]
    assert len(before) >= 4 and len(after) >= 3
    assert during == []  # no ping while the loop was blocked: systemd would restart us
    assert sink.having("STATUS=running")


def test_notifier_without_socket_is_a_noop_and_abstract_names_work(tmp_path):
    assert Notifier(env={}).ready() is False
    assert Notifier(env={"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval() is None
    name = f"dfl-test-{os.getpid()}-{time.monotonic_ns()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(b"\0" + name.encode())
    srv.settimeout(2)
    assert Notifier("@" + name).status("hello\nworld")
    assert srv.recv(100) == b"STATUS=hello world"
    srv.close()


def test_journal_formatter_priorities():
    import logging

    rec = logging.LogRecord("dfl_agent.daemon", logging.WARNING, __file__, 1, "peer %s lost\nagain", ("a",), None)
    assert JournalFormatter().format(rec) == "<4>dfl_agent.daemon: peer a lost | again"


#: how a test starts an agent process (a meta-test swaps in a deliberately broken agent)
AGENT = [sys.executable, "-m", "dfl_agent.runtime.service.daemon"]


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_agent_process_notifies_ready_status_watchdog_and_reloads(tmp_path, mosquitto_broker, federation):
    """READY, STATUS, WATCHDOG and checkpoints from a training agent; SIGHUP while it trains:
    RELOADING=1, the new log level applied (debug lines appear), READY=1 again, training goes
    on; a broken file on SIGHUP is refused and the agent keeps running; SIGTERM: STOPPING=1."""
    sink = NotifySocket(tmp_path / "notify.sock")
    cfg = config_from_dict({
        "federation": federation, "node_id": "sd0", "state_dir": str(tmp_path / "state"),
        "algorithm": {"name": "local", "rounds": 100000},  # still training when the signals come
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"size": "small"}, "training": {"steps": 2},
        "mqtt": {"broker": mosquitto_broker.endpoint, "heartbeat_interval": 0.5},
        "discovery": {"mdns": False},
    })
    path = tmp_path / "node.toml"
    path.write_text(dump_toml(cfg))
    env = {**os.environ, "NOTIFY_SOCKET": sink.path, "WATCHDOG_USEC": "400000"}
    log_path = tmp_path / "agent.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([*AGENT, "run", "--once", "--config", str(path)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)

    def text() -> str:
        return log_path.read_text()

    def trained_rounds() -> int:
        return len(re.findall(r"round \d+ done", text()))

    try:
        assert sink.wait_for("READY=1", 180), text()[-2000:]
        assert _wait(lambda: trained_rounds() >= 2, 90), text()[-2000:]
        assert " DEBUG " not in text()  # log level info so far
        # SIGHUP while training: the new log level is applied
        path.write_text(dump_toml(cfg).replace('log_level = "info"', 'log_level = "debug"'))
        proc.send_signal(signal.SIGHUP)
        assert sink.wait_for("RELOADING=1", 30), sink.messages
        assert _wait(lambda: "applied runtime.log_level" in text(), 30), text()[-2000:]
        assert _wait(lambda: len(sink.having("READY=1")) >= 2, 30), sink.messages
        at_reload = trained_rounds()
        assert _wait(lambda: " DEBUG " in text().split("applied runtime.log_level", 1)[1], 30), text()[-2000:]
        assert _wait(lambda: trained_rounds() >= at_reload + 2, 60), text()[-2000:]  # training goes on
        # a broken file: refused, the running configuration kept, READY again, still training
        path.write_text("federation = [unclosed\n")
        proc.send_signal(signal.SIGHUP)
        assert _wait(lambda: "reload: configuration error, keeping the running one" in text(), 30), text()[-2000:]
        assert _wait(lambda: len(sink.having("READY=1")) >= 3, 30), sink.messages
        at_bad = trained_rounds()
        assert _wait(lambda: trained_rounds() >= at_bad + 2, 60) and proc.poll() is None, text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        sink.close()
    assert sink.having("WATCHDOG=1"), sink.messages
    statuses = [m for _, m in sink.having("STATUS=")]
    assert any("round" in m and "peers" in m for m in statuses), statuses
    assert sink.having("STOPPING=1")
    # checkpoints after every round, the newest two kept
    kept = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "state" / "checkpoints").glob("round-*.json"))
    assert len(kept) == 2 and kept[1] == kept[0] + 1 and kept[1] >= trained_rounds() - 1, kept


# an always-on agent whose run listener thread can be killed from outside: a message on
# dfl/{fed}/run/kill-listener raises inside paho's callback, which ends paho's network thread
# (as an unexpected error in the listener did); everything else is the real agent
_KILLABLE_LISTENER = """
import sys
from dfl_agent.runtime.service import lobby
real = lobby.RunLobby._on_message
def on_message(self, client, userdata, msg):
    if msg.topic.endswith("/run/kill-listener"):
        raise RuntimeError("the test ends the run listener's thread")
    return real(self, client, userdata, msg)
lobby.RunLobby._on_message = on_message
from dfl_agent.runtime.service.daemon import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_dead_run_listener_is_restarted_counted_and_then_ends_the_agent(tmp_path, mosquitto_broker, federation):
    """An always-on agent under a watchdog: its run listener's thread dies and is restarted
    (WARNING, ``task_restarts`` in its status), three times, each time subscribed again (the
    next kill message reaches it); the fourth death ends the agent with exit code 1 and an
    ERROR naming the listener, so that systemd restarts it.
    (Before, the dead listener left the agent deaf to runs while its status heartbeat and
    the watchdog pings went on.)"""
    import json

    import paho.mqtt.client as mqtt
    import paho.mqtt.publish as publish

    sink = NotifySocket(tmp_path / "notify.sock")
    cfg = config_from_dict({
        "federation": federation, "node_id": "sd1", "state_dir": str(tmp_path / "state"),
        "data": {"dataset": "digits"}, "discovery": {"mdns": False},
        "mqtt": {"broker": mosquitto_broker.endpoint, "heartbeat_interval": 0.3},
    })
    path = tmp_path / "node.toml"
    path.write_text(re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n|\n)*", "", dump_toml(cfg)))  # no default run
    host, port = mosquitto_broker.endpoint.rsplit(":", 1)
    statuses: list[dict] = []
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    sub.on_message = lambda c, u, m: statuses.append(json.loads(m.payload).get("payload", {}))  # the envelope's
    sub.connect(host, int(port))
    sub.subscribe(f"dfl/{federation}/node/sd1/status")
    sub.loop_start()
    log_path = tmp_path / "agent.log"
    env = {**os.environ, "NOTIFY_SOCKET": sink.path, "WATCHDOG_USEC": "600000"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE_LISTENER, "run", "--config", str(path)],
                            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)

    def text() -> str:
        return log_path.read_text()

    def kill_listener() -> None:
        publish.single(f"dfl/{federation}/run/kill-listener", b"x", hostname=host, port=int(port))

    def restarts() -> int | None:
        return statuses[-1].get("task_restarts", {}).get("run listener") if statuses else None

    try:
        assert _wait(lambda: "waiting for runs" in text() and restarts() == 0, 60), text()[-2000:]
        assert sink.having("READY=1") and sink.having("WATCHDOG=1")
        for n in (1, 2, 3):
            kill_listener()
            assert _wait(lambda: f"restart {n} of 3" in text() and restarts() == n, 20), text()[-2000:]
        kill_listener()
        assert proc.wait(timeout=60) == 1, text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        sub.loop_stop()
        sink.close()
    errors = [line for line in text().splitlines() if " ERROR " in line]
    assert any("run listener died" in line and "exit code 1" in line for line in errors), errors
    assert sink.having("STOPPING=1")
