"""systemd integration: ``sd_notify`` (READY, STATUS, WATCHDOG, RELOADING, STOPPING).

The notification protocol is one datagram per message on the ``AF_UNIX`` socket named
by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace), containing
newline-separated ``KEY=VALUE`` assignments (sd_notify(3)).  It is small enough to
speak directly; without ``$NOTIFY_SOCKET`` (not started by systemd) every call is a
no-op that returns False.

The watchdog: with ``WatchdogSec=`` systemd sets ``$WATCHDOG_USEC`` (and
``$WATCHDOG_PID``).  The service sends ``WATCHDOG=1`` from its asyncio event loop: the run
manager with its idle status (at least every half period), and the
:class:`~dfl_agent.runtime.service.supervisor.ChildRun` of a training run every second, so pings
stop as soon as the loop is blocked (a stuck callback, a deadlock) or the run manager's loop
stalls, and systemd restarts the service after ``WatchdogSec``.  With :attr:`Notifier.alive` set (the always-on agent's
:meth:`dfl_agent.runtime.service.liveness.Liveness.alive`), a ping is sent only while every
long-lived task and thread of the agent is alive.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages to ``$NOTIFY_SOCKET`` (or ``socket_path``).

    Args:
        socket_path: override of ``$NOTIFY_SOCKET`` (tests); ``None`` reads the env.
        env: environment to read (default ``os.environ``).
    """

    def __init__(self, socket_path: str | None = None, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.path = socket_path if socket_path is not None else env.get("NOTIFY_SOCKET", "")
        self._env = env
        self._sock: socket.socket | None = None
        self.sent = 0
        self.errors = 0
        #: ``() -> bool``: WATCHDOG=1 is sent only while it returns True (None: always)
        self.alive: Callable[[], bool] | None = None
        #: watchdog pings withheld because ``alive`` said no
        self.withheld = 0

    @property
    def enabled(self) -> bool:
        """True when there is a socket to notify."""
        return bool(self.path)

    def _address(self) -> str | bytes:
        return b"\0" + self.path[1:].encode() if self.path.startswith("@") else self.path

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=VALUE`` lines (keys upper-cased: ``notify(ready=1, status="x")``).

        Returns True when the datagram was sent; errors (systemd gone) are counted and
        logged at debug level, never raised.
        """
        if not self.enabled:
            return False
        msg = "\n".join(f"{k.upper()}={str(v).replace(chr(10), ' ')}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self._address())
        except OSError as exc:
            self.errors += 1
            log.debug("sd_notify to %s failed: %s", self.path, exc)
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1`` (Type=notify start-up finished), with an optional STATUS."""
        return self.notify(ready=1, **({"status": status} if status else {}))

    def status(self, text: str) -> bool:
        """``STATUS=text``: shown by ``systemctl status``."""
        return self.notify(status=text)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: keep-alive ping, withheld (False) while :attr:`alive` says a part
        of the agent is dead."""
        if self.enabled and self.alive is not None and not self.alive():
            if not self.withheld:
                log.warning("systemd watchdog: pings withheld while a task of the agent is dead")
            self.withheld += 1
            return False
        return self.notify(watchdog=1)

    def reloading(self) -> bool:
        """``RELOADING=1`` (a SIGHUP reload started); follow with :meth:`ready`."""
        return self.notify(reloading=1)

    def stopping(self) -> bool:
        """``STOPPING=1``: shutting down."""
        return self.notify(stopping=1)

    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half of ``$WATCHDOG_USEC``), or None when the watchdog
        is off or meant for another process (``$WATCHDOG_PID`` != our pid)."""
        usec = self._env.get("WATCHDOG_USEC", "")
        pid = self._env.get("WATCHDOG_PID", "")
        if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
            return None
        return int(usec) / 1e6 / 2
