"""A peer that comes back (restart, power cut, healed partition, late join) gets a CHOCO
keyframe from each neighbour at once, instead of being left out of their rounds until the
periodic keyframe (found by the field lab: a power-cut device closed 50 of 59 rounds alone)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.compression import parse_spec
from dfl_agent.learning.error_feedback import ChocoGossip
from dfl_agent.runtime.node.membership import Membership


def _stream(epoch: list[int] | None = None) -> ChocoGossip:
    g = ChocoGossip(parse_spec("topk:0.1+q8"), np.random.default_rng(0), keyframe_every=100)
    if epoch is not None:
        g.epoch_source = lambda: epoch[0]
    return g


def test_a_returning_neighbour_gets_a_keyframe_and_its_new_copy_follows_the_stream() -> None:
    epoch = [0]
    sender = _stream(epoch)
    rng = np.random.default_rng(1)
    x = {"w": rng.normal(size=200).astype(np.float32)}
    metas = [sender.outgoing(x)[2]["choco"] for _ in range(3)]
    assert [m[1] for m in metas] == [1, 0, 0]  # a keyframe, then differences
    restarted = _stream()  # the neighbour lost its copy of the sender's stream (a power cut)
    blob, desc, meta = sender.outgoing(x)
    from dfl_agent.learning.compression import decompress_dict

    assert restarted.incoming("s", decompress_dict(blob, desc), meta) is None  # a gap: left out
    epoch[0] += 1  # the sender sees it come back in its presence
    blob, desc, meta = sender.outgoing(x)
    assert meta["choco"][1] == 1
    copy = restarted.incoming("s", decompress_dict(blob, desc), meta)
    assert copy is not None and np.allclose(copy["w"], sender.own_copy()["w"])
    blob, desc, meta = sender.outgoing({"w": x["w"] + 0.1})
    assert meta["choco"][1] == 0 and restarted.incoming("s", decompress_dict(blob, desc), meta) is not None
    assert np.allclose(restarted.copies["s"]["w"], sender.own_copy()["w"])  # the copies agree again


def test_membership_counts_a_peer_that_comes_back_not_one_that_stays() -> None:
    peers = PeerTable("me", "fed", heartbeat_timeout=None)
    m = Membership(SimpleNamespace(peers=peers, security=None, node_id="me", compatibility=None))
    m.on_presence("a", {"algorithm": "fedavg"})
    assert m.rejoins == 1  # first seen
    m.on_presence("a", {"algorithm": "fedavg"})  # a repeated presence of a live peer
    assert m.rejoins == 1
    m.on_presence("a", None)  # it went offline ...
    m.on_presence("a", {"algorithm": "fedavg"})  # ... and came back
    assert m.rejoins == 2


def test_membership_counts_a_peer_restarted_within_the_heartbeat_timeout() -> None:
    """Killed and restarted before its heartbeats stopped (its unsigned will only a hint): its
    status heartbeat counter starts again, and that counts as a return."""
    peers = PeerTable("me", "fed", heartbeat_timeout=None)
    m = Membership(SimpleNamespace(peers=peers, security=None, node_id="me", compatibility=None))
    for beat in (7, 8, 9):
        m.note_status("a", {"state": "training", "heartbeat": beat})
    assert m.rejoins == 0
    m.note_status("a", {"state": "idle", "heartbeat": 1})  # a new process
    assert m.rejoins == 1
    m.note_status("a", {"state": "idle", "heartbeat": 2})
    assert m.rejoins == 1


def test_membership_counts_a_peer_whose_session_broke_at_its_next_sign_of_life() -> None:
    """A partition shorter than the heartbeat timeout: the peer stays live, its last will came
    (its session broke, it may have missed this node's messages); its next status or presence
    counts as a return, once."""
    peers = PeerTable("me", "fed", heartbeat_timeout=None)
    m = Membership(SimpleNamespace(peers=peers, security=None, node_id="me", compatibility=None))
    m.on_presence("a", {"algorithm": "fedavg"})
    m.note_status("a", {"state": "training", "heartbeat": 7})
    assert m.rejoins == 1
    peers.note_session_lost("a")
    m.note_status("a", {"state": "training", "heartbeat": 8})  # back: a keyframe is due
    assert m.rejoins == 2
    m.note_status("a", {"state": "training", "heartbeat": 9})
    assert m.rejoins == 2
    peers.note_session_lost("a")
    m.on_presence("a", {"algorithm": "fedavg"})  # its presence again after a broken session
    assert m.rejoins == 3


def test_a_receiver_that_lost_a_stream_asks_for_a_keyframe_in_its_status_and_gets_it() -> None:
    """Found in the field lab: after a partition the returning device skipped rounds to catch up,
    the messages of those rounds never reached its CHOCO copies, and every later message was a
    gap (55, then 30 rounds alone). Whatever breaks a stream, the receiver's status now names
    the sender (``keyframe_wanted``) and the sender's next message is a keyframe."""
    from dfl_agent.learning.compression import decompress_dict

    def node(nid: str, peers_live: list[str]) -> Membership:
        peers = PeerTable(nid, "fed", heartbeat_timeout=None)
        ctx = SimpleNamespace(peers=peers, security=None, node_id=nid, compatibility=None, graph_neighbours=None)
        m = Membership(ctx)
        ctx.live_peers = m.live_peers
        for p in peers_live:
            m.on_presence(p, {"algorithm": "fedavg"})
        return m

    s_m, r_m = node("s", ["r"]), node("r", ["s"])
    sender, receiver = _stream(), _stream()
    sender.epoch_source = lambda: s_m.rejoins
    s_m.streams.append(sender)
    r_m.streams.append(receiver)
    assert r_m.keyframe_wanted() == ["s"]  # nothing received yet
    x = {"w": np.random.default_rng(1).normal(size=200).astype(np.float32)}
    blob, desc, meta = sender.outgoing(x)
    assert receiver.incoming("s", decompress_dict(blob, desc), meta) is not None  # the keyframe
    assert r_m.keyframe_wanted() == []
    sender.outgoing(x)  # a message the receiver never applies (a round it skipped)
    blob, desc, meta = sender.outgoing(x)
    assert receiver.incoming("s", decompress_dict(blob, desc), meta) is None  # a gap: left out
    status = {"state": "training", "heartbeat": 3, "keyframe_wanted": r_m.keyframe_wanted()}
    assert status["keyframe_wanted"] == ["s"]
    s_m.note_status("r", status)  # the sender reads the receiver's status heartbeat
    blob, desc, meta = sender.outgoing(x)
    assert meta["choco"][1] == 1  # a keyframe
    assert receiver.incoming("s", decompress_dict(blob, desc), meta) is not None and r_m.keyframe_wanted() == []
    s_m.note_status("r", {"state": "training", "heartbeat": 4, "keyframe_wanted": []})
    assert sender.outgoing(x)[2]["choco"][1] == 0  # differences again


def test_a_node_waiting_within_a_round_asks_for_keyframes_at_once() -> None:
    """A round that waits for updates it can decode would ask for keyframes only at its end
    (the status heartbeat repeats the last status): ``request_keyframes`` publishes the
    status when the list changed, else at most once a second, and not at all when empty."""
    import asyncio

    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.transport.memory import MemoryNetwork, run_virtual

    net = MemoryNetwork()
    ctx = RuntimeContext(node_id="me", federation="f", transport=net.transport("me", "f"), peers=PeerTable("me", "f"),
                         data=None, model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0))
    published: list[float] = []

    async def status() -> None:
        published.append(ctx.clock.now())

    ctx.set_hooks(status_hook=status)
    wanted: list[str] = []
    ctx.membership.keyframe_wanted = lambda: list(wanted)  # type: ignore[method-assign]

    async def main() -> None:
        await ctx.request_keyframes()  # nothing lost: nothing to ask
        wanted.append("a")
        for _ in range(4):  # at 0, 0.3, 0.6, 0.9 s: once (the list did not change)
            await ctx.request_keyframes()
            await asyncio.sleep(0.3)
        wanted.append("b")
        await ctx.request_keyframes()  # at 1.2 s: changed
        await asyncio.sleep(1.1)
        await ctx.request_keyframes()  # 1.1 s later, unchanged: again

    run_virtual(main())
    assert [round(t - published[0], 1) for t in published] == [0.0, 1.2, 2.3]


def test_a_keyframe_resent_after_the_next_difference_does_not_rewind_the_copy() -> None:
    """A neighbour re-sends its latest message as a keyframe to a peer it saw come back; the
    broker may deliver its next difference first (another topic).  The late keyframe must
    not rewind the copy: the field lab saw every stream of a device break at once that way.
    A restarted sender's keyframe (seq 0) is still taken."""
    from dfl_agent.learning.compression import decompress_dict

    sender, receiver = _stream(), _stream()
    rng = np.random.default_rng(2)
    sent = []
    for _ in range(4):
        blob, desc, meta = sender.outgoing({"w": rng.normal(size=200).astype(np.float32)})
        sent.append((decompress_dict(blob, desc), meta))
    for tensors, meta in sent[:3]:
        assert receiver.incoming("s", tensors, meta) is not None
    stale_key = {"choco": [1, 1]}  # message 1 re-sent as a keyframe, after message 2
    before = receiver.copies["s"]["w"].copy()
    assert receiver.incoming("s", {"w": np.zeros(200, np.float32)}, stale_key) is None
    assert np.array_equal(receiver.copies["s"]["w"], before)
    assert receiver.incoming("s", *sent[3]) is not None and receiver.gaps == 0  # the stream goes on
    restarted = _stream()
    blob, desc, meta = restarted.outgoing({"w": np.ones(200, np.float32)})
    assert meta["choco"] == [0, 1]
    assert np.allclose(receiver.incoming("s", decompress_dict(blob, desc), meta)["w"], 1.0)
