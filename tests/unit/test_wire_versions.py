"""Wire version negotiation: a release federates with the previous one.

Agents announce the wire versions they speak (presence ``wires``, mDNS TXT ``wires``; an agent of
0.1.0 only ``version = "0.1.0/w5"`` and TXT ``wire=5``), and each frame is written in the highest
version its receivers all speak.  Today the wire is v5 on both releases; these tests speak a
test-only v6 (the encoder's version parameter, ``versions.SPOKEN`` patched to ``(5, 6)``) to show
what the next wire change gets: a v6 frame only for receivers that announced v6.  Before (0.1.0)
an agent wrote its one version to everybody and dropped any other as ``version``: the CHANGELOG
said "upgrade every agent together".
"""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from dfl_agent import WIRE_VERSIONS, __version__
from dfl_agent.algorithms.context import Message
from dfl_agent.discovery.mdns import MdnsDiscovery
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.transport import chunking, versions, wire
from dfl_agent.transport.memory import MemoryNetwork, run_virtual
from dfl_agent.transport.versions import negotiate, versions_of

V5_V6 = (5, 6)  # a release that speaks the next wire version beside today's


def _version(frame: bytes) -> int:
    return bytes(frame)[3] & ~wire.HEADER_ZSTD


def test_announcements_are_read_in_every_form() -> None:
    assert versions_of([5, 6]) == (5, 6) and versions_of("6,5") == (5, 6) and versions_of("5") == (5,)
    assert versions_of(5) == (5,)
    assert versions_of(None, "0.1.0/w5") == (5,)  # an agent of 0.1.0: only its presence's version
    assert versions_of([6], "0.1.0/w5") == (6,)  # wires win
    for junk in (None, "", "x", [True], ["a", -1, 0, 999], {"5": 1}, 5.0):
        assert versions_of(junk) == (), junk
    assert versions_of(list(range(1, 100))) == tuple(range(1, versions.MAX_ANNOUNCED_VERSIONS + 1))


def test_the_version_written_is_the_highest_all_receivers_speak(monkeypatch: pytest.MonkeyPatch) -> None:
    assert negotiate([]) == WIRE_VERSIONS[-1]
    monkeypatch.setattr(versions, "SPOKEN", V5_V6)
    assert negotiate([]) == 6  # nobody to ask: the newest
    assert negotiate([(5, 6)]) == 6 and negotiate([(5,)]) == 5  # a unicast: the recipient's
    assert negotiate([(5, 6), (5, 6, 7), (5,)]) == 5  # a broadcast: the lowest of the receivers' highest
    assert negotiate([(6, 7)]) == 6
    assert negotiate([()]) == 5  # not described yet: the oldest version this release speaks
    assert negotiate([(4,), (5, 6)]) == 6  # a receiver that can read nothing of this release is left out


def test_a_test_only_v6_is_written_and_read_and_an_older_reader_drops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    t = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    with pytest.raises(ValueError, match="wire version 6 is not one this release speaks"):
        wire.encode(Message("model", 1, dict(t)), federation="f", sender="a", version=6)
    monkeypatch.setattr(versions, "SPOKEN", V5_V6)
    f6 = wire.encode(Message("model", 1, dict(t)), federation="f", sender="a", version=6)
    f5 = wire.encode(Message("model", 1, dict(t)), federation="f", sender="a", version=5)
    assert (_version(f6), wire.raw_header(f6)["v"], _version(f5), wire.raw_header(f5)["v"]) == (6, 6, 5, 5)
    assert _version(wire.encode(Message("model", 1, dict(t)), federation="f", sender="a")) == 6  # the newest
    for f in (f5, f6):
        assert np.array_equal(wire.decode(f).tensors["w"], t["w"])
        chunks = chunking.split(f, 64, transfer_id=bytes(16))
        r = chunking.Reassembler(hash_from=wire.payload_offset)
        assert [bytes(x) for x in (r.feed(c) for c in chunks) if x is not None] == [f]
    # a frame whose envelope names another version than its version byte
    h, payload = wire.split_frame(f6)
    h["v"] = 5
    body = wire._JSON.encode(h).encode()
    bad = wire._PREFIX.pack(wire.MAGIC, 6, len(body)) + body + payload
    with pytest.raises(wire.WireError, match="envelope version 5 in a frame of version 6"):
        wire.decode(bad)
    # a reader that speaks only v5 (the previous release) drops v6 and reads v5
    monkeypatch.setattr(versions, "SPOKEN", (5,))
    with pytest.raises(wire.WireError) as err:
        wire.decode(f6)
    assert err.value.reason == "version"
    assert wire.decode(f5).round == 1


def test_each_receiver_gets_the_version_it_announced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of a release that speaks v5 and v6, with a peer of the same release (wires [5, 6]) and
    one of 0.1.0 (presence ``version = "0.1.0/w5"``, no ``wires``): unicasts in each one's version,
    broadcasts in v5 while the old node is a member, in v6 once it left."""
    monkeypatch.setattr(versions, "SPOKEN", V5_V6)
    net = MemoryNetwork()
    got: dict[str, list[bytes]] = {"new": [], "old": []}
    me = RuntimeContext(node_id="me", federation="f", transport=net.transport("me", "f", {"wires": [5, 6]}),
                        peers=PeerTable("me", "f"), data=None, model_spec={}, train=None, init_seed=0,
                        rng=np.random.default_rng(0))
    new = net.transport("new", "f", {"wires": [5, 6], "version": "0.3.0/w6"})
    old = net.transport("old", "f", {"version": "0.1.0/w5", "algorithm": "dfml"})
    w = {"w": np.ones(4, np.float32)}

    async def main() -> list[tuple[str, int]]:
        for name, t in (("new", new), ("old", old)):
            await t.start(lambda f, n, name=name: got[name].append(bytes(f)), lambda *_: None)
        await me.start()
        await asyncio.sleep(0)
        await me.send("new", Message("model", 1, dict(w)))
        await me.send("old", Message("model", 1, dict(w)))
        await me.broadcast(Message("model", 2, dict(w)))
        await asyncio.sleep(0)
        seen = [(k, _version(f)) for k in ("new", "old") for f in got[k]]
        await old.stop()  # the old node leaves (upgraded, say): the broadcast goes in v6
        await asyncio.sleep(0)
        await me.broadcast(Message("model", 3, dict(w)))
        await asyncio.sleep(0)
        return seen + [("new", _version(got["new"][-1]))]

    seen = run_virtual(main())
    assert seen == [("new", 6), ("new", 5), ("old", 5), ("old", 5), ("new", 6)]
    assert me.peers.get("old").wire_versions() == (5,) and me.peers.get("new").wire_versions() == (5, 6)
    # the old node reads what it was sent: a reader of v5 alone decodes every frame it got
    monkeypatch.setattr(versions, "SPOKEN", (5,))
    assert [wire.decode(f, federation="f").round for f in got["old"]] == [1, 2]


def _txt(node: str, **txt: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(decoded_properties={"id": node, "fed": "f", **txt}, port=0,
                                 parsed_addresses=lambda: ["127.0.0.2"])


def test_mdns_records_of_the_previous_release_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    table = PeerTable("me", "f")
    md = MdnsDiscovery(table, node_id="me", federation="f", descriptor={}, interfaces=["127.0.0.1"])
    props = md._txt({"version": f"{__version__}/w5"})
    assert props["wire"] == str(WIRE_VERSIONS[0]) and props["wires"] == ",".join(map(str, WIRE_VERSIONS))
    name = "f--{}._dfl._tcp.local."
    old = md._parse_txt(name.format("old"), _txt("old", wire="5", ver="0.1.0/w5"))  # 0.1.0's TXT: no wires
    assert old is not None and old["wires"] == "5"
    table.upsert("old", "mdns", **{k: v for k, v in old.items() if k != "node_id"})
    assert table.get("old").wire_versions() == (5,)
    monkeypatch.setattr(versions, "SPOKEN", V5_V6)
    both = md._parse_txt(name.format("next"), _txt("next", wire="5", wires="5,6"))
    assert both is not None and both["wires"] == "5,6"
    for node, txt in (("far", {"wire": "7", "wires": "7,8"}), ("older", {"wire": "4"}), ("none", {})):
        assert md._parse_txt(name.format(node), _txt(node, **txt)) is None, node
    assert md.errors["wire_version"] == 3
