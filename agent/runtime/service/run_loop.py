"""The run manager's loop (:class:`RunLoop`, a part of
:class:`~dfl_agent.runtime.service.run_manager.RunManager`): which run to take next, the idle pass
(status heartbeat, spool ingestion), resuming a run after a restart, ``--once``'s queue of one
run, and SIGHUP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.service.default_run import default_descriptor
from dfl_agent.runtime.shared.assembly import StartupError
from dfl_agent.runtime.shared.descriptor import RunDescriptor

if TYPE_CHECKING:
    from dfl_agent.runtime.service.ledger import RunLedger
    from dfl_agent.runtime.shared.config import NodeConfig

log = logging.getLogger("dfl_agent.daemon")

#: a run on the sample store starts once the store holds this many samples (until then it
#: waits in the queue while the spool is ingested)
MIN_STORE_SAMPLES = 20
#: states recorded after a run's training: a restart finishes the run from there
AFTER_TRAINING = ("trained", "deploying", "deployed", "kept", "adopted")
#: states recorded before a run's training ended (an operator's cancel still stops the run)
BEFORE_TRAINED = (None, "admitted", "waiting_for_members", "training")


class RunLoop:
    """The loop around the run manager's transitions (see the module docstring); the run
    manager sets the attributes and has the transitions used here."""

    cfg: NodeConfig
    config_path: str | None
    ledger: RunLedger
    lobby: Any
    store: Any
    profile: Any
    node_id: str
    notifier: Any
    agent: Any
    info: dict[str, Any] | None
    has_default: bool
    once_metrics: tuple[Path, int] | None
    last_rc: int
    next_spool: float
    waiting_for_data: bool

    if TYPE_CHECKING:  # the run manager's transitions
        def admit(self, d: RunDescriptor) -> bool: ...
        async def train(self, d: RunDescriptor, stop: asyncio.Event, resume: str | None = None) -> bool: ...
        async def wait_for_members(self, d: RunDescriptor, stop: asyncio.Event) -> bool | None: ...
        def cancel_unstarted(self, run_id: str) -> None: ...
        def expire_unstarted(self, run_id: str) -> None: ...
        def end_interrupted(self, run_id: str, reason: str) -> None: ...
        def decline(self, run_id: str, reason: str) -> None: ...
        def idle(self) -> None: ...
        def _to(self, state: str, run_id: str | None = None, reason: str = "", rnd: int = 0,
                extra: dict[str, Any] | None = None) -> None: ...
        def finish(self, d: RunDescriptor, agent: Any, extra: dict[str, Any] | None) -> None: ...
        def publish(self, state: str = "idle", force: bool = False) -> None: ...

    async def serve(self, stop: asyncio.Event) -> int:
        """Run the default run and the queued runs, one at a time, until ``stop`` is set.
        Returns 0.

        Raises:
            StartupError: the default run cannot start (bad configuration).
        """
        while not stop.is_set():
            d = self.next_run()
            if d is None:
                await self.idle_pass(stop)
                continue
            if self.ledger.state(d.run_id) in AFTER_TRAINING:  # a kill came after its training
                if not await self.resume(d, stop):
                    break
                continue
            if not self.admit(d):
                self.idle()
                continue
            if d.min_members > 1:
                ok = await self.wait_for_members(d, stop)
                if ok is None:
                    break
                if not ok:
                    continue
            if not await self.train(d, stop):
                break
        return 0

    async def run_once(self, stop: asyncio.Event) -> int:
        """``dfl-agent run --once``: the node's ``[algorithm]`` run as a queue of one, through the
        same transitions as every run (admission with the privacy budget, a run process, the
        ledger, the deployment), then return its exit code: 0 finished (or stopped by ``stop``),
        1 failed, 3 broker unreachable, 4 trained alone in most rounds
        (:func:`~dfl_agent.runtime.shared.degraded.once_exit_code`).

        Raises:
            StartupError: the run cannot start (bad configuration or data), or admission declined
                it (the privacy budget, the device profile): exit code 2.
        """
        from dfl_agent.runtime.shared.degraded import once_exit_code

        d = dataclasses.replace(default_descriptor(self.cfg) or RunDescriptor(
            run_id="once", federation=self.cfg.federation, algorithm=self.cfg.algorithm.name,
            rounds=self.cfg.algorithm.rounds, default=True), run_id=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        metrics = Path(self.cfg.runtime.metrics_file or Path(self.cfg.state_dir) / "metrics.jsonl")
        self.once_metrics = (metrics, metrics.stat().st_size if metrics.exists() else 0)
        if self.store is not None:  # the run's data: the spool's files, also those still settling
            await asyncio.to_thread(self._ingest_settled)
        if not self.admit(d):
            raise StartupError(f"run {d.run_id} declined: {self.ledger.entries[d.run_id].get('reason', '')}")
        if not await self.train(d, stop):
            return 0  # stopped
        entry = self.ledger.entries.get(d.run_id) or {}
        if entry.get("state") == "finished":
            return once_exit_code(entry, self.cfg.runtime.allow_alone)
        return 3 if self.last_rc == 3 else 1

    def _ingest_settled(self) -> None:
        """Ingest the spool, waiting (at most the store's settle time and a second) for files
        too young to be taken yet: a run started right after its data was dropped trains on it,
        and its admission counts it (the privacy budget's N)."""
        store = self.store
        waited = store.ingest_spool()
        until = time.monotonic() + float(getattr(store, "settle_seconds", 1.0)) + 1.0
        while waited.get("waiting") and time.monotonic() < until:
            time.sleep(0.2)
            waited = store.ingest_spool()

    def reload(self) -> None:
        """SIGHUP: check ``node.toml`` again (RELOADING, then READY for systemd); a bad file
        changes nothing (logged); else the run process of the run in training applies what can
        change while it trains (:func:`~dfl_agent.runtime.run.reload.reload_config`) and the
        service takes the new log level."""
        from dfl_agent.runtime.shared.config import ConfigError, load_config

        if not self.config_path:
            return
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload: configuration error, keeping the running one: %s", exc)
        else:
            if new.runtime.log_level != self.cfg.runtime.log_level:
                logging.getLogger().setLevel(getattr(logging, new.runtime.log_level.upper()))
                self.cfg.runtime.log_level = new.runtime.log_level
            if self.agent is not None:
                self.agent.reload()
            else:
                log.info("reload: a run reads node.toml when it starts")
        info = self.info
        self.notifier.ready("idle" if info is None else f"run {info['id']}: {info['state']}")

    def next_run(self) -> RunDescriptor | None:
        """The run to take next: the default run when due and not done, else the first
        runnable queued run (runs cancelled before they ran here are recorded).  None when
        there is none, this node is not a member (declined), or the sample store holds too
        few samples (the run waits)."""
        if (d := self._unfinished()) is not None:
            return d
        store, ledger, lobby = self.store, self.ledger, self.lobby
        if self.has_default:
            dd = default_descriptor(self.cfg, ledger=ledger, new_samples=store.count_since if store is not None else None)
            if dd is not None and self.cfg.algorithm.every:
                self._end_past_repeats(dd.run_id)
            if dd is not None and not ledger.is_done(dd.run_id):
                d = dd
        if d is None:
            with lobby.lock:
                for r in lobby.queue.ordered():  # cancelled, or past its not_after, before it ran here
                    if r.cancelled and ledger.state(r.run_id) in BEFORE_TRAINED:
                        self.cancel_unstarted(r.run_id)
                    elif not r.cancelled and r.expired(time.time()) and not ledger.started(r.run_id):
                        self.expire_unstarted(r.run_id)
                d = lobby.queue.next_runnable(ledger.is_done)
        if d is not None and not d.is_for(self.node_id, self.profile.name):
            self.decline(d.run_id, "not a member of this run")
            self.idle()
            d = None
        if d is not None and store is not None and store.count() < MIN_STORE_SAMPLES:
            if not self.waiting_for_data:  # the run waits in the queue until the application adds samples
                log.info("run %s waits: the sample store holds %d samples (needs %d); add .npz files to %s",
                         d.run_id, store.count(), MIN_STORE_SAMPLES, store.spool_dir)
            self.waiting_for_data = True
            d = None
        else:
            self.waiting_for_data = False
        return d

    def _end_past_repeats(self, current: str) -> None:
        """Record ``failed`` every earlier repeat of the recurring default run (``algorithm.every``)
        that a kill or power cut interrupted before its training ended and whose period is over:
        a missed period is not made up, so nothing would ever end it, and its entry and folder
        would stay for the device's life.  A repeat interrupted within its own period is
        ``current`` and runs again (resuming from its checkpoint)."""
        prefix = current.rsplit(".", 1)[0] + "."
        for rid in self.ledger.in_states(BEFORE_TRAINED[1:]):
            if rid != current and rid.startswith(prefix):
                self.end_interrupted(rid, "interrupted before its training ended (the service stopped or lost "
                                          "power), and its period is over: a missed period is not made up")

    def _unfinished(self) -> RunDescriptor | None:
        """A run killed after its training (:data:`AFTER_TRAINING`; its descriptor saved at
        admission), finished before any other; one whose descriptor is unreadable fails."""
        for rid, e in self.ledger.in_states(AFTER_TRAINING).items():
            try:
                raw = bounded_loads((self.ledger.run_dir(rid) / "descriptor.json").read_bytes(), "state")
                return RunDescriptor.from_dict({k: v for k, v in raw.items() if k != "schema_version"})
            except (OSError, ValueError, AttributeError) as exc:
                self.ledger.set(rid, "failed", int(e.get("round") or 0), f"cannot resume after a restart: {exc}")
                log.warning("run %s failed: cannot resume after a restart: %s", rid, exc)
        return None

    async def resume(self, d: RunDescriptor, stop: asyncio.Event) -> bool:
        """``idle ->`` the state recorded before a kill: ``deployed``/``adopted``/``kept`` is recorded finished;
        ``trained``/``deploying`` runs the agent, which restores its final checkpoint and deploys
        (:meth:`~dfl_agent.deploy.versions.ModelStore.run_outcome`: once).  False: ``stop`` came."""
        state = str(self.ledger.state(d.run_id))
        log.info("run %s resumes from state %s, recorded before a restart", d.run_id, state)
        self.info = {"id": d.run_id, "state": "training", "round": d.rounds, "reason": ""}
        if state in ("trained", "deploying"):
            return await self.train(d, stop, resume=state)
        if state in ("deployed", "adopted"):  # a kill may have come between the ledger and the switch of current
            from dfl_agent.runtime.service.supervisor import switch_deployed

            await asyncio.to_thread(switch_deployed, self.cfg, self.lobby, d.run_id)
        self._to(state, d.run_id)
        self.finish(d, None, None)
        self.idle()
        self.publish(force=True)
        return True

    async def ingest_due(self) -> None:
        """A spool ingestion of the sample store when one is due (idle, and while a run
        process trains: the supervisor is the store's only writer)."""
        store = self.store
        if store is not None and time.monotonic() >= self.next_spool:
            self.next_spool = time.monotonic() + self.cfg.data.spool_interval
            try:
                await asyncio.to_thread(store.ingest_spool)
            except Exception as exc:  # noqa: BLE001 - ingestion never stops the agent
                log.error("spool pass failed: %s", exc)

    async def _ingest_loop(self) -> None:
        """The spool ingestion while a run trains in a run process."""
        while True:
            await self.ingest_due()
            await asyncio.sleep(0.5)

    async def idle_pass(self, stop: asyncio.Event) -> None:
        """One pass of the idle loop: the status heartbeat, a spool ingestion when due,
        then wait up to 0.5 s for ``stop``."""
        self.publish()
        await self.ingest_due()
        self.lobby.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
