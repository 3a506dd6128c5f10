"""The node's presence and status (discovery.presence) ride on the MQTT transport's home
session through its control channel; the transport alone moves frames only."""

from __future__ import annotations

import asyncio

import pytest

from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import MqttPresence, node_transport
from dfl_agent.transport.base import Transport
from dfl_agent.transport.memory import MemoryNetwork
from dfl_agent.transport.mqtt import MqttTransport, _Conn

ENDPOINT = "127.0.0.1:1"


def _topics(transport: MqttTransport, home: bool) -> list[str]:
    return [t for t, _ in transport._subscriptions(_Conn(ENDPOINT, home=home))]


def test_presence_channel_adds_its_topics_and_last_will():
    t = node_transport("n1", "fed", broker=ENDPOINT, peers=PeerTable("n1", "fed"), descriptor={"a": 1},
                       heartbeat_interval=0.5)
    assert isinstance(t.channel, MqttPresence) and t.channel.period == 0.5
    assert _topics(t, home=True) == ["dfl/fed/node/n1/inbox", "dfl/fed/node/+/out",
                                     "dfl/fed/node/+/presence", "dfl/fed/node/+/status"]
    assert _topics(t, home=False) == ["dfl/fed/node/+/out", "dfl/fed/node/+/presence", "dfl/fed/node/+/status"]
    will_topic, will = t.channel.will()
    assert will_topic == "dfl/fed/node/n1/presence" and b'"offline"' in will
    assert t.statuses == {}


def test_transport_without_channel_moves_frames_only():
    t = MqttTransport("n1", "fed", broker=ENDPOINT, peers=PeerTable("n1", "fed"))
    assert _topics(t, home=True) == ["dfl/fed/node/n1/inbox", "dfl/fed/node/+/out"]
    assert t.statuses == {}
    t._started = True
    with pytest.raises(RuntimeError, match="no presence/status channel"):
        asyncio.run(t.publish_status({"round": 1}))


def test_an_inference_member_does_not_subscribe_to_the_model_gossip(tmp_path):
    """An inference member takes only the deployed models addressed to its inbox: the training
    nodes' broadcasts (every round's update) would only cost its link and be dropped."""
    from dfl_agent.inference.member import InferenceMember

    member = InferenceMember("pi-4", "fed", broker=ENDPOINT, state_dir=tmp_path, sign=False)
    assert _topics(member.ctx.transport, home=True) == [
        "dfl/fed/node/pi-4/inbox", "dfl/fed/node/+/presence", "dfl/fed/node/+/status"]


def test_presence_arguments_are_checked_by_name():
    for name, kwargs in [("descriptor", dict(descriptor=[])), ("heartbeat_interval", dict(heartbeat_interval=0)),
                         ("on_heartbeat", dict(on_heartbeat=3))]:
        with pytest.raises(ValueError, match=name):
            MqttPresence("n1", "fed", **{"descriptor": {}, **kwargs})


def test_transport_declares_what_the_runtime_asks():
    t = MqttTransport("n1", "fed", broker=ENDPOINT, peers=PeerTable("n1", "fed"))
    assert t.use_prepare_frame(len) is True and t.prepare_frame is len
    assert not t.connected  # not started
    mem = MemoryNetwork().transport("m", "fed", {})
    assert mem.use_prepare_frame(len) is False
    assert mem.decode_shared(b"DFL", federation="fed", recipient="m", max_frame_bytes=10) is None  # not shared
    assert Transport.connected.fget(mem) is True  # the default: a transport that cannot lose its network
