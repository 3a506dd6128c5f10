"""Round progress of long runs (``dflctl simulate``, the benchmarks): rounds done, accuracy, ETA.

Progress always goes to stderr, so that ``--json`` keeps stdout one clean JSON document.
On a terminal it is a rich progress bar (rounds done / total, mean accuracy, elapsed time,
time remaining); otherwise (a pipe, a file, a CI log) it is one plain line per finished
round, flushed at once::

    simulate fedavg: round 3/20, accuracy 0.8123, 12.4s elapsed, ETA 1m10s

Only the standard library is imported at module level (``rich`` when a bar is shown).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

#: the callback a simulation calls after every round: (round done, mean accuracy or None)
Tick = Callable[[int, float | None], None]


def _duration(seconds: float) -> str:
    """``12.4s``, ``3m05s``, ``1h02m``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def progress_line(label: str, done: int, total: int, accuracy: float | None, elapsed: float,
                  rounds_elapsed: float | None = None, rounds_counted: int | None = None) -> str:
    """One plain progress line (the non-terminal display).

    Args:
        label: what runs (``simulate fedavg``).
        done: rounds finished so far (>= 1); total: rounds in all.
        accuracy: mean global test accuracy of the nodes after the round, None when not evaluated.
        elapsed: seconds since the run started (set-up included).
        rounds_elapsed: seconds the rounds counted for the ETA took; None: ``elapsed``.
        rounds_counted: how many rounds ``rounds_elapsed`` covers; None: ``done``.
    """
    acc = f", accuracy {accuracy:.4f}" if accuracy is not None else ""
    spent = elapsed if rounds_elapsed is None else rounds_elapsed
    per_round = spent / max(1, done if rounds_counted is None else rounds_counted)
    eta = f", ETA {_duration(per_round * (total - done))}" if 0 < done < total else ""
    return f"{label}: round {done}/{total}{acc}, {_duration(elapsed)} elapsed{eta}"


@contextlib.contextmanager
def round_progress(total: int, label: str, *, file: TextIO | None = None, enabled: bool = True,
                   rich_display: bool | None = None) -> Iterator[Tick]:
    """A progress display for a run of ``total`` rounds; yields the per-round callback.

    Args:
        total: rounds the run will do.
        label: shown before the counts (``simulate dfml``).
        file: where it is written (default ``sys.stderr``).
        enabled: False shows nothing (the callback does nothing).
        rich_display: True a rich bar, False plain lines; None (default): a bar when
            ``file`` is a terminal.

    The callback ``tick(round, accuracy)`` is called once per finished round, in order;
    ``accuracy`` None keeps the last shown value.  ``tick(0, None)`` (optional, shows
    nothing) marks the start of the first round, after set-up: the ETA counts from there.
    """
    out = sys.stderr if file is None else file
    if not enabled:
        yield lambda done, accuracy: None
        return
    if rich_display is None:
        rich_display = bool(getattr(out, "isatty", lambda: False)())
    started = time.monotonic()
    last: dict[str, Any] = {"acc": None, "rounds_from": started}
    if not rich_display:
        def plain(done: int, accuracy: float | None) -> None:
            now = time.monotonic()
            if done <= 0:
                last["rounds_from"] = now
                return
            if accuracy is not None:
                last["acc"] = accuracy
            if done == 1:  # the first round carries warm-up: the ETA's rate counts from its end
                last["first_done"] = now
                since, counted = now - last["rounds_from"], 1
            else:
                since, counted = now - last.get("first_done", last["rounds_from"]), done - 1
            print(progress_line(label, done, total, last["acc"], now - started, since, counted),
                  file=out, flush=True)

        yield plain
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("rounds"),
                   TextColumn("{task.fields[acc]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                   console=Console(file=out), transient=False)
    task = bar.add_task(label, total=total, acc="")

    def fancy(done: int, accuracy: float | None) -> None:
        if done <= 0:
            bar.reset(task, acc="")  # rounds start now: the rate (ETA) counts from here
            return
        if accuracy is not None:
            last["acc"] = accuracy
        acc = f"acc {last['acc']:.4f}" if last["acc"] is not None else ""
        bar.update(task, completed=done, acc=acc)

    with bar:
        yield fancy


def simulate_with_progress(cfg: Any, label: str | None = None, *, enabled: bool = True,
                           file: TextIO | None = None) -> dict[str, Any]:
    """:func:`dfl_agent.runtime.node.simulator.simulate` with a :func:`round_progress` display on stderr.

    A drop-in for ``simulate(cfg)`` in scripts and benchmarks; returns its summary.

    Raises:
        whatever ``simulate`` raises.
    """
    from dfl_agent.runtime.node.simulator import simulate

    name = label or f"simulate {cfg.algorithm} ({cfg.nodes} nodes)"
    with round_progress(cfg.rounds, name, enabled=enabled, file=file) as tick:
        return simulate(cfg, progress=tick)
