"""The run manager (dfl_agent.runtime.service.run_manager): its states, one method per transition,
and what each end of a run writes to the ledger - driven step by step with a stand-in lobby
and agent (no MQTT, no torch)."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.lobby import RunQueue
from dfl_agent.runtime.service.run_manager import TRANSITIONS, IllegalTransition, RunHooks, RunManager
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import RunDescriptor
from dfl_agent.runtime.shared.run_config import CANCEL_LATE


class Lobby:
    def __init__(self):
        self.lock = threading.Lock()
        self.queue = RunQueue()
        self.changed = threading.Event()
        self.on_cancel = None
        self.verifier = SimpleNamespace(refused={})
        self.published = []
        self.client = None  # not connected: the announcement of a deployed model is skipped

    def run(self, run_id):
        return self.queue.runs.get(run_id)

    def accepted_by(self, run_id):
        return set()

    def late_for(self, run_id):
        return ""

    def finished_by(self, run_id):
        return set()

    def may_join(self, run_id):
        return 10

    def publish_status(self, info, state, history):
        self.published.append((dict(info) if info else None, state))


class Notifier:
    def watchdog_interval(self):
        return None

    def ready(self, line):
        pass

    status = watchdog = ready


class Agent:
    """Trains nothing: reports the states after its rounds and finishes."""

    def __init__(self, cfg, config_path, *, on_state, deployed=True, **kw):
        self.cfg, self.on_state, self.kw = cfg, on_state, kw
        self.outcome, self.progress, self.snapshot, self.data_shape = "starting", None, None, None
        self.deployed = deployed

    async def run(self, stop):
        self.outcome = "finished"
        self.on_state("trained")
        self.on_state("deploying")
        self.on_state("deployed" if self.deployed else "kept")
        return 0


def manager(tmp_path, agent=Agent, **cfg):
    from dfl_agent.profiles import resolve_profile

    config = config_from_dict({"federation": "f", "state_dir": str(tmp_path), **cfg})
    prof = resolve_profile("generic-x86", {"behaviour": {"algorithms": ["fedavg"]}})[0]
    return RunManager(config, None, node_id="n", profile=prof, ledger=RunLedger(tmp_path), lobby=Lobby(),
                      agent_factory=agent, notifier=Notifier(), hooks=RunHooks())


#: the run manager's states (see its module docstring for the transitions)
STATES = ("idle", "admitted", "waiting_for_members", "training", "trained", "deploying", "deployed", "kept",
          "adopted", "recorded", "declined", "cancelled", "failed", "missed")


def test_the_states_are_exactly_those_of_the_architecture():
    assert set(STATES) == {"idle", "admitted", "waiting_for_members", "training", "trained", "deploying",
                           "deployed", "kept", "adopted", "recorded", "declined", "cancelled", "failed", "missed"}
    assert set(TRANSITIONS) == set(STATES)
    assert all(set(nxt) <= set(STATES) for nxt in TRANSITIONS.values())
    for end in ("recorded", "declined", "cancelled", "failed", "missed"):  # every end goes back to idle
        assert TRANSITIONS[end] == ("idle",)


class Adopter(Agent):
    """Missed the run's end: reports the model it adopted from member ``b`` (or kept, or none)."""

    def __init__(self, *a, how="adopted", **kw):
        super().__init__(*a, **kw)
        self.how, self.reason = how, ""

    async def run(self, stop):
        if self.how == "missed":
            self.outcome, self.reason = "missed", "no member could provide the run's model (b: deployment is off)"
            return 0
        self.outcome = "finished"
        self.on_state(self.how, version=4 if self.how == "adopted" else None,
                      source={"node": "b", "version": 2, "sha256": "ab" * 32, "round": 3}, reason="accuracy 0.9")
        return 0


@pytest.mark.parametrize("how", ["adopted", "kept", "missed"])
def test_a_node_that_missed_the_runs_end_records_how_its_model_ended(tmp_path, how):
    """adopted: training -> adopted -> recorded, the ledger names the member and its version;
    kept: training -> kept -> recorded; missed: training -> missed (terminal, with each member's
    answer), and the status shows it."""
    m = manager(tmp_path, agent=lambda *a, **kw: Adopter(*a, how=how, **kw))
    seen = []
    m._to = (lambda to, *a, orig=m._to, **kw: (seen.append(to), orig(to, *a, **kw))[1])  # type: ignore[method-assign]
    d = RunDescriptor(run_id="r9", federation="f", algorithm="fedavg", rounds=3)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event()))
    e = m.ledger.entries["r9"]
    if how == "missed":
        assert seen == ["admitted", "training", "missed", "idle"]
        assert e["state"] == "missed" and "b: deployment is off" in e["reason"] and "model" not in e
        assert m.ledger.is_done("r9") and m.lobby.published[-1][0]["state"] == "missed"
        return
    assert seen == ["admitted", "training", how, "recorded", "idle"]
    assert e["state"] == "finished" and e["model"] == how and e["adopted_from"] == "b" and e["adopted_version"] == 2
    assert e["adopted_sha256"] == "ab" * 32 and e["model_note"] == "accuracy 0.9"
    assert (e.get("version") == 4) is (how == "adopted")


def test_a_finished_run_passes_training_trained_deploying_deployed_recorded(tmp_path):
    m = manager(tmp_path)
    seen = []
    m._to = (lambda to, *a, orig=m._to, **kw: (seen.append(to), orig(to, *a, **kw))[1])  # type: ignore[method-assign]
    finished = []
    m.hooks.on_run_finished(lambda run, node: finished.append(run.run_id))
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=2)
    assert m.admit(d)
    assert asyncio.run(m.train(d, asyncio.Event())) is True
    assert seen == ["admitted", "training", "trained", "deploying", "deployed", "recorded", "idle"]
    assert m.ledger.state("r1") == "finished" and m.ledger.entries["r1"]["round"] == 2
    assert finished == ["r1"] and m.state == "idle" and m.agent is None
    assert m.lobby.published[0] == ({"id": "r1", "state": "accepted", "round": 0, "reason": ""}, "accepted")


def test_a_kept_model_is_recorded_too(tmp_path):
    m = manager(tmp_path, agent=lambda *a, **kw: Agent(*a, deployed=False, **kw))
    d = RunDescriptor(run_id="r2", federation="f", algorithm="fedavg", rounds=1)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event()))
    assert m.ledger.state("r2") == "finished"


def test_a_declined_run_is_recorded_with_its_reason(tmp_path):
    m = manager(tmp_path)
    d = RunDescriptor(run_id="r3", federation="f", algorithm="dechw", rounds=1)
    assert not m.admit(d)
    assert m.state == "declined" and m.ledger.state("r3") == "declined"
    assert m.ledger.entries["r3"]["reason"] == "algorithm dechw not allowed by profile generic-x86"
    m.idle()
    assert m.state == "idle"


def test_a_run_cancelled_before_it_ran_is_recorded_and_the_manager_stays_idle(tmp_path):
    m = manager(tmp_path, algorithm={"rounds": 1})
    m.has_default = False
    m.lobby.queue.offer(RunDescriptor(run_id="r4", federation="f", algorithm="fedavg", rounds=1, cancelled=True))
    assert m.next_run() is None
    assert m.ledger.state("r4") == "cancelled" and m.state == "idle"


def test_a_crashed_run_fails_and_the_manager_goes_on(tmp_path):
    class Crashing(Agent):
        async def run(self, stop):
            raise RuntimeError("boom")

    m = manager(tmp_path, agent=Crashing)
    d = RunDescriptor(run_id="r5", federation="f", algorithm="fedavg", rounds=1)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event())) is True
    assert m.ledger.state("r5") == "failed" and m.ledger.entries["r5"]["reason"] == "RuntimeError: boom"
    assert m.state == "idle"


def test_an_illegal_transition_raises(tmp_path):
    m = manager(tmp_path)
    assert m.admit(RunDescriptor(run_id="r6", federation="f", algorithm="fedavg", rounds=1))
    with pytest.raises(IllegalTransition):
        m.on_agent_state("deployed")  # admitted -> deployed: no such transition
    assert m.state == "admitted" and m.ledger.state("r6") == "admitted"  # nothing recorded


def test_a_published_run_with_a_bad_setting_fails_and_the_agent_stays_up(tmp_path):
    """A descriptor whose training settings the configuration rules refuse fails that run
    (recorded with the reason); before, the StartupError left the serve loop and ended
    the always-on agent (exit code 2), and a restart met the same retained descriptor."""
    m = manager(tmp_path)
    d = RunDescriptor(run_id="r6", federation="f", algorithm="fedavg", rounds=1, training={"no_such_key": 1})
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event())) is True
    assert m.ledger.state("r6") == "failed" and "no_such_key" in m.ledger.entries["r6"]["reason"]
    assert m.state == "idle" and m.lobby.on_cancel is None


def test_the_default_run_with_a_bad_setting_still_stops_the_agent(tmp_path):
    from dfl_agent.runtime.shared.assembly import StartupError

    m = manager(tmp_path)
    d = RunDescriptor(run_id="d-1", federation="f", algorithm="fedavg", rounds=1, training={"no_such_key": 1},
                      default=True)
    assert m.admit(d)
    with pytest.raises(StartupError):
        asyncio.run(m.train(d, asyncio.Event()))


class LateLobby(Lobby):
    """The other members' statuses: run r1 ended there (finished, deployed) after training."""

    def late_for(self, run_id):
        return "the run had ended on 2 member(s)" if run_id == "r1" else ""

    def finished_by(self, run_id):
        return {"a", "b"} if run_id == "r1" else set()


def test_a_late_joiner_declines_a_run_that_ended_on_its_members_and_does_not_wait(tmp_path):
    # found in the field lab: a device started after run 0 had ended everywhere took run 0 from
    # the queue, waited its whole start_timeout (120 s) for members that had moved on, marked it
    # failed, and held up the next run for everyone meanwhile
    import time

    m = manager(tmp_path)
    m.lobby = LateLobby()
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=1, min_members=3, start_timeout=60)
    assert m.admit(d)
    t0 = time.monotonic()
    assert asyncio.run(m.wait_for_members(d, asyncio.Event())) is False
    assert time.monotonic() - t0 < 5
    entry = m.ledger.entries["r1"]
    assert entry["state"] == "declined" and entry["reason"].startswith("late: the run had ended on 2 member(s)")
    assert m.state == "idle"


def test_a_member_back_from_a_power_cut_finishes_a_run_its_members_ended(tmp_path):
    # the same statuses, but this node trained rounds of r1 before its restart: it is not late,
    # and the members that ended the run count, so that its run process resumes from its
    # checkpoint, ends the run as they did, and deploys.  Found in the field lab: a gateway
    # killed at round 285 of 300 came back after the others had finished, waited its whole
    # start_timeout (120 s) for members that would never accept again, and failed the run
    m = manager(tmp_path)
    m.lobby = LateLobby()
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=1, min_members=3, start_timeout=60)
    assert m.admit(d)
    (m.ledger.run_dir("r1") / "metrics.jsonl").write_text('{"round": 1}\n')
    assert asyncio.run(m.wait_for_members(d, asyncio.Event())) is True
    # with only one other member that ended it, min_members 3 is not met: it fails at start_timeout
    m = manager(tmp_path / "b")
    m.lobby = LateLobby()
    m.lobby.finished_by = lambda run_id: {"a"}
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=1, min_members=3, start_timeout=0.5)
    assert m.admit(d)
    (m.ledger.run_dir("r1") / "metrics.jsonl").write_text('{"round": 1}\n')
    assert asyncio.run(m.wait_for_members(d, asyncio.Event())) is False
    assert m.ledger.entries["r1"]["state"] == "failed"


class CancelledAt(Agent):
    """Reports its states like :class:`Agent`; the operator's cancel reaches the node (the
    lobby's cancel hook, as a cancel record does) after ``at``: ``"round"`` (a round in
    progress) or ``"deploying"`` (its last round done, the model being deployed)."""

    at = "deploying"

    def __init__(self, *a, lobby, **kw):
        super().__init__(*a, **kw)
        self.lobby, self.stopped = lobby, None

    async def cancel(self, stop):
        d = self.lobby.queue.runs["r9"]
        self.lobby.queue.runs["r9"] = RunDescriptor(**{**d.__dict__, "cancelled": True})
        self.lobby.on_cancel("r9")  # on the lobby's MQTT thread in the agent
        await asyncio.sleep(0.05)
        self.stopped = stop.is_set()  # the supervisor SIGTERMs a run process on it

    async def run(self, stop):
        if self.at == "round":
            await self.cancel(stop)
            self.outcome = "stopped"  # the run process left its rounds
            return 0
        self.outcome = "finished"
        self.on_state("trained")
        self.on_state("deploying")
        await self.cancel(stop)
        if stop.is_set():  # a run process killed while it deploys: no model
            return 0
        self.on_state("deployed")
        return 0


def test_a_cancel_after_the_last_round_is_refused_and_the_run_deployed_and_recorded_finished(tmp_path):
    agents = []
    m = manager(tmp_path)
    m.agent_factory = lambda *a, **kw: agents.append(CancelledAt(*a, lobby=m.lobby, **kw)) or agents[-1]
    d = RunDescriptor(run_id="r9", federation="f", algorithm="fedavg", rounds=40)
    m.lobby.queue.offer(d)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event())) is True
    assert agents[0].stopped is False  # not stopped: the model is deployed
    entry = m.ledger.entries["r9"]
    assert (entry["state"], entry["round"], entry["reason"]) == ("finished", 40, CANCEL_LATE)
    assert m.info == {"id": "r9", "state": "finished", "round": 40, "reason": CANCEL_LATE}  # what its status says


def test_a_cancel_during_a_round_stops_the_run_and_records_it_cancelled(tmp_path):
    agents = []
    m = manager(tmp_path)
    m.agent_factory = lambda *a, **kw: agents.append(CancelledAt(*a, lobby=m.lobby, **kw)) or agents[-1]
    CancelledAt.at = "round"
    try:
        d = RunDescriptor(run_id="r9", federation="f", algorithm="fedavg", rounds=40)
        m.lobby.queue.offer(d)
        assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event())) is True
    finally:
        CancelledAt.at = "deploying"
    assert agents[0].stopped is True
    assert m.ledger.state("r9") == "cancelled" and m.info["state"] == "cancelled"
