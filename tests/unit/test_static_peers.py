"""Static peer entries: accepted and rejected forms, loading into a PeerTable."""

from __future__ import annotations

import pytest

from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.static import load_static_peers, parse_peer
from dfl_agent.transport.endpoint import parse_endpoint


@pytest.mark.parametrize(
    "entry, expected",
    [
        ("node-b", {"node_id": "node-b", "broker": "", "profile": "", "algorithm": ""}),
        ("  node_b.2  ", {"node_id": "node_b.2", "broker": "", "profile": "", "algorithm": ""}),
        ("b@192.168.1.20:1883", {"node_id": "b", "broker": "192.168.1.20:1883", "profile": "", "algorithm": ""}),
        ("b@broker.local:1", {"node_id": "b", "broker": "broker.local:1", "profile": "", "algorithm": ""}),
        ("b@mqtt_1:65535", {"node_id": "b", "broker": "mqtt_1:65535", "profile": "", "algorithm": ""}),
        ("b@[fd00::1]:1883", {"node_id": "b", "broker": "[fd00::1]:1883", "profile": "", "algorithm": ""}),
        ({"id": "b"}, {"node_id": "b", "broker": "", "profile": "", "algorithm": ""}),
        (
            {"id": "b", "broker": "h:1883", "profile": "rpi4", "algorithm": "dfml"},
            {"node_id": "b", "broker": "h:1883", "profile": "rpi4", "algorithm": "dfml"},
        ),
        ({"id": "b", "broker": None}, {"node_id": "b", "broker": "", "profile": "", "algorithm": ""}),
    ],
)
def test_accepted(entry, expected):
    assert parse_peer(entry) == expected


@pytest.mark.parametrize(
    "entry, match",
    [
        ("", "invalid node id"),
        ("bad id", "invalid node id"),
        ("x" * 65, "invalid node id"),
        ("nöde", "invalid node id"),
        ("b@", "empty broker"),
        ("@h:1883", "invalid node id"),
        ("b@h", "expected 'host:port'"),
        ("b@:1883", "empty host"),
        ("b@h:0", "port"),
        ("b@h:65536", "port"),
        ("b@h:-1", "port"),
        ("b@h:+1", "port"),
        ("b@h:abc", "port"),
        ("b@h: 1883", "port"),
        ("b@h:1883@x", "invalid host|port"),
        ("b@ho st:1", "invalid host"),
        ("b@h/x:1", "invalid host"),
        ("b@[::1:1883", "ipv6"),
        ("b@[1.2.3.4]:1883", "not an IPv6"),
        ({"broker": "h:1"}, "missing 'id'"),
        ({"id": "b", "borker": "h:1"}, "unknown keys"),
        ({"id": "b", "broker": 1883}, "must be a string"),
        ({"id": "b", "broker": "h:99999"}, "port"),
        ({"id": "b", "profile": "two words"}, "invalid profile"),
        ({"id": 7}, "invalid node id"),
        (42, "expected a string or a table"),
        (None, "expected a string or a table"),
    ],
)
def test_rejected(entry, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        parse_peer(entry)
    assert "static peer" in str(excinfo.value)
    assert repr(entry) in str(excinfo.value)  # the message names the entry


def test_parse_endpoint():
    assert parse_endpoint("h:1883") == ("h", 1883)
    assert parse_endpoint("[::1]:1") == ("::1", 1)
    with pytest.raises(ValueError):
        parse_endpoint(1883)  # type: ignore[arg-type]


def test_load_static_peers_upserts_with_source_static():
    table = PeerTable("self", federation="fed")
    ids = load_static_peers(
        table,
        ["a", "b@10.0.0.2:1883", {"id": "c", "profile": "jetson", "algorithm": "dechw"}],
        "fed",
    )
    assert ids == ["a", "b", "c"]
    assert table.live_peers() == ["a", "b", "c"]
    assert table.get("b").broker == "10.0.0.2:1883"
    assert table.broker_of("a") == ""
    c = table.get("c")
    assert c.profile == "jetson" and c.algorithm == "dechw" and c.federation == "fed"
    assert all(p.sources == {"static"} for p in table.all())


def test_load_static_peers_skips_self():
    table = PeerTable("self", federation="fed")
    assert load_static_peers(table, ["self", "a"], "fed") == ["a"]
    assert table.live_peers() == ["a"]


def test_load_static_peers_is_all_or_nothing():
    table = PeerTable("self", federation="fed")
    with pytest.raises(ValueError, match="bad id"):
        load_static_peers(table, ["a", "bad id"], "fed")
    assert table.all() == []


def test_load_static_peers_rejects_duplicates_and_bad_federation():
    table = PeerTable("self", federation="fed")
    with pytest.raises(ValueError, match="listed twice"):
        load_static_peers(table, ["a", "a@h:1"], "fed")
    with pytest.raises(ValueError, match="federation"):
        load_static_peers(table, ["a"], "bad fed")
    with pytest.raises(ValueError, match="list"):
        load_static_peers(table, "a", "fed")  # type: ignore[arg-type]
    assert table.all() == []
