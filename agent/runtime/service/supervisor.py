"""The supervisor's side of a run process: :class:`ChildRun` trains one run in a child process.

The always-on agent is a torch-free supervisor (:mod:`dfl_agent.runtime.service.daemon`,
:mod:`dfl_agent.runtime.service.run_manager`).  For each admitted run the run manager's agent factory
makes a :class:`ChildRun`, which

* writes the run's effective configuration to ``RUN_DIR/run.toml`` (mode 0600) and starts
  ``python -m dfl_agent.runtime.run.run_process`` (:mod:`dfl_agent.runtime.run.run_process`) in its own
  memory cgroup limited to the device profile's ``compute.memory_budget_mb``
  (:class:`~dfl_agent.runtime.service.cgroup.RunCgroup`; unlimited, with one WARNING, where no cgroup
  can be made), without the systemd notification socket (only the supervisor talks to systemd),
  and so that the kernel kills it when the supervisor dies;
* follows it over the typed pipe (:mod:`dfl_agent.runtime.shared.pipe`): it signs and publishes the presence and the status
  heartbeats the child relays (with the service's refusal and drop counters), records the
  run's states after its rounds in the run ledger through the run manager before it lets the
  child go on, switches ``current`` to the version the child installed and announces it;
* feeds the systemd watchdog (gated by the service's liveness) and keeps ``STATUS=`` current;
* stops it with SIGTERM (a stop of the service, or an operator's cancel) and SIGKILL after
  ``runtime.run_stop_grace`` seconds;
* tells the run manager how it ended: :attr:`ChildRun.crash` is ``None`` for a run process that
  exited by itself, else ``"oom"`` (killed by the kernel's OOM killer in its cgroup),
  ``"killed"`` (another signal) or ``"crashed"`` (an exception; :attr:`ChildRun.error`).

It has the training :class:`~dfl_agent.runtime.run.agent.Agent`'s interface as the run manager sees
it (``run``, ``progress``, ``outcome``, ``snapshot``, ``data_shape``, ``peak_rss_mb``), :class:`RunProgress` being
what its reports say of the child's node.  Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.fsutil import atomic_write
from dfl_agent.runtime.service.cgroup import RunCgroup, agent_stem, classify_exit
from dfl_agent.runtime.shared import pipe
from dfl_agent.runtime.shared.assembly import StartupError

if TYPE_CHECKING:
    from dfl_agent.runtime.service.lobby import RunLobby
    from dfl_agent.runtime.service.systemd import Notifier
    from dfl_agent.runtime.shared.config import NodeConfig
    from dfl_agent.runtime.shared.descriptor import RunDescriptor

log = logging.getLogger("dfl_agent.daemon")

#: environment variables the run process must not inherit (only the supervisor talks to systemd)
SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
#: exit code of a run process that cannot start (bad configuration or data)
EXIT_STARTUP = 2
#: exit code of a run process whose broker is unreachable
EXIT_BROKER = 3


@dataclasses.dataclass
class RunProgress:
    """What the service knows of a run process's node, from its reports over the typed pipe:
    its last status, its counters and live peers, the round of its last checkpoint.  The run
    manager, the service's counters, the metrics endpoint and the ``on_run_finished`` hooks
    read it.

    Attributes:
        node_id, federation: the node.
        status: the node's last status (:meth:`~dfl_agent.runtime.node.node.Node.status`), with the
            round and the degraded counts of the run's last state report.
        counters: its byte and drop counters.
        live_peers: its live peers.
        checkpoint_round: the round of its last checkpoint (0: none yet).
    """

    node_id: str
    federation: str
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    counters: pipe.RunCounters = dataclasses.field(default_factory=pipe.RunCounters)
    live_peers: tuple[str, ...] = ()
    checkpoint_round: int = 0

    def last_round(self) -> int:
        """The round of the node's last status (0 before the first)."""
        return int(self.status.get("round") or 0)

    def update(self, msg: pipe.StatusReport) -> None:
        """Take a status report of the run process."""
        self.status = dict(msg.status)
        if msg.counters is not None:
            self.counters = msg.counters
        if msg.live_peers is not None:
            self.live_peers = msg.live_peers
        self.checkpoint_round = msg.checkpoint_round

    def ended(self, msg: pipe.End) -> None:
        """Take the run process's end report (its last round and the drops the service keeps)."""
        self.status["round"] = msg.round
        self.counters = dataclasses.replace(self.counters, dropped=dict(msg.drops))


def _preexec(cgroup: Any) -> Any:
    """The run process's set-up between fork and exec: die with the supervisor (Linux
    ``PR_SET_PDEATHSIG``), and enter the memory cgroup before anything is allocated."""

    def setup() -> None:
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if cgroup is not None:
            cgroup.enter()

    return setup


class ChildRun:
    """One run in a run process (see the module docstring).

    Args:
        cfg: the run's configuration (:func:`~dfl_agent.runtime.shared.run_config.run_config_for`).
        config_path: node.toml (the child reads ``run.toml``, and node.toml again on SIGHUP).
        run: the run's descriptor; run_dir: its folder (``descriptor.json`` saved at admission).
        members: the run's admitted members besides this node.
        wanted_peers: ``() -> int``: how many others may still join (the lobby's count).
        on_state: the run manager's ``on_agent_state(state)``: records the state in the ledger.
        lobby: the :class:`~dfl_agent.runtime.service.lobby.RunLobby` that publishes for the node.
        memory_mb: the run process's memory limit (MiB; None: unlimited).
        stop_grace: seconds between SIGTERM and SIGKILL.
        attempt: 1 for the first run process of the run, 2.. for its retries.
        once: ``dfl-agent run --once``'s run (its checkpoints and metrics stay in the state directory).
        service_status: ``() -> dict``: the service's counters, carried in every status of the run.
        notifier: the service's systemd notifier (its watchdog follows the service's liveness), or None.
        stopping: ``() -> bool``: whether the service itself is stopping (its presence then says
            "stopping", a clean leave for its peers, rather than "run ended").
    """

    #: the run manager keeps ingesting the sample store while it trains (the store's only writer)
    supervised = True

    def __init__(self, cfg: NodeConfig, config_path: str | None = None, *, run: RunDescriptor, run_dir: Path,
                 lobby: RunLobby, wanted_peers: Callable[[], int] | None = None, members: Iterable[str] = (),
                 on_state: Callable[..., None] | None = None, memory_mb: int | None = None, stop_grace: float = 30.0,
                 attempt: int = 1, once: bool = False, service_status: Callable[[], dict[str, Any]] | None = None,
                 notifier: Notifier | None = None, stopping: Callable[[], bool] = lambda: False):
        self.cfg, self.run_desc, self.run_dir, self.lobby = cfg, run, Path(run_dir), lobby
        self.config_path, self.once = config_path, once
        self.wanted_peers, self.on_state = wanted_peers, on_state
        self.members = sorted(str(m) for m in members)
        self.memory_mb, self.stop_grace, self.attempt = memory_mb, float(stop_grace), attempt
        #: what the supervisor knows of the run process's node (None before it starts)
        self.progress: RunProgress | None = None
        self.outcome = "starting"
        self.snapshot: np.ndarray | None = None
        self.data_shape: Any = None
        #: None: the run process exited by itself; else "oom", "killed" or "crashed"
        self.crash: str | None = None
        #: the run process's error message (``error`` line), if it sent one
        self.error = ""
        #: why the run ended as its end report says (``missed``: each member's answer), else ""
        self.reason = ""
        self.returncode: int | None = None
        #: the run process's peak resident memory (MiB) as its last state or end report said
        #: (None before one, or from an earlier release's run process): the ledger entry's ``peak_rss_mb``
        self.peak_rss_mb: float | None = None
        self.service_status, self.notifier, self.stopping = service_status, notifier, stopping
        self.proc: Any = None
        self._presence = False
        self._may_join: int | None = None

    # -- the run process's life ---------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> int:
        """Start the run process and follow it until it exits; ``stop`` stops it (SIGTERM,
        then SIGKILL after the grace period).  Returns 0 (ended), or 3 (broker unreachable).

        Raises:
            StartupError: the run process says that the run cannot start (its message).
        """
        from dfl_agent.runtime.shared.config import dump_toml

        node_id = self.lobby.node_id
        self.progress = RunProgress(node_id, self.cfg.federation)
        run_toml = self.run_dir / "run.toml"
        atomic_write(run_toml, dump_toml(self.cfg), mode=0o600)  # it holds the broker password
        # None where no cgroup can be made (logged once): the run process runs unlimited
        cgroup = RunCgroup.create(f"{agent_stem(node_id, self.cfg.state_dir)}-{self.run_desc.run_id}-{self.attempt}",
                                  self.memory_mb)
        env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_ENV}
        try:
            self.proc = proc = await self._spawn(run_toml, env, cgroup)
        except subprocess.SubprocessError as exc:  # the cgroup could not be entered: run unlimited, said
            if cgroup is None:
                raise
            log.warning("run %s: the run process could not enter its memory cgroup (%s); it runs without a "
                        "memory limit", self.run_desc.run_id, exc)
            cgroup.remove()
            cgroup = None
            self.proc = proc = await self._spawn(run_toml, env, None)
        log.info("run %s: run process %d started (attempt %d%s)", self.run_desc.run_id, proc.pid, self.attempt,
                 f", memory limit {self.memory_mb} MiB" if cgroup is not None and self.memory_mb else "")
        self._send(pipe.Start(tuple(self.members), self._wanted()))
        tasks = [asyncio.ensure_future(self._tick()), asyncio.ensure_future(self._stop_on(stop))]
        try:
            await self._read()
            self.returncode = rc = await proc.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if proc.returncode is None:  # the supervisor is stopping on an error: no orphan
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            self._say_goodbye()  # the node leaves the run's rounds (if the child did not say so)
            oom = classify_exit(proc.returncode, cgroup) == "oom"
            if cgroup is not None:
                cgroup.remove()
        return self._ended(rc, bool(oom))

    async def _spawn(self, run_toml: Path, env: dict[str, str], cgroup: Any) -> Any:
        args = ["--config", str(run_toml), "--run-dir", str(self.run_dir), *(["--once"] if self.once else []),
                *(["--node-config", str(self.config_path)] if self.config_path else [])]
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dfl_agent.runtime.run.run_process", *args, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env, preexec_fn=_preexec(cgroup), limit=pipe.MAX_LINE_BYTES)

    def _ended(self, rc: int, oom: bool) -> int:
        """How the run process ended: sets :attr:`crash`; returns the run's exit code."""
        run_id = self.run_desc.run_id
        if rc == EXIT_STARTUP and self.outcome == "starting":
            raise StartupError(self.error or f"run {run_id}: the run process could not start")
        if rc == EXIT_BROKER:
            return EXIT_BROKER
        if rc < 0 or (rc != 0 and self.outcome == "starting"):
            self.crash = "oom" if oom else "killed" if rc < 0 else "crashed"
            why = (f"killed by the kernel's OOM killer (memory limit {self.memory_mb} MiB)" if self.crash == "oom"
                   else f"killed by signal {-rc}" if rc < 0 else self.error or f"exit code {rc}")
            log.warning("run %s: run process %s", run_id, why)
            self.error = self.error or why
            return 1
        return 0

    async def _read(self) -> None:
        """Handle the run process's messages until its output ends; a line that is not a
        pipe message is dropped (logged)."""
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            try:
                line = await self.proc.stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):  # a line over the limit: dropped
                log.warning("run %s: a message of the run process was too long; dropped", self.run_desc.run_id)
                continue
            if not line:
                return
            try:
                await self._handle(pipe.from_line(line))
            except pipe.PipeError as exc:
                log.warning("run %s: dropped a message of the run process: %s", self.run_desc.run_id, exc)
            except Exception:  # noqa: BLE001 - one bad message never ends the run's follow-up
                log.exception("run %s: could not handle a message of the run process", self.run_desc.run_id)

    async def _handle(self, msg: pipe.Message) -> None:
        node = self.progress
        assert node is not None
        if isinstance(msg, pipe.Presence):
            self._presence = True
            self.lobby.publish_presence(msg.descriptor)
        elif isinstance(msg, pipe.Goodbye):
            self._say_goodbye()
        elif isinstance(msg, pipe.StatusReport):
            node.update(msg)
            self.lobby.publish_run_status(node.status, self.service_status() if self.service_status else None)
        elif isinstance(msg, pipe.StateReport):
            await self._state(msg)
        elif isinstance(msg, pipe.Failure):
            self.error = msg.message
        elif isinstance(msg, pipe.End):
            self.outcome = msg.outcome
            self.reason = msg.reason or ""
            self._take(msg)
            self.data_shape = msg.data_shape
            node.ended(msg)

    async def _state(self, msg: pipe.StateReport) -> None:
        """A state of the run after its rounds: the run manager records it (the ledger),
        then, for ``deployed``, ``current`` is switched and announced; then the child goes on."""
        node = self.progress
        assert node is not None
        node.status["round"] = msg.round
        node.status.update(msg.degraded)  # the run manager's ledger entry
        self._take(msg)
        if msg.state in ("trained", "adopted"):
            self.outcome = "finished"
        if self.on_state is not None:  # "trained" carries the run's start (warm start) for the ledger
            info = {k: getattr(msg, k) for k in ("start", "version", "source", "reason") if getattr(msg, k) is not None}
            self.on_state(msg.state, **info)
        if msg.state in ("deployed", "adopted") and msg.version is not None:
            await asyncio.to_thread(switch_current, self.cfg, self.lobby, self.run_desc.run_id, msg.version)
        self._send(pipe.Ack(msg.seq))

    def _take(self, msg: pipe.StateReport | pipe.End) -> None:
        """Take the run process's peak resident memory (it only grows) and its data snapshot's
        newest sample id from a state or end report."""
        if msg.peak_rss_mb is not None:
            self.peak_rss_mb = max(msg.peak_rss_mb, self.peak_rss_mb or 0.0)
        if msg.snapshot_last_id is not None:
            self.snapshot = np.array([msg.snapshot_last_id])

    # -- talking to the run process ----------------------------------------------------------
    def _send(self, msg: pipe.ToRun) -> None:
        stdin = self.proc.stdin if self.proc is not None else None
        if stdin is None or stdin.is_closing():
            return
        stdin.write(pipe.to_line(msg))

    def _say_goodbye(self) -> None:
        """The node's presence "offline" (once per run process): ``stopping`` when the service
        stops, else ``run ended``."""
        if self._presence:
            self._presence = False
            self.lobby.publish_presence(None, "stopping" if self.stopping() else "run ended")

    def reload(self) -> None:
        """SIGHUP: the run process applies what can change while it trains (node.toml)."""
        self._send(pipe.Reload())

    def _wanted(self) -> int:
        return int(self.wanted_peers()) if self.wanted_peers is not None else sys.maxsize

    async def _tick(self) -> None:
        """Every second: tell the child how many peers may still join, ping the watchdog
        (gated by the service's liveness), refresh ``STATUS=``."""
        n = self.notifier
        interval = n.watchdog_interval() if n is not None else None
        while True:
            wanted = self._wanted()
            if wanted != self._may_join:
                self._may_join = wanted
                self._send(pipe.MayJoin(wanted))
            if n is not None:
                if interval:
                    n.watchdog()
                n.status(self.status_line())
            await asyncio.sleep(min(1.0, interval or 1.0))

    async def _stop_on(self, stop: asyncio.Event) -> None:
        """On ``stop``: SIGTERM, then SIGKILL after the grace period."""
        await stop.wait()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.stop_grace)
        except asyncio.TimeoutError:
            log.warning("run %s: the run process did not stop within %.0f s; killed", self.run_desc.run_id,
                        self.stop_grace)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def status_line(self) -> str:
        """One line for ``systemctl status`` (STATUS=): run, round, peers."""
        st = self.progress.status if self.progress is not None else {}
        return (f"run {self.run_desc.run_id} {st.get('state', 'starting')}: round {st.get('round', 0)}/"
                f"{st.get('rounds', 0)}, {len(st.get('live_peers', []) or [])} peers")


def announce(lobby: Any, models: Any) -> None:
    """Publish the retained ``dfl/{fed}/node/{id}/model`` announcement of ``current``
    (:func:`~dfl_agent.deploy.gate.announcement`) on the lobby's session; best effort."""
    from dfl_agent.deploy.gate import announcement
    from dfl_agent.privacy.policy import dp_enabled
    from dfl_agent.transport.mqtt import topic

    if lobby is None or lobby.client is None:
        return
    doc = announcement(models, lobby.node_id, lobby.cfg.federation, lobby.guard, private=dp_enabled(lobby.cfg))
    if doc is None:
        return
    try:
        lobby.client.publish(topic(lobby.cfg.federation, lobby.node_id, "model"), json.dumps(doc, sort_keys=True), qos=1,
                             retain=True)
    except Exception as exc:  # noqa: BLE001 - the files are the contract; MQTT is a convenience
        log.warning("could not publish the model announcement: %s", exc)


def switch_current(cfg: Any, lobby: Any, run_id: str, version: int) -> None:
    """Point ``current`` at ``version``, which run ``run_id``'s run process installed, prune the
    old versions and announce it (the service's side of a deployment)."""
    from dfl_agent.deploy.versions import ModelStore

    models = ModelStore(cfg.state_dir, keep=cfg.deploy.keep)
    models.switch(version)
    models.prune()
    log.info("run %s: model v%d is now current", run_id, version)
    announce(lobby, models)


def switch_deployed(cfg: Any, lobby: Any, run_id: str) -> None:
    """After a restart from the ledger's ``deployed``: ``current`` holds run ``run_id``'s
    installed version (switched and announced when a kill came before the switch)."""
    from dfl_agent.deploy.versions import ModelStore

    models = ModelStore(cfg.state_dir, keep=cfg.deploy.keep)
    before = models.current_version()
    models.run_outcome(run_id)
    if models.current_version() != before:
        log.info("run %s: model v%s is now current (switched after a restart)", run_id, models.current_version())
        announce(lobby, models)
