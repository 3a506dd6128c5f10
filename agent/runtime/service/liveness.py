"""Liveness of the always-on agent: its long-lived tasks and threads, and whether all live.

A service that lives for months must not go on looking healthy with a dead part: a run
listener whose thread died would leave the node deaf to runs and cancels while its status
heartbeat and the systemd watchdog went on.  :class:`Liveness` is the registry of those
parts:

* a **thread** is registered with :meth:`Liveness.watch`: a probe (``() -> bool``, True
  while it runs) and, where it can be restarted, a restart function;
* an **asyncio task** is started with :meth:`Liveness.spawn`: a coroutine factory, run
  again when the task ends with an exception.

A part found dead is restarted, at most ``max_restarts`` times over the process's life,
each time with a WARNING and a count in :attr:`Liveness.restarts` (``task_restarts`` in the
node's status).  A part that cannot be restarted, or has used its restarts, fails the
service: an ERROR names it, :attr:`Liveness.failed` holds its name, and the agent stops
with exit code 1, so that systemd restarts the whole process.

The systemd watchdog is fed only while every registered part is alive
(:attr:`dfl_agent.runtime.service.systemd.Notifier.alive` is :meth:`Liveness.alive`): a part that
is dead and not restarted stops the ``WATCHDOG=1`` pings, so that systemd restarts the
service after ``WatchdogSec`` even if the process cannot end itself.  Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("dfl_agent.daemon")

#: restarts of each part over the process's life before it fails the service
DEFAULT_MAX_RESTARTS = 3


class Liveness:
    """The registry of the service's long-lived parts (see the module docstring).

    Args:
        max_restarts: restarts of each part before a death fails the service (>= 0).
    """

    def __init__(self, max_restarts: int = DEFAULT_MAX_RESTARTS) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.max_restarts = max_restarts
        #: restarts so far, by part name (every registered part has an entry)
        self.restarts: dict[str, int] = {}
        #: the part that failed the service (None while it serves)
        self.failed: str | None = None
        self._probes: dict[str, tuple[Callable[[], bool], Callable[[], None] | None]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failed_event: asyncio.Event | None = None

    # -- registration ---------------------------------------------------------------------
    def watch(self, name: str, probe: Callable[[], bool], restart: Callable[[], None] | None = None) -> None:
        """Register a thread (or any part) by its ``probe`` (True while alive); ``restart``
        brings it back (None: a death fails the service at once)."""
        self._probes[name] = (probe, restart)
        self.restarts.setdefault(name, 0)

    def spawn(self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        """Start ``factory()`` as the task ``name`` on the running loop; when it ends with an
        exception it is started again (counted), until the restarts are used up.  A task
        that returns, or is cancelled, has ended and is no longer watched."""
        self.restarts.setdefault(name, 0)
        task = asyncio.get_running_loop().create_task(factory(), name=f"dfl-{name}")
        self._tasks[name] = task
        task.add_done_callback(lambda t: self._task_done(name, factory, t))
        return task

    def _task_done(self, name: str, factory: Callable[[], Coroutine[Any, Any, None]],
                   task: asyncio.Task[None]) -> None:
        if self._tasks.get(name) is task:
            del self._tasks[name]
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if self._may_restart(name, f"{type(exc).__name__}: {exc}"):
            self.spawn(name, factory)

    def _may_restart(self, name: str, why: str) -> bool:
        """Count a restart of ``name`` (WARNING) and return True, or fail the service."""
        done = self.restarts.get(name, 0)
        if done >= self.max_restarts:
            self._fail(name, why)
            return False
        self.restarts[name] = done + 1
        log.warning("%s died (%s); restarting it (restart %d of %d)", name, why, done + 1, self.max_restarts)
        return True

    def _fail(self, name: str, why: str) -> None:
        if self.failed is not None:
            return
        self.failed = name
        log.error("%s died (%s) after %d restarts; the agent stops with exit code 1 so that it is restarted",
                  name, why, self.restarts.get(name, 0))
        if self._failed_event is not None:
            self._failed_event.set()

    # -- state ----------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Probe every watched part; restart the dead ones that may be restarted.  Returns
        the names of the parts dead now (the failed one included)."""
        dead = [] if self.failed is None else [self.failed]
        for name, (probe, restart) in list(self._probes.items()):
            if name == self.failed or _probe(probe):
                continue
            if restart is None:
                self._fail(name, "not running")
            elif self._may_restart(name, "not running"):
                try:
                    restart()
                except Exception as exc:  # noqa: BLE001 - a restart that fails is a death
                    log.warning("%s: restart failed: %s", name, exc)
                if _probe(probe):
                    continue
            dead.append(name)
        return dead

    def alive(self) -> bool:
        """True while every registered part is alive (dead ones restarted where they may be):
        the condition of the systemd watchdog's pings."""
        return not self.check()

    def status(self) -> dict[str, int]:
        """``{part: restarts}``: the ``task_restarts`` of the node's status."""
        return dict(sorted(self.restarts.items()))

    async def wait_failed(self, interval: float = 1.0) -> str:
        """Probe every ``interval`` seconds (restarting what may be restarted) until a part
        fails the service; returns its name."""
        self._failed_event = event = asyncio.Event()
        while self.failed is None:
            self.check()
            if self.failed is not None:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), interval)
        return self.failed or ""

    def cancel(self) -> None:
        """Cancel the spawned tasks (the service stops)."""
        for task in list(self._tasks.values()):
            task.cancel()


def _probe(probe: Callable[[], bool]) -> bool:
    try:
        return bool(probe())
    except Exception as exc:  # noqa: BLE001 - a probe that fails says dead
        log.debug("liveness probe failed: %s", exc)
        return False


def paho_loop_alive(client: Any) -> bool:
    """True while paho's network thread (``loop_start``) of ``client`` runs."""
    thread = getattr(client, "_thread", None)
    return thread is not None and thread.is_alive()


def restart_paho_loop(client: Any) -> None:
    """Start paho's network thread of ``client`` again after it died, on a new connection:
    the message whose handling ended the thread is not handled again from paho's buffer,
    and the client's ``on_connect`` subscribes again."""
    if getattr(client, "_thread", None) is not None:  # paho clears it as its thread ends
        client.loop_stop()
    client.connect_async(client.host, client.port, client.keepalive)  # the new thread connects
    client.loop_start()


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it ended (teardown of a background loop)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
