"""Fault tolerance of lock-step rounds: a node that fell behind its neighbours (a broker
outage, a partition) skips to their round when signed updates of later rounds show
them ahead (``runtime.rejoin``); it never skips on a non-neighbour's or a departed
peer's updates, nor when catching up is off."""

import asyncio

import numpy as np

from dfl_agent.algorithms.base import Algorithm
from dfl_agent.algorithms.context import Message
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.context import RuntimeContext
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

    async def main():
        for c in ctxs.values():
            await c.start()
        for r in (33, 34):  # "ahead" completed round 33 and sent its round-34 update
            await ctxs["ahead"].send("me", Message("model", r, {"x": np.ones(2, np.float32)}))
        await ctxs["far"].send("me", Message("model", 90, {"x": np.ones(2, np.float32)}))
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
    from dfl_agent.runtime.daemon import _as_float, _as_round

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
