"""Alone is a state, not a success (dfl_agent.runtime.shared.degraded): a node that closes rounds with
no peer update although it needs peers flags its run ``degraded`` with a count (status, ledger
entry, ``dflctl status``, ``run list``, ``run show``), warns at most once every 10 rounds, and
``dfl-agent run --once`` exits 4 when more than half the rounds were alone (``runtime.allow_alone``
accepts it).  A deliberate ``local`` run is never alone."""

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dfl_agent.cli.cli_runs import run_rows, run_view
from dfl_agent.cli.tables import STATUS_COLUMNS, render_table, status_rows
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.node.node import round_alone
from dfl_agent.runtime.run.operations import recount
from dfl_agent.runtime.service.lobby import RunLobby
from dfl_agent.runtime.service.run_manager import RunManager
from dfl_agent.runtime.service.supervisor import RunProgress
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.degraded import EXIT_DEGRADED, degraded_fields, once_exit_code
from dfl_agent.runtime.shared.descriptor import RunDescriptor
from dfl_agent.transport.memory import MemoryNetwork, run_virtual
from tests.unit import test_run_manager as rm


def _lone_node(algorithm: str, rounds: int, needs_peers: bool | None, finish_after: int | None = None):
    """A node with nobody else in its federation (in-memory network, virtual time) that
    trains ``rounds`` rounds; ``needs_peers`` as the agent sets it (None: not set).
    Returns its records and final status."""
    from dfl_agent.algorithms.base import get_algorithm
    from dfl_agent.data import load_dataset, node_data_for
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.models import default_spec
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.node.node import Node

    bundle = load_dataset("digits")
    net = MemoryNetwork()
    me = RuntimeContext(node_id="me", federation="f", transport=net.transport("me", "f", {}),
                        peers=PeerTable("me", "f"), data=node_data_for(bundle, 2, 0, "iid", seed=0),
                        model_spec=default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small"),
                        train=TrainConfig(steps=1), init_seed=1, rng=np.random.default_rng(0))
    cls = get_algorithm(algorithm)
    opts = cls.Options(round_timeout=0.5) if algorithm == "fedavg" else cls.Options()
    records: list[dict] = []
    node = Node(me, cls(me, opts), bundle.test.x[:20], bundle.test.y[:20], sink=records.append, eval_every=100)
    if needs_peers is not None:
        node.hooks.needs_peers = lambda: needs_peers
    if finish_after is not None:  # what the agent's check says: most members finished the run
        checks = iter(range(1, rounds + 1))  # called once after every round but the last
        node.hooks.finish_check = lambda: next(checks) >= finish_after
    out = {}

    async def main():
        await me.start()
        await node.setup()
        await node.run(rounds)
        out["status"] = node.status()

    run_virtual(main())
    return records, out["status"]


def test_a_lone_node_that_needs_peers_is_degraded_and_warns_once_every_10_rounds(caplog):
    """min_peers >= 1, nobody came: every round is alone, the status says degraded 25 of 25,
    and the WARNING comes at rounds 1, 11 and 21 only (at HEAD before: no round alone, no
    warning, no degraded field)."""
    with caplog.at_level(logging.WARNING, logger="dfl_agent.daemon"):
        records, st = _lone_node("fedavg", 25, needs_peers=True)
    assert [r["alone"] for r in records] == [True] * 25
    assert degraded_fields(st) == {"degraded": True, "rounds_alone": 25, "exchange_rounds": 25}
    warned = [r.getMessage() for r in caplog.records if "closed alone" in r.getMessage()]
    assert [w.split()[1] for w in warned] == ["1", "11", "21"], warned
    assert "the run is degraded, 11 of 11 rounds alone so far" in warned[1]


def test_a_node_that_needs_no_peer_is_not_degraded_when_it_runs_alone():
    """min_peers = 0 and nobody else: genuinely alone, no failure."""
    records, st = _lone_node("fedavg", 3, needs_peers=False)
    assert not any(r["alone"] for r in records)
    assert st["degraded"] is False and st["rounds_alone"] == 0 and st["exchange_rounds"] == 3


def test_a_node_left_behind_ends_when_most_members_finished_instead_of_closing_the_rest_alone():
    """A node behind its federation (cut off, or slow) whose members report the run finished
    ends its run after the round it is in, as finished (before: it closed every remaining
    round alone at once: 210 in the field trial)."""
    records, st = _lone_node("fedavg", 25, needs_peers=True, finish_after=3)
    assert [r["round"] for r in records] == [1, 2, 3]
    assert st["state"] == "finished" and st["rounds_alone"] == 3


def test_a_deliberate_local_run_is_never_alone():
    records, st = _lone_node("local", 3, needs_peers=True)
    assert not any(r["alone"] for r in records)
    assert degraded_fields(st) == {"degraded": False, "rounds_alone": 0, "exchange_rounds": 0}


def test_round_alone_counts_a_node_that_needs_peers():
    assert round_alone({"neighbours": 0}, [], needs_peers=True)
    assert not round_alone({"neighbours": 0}, [], needs_peers=False)
    assert not round_alone({"neighbours": 1}, [], needs_peers=True)
    assert not round_alone({"role": "idle", "neighbours": 0}, [], needs_peers=True)  # not meant to exchange


@pytest.mark.parametrize("alone,rounds,allow,want", [
    (20, 20, False, EXIT_DEGRADED),  # the lone node
    (11, 20, False, EXIT_DEGRADED),  # more than half
    (10, 20, False, 0),  # half: degraded, but the run exits 0
    (20, 20, True, 0),  # runtime.allow_alone
    (0, 20, False, 0),
])
def test_once_exits_4_when_more_than_half_the_rounds_were_alone(alone, rounds, allow, want):
    """From the finished run's ledger entry (the run manager recorded the degraded counts)."""
    entry = {"state": "finished", "rounds_alone": alone, "exchange_rounds": rounds}
    assert once_exit_code(entry, allow) == want


def test_allow_alone_is_a_runtime_key_off_by_default():
    assert config_from_dict({"federation": "f"}).runtime.allow_alone is False
    assert config_from_dict({"federation": "f", "runtime": {"allow_alone": True}}).runtime.allow_alone is True


def test_a_resumed_node_recounts_its_rounds_alone_from_the_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"node": "n", "run": "r", "round": t, "neighbours": 0, "alone": t <= 3} for t in range(1, 6)]
    recs += [{"node": "other", "run": "r", "round": 1, "neighbours": 0, "alone": True},
             {"node": "n", "run": "r", "round": 3, "neighbours": 0, "alone": True},  # written twice
             {"node": "n", "run": "r", "round": 9, "neighbours": 0, "alone": True}]  # after the checkpoint
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n{torn")
    assert recount(path, "n", "r", upto=5) == (3, 5)
    assert recount(tmp_path / "missing", "n", "r", upto=5) == (0, 0)


class _AloneAgent(rm.Agent):
    """The run manager's stand-in agent whose node closed 15 of 20 rounds alone."""

    async def run(self, stop):
        st = {"round": 20, "rounds_alone": 15, "exchange_rounds": 20}
        self.progress = RunProgress("n", "f", st)
        return await super().run(stop)


def test_the_run_is_recorded_with_its_degraded_flag_and_count(tmp_path):
    """Not a state: the run still ends recorded (``finished``), its ledger entry flagged."""
    m: RunManager = rm.manager(tmp_path, agent=_AloneAgent)
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=20)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event())) is True
    e = m.ledger.entries["r1"]
    assert e["state"] == "finished"
    assert (e["degraded"], e["rounds_alone"], e["exchange_rounds"]) == (True, 15, 20)


def test_the_idle_status_carries_degraded_runs_in_its_history():
    published = []
    lobby = RunLobby(config_from_dict({"federation": "f"}), "n", SimpleNamespace(refused={}))
    lobby.client = SimpleNamespace(publish=lambda topic, payload, **kw: published.append(payload))
    lobby._signed = lambda kind, doc: doc
    hist = {"r1": {"state": "finished", "round": 20, "time": 1, "degraded": True, "rounds_alone": 15,
                   "exchange_rounds": 20},
            "r2": {"state": "finished", "round": 20, "time": 2, "degraded": False, "rounds_alone": 0}}
    lobby.publish_status({"id": "r2", "state": "finished"}, "idle", hist)
    h = published[0]["run_history"]
    assert h["r1"]["degraded"] is True and h["r1"]["rounds_alone"] == 15 and h["r1"]["exchange_rounds"] == 20
    assert "degraded" not in h["r2"]


def test_dflctl_status_run_list_and_run_show_show_degraded():
    training = {"state": "running", "round": 7, "rounds_alone": 7, "exchange_rounds": 7, "degraded": True,
                "run": {"id": "r1", "state": "training", "round": 7}}
    idle = {"state": "idle", "run": {"id": "r0", "state": "finished", "round": 20},
            "run_history": {"r0": {"state": "finished", "round": 20, "degraded": True, "rounds_alone": 12,
                                   "exchange_rounds": 20}}}
    fine = {"state": "running", "round": 7, "rounds_alone": 0, "exchange_rounds": 7, "degraded": False,
            "run": {"id": "r1", "state": "training", "round": 7}}
    rows = {r["node_id"]: r["degraded"] for r in status_rows({"a": training, "b": idle, "c": fine})}
    assert rows == {"a": "7/7 alone", "b": "12/20 alone", "c": ""}
    from io import StringIO

    from rich.console import Console

    buf = StringIO()
    Console(file=buf, width=80, no_color=True).print(render_table("status", status_rows({"a": training, "c": fine}),
                                                                  STATUS_COLUMNS))
    assert "7/7 alone" in buf.getvalue()  # kept on a narrow terminal
    msg = {"descriptor": {"run_id": "r0", "algorithm": "fedavg", "rounds": 20}}
    v = run_view("r0", msg, {"b": idle})
    assert v["nodes"]["b"]["degraded"] is True and v["nodes"]["b"]["rounds_alone"] == 12
    assert run_rows({"r0": msg}, {"b": idle})[0]["nodes"] == "b:finished@20 degraded"
    assert run_view("r1", {"descriptor": {"run_id": "r1"}}, {"a": training})["nodes"]["a"]["rounds_alone"] == 7
    assert run_rows({"r1": {"descriptor": {}}}, {"c": fine})[0]["nodes"] == "c:training@7"


def test_a_run_process_tells_its_supervisor_the_degraded_counts_with_trained():
    """The run process's ``trained`` message carries them; the supervisor's view of the node
    (what the run manager reads for the ledger) takes them."""
    from dfl_agent.runtime.run.agent import Agent
    from dfl_agent.runtime.service.supervisor import ChildRun, RunProgress
    from dfl_agent.runtime.shared import pipe

    class Host:
        def __init__(self):
            self.reports = []

        def members(self):
            return ()

        def may_join(self):
            return 0

        def record_state(self, report):
            self.reports.append(report)

    host = Host()
    agent = Agent(config_from_dict({"federation": "f"}), host=host)
    st = {"round": 20, "rounds_alone": 15, "exchange_rounds": 20, "degraded": True}
    agent.node = SimpleNamespace(status=lambda: st)
    agent._tell("trained")
    msg = pipe.from_line(pipe.to_line(host.reports[0]))  # as it crosses the pipe
    assert (msg.degraded["degraded"], msg.degraded["rounds_alone"], msg.degraded["exchange_rounds"]) == (True, 15, 20)

    told = []
    child = ChildRun(config_from_dict({"federation": "f"}), run=SimpleNamespace(run_id="r"), run_dir=Path("."),
                     lobby=None, on_state=lambda state, **kw: told.append(degraded_fields(child.progress.status)))
    child.progress, child._send = RunProgress("n", "f"), lambda doc: None
    asyncio.run(child._state(msg))
    assert told == [{"degraded": True, "rounds_alone": 15, "exchange_rounds": 20}]
