"""What one MQTT connection logs about its broker: lost, still away, back.

A service's log must show a broker outage without flooding the journal: one WARNING
when the connection is lost (or when the first connection fails), then while the broker
stays away at most one WARNING per report interval saying for how long and after how
many reconnection attempts (the interval starts at ``first_report`` seconds and doubles
up to ``max_report``), and one INFO line with the outage's duration when it is back.
paho's own messages about every failed attempt stay at DEBUG (see
:func:`dfl_agent.transport.mqtt.mqtt_session`).

The lines, for node ``s0`` and broker ``10.0.0.5:1883``::

    WARNING s0: lost broker 10.0.0.5:1883 (Unspecified error); reconnecting
    WARNING s0: cannot reach broker 10.0.0.5:1883 (connection refused); retrying
    WARNING s0: broker 10.0.0.5:1883 still unreachable after 1 min 0 s (12 attempts, last: connection refused)
    INFO    s0: broker 10.0.0.5:1883 back after 1 min 34 s (19 reconnection attempts)

Used by :class:`~dfl_agent.transport.mqtt.MqttTransport` (one per broker connection)
and by the always-on agent's run lobby session.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


def format_duration(seconds: float) -> str:
    """``seconds`` for a log line: ``"4.2 s"``, ``"3 min 5 s"``, ``"2 h 7 min"``.

    >>> [format_duration(s) for s in (0.04, 4.24, 65, 7620)]
    ['0.0 s', '4.2 s', '1 min 5 s', '2 h 7 min']
    """
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class BrokerOutage:
    """The log of one connection's broker outages (thread-safe; paho calls it from its
    network thread).

    Args:
        who: how the lines start (the node id).
        endpoint: the broker, ``"host:port"``.
        logger: where the lines go.
        first_report: seconds after the loss (or the first failed attempt) of the first
            "still unreachable" line; each later one comes after twice the previous wait.
        max_report: the longest wait between two "still unreachable" lines (s).
        clock: monotonic time source (injectable for tests).
    """

    def __init__(self, who: str, endpoint: str, logger: logging.Logger, *, first_report: float = 60.0,
                 max_report: float = 900.0, clock: Callable[[], float] = time.monotonic):
        self.who, self.endpoint, self.log = who, endpoint, logger
        self.first_report, self.max_report, self.clock = first_report, max_report, clock
        self._lock = threading.Lock()
        #: monotonic time the outage began (None: connected, or never tried)
        self.down_since: float | None = None
        #: failed connection attempts in the current outage
        self.attempts = 0
        self.ever_connected = False
        self._next_report = 0.0
        self._wait = first_report

    def _begin(self, now: float) -> None:
        self.down_since, self.attempts = now, 0
        self._wait = self.first_report
        self._next_report = now + self._wait

    def lost(self, reason: str) -> None:
        """The connection was up and is gone (not by our own disconnect): WARNING."""
        with self._lock:
            if self.down_since is not None:
                return
            self._begin(self.clock())
        self.log.warning("%s: lost broker %s (%s); reconnecting", self.who, self.endpoint, reason)

    def attempt_failed(self, why: str) -> None:
        """A connection attempt failed (no answer, refused, TLS, not authorised): the first
        one before any connection is a WARNING, later ones only as the report interval allows."""
        with self._lock:
            now = self.clock()
            first = self.down_since is None
            if first:
                self._begin(now)
            self.attempts += 1
            if first:
                line = "cannot reach"
            elif now >= self._next_report:
                self._wait = min(self._wait * 2, self.max_report)
                self._next_report = now + self._wait
                line = "still"
            else:
                return
            down_s, attempts = now - (self.down_since or now), self.attempts
        if line == "cannot reach":
            self.log.warning("%s: cannot reach broker %s (%s); retrying", self.who, self.endpoint, why)
        else:
            self.log.warning("%s: broker %s still unreachable after %s (%d attempts, last: %s)", self.who,
                             self.endpoint, format_duration(down_s), attempts, why)

    def connected(self) -> float | None:
        """The broker accepted the connection: INFO with the outage's duration when there
        was one.  Returns that duration in seconds (None: no outage)."""
        with self._lock:
            since, attempts, first = self.down_since, self.attempts, not self.ever_connected
            self.down_since, self.attempts, self.ever_connected = None, 0, True
            down_s = None if since is None else self.clock() - since
        if down_s is not None:
            if first:
                self.log.info("%s: reached broker %s after %s (%d failed attempts)", self.who, self.endpoint,
                              format_duration(down_s), attempts)
            else:
                self.log.info("%s: broker %s back after %s (%d reconnection attempts)", self.who, self.endpoint,
                              format_duration(down_s), attempts)
        return down_s
