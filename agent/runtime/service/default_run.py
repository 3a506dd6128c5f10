"""The node's default run (its ``[algorithm]`` section): its id, and when a recurring one is due.

A default run's id is a hash of the federation and its settings (:func:`default_run_id`), stable
across boots; ``algorithm.every`` repeats it once per period (:func:`recurring_run_id`),
``algorithm.every_samples`` whenever enough new samples arrived (:func:`next_sample_triggered`).
What already ran is read from the run ledger (:class:`~dfl_agent.runtime.service.ledger.RunLedger`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from dfl_agent.durations import parse_duration
from dfl_agent.learning.training import DEFAULT_LR
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.shared.descriptor import (
    RunDescriptor,
    default_run_id,
    period_index,
    recurring_run_id,
    sample_run_id,
)


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
    index = {int(k[len(prefix):]): e for k, e in ledger.with_prefix(prefix).items()
             if k.startswith(prefix) and k[len(prefix):].isdigit()}
    if not index:
        return sample_run_id(default_id, 0)
    last = max(index)
    if not ledger.is_done(sample_run_id(default_id, last)):
        return sample_run_id(default_id, last)
    last_id = max((int(e.get("snapshot_last_id") or 0) for e in index.values()), default=0)
    return sample_run_id(default_id, last + 1) if new_samples(last_id) >= every_samples else None


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
