"""The run manager: how a run lives on this node, as a state machine.

The always-on agent (``dfl-agent run`` without ``--once``) trains in runs, one at a
time, in queue order (:mod:`dfl_agent.runtime.service.lobby`).  :class:`RunManager` takes each
run through these states, one method per transition::

    idle                 --admit-->            admitted | declined
    idle                 --cancel_unstarted--> cancelled   (cancelled before it ran here)
    idle                 --resume-->           trained | deploying | deployed | kept   (after a restart)
    admitted             --wait_for_members--> waiting_for_members --> training | declined | cancelled | failed
    admitted             --train-->            training    (min_members 1)
    training             --on_agent_state-->   trained --> deploying --> deployed | kept
    training             --on_agent_state-->   adopted | kept   (it missed the run's end: a member's model)
    trained | deployed | kept | adopted --finish--> recorded
    training             --cancelled | fail--> cancelled | failed
    training             --missed-->           missed      (it missed the run's end; no member had its model)
    recorded | declined | cancelled | failed | missed --idle--> idle

A node whose run ended on most of its members while it was away (a power cut) takes the run's
model from a member that deployed it (:mod:`dfl_agent.runtime.run.adoption`): ``adopted``; its
ledger entry's ``model`` says how the run's model ended here (``deployed``, ``adopted`` with
``adopted_from``, ``adopted_version`` and ``adopted_sha256``, ``kept`` with ``model_note``), and
``version`` the version installed.  Where no member can provide it, the run ends ``missed`` with
each member's answer as its reason.

An operator's cancel stops a run here until its last round is done; one that arrives after
(``trained``, ``deploying``: the model is being deployed) is refused here: the model is deployed
and the run recorded ``finished`` with the refusal as its reason (``CANCEL_LATE``), so the
ledger, the status and ``dflctl run show`` say the same.

Each state is written to the run ledger (:class:`~dfl_agent.runtime.service.ledger.RunLedger`) before it
takes effect (``recorded`` as ``finished``): a run that ended here is never rerun, and a restart
resumes a run from the state recorded (:meth:`RunManager.resume`; a model is deployed or kept
exactly once).  ``DFL_TEST_CRASH_AT`` (:func:`~dfl_agent.fsutil.crash_point`) kills the process at a
state for the crash tests.  The lobby, hooks, sample store and agent factory are injected.  The
always-on agent's factory makes a :class:`~dfl_agent.runtime.service.supervisor.ChildRun` (each run in a run
process, retried after a crash or kill, :meth:`RunManager._retry`); tests may hand in the in-process
agent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import atomic_write, crash_point
from dfl_agent.profiles import resolve_profile
from dfl_agent.runtime.service.admission import admit
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.lobby import RunLobby
from dfl_agent.runtime.service.privacy_budget import PrivacyBudget
from dfl_agent.runtime.service.retention import (
    low_space,
    prune_runs,
    remove_stale_candidate,
    settle_run,
)
from dfl_agent.runtime.service.run_loop import AFTER_TRAINING, RunLoop
from dfl_agent.runtime.service.service_counters import ServiceCounters
from dfl_agent.runtime.service.state_files import open_checked, store_damaged
from dfl_agent.runtime.service.systemd import Notifier
from dfl_agent.runtime.shared.assembly import StartupError, build_security
from dfl_agent.runtime.shared.config import NodeConfig
from dfl_agent.runtime.shared.degraded import degraded_fields
from dfl_agent.runtime.shared.descriptor import TERMINAL, RunDescriptor, RunVerifier
from dfl_agent.runtime.shared.run_config import (
    CANCEL_LATE,
    RunHooks,
    _CancelWatch,
    _forward_stop,
    node_id_from_state,
    run_config_for,
)
from dfl_agent.runtime.shared.sample_store import open_store, seed_store
from dfl_agent.runtime.shared.state_version import open_state as migrate_state

log = logging.getLogger("dfl_agent.daemon")

#: the run manager's states (see the module docstring): state -> the states it may move to
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "idle": ("idle", "admitted", "declined", "cancelled", "trained", "deploying", "deployed", "kept", "adopted"),
    "admitted": ("waiting_for_members", "training", "idle"),
    "waiting_for_members": ("training", "declined", "cancelled", "failed", "idle"),
    "training": ("trained", "adopted", "kept", "missed", "cancelled", "failed", "idle"),
    "trained": ("deploying", "recorded", "failed", "cancelled", "idle"),
    "deploying": ("deployed", "kept", "recorded", "failed", "idle"),
    "deployed": ("recorded", "failed"),
    "kept": ("recorded", "failed"),
    "adopted": ("recorded", "failed"),
    "missed": ("idle",),
    "recorded": ("idle",),
    "declined": ("idle",),
    "cancelled": ("idle",),
    "failed": ("idle",),
}
#: the runs an idle status's ``run_history`` shows (the ledger's newest)
HISTORY = 20
#: the reason recorded for a run cancelled by the operator
CANCELLED = "cancelled by the operator"
#: the ledger's name of a state where it differs (``finished``: the ledger's terminal name)
LEDGER_NAME = {"recorded": "finished"}

class IllegalTransition(RuntimeError):
    """A transition the run manager's state machine does not have (a programming error)."""


class RunManager(RunLoop):
    """One node's runs, one at a time, as a state machine (see the module docstring).

    Args:
        cfg: the node's configuration (``node.toml``); a run's configuration is
            :func:`run_config_for` of it and the run's descriptor.
        config_path: the file it came from (passed to the training agent).
        node_id: this node.
        profile: this device's profile (admission, membership by profile).
        ledger: the run ledger.
        lobby: the :class:`~dfl_agent.runtime.service.lobby.RunLobby` (queue, peers' statuses,
            this node's idle status).
        agent_factory: ``(cfg, config_path, *, run, run_dir, wanted_peers, members, on_state,
            attempt, service_status, notifier, stopping) -> agent`` whose ``await agent.run(stop)``
            trains the run and returns an exit code (the daemon's ``Agent``).
        notifier: the systemd notifier (READY, STATUS, WATCHDOG while idle).
        hooks: callbacks around runs (``on_run_finished``).
        store: the sample store ingested between runs (None without one).
    """

    def __init__(self, cfg: NodeConfig, config_path: str | None, *, node_id: str, profile: Any, ledger: RunLedger,
                 lobby: Any, agent_factory: Callable[..., Any], notifier: Any, hooks: RunHooks | None = None,
                 store: Any = None, once: bool = False):
        self.cfg, self.config_path, self.node_id, self.profile = cfg, config_path, node_id, profile
        self.ledger, self.lobby, self.agent_factory, self.notifier = ledger, lobby, agent_factory, notifier
        self.hooks = hooks if hooks is not None else RunHooks()
        self.store = store
        #: ``dfl-agent run --once``: one run (:meth:`run_once`), whose files stay in the state directory
        self.once = once
        #: the exit code of the last run process (0, 1, 2, 3), for :meth:`run_once`
        self.last_rc = 0
        #: ``--once``: the metrics file its run appends to, and its size before the run (the privacy
        #: ledger settles the run from the round records after it)
        self.once_metrics: tuple[Path, int] | None = None
        self.state = "idle"
        #: the run shown in the status: ``{id, state, round, reason}`` of the current or last run
        self.info: dict[str, Any] | None = None
        #: the agent of the run in training (None while idle): the Prometheus endpoint shows it
        self.agent: Any = None
        self.has_default = getattr(cfg, "has_default_run", True)
        self.interval = notifier.watchdog_interval()
        self.last_pub = 0.0
        # (input shape, classes) for the accept-time memory check: [data]'s, else the first run's
        self.data_shape: tuple[Any, int | None] = (cfg.data.input_shape, cfg.data.num_classes) \
            if cfg.data.input_shape and cfg.data.num_classes else (None, None)
        self.next_spool = 0.0
        self.waiting_for_data = False
        #: refusal and drop counters over restarts: every status (idle, training) and Prometheus
        self.counters = ServiceCounters(cfg.state_dir, lobby, lambda: self.agent.progress if self.agent is not None else None)
        lobby.counters = self.counters
        # in every status, idle and training: whether this node takes only operator-signed runs
        # (dflctl refuses to submit unsigned then), and the runs queued here (a submission's answer)
        self.counters.fields["signatures_required"] = lambda: bool(getattr(lobby.verifier, "require_signatures",
                                                                           False))
        self.counters.fields["runs_queued"] = lambda: lobby.queued(self.ledger.is_done)
        # the revocation list held, the nodes it revokes, this node's certificate's expiry
        for name in ("revocation_list", "revoked", "certificate_expires") if getattr(lobby, "guard", None) else ():
            self.counters.fields[name] = functools.partial(lambda n: lobby.security_status().get(n), name)
        self.privacy = PrivacyBudget(cfg, profile, store, self.counters)  # admission against the privacy budget

    # -- the state machine ------------------------------------------------------------
    def _to(self, state: str, run_id: str | None = None, reason: str = "", rnd: int = 0,
            extra: dict[str, Any] | None = None) -> None:
        """Move to ``state``; with ``run_id`` the ledger records it first (with ``reason``,
        ``rnd``, ``extra``): a kill right after finds it there.

        Raises:
            IllegalTransition: the state machine has no such transition.
        """
        if state not in TRANSITIONS.get(self.state, ()):
            raise IllegalTransition(f"run manager: {self.state} -> {state}")
        if run_id is not None:
            crash_point(state, "before")
            self._record(run_id, LEDGER_NAME.get(state, state), reason, rnd, extra)
            crash_point(state, "after")
        log.debug("run manager: %s -> %s", self.state, state)
        self.state = state

    def _record(self, run_id: str, state: str, reason: str = "", rnd: int = 0,
                extra: dict[str, Any] | None = None) -> None:
        """Write ``run_id``'s ledger entry (earlier fields but state, round, reason, time kept)."""
        before = self.ledger.entries.get(run_id) or {}
        kept = {k: v for k, v in before.items() if k not in ("state", "round", "reason", "time")}
        metrics, offset = self.once_metrics or (None, 0)  # --once: its records in the node's metrics file
        extra = {**dict(extra or {}), **self.privacy.on_state(run_id, state, self.ledger.run_dir(run_id),
                                                              metrics=metrics, offset=offset)}
        self.ledger.set(run_id, state, rnd, reason, {**kept, **extra})
        if state in ("declined", "failed"):
            log.warning("run %s %s: %s", run_id, state, reason)
        if state in TERMINAL:
            self._after_ended(run_id)

    def _after_ended(self, run_id: str) -> None:
        """Once the ledger records ``run_id`` ended: settle its folder, keep the newest
        ``runtime.keep_runs`` runs' folders, remove a stale candidate, warn on low disk space
        (:mod:`~dfl_agent.runtime.service.retention`; a failure is logged, the run stays recorded)."""
        rt = self.cfg.runtime
        try:
            settle_run(self.ledger.run_dir(run_id), self.ledger.entry(run_id) or {}, rt.keep_run_files)
            prune_runs(self.ledger, rt.keep_runs)
            remove_stale_candidate(self.cfg.state_dir)
            if (line := low_space(self.cfg.state_dir, rt.disk_warn_mb)) is not None:
                log.warning("%s", line)
        except OSError as exc:
            log.warning("run %s: could not remove the files of ended runs: %s", run_id, exc)

    def idle(self) -> None:
        """Back to ``idle`` after a run ended (or was interrupted)."""
        self._to("idle")

    def decline(self, run_id: str, reason: str) -> None:
        """``idle -> declined``: this node does not take part (recorded)."""
        self._to("declined", run_id, reason)
        self.info = {"id": run_id, "state": "declined", "round": 0, "reason": reason}

    def cancel_unstarted(self, run_id: str) -> None:
        """``idle -> cancelled``: a run cancelled before it ran here (recorded)."""
        self._to("cancelled", run_id, CANCELLED)
        self._to("idle")

    def expire_unstarted(self, run_id: str) -> None:
        """``idle -> declined``: a queued run whose ``not_after`` passed before it started
        here (recorded, and counted as a refusal ``expired``)."""
        refused = self.lobby.verifier.refused
        refused["expired"] = refused.get("expired", 0) + 1
        self.decline(run_id, "expired: its not_after passed before it started here")
        self._to("idle")

    def end_interrupted(self, run_id: str, reason: str) -> None:
        """Record ``failed`` (with ``reason``) a run a restart will not resume (an earlier repeat
        of the recurring default run); the manager's own state is untouched.  Its privacy
        reservation is settled as for any failed run, and its folder settled like every ended run's."""
        e = self.ledger.entry(run_id) or {}
        self._record(run_id, "failed", reason, int(e.get("round") or 0))

    def admit(self, d: RunDescriptor) -> bool:
        """``idle -> admitted`` when the run fits this device (:func:`~dfl_agent.runtime.service.admission.admit`),
        else ``idle -> declined``.  Publishes the decision."""
        reason = admit(d, self.profile, node_id=self.node_id, input_shape=self.data_shape[0], num_classes=
                       self.data_shape[1], node_model=dataclasses.asdict(self.cfg.model)) or self.privacy.admit(d)
        if reason:
            self.decline(d.run_id, reason)
            self.publish(force=True)
            return False
        run_dir = self.ledger.run_dir(d.run_id)  # the descriptor a restart resumes the run with
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "descriptor.json", json.dumps(d.to_dict(), sort_keys=True))
        self._to("admitted", d.run_id)
        self.info = {"id": d.run_id, "state": "accepted", "round": 0, "reason": ""}
        self.publish("accepted", force=True)
        return True

    async def wait_for_members(self, d: RunDescriptor, stop: asyncio.Event) -> bool | None:
        """``admitted -> waiting_for_members`` until ``min_members`` devices accepted the run
        (this one included); then True, or ``cancelled``/``failed`` (recorded) and False,
        or None when ``stop`` was set (back to ``idle``; a restart waits again).  A node that
        never trained the run and finds it ended on other members, or past their first round
        (a late joiner), declines it: it takes part from the next run on.  For a node that trained
        rounds of it (a power cut), members that ended it count: it ends the run as they did."""
        self._to("waiting_for_members", d.run_id)
        lobby, nid = self.lobby, self.node_id
        deadline = time.time() + d.start_timeout
        late = not (self.ledger.run_dir(d.run_id) / "metrics.jsonl").exists()  # no round of it here
        def members() -> int:
            return len(lobby.accepted_by(d.run_id) | (set() if late else lobby.finished_by(d.run_id)) | {nid})
        while members() < d.min_members and not stop.is_set():
            if self.is_cancelled(d.run_id) or time.time() > deadline or (late and lobby.late_for(d.run_id)):
                break
            self.publish("accepted")
            await asyncio.sleep(0.3)
        n, why_late = members(), lobby.late_for(d.run_id) if late else ""
        if stop.is_set():
            self._to("idle")
            return None
        if n >= d.min_members and not why_late:
            return True
        if why_late:
            self.decline(d.run_id, f"late: {why_late} before this node joined")
        elif self.is_cancelled(d.run_id):
            self.info = self._ended_as(d.run_id, "cancelled", CANCELLED)
        else:
            self.info = self._ended_as(d.run_id, "failed", f"start_timeout: only {n} of min_members "
                                                           f"{d.min_members} accepted within {d.start_timeout:.0f}s")
        self.publish(force=True)
        self._to("idle")
        return False

    def _ended_as(self, run_id: str, state: str, reason: str, rnd: int = 0,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """``-> state`` (``failed``, ``cancelled``; recorded with ``extra``); returns the status view."""
        self._to(state, run_id, reason, rnd, extra)
        return {"id": run_id, "state": state, "round": rnd, "reason": reason}

    def on_agent_state(self, state: str, **_info: Any) -> None:
        """The training agent's say after its rounds: ``trained``, ``deploying``,
        ``deployed`` or ``kept`` (the deployment gate kept the current model), or ``adopted``
        (it missed the run's end and installed a member's model, ``_info["source"]``).  A run
        resumed after its training hears again what it recorded (nothing to do).  ``deployed``,
        ``adopted`` and ``kept`` record how the run's model ended here (:func:`model_fields`)."""
        if state == self.state or (state == "trained" and self.state == "deploying"):
            return
        rnd, agent = 0, self.agent
        extra: dict[str, Any] | None = _peak(agent) or None  # the run process's memory so far
        if agent is not None and state == "trained":  # kept in the ledger: a resumed run records it
            st = dict(agent.progress.status) if agent.progress is not None else {}
            rnd, snap = st.get("round", 0), agent.snapshot
            extra = {"snapshot_last_id": int(snap.max())} if snap is not None and len(snap) else {}
            extra.update(_peak(agent))
            extra.update(degraded_fields(st))  # trained alone: degraded, with its count
            if isinstance(start := _info.get("start"), dict):  # the warm start: kept in the run's entry
                extra = {**(extra or {}), "init": start.get("init"), "started_from": start.get("started_from"),
                         "init_reason": start.get("reason", "")}
        if state in ("deployed", "adopted", "kept"):
            extra = {**(extra or {}), **model_fields(state, _info)}
        self._to(state, self.info["id"] if self.info else None, rnd=rnd, extra=extra)

    def finish(self, d: RunDescriptor, agent: Any, extra: dict[str, Any] | None, reason: str = "") -> None:
        """``trained | deployed | kept | deploying -> recorded``: the run finished here
        (recorded with its snapshot's newest sample id, and ``reason``: :data:`CANCEL_LATE` when
        the operator's cancel came after its last round), then the finish hooks (``node``
        None when the run resumed after its model was deployed)."""
        if self.state == "training":  # an agent that does not report its states
            self._to("trained", d.run_id, rnd=d.rounds, extra=extra)
        self._to("recorded", d.run_id, reason, d.rounds, extra)
        self.info = {"id": d.run_id, "state": "finished", "round": d.rounds, "reason": reason}
        log.info("run %s finished", d.run_id)
        self.hooks.fire_finished(d, agent.progress if agent is not None else None)

    def fail(self, run_id: str, reason: str, rnd: int = 0, extra: dict[str, Any] | None = None) -> None:
        """``-> failed`` (recorded, with ``extra``)."""
        self.info = self._ended_as(run_id, "failed", reason, rnd, extra)

    def cancelled(self, run_id: str, at: int, extra: dict[str, Any] | None = None) -> None:
        """``training -> cancelled`` (recorded with the round the cancel arrived after, and ``extra``)."""
        self.info = self._ended_as(run_id, "cancelled", CANCELLED, at, extra)

    # -- status -------------------------------------------------------------------------
    def publish(self, state: str = "idle", force: bool = False) -> None:
        """This node's status through the lobby (at most once per heartbeat interval unless
        ``force``), the systemd STATUS line, and a WATCHDOG ping."""
        if self.once and state == "idle":  # --once: the run's last status stays its node's ("finished")
            return
        if force or time.monotonic() - self.last_pub >= min(self.cfg.mqtt.heartbeat_interval, self.interval or 1e9):
            self.lobby.publish_status(self.info, state, self.ledger.recent(HISTORY))
            info = self.info
            line = "idle" if info is None or state == "idle" else f"run {info['id']}: {info['state']}"
            self.notifier.ready(line) if self.last_pub == 0.0 else self.notifier.status(line)
            if self.interval:
                self.notifier.watchdog()
            self.last_pub = time.monotonic()

    def service_status(self) -> dict[str, Any]:
        """The agent's own figures for the Prometheus endpoint while no run trains."""
        return {"state": "idle" if self.agent is None else "training", "run": self.info,
                **self.counters.view()}

    def is_cancelled(self, run_id: str) -> bool:
        """Whether the newest known descriptor of ``run_id`` is a cancel."""
        cur = self.lobby.run(run_id)
        return cur is not None and cur.cancelled

    async def train(self, d: RunDescriptor, stop: asyncio.Event, resume: str | None = None) -> bool:
        """``-> training`` (or ``resume``: ``trained``/``deploying`` after a restart): train
        run ``d`` with a new agent (a run process) until it ends, then record how it ended.  A
        run process that crashed or was killed is retried from the run's last checkpoint
        (:meth:`_retry`).  Returns False when ``stop`` interrupted it (the serve loop ends).

        Raises:
            StartupError: the default run cannot start.
        """
        self._to(resume or "training", d.run_id)
        try:  # a published run's settings that the configuration rules refuse fail that run only
            run_cfg = self.cfg if self.once else run_config_for(self.cfg, d)
        except StartupError as exc:
            return self._cannot_start(d, exc)
        run_stop = asyncio.Event()
        watcher = asyncio.ensure_future(_forward_stop(stop, run_stop))
        ingest: asyncio.Future[None] | None = None
        attempt = 1
        try:
            while True:
                agent, watch = self._new_agent(d, run_cfg, run_stop, stop, attempt)
                if getattr(agent, "supervised", False) and ingest is None and self.store is not None:
                    ingest = asyncio.ensure_future(self._ingest_loop())  # the store's only writer
                try:
                    rc = await agent.run(run_stop)
                except StartupError as exc:
                    return self._cannot_start(d, exc)
                except Exception as exc:  # the algorithm crashed: the run fails here, the agent stays up
                    log.exception("run %s crashed", d.run_id)
                    self.fail(d.run_id, f"{type(exc).__name__}: {exc}")
                    self.idle()
                    return True
                finally:
                    node, self.agent = agent.progress, None
                    self.counters.run_ended(node)
                    self.lobby.on_cancel = None
                if getattr(agent, "crash", None) is None or run_stop.is_set() or self.is_cancelled(d.run_id):
                    break
                if not self._retry(d, agent, attempt):
                    self.fail(d.run_id, f"run process {agent.error} (attempt {attempt}; no retries left)",
                              agent.progress.last_round() if agent.progress is not None else 0, _peak(agent) or None)
                    self.idle()
                    self.publish(force=True)
                    return True
                attempt += 1
        finally:
            for task in (watcher, ingest):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (watcher, ingest) if t is not None), return_exceptions=True)
        return await self._ended(d, agent, rc, watch, stop)

    def _cannot_start(self, d: RunDescriptor, exc: StartupError) -> bool:
        """Run ``d`` cannot start (its settings or data): a published run fails here (True: the
        agent goes on); the default run's error propagates (bad configuration: exit code 2)."""
        if d.default:
            raise exc
        self.fail(d.run_id, str(exc))
        self.idle()
        return True

    def _new_agent(self, d: RunDescriptor, run_cfg: NodeConfig, run_stop: asyncio.Event, stop: asyncio.Event,
                   attempt: int) -> tuple[Any, _CancelWatch]:
        """The agent of run ``d``'s ``attempt`` (the factory's), watched for a cancel; ``stop``: the
        service's own stop (a run process's last presence then says "stopping", not "run ended")."""
        run_dir = self.ledger.run_dir(d.run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        members = self.lobby.accepted_by(d.run_id)  # the admitted members so far; for a node that trained
        if (run_dir / "metrics.jsonl").exists():  # in it before (a power cut), those that ended it too
            members |= self.lobby.finished_by(d.run_id)
        agent = self.agent_factory(
            run_cfg, self.config_path, run=d, run_dir=run_dir, wanted_peers=lambda: self.lobby.may_join(d.run_id),
            members=members - {self.node_id},
            on_state=self.on_agent_state, attempt=attempt, service_status=self.counters.view,
            notifier=self.notifier, stopping=stop.is_set, **({"once": True} if self.once else {}))
        watch = _CancelWatch(d.run_id, agent, run_stop, asyncio.get_running_loop(),
                             ended=lambda: self.state in AFTER_TRAINING or agent.outcome == "finished")
        self.lobby.on_cancel = watch
        if self.is_cancelled(d.run_id):  # cancelled between the queue pick and here
            watch(d.run_id)
        self.agent = agent
        return agent, watch

    def _retry(self, d: RunDescriptor, agent: Any, attempt: int) -> bool:
        """After run process ``attempt`` of ``d`` crashed or was killed (``agent.crash``):
        whether to retry (``runtime.run_retries`` times; an OOM kill once, with the same
        limit).  A retry is recorded as a transition back to ``training`` (or to the state
        after training the ledger holds) with its attempt number."""
        allowed = self.cfg.runtime.run_retries
        if agent.crash == "oom":
            allowed = min(1, allowed)
        if attempt > allowed:
            return False
        state = str(self.ledger.state(d.run_id))
        again = state if state in ("trained", "deploying") else "training"
        rnd = agent.progress.last_round() if agent.progress is not None else 0
        log.warning("run %s: retry %d of %d from its last checkpoint (the run process %s)", d.run_id, attempt,
                    allowed, agent.error)
        crash_point(again, "before")
        self._record(d.run_id, again, f"retry {attempt} of {allowed}: {agent.error}", rnd, {"attempt": attempt + 1})
        self.state = again
        self.info = {"id": d.run_id, "state": "training", "round": rnd, "reason": f"retry {attempt}"}
        return True

    async def _ended(self, d: RunDescriptor, agent: Any, rc: int, watch: _CancelWatch,
                     stop: asyncio.Event) -> bool:
        """Record how the run that ``agent`` trained ended (``rc``: its exit code; ``watch``:
        its cancel hook, which knows the round a cancel came after, or that it came too late)."""
        self.last_rc = rc
        cancel_round = watch.rounds
        cancelled = d.run_id in cancel_round or (agent.outcome != "finished" and self.is_cancelled(d.run_id))
        if agent.data_shape is not None:
            self.data_shape = agent.data_shape
        rnd = agent.progress.status.get("round", 0) if agent.progress is not None else 0
        snap = agent.snapshot  # a run on the sample store: the newest sample id of its data
        snapshot = {"snapshot_last_id": int(snap.max())} if snap is not None and len(snap) else {}
        extra = {**snapshot, **_peak(agent)} or None  # with the run process's peak memory over its life
        if agent.outcome == "missed":  # it ended on the members while this node was away, no model to take
            self.info = self._ended_as(d.run_id, "missed", getattr(agent, "reason", "") or "missed", rnd, extra)
        elif agent.outcome == "finished":  # a cancel that came after the last round is refused here
            late = d.run_id in watch.late or self.is_cancelled(d.run_id)
            self.finish(d, agent, extra, CANCEL_LATE if late else "")
        elif cancelled:
            at = cancel_round.get(d.run_id, rnd)
            log.info("run %s cancelled by the operator: the cancel arrived after round %d, the last round "
                     "trained here is %d", d.run_id, at, rnd)
            self.cancelled(d.run_id, at, extra)
        elif stop.is_set():
            self.idle()
            return False  # interrupted: a restart rejoins it
        elif rc == 3:  # broker unreachable: try again shortly (--once: exit code 3)
            self.idle()
            if not self.once:
                await asyncio.sleep(5.0)
        else:
            self.fail(d.run_id, f"exit code {rc}", rnd, extra)
        if self.state != "idle":
            self.idle()
        self.publish(force=True)
        return True


def model_fields(state: str, info: dict[str, Any]) -> dict[str, Any]:
    """The ledger entry's fields that say how a run's model ended on this node, for the run
    process's ``state`` (``deployed``, ``adopted`` or ``kept``) and its report's ``info``
    (``version``, ``source``: the member's version a model came from, ``reason``): ``model``,
    ``version``, ``adopted_from``, ``adopted_version``, ``adopted_sha256``, ``model_note``."""
    out: dict[str, Any] = {"model": state}
    if isinstance(v := info.get("version"), int) and not isinstance(v, bool):
        out["version"] = v
    src = info.get("source")
    if isinstance(src, dict) and src.get("node"):
        out.update(adopted_from=str(src["node"]), adopted_version=src.get("version"), adopted_sha256=src.get("sha256"))
    if isinstance(note := info.get("reason"), str) and note:
        out["model_note"] = note[:500]
    return out


def _peak(agent: Any) -> dict[str, Any]:
    """``{"peak_rss_mb": MiB}``: the run process's peak resident memory as it reported it (the
    run's ledger entry keeps the last one), or ``{}`` (none reported, or an in-process agent)."""
    mb = getattr(agent, "peak_rss_mb", None)
    return {"peak_rss_mb": mb} if isinstance(mb, (int, float)) and not isinstance(mb, bool) else {}


def build_run_manager(cfg: NodeConfig, config_path: str | None, *, hooks: RunHooks | None = None,
                      agent_factory: Callable[..., Any] | None = None, once: bool = False) -> RunManager:
    """The always-on agent's run manager: this node's id (``state_dir/node_id``), its
    device profile, the run ledger, the node's security guard (it signs idle statuses
    and verifies peers' ones and run descriptors), the lobby (not connected yet), the
    sample store with ``data.dataset = "store"``, the systemd notifier, and ``hooks``.

    The state folder's schema is checked first, and an older one migrated
    (:func:`~dfl_agent.runtime.shared.state_version.open_state`; an earlier release's run ledger
    is taken over there); then :func:`~dfl_agent.runtime.service.state_files.open_checked` opens the run ledger and checks every state file.

    Raises:
        StateVersionError: the state folder was written by a newer release (a StartupError).
        StartupError: the state directory, the profile, the keys or the store are unusable.
    """
    state_dir = Path(cfg.state_dir)
    try:
        migrate_state(state_dir)  # first: the checks below read the folder in this release's schema
        state_dir.mkdir(parents=True, exist_ok=True)
        profile = resolve_profile(cfg.profile, cfg.profile_overrides)[0]
    except (OSError, ValueError, LookupError) as exc:
        raise StartupError(str(exc)) from None
    ledger = open_checked(cfg)
    nid = node_id_from_state(state_dir, cfg.node_id)
    guard = build_security(cfg, state_dir, nid)
    lobby = RunLobby(cfg, nid, RunVerifier(cfg.federation, require_signatures=cfg.security.require_signatures,
                                           guard=guard), guard=guard, ledger=ledger)  # ledger: cancels last
    store = None
    if cfg.data.dataset == "store":  # ingested between runs (a run ingests on its own)
        try:
            store = open_store(cfg)
            seed_store(store, cfg.data.path)  # data.path/train.npz, once in the store's life
        except (OSError, ValueError) as exc:
            raise StartupError(str(exc)) from None
        except sqlite3.DatabaseError as exc:  # the store's file is damaged
            raise StartupError(store_damaged(state_dir / "store" / "samples.sqlite",
                                             f"is not a readable SQLite database ({exc})")) from None
    if agent_factory is None:  # each run in a run process (runtime.supervisor)
        from dfl_agent.runtime.service.supervisor import ChildRun

        agent_factory = functools.partial(ChildRun, lobby=lobby, memory_mb=profile.compute.memory_budget_mb,
                                          stop_grace=cfg.runtime.run_stop_grace)
    return RunManager(cfg, config_path, node_id=nid, profile=profile, ledger=ledger, lobby=lobby,
                      agent_factory=agent_factory, notifier=Notifier(), hooks=hooks, store=store, once=once)
