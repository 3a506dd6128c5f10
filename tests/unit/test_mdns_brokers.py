"""A broker that an mDNS record names (unsigned) is used only when it is trusted: this node's
own (``mqtt.broker``), a static peer's (configuration), or one named in a presence signed by
an enrolled member; any other is ignored, logged once and counted (``mdns_broker_untrusted``).
The live test, with real zeroconf and a real MQTT transport: tests/integration/test_mdns.py."""

from __future__ import annotations

import asyncio
import logging
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.discovery.bridged import HomeRoutedPeerTable
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import node_transport
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64

HOME, OTHER, THIRD = "10.0.0.1:1883", "10.9.9.9:1883", "10.7.7.7:1883"
KA, KME, KX = (Ed25519PrivateKey.generate() for _ in range(3))
PINNED = {"a": public_key_b64(KA), "me": public_key_b64(KME)}


def test_an_mdns_record_names_only_a_trusted_broker(caplog):
    table = PeerTable("me", "fed", home_broker=HOME)
    events: list[tuple[str, str, str]] = []
    table.add_listener(lambda ev, nid, info: events.append((ev, nid, info.broker)))
    caplog.set_level(logging.WARNING, logger="dfl_agent.peers")
    table.upsert("good", "mdns", federation="fed", broker=HOME)
    for _ in range(3):  # re-announced: counted each time, logged once
        table.upsert("ghost", "mdns", federation="fed", broker=OTHER, profile="rpi4")
    assert table.broker_of("good") == HOME
    ghost = table.get("ghost")
    assert ghost is not None and ghost.broker == "" and ghost.profile == "rpi4" and table.is_live("ghost")
    assert table.broker_of("ghost") == ""  # its frames would go to the home broker
    assert table.dropped == {"mdns_broker_untrusted": 3}
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"me: ignored broker {OTHER} named by the mDNS record of ghost: neither mqtt.broker, a "
                        "static peer's nor in a presence signed by an enrolled member (mdns_broker_untrusted)"]
    # a presence signed by an enrolled member names it: the record's broker applies (the transport connects)
    table.trust_broker(OTHER)
    assert table.broker_of("ghost") == OTHER and events[-1] == ("updated", "ghost", OTHER)
    table.upsert("late", "mdns", federation="fed", broker=OTHER)
    assert table.broker_of("late") == OTHER and table.dropped["mdns_broker_untrusted"] == 3
    # a static peer's broker is configuration; another node's presence is not mDNS (its own rules)
    table.upsert("s", "static", federation="fed", broker=THIRD)
    table.upsert("m", "mdns", federation="fed", broker=THIRD)
    assert table.broker_of("m") == THIRD and table.dropped["mdns_broker_untrusted"] == 3
    # a bridged site's table applies the same rule (it routes everything home anyway)
    bridged = HomeRoutedPeerTable("me", "fed", home_broker=HOME)
    bridged.upsert("ghost", "mdns", federation="fed", broker=OTHER)
    assert PeerTable.broker_of(bridged, "ghost") == "" and bridged.dropped == {"mdns_broker_untrusted": 1}


def _presences(messages: list[tuple[str, bytes]], require: bool) -> tuple[PeerTable, dict[str, int]]:
    """``me`` (signatures required or not) receives these presences (sender, payload)."""
    table = PeerTable("me", "fed", home_broker=HOME)
    guard = SecurityGuard("me", KME, TrustStore("fed", PINNED), require_signatures=require)
    t = node_transport("me", "fed", broker=HOME, peers=table, descriptor={}, control=guard)

    async def main() -> None:
        t._loop, t._on_presence = asyncio.get_running_loop(), lambda node, descriptor: None
        for sender, payload in messages:
            t.channel.on_message(False, None, sender, "presence", payload)
            await asyncio.sleep(0.01)

    asyncio.run(main())
    return table, dict(t.stats.dropped)


def _online(sender: str, key, broker: str) -> bytes:
    doc = {"state": "online", "node_id": sender, "descriptor": {"broker": broker}, "time": time.time(),
           "session": "s1"}
    return SecurityGuard(sender, key, TrustStore("fed", PINNED)).sign_control("presence", doc, "fed")


def test_only_a_presence_signed_by_an_enrolled_member_trusts_a_broker():
    # enrolled (pinned) member a: trusted; x signs with a key nobody enrolled: dropped, not trusted
    table, dropped = _presences([("a", _online("a", KA, OTHER)), ("x", _online("x", KX, THIRD))], require=True)
    assert table.broker_trusted(OTHER) and not table.broker_trusted(THIRD)
    assert dropped == {"presence_unknown_sender": 1}
    # signatures optional: x's presence is accepted as unverified, and still trusts no broker
    table, dropped = _presences([("x", _online("x", KX, THIRD))], require=False)
    assert not table.broker_trusted(THIRD) and dropped == {}
    table.upsert("ghost", "mdns", federation="fed", broker=THIRD)
    assert table.broker_of("ghost") == "" and table.dropped == {"mdns_broker_untrusted": 1}


def test_an_mdns_record_does_not_change_a_members_description_nor_exclude_it():
    """A made-up mDNS record for member b saying it runs another algorithm: b's presence said
    fedavg, so the record changes nothing (before, b was excluded from this node's run for
    good: ``excluding peer b: runs dechw``).  A record that comes before b's presence keeps b
    out only until the presence describes it."""
    import numpy as np

    from dfl_agent.profiles import peer_incompatibility
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.transport.memory import MemoryNetwork

    def ctx() -> RuntimeContext:
        return RuntimeContext(node_id="me", federation="fed", transport=MemoryNetwork().transport("me", "fed"),
                              peers=PeerTable("me", "fed", home_broker=HOME), data=None, model_spec={}, train=None,
                              init_seed=0, rng=np.random.default_rng(0),
                              compatibility=peer_incompatibility("fedavg", "h1"))

    me = ctx()
    me.peers.upsert("b", "presence", federation="fed", algorithm="fedavg", model_hash="h1", broker=HOME)
    assert me.live_peers() == ["b"]
    me.peers.upsert("b", "mdns", federation="fed", algorithm="dechw", model_hash="h2", address="10.6.6.6:1")
    info = me.peers.get("b")
    assert (info.algorithm, info.model_hash, info.address) == ("fedavg", "h1", "10.6.6.6:1")
    assert me.live_peers() == ["b"] and me.membership.excluded == {}
    me = ctx()  # the record first
    me.peers.upsert("b", "mdns", federation="fed", algorithm="dechw")
    assert me.live_peers() == [] and me.membership.excluded == {} and me.rejected["incompatible_peer"] == 0
    me.peers.upsert("b", "presence", federation="fed", algorithm="fedavg", model_hash="h1")
    assert me.live_peers() == ["b"]
    # a peer whose own presence says it is incompatible is excluded, as before
    me.peers.upsert("c", "presence", federation="fed", algorithm="dechw")
    assert me.live_peers() == ["b"] and "c" in me.membership.excluded
