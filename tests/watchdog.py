"""A watchdog pinger for tests of :class:`~dfl_agent.runtime.service.systemd.Notifier` and
:class:`~dfl_agent.runtime.service.liveness.Liveness`: it pings from the event loop as the
service does (the run manager with its idle status, a run's ``ChildRun`` every second), with
nothing else around it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dfl_agent.runtime.service.systemd import Notifier


async def watchdog_loop(notifier: Notifier, interval: float, status: Callable[[], str] | None = None) -> None:
    """Ping ``WATCHDOG=1`` every ``interval`` s from the running event loop until cancelled,
    and with ``status`` send ``STATUS=`` when its text changes.  The pings are loop callbacks,
    so they stop while the loop is blocked."""
    last: str | None = None
    while True:
        notifier.watchdog()
        if status is not None and (text := status()) != last:
            notifier.status(text)
            last = text
        await asyncio.sleep(interval)
