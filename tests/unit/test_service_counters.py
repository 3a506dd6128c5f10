"""The always-on agent's refusal and drop counters (dfl_agent.runtime.service.service_counters):
in the status idle and while a run trains, and the same after a restart - with the real
run manager, run lobby, verifier, node and state directory (no broker: the lobby's client
records what it publishes)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np

from dfl_agent.profiles import resolve_profile
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.lobby import RunLobby
from dfl_agent.runtime.service.run_manager import RunHooks, RunManager
from dfl_agent.runtime.service.service_counters import COUNTERS_FILE, ServiceCounters, load_counters
from dfl_agent.runtime.service.supervisor import RunProgress
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import RunDescriptor, RunVerifier
from dfl_agent.runtime.shared.pipe import RunCounters


class Client:
    """Records the lobby's publications (what paho would send)."""

    def __init__(self):
        self.sent = []

    def publish(self, topic, body, qos=0, retain=False):
        self.sent.append(json.loads(body))


class Notifier:
    def watchdog_interval(self):
        return None

    def ready(self, line):
        pass

    status = watchdog = stopping = ready


def real_node():
    """A real node (fedavg, memory transport, a tiny data set) as a run would have."""
    from dfl_agent.algorithms.base import get_algorithm, parse_options
    from dfl_agent.data.dataset import NodeData
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.models import default_spec
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.node.node import Node
    from dfl_agent.transport.memory import MemoryNetwork

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype(np.float32), rng.integers(0, 2, 16)
    data = NodeData(x, y, x[:4], y[:4], 2, (4,), ["a", "b"], [])
    ctx = RuntimeContext(node_id="n", federation="f", transport=MemoryNetwork().transport("n", "f", {}),
                         peers=PeerTable("n", "f"), data=data, model_spec=default_spec((4,), 2, "small"),
                         train=TrainConfig(epochs=1, batch_size=8), init_seed=0, rng=np.random.default_rng(0), seed=0)
    cls = get_algorithm("fedavg")
    return Node(ctx, cls(ctx, parse_options(cls, {})), x[:4], y[:4], rounds=1)


class TrainingAgent:
    """Its run's node is a real one; while it "trains", its status is reported to the
    supervisor, which publishes it with the service's counters (as ChildRun does)."""

    def __init__(self, cfg, config_path, *, on_state, lobby=None, service_status, **kw):
        self.on_state, self.outcome, self.snapshot, self.data_shape = on_state, "starting", None, None
        self.progress, self.service_status, self.seen, self.lobby = None, service_status, None, lobby

    async def run(self, stop):
        node = real_node()
        await node.setup()
        node.ctx.rejected["presence_bad_signature"] += 2  # the run's transport dropped forged presences
        c = node.ctx.counters()
        self.progress = RunProgress("n", "f", node.status(), RunCounters(dropped=c["dropped"]))
        if self.lobby is not None:  # the supervisor publishes the run's status with the service's counters
            self.lobby.publish_run_status(self.progress.status, self.service_status())
            self.seen = self.lobby.client.sent[-1]
        self.outcome = "finished"
        self.on_state("trained")
        return 0


def manager(state_dir, agent=TrainingAgent):
    cfg = config_from_dict({"federation": "f", "state_dir": str(state_dir)})
    lobby = RunLobby(cfg, "n", RunVerifier("f", require_signatures=False))
    lobby.client = Client()
    prof = resolve_profile("generic-x86", {"behaviour": {"algorithms": ["fedavg"]}})[0]
    return RunManager(cfg, None, node_id="n", profile=prof, ledger=RunLedger(state_dir), lobby=lobby,
                      agent_factory=agent, notifier=Notifier(), hooks=RunHooks())


def refuse_and_drop(lobby):
    """A malformed run descriptor (refused) and a malformed peer status (dropped)."""
    lobby._on_message(None, None, SimpleNamespace(topic="dfl/f/run/r-x", payload=b"{not json"))
    lobby._on_message(None, None, SimpleNamespace(topic="dfl/f/node/m/status", payload=b"[[["))


def test_the_counters_are_in_every_status_and_survive_a_restart(tmp_path):
    m = manager(tmp_path)
    m.publish(force=True)
    first = m.lobby.client.sent[-1]
    assert first["runs_refused"] == {} and first["control_dropped"] == {}  # present, even at zero
    refuse_and_drop(m.lobby)
    m.publish(force=True)
    idle = m.lobby.client.sent[-1]
    assert idle["runs_refused"] == {"malformed": 1} and idle["control_dropped"] == {"status_malformed": 1}

    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=1)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event())) and m.ledger.state("r1") == "finished"
    # the run ended: its node's presence drops stay with the service's counters
    seen = m.counters.view()
    assert seen == {"runs_refused": {"malformed": 1},
                    "control_dropped": {"presence_bad_signature": 2, "status_malformed": 1},
                    "privacy": {"dp": False},  # the privacy budget's field: no DP here
                    "signatures_required": False, "runs_queued": []}  # the lobby's: unsigned, nothing queued
    m.publish(force=True)
    after = m.lobby.client.sent[-1]
    assert after["runs_refused"] == seen["runs_refused"] and after["control_dropped"] == seen["control_dropped"]

    assert m.counters.save() and not m.counters.save()  # written once, then unchanged
    again = manager(tmp_path)  # a restart: the lobby and the verifier count from 0 again
    assert again.lobby.verifier.refused == {} and again.counters.view() == seen
    refuse_and_drop(again.lobby)
    again.publish(force=True)
    st = again.lobby.client.sent[-1]
    assert st["runs_refused"] == {"malformed": 2}
    assert st["control_dropped"] == {"presence_bad_signature": 2, "status_malformed": 2}
    assert again.service_status()["runs_refused"] == {"malformed": 2}  # the Prometheus endpoint's view


def test_the_run_node_status_carries_the_counters_while_training(tmp_path):
    agents = []

    def factory(*a, **kw):
        agents.append(TrainingAgent(*a, lobby=m.lobby, **kw))
        return agents[-1]

    m = manager(tmp_path, factory)
    refuse_and_drop(m.lobby)
    d = RunDescriptor(run_id="r2", federation="f", algorithm="fedavg", rounds=1)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event()))
    seen = agents[0].seen
    assert seen["algorithm"] == "fedavg" and seen["round"] == 0  # the run node's own status ...
    assert seen["runs_refused"] == {"malformed": 1}
    # ... with the service's counters: the lobby's status drops (once: the run's transport
    # counts the same statuses), the run's own presence drops
    assert seen["control_dropped"] == {"presence_bad_signature": 2, "status_malformed": 1}


def test_the_saving_task_writes_while_counting_and_once_more_at_stop(tmp_path):
    lobby = SimpleNamespace(verifier=SimpleNamespace(refused={}), dropped={})
    c = ServiceCounters(tmp_path, lobby)

    async def main():
        c.start_saving(0.05)
        lobby.verifier.refused["unsigned"] = 1
        for _ in range(100):
            await asyncio.sleep(0.02)
            if (tmp_path / COUNTERS_FILE).exists():
                break
        assert load_counters(tmp_path / COUNTERS_FILE)["runs_refused"] == {"unsigned": 1}
        lobby.dropped["handler_error"] = 3
        await c.stop_saving()

    asyncio.run(main())
    assert load_counters(tmp_path / COUNTERS_FILE) == {"runs_refused": {"unsigned": 1},
                                                       "control_dropped": {"handler_error": 3}}


def test_an_unreadable_counters_file_starts_from_zero(tmp_path, caplog):
    (tmp_path / COUNTERS_FILE).write_text("[" * 100)  # nested too deep for the bounded parser
    assert load_counters(tmp_path / COUNTERS_FILE) == {"runs_refused": {}, "control_dropped": {}}
    assert "unreadable" in caplog.text
    (tmp_path / COUNTERS_FILE).write_text(json.dumps({"runs_refused": {"replay": 4, "bad": "x"}}))
    assert load_counters(tmp_path / COUNTERS_FILE) == {"runs_refused": {"replay": 4}, "control_dropped": {}}
