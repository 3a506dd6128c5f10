"""A broker that refuses the agent's credentials: the log line names the user and the keys to check."""

from __future__ import annotations

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from dfl_agent.transport.mqtt import refused


def test_refused_credentials_name_the_user_and_the_keys() -> None:
    for name in ("Not authorized", "Bad user name or password"):
        line = refused(ReasonCode(PacketTypes.CONNACK, name), "dev1")
        assert f"{name} as user 'dev1'" in line and "mqtt.username and mqtt.password" in line, line
    assert "no user name (anonymous)" in refused(ReasonCode(PacketTypes.CONNACK, "Not authorized"), None)


def test_other_refusals_stay_plain() -> None:
    line = refused(ReasonCode(PacketTypes.CONNACK, "Server unavailable"), "dev1")
    assert line == "broker refused the connection: Server unavailable"


def test_sessions_reconnect_within_five_seconds_of_the_brokers_return() -> None:
    """The backoff doubles from 1 s and stops at 5 s (the field lab measured 15 s of
    reconnection after an 8 s outage with the former 30 s cap)."""
    from dfl_agent.transport.mqtt import mqtt_session

    c = mqtt_session("t-reconnect")
    assert (c._reconnect_min_delay, c._reconnect_max_delay) == (1, 5)
