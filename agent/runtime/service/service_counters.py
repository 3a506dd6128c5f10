"""The always-on agent's refusal and drop counters, kept across restarts.  Torch-free.

The service counts what it refused or dropped on the control plane over its whole life:

* ``runs_refused``: run descriptors refused, by reason (the lobby's verifier);
* ``control_dropped``: control messages dropped, by reason - the statuses and errors of
  the run lobby (``status_{reason}``, ``handler_error``), which listens idle and while a
  run trains, and the presence drops of each run's node (``presence_{reason}``,
  ``bad_presence``; a run's status drops are the lobby's too and are not counted twice), and
  the answers to a node's request for a run's model it dropped (``model_files_{reason}``:
  :mod:`dfl_agent.runtime.run.adoption`).

:class:`ServiceCounters` is the one place that adds them up: the counts saved by earlier
starts, the lobby's counts since this start, the runs that ended since, and the run in
training.  Its :meth:`~ServiceCounters.view` goes into every status the node publishes,
idle (the lobby) and training (the run's node), and into the Prometheus endpoint, so both
fields are always present.  :meth:`~ServiceCounters.save` writes the totals to
``STATE_DIR/counters.json`` (atomically, at most once per heartbeat while they change,
and when the agent stops); the next start reads them back with the bounded JSON parser.
A kill loses at most the last heartbeat's increments.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import atomic_write
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.shared.pipe import run_drops

log = logging.getLogger("dfl_agent.daemon")

#: the counters' file under the state directory
COUNTERS_FILE = "counters.json"
#: the counter groups, each ``{reason: n}``
GROUPS = ("runs_refused", "control_dropped")


def _total(*parts: Mapping[str, Any] | None) -> dict[str, int]:
    """Per-reason sums of ``parts`` (None and non-integer values skipped), sorted by reason."""
    out: dict[str, int] = {}
    for part in parts:
        for k, v in dict(part or {}).items():
            if isinstance(v, int) and not isinstance(v, bool):
                out[str(k)] = out.get(str(k), 0) + v
    return dict(sorted(out.items()))


def _dropped(progress: Any) -> Mapping[str, int] | None:
    return progress.counters.dropped if progress is not None else None


def load_counters(path: Path) -> dict[str, dict[str, int]]:
    """The counters saved at ``path``: ``{group: {reason: n}}``; zeros when the file is
    missing, and (logged at WARNING) when it is unreadable, too large or not counters."""
    empty: dict[str, dict[str, int]] = {g: {} for g in GROUPS}
    try:
        doc = bounded_loads(path.read_bytes(), "state")
    except FileNotFoundError:
        return empty
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); the refusal and drop counters start from 0", path, exc)
        return empty
    if not isinstance(doc, dict):
        log.warning("%s: not a counters document; the refusal and drop counters start from 0", path)
        return empty
    return {g: _total(doc.get(g) if isinstance(doc.get(g), dict) else None) for g in GROUPS}


class ServiceCounters:
    """The node's refusal and drop counters over restarts (see the module docstring).

    Args:
        state_dir: the state directory (``counters.json`` goes there).
        lobby: the run lobby (``verifier.refused`` and ``dropped``: its counts since this start).
        run_node: ``() -> progress``: what the service knows of the node of the run in training
            (:class:`~dfl_agent.runtime.service.supervisor.RunProgress`), or None while idle.
    """

    def __init__(self, state_dir: str | Path, lobby: Any, run_node: Callable[[], Any] = lambda: None):
        self.path = Path(state_dir) / COUNTERS_FILE
        self.lobby, self.run_node = lobby, run_node
        #: counts of earlier starts (read from the file)
        self.base = load_counters(self.path)
        #: drops of the runs that ended since this start
        self.ended: dict[str, int] = {}
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._saved: dict[str, dict[str, int]] = self.base
        self._task: asyncio.Future[None] | None = None
        #: more fields of every status, by name, not saved (the service's ``task_restarts``:
        #: :meth:`dfl_agent.runtime.service.liveness.Liveness.status`)
        self.fields: dict[str, Callable[[], Any]] = {}

    def view(self) -> dict[str, Any]:
        """``{"runs_refused": {reason: n}, "control_dropped": {reason: n}}``: the totals over
        this node's life (both present, ``{}`` when nothing was refused or dropped), and the
        :attr:`fields`."""
        return {**self._totals(), **{name: field() for name, field in self.fields.items()}}

    def _totals(self) -> dict[str, dict[str, int]]:
        lobby = self.lobby
        with self._lock:
            ended = dict(self.ended)
        return {"runs_refused": _total(self.base["runs_refused"], getattr(lobby.verifier, "refused", None)),
                "control_dropped": _total(self.base["control_dropped"], getattr(lobby, "dropped", None), ended,
                                          run_drops(_dropped(self.run_node())))}

    def run_ended(self, node: Any) -> None:
        """Keep the drops of ``node`` (a :class:`~dfl_agent.runtime.service.supervisor.RunProgress`), whose
        run ended (call before it is let go)."""
        drops = run_drops(_dropped(node))
        with self._lock:
            self.ended = _total(self.ended, drops)

    def save(self) -> bool:
        """Write the totals to ``counters.json`` when they changed since the last write
        (atomically; a failure is logged and tried again next time).  Returns whether it wrote."""
        with self._save_lock:  # the saving task's thread and the last save at stop
            now = self._totals()
            if now == self._saved:
                return False
            try:
                atomic_write(self.path, json.dumps({"version": 1, **now}, sort_keys=True) + "\n")
            except OSError as exc:
                log.warning("could not save the refusal and drop counters to %s: %s", self.path, exc)
                return False
            self._saved = now
            return True

    def start_saving(self, interval: float, liveness: Any = None) -> None:
        """Save every ``interval`` seconds while the counters change (a task of the running
        event loop) until :meth:`stop_saving`; with ``liveness`` (a
        :class:`~dfl_agent.runtime.service.liveness.Liveness`) the task is watched: restarted when it
        fails, and counted."""
        if liveness is not None:
            self._task = liveness.spawn("counter saving", lambda: self._keep_saved(interval))
        else:
            self._task = asyncio.ensure_future(self._keep_saved(interval))

    async def stop_saving(self) -> None:
        """End the saving task, then save once more (the agent stops)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.save()

    async def _keep_saved(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self.save)
