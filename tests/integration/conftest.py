"""Fixtures for integration tests: real local MQTT brokers on 127.0.0.1.

* ``mosquitto_broker``, ``mosquitto_broker2``: module-scoped mosquitto brokers
  (skipped when mosquitto is not installed).
* ``amqtt_broker``: module-scoped amqtt broker (skipped without amqtt).
* ``fresh_mosquitto``: a function-scoped mosquitto, for tests that restart or limit it.
* ``federation``: a federation id unique to the test, so retained presence/status
  messages of other tests on a shared broker do not leak in.
"""

from __future__ import annotations

import uuid

import pytest

from dfl_agent.cli.broker import amqtt_available, mosquitto_path, start_broker

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
