"""Ctrl-C during ``dflctl run submit`` says whether the run was published (real mosquitto,
``dflctl`` as a subprocess, SIGINT as a terminal sends it): interrupted while it waits for the
devices' answers, the run stands and the line says so with its id; interrupted before anything
was sent (a broker that never answers the connection), nothing was published.  Exit 130."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from dfl_agent.cli.fleet import fetch_retained
from dfl_agent.runtime.shared.descriptor import run_topic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT at its default, as a terminal's foreground process has it
    (a test run started in the background of a shell ignores SIGINT, and children inherit that;
    the programs rightly leave an ignored SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _submit(tmp_path: Path, broker: str, fed: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    err = tmp_path / "stderr"
    proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.cli.dflctl", "run", "submit", "--broker", broker,
                             "--federation", fed, "--algorithm", "fedavg", "--rounds", "1", "--run-id", "r-int",
                             *extra], stdout=subprocess.PIPE, stderr=open(err, "wb"), text=True, preexec_fn=_as_from_a_terminal)
    return proc, err


def _until(cond, proc: subprocess.Popen, err: Path, what: str) -> None:
    end = time.monotonic() + 60
    while not cond():
        assert proc.poll() is None, f"dflctl ended (exit {proc.returncode}) before {what}: {err.read_text()}"
        assert time.monotonic() < end, f"no {what}: {err.read_text()}"
        time.sleep(0.05)


def test_ctrl_c_while_waiting_for_answers_says_the_run_was_published(mosquitto_broker, federation, tmp_path):
    host, port = mosquitto_broker.endpoint.rsplit(":", 1)
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.connect(host, int(port))
    c.loop_start()  # a device whose retained status is there, and which does not answer (switched off)
    c.publish(f"dfl/{federation}/node/n0/status", json.dumps({"node_id": "n0", "state": "idle", "time": time.time()}),
              qos=1, retain=True).wait_for_publish(5)
    c.disconnect()
    c.loop_stop()
    proc, err = _submit(tmp_path, mosquitto_broker.endpoint, federation)  # --wait 10 s by default
    _until(lambda: "waiting up to 10 s for the answers of 1 device(s)" in err.read_text(), proc, err, "the wait")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    text = err.read_text()
    assert proc.returncode == 130, text
    assert out.strip() == "r-int"  # the run id on stdout, as when it completes
    assert "dflctl run submit: interrupted; run r-int was published and stands (follow it: dflctl run show r-int " \
           "--broker" in text, text
    assert "Traceback" not in text
    assert fetch_retained(mosquitto_broker.endpoint, run_topic(federation, "r-int")) is not None


def test_ctrl_c_before_anything_was_sent_says_nothing_was_published(tmp_path):
    srv = socket.create_server(("127.0.0.1", 0))  # accepts the connection, never answers it
    accepted: list[socket.socket] = []
    srv.settimeout(0.05)
    proc, err = _submit(tmp_path, f"127.0.0.1:{srv.getsockname()[1]}", "f", "--timeout", "60")
    try:
        def connected() -> bool:
            with contextlib.suppress(TimeoutError):
                accepted.append(srv.accept()[0])
            return bool(accepted)

        _until(connected, proc, err, "a connection")
        time.sleep(0.3)  # dflctl waits for the broker's CONNACK
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        for s in (*accepted, srv):
            s.close()
    text = err.read_text()
    assert proc.returncode == 130 and out == "", text
    assert text.strip() == "dflctl run submit: interrupted; nothing was published", text
