"""Broadcasts on a sparse communication graph in the simulator's memory network.

A neighbour-scoped broadcast (fedavg's model, fullavg's ``scope = all`` model, DecHW's
``delivery = broadcast``) reaches exactly the sender's graph neighbours: one shared
buffer, sent once, received once by each neighbour, no ``not_neighbour`` rejections.
The results are the same as when every node received it and the non-neighbours
rejected it (``MemoryNetwork(scoped_broadcasts=False)``, the delivery before, and
the traffic over MQTT).  Messages meant for every live peer (Def-KT's ``done``,
DFML's tokens) and directed sends still reach non-neighbours.
"""

import asyncio
import json
import logging

import numpy as np
import pytest

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.topology import build_topology
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.runtime.node.simulator import SimConfig, simulate
from dfl_agent.transport.memory import SHARED_STATS, MemoryNetwork, run_virtual
from tests.unit.toy import SPEC
from tests.unit.toy import toy_data as _data


def _run(graph, algorithm, options, rounds, *, scoped):
    """A federation on ``graph`` over the memory network; returns (nodes, records)."""
    net = MemoryNetwork(scoped_broadcasts=scoped)
    cls = get_algorithm(algorithm)
    opts = parse_options(cls, options)
    test = _data(99, 64)
    records, nodes = [], []
    for i, nid in enumerate(sorted(graph)):
        ctx = RuntimeContext(
            node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
            data=_data(i), model_spec=SPEC, train=TrainConfig(batch_size=8, lr=0.1), init_seed=0,
            rng=np.random.default_rng(i), graph_neighbours=graph[nid],
        )
        nodes.append(Node(ctx, cls(ctx, opts), test.train_x, test.train_y, sink=records.append, rounds=rounds))

    async def main():
        for n in nodes:
            await n.ctx.start()
        for n in nodes:
            await n.setup()
        await asyncio.gather(*(n.run(rounds) for n in nodes))

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only cost time (as in the simulator)
    try:
        run_virtual(main())
    finally:
        torch.set_num_threads(threads)
    return nodes, records


def _results(nodes, records):
    """What the learning produced: every record's accuracies, loss and neighbours, and
    every node's final parameters."""
    keys = ("node", "round", "global_accuracy", "local_accuracy", "train_loss", "neighbour_ids", "missing")
    recs = sorted(tuple(str(r.get(k)) for k in keys) for r in records)
    params = {n.ctx.node_id: model_to_numpy(n.algorithm.model) for n in nodes}
    return recs, params


CASES = [
    ("ring", {}, "fedavg", {}),
    ("erdos_renyi", {"p": 0.3}, "fedavg", {}),
    ("erdos_renyi", {"p": 0.4}, "dechw", {"delivery": "broadcast"}),
    ("ring", {}, "fullavg", {"scope": "all"}),
]


@pytest.mark.parametrize("topology,topo_opts,algorithm,options", CASES)
def test_broadcast_reaches_exactly_the_graph_neighbours(topology, topo_opts, algorithm, options, caplog):
    ids = [f"n{i}" for i in range(8)]
    graph = build_topology(topology, ids, seed=2, **topo_opts)
    assert any(len(v) < len(ids) - 1 for v in graph.values())  # sparse
    rounds = 2
    caplog.set_level(logging.WARNING)
    before = dict(SHARED_STATS)
    nodes, records = _run(graph, algorithm, options, rounds, scoped=True)
    broadcasts = sum(n.ctx.transport.stats.frames_sent for n in nodes)
    assert broadcasts >= len(ids) * rounds
    assert SHARED_STATS["buffers"] - before["buffers"] == broadcasts  # one encoded buffer per broadcast
    assert SHARED_STATS["decodes"] - before["decodes"] <= broadcasts
    for n in nodes:
        nid, s = n.ctx.node_id, n.ctx.transport.stats
        degree = len(graph[nid])
        # every neighbour's broadcasts arrived, nobody else's
        assert s.frames_received == sum(nodes[ids.index(p)].ctx.transport.stats.frames_sent for p in graph[nid])
        assert s.frames_sent == rounds + (algorithm == "dechw")  # DecHW also sends its round-0 model
        # sent once per broadcast, received once by each neighbour: the wire's counts
        assert s.bytes_received == sum(m for m in n.ctx.bytes_received_by_kind.values())
        assert n.ctx.rejected["not_neighbour"] == 0, n.ctx.rejected
        assert all(r["neighbour_ids"] == graph[nid] for r in records if r["node"] == nid)
        assert degree >= 1
    assert "not_neighbour" not in caplog.text

    # the same learning as when every node received every broadcast and the
    # non-neighbours rejected it (the delivery before, and what MQTT does)
    caplog.clear()
    old_nodes, old_records = _run(graph, algorithm, options, rounds, scoped=False)
    assert sum(n.ctx.rejected["not_neighbour"] for n in old_nodes) > 0  # the comparison run did deliver to all
    assert "not_neighbour" in caplog.text
    new_recs, new_params = _results(nodes, records)
    old_recs, old_params = _results(old_nodes, old_records)
    assert new_recs == old_recs
    for nid, params in new_params.items():
        for name, value in params.items():
            np.testing.assert_array_equal(value, old_params[nid][name])  # bit for bit
    # byte counts: the same bytes sent; received fewer, by exactly the non-neighbours' broadcasts
    for n, o in zip(nodes, old_nodes):
        assert n.ctx.transport.stats.frames_sent == o.ctx.transport.stats.frames_sent
        assert n.ctx.transport.stats.frames_received < o.ctx.transport.stats.frames_received


def test_directed_sends_and_unscoped_broadcasts_reach_non_neighbours():
    """On a ring, a send to a non-neighbour and a broadcast not scoped to the neighbours
    (tokens, pair ``done`` messages) still arrive; a scoped one reaches the two neighbours."""
    ids = [f"n{i}" for i in range(6)]
    graph = build_topology("ring", ids, seed=0)

    async def main():
        net = MemoryNetwork()
        ctxs = {}
        for i, nid in enumerate(ids):
            ctxs[nid] = RuntimeContext(
                node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
                data=_data(i), model_spec=SPEC, train=TrainConfig(), init_seed=0,
                rng=np.random.default_rng(i), graph_neighbours=graph[nid])
            await ctxs[nid].start()
        far = "n3"
        assert far not in graph["n0"]
        await ctxs["n0"].send(far, Message("direct", 1, {"w": np.ones(3, np.float32)}))
        await ctxs["n0"].broadcast(Message("token", 1))
        await ctxs["n0"].broadcast(Message("model", 1), neighbours_only=True)
        await asyncio.sleep(0)
        direct = await ctxs[far].receive("direct", round=1, deadline=1.0)
        tokens = {nid: await ctxs[nid].receive("token", round=1, deadline=2.0) for nid in ids[1:]}
        models = {nid: await ctxs[nid].receive("model", round=1, deadline=3.0) for nid in ids[1:]}
        return direct, tokens, models

    direct, tokens, models = run_virtual(main())
    assert direct is not None and direct.sender == "n0"
    assert all(m is not None for m in tokens.values())  # every live peer
    assert sorted(nid for nid, m in models.items() if m is not None) == graph["n0"] == ["n1", "n5"]


@pytest.mark.parametrize("algorithm", ["defkt", "dfml"])
def test_algorithms_that_talk_to_live_peers_work_on_a_ring(algorithm, tmp_path):
    """Def-KT's pairs and DFML's aggregator are drawn from all live peers, not from the
    graph: on a ring they still take models from non-neighbours, and every round
    completes with nothing rejected."""
    rounds, n = 3, 6
    cfg = SimConfig(algorithm=algorithm, nodes=n, rounds=rounds, dataset="digits", partition="iid", seed=3,
                    topology="ring", out=str(tmp_path), train=TrainConfig(batch_size=64))
    s = simulate(cfg)
    assert all(not d for d in s["dropped"].values()), s["dropped"]
    graph = build_topology("ring", [f"node{i:02d}" for i in range(n)], seed=3)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["round"] for r in records}) == list(range(1, rounds + 1))
    assert len(records) == n * rounds
    took = [(r["node"], p) for r in records for p in r.get("neighbour_ids") or []]
    assert took, "no node took a model"
    assert any(p not in graph[node] for node, p in took)  # from a non-neighbour
