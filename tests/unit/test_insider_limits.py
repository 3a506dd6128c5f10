"""What one insider (an enrolled device, with its own valid key) cannot decide alone:

* skipping rounds: a node skips ahead only on evidence from more than half of its live
  verified neighbours, from at least two distinct senders when two or more are live,
  and by at most ``runtime.max_catch_up_rounds`` rounds per event (in the run, and at a
  restart from the neighbours' statuses);
* "the run is finished": only a majority of the run's members (at least two devices)
  or the operator-signed run descriptor (a cancel) says so, never one device's status.
"""

import asyncio
import json
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.neighbourhood import arrival_check
from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.run.agent import Agent
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64
from dfl_agent.transport.memory import MemoryNetwork, run_virtual
from tests.host import LobbyHost

GOOD = {"x": np.ones(2, np.float32)}


def _ctx(net, nid):
    return RuntimeContext(
        node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"), data=None,
        model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0),
    )


def _signed_skip(sends, neighbours=("a", "b"), cap=None, straggler="paper", final_round=None, at=(16,)):
    """``me`` and its member neighbours, every node signing, ``me`` requiring signatures;
    ``sends`` = [(sender, round)] model updates that fit (signed by the sender's own key)
    delivered to ``me``, which runs under ``runtime.straggler = straggler``.  Returns
    (catch_up_round(16), me); with several rounds in ``at``, the list of
    ``catch_up_round(r)`` for each of them, in order."""
    net = MemoryNetwork()
    keys = {n: Ed25519PrivateKey.generate() for n in ("me", *neighbours)}
    pinned = {n: public_key_b64(k) for n, k in keys.items()}
    ctxs = {}
    for nid, key in keys.items():
        ctx = _ctx(net, nid)
        ctx.security = SecurityGuard(nid, key, TrustStore("f", pinned), require_signatures=nid == "me")
        ctxs[nid] = ctx
    me = ctxs["me"]
    me.catch_up, me.final_round = True, final_round
    me.straggler = StragglerPolicy(mode=straggler)
    if cap is not None:
        me.max_catch_up_rounds = cap
    me.check_on_arrival("model", arrival_check(GOOD))

    async def main():
        for c in ctxs.values():
            await c.start()
        for sender, rnd in sends:
            await ctxs[sender].send("me", Message("model", rnd, dict(GOOD), meta={"samples": 1}))
        await asyncio.sleep(0.05)
        assert sorted(me.neighbours()) == sorted(neighbours)  # all live and verified
        got = [me.catch_up_round(r) for r in at]
        return got if len(at) > 1 else got[0]

    return run_virtual(main()), me


def test_one_signed_sender_far_ahead_with_two_live_neighbours_does_not_skip():
    """The issue's attack: one member's signed, well-formed frame of round + 1000 (its own
    key), with two live neighbours.  On 0c2393f the node skipped rounds 16-1015."""
    nxt, me = _signed_skip([("a", 16 + 1000), ("b", 15)])
    assert nxt == 16 and me.caught_up == 0
    nxt, me = _signed_skip([("a", 16 + 1000)])  # the other neighbour showed nothing at all
    assert nxt == 16 and me.caught_up == 0


def test_majority_of_distinct_senders_skips_capped_at_max_catch_up_rounds():
    # two of two live neighbours ahead: a skip, by the default cap of 10 rounds at most
    nxt, me = _signed_skip([("a", 90), ("b", 40)])
    assert nxt == 26 and me.caught_up == 10
    # within the cap: one past the round that a majority completed (b's round-40 update
    # shows it completed round 39), the farther sender counts for no more
    nxt, me = _signed_skip([("a", 90), ("b", 20)])
    assert nxt == 20 and me.caught_up == 4
    # two of three: a majority; one of three: none
    nxt, _ = _signed_skip([("a", 1016), ("b", 1016), ("c", 15)], neighbours=("a", "b", "c"), cap=3)
    assert nxt == 19
    nxt, _ = _signed_skip([("a", 1016), ("b", 15), ("c", 15)], neighbours=("a", "b", "c"))
    assert nxt == 16
    # the cap is configurable; 0 never skips
    assert _signed_skip([("a", 90), ("b", 90)], cap=0)[0] == 16


def test_two_insiders_far_ahead_under_quorum_move_a_node_at_most_the_cap_per_catch_up():
    """Two live neighbours' signed, well-formed frames of round + 1000 under the agent's
    default ``runtime.straggler = "quorum"`` (a majority of two: evidence enough to skip),
    in a run of 120 rounds: each catch-up moves the node by at most
    ``runtime.max_catch_up_rounds`` (10), as under ``paper``; it never jumps to their round
    (on 75535c2 quorum mode lifted the cap: rounds 43-119 skipped at once)."""
    for mode in ("quorum", "paper"):
        nxt, me = _signed_skip([("a", 43 + 1000), ("b", 43 + 1000)], straggler=mode, final_round=120, at=(43,))
        assert me.straggler.quorum == (mode == "quorum")
        assert nxt == 53 and me.caught_up == 10, (mode, nxt)
    # every later catch-up is capped too (one per round the node closes), up to the last round
    starts = (43, 54, 65, 109, 120)
    got, me = _signed_skip([("a", 1043), ("b", 1043)], straggler="quorum", final_round=120, at=starts)
    assert got == [53, 64, 75, 119, 120]
    assert all(t - s <= 10 for s, t in zip(starts, got, strict=True)) and me.caught_up == 10 + 10 + 10 + 10


def test_skip_never_passes_the_runs_last_round():
    net = MemoryNetwork()
    ctxs = {n: _ctx(net, n) for n in ("me", "a")}
    me = ctxs["me"]
    me.catch_up, me.final_round = True, 20
    me.check_on_arrival("model", arrival_check(GOOD))

    async def main():
        for c in ctxs.values():
            await c.start()
        await ctxs["a"].send("me", Message("model", 10**6, dict(GOOD), meta={"samples": 1}))
        await asyncio.sleep(0.05)
        return me.catch_up_round(16)

    assert run_virtual(main()) == 20  # the node runs round 20 itself


def test_quorum_and_target_rules():
    from dfl_agent.algorithms.protocols.synchronization import evidence_quorum
    from dfl_agent.runtime.node.membership import catch_up_target

    assert [evidence_quorum(n) for n in range(6)] == [0, 1, 2, 2, 3, 3]
    assert catch_up_target(5, {"a": 100}, live=1, cap=10) == 15  # one live neighbour: it is the majority
    assert catch_up_target(5, {"a": 100}, live=2, cap=10) == 5
    assert catch_up_target(5, {"a": 100, "b": 7}, live=2, cap=10) == 8
    assert catch_up_target(5, {}, live=0, cap=10) == 5


def test_max_catch_up_rounds_config():
    assert config_from_dict({}).runtime.max_catch_up_rounds == 10
    assert config_from_dict({"runtime": {"max_catch_up_rounds": 3}}).runtime.max_catch_up_rounds == 3
    with pytest.raises(ConfigError, match="runtime.max_catch_up_rounds"):
        config_from_dict({"runtime": {"max_catch_up_rounds": -1}})


# -- "finished" at a (re)start --------------------------------------------------------
ROUNDS = 60


def _starting_agent(tmp_path, statuses, live=("a", "b"), members=None, resumed=False, start_round=1,
                    checks=None):
    """An :class:`Agent` of a run of ``ROUNDS`` rounds about to start its rounds: live
    peers ``live`` (memory transport), peers' verified statuses ``statuses`` (what the
    MQTT transport keeps: node -> status dict), admitted ``members``.  ``checks(agent)``
    runs with the peers live; its result is returned."""
    cfg = config_from_dict({"federation": "f", "node_id": "me", "state_dir": str(tmp_path),
                            "algorithm": {"name": "fedavg", "rounds": ROUNDS}})
    agent = Agent(cfg, host=LobbyHost(members=members or (), publish=False))
    net = MemoryNetwork()
    ctxs = {n: _ctx(net, n) for n in ("me", *live)}
    agent.node_id, agent.ctx = "me", ctxs["me"]
    ctxs["me"].transport.statuses = statuses

    async def main():
        for c in ctxs.values():
            await c.start()
        if resumed:
            agent.members |= agent._load_members(resumed=True)
        return checks(agent)

    return run_virtual(main())


def _st(state, rnd):
    return {"state": state, "round": rnd, "time": time.time(), "heartbeat": 1}


def test_one_devices_signed_finished_status_does_not_end_a_restarting_nodes_run(tmp_path):
    """The issue's attack: one enrolled device's (verified) status ``finished`` at round
    999999, retained.  On 0c2393f a restarting node rejoined at round 1000000 and exited
    after 0 rounds."""
    statuses = {"a": _st("finished", 999999), "b": _st("running", 3)}
    assert _starting_agent(tmp_path, statuses, checks=lambda ag: ag._rejoin_round()) <= ROUNDS
    assert not _starting_agent(tmp_path, statuses, checks=lambda ag: ag._federation_finished())
    # alone with the liar: one device is never "a majority of the members"
    liar = {"a": _st("finished", 999999)}
    assert _starting_agent(tmp_path, liar, live=("a",), checks=lambda ag: ag._rejoin_round()) == 1
    assert not _starting_agent(tmp_path, liar, live=("a",), checks=lambda ag: ag._federation_finished())
    # a device that is no member counts for nothing
    assert not _starting_agent(tmp_path, {"x": _st("finished", 6), "y": _st("finished", 6), "a": _st("running", 3)},
                               members={"a", "b"}, checks=lambda ag: ag._federation_finished())


def test_one_devices_running_status_far_ahead_moves_no_restart(tmp_path):
    """One live member's status ``running`` at round 1000: on 0c2393f the node rejoined at
    round 1001, past the run's end, and exited."""
    statuses = {"a": _st("running", 1000), "b": _st("running", 3)}
    assert _starting_agent(tmp_path, statuses, checks=lambda ag: ag._rejoin_round()) == 4  # both completed 3
    # both live neighbours ahead: a skip, capped; never past the run's last round
    both = {"a": _st("running", 1000), "b": _st("running", 1000)}
    assert _starting_agent(tmp_path, both, checks=lambda ag: ag._rejoin_round()) == 11
    assert _starting_agent(tmp_path, both, checks=lambda ag: ag._rejoin_round(55)) == ROUNDS


def test_majority_of_members_says_finished(tmp_path):
    both = {"a": _st("finished", ROUNDS), "b": _st("finished", ROUNDS)}
    assert _starting_agent(tmp_path, both, checks=lambda ag: ag._federation_finished())
    # the admitted members of the run, not only the live ones: two of three finished and left
    assert _starting_agent(tmp_path, both, live=(), members={"a", "b", "c"},
                           checks=lambda ag: ag._federation_finished())
    assert not _starting_agent(tmp_path, {"a": _st("finished", ROUNDS)}, live=(), members={"a", "b", "c"},
                               checks=lambda ag: ag._federation_finished())
    # members recorded when the rounds started (--once: read back when resuming a checkpoint)
    (tmp_path / "members.json").write_text(json.dumps({"members": ["a", "b", "c"]}))
    assert _starting_agent(tmp_path, both, live=(), resumed=True, checks=lambda ag: ag._federation_finished())
    assert not _starting_agent(tmp_path, both, live=("a",), resumed=False,  # a fresh start: the file is stale
                               checks=lambda ag: ag._federation_finished())


def test_members_are_recorded_as_the_rounds_start(tmp_path):
    def save(ag):
        ag._save_members()
        return json.loads((tmp_path / "members.json").read_text())

    assert _starting_agent(tmp_path, {}, members={"c"}, checks=save) == {"members": ["a", "b", "c"]}
    (tmp_path / "members.json").write_text("{not json")  # unreadable: no members, no crash
    assert _starting_agent(tmp_path, {}, live=(), resumed=True, checks=lambda ag: ag._members()) == set()


def test_finished_by_members_rule():
    from dfl_agent.runtime.run.rejoin import finished_by_members

    fin = {"state": "finished"}
    assert not finished_by_members({"a": fin}, {"a"})  # one device, even the only other member
    assert finished_by_members({"a": fin, "b": fin}, {"a", "b", "c"})
    assert not finished_by_members({"a": fin, "b": fin}, {"a", "b", "c", "d"})  # half is no majority
    assert not finished_by_members({"a": fin, "b": "finished"}, {"a", "b"})  # malformed status
