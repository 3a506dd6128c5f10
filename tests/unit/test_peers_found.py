"""How each peer was found (the peer table's ``found_via``): the first source per peer, each
source's first finding with its time and address, once, for the metrics records; a presence
that crossed a bridge from another site's broker is ``bridged-presence``."""

from __future__ import annotations

from dfl_agent.discovery.bridged import HomeRoutedPeerTable
from dfl_agent.discovery.peers import PeerTable


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_first_source_per_peer_and_each_finding_once() -> None:
    clock = Clock()
    table = PeerTable("me", "fed", clock=clock, home_broker="10.0.0.2:8883")
    table.upsert("p", "presence", broker="10.0.0.2:8883", address="10.0.0.11")
    clock.t = 101.5
    table.upsert("p", "mdns", broker="10.0.0.2:8883", address="10.0.0.11:7000")
    table.upsert("q", "mdns", address="10.0.0.12:7000")
    table.upsert("s", "static", broker="10.0.0.2:8883")
    assert table.found_via() == {"p": "presence", "q": "mdns", "s": "static"}
    assert table.found_counts() == {"presence": 1, "mdns": 1, "static": 1}
    assert table.take_found() == {
        "p": {"presence": {"t": 100.0, "address": "10.0.0.11"}, "mdns": {"t": 101.5, "address": "10.0.0.11:7000"}},
        "q": {"mdns": {"t": 101.5, "address": "10.0.0.12:7000"}},
        "s": {"static": {"t": 101.5, "address": ""}}}
    clock.t = 110.0
    table.withdraw("q", "mdns")
    table.upsert("q", "mdns", address="10.0.0.12:7000")  # back: not a new finding
    table.upsert("p", "presence", broker="10.0.0.2:8883")
    assert table.take_found() == {}
    table.upsert("q", "presence", broker="10.0.0.2:8883")  # a new way for a known peer
    assert table.take_found() == {"q": {"presence": {"t": 110.0, "address": ""}}}
    assert table.found_via()["q"] == "mdns"
    table.upsert("me", "mdns")  # never itself
    assert "me" not in table.found_via()


def test_a_presence_over_the_bridge_is_bridged_presence() -> None:
    table = HomeRoutedPeerTable("me", "fed", home_broker="198.18.0.10:8883")
    table.upsert("far", "presence", broker="198.18.1.10:8883", address="198.18.1.11")
    table.upsert("near", "presence", broker="198.18.0.10:8883", address="198.18.0.12")
    table.upsert("near", "mdns", broker="198.18.0.10:8883", address="198.18.0.12:5000")
    assert table.found_via() == {"far": "bridged-presence", "near": "presence"}
    assert set(table.take_found()["near"]) == {"presence", "mdns"}
    # without bridging (one broker per peer, connected directly) a presence is a presence
    direct = PeerTable("me", "fed", home_broker="198.18.0.10:8883")
    direct.upsert("far", "presence", broker="198.18.1.10:8883")
    assert direct.found_via() == {"far": "presence"}
