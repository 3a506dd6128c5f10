"""Def-KT (seed 004) and its baselines on the virtual-time simulator: the pair schedule,
rounds mode (disjoint pairs, receiver stores w̃, dead or disagreeing peers never
stall), gossip mode (no global rounds, a peer dying mid-transfer), Combo, FullAvg,
determinism."""

import asyncio
import collections
import copy
import dataclasses

import numpy as np
import pytest

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.algorithms.protocols.pairs import pair_schedule
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.params import load_numpy, model_to_numpy
from dfl_agent.learning.training import TrainConfig, evaluate
from dfl_agent.learning.transfer import flatten_segment, mutual_transfer
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.runtime.node.simulator import SimConfig, simulate
from dfl_agent.transport.memory import MemoryNetwork, run_virtual
from tests.unit.toy import SPEC
from tests.unit.toy import toy_data as _data


def _federation(n, algorithm="defkt", options=None, init_seed=0):
    net = MemoryNetwork()
    cls = get_algorithm(algorithm)
    opts = parse_options(cls, options or {})
    test = _data(99, 200)
    nodes = []
    for i in range(n):
        nid = f"n{i}"
        ctx = RuntimeContext(
            node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
            data=_data(i), model_spec=SPEC, train=TrainConfig(batch_size=8, lr=0.1), init_seed=init_seed,
            rng=np.random.default_rng(i),
        )
        nodes.append(Node(ctx, cls(ctx, opts), test.train_x, test.train_y))
    return net, nodes


def _run(net, nodes, rounds, kill_at=None, before=None):
    """Run every node for ``rounds``; ``kill_at = {index: round}`` crashes a node when it
    starts that round (like SimConfig.kill). Returns the virtual end time."""

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        for i, r in (kill_at or {}).items():
            node = nodes[i]
            original = node.algorithm.round

            async def round_or_die(t, node=node, original=original, r=r):
                if t >= r:
                    net.kill(node.ctx.node_id)
                    raise asyncio.CancelledError
                return await original(t)

            node.algorithm.round = round_or_die
        if before:
            before()
        tasks = [asyncio.ensure_future(n.run(rounds)) for n in nodes]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for i, res in enumerate(results):  # only the nodes killed on purpose may end in an exception
            if isinstance(res, BaseException) and i not in (kill_at or {}):
                raise AssertionError(f"node {nodes[i].ctx.node_id} crashed: {res!r}") from res
        return asyncio.get_running_loop().time()

    return run_virtual(main())


def _params(node):
    return model_to_numpy(node.algorithm.model)


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in a)


# -- the schedule --------------------------------------------------------------------------


def test_schedule_pairs_are_disjoint_deterministic_and_uniform():
    ids = [f"node{i:02d}" for i in range(10)]
    senders = collections.Counter()
    for t in range(1, 2001):
        pairs = pair_schedule(ids, 7, t, 3)
        assert len(pairs) == 3
        flat = [x for p in pairs for x in p]
        assert len(set(flat)) == 6 and set(flat) <= set(ids)
        assert pair_schedule(list(reversed(ids)) + ids[:2], 7, t, 3) == pairs  # order and duplicates irrelevant
        senders.update(s for s, _ in pairs)
    assert pair_schedule(ids, 7, 1, 3) != pair_schedule(ids, 8, 1, 3)
    assert pair_schedule(ids, 7, 1, 3) != pair_schedule(ids, 7, 2, 3)
    # each node is a sender in about Q/K = 30 % of the rounds
    assert all(500 < senders[i] < 700 for i in ids)
    assert pair_schedule(ids[:5], 7, 1, 9) and len(pair_schedule(ids[:5], 7, 1, 9)) == 2  # capped at n // 2
    assert pair_schedule(ids[:1], 7, 1, 1) == []
    with pytest.raises(ValueError):
        pair_schedule(ids, 7, 1, 0)


def test_a_missing_node_only_shifts_the_pairs_ranked_after_it():
    ids = [f"node{i:02d}" for i in range(20)]
    for t in range(1, 50):
        pairs = pair_schedule(ids, 0, t, 3)
        used = {x for p in pairs for x in p}
        outsider = next(i for i in ids if i not in used)
        assert pair_schedule([i for i in ids if i != outsider], 0, t, 3) == pairs
        last_receiver = pairs[-1][1]
        assert pair_schedule([i for i in ids if i != last_receiver], 0, t, 3)[:2] == pairs[:2]


def test_options_are_validated():
    cls = get_algorithm("defkt")
    assert parse_options(cls, {}).Q == 1 and parse_options(cls, {}).E == 1 and parse_options(cls, {}).M == 1
    assert parse_options(cls, {}).sender_keeps == "trained" and parse_options(cls, {}).mode == "rounds"
    for bad in ({"mode": "sync"}, {"sender_keeps": "x"}, {"Q": 0}, {"E": 0}, {"round_timeout": 5.0},
                {"max_queue": 0}, {"temperature": 0.0}, {"transfer_lr": -0.1}, {"transfer_momentum": 1.0},
                {"transfer_momentum": -0.5}, {"transfer_batch_size": -1}):
        with pytest.raises(ValueError):
            parse_options(cls, bad)
    with pytest.raises(ValueError, match="gossip|rounds"):
        parse_options(get_algorithm("fullavg"), {"scope": "all", "mode": "gossip"})
    with pytest.raises(ValueError, match="unknown option"):
        parse_options(get_algorithm("combo"), {"mode": "gossip"})


# -- rounds mode -----------------------------------------------------------------------------


def test_rounds_mode_runs_the_schedule_pairs_only():
    net, nodes = _federation(6, options={"Q": 2})
    end = _run(net, nodes, 4)
    ids = [n.ctx.node_id for n in nodes]
    for t in range(1, 5):
        pairs = pair_schedule(ids, 0, t, 2)
        roles = {n.ctx.node_id: n.history[t - 1] for n in nodes}
        for s, r in pairs:
            assert roles[s]["role"] == "sender" and roles[s]["partner"] == r
            assert roles[r]["role"] == "receiver" and roles[r]["partner"] == s and roles[r]["fused"]
        idle = set(ids) - {x for p in pairs for x in p}
        assert all(roles[i]["role"] == "idle" for i in idle)
        assert all(rec["late"] == [] for rec in roles.values())
    assert end == 0.0  # nobody waited for a deadline
    # per round: Q models plus Q tiny "done" broadcasts
    kinds = collections.Counter()
    for n in nodes:
        kinds.update(n.ctx.bytes_sent_by_kind)
    assert set(kinds) == {"defkt.model", "defkt.done"}
    assert kinds["defkt.done"] / (4 * 2) < 400  # bytes per "done" (envelope only)


def test_idle_nodes_keep_their_model_and_the_receiver_stores_w_tilde():
    net, nodes = _federation(4)
    ids = [n.ctx.node_id for n in nodes]
    (s, r), = pair_schedule(ids, 0, 1, 1)
    idle = [n for n in nodes if n.ctx.node_id not in (s, r)]
    by_id = {n.ctx.node_id: n for n in nodes}
    sent = {}

    def spy():
        original = by_id[s].ctx.send

        async def send(peer, message):
            sent[peer] = copy.deepcopy(message.tensors)
            return await original(peer, message)

        by_id[s].ctx.send = send

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        spy()
        before = {n.ctx.node_id: _params(n) for n in nodes}
        receiver = by_id[r]
        rng_state = copy.deepcopy(receiver.ctx.rng.bit_generator.state)
        await asyncio.gather(*(n.run(1) for n in nodes))
        return before, rng_state

    before, rng_state = run_virtual(main())
    for n in idle:
        assert _same(before[n.ctx.node_id], _params(n))
    assert _same(sent[r], _params(by_id[s]))  # sender_keeps = trained
    # the receiver's new model is w̃ after E = 1 epoch of mutual transfer with its old w
    w_tilde, w = by_id[r].algorithm.new_model(), by_id[r].algorithm.new_model()
    load_numpy(w_tilde, sent[r])
    load_numpy(w, before[r])
    rng = np.random.default_rng()
    rng.bit_generator.state = rng_state
    d = by_id[r].ctx.data
    # the transfer's default optimiser: the training lr and batch size, no momentum (Eq. 2-3)
    plain = dataclasses.replace(by_id[r].ctx.train, momentum=0.0)
    assert by_id[r].ctx.train.momentum == 0.9
    with_momentum = copy.deepcopy(w_tilde), copy.deepcopy(w)
    mutual_transfer(w_tilde, w, d.train_x, d.train_y, plain, copy.deepcopy(rng))
    got = _params(by_id[r])
    for k, v in model_to_numpy(w_tilde).items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=1e-7)
    # ... which is not what the training optimiser (momentum 0.9) would have stored
    mutual_transfer(*with_momentum, d.train_x, d.train_y, by_id[r].ctx.train, rng)
    assert not all(np.allclose(got[k], v, atol=1e-6) for k, v in model_to_numpy(with_momentum[0]).items())


def test_the_transfer_optimiser_options_replace_the_training_ones():
    cls = get_algorithm("defkt")
    net, nodes = _federation(2)
    algo = nodes[0].algorithm
    train = nodes[0].ctx.train
    cfg = algo.transfer_config()
    assert (cfg.lr, cfg.momentum, cfg.batch_size) == (train.lr, 0.0, train.batch_size)
    algo.options = parse_options(cls, {"transfer_lr": 0.01, "transfer_momentum": 0.5, "transfer_batch_size": 200})
    cfg = algo.transfer_config()
    assert (cfg.lr, cfg.momentum, cfg.batch_size) == (0.01, 0.5, 200)
    assert (cfg.weight_decay, cfg.epochs) == (train.weight_decay, train.epochs)


def test_sender_keeps_unchanged():
    net, nodes = _federation(2, options={"sender_keeps": "unchanged"})

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        before = [_params(n) for n in nodes]
        await asyncio.gather(*(n.run(1) for n in nodes))
        return before

    before = run_virtual(main())
    roles = [n.history[0]["role"] for n in nodes]
    s = roles.index("sender")
    assert _same(before[s], _params(nodes[s]))
    assert not _same(before[1 - s], _params(nodes[1 - s]))


@pytest.mark.parametrize("victim_role", ["sender", "receiver"])
def test_a_dead_pair_member_does_not_stall_the_round(victim_role):
    ids = [f"n{i}" for i in range(5)]
    (s, r), = pair_schedule(ids, 0, 3, 1)
    victim = int((s if victim_role == "sender" else r)[1:])
    net, nodes = _federation(5, options={"receive_timeout": 20.0, "round_timeout": 40.0})
    end = _run(net, nodes, 5, kill_at={victim: 3})
    survivors = [n for i, n in enumerate(nodes) if i != victim]
    assert all(len(n.history) == 5 for n in survivors)
    assert len(nodes[victim].history) == 2
    partner = s if victim_role == "receiver" else r
    rec = next(n for n in nodes if n.ctx.node_id == partner).history[2]
    if victim_role == "sender":  # the receiver was dropped from the new view or gave up
        assert not rec["fused"]
    assert end <= 40.0 + 1e-6  # at most one round paid a deadline


def test_nodes_that_disagree_about_liveness_never_deadlock():
    net, nodes = _federation(6, options={"receive_timeout": 5.0, "round_timeout": 10.0, "Q": 2})
    blind = nodes[0].ctx
    original = blind.live_peers

    def patched():  # node 0 believes n3 dead although it is alive
        return [p for p in original() if p != "n3"]

    blind.live_peers = patched
    end = _run(net, nodes, 6)
    assert all(len(n.history) == 6 for n in nodes)
    assert end <= 6 * 10.0 + 1e-6
    # at least one of the pairs still happened every round (views agree on most of it)
    fused = sum(r["fused"] for n in nodes for r in n.history if r["role"] == "receiver")
    assert fused >= 6


def test_mismatched_schedule_seeds_are_rejected_and_counted():
    net, nodes = _federation(2, options={"receive_timeout": 1.0, "round_timeout": 2.0})
    nodes[1].algorithm.options = parse_options(get_algorithm("defkt"), {"receive_timeout": 1.0, "round_timeout": 2.0,
                                                                       "schedule_seed": 12345})
    # with 2 nodes both always pair up; with different seeds they may disagree on who sends
    _run(net, nodes, 6)
    dropped = sum(n.ctx.counters()["dropped"].get("schedule_mismatch", 0) for n in nodes)
    assert dropped >= 1


def test_rounds_mode_learns_and_is_deterministic():
    runs = []
    for _ in range(2):
        net, nodes = _federation(4, options={"Q": 2})
        _run(net, nodes, 12)
        runs.append([_params(n) for n in nodes])
        acc = [n.history[-1]["global_accuracy"] for n in nodes]
        assert min(acc) > 0.8
    assert all(_same(a, b) for a, b in zip(*runs))


# -- gossip mode ------------------------------------------------------------------------------


def test_gossip_learns_without_global_rounds():
    net, nodes = _federation(5, options={"mode": "gossip"})
    initial = evaluate(nodes[0].algorithm.new_model(), nodes[0].test_x, nodes[0].test_y)["accuracy"]
    _run(net, nodes, 8)
    assert all(len(n.history) == 8 for n in nodes)
    kinds = collections.Counter()
    for n in nodes:
        kinds.update(n.ctx.bytes_sent_by_kind)
    assert set(kinds) == {"defkt.push", "defkt.reply", "defkt.leave"}  # no model/done of a round
    # nodes are not in lock-step: step k ends at different times on different nodes
    for k in range(8):
        assert len({round(n.history[k]["time"], 6) for n in nodes}) > 1
    assert sum(r["fused"] for n in nodes for r in n.history) >= 5 * 8 * 0.6
    accs = [n.history[-1]["global_accuracy"] for n in nodes]
    assert min(accs) > 0.8 and np.mean(accs) > initial + 0.2


def test_gossip_busy_receivers_decline_and_the_sender_tries_another():
    net, nodes = _federation(6, options={"mode": "gossip", "max_queue": 1, "gossip_interval": 0.01})
    _run(net, nodes, 6)
    stats = collections.Counter()
    for n in nodes:
        stats.update(n.algorithm.stats)
    assert stats["declined"] > 0 and stats["push_declined"] == stats["declined"]
    assert stats["push_queued"] > 0
    attempts = [r["attempts"] for n in nodes for r in n.history]
    assert max(attempts) >= 2


def test_gossip_survives_a_peer_dying_mid_transfer():
    """n1 dies right after a model was pushed to it, before it answers; the sender
    notices (presence), pushes to someone else, and nobody stalls."""
    net, nodes = _federation(5, options={"mode": "gossip", "reply_timeout": 30.0})
    victim = nodes[1]
    tasks = {}

    async def dying_inbox():
        msg = await victim.ctx.receive("defkt.push", round=2**31 - 1)
        tasks["victim_got"] = msg.sender
        net.kill(victim.ctx.node_id)
        tasks["victim"].cancel()

    victim.algorithm._serve_inbox = dying_inbox

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        tasks["victim"] = asyncio.ensure_future(victim.run(6))
        others = [asyncio.ensure_future(n.run(6)) for n in nodes if n is not victim]
        results = await asyncio.gather(tasks["victim"], *others, return_exceptions=True)
        crashed = [r for r in results[1:] if isinstance(r, BaseException)]
        assert not crashed, f"a surviving node crashed: {crashed!r}"
        return asyncio.get_running_loop().time()

    end = run_virtual(main())
    sender = next(n for n in nodes if n.ctx.node_id == tasks["victim_got"])
    assert sender.algorithm.stats["push_gone"] >= 1
    for n in nodes:
        if n is not victim:
            assert len(n.history) == 6
            assert all(r["pushed_to"] != victim.ctx.node_id or r["round"] < 2 for r in n.history[1:])
    assert end < 6 * 1.5 + 30.0  # no one waited out a reply timeout
    assert np.mean([n.history[-1]["global_accuracy"] for n in nodes if n is not victim]) > 0.75


def test_gossip_with_simconfig_kill_and_determinism():
    cfg = dict(algorithm="defkt", nodes=5, rounds=4, dataset="digits", partition="shards", zeta=2, seed=1,
               options={"mode": "gossip"}, kill={2: 2}, train=TrainConfig(batch_size=32))
    a, b = simulate(SimConfig(**cfg)), simulate(SimConfig(**cfg))
    assert a["rounds_per_node"] == {"node00": 4, "node01": 4, "node02": 1, "node03": 4, "node04": 4}
    assert a["global_accuracy"]["per_node"] == b["global_accuracy"]["per_node"]


# -- baselines ---------------------------------------------------------------------------------


def test_combo_exchanges_halves_as_algorithm_3():
    net, nodes = _federation(2, algorithm="combo")

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        before = [_params(n) for n in nodes]
        await asyncio.gather(*(n.run(1) for n in nodes))
        return before

    before = run_virtual(main())
    roles = [n.history[0]["role"] for n in nodes]
    s, r = roles.index("sender"), roles.index("receiver")
    assert nodes[s].history[0]["fused"] and nodes[r].history[0]["fused"]
    after_s, after_r = _params(nodes[s]), _params(nodes[r])
    # equal sample counts (32 each): the receiver keeps its first half and averages the second
    np.testing.assert_array_equal(flatten_segment(after_r, 1), flatten_segment(before[r], 1))
    np.testing.assert_allclose(flatten_segment(after_r, 2),
                               (flatten_segment(before[r], 2).astype(np.float64) + flatten_segment(after_s, 2)) / 2,
                               rtol=1e-6, atol=1e-6)
    # the sender's first half is the average of its trained w̃_1 and the receiver's w_1: it moved
    assert not np.allclose(flatten_segment(after_s, 1), flatten_segment(before[s], 1))
    kinds = collections.Counter()
    for n in nodes:
        kinds.update(n.ctx.bytes_sent_by_kind)
    assert set(kinds) == {"combo.seg1", "combo.seg2", "combo.done"}


def test_fullavg_pair_is_eq_9():
    net, nodes = _federation(2, algorithm="fullavg", options={"sender_keeps": "trained"})

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        before = [_params(n) for n in nodes]
        await asyncio.gather(*(n.run(1) for n in nodes))
        return before

    before = run_virtual(main())
    roles = [n.history[0]["role"] for n in nodes]
    s, r = roles.index("sender"), roles.index("receiver")
    sent = _params(nodes[s])  # the sender keeps what it sent
    for k, v in _params(nodes[r]).items():
        np.testing.assert_allclose(v, (before[r][k].astype(np.float64) + sent[k]) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm,options", [
    ("combo", {}), ("fullavg", {}), ("fullavg", {"scope": "all"}), ("fullavg", {"mode": "gossip"}),
    ("defkt", {"Q": 2, "M": 2, "E": 2}),
])
def test_baselines_and_variants_run_in_the_simulator(algorithm, options):
    s = simulate(SimConfig(algorithm=algorithm, nodes=5, rounds=3, dataset="digits", partition="shards", zeta=2,
                           options=options, train=TrainConfig(batch_size=32)))
    assert s["rounds_completed"] == 3 and s["bytes_sent"] > 0


def test_fullavg_all_sends_n_models_per_round_and_defkt_q():
    kw = dict(nodes=4, rounds=2, dataset="digits", partition="iid", train=TrainConfig(batch_size=32))
    per_round_all = simulate(SimConfig(algorithm="fullavg", options={"scope": "all"}, **kw))["bytes_sent"] / 2
    per_round_pair = simulate(SimConfig(algorithm="defkt", **kw))["bytes_sent"] / 2
    assert 3.5 < per_round_all / per_round_pair < 4.5


def test_schedule_uses_the_federation_seed_even_with_independent_initialisation():
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    s = simulate(SimConfig(algorithm="defkt", nodes=4, rounds=3, dataset="digits", partition="iid",
                           init="independent", seed=2, train=TrainConfig(batch_size=64)))
    assert s["rounds_completed"] == 3
    assert all("schedule_mismatch" not in d for d in s["dropped"].values())
