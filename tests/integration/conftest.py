"""Fixtures for integration tests: real local MQTT brokers on 127.0.0.1.

* ``mosquitto_broker``, ``mosquitto_broker2``: module-scoped mosquitto brokers
  (skipped when mosquitto is not installed).
* ``amqtt_broker``: module-scoped amqtt broker (skipped without amqtt).
* ``fresh_mosquitto``: a function-scoped mosquitto, for tests that restart or limit it.
* ``federation``: a federation id unique to the test, so retained presence/status
  messages of other tests on a shared broker do not leak in.
* :func:`login_mosquitto`: a mosquitto that lets no anonymous client in, with a password
  file and an ACL file (e.g. those ``dflctl keys enroll`` writes).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dfl_agent.cli.broker import amqtt_available, free_port, mosquitto_path, start_broker

MOSQUITTO_MISSING = "mosquitto is not installed (apt install mosquitto)"
AMQTT_MISSING = "amqtt is not installed (pip install 'dfl-agent[broker]')"

requires_mosquitto = pytest.mark.skipif(mosquitto_path() is None, reason=MOSQUITTO_MISSING)
requires_amqtt = pytest.mark.skipif(not amqtt_available(), reason=AMQTT_MISSING)


def _mosquitto(**kwargs):
    if mosquitto_path() is None:
        pytest.skip(MOSQUITTO_MISSING)
    return start_broker("mosquitto", **kwargs)


@pytest.fixture(scope="module")
def mosquitto_broker():
    with _mosquitto() as broker:
        yield broker


@pytest.fixture(scope="module")
def mosquitto_broker2():
    with _mosquitto() as broker:
        yield broker


@pytest.fixture(scope="module")
def amqtt_broker():
    if not amqtt_available():
        pytest.skip(AMQTT_MISSING)
    with start_broker("amqtt") as broker:
        yield broker


@pytest.fixture
def fresh_mosquitto():
    with _mosquitto() as broker:
        yield broker


@pytest.fixture
def federation() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def login_mosquitto(passwd: Path, acl: Path, workdir: Path) -> Iterator[str]:
    """A mosquitto on 127.0.0.1 with ``allow_anonymous false``, ``password_file passwd`` and
    ``acl_file acl``; yields its ``host:port``.  Its log is ``workdir/broker.log``; the files
    must be readable by the user it runs as (as root it stays root).

    Raises:
        RuntimeError: the broker did not come up (its log in the message).
    """
    if mosquitto_path() is None:
        pytest.skip(MOSQUITTO_MISSING)
    port = free_port()
    conf, log = workdir / "mosquitto.conf", workdir / "broker.log"
    conf.write_text("\n".join([
        "per_listener_settings false", "persistence false", "log_dest stderr", f"listener {port} 127.0.0.1",
        "allow_anonymous false", f"password_file {passwd}", f"acl_file {acl}",
        *(["user root"] if os.geteuid() == 0 else []), ""]))
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(mosquitto_path()), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=out)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not start: {log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(5)
