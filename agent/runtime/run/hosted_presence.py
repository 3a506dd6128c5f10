"""A run process's presence: it listens to its peers' presence and status like every node
(:class:`~dfl_agent.discovery.presence.MqttPresence`), and speaks only through its host.

The run's node publishes no presence, no status and no last will on its own session: its
presence descriptor and each status go to the :class:`~dfl_agent.runtime.shared.run_host.RunHost`
(the supervisor signs and publishes them, and its session holds the node's last will), so a
run process's exit never shows the node offline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dfl_agent.discovery.presence import MqttPresence
from dfl_agent.runtime.shared.pipe import StatusReport
from dfl_agent.runtime.shared.run_host import RunHost


class HostedPresence(MqttPresence):
    """:class:`~dfl_agent.discovery.presence.MqttPresence` whose own messages go to ``host``.

    Args:
        host: the run's host.
        report: ``status -> StatusReport``: the status with the node's counters (the agent's).
        *args, **kwargs: :class:`~dfl_agent.discovery.presence.MqttPresence`'s.
    """

    def __init__(self, *args: Any, host: RunHost, report: Callable[[dict[str, Any]], StatusReport], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.host, self.report = host, report

    def will(self) -> tuple[str, bytes] | None:
        return None  # the supervisor's session holds the node's last will

    def _say_online(self, client: Any) -> None:
        self.host.publish_presence(dict(self.descriptor))

    def _publish_status_now(self, client: Any = None) -> None:
        with self._lock:
            status = dict(self._status or {})
            self._last_status_pub = time.monotonic()
        self.host.publish_status(self.report(status))

    def goodbye(self, client: Any) -> Any:
        self.host.leave()  # the supervisor says "offline" for the node, at once
