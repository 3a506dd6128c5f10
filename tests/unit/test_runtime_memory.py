"""RuntimeContext over the memory transport on the virtual-time loop: fedavg end to end,
bad input rejected and counted, dead peers never stall a round past its deadline."""

import asyncio

import numpy as np
import pytest

from dfl_agent.algorithms.base import available, get_algorithm, parse_options
from dfl_agent.algorithms.context import Message
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.transport import wire
from dfl_agent.transport.memory import MemoryNetwork, SimulationDeadlock, run_virtual
from tests.unit.toy import SPEC
from tests.unit.toy import toy_data as _data


def _federation(n, algorithm="fedavg", options=None, latency=0.0):
    net = MemoryNetwork(latency=latency)
    cls = get_algorithm(algorithm)
    opts = parse_options(cls, options or {})
    nodes = []
    test = _data(99, 64)
    for i in range(n):
        nid = f"n{i}"
        ctx = RuntimeContext(
            node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
            data=_data(i), model_spec=SPEC, train=TrainConfig(batch_size=8, lr=0.1), init_seed=0,
            rng=np.random.default_rng(i),
        )
        nodes.append(Node(ctx, cls(ctx, opts), test.train_x, test.train_y))
    return net, nodes


def _run(net, nodes, rounds, kill=None):
    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        tasks = [asyncio.ensure_future(n.run(rounds)) for n in nodes]
        if kill:
            await asyncio.sleep(kill[1])
            net.kill(nodes[kill[0]].ctx.node_id)
            tasks[kill[0]].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return asyncio.get_running_loop().time()

    return run_virtual(main())


def test_registry_has_foundation_algorithms():
    assert {"fedavg", "local"} <= set(available())
    with pytest.raises(KeyError, match="known"):
        get_algorithm("nope")


def test_parse_options_names_bad_key():
    with pytest.raises(ValueError, match="algorithm.options.bogus"):
        parse_options(get_algorithm("fedavg"), {"bogus": 1})
    with pytest.raises(ValueError, match="round_timeout"):
        parse_options(get_algorithm("fedavg"), {"round_timeout": "soon"})


def test_fedavg_converges_to_consensus_and_is_deterministic():
    results = []
    for _ in range(2):
        net, nodes = _federation(3)
        _run(net, nodes, 3)
        params = [model_to_numpy(n.algorithm.model) for n in nodes]
        results.append(params)
        assert all(len(n.history) == 3 for n in nodes)
        assert all(n.history[-1]["neighbours"] == 2 for n in nodes)
        # after averaging, all nodes hold the same model (same round, all neighbours)
        for k in params[0]:
            np.testing.assert_allclose(params[0][k], params[1][k], rtol=1e-5, atol=1e-6)
    for k in results[0][0]:
        np.testing.assert_array_equal(results[0][0][k], results[1][0][k])


def test_local_sends_nothing():
    net, nodes = _federation(2, "local")
    _run(net, nodes, 2)
    assert all(n.ctx.transport.stats.bytes_sent == 0 for n in nodes)


def test_dead_peer_never_stalls_a_round_past_its_deadline():
    net, nodes = _federation(3, options={"round_timeout": 20.0})
    # kill n2 right away: the others must go on; each round waits at most 20 virtual s
    end = _run(net, nodes, 3, kill=(2, 0.0))
    for n in nodes[:2]:
        assert len(n.history) == 3
        assert all(r["round_seconds"] <= 20.0 + 1e-6 for r in n.history)
    assert end < 3 * 20.0 + 1


def test_peer_silent_but_present_costs_exactly_the_deadline():
    net, nodes = _federation(2, options={"round_timeout": 5.0})

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        # n1 is online but never runs rounds
        await nodes[0].run(2)
        return asyncio.get_running_loop().time()

    end = run_virtual(main())
    assert nodes[0].history[-1]["missing"] == ["n1"]
    assert 10.0 <= end <= 10.0 + 1e-6


def test_bad_frames_are_rejected_counted_and_the_model_is_untouched():
    net, nodes = _federation(2)
    a, b = nodes

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        before = model_to_numpy(a.algorithm.model)
        good = model_to_numpy(b.algorithm.model)
        bad_frames = [
            b"garbage",
            wire.encode(Message("model", 1, good, meta={"samples": 3}), federation="f", sender="n1")[:50],
            wire.encode(Message("model", 1, good, meta={"samples": 3}), federation="other", sender="n1"),
            wire.encode(Message("model", 1, {k: v * np.nan for k, v in good.items()}, meta={"samples": 3}),
                        federation="f", sender="n1"),
        ]
        a.ctx.max_frame_bytes = 10_000_000
        big = wire.encode(Message("model", 1, {"x": np.zeros(3_000_000, np.float32)}), federation="f", sender="n1")
        bad_frames.append(big)
        for f in bad_frames:
            net.deliver_raw("n0", f)
        # wrong shapes pass the wire but fail the algorithm's check
        wrong = {k: np.zeros((1,) + v.shape, v.dtype) for k, v in good.items()}
        net.deliver_raw("n0", wire.encode(Message("model", 1, wrong, meta={"samples": 3}), federation="f", sender="n1"))
        await asyncio.sleep(0.01)
        after = model_to_numpy(a.algorithm.model)
        for k in before:
            np.testing.assert_array_equal(before[k], after[k])
        await a.run(1)  # n1 never answers for real: the wrong-shape one is rejected, round times out
        return a.ctx.counters()["dropped"]

    dropped = run_virtual(main())
    assert dropped["malformed"] == 2
    assert dropped["wrong_federation"] == 1
    assert dropped["non_finite"] == 1
    assert dropped["oversized"] == 1
    assert dropped["incompatible"] == 1
    assert a.history[0]["neighbours"] == 0


def test_virtual_deadlock_is_reported():
    async def main():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationDeadlock):
        run_virtual(main())


def test_broadcast_is_one_shared_buffer_decoded_once():
    """Memory O(N x model): each broadcast is stored as one buffer and decoded once; every
    receiver gets the same read-only arrays (no per-receiver copy of the model)."""
    from dfl_agent.transport.memory import SHARED_STATS

    n, rounds = 5, 2
    net, nodes = _federation(n)
    before = dict(SHARED_STATS)
    _run(net, nodes, rounds)
    broadcasts = sum(nd.ctx.transport.stats.frames_sent for nd in nodes)
    assert broadcasts >= n * rounds
    assert SHARED_STATS["buffers"] - before["buffers"] == broadcasts  # one encoded buffer per broadcast
    assert SHARED_STATS["decodes"] - before["decodes"] <= broadcasts  # not one decode per receiver
    received = sum(nd.ctx.transport.stats.frames_received for nd in nodes)
    assert received == broadcasts * (n - 1)

    async def shared_arrays():
        _net2, nodes2 = _federation(3)
        for nd in nodes2:
            await nd.ctx.start()
        msg = Message(kind="model", round=1, tensors={"w": np.arange(6, dtype=np.float32)})
        await nodes2[0].ctx.broadcast(msg)
        await asyncio.sleep(0)
        got = [await nd.ctx.receive("model", round=1, deadline=1.0) for nd in nodes2[1:]]
        return got

    a, b = run_virtual(shared_arrays())
    assert a is not b and a.tensors["w"] is b.tensors["w"]  # the same array, not a copy
    assert not a.tensors["w"].flags.writeable
    # the records are per receiver, their tensors/meta one shared read-only mapping
    assert a.tensors is b.tensors and a.meta is b.meta
    with pytest.raises(TypeError):
        a.tensors["w"] = np.zeros(6, dtype=np.float32)
    assert type(dict(a.tensors)) is dict
    np.testing.assert_array_equal(a.tensors["w"], np.arange(6, dtype=np.float32))


def test_round_records_say_where_the_time_went():
    """Every round's record carries train/encode/send/receive/wait/eval seconds; training
    and evaluation really took time, and the parts never exceed the round."""
    net, nodes = _federation(3)
    _run(net, nodes, 2)
    for nd in nodes:
        assert len(nd.history) == 2
        for r in nd.history:
            for k in ("train_s", "encode_s", "send_s", "receive_s", "wait_s", "eval_s", "round_wall_s"):
                assert isinstance(r[k], float) and r[k] >= 0.0, k
            assert r["train_s"] > 0 and r["eval_s"] > 0 and r["encode_s"] > 0 and r["receive_s"] > 0
            parts = r["train_s"] + r["encode_s"] + r["send_s"] + r["receive_s"] + r["wait_s"]
            assert abs(parts - r["round_wall_s"]) < 1e-3 or r["wait_s"] == 0.0
