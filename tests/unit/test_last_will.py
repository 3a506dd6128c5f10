"""A node's MQTT last will, signed when its connection opens and bound to that connection by a
session id (dfl_agent.security.trust.verify_will, dfl_agent.discovery.presence, the dflctl
observer and tables): verified, it is a hint where signatures are required and obeyed where
they are not; a will of an earlier connection is stale; ``peers`` shows ``offline (last will)``
with its trust and ``status`` shows ``offline`` for the node; an older agent's bare will is
shown as before."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.observer import Observer
from dfl_agent.cli.tables import peer_rows, presence_state, status_rows
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import MqttPresence, node_transport
from dfl_agent.security import ControlRejected, SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64
from dfl_agent.security.trust import WILL_REASON, is_will, will_payload

KA, KME, KX = (Ed25519PrivateKey.generate() for _ in range(3))
PINNED = {"a": public_key_b64(KA), "me": public_key_b64(KME)}


def _guard(node: str, key, require: bool = False) -> SecurityGuard:
    return SecurityGuard(node, key, TrustStore("fed", PINNED), require_signatures=require)


def _signed(doc: dict, key=KA) -> bytes:
    return _guard("a", key).sign_control("presence", doc, "fed")


def _online(session: str) -> bytes:
    return _signed({"state": "online", "node_id": "a", "descriptor": {}, "time": time.time(), "session": session})


def test_each_connection_gets_a_will_signed_for_it_and_its_presence_and_status_name_it():
    p = MqttPresence("a", "fed", descriptor={}, control=_guard("a", KA))
    topic1, will1 = p.will()
    s1 = p.session
    _topic2, will2 = p.will()  # the next connection attempt: a new session, a new will
    assert topic1 == "dfl/fed/node/a/presence" and p.session != s1
    me = _guard("me", KME, require=True)
    for will, session in ((will1, s1), (will2, p.session)):
        sender, role, doc = me.verify_will(will, "a")
        assert (sender, role) == ("a", "device") and doc["session"] == session and is_will(doc)
    assert json.loads(p._presence_payload(True))["payload"]["session"] == p.session
    assert json.loads(p._status_payload())["payload"]["session"] == p.session
    # the sequence rule does not apply to a will (it is signed before its connection's "online"),
    # but the very will again is a duplicate, and only a will passes verify_will
    me.verify_control(_online(p.session), "presence", "a")
    with pytest.raises(ControlRejected) as e:
        me.verify_will(will2, "a")
    assert e.value.reason == "duplicate"
    with pytest.raises(ControlRejected) as e:
        me.verify_will(_signed({"state": "offline", "node_id": "a", "time": time.time()}), "a")
    assert e.value.reason == "malformed"
    for bad, reason in ((_signed(will_payload("a", "s"), KX), "bad_signature"),
                        (json.dumps(will_payload("a", "s")).encode(), "unsigned")):
        with pytest.raises(ControlRejected) as e:
            me.verify_will(bad, "a")
        assert e.value.reason == reason


def _receive(caplog, messages: list[tuple[str, bytes]], require: bool):
    """``me`` (signatures required or not) receives peer a's messages; returns its log lines about
    peer a, its drop counters and its peer table."""
    table = PeerTable("me", "fed", heartbeat_timeout=30.0)
    t = node_transport("me", "fed", broker="127.0.0.1:1", peers=table, descriptor={},
                       control=_guard("me", KME, require=require))

    def on_presence(node: str, descriptor) -> None:  # what the runtime's membership does
        if descriptor is None:
            table.withdraw(node, "presence")
        else:
            table.upsert(node, "presence", federation="fed")

    async def main() -> None:
        t._loop, t._on_presence = asyncio.get_running_loop(), on_presence
        for leaf, payload in messages:
            t.channel.on_message(False, None, "a", leaf, payload)
            await asyncio.sleep(0.01)

    caplog.clear()
    caplog.set_level(logging.DEBUG)
    asyncio.run(main())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records
             if "peer a " in r.getMessage() and r.name in ("dfl_agent.peers", "dfl_agent.transport.mqtt")]
    return lines, dict(t.stats.dropped), table


def test_signatures_required_a_verified_will_is_a_hint_and_a_forged_or_stale_one_nothing(caplog):
    will = _signed(will_payload("a", "s1"))
    lines, dropped, table = _receive(caplog, [("presence", _online("s1")), ("presence", will)], require=True)
    assert lines == [("WARNING", "me: peer a lost its connection (its signed last will: crashed or cut off); "
                                 "a member until its heartbeats stop")]
    assert table.is_live("a") and table.take_session_lost("a") and dropped == {}
    # signed with another key: dropped and counted, no hint
    lines, dropped, table = _receive(caplog, [("presence", _online("s1")),
                                              ("presence", _signed(will_payload("a", "s1"), KX))], require=True)
    assert [lvl for lvl, _ in lines if lvl != "DEBUG"] == [] and dropped == {"presence_bad_signature": 1}
    assert not table.take_session_lost("a")
    # the will of an earlier connection (late, or replayed) after the node connected again
    lines, dropped, table = _receive(caplog, [("presence", _online("s2")), ("presence", will)], require=True)
    assert [lvl for lvl, _ in lines if lvl != "DEBUG"] == [] and dropped == {"presence_stale_will": 1}
    assert table.is_live("a") and not table.take_session_lost("a")


def test_signatures_optional_a_verified_will_is_obeyed_and_a_stale_one_is_not(caplog):
    will = _signed(will_payload("a", "s1"))
    lines, dropped, table = _receive(caplog, [("presence", _online("s1")), ("presence", will)], require=False)
    assert lines == [("WARNING", "me: peer a lost its connection (its last will: crashed or cut off)")]
    assert not table.is_live("a") and dropped == {}
    lines, dropped, table = _receive(caplog, [("presence", _online("s2")), ("presence", will)], require=False)
    assert table.is_live("a") and dropped == {"presence_stale_will": 1}


def test_an_older_agents_bare_will_is_still_a_hint_where_signatures_are_required(caplog):
    bare = json.dumps({"state": "offline", "node_id": "a", "time": time.time()}).encode()
    lines, dropped, _table = _receive(caplog, [("presence", _online("s1")), ("presence", bare)], require=True)
    assert lines == [("WARNING", "me: peer a lost its connection (its unsigned last will: crashed or cut off); "
                                 "a member until its heartbeats stop")]
    assert dropped == {"presence_unsigned": 1}


def _observer(guard=None) -> Observer:
    obs = Observer("127.0.0.1:1", "fed")
    obs.guard = guard
    return obs


def _msg(node: str, leaf: str, payload: bytes):
    return SimpleNamespace(topic=f"dfl/fed/node/{node}/{leaf}", payload=payload)


def test_dflctl_shows_a_verified_will_as_offline_last_will_and_ignores_a_stale_one():
    now = time.time()
    obs = _observer(_guard("dflctl", None, require=True))
    status = _guard("a", KA).sign_control("status", {"node_id": "a", "state": "running", "time": now + 5,
                                                     "session": "s1", "run": {"id": "r1", "state": "training",
                                                                              "round": 5}}, "fed")
    obs._handle(_msg("a", "status", status))
    obs._handle(_msg("a", "presence", _online("s1")))
    obs._handle(_msg("a", "presence", _signed({**will_payload("a", "s0"), "time": now - 60})))  # stale
    assert obs.presence["a"]["state"] == "online" and obs.dropped["presence_stale_will"] == 1
    obs._handle(_msg("a", "presence", _signed(will_payload("a", "s1"))))
    statuses, presence = obs.snapshot()
    assert presence["a"]["trust"] == "device" and presence["a"]["reason"] == WILL_REASON
    [row] = peer_rows(statuses, presence)
    assert (row["state"], row["trust"]) == ("offline (last will)", "device")
    [srow] = status_rows(statuses, presence=presence)
    assert srow["state"] == "offline (last will)" and srow["run"] == "r1 training@5"
    assert status_rows(statuses)[0]["state"] == "running"  # without presence: the status's own


def test_presence_state_rules():
    will = {"state": "offline", "node_id": "a", "time": 100.0, "reason": WILL_REASON, "session": "s1"}
    assert presence_state(will, {"state": "idle", "time": 150.0, "session": "s1"}) == "offline (last will)"
    # a status of a later connection: the node is back, the will is stale
    assert presence_state(will, {"state": "idle", "time": 150.0, "session": "s2"}) is None
    # ... but one sent before that will's connection opened says nothing about it
    assert presence_state(will, {"state": "idle", "time": 50.0, "session": "s0"}) == "offline (last will)"
    # an older agent's bare will, and the supervisor's goodbye at a run's end, as before
    bare = {"state": "offline", "node_id": "a", "time": 100.0}
    assert presence_state(bare, {"state": "running", "time": 150.0}) == "offline"
    assert presence_state({**bare, "reason": "run ended"}, {"state": "idle", "time": 150.0}) is None
    assert presence_state({}, {"state": "idle"}) is None
    # a node that stopped or finished keeps its status's state in ``status``
    for st in ("stopped", "finished"):
        assert status_rows({"a": {"state": st, "time": 150.0}}, presence={"a": bare})[0]["state"] == st
    rows = peer_rows({"a": {"state": "idle", "time": 150.0, "session": "s1"}}, {"a": {**will, "trust": "unverified"}})
    assert rows[0]["state"] == "offline (last will)"
