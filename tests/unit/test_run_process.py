"""The pipe between the supervisor and a run process (JSON lines), the run process's
presence relay (it publishes no presence, no status and no last will itself), and how the
supervisor reads a run process's exit.  The real processes: tests/system/test_supervisor.py."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from dfl_agent.discovery.presence import MqttPresence
from dfl_agent.runtime.run.run_process import RunChannel
from dfl_agent.runtime.service.supervisor import ChildRun, RunProgress
from dfl_agent.runtime.shared import pipe
from dfl_agent.runtime.shared.assembly import StartupError
from dfl_agent.runtime.shared.pipe import StateReport
from dfl_agent.runtime.shared.run_host import HostGone


def _channel():
    r_out, w_out = os.pipe()  # child -> supervisor
    r_in, w_in = os.pipe()  # supervisor -> child
    ch = RunChannel(os.fdopen(w_out, "wb", buffering=0), os.fdopen(r_in, "r"))
    return ch, os.fdopen(r_out, "r"), os.fdopen(w_in, "w")


def test_state_waits_for_the_supervisors_ack_and_carries_the_round():
    ch, from_child, to_child = _channel()
    to_child.write(json.dumps({"type": "start", "members": ["b"], "may_join": 2}) + "\n")
    to_child.flush()
    ch.read_start()
    assert ch.members() == ("b",) and ch.may_join() == 2
    done = threading.Event()
    t = threading.Thread(target=lambda: (ch.record_state(StateReport("trained", 0, round=3)), done.set()))
    t.start()
    msg = json.loads(from_child.readline())
    assert msg.pop("peak_rss_mb") > 10  # this process's own peak (MiB), measured when it sends the state
    assert msg == {"type": "state", "state": "trained", "seq": 1, "round": 3}
    assert not done.wait(0.2)  # not before the supervisor recorded it
    to_child.write(json.dumps({"type": "ack", "seq": 1}) + "\n" + json.dumps({"type": "may_join", "n": 0}) + "\n")
    to_child.flush()
    assert done.wait(5)
    t.join()
    assert ch.may_join() == 0


def test_a_line_that_is_no_pipe_message_is_dropped_and_the_pipe_goes_on():
    ch, from_child, to_child = _channel()
    to_child.write(json.dumps({"type": "start"}) + "\n")
    to_child.flush()
    ch.read_start()
    to_child.write("{not json\n" + json.dumps({"type": "what"}) + "\n" + json.dumps({"type": "may_join", "n": "x"})
                   + "\n" + json.dumps({"type": "may_join", "n": 1}) + "\n")
    to_child.flush()
    deadline = time.monotonic() + 5
    while ch.may_join() != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ch.may_join() == 1 and ch.dropped == 3 and not ch.gone.is_set()


def test_every_pipe_message_reads_back_as_it_was_written():
    msgs = [pipe.Start(("a", "b"), 3), pipe.Ack(7), pipe.MayJoin(0), pipe.Presence({"algorithm": "fedavg"}),
            pipe.StatusReport({"round": 2}, pipe.RunCounters(1, 2, {"replay": 3}, 0), ("p",), 2),
            pipe.StatusReport({"round": 0}),
            StateReport("deployed", 4, round=5, snapshot_last_id=9, version=2, start={"init": "warm"},
                        degraded={"degraded": True, "rounds_alone": 1, "exchange_rounds": 5}, peak_rss_mb=301.5),
            pipe.Failure("startup", "data.path: no such folder"),
            pipe.End("finished", 5, 5, [[3, 32], 6], 9, {"replay": 1}),
            pipe.End("finished", 5, 5, None, None, {}, 352.3),
            StateReport("adopted", 3, round=0, version=4, source={"node": "b", "version": 2, "sha256": "ab"},
                        reason="accuracy 0.9 vs none"),
            pipe.End("missed", 0, 0, None, None, {"model_files_bad_hash": 1}, 300.0, "b: deployment is off")]
    for m in msgs:
        assert pipe.from_line(pipe.to_line(m)) == m
    for bad in (b"[1]", b'{"type": "state", "state": "sleeping", "seq": 1}', b'{"type": "ack"}', b"\xff",
                b'{"type": "end", "outcome": "finished", "peak_rss_mb": "a lot"}',
                b'{"type": "state", "state": "trained", "seq": 1, "peak_rss_mb": -1}',
                b'{"type": "state", "state": "kept", "seq": 1, "reason": 3}'):
        with pytest.raises(pipe.PipeError):
            pipe.from_line(bad)
    # an earlier release's lines, without the peak, read as before
    assert pipe.from_line(b'{"type": "end", "outcome": "finished", "round": 3}').peak_rss_mb is None
    assert pipe.from_line(b'{"type": "state", "state": "trained", "seq": 2}').peak_rss_mb is None
    old = pipe.from_line(b'{"type": "state", "state": "deployed", "seq": 2, "version": 3}')
    assert (old.source, old.reason, pipe.from_line(b'{"type": "end", "outcome": "finished"}').reason) == (None, None, None)


def test_a_closed_pipe_means_the_supervisor_is_gone():
    ch, from_child, to_child = _channel()
    to_child.write(json.dumps({"type": "start"}) + "\n")
    to_child.flush()
    gone = threading.Event()
    ch.on_gone = gone.set
    ch.read_start()
    to_child.close()
    assert gone.wait(5)
    with pytest.raises(HostGone):
        ch.record_state(StateReport("deploying", 0))


def test_a_run_process_presence_speaks_through_its_host_and_sets_no_will():
    from dfl_agent.runtime.run.hosted_presence import HostedPresence
    from tests.host import LobbyHost

    host = LobbyHost(publish=False)
    sent = []
    host.publish_presence = lambda d: sent.append(("presence", dict(d)))
    p = HostedPresence("n1", "fed", descriptor={"algorithm": "fedavg"}, host=host,
                       report=lambda st: pipe.StatusReport(st, checkpoint_round=1))
    assert p.will() is None and p.goodbye(None) is None
    p._status = {"state": "training", "round": 2}
    p.announce(None)
    assert sent == [("presence", {"algorithm": "fedavg"})]
    assert host.statuses == [pipe.StatusReport({"state": "training", "round": 2}, checkpoint_round=1)]
    plain = MqttPresence("n1", "fed", descriptor={})
    assert plain.will() is not None  # a node that speaks for itself (dfl-infer): its own last will


def _child(**kw):
    c = ChildRun(SimpleNamespace(federation="fed"), run=SimpleNamespace(run_id="r1"), run_dir=".", lobby=None,
                 memory_mb=96, **kw)
    c.progress = RunProgress("n1", "fed")
    return c


def test_exit_of_a_run_process_read_as_the_supervisor_records_it():
    c = _child()
    assert c._ended(-9, oom=True) == 1 and c.crash == "oom" and "OOM killer (memory limit 96 MiB)" in c.error
    c = _child()
    assert c._ended(-9, oom=False) == 1 and c.crash == "killed"
    c = _child()
    c.error = "ZeroDivisionError: boom"
    assert c._ended(1, oom=False) == 1 and c.crash == "crashed" and c.error == "ZeroDivisionError: boom"
    c = _child()
    assert c._ended(3, oom=False) == 3 and c.crash is None  # broker unreachable: tried again, not a crash
    c = _child()
    c.outcome = "stopped"
    assert c._ended(0, oom=False) == 0 and c.crash is None
    c = _child()
    c.error = "data.path: no such folder"
    with pytest.raises(StartupError, match="data.path"):
        c._ended(2, oom=False)


@pytest.fixture(scope="module")
def digits():
    from dfl_agent.data import load_dataset

    return load_dataset("digits")


def _never_set_up(name: str, bundle):
    """A node of algorithm ``name`` as a run process holds it when its start failed (the
    broker was down): built, never set up."""
    import numpy as np

    from dfl_agent.algorithms.base import get_algorithm
    from dfl_agent.data import node_data_for
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.models import default_spec
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.node.node import Node
    from dfl_agent.transport.memory import MemoryNetwork

    ctx = RuntimeContext(node_id="me", federation="f", transport=MemoryNetwork().transport("me", "f", {}),
                         peers=PeerTable("me", "f"), data=node_data_for(bundle, 2, 0, "iid", seed=0),
                         model_spec=default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small"),
                         train=TrainConfig(steps=1), init_seed=1, rng=np.random.default_rng(0))
    cls = get_algorithm(name)
    return Node(ctx, cls(ctx, cls.Options()), bundle.test.x[:20], bundle.test.y[:20])


def test_the_end_report_of_a_run_whose_node_was_never_set_up(digits):
    """The broker was down when the run started: the node exists but its algorithm was never set
    up.  Its status and the run's ``end`` message still work, for every registered algorithm (at
    75535c2: ``AttributeError: 'FedAvg' object has no attribute 'market'`` from the end report, a
    traceback in the run process, and the same for 12 of the 18 algorithms)."""
    from dfl_agent.algorithms.base import available
    from dfl_agent.runtime.run.agent import Agent
    from dfl_agent.runtime.shared.config import config_from_dict
    from tests.host import LobbyHost

    for name in available():
        node = _never_set_up(name, digits)
        st = node.status()
        assert st["round"] == 0 and st["algorithm"] == name and st["state"] == "starting", name
        agent = Agent(config_from_dict({"federation": "f"}), host=LobbyHost(publish=False))
        agent.node, agent.outcome = node, "stopped"
        doc = json.loads(pipe.to_line(agent.end_report()))  # it goes down the pipe as one JSON line
        assert doc["type"] == "end" and doc["round"] == 0 and doc["last_round"] == 0, name
