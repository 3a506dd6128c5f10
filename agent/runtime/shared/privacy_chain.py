"""The privacy ledger's format: its events, their hash chain, the fold that gives each run's
state, and the head marker.  Torch-free; :mod:`dfl_agent.runtime.shared.privacy_ledger` reads and writes
it.

**Settling appends; nothing is rewritten.**  Every change is an *event* appended to table
``events`` (``seq`` 1, 2, 3, ...): ``reserve`` (a run's plan), ``replan`` (the run process's own
plan for a reservation not yet settled), ``trained``, ``settle`` (``spent`` with the steps taken,
or ``released``), ``migrated`` (a row of an older release's ledger, taken over as it was) and
``opening`` (an amount an operator stated as already spent:
:func:`~dfl_agent.runtime.service.privacy_recovery.recover`).  The state of each run is the *fold* of its
events in order (:func:`apply`); table ``runs`` is that fold, written in the same transaction as the
event for readers with the ``sqlite3`` shell, and checked against it.

**The hash chain.**  Each event stores ``hash = SHA-256(canonical JSON of [previous hash, seq,
run_id, kind, body])`` (canonical: sorted keys, no spaces, ASCII, floats as Python's shortest
round-trip repr); the first event's "previous hash" is the ledger's random chain id (table
``meta``).  So changing an event's content or the state it leads to, removing an event or
reordering events breaks the chain at that event; editing table ``runs`` makes it disagree with
the fold.

**The head marker** ``STATE_DIR/privacy-head.json`` (outside ``privacy/``, so that deleting or
restoring that folder alone does not take the marker with it) records the chain id, how many
events the ledger holds, the last event's hash, and the composed ε at the newest row's δ.  A chain
alone cannot tell that its last rows were cut off, or that the file was emptied or deleted; the
marker can.  It is written atomically and durably (temporary file, fsync, rename, fsync of the
folder) *after* each commit, and once *before* a ledger is first created or migrated, so at every
instant the ledger holds at least the marker's events: a power cut between a commit and the
marker's write leaves the ledger one event ahead, which is accepted (and the marker caught up).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import atomic_write
from dfl_agent.privacy.accountant import rdp_epsilon

#: the ledger's file under the state directory
LEDGER_FILE = Path("privacy") / "ledger.sqlite"
#: the head marker under the state directory (see the module docstring)
HEAD_FILE = Path("privacy-head.json")
#: the copy of an older release's ledger taken before it is chained
PRE_CHAIN_FILE = Path("privacy") / "ledger.pre-chain.sqlite"
#: the ledger's format (table ``meta``, key ``format``): 2 is the chained ledger
FORMAT = 2
#: the row states: ``reserved`` at admission, ``spent`` once settled, ``released`` (never trained)
ROW_STATES = ("reserved", "spent", "released")
#: how far below the device's records an operator's stated ε may be: the rounding of the
#: published figures (4 decimals); the records' figure is taken then
ROUNDING = 1e-4
#: the event kinds (see the module docstring)
EVENT_KINDS = ("reserve", "replan", "trained", "settle", "migrated", "opening")

RUNS_DDL = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    time REAL NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('reserved', 'spent', 'released')),
    noise_multiplier REAL NOT NULL,
    sample_rate REAL NOT NULL,
    steps INTEGER NOT NULL,
    planned_steps INTEGER NOT NULL,
    steps_per_round INTEGER NOT NULL,
    delta REAL NOT NULL,
    max_grad_norm REAL NOT NULL,
    epsilon REAL NOT NULL,
    trained INTEGER NOT NULL DEFAULT 0,
    settled REAL
)"""
EVENTS_DDL = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    hash TEXT NOT NULL
)"""
META_DDL = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
COLUMNS = ("run_id", "time", "state", "noise_multiplier", "sample_rate", "steps", "planned_steps",
           "steps_per_round", "delta", "max_grad_norm", "epsilon", "trained", "settled")
PLAN_FIELDS = ("noise_multiplier", "sample_rate", "steps", "planned_steps", "steps_per_round", "delta", "max_grad_norm",
         "epsilon")


class LedgerDamaged(ValueError):
    """The privacy ledger cannot be trusted: one line naming the file, what is wrong and the
    recovery command (``str(exc)``); :attr:`what` is the middle part alone."""

    def __init__(self, state_dir: str | Path, what: str):
        self.state_dir, self.what = Path(state_dir), what
        super().__init__(f"privacy ledger {Path(state_dir) / LEDGER_FILE}: {what}; DP runs are refused until an "
                         f"operator runs: dflctl privacy recover --state-dir {state_dir} --spent-epsilon E "
                         "(E: the epsilon this device has spent, from your records)")


def canonical(obj: Any) -> str:
    """The canonical JSON text of ``obj`` (sorted keys, no spaces, ASCII; NaN refused)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def link_hash(prev: str, seq: int, run_id: str, kind: str, body: str) -> str:
    """The hash of event ``seq``: SHA-256 (hex) of the canonical JSON of
    ``[prev, seq, run_id, kind, body]``, ``body`` being the event's stored canonical text."""
    return hashlib.sha256(canonical([prev, seq, run_id, kind, body]).encode("ascii")).hexdigest()


@dataclasses.dataclass
class LedgerState:
    """A verified ledger: the fold of its events.

    Attributes:
        rows: run id -> row (the :data:`COLUMNS`), in the order the runs were first recorded.
        carried: the ``opening`` events' bodies (``epsilon``, ``delta``, ``time``, ``reason``):
            amounts an operator stated as already spent.
        events: how many events the chain holds.
        head: the last event's hash (the chain id when there is none).
        chain: the chain id.
        migrated: how many rows were chained on this open (an older release's ledger).
    """

    rows: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    carried: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: int = 0
    head: str = ""
    chain: str = ""
    migrated: int = 0

    def history(self, exclude: str | None = None) -> list[tuple[float, float, int]]:
        """``(noise_multiplier, sample_rate, steps)`` of every reserved or spent row (but ``exclude``)."""
        return [(r["noise_multiplier"], r["sample_rate"], r["steps"]) for r in self.rows.values()
                if r["state"] != "released" and r["steps"] > 0 and r["run_id"] != exclude]

    def epsilon(self, delta: float, exclude: str | None = None,
                plus: Sequence[tuple[float, float, int]] = ()) -> float:
        """The composed ε at ``delta`` of the history (but ``exclude``) and ``plus``: RDP over
        the rows, plus the carried amounts (basic composition)."""
        return sum(float(c["epsilon"]) for c in self.carried) + rdp_epsilon([*self.history(exclude), *plus], delta)

    def newest_delta(self) -> float | None:
        """The δ of the newest row (else of the newest carried amount), None for an empty ledger."""
        if self.rows:
            return float(list(self.rows.values())[-1]["delta"])
        return float(self.carried[-1]["delta"]) if self.carried else None


def apply(state: LedgerState, run_id: str, kind: str, body: dict[str, Any]) -> None:
    """Fold one event into ``state`` (see the module docstring).

    Raises:
        ValueError: the event does not follow from the events before it (one line).
    """
    rows = state.rows
    row = rows.get(run_id)
    if kind == "reserve" and row is None:
        rows[run_id] = {"run_id": run_id, "time": body["time"], "state": "reserved",
                        **{k: body[k] for k in PLAN_FIELDS}, "trained": 0, "settled": None}
    elif kind == "replan" and row is not None and row["state"] == "reserved":
        row.update({k: body[k] for k in PLAN_FIELDS})
    elif kind == "trained" and row is not None:
        row["trained"] = 1
    elif kind == "settle" and row is not None and row["state"] == "reserved" and body["state"] in ("spent", "released"):
        row.update({"state": body["state"], "steps": body["steps"], "epsilon": body["epsilon"],
                    "settled": body["settled"]})
    elif kind == "migrated" and row is None:
        rows[run_id] = {k: body[k] for k in COLUMNS}
    elif kind == "opening":
        state.carried.append(dict(body))
    else:
        raise ValueError(f"a {kind!r} event for run {run_id!r} does not follow from the events before it")


def read_head(state_dir: str | Path) -> dict[str, Any] | None:
    """The head marker (None when there is none).

    Raises:
        LedgerDamaged: the marker is unreadable or not a marker.
    """
    path = Path(state_dir) / HEAD_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerDamaged(state_dir, f"its head marker {path} is unreadable ({exc.strerror or exc})") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        doc = None
    if not (isinstance(doc, dict) and isinstance(doc.get("events"), int) and isinstance(doc.get("chain"), str)
            and isinstance(doc.get("head"), str)):
        raise LedgerDamaged(state_dir, f"its head marker {path} is not a head marker ({len(raw)} bytes)")
    return doc


def write_head(state_dir: str | Path, state: LedgerState) -> None:
    """Write the head marker for ``state`` (atomically and durably)."""
    delta = state.newest_delta()
    doc = {"format": FORMAT, "chain": state.chain, "events": state.events, "head": state.head, "time": time.time(),
           "delta": delta, "epsilon": round(state.epsilon(delta), 6) if delta is not None else 0.0}
    atomic_write(Path(state_dir) / HEAD_FILE, json.dumps(doc, sort_keys=True) + "\n")


def sqlite_uri(path: Path, mode: str) -> str:
    """The SQLite URI of ``path`` opened in ``mode`` (``ro``, ``rw``: never created; ``rwc``)."""
    return f"file:{urllib.parse.quote(str(path.absolute()))}?mode={mode}"


def file_stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
