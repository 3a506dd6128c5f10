"""The always-on agent's liveness registry: the systemd watchdog is fed only while every
long-lived task and thread is alive; a dead one is restarted and counted, or fails the
service.  The watchdog pings go over the real sd_notify protocol (an AF_UNIX datagram
socket, as systemd binds it)."""

import asyncio
import socket
import threading
import time

import pytest

from dfl_agent.runtime.service.liveness import Liveness
from dfl_agent.runtime.service.systemd import Notifier
from tests.watchdog import watchdog_loop


class NotifySocket:
    """What systemd does: a bound AF_UNIX datagram socket; records (time, message)."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while not self._stop:
            try:
                self.messages.append((time.monotonic(), self.sock.recv(4096).decode()))
            except TimeoutError:
                continue
            except OSError:
                return

    def pings(self):
        return [t for t, m in list(self.messages) if "WATCHDOG=1" in m.split("\n")]

    def close(self):
        self._stop = True
        self._thread.join(1)
        self.sock.close()


class Worker:
    """A long-lived thread that runs until told to die (as the run listener's thread)."""

    def __init__(self):
        self.starts = 0
        self.thread = None
        self.start()

    def start(self):
        self.starts += 1
        self.die = threading.Event()
        self.thread = threading.Thread(target=self.die.wait, daemon=True)
        self.thread.start()

    def alive(self):
        return self.thread.is_alive()

    def kill(self):
        self.die.set()
        self.thread.join(1)


def _notifier(sink, liveness):
    n = Notifier(sink.path, env={"WATCHDOG_USEC": "100000"})
    n.alive = liveness.alive
    return n


def test_a_dead_thread_stops_the_watchdog_pings(tmp_path):
    sink = NotifySocket(tmp_path / "notify.sock")
    liveness = Liveness()
    worker = Worker()
    liveness.watch("run listener", worker.alive)  # no restart: a death fails the service
    n = _notifier(sink, liveness)
    marks = {}

    async def main():
        task = asyncio.ensure_future(watchdog_loop(n, 0.05))
        await asyncio.sleep(0.5)
        worker.kill()
        marks["died"] = time.monotonic()
        await asyncio.sleep(0.5)
        task.cancel()

    asyncio.run(main())
    sink.close()
    pings = sink.pings()
    assert len([t for t in pings if t < marks["died"]]) >= 4
    assert [t for t in pings if t > marks["died"] + 0.02] == []  # systemd restarts the service
    assert liveness.failed == "run listener" and n.withheld >= 5


def test_a_dead_thread_is_restarted_and_counted_until_its_restarts_are_used_up(tmp_path, caplog):
    sink = NotifySocket(tmp_path / "notify.sock")
    liveness = Liveness(max_restarts=2)
    worker = Worker()
    liveness.watch("run listener", worker.alive, worker.start)
    n = _notifier(sink, liveness)
    marks = {}

    async def main():
        task = asyncio.ensure_future(watchdog_loop(n, 0.05))
        for i in range(3):
            await asyncio.sleep(0.3)
            worker.kill()
            marks[i] = time.monotonic()
        await asyncio.sleep(0.4)
        task.cancel()

    asyncio.run(main())
    sink.close()
    pings = sink.pings()
    # the first two deaths: restarted, the pings go on; the third: no restart left, pings stop
    assert len([t for t in pings if marks[0] < t < marks[1]]) >= 3
    assert len([t for t in pings if marks[1] < t < marks[2]]) >= 3
    assert [t for t in pings if t > marks[2] + 0.02] == []
    assert worker.starts == 3 and liveness.status() == {"run listener": 2}
    assert liveness.failed == "run listener"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("run listener died" in w and "restart 1 of 2" in w for w in warnings), warnings
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(e.startswith("run listener died") and "exit code 1" in e for e in errors), errors


def test_a_task_that_raises_is_restarted_and_counted_then_fails_the_service(caplog):
    runs = []

    async def ingestion():
        runs.append(time.monotonic())
        await asyncio.sleep(0.01)
        raise OSError("disk gone")

    async def main():
        liveness = Liveness(max_restarts=3)
        liveness.spawn("ingestion", ingestion)
        failed = await asyncio.wait_for(liveness.wait_failed(interval=0.05), 5)
        return liveness, failed

    liveness, failed = asyncio.run(main())
    assert failed == "ingestion" and len(runs) == 4  # first start + 3 restarts
    assert liveness.status() == {"ingestion": 3} and not liveness.alive()
    assert any("ingestion died (OSError: disk gone)" in r.getMessage() for r in caplog.records
               if r.levelname == "ERROR")


def test_a_task_that_returns_or_is_cancelled_has_ended_and_is_not_restarted():
    async def main():
        liveness = Liveness()
        done = liveness.spawn("once", lambda: asyncio.sleep(0))  # returns at once
        long = liveness.spawn("status", lambda: asyncio.sleep(60))
        await asyncio.sleep(0.05)
        liveness.cancel()
        await asyncio.sleep(0.01)
        return liveness, done, long

    liveness, done, long = asyncio.run(main())
    assert done.done() and long.cancelled()
    assert liveness.status() == {"once": 0, "status": 0} and liveness.failed is None and liveness.alive()


def test_without_a_watchdog_the_probes_cost_nothing():
    liveness = Liveness()
    calls = []
    liveness.watch("x", lambda: calls.append(1) or True)
    n = Notifier(env={})  # not under systemd
    n.alive = liveness.alive
    assert n.watchdog() is False and calls == []
    with pytest.raises(ValueError):
        Liveness(max_restarts=-1)


def _counters(tmp_path):
    from dfl_agent.runtime.service.lobby import RunLobby
    from dfl_agent.runtime.service.service_counters import ServiceCounters
    from dfl_agent.runtime.shared.config import config_from_dict
    from dfl_agent.runtime.shared.descriptor import RunVerifier

    cfg = config_from_dict({"federation": "f", "node_id": "n0", "state_dir": str(tmp_path)})
    return ServiceCounters(tmp_path, RunLobby(cfg, "n0", RunVerifier("f", require_signatures=False)))


def test_task_restarts_are_in_the_status_and_not_saved(tmp_path):
    """The service's counters carry ``task_restarts`` into every status (idle: the lobby's;
    training: the run node's), but counters.json keeps only the refusal and drop counters."""
    import json

    from dfl_agent.runtime.service.service_counters import COUNTERS_FILE

    counters, liveness = _counters(tmp_path), Liveness()
    worker = Worker()
    liveness.watch("run listener", worker.alive, worker.start)
    counters.fields["task_restarts"] = liveness.status
    counters.lobby.verifier.refused["cancelled"] = 1
    worker.kill()
    assert liveness.alive() and counters.view() == {"runs_refused": {"cancelled": 1}, "control_dropped": {},
                                                    "task_restarts": {"run listener": 1}}
    assert counters.save()
    saved = json.loads((tmp_path / COUNTERS_FILE).read_text())
    assert "task_restarts" not in saved and saved["runs_refused"] == {"cancelled": 1}


def test_the_counter_saving_task_is_watched(tmp_path, monkeypatch):
    """A saving task that fails (a save that raises what it does not catch) is started
    again and counted; stop_saving still ends it and saves."""
    counters, calls = _counters(tmp_path), []
    real_save = counters.save

    def save():
        calls.append(1)
        if len(calls) == 1:
            raise TypeError("not JSON serialisable")
        return real_save()

    monkeypatch.setattr(counters, "save", save)

    async def main():
        liveness = Liveness()
        counters.start_saving(0.02, liveness)
        await asyncio.sleep(0.3)
        liveness.cancel()
        await counters.stop_saving()
        return liveness

    liveness = asyncio.run(main())
    assert liveness.status() == {"counter saving": 1} and liveness.failed is None and len(calls) >= 3
