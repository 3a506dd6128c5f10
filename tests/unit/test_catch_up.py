"""Fault tolerance of lock-step rounds: a node that fell behind its neighbours (a broker
outage, a partition) skips to their round when signed updates of later rounds show
them ahead (``runtime.rejoin``); it never skips on a non-neighbour's or a departed
peer's updates, nor when catching up is off."""

import asyncio

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.base import Algorithm
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.neighbourhood import arrival_check
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64
from dfl_agent.transport.memory import MemoryNetwork, run_virtual


def _ctx(net, nid, graph=None):
    return RuntimeContext(
        node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"), data=None,
        model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0), graph_neighbours=graph,
    )


def _scenario(catch_up=True, kill=False, graph=None):
    net = MemoryNetwork()
    ctxs = {nid: _ctx(net, nid, graph if nid == "me" else None) for nid in ("me", "ahead", "far")}
    ctxs["me"].catch_up = catch_up
    ctxs["me"].max_catch_up_rounds = 1000  # which round is chosen; the cap: test_insider_limits.py
    ctxs["me"].check_on_arrival("model", arrival_check({"x": np.ones(2, np.float32)}))

    async def main():
        for c in ctxs.values():
            await c.start()
        for r in (33, 34):  # "ahead" completed round 33 and sent its round-34 update
            await ctxs["ahead"].send("me", Message("model", r, {"x": np.ones(2, np.float32)}, meta={"samples": 1}))
        await ctxs["far"].send("me", Message("model", 90, {"x": np.ones(2, np.float32)}, meta={"samples": 1}))
        await asyncio.sleep(0.05)
        me = ctxs["me"]
        while (await me.receive("model", deadline=0.0)) is not None:  # a market took them: still evidence
            pass
        if kill:
            net.kill("ahead")
            net.kill("far")
            await asyncio.sleep(0.05)
        return ctxs["me"].catch_up_round(16), ctxs["me"].catch_up_round(40)

    return run_virtual(main()), ctxs["me"]


def test_skips_to_one_past_the_neighbours_round():
    (nxt, later), me = _scenario(graph=["ahead"])  # "far" is not a neighbour: ignored
    assert nxt == 34 and later == 40
    assert me.caught_up == 34 - 16


def test_no_skip_when_off_or_the_evidence_left():
    assert _scenario(catch_up=False)[0] == (16, 40)
    assert _scenario(kill=True)[0] == (16, 40)


class _Rounds(Algorithm):
    name = ""

    async def setup(self):
        pass

    async def round(self, t):
        return {}

    def catches_up(self):
        return True


class _Ctx:
    def __init__(self, jumps):
        self.jumps, self.ended = jumps, []

    async def end_round(self, t, **info):
        self.ended.append(t)

    def catch_up_round(self, next_round):
        return self.jumps.get(next_round, next_round)


def test_run_follows_catch_up_round():
    ctx = _Ctx({3: 7})
    alg = _Rounds.__new__(_Rounds)
    alg.ctx = ctx
    asyncio.run(alg.run(9, start_round=1))
    assert ctx.ended == [1, 2, 7, 8, 9]


def test_malformed_status_rounds_count_as_zero():
    from dfl_agent.runtime.run.rejoin import _as_float, _as_round

    assert [_as_round(v) for v in (7, "7", None, "x", [1], -3)] == [7, 7, 0, 0, 0, 0]
    assert [_as_float(v) for v in (1.5, "2", None, "x", {})] == [1.5, 2.0, 0.0, 0.0, 0.0]


def test_training_pauses_while_disconnected_from_the_broker():
    """``runtime.pause_when_disconnected``: a node that lost its broker does not train
    (and so does not run rounds alone) until the connection is back; the pause is
    reported as ``gated`` while it lasts and summed in ``disconnected_seconds``."""
    net = MemoryNetwork()
    ctxs = {nid: _ctx(net, nid) for nid in ("me", "peer")}
    me = ctxs["me"]
    me.pause_when_disconnected = True
    trained: list[float] = []
    seen: dict[str, object] = {}

    async def main():
        for c in ctxs.values():
            await c.start()
        await me.compute(lambda: trained.append(me.clock.now()))  # connected: no pause
        net.kill("me")  # the broker connection drops
        task = asyncio.ensure_future(me.compute(lambda: trained.append(me.clock.now())))
        await asyncio.sleep(10.0)
        seen["gated"], seen["done"] = me.gated, task.done()
        net.reconnect("me")
        await task
        seen["peers"] = me.live_peers()

    run_virtual(main())
    assert seen["gated"] == "not connected to the MQTT broker" and seen["done"] is False
    assert len(trained) == 2 and trained[1] >= 10.0
    assert me.gated is None and 10.0 <= me.disconnected_seconds <= 10.0 + me.reconnect_poll
    assert seen["peers"] == ["peer"]  # the peer is known again after reconnecting


def test_no_pause_when_off():
    net = MemoryNetwork()
    me = _ctx(net, "me")
    trained = []

    async def main():
        await me.start()
        net.kill("me")
        await me.compute(lambda: trained.append(1))

    run_virtual(main())
    assert trained == [1] and me.disconnected_seconds == 0.0


# -- the skip rule: evidence is only what passed every check; more than half of the live
# -- verified neighbours (two distinct ones when two or more are live) must have shown the round
GOOD = {"x": np.ones(2, np.float32)}
BAD = {"x": np.ones(5, np.float32)}  # the wrong shape


def _skip_scenario(sends, secure=False, trusted=("a", "b", "c")):
    """``me`` plus neighbours a, b, c; ``sends`` = [(sender, round, tensors)] delivered to
    ``me``, which checks model updates against ``GOOD``.  With ``secure``, every node signs
    and ``me`` requires signatures from the ``trusted`` (pinned) ids only.
    Returns (catch_up_round(16), me)."""
    net = MemoryNetwork()
    keys = {n: Ed25519PrivateKey.generate() for n in ("me", "a", "b", "c")}
    ctxs = {}
    for nid in keys:
        ctx = _ctx(net, nid)
        if secure:
            pinned = {n: public_key_b64(keys[n]) for n in ("me", *trusted)}
            ctx.security = SecurityGuard(nid, keys[nid], TrustStore("f", pinned), require_signatures=nid == "me")
        ctxs[nid] = ctx
    me = ctxs["me"]
    me.catch_up = True
    me.max_catch_up_rounds = 1000  # which round is chosen; the cap: test_insider_limits.py
    me.check_on_arrival("model", arrival_check(GOOD))

    async def main():
        for c in ctxs.values():
            await c.start()
        for sender, rnd, tensors in sends:
            await ctxs[sender].send("me", Message("model", rnd, dict(tensors), meta={"samples": 1}))
        await asyncio.sleep(0.05)
        return me.catch_up_round(16)

    return run_virtual(main()), me


def test_bad_tensor_future_round_frame_is_no_evidence():
    """Members' frames of a future round whose tensors do not fit are dropped and
    counted on arrival, and are no catch-up evidence (two of three would be enough)."""
    nxt, me = _skip_scenario([("a", 90, BAD), ("b", 90, BAD)])
    assert nxt == 16 and me.caught_up == 0
    assert me.rejected["incompatible"] == 2 and not me.latest_round
    assert me._take("model", None, None) is None  # not delivered to the algorithm either
    # the same frame with fitting tensors is evidence (the test can tell the difference)
    nxt, me = _skip_scenario([("a", 90, GOOD), ("b", 90, GOOD), ("c", 90, GOOD)])
    assert nxt == 90 and me.rejected["incompatible"] == 0


def test_one_of_three_live_neighbours_ahead_does_not_skip():
    nxt, me = _skip_scenario([("a", 90, GOOD), ("b", 15, GOOD), ("c", 15, GOOD)], secure=True)
    assert nxt == 16 and me.caught_up == 0 and sorted(me.neighbours()) == ["a", "b", "c"]


def test_two_of_three_live_neighbours_ahead_skip():
    nxt, me = _skip_scenario([("a", 90, GOOD), ("b", 40, GOOD), ("c", 15, GOOD)], secure=True)
    # half of three (rounded up) = two showed round 39 or later: skip to one past it
    assert nxt == 40 and me.caught_up == 40 - 16


def test_unverified_neighbours_frame_does_not_count():
    """With signatures required, the frame of a sender this node does not trust is
    dropped (and counted) and that sender is no neighbour: only the verified neighbour,
    which is behind, counts, so nothing is skipped."""
    sends = [("a", 15, GOOD), ("c", 90, GOOD)]
    nxt, me = _skip_scenario(sends, secure=True, trusted=("a",))
    assert nxt == 16 and me.caught_up == 0
    assert me.rejected["unknown_sender"] == 1 and "c" not in me.neighbours()
    # both trusted: one of the two verified neighbours is no majority (one insider never
    # decides a skip); both of them ahead are
    nxt, me = _skip_scenario(sends, secure=True, trusted=("a", "c"))
    assert nxt == 16
    nxt, me = _skip_scenario([("a", 90, GOOD), ("c", 90, GOOD)], secure=True, trusted=("a", "c"))
    assert nxt == 90


def test_bad_signed_frame_does_not_make_genuine_frames_replays():
    """A member-signed frame of a far future round with bad tensors is dropped before its
    round is remembered for the replay rule: the member's genuine update, sent just
    before it but arriving after it, is still accepted."""
    from dfl_agent.transport import wire

    net = MemoryNetwork()
    ka, kme = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pinned = {"a": public_key_b64(ka), "me": public_key_b64(kme)}
    me = _ctx(net, "me")
    me.security = SecurityGuard("me", kme, TrustStore("f", pinned), require_signatures=True)
    me.catch_up = True  # the daemon's setting: arrival checks on
    me.check_on_arrival("model", arrival_check(GOOD))
    signer = SecurityGuard("a", ka, TrustStore("f", pinned))
    enc = lambda rnd, t: wire.encode(Message("model", rnd, dict(t), meta={"samples": 1}, recipient="me"),  # noqa: E731
                                     federation="f", sender="a", sign=signer.sign)
    genuine = enc(3, GOOD)
    bad = enc(10**6, BAD)  # sent later, arrives first
    me._on_frame(bad, len(bad))
    me._on_frame(genuine, len(genuine))
    assert me.rejected["incompatible"] == 1 and me.rejected["replay"] == 0
    got = me._take("model", None, None)
    assert got is not None and got.round == 3 and me.latest_round == {"a": 3}


def test_under_quorum_a_node_behind_rejoins_the_quorums_round_over_capped_skips():
    """``runtime.straggler = "quorum"``: the federation does not wait for a node behind it;
    the node skips towards the neighbours' round by ``max_catch_up_rounds`` per round it
    closes (each of those rounds closes with their newest updates once it has waited its
    adaptive deadline), as under ``paper``: no evidence moves it further at once."""
    from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy

    def targets(mode):
        net = MemoryNetwork()
        me, ahead = _ctx(net, "me"), _ctx(net, "ahead")
        me.catch_up, me.max_catch_up_rounds = True, 10
        me.straggler = StragglerPolicy(mode=mode)
        me.check_on_arrival("model", arrival_check({"x": np.ones(2, np.float32)}))

        async def main():
            await me.start()
            await ahead.start()
            await ahead.send("me", Message("model", 150, {"x": np.ones(2, np.float32)}, meta={"samples": 1}))
            await asyncio.sleep(0.05)
            return me.catch_up_round(50), me.catch_up_round(61), me.catch_up_round(145)

        return run_virtual(main())

    assert targets("quorum") == targets("paper") == (60, 71, 150)


def test_under_quorum_a_node_far_behind_catches_up_over_capped_skips_with_its_neighbours():
    """FedAvg under ``runtime.straggler = "quorum"``: a node starts 30 rounds behind two
    neighbours that close a round a second without it (virtual time).  Its first round waits its
    deadline (no completion time learnt yet) and closes alone; then each skip moves it at most
    ``max_catch_up_rounds`` (10), and each round it runs while still behind closes at once with
    the neighbours' newest updates (``catching_up``), so it is with them three rounds later.
    Without that, each capped round waited its whole deadline (10 s) for updates of a round the
    neighbours had left and closed alone, and the node never caught up."""
    from dfl_agent.algorithms.base import get_algorithm
    from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy, quorum_options
    from dfl_agent.learning.params import model_to_numpy
    from dfl_agent.runtime.node.node import Node
    from tests.unit.test_outage_pause import _trainer

    net = MemoryNetwork()
    bundle, me = _trainer(net)
    me.straggler = StragglerPolicy("quorum")
    me.catch_up, me.max_catch_up_rounds, me.final_round = True, 10, 45
    peers = [_ctx(net, n) for n in ("a", "b")]
    fedavg = get_algorithm("fedavg")
    records: list[dict] = []
    node = Node(me, fedavg(me, quorum_options(fedavg.Options(round_timeout=10.0), me.straggler)),
                bundle.test.x[:50], bundle.test.y[:50], sink=records.append)

    async def main():
        for c in (me, *peers):
            await c.start()
        await node.setup()
        model = model_to_numpy(node.algorithm.model)
        me.check_on_arrival("model", arrival_check(model))
        node.state = "running"

        async def federation():  # rounds 31..45, one a second, whatever this node does
            for r in range(31, 46):
                for p in peers:
                    await p.send("me", Message("model", r, dict(model), meta={"samples": 10}))
                await asyncio.sleep(1.0)

        task = asyncio.ensure_future(federation())
        await node.run(45)
        await task

    run_virtual(main())
    seen = [(r["round"], r["neighbours"], round(r["round_seconds"], 1)) for r in records]
    rounds = [r for r, _, _ in seen]
    assert rounds[:4] == [1, 12, 23, 34] and rounds[-1] == 45, seen  # skips of 10 at most
    assert all(b - a <= 11 for a, b in zip(rounds, rounds[1:], strict=False)), seen
    assert seen[0][1] == 0 and all(n == 2 for _, n, _ in seen[1:]), seen  # only the first round alone
    assert all(s < 1.0 for _, _, s in seen[1:4]), seen  # no deadline waited while behind
    assert me.caught_up == 45 - len(rounds), seen
