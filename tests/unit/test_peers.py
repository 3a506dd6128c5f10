"""PeerTable semantics: sources vouch, listeners see each transition once, heartbeats."""

from __future__ import annotations

import pytest

from dfl_agent.discovery.peers import PeerInfo, PeerTable


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, event: str, node_id: str, info: PeerInfo) -> None:
        assert info.node_id == node_id
        self.events.append((event, node_id))


@pytest.fixture
def table() -> PeerTable:
    # the broker mDNS records name here is this node's own (others: test_mdns_brokers.py)
    return PeerTable("self", federation="fed", home_broker="10.0.0.2:1883")


@pytest.fixture
def rec(table: PeerTable) -> Recorder:
    r = Recorder()
    table.add_listener(r)
    return r


def test_upsert_adds_live_peer_with_fields(table, rec):
    info = table.upsert("b", "mdns", federation="fed", broker="10.0.0.2:1883", profile="rpi4",
                        algorithm="dfml", model_hash="abc", version="0.1.0", address="10.0.0.2:0")
    assert info is not None
    assert table.live_peers() == ["b"]
    got = table.get("b")
    assert got.broker == "10.0.0.2:1883" and got.profile == "rpi4" and got.algorithm == "dfml"
    assert got.model_hash == "abc" and got.version == "0.1.0" and got.address == "10.0.0.2:0"
    assert got.sources == {"mdns"}
    assert rec.events == [("added", "b")]


def test_unknown_source_rejected(table):
    with pytest.raises(ValueError, match="unknown discovery source"):
        table.upsert("b", "carrier-pigeon")


def test_live_while_any_source_vouches(table, rec):
    table.upsert("b", "static", federation="fed")
    table.upsert("b", "mdns", federation="fed")
    table.upsert("b", "presence", federation="fed")
    assert table.get("b").sources == {"static", "mdns", "presence"}
    table.withdraw("b", "mdns")
    assert table.live_peers() == ["b"]
    table.withdraw("b", "static")
    assert table.live_peers() == ["b"]
    table.withdraw("b", "presence")
    assert table.live_peers() == []
    assert rec.events == [("added", "b"), ("updated", "b"), ("updated", "b"), ("removed", "b")]
    # still known, just not live
    assert [p.node_id for p in table.all()] == ["b"]


def test_withdraw_is_per_source_and_idempotent(table, rec):
    table.upsert("b", "mdns", federation="fed")
    table.withdraw("b", "presence")  # never vouched: no effect
    table.withdraw("nobody", "mdns")  # unknown peer: no effect
    assert table.live_peers() == ["b"]
    table.withdraw("b", "mdns")
    table.withdraw("b", "mdns")
    assert table.live_peers() == []
    assert rec.events == [("added", "b"), ("removed", "b")]


def test_readd_after_removal_emits_added_again(table, rec):
    table.upsert("b", "mdns", federation="fed")
    table.withdraw("b", "mdns")
    table.upsert("b", "presence", federation="fed")
    assert rec.events == [("added", "b"), ("removed", "b"), ("added", "b")]


def test_self_is_ignored(table, rec):
    assert table.upsert("self", "mdns", federation="fed") is None
    assert table.live_peers() == [] and table.all() == []
    assert rec.events == []


def test_other_federation_is_ignored(table, rec):
    assert table.upsert("x", "mdns", federation="other") is None
    assert table.live_peers() == []
    assert rec.events == []
    # no federation given: accepted (a static entry knows its federation from config)
    assert table.upsert("y", "static") is not None
    assert table.live_peers() == ["y"]


def test_table_without_federation_accepts_all():
    t = PeerTable("self")
    t.upsert("a", "mdns", federation="f1")
    t.upsert("b", "mdns", federation="f2")
    assert t.live_peers() == ["a", "b"]


def test_empty_fields_do_not_erase_known_values(table):
    table.upsert("b", "static", federation="fed", broker="h:1883")
    table.upsert("b", "mdns", federation="fed", broker="", profile="jetson")
    got = table.get("b")
    assert got.broker == "h:1883" and got.profile == "jetson"


def test_unknown_fields_go_to_extra(table):
    table.upsert("b", "presence", federation="fed", round=7, none_value=None)
    assert table.get("b").extra == {"round": 7}


def test_listener_exactly_once_per_transition_with_several_listeners(table):
    r1, r2 = Recorder(), Recorder()
    table.add_listener(r1)
    table.add_listener(r2)
    table.upsert("b", "static", federation="fed")
    table.upsert("b", "mdns", federation="fed")
    table.withdraw("b", "static")  # still live via mdns: no event
    table.withdraw("b", "mdns")
    expected = [("added", "b"), ("updated", "b"), ("removed", "b")]
    assert r1.events == expected and r2.events == expected


def test_heartbeat_timeout_applies_to_every_source():
    clock = FakeClock()
    t = PeerTable("self", federation="fed", heartbeat_timeout=10.0, clock=clock)
    rec = Recorder()
    t.add_listener(rec)
    t.upsert("p", "presence", federation="fed")
    t.upsert("m", "mdns", federation="fed")
    t.upsert("s", "static", federation="fed")
    assert t.live_peers() == ["m", "p", "s"]
    clock.advance(10.0)
    assert t.live_peers() == ["m", "p", "s"]  # exactly at the timeout: still live
    t.touch("m")  # a heartbeat or any message
    clock.advance(0.5)
    # nobody heard from p and s for longer than the timeout; m was touched
    assert t.live_peers() == ["m"]
    t.touch("p")
    assert t.live_peers() == ["m", "p"]
    clock.advance(11.0)
    assert "p" not in t.live_peers()
    # a fresh presence message revives it; it was not live, so this is "added"
    t.upsert("p", "presence", federation="fed")
    assert "p" in t.live_peers()
    assert rec.events[-1] == ("added", "p")
    assert t.get("p").last_seen == clock()


def test_presence_offline_overrides_a_lingering_mdns_record():
    """A crashed peer sends no mDNS goodbye; its last will (presence offline) must win."""
    t = PeerTable("self", federation="fed")
    t.upsert("x", "mdns", federation="fed")
    t.upsert("x", "presence", federation="fed")
    t.withdraw("x", "presence")  # last will
    assert t.live_peers() == []
    t.upsert("x", "mdns", federation="fed")  # cached record re-seen: still offline
    assert t.live_peers() == []
    t.upsert("x", "presence", federation="fed")  # back online
    assert t.live_peers() == ["x"]


def test_heartbeat_none_never_times_out():
    clock = FakeClock()
    t = PeerTable("self", clock=clock)
    t.upsert("p", "presence")
    clock.advance(1e9)
    assert t.live_peers() == ["p"]


def test_touch_unknown_peer_is_noop(table):
    table.touch("ghost")
    assert table.all() == []


def test_broker_of(table):
    table.upsert("b", "static", federation="fed", broker="10.0.0.2:1883")
    table.upsert("c", "mdns", federation="fed")
    assert table.broker_of("b") == "10.0.0.2:1883"
    assert table.broker_of("c") == ""
    assert table.broker_of("unknown") == ""


def test_descriptor_is_json_friendly(table):
    import json

    table.upsert("b", "mdns", federation="fed", broker="h:1")
    table.upsert("b", "static", federation="fed")
    d = table.get("b").descriptor()
    assert d["sources"] == ["mdns", "static"]
    json.dumps(d)


def test_all_sorted(table):
    for n in ("c", "a", "b"):
        table.upsert(n, "static", federation="fed")
    assert [p.node_id for p in table.all()] == ["a", "b", "c"]
    assert table.live_peers() == ["a", "b", "c"]


def _departures(caplog, peer: str) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "dfl_agent.peers" and f"peer {peer} " in r.getMessage()]


def test_a_dead_peer_is_logged_once_when_its_liveness_expires(caplog):
    caplog.set_level("INFO", logger="dfl_agent.peers")
    clock = FakeClock()
    table = PeerTable("self", federation="fed", heartbeat_timeout=30.0, clock=clock)
    table.upsert("dead", "presence", federation="fed")
    table.upsert("alive", "presence", federation="fed")
    clock.advance(20)
    table.touch("alive")
    assert table.live_peers() == ["alive", "dead"] and _departures(caplog, "dead") == []
    clock.advance(15)  # dead: 35 s silent; alive: 15 s
    for _ in range(5):  # queried several times a round: one line only
        assert table.live_peers() == ["alive"]
    assert _departures(caplog, "dead") == [
        ("WARNING", "self: peer dead not heard from for 35s (heartbeat timeout 30.0s): presumed dead")]
    assert _departures(caplog, "alive") == []
    table.touch("dead")  # it comes back: said once, and a second death is logged again
    assert table.live_peers() == ["alive", "dead"]
    clock.advance(31)
    table.touch("alive")
    table.live_peers()
    table.live_peers()
    assert [lvl for lvl, _ in _departures(caplog, "dead")] == ["WARNING", "INFO", "WARNING"]
    assert _departures(caplog, "dead")[1][1] == "self: peer dead is back"


def test_a_clean_leave_is_logged_once_and_not_again_at_expiry(caplog):
    caplog.set_level("INFO", logger="dfl_agent.peers")
    clock = FakeClock()
    table = PeerTable("self", federation="fed", heartbeat_timeout=30.0, clock=clock)
    table.upsert("b", "presence", federation="fed")
    table.upsert("b", "mdns", federation="fed")
    table.withdraw("b", "mdns")  # presence still vouches: nothing to say
    assert _departures(caplog, "b") == []
    table.withdraw("b", "presence")
    table.withdraw("b", "presence")
    clock.advance(60)
    table.live_peers()
    assert _departures(caplog, "b") == [("INFO", "self: peer b left (offline)")]
