"""A crash at every state boundary of a run's life: the real run manager, run ledger and
deployment (gate, model files, versions folder), with the crash switch
(``DFL_TEST_CRASH_AT``'s :func:`~dfl_agent.fsutil.crash_point`) raising instead of killing,
then a fresh run manager over the same state folder.  Whatever the point, the run ends
recorded ``finished`` with its model deployed or kept by the gate exactly once, trained
once; a declined or cancelled run stays so.  (``tests/system/test_run_kill.py`` SIGKILLs
a real agent at a few of these points.)"""

import asyncio
import copy
from types import SimpleNamespace

import numpy as np
import pytest

from dfl_agent.deploy import ModelStore
from dfl_agent.runtime.service.supervisor import RunProgress, switch_current
from dfl_agent.runtime.shared.descriptor import RunDescriptor
from tests.unit.test_run_manager import Lobby, manager

torch = pytest.importorskip("torch")


class Crash(BaseException):
    """The stand-in for SIGKILL: no handler of the run manager catches it."""


class MembersLobby(Lobby):
    def accepted_by(self, run_id):
        return {"n2"}  # another member accepted: min_members 2 is met at once


class DeployingAgent:
    """Trains nothing (a marker file in the run folder stands for the final checkpoint, the
    trainings are counted), then deploys a real model through the real deployment step
    (:func:`dfl_agent.runtime.run.deployment.deploy_after_run`): the gate on a validation slice,
    the model files, the versions folder."""

    trainings = 0
    host = None  # one process: no supervisor

    def __init__(self, cfg, config_path, *, run, run_dir, on_state, **kw):
        from dfl_agent.models import build_model, default_spec

        self.cfg, self.run_desc, self.run_dir, self.on_state = cfg, run, run_dir, on_state
        self.state_dir, self.node_id, self.run_id = cfg.state_dir, "n", "unused"
        self.outcome, self.snapshot, self.data_shape = "starting", None, None
        self.spec = default_spec((3, 16), 4, "small")
        torch.manual_seed(0)
        model = build_model(self.spec)
        rng = np.random.default_rng(0)
        data = SimpleNamespace(class_names=list("abcd"), val_x=rng.normal(size=(40, 3, 16)).astype(np.float32),
                               val_y=rng.integers(0, 4, 40))
        self.ctx = SimpleNamespace(data=data, transport=SimpleNamespace(), security=None, counters=lambda: {})
        self.node = SimpleNamespace(algorithm=SimpleNamespace(deployable_model=lambda: copy.deepcopy(model),
                                                              name="fedavg"),
                                    history=[{"round": 1}], status=lambda: {"round": 1}, ctx=self.ctx,
                                    last_round=lambda: 1)
        self.progress = RunProgress("n", "f", {"round": 1})  # what the supervisor knows of it

    async def run(self, stop):
        from dfl_agent.fsutil import atomic_write
        from dfl_agent.runtime.run.deployment import deploy_after_run

        done = self.run_dir / "trained.marker"
        if not done.exists():  # the rounds (the checkpoint says all are done after a restart)
            DeployingAgent.trainings += 1
            atomic_write(done, "1")
        self.outcome = "finished"
        self.on_state("trained")
        self.on_state("deploying")
        res = await deploy_after_run(self, self.spec, (3, 16))
        self.on_state("deployed" if res["deployed"] else "kept")
        if res["deployed"]:  # the supervisor's part once the ledger recorded it: switch current
            switch_current(self.cfg, None, self.run_desc.run_id, res["version"])
        return 0


@pytest.fixture
def crash_at(monkeypatch):
    """``crash_at("deploying:mid")``: the crash switch raises :class:`Crash` at that point."""
    import dfl_agent.deploy.versions as versions
    import dfl_agent.runtime.service.run_manager as rm

    target = {"at": None}

    def point(state, when):
        if target["at"] == f"{state}:{when}":
            raise Crash(target["at"])

    monkeypatch.setattr(rm, "crash_point", point)
    monkeypatch.setattr(versions, "crash_point", point)
    DeployingAgent.trainings = 0
    return lambda at: target.update(at=at)


def _manager(tmp_path, keep=False):
    m = manager(tmp_path, agent=DeployingAgent, deploy={"tolerance": 0.0, "onnx": False})
    m.lobby = MembersLobby()
    m.has_default = False
    if keep:  # the gate keeps the deployed model: too few validation samples (40) to replace it
        m.cfg.deploy.min_validation = 100
    return m


async def _serve_until_done(m, run_id):
    """The serve loop until ``run_id`` is recorded as ended here."""
    stop = asyncio.Event()

    async def watch():
        while not m.ledger.is_done(run_id):
            await asyncio.sleep(0.02)
        stop.set()

    watcher = asyncio.ensure_future(watch())
    await asyncio.wait_for(m.serve(stop), 60)
    await watcher


def _crash_then_restart(tmp_path, crash_at, at, d, keep=False):
    """Serve ``d`` with a crash at ``at`` (asserted to happen), then a fresh manager."""
    crash_at(at)
    m = _manager(tmp_path, keep)
    m.lobby.queue.offer(d)
    with pytest.raises(Crash):
        asyncio.run(_serve_until_done(m, d.run_id))
    crash_at(None)
    m = _manager(tmp_path, keep)  # the restart: the same state folder, a new process
    m.lobby.queue.offer(d)
    asyncio.run(_serve_until_done(m, d.run_id))
    return m


LIFE = [f"{s}:{w}" for s in ("admitted", "waiting_for_members", "training", "trained", "deploying", "deployed",
                             "recorded") for w in ("before", "after")] + ["deploying:mid"]


@pytest.mark.parametrize("at", LIFE)
def test_a_crash_anywhere_in_a_run_deploys_its_model_exactly_once(tmp_path, crash_at, at):
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=1, min_members=2)
    m = _crash_then_restart(tmp_path, crash_at, at, d)
    models = ModelStore(tmp_path)
    assert models.versions() == [1] and models.current_version() == 1
    assert models.manifest(1)["run_id"] == "r1"
    assert not [p for p in models.root.iterdir() if p.name.startswith(".tmp-")]
    assert m.ledger.state("r1") == "finished" and m.ledger.entries["r1"]["round"] == 1
    assert DeployingAgent.trainings == 1
    assert m.state == "idle"


@pytest.mark.parametrize("at", ["kept:before", "kept:after", "deploying:after", "recorded:before"])
def test_a_crash_around_a_kept_model_keeps_it_exactly_once(tmp_path, crash_at, at):
    models = ModelStore(tmp_path)
    models.install({"model.safetensors": b"0", "spec.json": b"{}"}, {"run_id": "r0", "round": 1})
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=1)
    m = _crash_then_restart(tmp_path, crash_at, at, d, keep=True)
    assert models.versions() == [1] and models.current_version() == 1  # still the earlier run's model
    assert models.show()["candidate"]["run_id"] == "r1"
    assert m.ledger.state("r1") == "finished" and DeployingAgent.trainings == 1


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_crash_as_a_run_is_declined_or_cancelled_leaves_it_so(tmp_path, crash_at, when):
    d = RunDescriptor(run_id="r2", federation="f", algorithm="dechw", rounds=1)  # the profile refuses it
    m = _crash_then_restart(tmp_path, crash_at, f"declined:{when}", d)
    assert m.ledger.state("r2") == "declined" and "dechw not allowed" in m.ledger.entries["r2"]["reason"]
    d = RunDescriptor(run_id="r3", federation="f", algorithm="fedavg", rounds=1, cancelled=True)
    m = _crash_then_restart(tmp_path, crash_at, f"cancelled:{when}", d)
    assert m.ledger.state("r3") == "cancelled" and m.ledger.state("r2") == "declined"
    assert DeployingAgent.trainings == 0 and ModelStore(tmp_path).versions() == []


def test_every_state_is_in_the_ledger_before_it_takes_effect(tmp_path, monkeypatch):
    """At each crash point "before", the manager is still in the previous state; "after", the
    ledger already holds the new one while the manager has not moved yet."""
    import dfl_agent.runtime.service.run_manager as rm

    seen = []
    m = _manager(tmp_path)

    def point(state, when):
        seen.append((state, when, m.state, m.ledger.state("r1")))

    monkeypatch.setattr(rm, "crash_point", point)
    m.lobby.queue.offer(RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=1, min_members=2))
    asyncio.run(_serve_until_done(m, "r1"))
    order = ["admitted", "waiting_for_members", "training", "trained", "deploying", "deployed", "recorded"]
    assert [s for s, w, _, _ in seen if w == "after"] == order
    prev, prev_ledger = "idle", None
    for state in order:
        b = next(x for x in seen if x[:2] == (state, "before"))
        a = next(x for x in seen if x[:2] == (state, "after"))
        assert b[2] == prev and b[3] == prev_ledger
        assert a[2] == prev and a[3] == rm.LEDGER_NAME.get(state, state)
        prev, prev_ledger = state, a[3]
    assert (tmp_path / "runs" / "r1" / "descriptor.json").is_file()


def test_run_outcome_finds_what_a_killed_deployment_left(tmp_path):
    """A kill between moving a version into place and switching ``current``: the version
    of the run is found and made current; a staged candidate counts as kept."""
    from dfl_agent.fsutil import atomic_symlink

    models = ModelStore(tmp_path)
    files = {"model.safetensors": b"0", "spec.json": b"{}"}
    assert models.run_outcome("r1") is None
    models.install(files, {"run_id": "r0", "round": 1})
    models.install(files, {"run_id": "r1", "round": 1})
    atomic_symlink("v1", models.root / "current")  # as if killed before the switch
    assert models.run_outcome("r1") == {"deployed": True, "version": 2} and models.current_version() == 2
    models.stage_candidate(files, {"run_id": "r2", "round": 1})
    assert models.run_outcome("r2") == {"deployed": False, "version": None}


def test_a_cancel_that_came_while_down_stops_an_unfinished_run_not_a_trained_one(tmp_path, crash_at):
    """A cancel retained while the device was down: a run recorded ``training`` is recorded
    cancelled; one recorded ``trained`` completes its deployment."""
    m = _manager(tmp_path)
    m.ledger.set("r8", "training")  # killed in training, cancelled meanwhile
    m.lobby.queue.offer(RunDescriptor(run_id="r8", federation="f", algorithm="fedavg", rounds=1, cancelled=True))
    assert m.next_run() is None and m.ledger.state("r8") == "cancelled"
    crash_at("trained:after")
    m = _manager(tmp_path)
    m.lobby.queue.offer(RunDescriptor(run_id="r7", federation="f", algorithm="fedavg", rounds=1))
    with pytest.raises(Crash):
        asyncio.run(_serve_until_done(m, "r7"))
    crash_at(None)
    m = _manager(tmp_path)
    m.lobby.queue.offer(RunDescriptor(run_id="r7", federation="f", algorithm="fedavg", rounds=1, cancelled=True))
    asyncio.run(_serve_until_done(m, "r7"))
    assert m.ledger.state("r7") == "finished" and ModelStore(tmp_path).manifest(1)["run_id"] == "r7"
