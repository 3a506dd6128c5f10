"""The run manager: one run's life on this node, as a state machine.

(Filled in by the next step; for now it holds the hooks around runs.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dfl_agent.runtime.descriptor import RunDescriptor

log = logging.getLogger("dfl_agent.runs")


RunHook = Callable[[RunDescriptor, Any], Any]


class RunHooks:
    """Callbacks around runs.  ``on_run_finished(run, node)`` is called after a run
    ends on this node with state ``finished`` (``node`` is the :class:`~dfl_agent.runtime.node.Node`
    that trained it; its algorithm holds the final model) - e.g. to deploy the model.
    A hook that raises is logged; it never stops the agent."""

    def __init__(self) -> None:
        self.finished: list[RunHook] = []

    def on_run_finished(self, fn: RunHook) -> RunHook:
        """Register ``fn(run, node)``; usable as a decorator."""
        self.finished.append(fn)
        return fn

    def fire_finished(self, run: RunDescriptor, node: Any) -> None:
        for fn in list(self.finished):
            try:
                fn(run, node)
            except Exception:
                log.exception("on_run_finished hook %r failed", fn)
