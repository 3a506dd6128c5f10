"""The privacy ledger's format: its events, their hash chain, the fold that gives each run's
state, and the head marker.  Torch-free; :mod:`dfl_agent.runtime.shared.privacy_ledger` reads and writes
it.

**Settling appends; nothing is rewritten.**  Every change is an *event* appended to table
``events`` (``seq`` 1, 2, 3, ...): ``reserve`` (a run's plan), ``replan`` (the run process's own
plan for a reservation not yet settled), ``trained``, ``settle`` (``spent`` with the steps taken,
or ``released``), ``migrated`` (a row of an older release's ledger, taken over as it was) and
``opening`` (an amount an operator stated as already spent:
:func:`~dfl_agent.runtime.service.privacy_recovery.recover`) and ``fold`` (the whole state at that
point, older runs folded: see below).  The state of each run is the *fold* of its
events in order (:func:`apply`); table ``runs`` is that fold, written in the same transaction as the
event for readers with the ``sqlite3`` shell, and checked against it.

**The hash chain.**  Each event stores ``hash = SHA-256(canonical JSON of [previous hash, seq,
run_id, kind, body])`` (canonical: sorted keys, no spaces, ASCII, floats as Python's shortest
round-trip repr); the first event's "previous hash" is the ledger's random chain id (table
``meta``).  So changing an event's content or the state it leads to, removing an event or
reordering events breaks the chain at that event; editing table ``runs`` makes it disagree with
the fold.

**Folding keeps the ledger bounded.**  A device with recurring DP runs would otherwise add
four events a run forever.  Once the ledger holds more than ``keep`` settled runs beyond the newest
``keep`` (:func:`fold_body`; the service passes ``runtime.keep_runs``), one ``fold`` event is
appended whose body is the whole state: the newest ``keep`` runs and every reserved run as they
are, the carried amounts, and the older spent runs *composed*: their RDP curves summed into one
(``folded``: the curve over the accountant's orders, a fingerprint of those orders, how many runs
and DP steps it holds, the newest δ).  Rényi DP composes by adding curves, so the composed ε is the
same up to floating-point rounding, whatever noise multipliers and sampling rates the runs had.
Older released runs (which spent nothing) are dropped.  In the same transaction the events before
it are deleted and table ``meta`` records where the chain now starts (``base_seq``,
``base_head``: the sequence number and hash of the last deleted event), so the ``fold`` event
still hashes onto the deleted history and sequence numbers never restart.  A ``fold`` whose
composed ε is below the state it replaces, or whose curve was computed at other orders than this
release's accountant uses, is refused (:func:`apply`).

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

import numpy as np

from dfl_agent.fsutil import atomic_write
from dfl_agent.privacy.accountant import ORDERS, orders_id, rdp_curve, rdp_epsilon

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
        folded: the older runs a fold composed (see the module docstring): ``rdp`` (their
            summed RDP curve), ``orders`` (:func:`~dfl_agent.privacy.accountant.orders_id`),
            ``runs``, ``steps``, ``delta``; empty when none.
        base: the sequence number of the last event deleted by a fold (0: none).
    """

    rows: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    carried: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: int = 0
    head: str = ""
    chain: str = ""
    migrated: int = 0
    folded: dict[str, Any] = dataclasses.field(default_factory=dict)
    base: int = 0

    def runs_spent(self) -> int:
        """How many runs are reserved or spent, folded ones included."""
        return int(self.folded.get("runs", 0)) + sum(1 for r in self.rows.values() if r["state"] != "released")

    def history(self, exclude: str | None = None) -> list[tuple[float, float, int]]:
        """``(noise_multiplier, sample_rate, steps)`` of every reserved or spent row (but ``exclude``)."""
        return [(r["noise_multiplier"], r["sample_rate"], r["steps"]) for r in self.rows.values()
                if r["state"] != "released" and r["steps"] > 0 and r["run_id"] != exclude]

    def epsilon(self, delta: float, exclude: str | None = None,
                plus: Sequence[tuple[float, float, int]] = ()) -> float:
        """The composed ε at ``delta`` of the history (but ``exclude``) and ``plus``: RDP over
        the rows, plus the carried amounts (basic composition)."""
        return sum(float(c["epsilon"]) for c in self.carried) + rdp_epsilon(
            [*self.history(exclude), *plus], delta, self.folded.get("rdp"))

    def newest_delta(self) -> float | None:
        """The δ of the newest row (else of the newest carried amount), None for an empty ledger."""
        if self.rows:
            return float(list(self.rows.values())[-1]["delta"])
        if self.carried:
            return float(self.carried[-1]["delta"])
        return float(self.folded["delta"]) if self.folded else None


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
    elif kind == "fold" and not run_id:
        before = state.epsilon(d) if (d := state.newest_delta()) is not None else 0.0
        folded = dict(body["folded"])
        if folded and folded.get("orders") != orders_id():
            raise ValueError("a fold composed at other RDP orders than this release's accountant uses")
        new = LedgerState(rows={r["run_id"]: {k: r[k] for k in COLUMNS} for r in body["rows"]},
                          carried=[dict(c) for c in body["carried"]], folded=folded)
        after = new.epsilon(d) if (d := new.newest_delta()) is not None else 0.0
        if after < before - 1e-9 * max(1.0, before):
            raise ValueError(f"a fold lowers the composed epsilon from {before:.6g} to {after:.6g}")
        state.rows, state.carried, state.folded = new.rows, new.carried, new.folded
    else:
        raise ValueError(f"a {kind!r} event for run {run_id!r} does not follow from the events before it")


def fold_body(state: LedgerState, keep: int) -> dict[str, Any] | None:
    """The body of a ``fold`` event for ``state`` keeping the newest ``keep`` runs (see the
    module docstring), or None while at most ``keep`` older runs could be folded (so a fold
    happens once every ``keep`` runs)."""
    rows = list(state.rows.values())
    newest = {r["run_id"] for r in rows[-keep:]} if keep > 0 else set()
    older = [r for r in rows if r["run_id"] not in newest and r["state"] != "reserved"]
    if len(older) <= keep:
        return None
    spent = [r for r in older if r["state"] == "spent"]
    folded = dict(state.folded) or {"rdp": [0.0] * len(ORDERS), "orders": orders_id(), "runs": 0, "steps": 0,
                                    "delta": None}
    total = np.asarray(folded["rdp"], dtype=np.float64)
    for r in spent:
        total = total + rdp_curve(r["noise_multiplier"], r["sample_rate"], r["steps"])
    if spent:
        folded.update(rdp=[float(x) for x in total], runs=int(folded["runs"]) + len(spent),
                      steps=int(folded["steps"]) + sum(int(r["steps"]) for r in spent), delta=float(spent[-1]["delta"]))
    gone = {r["run_id"] for r in older}
    return {"rows": [r for r in rows if r["run_id"] not in gone], "carried": list(state.carried),
            "folded": folded if folded["runs"] else {}}


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
