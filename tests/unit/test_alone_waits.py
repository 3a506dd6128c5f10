"""A round with no live neighbour waits for its deadline while the run's other members are
away (found in the field lab: a WAN outage longer than the heartbeat timeout made the lone
device of a site race through its rounds alone, 6 rounds ahead of the others, and it never
trained with them again in that run).  ``ctx.alone_waits`` (the agent's: the run has other
members, who have not finished it) turns the wait on; the simulator has none."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.neighbourhood import collect_round
from dfl_agent.algorithms.protocols.synchronization import UpdateMarket, waits_alone
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.transport.memory import MemoryNetwork, run_virtual

X = {"x": np.ones(2, np.float32)}


def _ctx(net, nid, alone_waits=None):
    return RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
                          data=None, model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0),
                          alone_waits=alone_waits)


def _collect(kind, ctx, deadline):
    if kind == "market":
        return UpdateMarket().collect(ctx, "model", 1, deadline=deadline, poll=0.5)
    return collect_round(ctx, "model", 1, deadline, 0.5, X)


@pytest.mark.parametrize("kind", ["market", "plain"])
@pytest.mark.parametrize("waits", [True, False])
def test_a_round_with_no_live_neighbour_waits_for_its_deadline_while_members_are_away(kind, waits):
    net = MemoryNetwork()
    me = _ctx(net, "me", (lambda: True) if waits else None)
    out = {}

    async def main():
        await me.start()
        t0 = me.clock.now()
        await _collect(kind, me, t0 + 20.0)
        out["closed_after"] = me.clock.now() - t0

    run_virtual(main())
    if waits:
        assert 19.5 <= out["closed_after"] <= 21.0  # one round per deadline, not a race
    else:
        assert out["closed_after"] < 1.0  # the simulator's (and a finished federation's) way


@pytest.mark.parametrize("kind", ["market", "plain"])
def test_a_member_that_comes_back_during_the_wait_is_taken_at_once(kind):
    net = MemoryNetwork()
    me, peer = _ctx(net, "me", lambda: True), _ctx(net, "peer")
    out = {}

    async def main():
        await me.start()
        t0 = me.clock.now()
        task = asyncio.ensure_future(_collect(kind, me, t0 + 20.0))
        await asyncio.sleep(3.0)
        await peer.start()  # back in this node's presence
        await asyncio.sleep(1.0)
        await peer.send("me", Message("model", 1, dict(X), meta={"samples": 1}))
        res = await task
        out["closed_after"] = me.clock.now() - t0
        out["senders"] = sorted(res.latest()) if kind == "market" else sorted(res[0])

    run_virtual(main())
    assert out["senders"] == ["peer"] and out["closed_after"] < 6.0


def test_waits_alone_needs_an_empty_neighbourhood_and_the_contexts_say():
    class C:
        alone_waits = staticmethod(lambda: True)

    assert waits_alone(C(), []) and not waits_alone(C(), ["p"])
    assert not waits_alone(SimpleNamespace(alone_waits=None), [])  # no alone_waits: the simulator's contexts
    C.alone_waits = staticmethod(lambda: False)  # the members finished the run: go on
    assert not waits_alone(C(), [])


@pytest.mark.parametrize("kind", ["market", "plain"])
def test_the_update_of_a_neighbour_that_finished_and_left_closes_the_round_at_once(kind):
    """The last round of a run: the faster neighbour sent its update, finished and left
    before this node's round began.  The round takes that update at once; before, with no
    live neighbour it waited for its whole deadline and took it then (every run's last
    round on the slower node, 2 s under the quorum's adaptive deadline)."""
    net = MemoryNetwork()
    me, peer = _ctx(net, "me", lambda: True), _ctx(net, "peer")
    out = {}

    async def main():
        await me.start()
        await peer.start()
        await asyncio.sleep(1.0)
        await peer.send("me", Message("model", 1, dict(X), meta={"samples": 1}))
        await peer.stop()  # a clean leave: its run is over
        await asyncio.sleep(1.0)
        out["live"] = me.neighbours()
        t0 = me.clock.now()
        res = await _collect(kind, me, t0 + 20.0)
        out["closed_after"] = me.clock.now() - t0
        out["senders"] = sorted(res.latest()) if kind == "market" else sorted(res[0])

    run_virtual(main())
    assert out["live"] == []
    assert out["senders"] == ["peer"] and out["closed_after"] < 1.0, out
