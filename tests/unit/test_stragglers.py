"""Never wait for the slowest (``runtime.straggler``): the adaptive deadline rule, the
quorum, the staleness weight of late updates, and the simulator's per-node speeds.

The simulations run real nodes over the memory transport on a virtual clock: a node of
speed 0.05 takes 20 virtual seconds per training call, the others 1.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.fedavg import FedAvg
from dfl_agent.algorithms.protocols.stragglers import (
    QUORUM_PERCENT,
    QUORUM_STALENESS,
    AdaptiveDeadline,
    StragglerPolicy,
    quorum_options,
    staleness_weight,
    weigh_late,
)
from dfl_agent.runtime.node.simulator import SimConfig, simulate
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict


# -- the rules ----------------------------------------------------------------------------
def test_deadline_is_p90_of_the_last_ten_times_1_5_clamped() -> None:
    d = AdaptiveDeadline(2.0, 120.0)
    assert d.timeout(30.0) == 30.0  # nothing known yet: the upper bound
    assert d.timeout() == 120.0
    d.observe([1.0] * 9 + [4.0])  # p90 of ten = the 9th smallest = 1.0
    assert d.timeout(30.0) == pytest.approx(2.0)  # 1.5 clamped up to the minimum
    d.observe([10.0, 10.0])  # the window keeps the last ten: 1 x 7, 4, 10, 10
    assert d.timeout(30.0) == pytest.approx(15.0)
    d.observe([40.0] * 10)
    assert d.timeout(30.0) == 30.0  # clamped to the algorithm's round_timeout
    assert d.timeout(1.0) == 1.0  # an upper bound below the minimum wins


def test_staleness_weight_is_fedasync_polynomial() -> None:
    assert staleness_weight(0) == 1.0
    assert staleness_weight(1) == pytest.approx(2 ** -0.5)
    assert staleness_weight(3) == pytest.approx(0.5)
    assert staleness_weight(3, a=1.0) == pytest.approx(0.25)
    got = {"a": Message("model", 5, meta={"samples": 100}), "b": Message("model", 2, meta={"samples": 100})}
    weighted = weigh_late(got, 5)
    assert weighted["a"] is got["a"]
    assert weighted["b"].meta["samples"] == pytest.approx(50.0)
    assert weighted["b"].meta["staleness_weight"] == pytest.approx(0.5)
    assert got["b"].meta["samples"] == 100  # the received message is not changed


def test_quorum_options_and_explicit_options_win() -> None:
    paper = FedAvg.Options()
    assert paper.sync == "one_from_each" and paper.max_staleness == 0  # the paper's defaults stay
    q = quorum_options(paper, StragglerPolicy("quorum"))
    assert (q.sync, q.sync_percent, q.max_staleness) == ("one_from_min_percent", QUORUM_PERCENT, QUORUM_STALENESS)
    assert quorum_options(paper, StragglerPolicy("paper")) == paper
    mine = quorum_options(FedAvg.Options(sync="min_k", sync_k=2), StragglerPolicy("quorum"), {"sync": "min_k"})
    assert mine.sync == "min_k" and mine.max_staleness == QUORUM_STALENESS
    other = object()  # a family without SyncOptions is left alone
    assert quorum_options(other, StragglerPolicy("quorum")) is other


def test_config_keys() -> None:
    cfg = config_from_dict({"federation": "f"})
    # quorum by default for the always-on agent; the simulator keeps the papers' lock step
    assert (cfg.runtime.straggler, cfg.runtime.min_round_timeout, cfg.runtime.max_round_timeout) == ("quorum", 2.0, 120.0)
    with pytest.raises(ConfigError, match="runtime.straggler"):
        config_from_dict({"federation": "f", "runtime": {"straggler": "fast"}})
    with pytest.raises(ConfigError, match="runtime.min_round_timeout"):
        config_from_dict({"federation": "f", "runtime": {"min_round_timeout": 50.0, "max_round_timeout": 10.0}})
    from dfl_agent.runtime.shared.assembly import resolve_algorithm

    _, opts = resolve_algorithm(config_from_dict(
        {"federation": "f", "algorithm": {"name": "fedavg"}, "runtime": {"straggler": "quorum"}}))
    assert opts.sync == "one_from_min_percent"
    _, opts = resolve_algorithm(config_from_dict({"federation": "f", "algorithm": {"name": "fedavg"}}))
    assert opts.sync == "one_from_min_percent"  # the default: quorum
    _, opts = resolve_algorithm(config_from_dict(
        {"federation": "f", "algorithm": {"name": "fedavg"}, "runtime": {"straggler": "paper"}}))
    assert opts.sync == "one_from_each"  # the papers' lock step


# -- the simulator: a slow node ---------------------------------------------------------
def _rounds(tmp_path, name: str, **kw) -> list[dict]:
    cfg = SimConfig(algorithm="fedavg", nodes=4, dataset="digits", partition="iid", out=str(tmp_path / name),
                    eval_every=100, **kw)
    simulate(cfg)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "round" in r and "time" in r]


def _fast(records: list[dict]) -> list[dict]:
    return [r for r in records if r["node"] != "node03"]


def test_quorum_fast_nodes_do_not_wait_for_the_slow_one(tmp_path) -> None:
    speeds = [1.0, 1.0, 1.0, 0.05]  # node03 trains 20 virtual seconds a round, the others 1
    paper = _fast(_rounds(tmp_path, "paper", rounds=4, speeds=speeds))
    quorum = _fast(_rounds(tmp_path, "quorum", rounds=4, speeds=speeds, straggler="quorum"))

    def took(records: list[dict], first: int, last: int) -> float:  # virtual seconds from round first to last
        at = {r["round"]: r["time"] for r in records if r["node"] == "node00"}
        return at[last] - at[first]

    # the papers' lock step: every round waits for node03 (20 s of training each)
    assert took(paper, 1, 4) == pytest.approx(60.0)
    assert all(r["participants_used"] == 3 and r["participants_expected"] == 3 for r in paper)
    assert all(r["deadline_s"] == 30.0 for r in paper)
    # quorum: the first round waits for every member (the run's start), then two of three
    # neighbours suffice and a round takes the node's own training time
    assert took(quorum, 1, 4) == pytest.approx(3.0)
    assert all(r["participants_used"] == 2 and r["participants_expected"] == 3 for r in quorum if r["round"] > 1)
    # adaptive: node03's 19 s in round 1 is the 90th percentile of the times known since: 19 x 1.5
    assert {r["deadline_s"] for r in quorum if r["round"] > 1} == {28.5}


def test_adaptive_deadline_closes_a_lock_step_round(tmp_path) -> None:
    """An explicit ``sync = one_from_each`` wins over the quorum; the adaptive deadline
    still stops waiting for a peer that is present but never sends (speed 0.001: 1000 s
    a round) once the others' completion times are known."""
    recs = _fast(_rounds(tmp_path, "deadline", rounds=3, speeds=[1.0, 1.0, 1.0, 0.001], straggler="quorum",
                         options={"sync": "one_from_each"}))
    by_round = {r["round"]: r for r in recs}
    assert by_round[1]["deadline_s"] == 30.0 and by_round[1]["time"] == pytest.approx(31.0)  # nothing known yet
    assert by_round[2]["deadline_s"] == by_round[3]["deadline_s"] == 2.0  # p90 of ~0 s x 1.5, the minimum
    assert by_round[3]["time"] - by_round[2]["time"] == pytest.approx(3.0)  # 1 s of training + the 2 s deadline
    assert all(r["participants_used"] == 2 and r["sync_deadline_hit"] for r in recs)


def test_late_updates_are_used_with_their_staleness_weight(tmp_path) -> None:
    recs = _fast(_rounds(tmp_path, "late", rounds=5, speeds=[1.0, 1.0, 1.0, 0.25], straggler="quorum"))
    late = [r for r in recs if r["late_used"]]
    assert late, "the slow node's updates were never used"
    for r in late:
        assert "node03" in r["neighbour_ids"] and [s for s, _ in r["late_weights"]] == ["node03"]
    # node03's round-1 update (it trains 4 s) is taken in round 4: tau = 3
    weights = [w for r in late for _, w in r["late_weights"]]
    assert min(weights) == pytest.approx(staleness_weight(3), abs=1e-4)
    assert max(weights) < 1.0


def test_quorum_market_counts_current_updates_and_takes_the_newest() -> None:
    import numpy as np

    from dfl_agent.algorithms.protocols.synchronization import UpdateMarket

    m = UpdateMarket("one_from_min_percent", percent=0.5, max_staleness=8)  # the quorum: asked wait by wait
    dropped: list[Message] = []
    m.on_drop = dropped.append
    w = {"w": np.ones(3, np.float32)}
    old, new, again = (Message("model", r, dict(w), meta={"samples": 1}, sender="a") for r in (3, 5, 5))
    for msg in (old, new, again):  # again: a re-sent copy of round 5, after an outage
        m.put(msg)
    m.put(Message("model", 4, dict(w), meta={"samples": 1}, sender="b"))
    assert m.ready(6, ["a", "b"])  # the papers' wait: late updates count
    assert not m.ready(6, ["a", "b"], fresh_quorum=True)  # late updates alone never make the quorum
    assert m.ready(5, ["a", "b"], fresh_quorum=True)  # one of two senders with a round-5 update: ceil(0.5 * 2) = 1
    taken = m.take(5, ["a", "b"], fresh_quorum=True)
    assert taken["a"] == [new] and taken["a"][0] is new and [d.round for d in dropped] == [3, 5]
    assert dropped[1] is again and "a" not in m.queues and m.stats["superseded"] == 2


# -- compressed gossip through a straggler's gaps ---------------------------------------------
def _stream(tmp_seed: int = 0):
    import types

    import numpy as np

    from dfl_agent.algorithms.gossip_compression import choco_for
    from dfl_agent.learning.compression import CompressionPolicy

    ctx = types.SimpleNamespace(compression=CompressionPolicy.from_config("q4+zstd", {}), init_seed=tmp_seed,
                                track_stream=lambda stream: None)
    x = {"w": np.linspace(-1, 1, 64, dtype=np.float32)}
    return choco_for(ctx, "model"), x


def test_a_gap_in_a_neighbours_stream_makes_the_next_message_a_keyframe() -> None:
    sender, x = _stream(1)
    me, _ = _stream(2)
    msgs = [sender.outgoing({"w": x["w"] * (i + 1)}) for i in range(4)]  # seq 0 (keyframe) .. 3
    assert me.outgoing(x)[2]["choco"] == [0, 1]
    assert me.incoming("a", {"w": x["w"]}, msgs[0][2]) is not None  # the keyframe
    assert me.outgoing(x)[2]["choco"] == [1, 0]
    assert me.incoming("a", {"w": x["w"]}, msgs[2][2]) is None  # seq 2 after 0: a gap
    assert me.outgoing(x)[2]["choco"] == [2, 1]  # "a" probably missed ours too: a keyframe


def test_a_resent_copy_keeps_the_neighbours_copy() -> None:
    sender, x = _stream(1)
    me, _ = _stream(2)
    metas = [sender.outgoing({"w": x["w"] * (i + 1)})[2] for i in range(3)]
    w = {"w": x["w"]}
    assert me.incoming("a", w, metas[0]) is not None and me.incoming("a", w, metas[1]) is not None
    copy = me.incoming("a", w, metas[1])
    assert copy is not None and np.array_equal(copy["w"], me.copies["a"]["w"])
    again = me.incoming("a", w, metas[1])  # re-sent after an outage: the copy as it is, not applied twice
    assert again is not None and np.array_equal(again["w"], copy["w"])
    assert np.array_equal(me.copies["a"]["w"], copy["w"]) and me.next_seq["a"] == 2
    assert me.incoming("a", w, metas[2]) is not None  # the stream goes on


def _defkt(tmp_path, name: str, straggler: str) -> list[dict]:
    cfg = SimConfig(algorithm="defkt", nodes=6, dataset="digits", partition="iid", out=str(tmp_path / name),
                    eval_every=100, rounds=12, straggler=straggler, speeds=[1, 1, 1, 1, 1, 0.01],
                    options={"Q": 3, "receive_timeout": 5.0, "round_timeout": 10.0})
    simulate(cfg)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "round" in r and "role" in r]


def test_defkt_re_pairs_away_from_a_silent_sender_under_quorum(tmp_path) -> None:
    """Def-KT under ``quorum``: a sender whose model does not come within ``receive_timeout``
    (node05 trains 100 virtual seconds a round) is named in its receiver's ``done``; every
    node, itself included, leaves it out of the next SILENT_ROUNDS rounds' pairs, so no
    receiver waits for it again meanwhile.  With ``paper`` it keeps being paired."""
    from dfl_agent.algorithms.protocols.pairs import SILENT_ROUNDS

    def paired_after_silence(records):
        silent = sorted(r["round"] for r in records if r.get("role") == "receiver" and r.get("partner") == "node05"
                        and not r.get("fused"))
        if not silent:
            return None, []
        first = silent[0]
        again = [r["round"] for r in records if r.get("partner") == "node05" or
                 (r["node"] == "node05" and r.get("role") != "idle")]
        return first, [t for t in again if first < t <= first + SILENT_ROUNDS]

    first, again = paired_after_silence(_defkt(tmp_path, "quorum", "quorum"))
    assert first is not None and again == [], (first, again)
    first_p, again_p = paired_after_silence(_defkt(tmp_path, "paper", "paper"))
    assert first_p is not None and again_p, (first_p, again_p)


@pytest.mark.parametrize("fresh_quorum,take_ahead,ahead,expect_end,expect_taken", [
    (True, True, {"a": [40, 41], "b": [44]}, 0.1, {"a": 41, "b": 44}),  # behind: close at once, newest of each
    (False, True, {"a": [40, 41], "b": [44]}, 10.1, {}),  # the paper's lock step waits for round 5
    (True, True, {"a": [1000]}, 10.1, {}),  # one insider's claim is not a quorum of three
    (True, False, {"a": [40, 41], "b": [44]}, 10.1, {}),  # before its adaptive deadline: waits
])
def test_a_node_behind_the_quorum_takes_their_newest_updates_at_once(fresh_quorum, take_ahead, ahead, expect_end,
                                                                      expect_taken):
    """A node back from a partition is in round 5 while its neighbours are at round 40 and
    on: under the quorum it stops waiting for round-5 updates that will never come."""
    import asyncio

    import numpy as np

    from dfl_agent.algorithms.protocols.synchronization import UpdateMarket
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.transport.memory import MemoryNetwork, run_virtual

    net = MemoryNetwork()
    ctxs = {nid: RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
                                data=None, model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0))
            for nid in ("me", "a", "b", "c")}

    async def main():
        for c in ctxs.values():
            await c.start()
        for nid, rounds in ahead.items():
            for r in rounds:
                await ctxs[nid].send("me", Message("model", r, {"x": np.full(2, r, np.float32)}, meta={"samples": 1}))
        await asyncio.sleep(0.1)
        market = UpdateMarket("one_from_min_percent", percent=0.5, max_staleness=64)
        res = await market.collect(ctxs["me"], "model", 5, deadline=10.1, poll=0.5, take_ahead=take_ahead,
                                   fresh_quorum=fresh_quorum)
        return res, asyncio.get_running_loop().time(), market

    res, end, market = run_virtual(main())
    assert end == pytest.approx(expect_end, abs=0.05)
    assert {s: m[-1].round for s, m in res.taken.items()} == expect_taken
    assert market.stats["behind"] == int(bool(expect_taken)) and res.deadline_hit == (not expect_taken)


def test_the_reproduction_tools_keep_the_papers_lock_step(tmp_path) -> None:
    """The always-on agent defaults to quorum; the demo, its --feed variant and the chaos tool
    run the papers' lock step unless told otherwise, so that their committed figures reproduce."""
    from dfl_agent.cli import chaos, demo, dflctl

    assert config_from_dict({"federation": "f"}).runtime.straggler == "quorum"
    assert demo._config(demo.DemoOptions(), "f", "n0", 0, "127.0.0.1:1883", tmp_path).runtime.straggler == "paper"
    quorum = demo.DemoOptions(straggler="quorum")
    assert demo._config(quorum, "f", "n0", 0, "127.0.0.1:1883", tmp_path).runtime.straggler == "quorum"
    assert chaos._config(chaos.ChaosOptions(), "f", "n0", 0, "127.0.0.1:1883", tmp_path, "k")["runtime"][
        "straggler"] == "paper"
    from types import SimpleNamespace

    from dfl_agent.cli import demo_feed

    pool = SimpleNamespace(input_shape=(9, 128), num_classes=6, class_names=[str(i) for i in range(6)])
    feed = demo_feed._config(demo_feed.FeedOptions(), "f", "n0", tmp_path, "127.0.0.1:1883", pool, "k")
    assert feed.runtime.straggler == "paper"
    args = dflctl.build_parser().parse_args(["demo", "--straggler", "quorum"])
    assert args.straggler == "quorum"


@pytest.mark.parametrize("compression", [None, "q4+zstd"])
def test_one_lost_update_does_not_cost_a_deadline_in_every_later_round(compression) -> None:
    """Under the quorum, FedAvg's peer (lock step: it sends round t, then waits for this node's
    round t) loses its round-3 update on the way.  This node waits its adaptive deadline in
    round 3, then takes the peer's round-4 update ahead; that update stays queued for round 4,
    so that round 4 and every later one close as soon as the peer's update is there.  Before,
    the update taken ahead was gone from round 4, and every later round waited its whole
    deadline for an update the peer had already sent (the broker-outage test on a loaded
    machine: 2 s a round, and the last round closed alone).  With CHOCO compression the
    update used again is the neighbour's copy, applied once."""

    from dfl_agent.algorithms import gossip_compression as gc
    from dfl_agent.algorithms.base import get_algorithm
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.learning.compression import CompressionPolicy
    from dfl_agent.learning.params import model_to_numpy
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.node.node import Node
    from dfl_agent.transport.memory import MemoryNetwork
    from tests.unit.test_outage_pause import _run_with_peers, _trainer

    net = MemoryNetwork()
    bundle, me = _trainer(net)
    me.straggler = StragglerPolicy("quorum")
    peer = RuntimeContext(node_id="peer", federation="f", transport=net.transport("peer", "f"),
                          peers=PeerTable("peer", "f"), data=None, model_spec={}, train=None, init_seed=0,
                          rng=np.random.default_rng(0))
    if compression:
        me.compression = peer.compression = CompressionPolicy.from_config(compression)
    stream = gc.choco_for(peer, "model")
    records: list[dict] = []
    fedavg = get_algorithm("fedavg")
    options = quorum_options(fedavg.Options(round_timeout=10.0), me.straggler)
    node = Node(me, fedavg(me, options), bundle.test.x[:50], bundle.test.y[:50], sink=records.append)
    rounds = 8

    async def lock_step_peer(model) -> None:
        for t in range(1, rounds + 1):
            msg = gc.model_message(stream, "model", t, model_to_numpy(model), {"samples": 10})
            if t != 3:  # round 3's update is lost on the way (its CHOCO difference too: a gap)
                await peer.send("me", msg)
            elif stream is not None:
                stream.own = None  # the gap asks for a keyframe: the next message is one
            assert await peer.receive("model", round=t, deadline=peer.clock.now() + 60.0) is not None

    _run_with_peers(me, [peer], node, lock_step_peer, rounds)
    assert [r["neighbours"] for r in records] == [1] * rounds, [(r["round"], r["neighbours"], r["round_seconds"], r.get("behind"), r.get("missing")) for r in records]
    assert records[2]["round_seconds"] >= 2.0  # round 3 waited its adaptive deadline
    slow = [(r["round"], round(r["round_seconds"], 1)) for r in records[3:] if r["round_seconds"] >= 1.0]
    assert slow == [], slow


@pytest.mark.parametrize("compression", [None, "q4+zstd"])
def test_a_late_node_whose_neighbours_finished_ends_with_their_models_not_alone(compression) -> None:
    """The field lab at 10 % loss: this node's connection came up late, and it missed its two
    neighbours' round-1 updates; they closed rounds 2 to 4 under the quorum and finished the
    run (presence withdrawn, statuses ``finished``: the agent's ``alone_waits`` says no wait).
    Its round 1 takes their newest (round-4) updates at once and averages with them, and the
    node ends after it, as most members finished the run.  Before, its round 1 closed alone
    and its ``--once`` run exited 4 (degraded)."""
    from dfl_agent.algorithms import gossip_compression as gc
    from dfl_agent.algorithms.base import get_algorithm
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.learning.compression import CompressionPolicy
    from dfl_agent.learning.params import model_to_numpy
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.node.node import Node
    from dfl_agent.transport.memory import MemoryNetwork
    from tests.unit.test_outage_pause import _run_with_peers, _trainer

    net = MemoryNetwork()
    # with compression: CHOCO copies with error feedback, as in production
    policy = CompressionPolicy.from_config(compression) if compression else None
    bundle, me = _trainer(net, straggler=StragglerPolicy("quorum"), compression=policy,
                          alone_waits=lambda: False)  # the run's members finished it
    peers = [RuntimeContext(node_id=n, federation="f", transport=net.transport(n, "f"), peers=PeerTable(n, "f"),
                            data=None, model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0),
                            compression=policy)
             for n in ("a", "b")]
    streams = {p.node_id: gc.choco_for(p, "model") for p in peers}
    records: list[dict] = []
    fedavg = get_algorithm("fedavg")
    node = Node(me, fedavg(me, quorum_options(fedavg.Options(round_timeout=10.0), me.straggler)),
                bundle.test.x[:50], bundle.test.y[:50], sink=records.append)
    node.hooks.needs_peers = lambda: True
    node.hooks.finish_check = lambda: True

    async def finished(model) -> None:
        for p in peers:
            for t in (2, 3, 4):
                await p.send("me", gc.model_message(streams[p.node_id], "model", t, model_to_numpy(model),
                                                     {"samples": 10}))
        await asyncio.sleep(0.05)  # delivered (a kill drops what is still on the way)
        for p in peers:
            net.kill(p.node_id)

    _run_with_peers(me, peers, node, finished, 4)
    assert [(r["round"], r["alone"], r["neighbour_ids"]) for r in records] == [(1, False, ["a", "b"])], records
    assert records[0]["round_seconds"] < 1.0


def test_an_update_taken_ahead_is_decoded_once_and_used_again_in_its_own_round() -> None:
    """A node behind its neighbours takes a round-7 update while in round 5 (the market keeps it
    queued for round 7).  Decoding a CHOCO difference twice is out of sequence: without the
    decoded copy kept, round 7 dropped the update it had already received and waited its whole
    deadline (a rolling upgrade in the field lab closed that round alone)."""
    from types import SimpleNamespace

    import numpy as np

    from dfl_agent.algorithms.protocols.synchronization import UpdateMarket
    from dfl_agent.runtime.node.waiting import RoundWaiting

    applied: list[int] = []

    def decode(raw):  # a CHOCO stream: each difference applies once, a repeat is out of sequence
        out = {}
        for s, m in raw.items():
            if m.meta["seq"] in applied:
                continue
            applied.append(m.meta["seq"])
            out[s] = Message(m.kind, m.round, {"x": m.tensors["x"] + 100}, sender=s, meta=dict(m.meta))
        return out

    market = UpdateMarket("one_from_min_percent", percent=0.5, max_staleness=64)
    waiting = RoundWaiting(SimpleNamespace(straggler=None), market, round_timeout=20.0, poll=0.5)
    ahead = Message("model", 7, {"x": np.full(2, 7.0, np.float32)}, sender="a", meta={"seq": 1})
    market.put(ahead)
    got5 = waiting._decoded({"a": ahead}, decode, 5)  # taken ahead in round 5
    assert got5["a"].tensors["x"].tolist() == [107.0, 107.0]
    got5["a"].tensors["x"][:] = 0  # what the algorithm does with it in round 5 does not reach round 7
    got7 = waiting._decoded({"a": ahead}, decode, 7)  # the same update, taken again in its own round
    assert applied == [1] and got7["a"].tensors["x"].tolist() == [107.0, 107.0]
    assert market.queues.get("a") == [ahead]  # not discarded as undecodable
    assert waiting.ahead == {}  # used: forgotten
