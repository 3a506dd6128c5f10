"""MqttTransport's CONNACK handler: a SUBSCRIBE that paho cannot send is reported, not ignored.

Uses a real, never-connected paho client: its ``subscribe`` returns ``MQTT_ERR_NO_CONN``,
which is what a socket lost between CONNACK and SUBSCRIBE gives.
"""

from __future__ import annotations

import logging

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import node_transport
from dfl_agent.transport.mqtt import _Conn


def test_failed_subscribe_leaves_the_connection_unready_and_says_why(caplog):
    endpoint = "127.0.0.1:1"
    transport = node_transport("n1", "fed", broker=endpoint, peers=PeerTable("n1", "fed"), descriptor={})
    conn = _Conn(endpoint, home=True)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="n1", protocol=mqtt.MQTTv5, userdata=conn)
    assert client.subscribe("probe")[0] == mqtt.MQTT_ERR_NO_CONN  # the premise: paho refuses to send

    with caplog.at_level(logging.WARNING, logger="dfl_agent.transport.mqtt"):
        transport._on_connect(client, conn, None, ReasonCode(PacketTypes.CONNACK, "Success"), None)

    assert conn.connected  # the CONNACK itself was a success
    assert conn.sub_mid is None  # no SUBACK can match: nothing was subscribed
    assert conn.error.startswith("subscribe failed")  # start()'s timeout message names it
    assert not conn.ready.is_set()
    assert any("subscribe failed" in r.getMessage() for r in caplog.records)
