"""A restarted node that rejoins a running federation far ahead of it (an upgrade, a power cut):
its rejoin skip is capped at ``runtime.max_catch_up_rounds``, and, still behind, its first round
takes the neighbours' newest updates at once instead of waiting ``round_timeout`` for updates of
a round they have left and closing it alone (the field lab's rolling upgrade found each
upgraded device's first round closed alone after 20 s)."""

from __future__ import annotations

import asyncio

from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.neighbourhood import arrival_check
from dfl_agent.transport.memory import MemoryNetwork, run_virtual
from tests.unit.test_insider_limits import _ctx, _st, _starting_agent


def test_a_capped_rejoin_leaves_the_node_catching_up(tmp_path):
    both = {"a": _st("running", 40), "b": _st("running", 40)}
    assert _starting_agent(tmp_path, both, checks=lambda ag: (ag._rejoin_round(), ag.ctx.catching_up)) == (11, True)
    near = {"a": _st("running", 3), "b": _st("running", 3)}  # the skip reaches them: not behind
    assert _starting_agent(tmp_path / "n", near, checks=lambda ag: (ag._rejoin_round(), ag.ctx.catching_up)) == (
        4, False)
    one = {"a": _st("running", 40), "b": _st("running", 0)}  # one device's say moves nothing
    assert _starting_agent(tmp_path / "o", one, checks=lambda ag: (ag._rejoin_round(), ag.ctx.catching_up)) == (
        1, False)


def test_the_first_round_after_a_capped_rejoin_does_not_close_alone():
    """FedAvg under ``runtime.straggler = "quorum"``, round_timeout 10 s: the node rejoins at
    round 11 while its two neighbours close round 40 and on, one a second (virtual time).  Its
    first round closes at once with their newest updates, and no round of it is alone."""
    from dfl_agent.algorithms.base import get_algorithm
    from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy, quorum_options
    from dfl_agent.learning.params import model_to_numpy
    from dfl_agent.runtime.node.node import Node
    from tests.unit.test_outage_pause import _trainer

    net = MemoryNetwork()
    bundle, me = _trainer(net)
    me.straggler = StragglerPolicy("quorum")
    me.catch_up, me.max_catch_up_rounds, me.final_round = True, 10, 60
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
        me.membership.note_rejoin(11, {"a": 39, "b": 39}, 2, 60)  # what _rejoin_round tells it from their statuses
        node.state = "running"

        async def federation():  # rounds 40..60, one a second, whatever this node does
            for r in range(40, 61):
                for p in peers:
                    await p.send("me", Message("model", r, dict(model), meta={"samples": 10}))
                await asyncio.sleep(1.0)

        task = asyncio.ensure_future(federation())
        await node.run(60, start_round=11)
        await task

    run_virtual(main())
    seen = [(r["round"], r["neighbours"], round(r["round_seconds"], 1)) for r in records]
    assert seen[0][0] == 11 and seen[0][1] == 2 and seen[0][2] < 1.0, seen  # at once, with both
    assert all(n > 0 for _, n, _ in seen), seen
    assert seen[-1][0] == 60, seen


def test_a_rejoined_node_stays_behind_until_it_reaches_the_round_the_statuses_showed():
    """After a restart the first updates a node receives can be a broker's backlog of the rounds
    it missed, drained in order: they show no skip (in the lab, an upgraded device's second round
    then waited round_timeout, 20 s, and closed alone).  The node stays ``catching_up`` until it
    reaches the round its neighbours' statuses showed at its rejoin."""
    net = MemoryNetwork()
    me, a, b = _ctx(net, "me"), _ctx(net, "a"), _ctx(net, "b")
    me.catch_up, me.max_catch_up_rounds, me.final_round = True, 10, 60

    async def main():
        for c in (me, a, b):
            await c.start()
        me.membership.note_rejoin(11, {"a": 39, "b": 39}, 2, 60)  # both completed 39: the federation runs 40
        out: list[object] = [me.catching_up]
        out.append((me.membership.catch_up_round(12, {"a": 12, "b": 12}), me.catching_up))  # the backlog
        out.append((me.membership.catch_up_round(40, {"a": 12, "b": 12}), me.catching_up))  # there
        return out

    assert run_virtual(main()) == [True, (12, True), (40, False)]


def test_the_round_a_rejoined_node_must_reach_moves_on_with_its_peers_statuses():
    """In the field lab a device rejoined at round 79 while its peers' statuses showed about 220;
    with rounds of 0.1 s they were near 300 by the time its capped skips reached 221, and its
    round 222, no longer behind, waited round_timeout (20 s) and closed alone.  The statuses that
    come after the rejoin (a quorum of the live peers, as every catch-up) move the round to reach;
    one peer's status alone does not, and a node that never rejoined is not moved by statuses."""
    net = MemoryNetwork()
    me, a, b = _ctx(net, "me"), _ctx(net, "a"), _ctx(net, "b")
    me.catch_up, me.max_catch_up_rounds, me.final_round = True, 10, 1000

    def status(r, beat):
        return {"state": "running", "round": r, "heartbeat": beat}

    async def main():
        for c in (me, a, b):
            await c.start()
        out: list[object] = []
        me.note_status("a", status(500, 1))  # no rejoin: statuses move nothing
        out.append((me.membership.catch_up_round(5, {"a": 5, "b": 5}), me.catching_up))
        me.membership.note_rejoin(79, {"a": 220, "b": 220}, 2, 1000)
        me.note_status("a", status(300, 2))  # one peer's say
        out.append((me.membership.catch_up_round(222, {"a": 222, "b": 222}), me.catching_up))
        me.note_status("b", status(298, 1))  # a quorum: both at 298 or later
        out.append((me.membership.catch_up_round(222, {"a": 222, "b": 222}), me.catching_up))
        out.append((me.membership.catch_up_round(299, {"a": 300, "b": 300}), me.catching_up))  # there
        return out

    assert run_virtual(main()) == [(5, False), (222, False), (222, True), (300, False)]
