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
