"""What an agent's log says about its broker and its peers: a lost broker once at WARNING,
its reconnection attempts throttled, its return at INFO with the outage's duration; a peer's
goodbye at INFO, its last will at WARNING, the end of its run at DEBUG only."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import node_transport
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64
from dfl_agent.transport.outage import BrokerOutage, format_duration

log = logging.getLogger("test.outage")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _lines(caplog, name: str) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == name]


def test_a_lost_broker_is_one_warning_then_throttled_lines_then_back_with_its_duration(caplog):
    caplog.set_level(logging.DEBUG, logger="test.outage")
    clock = Clock()
    out = BrokerOutage("s0", "10.0.0.5:1883", log, clock=clock)
    assert out.connected() is None and _lines(caplog, "test.outage") == []  # the first connection: nothing
    out.lost("Unspecified error")
    out.lost("Unspecified error")  # said once
    for _ in range(59):  # paho retries every 1 s to 30 s: one attempt a second here, for 59 s
        clock.t += 1
        out.attempt_failed("no connection")
    assert _lines(caplog, "test.outage") == [
        ("WARNING", "s0: lost broker 10.0.0.5:1883 (Unspecified error); reconnecting")]
    for _ in range(61 + 120):  # 1 min, then 2 min later: one line each
        clock.t += 1
        out.attempt_failed("no connection")
    clock.t += 10
    assert out.connected() == pytest.approx(250)
    assert _lines(caplog, "test.outage")[1:] == [
        ("WARNING", "s0: broker 10.0.0.5:1883 still unreachable after 1 min 0 s (60 attempts, last: no connection)"),
        ("WARNING", "s0: broker 10.0.0.5:1883 still unreachable after 3 min 0 s (180 attempts, last: no connection)"),
        ("INFO", "s0: broker 10.0.0.5:1883 back after 4 min 10 s (240 reconnection attempts)")]
    # a second outage starts its own count; spacing is back at one minute
    caplog.clear()
    out.lost("Server shutting down")
    clock.t += 2.5
    out.attempt_failed("broker refused the connection: Not authorized")
    assert out.connected() == pytest.approx(2.5)
    assert _lines(caplog, "test.outage") == [
        ("WARNING", "s0: lost broker 10.0.0.5:1883 (Server shutting down); reconnecting"),
        ("INFO", "s0: broker 10.0.0.5:1883 back after 2.5 s (1 reconnection attempts)")]


def test_a_broker_away_at_start_is_said_once_and_reached_later(caplog):
    caplog.set_level(logging.DEBUG, logger="test.outage")
    clock = Clock()
    out = BrokerOutage("s0", "b:1883", log, first_report=10, max_report=15, clock=clock)
    for _ in range(60):
        out.attempt_failed("no connection")
        clock.t += 1
    out.connected()
    lines = _lines(caplog, "test.outage")
    assert lines[0] == ("WARNING", "s0: cannot reach broker b:1883 (no connection); retrying")
    # after 10 s, then every 15 s (the doubled wait, 20 s, is capped)
    assert [m.split("after ")[1].split(" (")[0] for _, m in lines[1:-1]] == ["10.0 s", "25.0 s", "40.0 s", "55.0 s"]
    assert lines[-1] == ("INFO", "s0: reached broker b:1883 after 1 min 0 s (60 failed attempts)")


def test_format_duration():
    assert [format_duration(s) for s in (0.04, 59.95, 60, 3599, 3600, 90061)] == [
        "0.0 s", "60.0 s", "1 min 0 s", "59 min 59 s", "1 h 0 min", "25 h 1 min"]


# ------------------------------------------------------------------ departures


class Peer:
    """The messages of peer ``a``: signed with its key (or bare JSON without one)."""

    def __init__(self, guard: SecurityGuard | None):
        self.guard = guard

    def presence(self, state: str, **extra) -> bytes:
        doc = {"state": state, "node_id": "a", **({"descriptor": {}} if state == "online" else {}),
               "time": time.time(), **extra}
        return self.guard.sign_control("presence", doc, "fed") if self.guard else json.dumps(doc).encode()

    def status(self, state: str) -> bytes:
        doc = {"node_id": "a", "state": state, "time": time.time(), "heartbeat": 1}
        return self.guard.sign_control("status", doc, "fed") if self.guard else json.dumps(doc).encode()

    @staticmethod
    def will(at: float) -> bytes:  # what the broker publishes: bare, written when the connection opened
        return json.dumps({"state": "offline", "node_id": "a", "time": at}).encode()


def _departure(caplog, steps, *, signed: bool = True, require: bool = False,
               tables: list | None = None) -> list[tuple[str, str]]:
    """``steps(peer)`` -> the messages that arrive after peer a's "online" (leaf, payload);
    returns the receiver's log lines about peer a (its peer table appended to ``tables``)."""
    ka, kme = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pinned = {"a": public_key_b64(ka), "me": public_key_b64(kme)}
    me_guard = SecurityGuard("me", kme, TrustStore("fed", pinned), require_signatures=require) if signed else None
    peer = Peer(SecurityGuard("a", ka, TrustStore("fed", pinned)) if signed else None)
    table = PeerTable("me", "fed", heartbeat_timeout=30.0)
    t = node_transport("me", "fed", broker="127.0.0.1:1", peers=table, descriptor={}, control=me_guard)
    if tables is not None:
        tables.append(table)

    def on_presence(node: str, descriptor) -> None:  # what the runtime's membership does
        if descriptor is None:
            table.withdraw(node, "presence")
        else:
            table.upsert(node, "presence", federation="fed")

    async def main() -> None:
        t._loop, t._on_presence = asyncio.get_running_loop(), on_presence
        for leaf, payload in [("presence", peer.presence("online")), *steps(peer)]:
            t.channel.on_message(False, None, "a", leaf, payload)
            await asyncio.sleep(0.01)

    caplog.clear()
    caplog.set_level(logging.DEBUG)
    asyncio.run(main())
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if "peer a " in r.getMessage() and r.name in ("dfl_agent.peers", "dfl_agent.transport.mqtt")]


def test_a_peers_goodbye_will_and_run_end_are_told_apart(caplog):
    # its signed goodbye while its run was on: a clean leave
    assert _departure(caplog, lambda p: [("status", p.status("training")), ("presence", p.presence("offline"))]) == [
        ("INFO", "me: peer a left (goodbye)")]
    # the goodbye after its status said its rounds were finished: its run ended, not a leave
    assert _departure(caplog, lambda p: [("status", p.status("finished")), ("presence", p.presence("offline"))]) == [
        ("DEBUG", "me: peer a ended its run")]
    # a goodbye that names the end of its run as its reason (the supervisor's)
    assert _departure(caplog, lambda p: [("presence", p.presence("offline", reason="run ended"))]) == [
        ("DEBUG", "me: peer a ended its run")]
    assert _departure(caplog, lambda p: [("presence", p.presence("offline", reason="stopping"))]) == [
        ("INFO", "me: peer a left (goodbye)")]
    # ... but the run's end after its status said it stopped early (SIGTERM): it left the run
    assert _departure(caplog, lambda p: [("status", p.status("stopped")),
                                         ("presence", p.presence("offline", reason="run ended"))]) == [
        ("INFO", "me: peer a left (goodbye)")]
    # its unsigned last will: the broker saw its connection die
    assert _departure(caplog, lambda p: [("status", p.status("training")), ("presence", p.will(time.time() - 60))]) == [
        ("WARNING", "me: peer a lost its connection (its last will: crashed or cut off)")]


def test_a_peer_back_after_the_end_of_its_run_is_debug_and_after_a_leave_info(caplog):
    caplog.set_level(logging.DEBUG, logger="dfl_agent.peers")
    table = PeerTable("me", "fed")
    for peer, how in (("a", "run_end"), ("b", "goodbye")):
        table.upsert(peer, "presence", federation="fed")
        table.note_departure(peer, how)
        table.withdraw(peer, "presence")
        table.upsert(peer, "presence", federation="fed")  # its next run
    assert _lines(caplog, "dfl_agent.peers") == [
        ("DEBUG", "me: peer a ended its run"), ("DEBUG", "me: peer a is back"),
        ("INFO", "me: peer b left (goodbye)"), ("INFO", "me: peer b is back")]
    with pytest.raises(ValueError, match="unknown departure"):
        table.note_departure("a", "vanished")


def test_signatures_required_an_unsigned_will_is_a_warning_only_for_a_live_peer(caplog):
    got = _departure(caplog, lambda p: [("presence", p.will(time.time()))], require=True)
    assert got == [("WARNING", "me: peer a lost its connection (its unsigned last will: crashed or cut off); "
                               "a member until its heartbeats stop")]
    # a will of a peer that is not live (here: it said goodbye first): nothing above DEBUG
    assert [lvl for lvl, _ in _departure(caplog, lambda p: [("presence", p.presence("offline")),
                                                            ("presence", p.will(time.time()))], require=True)] == [
        "INFO", "DEBUG"]


def test_signatures_required_a_will_of_a_live_peer_marks_its_session_lost_once(caplog):
    # found in the field lab: a device partitioned for 20 s (under the 30 s heartbeat timeout)
    # never looked offline, so nobody sent it a CHOCO keyframe; it dropped every update as
    # choco_gap and closed 55 rounds alone. Its will marks its session lost: its next sign of
    # life counts as a return (Membership._lost), and the neighbours send it keyframes
    tables: list = []
    _departure(caplog, lambda p: [("presence", p.will(time.time()))], require=True, tables=tables)
    assert tables[0].take_session_lost("a") and not tables[0].take_session_lost("a")
    tables.clear()  # a will of a peer that is not live marks nothing (it will come back as new)
    _departure(caplog, lambda p: [("presence", p.presence("offline")), ("presence", p.will(time.time()))],
               require=True, tables=tables)
    assert not tables[0].take_session_lost("a")


def test_unsigned_federation_a_will_is_older_than_the_peers_last_status(caplog):
    assert _departure(caplog, lambda p: [("status", p.status("training")), ("presence", p.will(time.time() - 60))],
                      signed=False) == [("WARNING", "me: peer a lost its connection (its last will: crashed or cut off)")]
    assert _departure(caplog, lambda p: [("status", p.status("training")), ("presence", p.presence("offline"))],
                      signed=False) == [("INFO", "me: peer a left (goodbye)")]
