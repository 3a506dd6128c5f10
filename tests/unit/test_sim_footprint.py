"""A simulated node's state on a sparse graph is O(its degree), not O(N), and the
simulator's figures do not change for it.

On a graph, a node of a neighbourhood algorithm (fedavg, dechw, cfa, dechetero) hears the
presence of its graph neighbours only, so its peer table and live-peer view (and the
status built from it) hold its neighbours; the records' ``live_peers`` and DecHW's ``delivery = auto`` rule still count
the whole federation (:meth:`RuntimeContext.live_peer_count`).  The pinned figures below
are those of the simulator before presence followed the graph (commit 75535c2): accuracy
per node and round, the live-peer count, the neighbours used, and the bytes sent (unicast
to each neighbour while a non-neighbour lives, one broadcast once none does).
"""

import pytest

from dfl_agent.runtime.node import simulator
from dfl_agent.runtime.node.simulator import SimConfig, round_records
from dfl_agent.transport.memory import run_virtual


def _started(nodes, algorithm="fedavg", topology="k_regular", **options):
    """The simulator's federation, assembled and its transports started (presence
    exchanged), without a round."""
    cfg = SimConfig(algorithm=algorithm, nodes=nodes, rounds=1, dataset="digits", samples_per_node=4,
                    topology=topology, topology_options=options)
    fed = simulator._assemble(cfg, "cpu", [].append)

    async def start():
        for node in fed.nodes:
            await node.ctx.start()

    run_virtual(start())
    return fed


def _state_sizes(node):
    ctx = node.ctx
    return {"peer_table": len(ctx.peers.all()), "live_peers": len(ctx.live_peers()),
            "neighbours": len(ctx.neighbours()), "findings": len(ctx.peers.found_via())}


@pytest.mark.parametrize("topology,options,degree", [("k_regular", {"k": 4}, 4), ("ring", {}, 2)])
def test_a_nodes_state_does_not_grow_with_n_on_a_sparse_graph(topology, options, degree):
    small, large = _started(50, topology=topology, **options), _started(500, topology=topology, **options)
    for fed, n in ((small, 50), (large, 500)):
        for node in (fed.nodes[0], fed.nodes[n // 2]):
            assert _state_sizes(node) == {"peer_table": degree, "live_peers": degree, "neighbours": degree,
                                          "findings": 0}
            assert sorted(node.ctx.live_peers()) == sorted(node.ctx.graph_neighbours)
            assert node.ctx.live_peer_count() == n - 1  # the records still count the federation


def test_rotating_algorithms_still_hear_every_member_on_a_graph():
    # DFML picks its aggregators among all live members, whatever the graph
    fed = _started(6, algorithm="dfml", topology="ring")
    ctx = fed.nodes[0].ctx
    assert len(ctx.peers.all()) == 5 and ctx.live_peer_count() == 5 and len(ctx.neighbours()) == 2


def _pinned_view(records):
    return {n: [(r["round"], r["global_accuracy"], r["live_peers"], r["neighbour_ids"]) for r in rs]
            for n, rs in records.items()}


# (round, global accuracy, live_peers, neighbours used) per node, and the round's bytes sent,
# as measured at 75535c2 (bench/scale/reproduce.md)
DECHW_RING_KILL = {
    "node00": [(1, 0.0947075208913649, 5, ["node01", "node05"]), (2, 0.08913649025069638, 4, ["node01", "node05"]),
               (3, 0.07799442896935933, 4, ["node01", "node05"])],
    "node01": [(1, 0.09192200557103064, 5, ["node00", "node02"]), (2, 0.09192200557103064, 4, ["node00", "node02"]),
               (3, 0.07799442896935933, 4, ["node00", "node02"])],
    "node02": [(1, 0.07242339832869081, 5, ["node01", "node03"]), (2, 0.07799442896935933, 4, ["node01", "node03"]),
               (3, 0.0584958217270195, 4, ["node01"])],
    "node03": [(1, 0.08635097493036212, 5, ["node02", "node04"])],
    "node04": [(1, 0.0807799442896936, 5, ["node03", "node05"]), (2, 0.08635097493036212, 4, ["node03", "node05"]),
               (3, 0.09749303621169916, 4, ["node05"])],
    "node05": [(1, 0.0947075208913649, 5, ["node00", "node04"]), (2, 0.0947075208913649, 4, ["node00", "node04"]),
               (3, 0.09192200557103064, 4, ["node00", "node04"])],
}
# models unicast per round (model frame: 138,792 bytes): round 1 sends rounds 0 and 1 to both
# neighbours; node02 and node04 keep one live neighbour after node03 is killed
DECHW_MODELS_SENT = {"node00": [4, 2, 2], "node01": [4, 2, 2], "node02": [4, 1, 1], "node03": [4],
                     "node04": [4, 1, 1], "node05": [4, 2, 2]}


def test_pinned_dechw_figures_on_a_ring_with_a_killed_node():
    recs = round_records(SimConfig(algorithm="dechw", nodes=6, rounds=3, dataset="digits", partition="iid",
                                   samples_per_node=16, topology="ring", kill={3: 2}))
    assert _pinned_view(recs) == {n: [(t, pytest.approx(a, abs=1e-12), live, used) for t, a, live, used in rs]
                                  for n, rs in DECHW_RING_KILL.items()}
    for n, counts in DECHW_MODELS_SENT.items():
        # envelopes carry a wall-clock time: a frame's length may vary by a few bytes
        assert [r["round_bytes_sent"] for r in recs[n]] == [pytest.approx(c * 138_792, abs=16 * c) for c in counts]


FEDAVG_ER = {
    "node00": [0.09749303621169916, 0.09749303621169916], "node01": [0.08913649025069638, 0.08913649025069638],
    "node02": [0.08635097493036212, 0.0807799442896936], "node03": [0.08913649025069638, 0.08913649025069638],
    "node04": [0.07242339832869081, 0.06128133704735376], "node05": [0.08913649025069638, 0.09192200557103064],
    "node06": [0.08635097493036212, 0.09192200557103064], "node07": [0.08635097493036212, 0.08913649025069638],
}


def test_pinned_fedavg_figures_on_an_erdos_renyi_graph():
    recs = round_records(SimConfig(algorithm="fedavg", nodes=8, rounds=2, dataset="digits", partition="iid",
                                   samples_per_node=16, topology="erdos_renyi", topology_options={"p": 0.4}))
    assert {n: [r["global_accuracy"] for r in rs] for n, rs in recs.items()} == {
        n: [pytest.approx(a, abs=1e-12) for a in accs] for n, accs in FEDAVG_ER.items()}
    assert {r["live_peers"] for rs in recs.values() for r in rs} == {7}
    assert all("peers_found" not in r for rs in recs.values() for r in rs)  # nothing to find in a simulation


def test_a_shared_broadcast_leaves_no_per_message_state_behind():
    """A receiver keeps no id of a shared broadcast (the memory network hands it to each
    receiver once) and a sender no copy of its last message; a raw frame's id is still
    remembered, and its copy dropped as a duplicate."""
    import asyncio

    import numpy as np

    from dfl_agent.algorithms.context import Message
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.transport import wire
    from dfl_agent.transport.memory import MemoryNetwork

    net = MemoryNetwork()
    a, b, c = (RuntimeContext(node_id=n, federation="f", transport=net.transport(n, "f"), peers=PeerTable(n, "f"),
                              data=None, model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0))
               for n in "abc")

    async def main():
        for ctx in (a, b, c):
            await ctx.start()
        await a.broadcast(Message("model", 1, {"w": np.ones(3, np.float32)}))
        assert a.outbox.last_encoded is None
        got = [await ctx.receive("model", round=1, deadline=1.0) for ctx in (b, c)]
        assert [m.sender for m in got] == ["a", "a"] and len(b.inbox.seen_ids) == len(c.inbox.seen_ids) == 0
        raw = wire.encode(Message("model", 2, {"w": np.ones(3, np.float32)}), federation="f", sender="a")
        for _ in range(2):
            net.deliver_raw("b", raw)
        await asyncio.sleep(0)
        assert b.inbox.seen_ids == {wire.decode(raw, federation="f").msg_id}
        assert b.rejected["duplicate"] == 1 and (await b.receive("model", round=2, deadline=2.0)).round == 2

    run_virtual(main())
