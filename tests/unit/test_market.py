"""The model update market (seed 003 §3.6.3): every synchronization strategy with a fast,
a slow and a dead peer (silent but present, or crashed with its last will), on the
memory transport with virtual time; the market wired into fedavg and dechetero;
partial device participation."""

import asyncio
import types

import numpy as np
import pytest

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.synchronization import STRATEGIES, UpdateMarket, select_participants
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.transport.memory import MemoryNetwork, run_virtual

START, SLOW_AT, DEADLINE = 0.1, 3.0, 10.0


def _ctx(net, nid):
    return RuntimeContext(
        node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"), data=None,
        model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0),
    )


def scenario(strategy, dead="silent", fast_msgs=1, wait_strategy=None, **kw):
    """``me`` collects round-1 updates; ``fast`` sends at 0, ``slow`` at 3 s, ``dead`` never
    (``silent``: still present; ``killed``: crashed, presence withdrawn).  Deadline 10 s.
    ``wait_strategy``: the strategy of this one wait, where not the market's."""
    net = MemoryNetwork()
    ctxs = {nid: _ctx(net, nid) for nid in ("me", "fast", "slow", "dead")}

    async def send(nid, delay, n):
        await asyncio.sleep(delay)
        for j in range(n):
            await ctxs[nid].send("me", Message("model", 1, {"x": np.full(2, j, np.float32)}, meta={"samples": 1}))

    async def main():
        for c in ctxs.values():
            await c.start()
        if dead == "killed":
            net.kill("dead")
        senders = [asyncio.ensure_future(send("fast", 0.0, fast_msgs)), asyncio.ensure_future(send("slow", SLOW_AT, 1))]
        await asyncio.sleep(START)
        market = UpdateMarket(strategy, **kw)
        res = await market.collect(ctxs["me"], "model", 1, deadline=START + DEADLINE, poll=0.5,
                                   strategy=wait_strategy)
        assert market.strategy == strategy  # one wait's strategy never changes the market's
        end = asyncio.get_running_loop().time()
        await asyncio.gather(*senders)
        return res, end

    return run_virtual(main())


def _counts(res):
    return {s: len(m) for s, m in res.taken.items()}


# (strategy, options, fast_msgs) -> expected (end time, taken counts, deadline hit) with a
# silent dead peer, and with a crashed one
CASES = [
    ("one_from_each", {}, 1,
     (START + DEADLINE, {"fast": 1, "slow": 1}, True), (SLOW_AT, {"fast": 1, "slow": 1}, False)),
    ("available", {}, 1,
     (START, {"fast": 1}, False), (START, {"fast": 1}, False)),
    ("min_one_from_each", {}, 2,
     (START + DEADLINE, {"fast": 2, "slow": 1}, True), (SLOW_AT, {"fast": 2, "slow": 1}, False)),
    ("one_from_min_percent", {"percent": 0.6}, 2,  # ⌈0.6·3⌉ = 2 of 3, ⌈0.6·2⌉ = 2 of 2
     (SLOW_AT, {"fast": 1, "slow": 1}, False), (SLOW_AT, {"fast": 1, "slow": 1}, False)),
    ("one_from_min_percent", {"percent": 0.3}, 1,  # ⌈0.9⌉ = 1: the fast one suffices
     (START, {"fast": 1}, False), (START, {"fast": 1}, False)),
    ("min_k", {"k": 3}, 1,  # 3 updates from 3 peers: the dead one blocks until the deadline;
     (START + DEADLINE, {"fast": 1, "slow": 1}, True),  # crashed: k is capped at the 2 live peers
     (SLOW_AT, {"fast": 1, "slow": 1}, False)),
    ("min_k", {"k": 2}, 2,
     (START, {"fast": 2}, False), (START, {"fast": 2}, False)),
    ("one_from_each_t", {"timeout": 5.0}, 1,
     (START + 5.0, {"fast": 1, "slow": 1}, True), (SLOW_AT, {"fast": 1, "slow": 1}, False)),
]


@pytest.mark.parametrize("strategy,opts,fast_msgs,silent,killed", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_strategy_with_slow_and_dead_peer(strategy, opts, fast_msgs, silent, killed):
    for dead, (t_end, counts, hit) in (("silent", silent), ("killed", killed)):
        res, end = scenario(strategy, dead=dead, fast_msgs=fast_msgs, **opts)
        assert end == pytest.approx(t_end), (dead, end)
        assert _counts(res) == counts, dead
        assert res.deadline_hit is hit, dead
        assert end <= START + DEADLINE + 1e-9  # never past the deadline
        if dead == "silent" and strategy != "available":
            assert "dead" in res.missing


@pytest.mark.parametrize("strategy", [None, *STRATEGIES])
def test_update_of_a_neighbour_that_left_since_counts(strategy):
    """``last`` sends its round-1 update and leaves (its last round, offline presence)
    before ``me`` starts collecting: the update still counts, with the market (every
    strategy) and without it; a sender outside the graph is still rejected."""
    from dfl_agent.algorithms.protocols.neighbourhood import collect_round

    net = MemoryNetwork()
    ctxs = {nid: _ctx(net, nid) for nid in ("me", "last", "stay", "outsider")}
    ctxs["me"].graph_neighbours = ["last", "stay"]
    template = {"x": np.zeros(2, np.float32)}

    async def main():
        for c in ctxs.values():
            await c.start()
        for nid in ("last", "stay", "outsider"):
            await ctxs[nid].send("me", Message("model", 1, {"x": np.ones(2, np.float32)}, meta={"samples": 1}))
        await asyncio.sleep(0.05)
        net.kill("last")
        await asyncio.sleep(0.05)
        assert ctxs["me"].neighbours() == ["stay"]
        if strategy is None:
            got, missing = await collect_round(ctxs["me"], "model", 1, 10.0, 0.5, template)
            return set(got), missing
        res = await UpdateMarket(strategy).collect(ctxs["me"], "model", 1, deadline=10.0, poll=0.5)
        return set(res.taken), res.missing

    got, missing = run_virtual(main())
    assert got == {"last", "stay"} and missing == []
    assert ctxs["me"].rejected["not_neighbour"] == 1  # the outsider


@pytest.mark.parametrize("strategy", [None, "min_one_from_each"])
def test_incompatible_peer_first_seen_during_collection_is_excluded(strategy):
    """A peer whose incompatible model (``compatibility``) is first noticed when its
    update arrives mid-collection is excluded then, not passed to aggregation."""
    from dfl_agent.algorithms.protocols.neighbourhood import collect_round

    net = MemoryNetwork()
    ctxs = {nid: _ctx(net, nid) for nid in ("me", "ok", "big")}
    ctxs["me"].compatibility = lambda info: "other architecture" if info.node_id == "big" else None
    template = {"x": np.zeros(2, np.float32)}

    async def collect():
        if strategy is None:
            return set((await collect_round(ctxs["me"], "model", 1, 10.0, 0.5, template))[0])
        return set((await UpdateMarket(strategy).collect(ctxs["me"], "model", 1, deadline=10.0, poll=0.5)).taken)

    async def main():
        await ctxs["me"].start()
        await ctxs["ok"].start()
        task = asyncio.create_task(collect())  # "big" is not known yet when collection starts
        await asyncio.sleep(0.1)
        await ctxs["big"].start()
        await ctxs["big"].send("me", Message("model", 1, {"x": np.ones(5, np.float32)}, meta={"samples": 1}))
        await asyncio.sleep(0.1)
        await ctxs["ok"].send("me", Message("model", 1, {"x": np.ones(2, np.float32)}, meta={"samples": 1}))
        return await task

    assert run_virtual(main()) == {"ok"}
    me = ctxs["me"]
    assert me.excluded == {"big": "other architecture"}
    assert me.rejected["incompatible"] == 0


def test_one_wait_takes_another_strategy_and_the_market_keeps_its_own():
    """The quorum's first round waits for every member (``one_from_each``) in a market whose
    strategy is ``one_from_min_percent``: that wait follows the one it is given."""
    res, end = scenario("one_from_min_percent", percent=0.3)
    assert _counts(res) == {"fast": 1} and end == pytest.approx(START)  # ⌈0.9⌉ = 1: the fast one will do
    res, end = scenario("one_from_min_percent", percent=0.3, wait_strategy="one_from_each")
    assert _counts(res) == {"fast": 1, "slow": 1} and res.deadline_hit  # every member, till the deadline
    assert end == pytest.approx(START + DEADLINE)


def test_every_strategy_is_covered():
    assert {c[0] for c in CASES} == set(STRATEGIES)


def test_staleness_and_future_rounds():
    m = UpdateMarket("min_one_from_each", max_staleness=1)
    for r in (1, 2, 3, 4):
        m.put(Message("model", r, sender="p"))
    m._prune(3)  # round 1 is too old for target round 3 with staleness 1
    taken = m.take(3, ["p"])
    assert [x.round for x in taken["p"]] == [2, 3]  # round 4 stays queued for its round
    assert [x.round for x in m.queues["p"]] == [4] and m.stats["stale"] == 1
    q = UpdateMarket(max_queue=2)
    for r in (1, 1, 1):
        q.put(Message("model", r, sender="p"))
    assert len(q.queues["p"]) == 2 and q.stats["overflow"] == 1


def test_bad_options_name_the_key():
    with pytest.raises(ValueError, match="algorithm.options.sync: must be one of"):
        parse_options(get_algorithm("fedavg"), {"sync": "whenever"})
    with pytest.raises(ValueError, match="sync_percent"):
        parse_options(get_algorithm("cfa"), {"sync": "one_from_min_percent", "sync_percent": 1.5})
    with pytest.raises(ValueError, match="participation"):
        parse_options(get_algorithm("dechw"), {"participation": -1})


def test_select_participants():
    rng = np.random.default_rng(0)
    chosen = select_participants(["a", "b", "c", "d"], 2, rng)
    assert len(chosen) == 2 and set(chosen) <= {"a", "b", "c", "d"}
    assert select_participants(["b", "a"], 0, rng) == ["a", "b"]


# -- wired into the averaging algorithms ------------------------------------------------

SPEC = {"type": "mlp", "input_shape": [4], "hidden": [8], "num_classes": 2}


def _data(seed, n=24):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    return types.SimpleNamespace(train_x=x, train_y=y, val_x=x[:0], val_y=y[:0], num_classes=2)


def _federation(n, algorithm, options, running=None, rounds=2):
    net = MemoryNetwork()
    cls = get_algorithm(algorithm)
    opts = parse_options(cls, options)
    algs = []
    for i in range(n):
        nid = f"n{i}"
        ctx = RuntimeContext(
            node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
            data=_data(i), model_spec=SPEC, train=TrainConfig(batch_size=8, lr=0.1), init_seed=0,
            rng=np.random.default_rng(i),
        )
        algs.append(cls(ctx, opts))
    infos = {a.ctx.node_id: [] for a in algs}
    for a in algs:
        async def hook(t, info, nid=a.ctx.node_id):
            infos[nid].append(info)
        a.ctx.round_hook = hook
    running = list(range(n)) if running is None else running

    async def main():
        for a in algs:
            await a.ctx.start()
            await a.setup()
        await asyncio.gather(*(algs[i].run(rounds) for i in running))
        return asyncio.get_running_loop().time()

    return algs, infos, run_virtual(main())


def test_fedavg_one_from_each_t_waits_the_timeout_not_the_round_deadline():
    algs, infos, end = _federation(3, "fedavg", {"sync": "one_from_each_t", "sync_timeout": 2.0,
                                                 "round_timeout": 30.0}, running=[0, 1])
    assert end == pytest.approx(4.0)  # 2 rounds x 2 s for the silent n2
    assert infos["n0"][-1]["missing"] == ["n2"] and infos["n0"][-1]["neighbours"] == 1
    assert infos["n0"][-1]["sync_deadline_hit"] is True


def test_fedavg_partial_participation_sends_empty_updates():
    algs, infos, end = _federation(4, "fedavg", {"participation": 1}, rounds=2)
    assert end == 0.0  # empty updates count as arrived: nobody waits for the deadline
    for a in algs:
        assert all(i["missing"] == [] for i in infos[a.ctx.node_id])
        assert all(i["updates_taken"] == 3 for i in infos[a.ctx.node_id])
    # each node received 1..3 models in all over the run; on average exactly one per round
    assert sum(i["neighbours"] for v in infos.values() for i in v) == 4 * 2


def test_dechetero_with_min_k():
    algs, infos, end = _federation(3, "dechetero", {"sync": "min_k", "sync_k": 1, "round_timeout": 9.0},
                                   running=[0, 1], rounds=3)
    assert end == 0.0  # one update suffices; the silent n2 is never waited for
    assert all(i["neighbours"] == 1 for i in infos["n0"])
    assert algs[0].status()["sync"] == "min_k"



def test_an_update_from_a_neighbour_that_left_never_makes_the_quorum_harder():
    """Under the quorum a neighbour that left counts only with an update of the round itself:
    the late update of one gone quiet would raise the number needed (one of two live
    neighbours, then two of three) without counting towards it, and the round would wait."""
    import asyncio

    import numpy as np

    from dfl_agent.algorithms.context import Message
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.transport.memory import MemoryNetwork, run_virtual

    net = MemoryNetwork()
    ctxs = {nid: RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f"),
                                peers=PeerTable(nid, "f"), data=None, model_spec={}, train=None, init_seed=0,
                                rng=np.random.default_rng(0)) for nid in ("me", "a", "b", "slow")}
    market = UpdateMarket("one_from_min_percent", percent=0.5, max_staleness=5)
    x = {"x": np.ones(2, np.float32)}
    out = {}

    async def main():
        for c in ctxs.values():
            await c.start()
        await asyncio.sleep(1.0)
        await ctxs["slow"].send("me", Message("model", 7, dict(x), meta={"samples": 1}))
        await ctxs["slow"].stop()  # it left; its late update is queued
        await ctxs["a"].send("me", Message("model", 10, dict(x), meta={"samples": 1}))
        await asyncio.sleep(1.0)
        me = ctxs["me"]
        out["live"] = sorted(me.neighbours())
        t0 = me.clock.now()
        res = await market.collect(me, "model", 10, deadline=t0 + 20.0, poll=0.5, fresh_quorum=True)
        out["closed_after"] = me.clock.now() - t0
        out["taken"] = sorted(res.taken)

    run_virtual(main())
    assert out["live"] == ["a", "b"]
    assert out["closed_after"] < 1.0 and "a" in out["taken"], out


@pytest.mark.parametrize("finished, away", [(("a", "b"), False), (("a",), False), (("a", "b"), True)])
def test_a_node_whose_neighbours_finished_while_it_started_takes_their_final_updates(finished, away):
    """A node connects late (a lossy link): its neighbours sent their round-1 updates before
    it subscribed, raced through rounds 2 to 4 under the quorum and finished the run.  In
    its round 1 only their later updates are queued, and none of them is live.  It takes
    the newest update each one queued (round 4) at once, as it would have taken their
    round-1 updates, instead of closing its round alone; a neighbour that sent nothing
    (``("a",)``: ``b``) stays out.  Where the members are away but have not finished the
    run (``away``: a partition; ``ctx.alone_waits``), the round waits its deadline and takes
    nothing: one neighbour's updates of far later rounds never make a node race ahead alone."""
    net = MemoryNetwork()
    ctxs = {nid: _ctx(net, nid) for nid in ("a", "b")}
    ctxs["me"] = RuntimeContext(node_id="me", federation="f", transport=net.transport("me", "f"),
                                peers=PeerTable("me", "f"), data=None, model_spec={}, train=None, init_seed=0,
                                rng=np.random.default_rng(0), alone_waits=lambda: away)
    market = UpdateMarket("one_from_min_percent", percent=0.5, max_staleness=5)
    out = {}

    async def main():
        for c in ctxs.values():
            await c.start()
        await asyncio.sleep(0.5)
        for nid in finished:
            for r in (2, 3, 4):
                await ctxs[nid].send("me", Message("model", r, {"x": np.full(2, r, np.float32)}, meta={"samples": 1}))
        for nid in ("a", "b"):
            net.kill(nid)  # finished: presence withdrawn
        await asyncio.sleep(0.5)
        me = ctxs["me"]
        out["live"] = me.neighbours()
        t0 = me.clock.now()
        res = await market.collect(me, "model", 1, deadline=t0 + 30.0, poll=0.5, strategy="one_from_each",
                                   fresh_quorum=True)
        out["closed_after"] = me.clock.now() - t0
        out["taken"] = {p: [m.round for m in ms] for p, ms in res.taken.items()}
        out["deadline_hit"] = res.deadline_hit

    run_virtual(main())
    assert out["live"] == [], out
    if away:
        assert out["closed_after"] >= 30.0 and out["taken"] == {} and out["deadline_hit"], out
        return
    assert out["closed_after"] < 1.0, out
    assert out["taken"] == {p: [4] for p in finished} and not out["deadline_hit"], out
    assert market.stats["behind"] == 1
