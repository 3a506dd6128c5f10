"""Recovery of a damaged privacy ledger (``dflctl privacy verify|recover``).  Torch-free.

:func:`recover` moves the damaged files aside to ``privacy/damaged-TIME/`` and opens a new chain
(:mod:`dfl_agent.runtime.shared.privacy_chain`) with an ``opening`` event that records the ε the operator
states as already spent: at least what the device's own records still show (:func:`salvage`: the
head marker's ε and whatever rows can still be read).  The accountant adds it to the composed ε of
the runs after it (basic composition: ε and δ add, a conservative bound), so a recovery never
lowers the budget spent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import sqlite3
import time
from pathlib import Path

from dfl_agent.fsutil import rename
from dfl_agent.runtime.shared.privacy_chain import (
    COLUMNS,
    HEAD_FILE,
    LEDGER_FILE,
    ROUNDING,
    LedgerDamaged,
    LedgerState,
    apply,
    read_head,
    sqlite_uri,
    write_head,
)
from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger

log = logging.getLogger("dfl_agent.daemon")


def salvage(state_dir: str | Path, delta: float) -> list[tuple[str, float]]:
    """What the device's records still show of its spent ε at ``delta``, whatever the ledger's
    damage: ``(source, epsilon)`` for the head marker (at its own δ), table ``runs`` and the
    events that still parse (their hashes unchecked).  Sources that cannot be read are left out."""
    out: list[tuple[str, float]] = []
    sd = Path(state_dir)
    with contextlib.suppress(LedgerDamaged):
        head = read_head(sd)
        if head is not None and isinstance(head.get("epsilon"), (int, float)) and head.get("events", 0) > 0:
            out.append((f"its head marker {sd / HEAD_FILE} (delta {head.get('delta')})", float(head["epsilon"])))
    path = sd / LEDGER_FILE
    if not path.exists() or path.stat().st_size == 0:
        return out
    try:
        con = sqlite3.connect(sqlite_uri(path, "ro"), uri=True, timeout=5.0)
    except sqlite3.Error:
        return out
    try:
        with contextlib.suppress(sqlite3.Error, ValueError, TypeError, KeyError):
            rows = [dict(zip(COLUMNS, r)) for r in con.execute(f"SELECT {', '.join(COLUMNS)} FROM runs")]
            st = LedgerState(rows={r["run_id"]: r for r in rows})
            out.append(("its table runs", st.epsilon(delta)))
        with contextlib.suppress(sqlite3.Error):
            st = LedgerState()
            for run_id, kind, body in con.execute("SELECT run_id, kind, body FROM events ORDER BY seq"):
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    apply(st, run_id, kind, json.loads(body))
            if st.rows or st.carried:
                out.append(("the rows of its history that still read", st.epsilon(delta)))
    finally:
        con.close()
    return [(s, e) for s, e in out if math.isfinite(e)]


def recover(state_dir: str | Path, spent_epsilon: float, delta: float,
            reason: str = "") -> tuple[float, Path | None]:
    """Start a new chain for a damaged ledger: its files move to ``privacy/damaged-TIME/``, and
    the new ledger opens with ``spent_epsilon`` at ``delta`` recorded as already spent (an
    ``opening`` event; within :data:`ROUNDING` below the device's records, their figure).
    Returns the ε recorded and the folder the damaged files went to (None: there were none).

    Raises:
        ValueError: the ledger verifies (nothing to recover), or ``spent_epsilon`` is below what
            the device's records still show (:func:`salvage`); one line.
    """
    sd = Path(state_dir)
    ledger = PrivacyLedger(sd)
    if not (spent_epsilon >= 0 and math.isfinite(spent_epsilon)):
        raise ValueError(f"--spent-epsilon must be a number >= 0, got {spent_epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"--delta must be in (0, 1), got {delta}")
    with ledger._locked():
        try:
            status, _ = ledger.check()
        except LedgerDamaged as exc:
            what = exc.what
        else:
            raise ValueError(f"privacy ledger {ledger.path}: {status}, nothing to recover (dflctl privacy verify "
                             "shows it)")
        floor = max(salvage(sd, delta), key=lambda se: se[1], default=None)
        if floor is not None and spent_epsilon < floor[1] - ROUNDING:
            raise ValueError(f"--spent-epsilon {spent_epsilon:g} is below what this device's records still show: "
                             f"epsilon {floor[1]:.6g} from {floor[0]}; a recovery never lowers a spent budget")
        if floor is not None:  # a figure copied from a status (rounded) counts as the records' own
            spent_epsilon = max(spent_epsilon, floor[1])
        moved = None
        files = [ledger.path.with_name(ledger.path.name + s) for s in ("", "-wal", "-shm")]
        if any(f.exists() for f in files):
            stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
            moved = ledger.path.parent / f"damaged-{stamp}"
            n = 1
            while moved.exists():
                n += 1
                moved = ledger.path.parent / f"damaged-{stamp}-{n}"
            moved.mkdir()
            for f in files:
                if f.exists():
                    rename(f, moved / f.name)
        chain = secrets.token_hex(16)
        ledger._create(chain)
        con = ledger._connect()
        try:
            con.execute("BEGIN IMMEDIATE")
            st = LedgerState(chain=chain, head=chain)
            body = {"epsilon": float(spent_epsilon), "delta": float(delta), "time": time.time(),
                    "reason": reason or what, "damaged_files": str(moved) if moved else None}
            ledger._append(con, st, "", "opening", body)
            con.execute("COMMIT")
        finally:
            con.close()
        write_head(sd, st)
    log.info("privacy ledger %s: recovered: a new chain opens with epsilon %g spent at delta %g (was: %s)",
             ledger.path, spent_epsilon, delta, what)
    return spent_epsilon, moved
