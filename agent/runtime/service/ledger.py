"""The run ledger: which runs this node finished, failed, cancelled or declined.

Kept in ``{state_dir}/runs/ledger.json`` (:class:`RunLedger`, atomic writes), so a
finished run is never rerun, after a reboot too.  Checkpoints and metrics are per run,
under ``{state_dir}/runs/{run_id}/``.  Also here: which repeat of a recurring default
run is due (:func:`next_recurring`, :func:`next_sample_triggered`,
:func:`default_descriptor`), since that is decided from the ledger.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dfl_agent.durations import parse_duration
from dfl_agent.fsutil import atomic_write
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.learning.training import DEFAULT_LR
from dfl_agent.runtime.shared.descriptor import (
    TERMINAL,
    RunDescriptor,
    default_run_id,
    period_index,
    recurring_run_id,
    sample_run_id,
)


def next_recurring(ledger: RunLedger, default_id: str, every_s: float, now: float,
                   running: str | None = None) -> str | None:
    """The repeat of a recurring default run that is due at ``now``, or None.

    A recurring run never overlaps itself: while one of its repeats is ``running``
    nothing is due, and a period whose repeat already ran (or any later one) is not
    due again.  Missed periods are not made up: only the current period's repeat runs.
    """
    if running is not None and running.startswith(default_id + "."):
        return None
    rid = recurring_run_id(default_id, period_index(now, every_s))
    return None if ledger.is_done(rid) else rid



def next_sample_triggered(ledger: RunLedger, default_id: str, every_samples: int,
                          new_samples: Callable[[int], int], running: str | None = None) -> str | None:
    """The repeat of a default run recurring "when at least ``every_samples`` new samples
    arrived" (``algorithm.every_samples``) that is due now, or None.

    The first repeat (``.s0``) runs at once; repeat ``.s{n}`` is unfinished (a restart
    resumes it) or, when done, the next one is due once ``new_samples(last_id)`` - the
    samples the store got after the newest sample id of any repeat's snapshot
    (``snapshot_last_id`` in the ledger; 0 when none was recorded) - reaches
    ``every_samples``.  Never overlaps itself: nothing is due while a repeat is ``running``.
    """
    prefix = default_id + ".s"
    if running is not None and running.startswith(prefix):
        return None
    index = {int(k[len(prefix):]): e for k, e in ledger.entries.items()
             if k.startswith(prefix) and k[len(prefix):].isdigit()}
    if not index:
        return sample_run_id(default_id, 0)
    last = max(index)
    if not ledger.is_done(sample_run_id(default_id, last)):
        return sample_run_id(default_id, last)
    last_id = max((int(e.get("snapshot_last_id") or 0) for e in index.values()), default=0)
    return sample_run_id(default_id, last + 1) if new_samples(last_id) >= every_samples else None


class RunLedger:
    """This node's run history, persisted in ``{state_dir}/runs/ledger.json``.

    Maps run id -> ``{"state", "round", "reason", "time"}``.  Written atomically after
    every change, so a crash never leaves it half-written.  Beside it, the ids of runs an
    operator cancelled (:attr:`cancelled`, ``{state_dir}/runs/cancelled.json``), also those
    that never ran here: a replayed descriptor of one is refused.
    """

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.dir = Path(state_dir) / "runs"
        self.path = self.dir / "ledger.json"
        self.entries: dict[str, dict[str, Any]] = {}
        try:
            raw = bounded_loads(self.path.read_bytes(), "state")
            if isinstance(raw, dict):
                self.entries = {k: v for k, v in raw.items() if isinstance(v, dict)}
        except (OSError, ValueError):
            pass
        self.cancelled_path = self.dir / "cancelled.json"
        #: run id -> unix time this node learnt it was cancelled
        self.cancelled: dict[str, float] = {}
        try:
            raw = bounded_loads(self.cancelled_path.read_bytes(), "state")
            if isinstance(raw, dict):
                self.cancelled = {k: float(v) for k, v in raw.items() if isinstance(v, (int, float))}
        except (OSError, ValueError):
            pass

    def remember_cancel(self, run_id: str) -> bool:
        """Remember that an operator cancelled ``run_id`` (atomic write); False when it was known."""
        if run_id in self.cancelled:
            return False
        self.cancelled = {**self.cancelled, run_id: time.time()}
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.cancelled_path, json.dumps(self.cancelled, sort_keys=True))
        return True

    def is_cancelled(self, run_id: str) -> bool:
        """Whether an operator cancelled ``run_id`` (a cancel record, or the run ended cancelled here)."""
        return run_id in self.cancelled or self.state(run_id) == "cancelled"

    def started(self, run_id: str) -> bool:
        """Whether this node started ``run_id`` (a ledger entry or its run folder exists)."""
        return run_id in self.entries or self.run_dir(run_id).exists()

    def run_dir(self, run_id: str) -> Path:
        """Per-run folder (checkpoints, metrics): ``{state_dir}/runs/{run_id}``."""
        return self.dir / run_id

    def set(self, run_id: str, state: str, round: int = 0, reason: str = "",
            extra: Mapping[str, Any] | None = None) -> None:
        """Record ``run_id``'s state on this node (atomic write); ``extra`` fields are kept
        with it (e.g. ``snapshot_last_id``: the newest sample id of the run's data snapshot)."""
        self.entries[run_id] = {"state": state, "round": int(round), "reason": reason, "time": time.time(),
                                **dict(extra or {})}
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(self.entries, sort_keys=True))

    def state(self, run_id: str) -> str | None:
        e = self.entries.get(run_id)
        return e.get("state") if e else None

    def is_done(self, run_id: str) -> bool:
        """True when the run reached a terminal state here (never rerun)."""
        return self.state(run_id) in TERMINAL



def _training_settings(training: Any) -> dict[str, Any]:
    """``[training]``'s set keys for the default run's id; an unset ``lr`` counts as the SGD
    default it stands for, so the id is the one it was when ``lr`` always had a value."""
    return {k: DEFAULT_LR if k == "lr" and v is None else v
            for k, v in dataclasses.asdict(training).items() if v is not None or k == "lr"}


def default_descriptor(cfg: Any, now: float | None = None, ledger: RunLedger | None = None,
                       new_samples: Callable[[int], int] | None = None) -> RunDescriptor | None:
    """The node's default run from its ``[algorithm]`` section (None when it has none, or
    when a run recurring on new samples is not due).

    Its id is :func:`default_run_id`; with ``algorithm.every`` the current period's
    :func:`recurring_run_id`; with ``algorithm.every_samples`` the due
    :func:`next_sample_triggered` repeat (needs ``ledger`` and ``new_samples``, the
    store's :meth:`~dfl_agent.store.sqlite.SampleStore.count_since`)."""
    a = getattr(cfg, "algorithm", None)
    if a is None:
        return None
    every_samples = getattr(a, "every_samples", None)
    settings = {"algorithm": a.name, "options": dict(a.options), "rounds": a.rounds,
                "model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if v is not None},
                "training": _training_settings(cfg.training),
                "compression": {k: v for k, v in dataclasses.asdict(cfg.compression).items() if v is not None}}
    rid = default_run_id(cfg.federation, settings)
    every = getattr(a, "every", None)
    if every:
        rid = recurring_run_id(rid, period_index(time.time() if now is None else now, parse_duration(every)))
    elif every_samples and ledger is not None and new_samples is not None:
        due = next_sample_triggered(ledger, rid, int(every_samples), new_samples)
        if due is None:
            return None
        rid = due
    return RunDescriptor(run_id=rid, federation=cfg.federation, algorithm=a.name, rounds=a.rounds,
                         name="default", options=dict(a.options), default=True)

