"""``RunHost``: everything a run sees of its surroundings.

A run trains in a run process (:mod:`dfl_agent.runtime.run.run_process`).  It talks to the
service around it only through this interface: the run process's implementation is
:class:`~dfl_agent.runtime.run.run_process.RunChannel`, over the typed pipe
(:mod:`dfl_agent.runtime.shared.pipe`) to the supervisor, which owns presence, status, the run
ledger, deployment switching and the announcement.  Tests drive a training agent in one
process with a host double of their own (``tests/host.py``).  Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from dfl_agent.runtime.shared.pipe import StateReport, StatusReport


class HostGone(RuntimeError):
    """The host is gone (the supervisor closed the pipe, stopped or was killed), or it did
    not acknowledge a state: the run stops."""


class RunHost(Protocol):
    """What a run needs from the service around it.

    The service signs and publishes the node's presence and status (a run publishes none
    itself, and sets no last will), records the run's states after its rounds in the run
    ledger before the run goes on, switches ``current`` to a version the run installed, and
    says which nodes are the run's members and how many may still join it.
    """

    def members(self) -> tuple[str, ...]:
        """The run's admitted members besides this node, as the service knew them at the start."""
        ...

    def may_join(self) -> int:
        """How many other nodes may still join the run (:data:`~dfl_agent.runtime.shared.pipe.UNBOUNDED`
        while no node declined it)."""
        ...

    def publish_presence(self, descriptor: Mapping[str, Any]) -> None:
        """Say that the node takes part in the run's rounds, with its presence ``descriptor``."""
        ...

    def leave(self) -> None:
        """Say that the node leaves the run's rounds now (its transport stops)."""
        ...

    def publish_status(self, report: StatusReport) -> None:
        """Publish the node's status (with its counters; the service adds its own)."""
        ...

    def record_state(self, report: StateReport) -> None:
        """Record a state of the run after its rounds and return once the service recorded it
        (for ``deployed``: once ``current`` points at ``report.version``).  ``report.seq`` is
        ignored: the host numbers the states itself.

        Raises:
            HostGone: the service did not record it (it is gone): the run must stop.
        """
        ...
