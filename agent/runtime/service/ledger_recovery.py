"""Recovery of a damaged run ledger (``dflctl state recover``).  Torch-free.

The agent refuses to start on a damaged run ledger (:class:`~dfl_agent.runtime.service.ledger.RunLedgerDamaged`):
starting with an empty one would let it run again a run it already ended.  :func:`recover`, which an
operator runs knowingly, rebuilds the ledger from what is left, and records **every run found
there as ended**, so that none of them runs again:

1. the rows of the damaged ledger that still read (a run not ended in its row is recorded
   ``failed``: nothing resumes it);
2. each run folder under ``runs/``: its ``ended.json`` (how it ended), else a deployed version or the
   refused candidate whose manifest names the run (``finished``), else ``failed`` with the reason
   :data:`RECOVERED`;
3. the cancel records that still read.

The damaged files move to ``runs/damaged-TIME/``, then the new ledger is written atomically.  A run
that left neither a row that reads nor a folder (a declined run, a run older than the last
``runtime.keep_runs``) is not known again: the agent would admit it again only if its descriptor is
still retained on the broker (:func:`recover`'s result says how many rows were lost).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import folder_lock, rename
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.service.ledger import (
    LEDGER_FILE,
    LEGACY_CANCELLED,
    LEGACY_LEDGER,
    RunLedger,
    RunLedgerDamaged,
    sqlite_uri,
    summary,
    write_new_ledger,
)
from dfl_agent.runtime.service.retention import read_ended
from dfl_agent.runtime.shared.descriptor import TERMINAL

log = logging.getLogger("dfl_agent.daemon")

#: the reason recorded for a run whose outcome here the recovery could not tell
RECOVERED = "recovered by dflctl state recover: the run ledger was damaged and this run's outcome here is unknown"


def verify(state_dir: str | Path) -> tuple[bool, str]:
    """``(True, summary line)`` when the run ledger opens and checks (an earlier release's files are
    taken over then), ``(False, the one line of the damage)`` otherwise."""
    try:
        ledger = RunLedger(state_dir)
    except RunLedgerDamaged as exc:
        return False, str(exc)
    try:
        n, cancels = ledger.count(), len(ledger.cancelled)
        ended = len(ledger.in_states(TERMINAL))
    finally:
        ledger.close()
    return True, f"run ledger {ledger.path}: ok: {n} runs ({ended} ended), {cancels} cancel records"


def _salvage(runs: Path) -> tuple[dict[str, dict[str, Any]], dict[str, float], int]:
    """The rows and cancel records of the damaged ledger (and an earlier release's files) that
    still read, and how many rows did not."""
    rows: dict[str, dict[str, Any]] = {}
    cancelled: dict[str, float] = {}
    lost = 0
    path = runs / LEDGER_FILE
    if path.is_file() and path.stat().st_size > 0:
        with contextlib.suppress(sqlite3.Error):
            con = sqlite3.connect(sqlite_uri(path, "ro"), uri=True, timeout=5.0)
            try:
                with contextlib.suppress(sqlite3.Error):
                    for rid, text in con.execute("SELECT run_id, entry FROM runs"):
                        try:
                            e = json.loads(text)
                        except (TypeError, ValueError):
                            e = None
                        if isinstance(rid, str) and isinstance(e, dict) and isinstance(e.get("state"), str):
                            rows[rid] = e
                        else:
                            lost += 1
                with contextlib.suppress(sqlite3.Error):
                    cancelled.update({str(r): float(t) for r, t in con.execute("SELECT run_id, time FROM cancelled")})
            finally:
                con.close()
    for name, into in ((LEGACY_LEDGER, rows), (LEGACY_CANCELLED, cancelled)):
        with contextlib.suppress(OSError, ValueError):
            doc = bounded_loads((runs / name).read_bytes(), "state")
            if isinstance(doc, dict):
                for k, v in doc.items():
                    if into is rows and isinstance(v, dict) and isinstance(v.get("state"), str):
                        rows.setdefault(str(k), v)
                    elif into is cancelled and isinstance(v, (int, float)) and not isinstance(v, bool):
                        cancelled.setdefault(str(k), float(v))
    return rows, cancelled, lost


def _deployed_runs(state_dir: Path) -> dict[str, str]:
    """run id -> where a model of it is kept (a deployed version, or the refused candidate)."""
    from dfl_agent.deploy.versions import DeployError, ModelStore

    models = ModelStore(state_dir)
    out: dict[str, str] = {}
    for v in models.versions():
        with contextlib.suppress(DeployError):
            rid = models.manifest(v).get("run_id")
            if isinstance(rid, str):
                out[rid] = f"deployed as v{v}"
    with contextlib.suppress(OSError, ValueError):
        cand = bounded_loads((models.root / "candidate" / "manifest.json").read_bytes(), "manifest")
        if isinstance(cand, dict) and isinstance(cand.get("run_id"), str):
            out.setdefault(cand["run_id"], "its model refused by the deploy gate (models/candidate)")
    return out


def recover(state_dir: str | Path) -> dict[str, Any]:
    """Rebuild a damaged run ledger (see the module docstring).  Returns ``{"moved_to", "runs",
    "from_ledger", "from_folders", "cancelled", "unreadable_rows", "states"}``.

    Raises:
        ValueError: the ledger checks (nothing to recover).
        OSError, sqlite3.Error: the disk refused (the damaged files stay where they were, or in
            ``runs/damaged-TIME/`` with no new ledger: run it again).
    """
    sd = Path(state_dir)
    runs = sd / "runs"
    ok, line = verify(sd)
    if ok:
        raise ValueError(f"{line}; nothing to recover")
    with folder_lock(runs):
        rows, cancelled, lost = _salvage(runs)
        from_ledger = len(rows)
        deployed = _deployed_runs(sd)
        from_folders = 0
        for folder in sorted(p for p in runs.iterdir() if p.is_dir() and not p.name.startswith((".", "damaged-"))):
            rid = folder.name
            if rows.get(rid, {}).get("state") in TERMINAL:
                continue
            ended = read_ended(folder)
            if ended is not None and ended["state"] in TERMINAL:
                rows[rid] = {**ended, "reason": ended.get("reason") or ""}
            elif rid in deployed:
                rows[rid] = {"state": "finished", "round": int(rows.get(rid, {}).get("round") or 0),
                             "reason": f"recovered by dflctl state recover: {deployed[rid]}", "time": time.time()}
            else:
                rows[rid] = {"state": "failed", "round": int(rows.get(rid, {}).get("round") or 0),
                             "reason": RECOVERED, "time": time.time()}
            from_folders += 1
        for rid, e in rows.items():  # a row that read but does not say the run ended: nothing resumes it
            if e.get("state") not in TERMINAL:
                rows[rid] = {**summary(e), "state": "failed", "reason": RECOVERED}
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        moved = runs / f"damaged-{stamp}"
        n = 1
        while moved.exists():
            moved, n = runs / f"damaged-{stamp}-{n}", n + 1
        moved.mkdir()
        for name in (LEDGER_FILE, f"{LEDGER_FILE}-wal", f"{LEDGER_FILE}-shm", LEGACY_LEDGER, LEGACY_CANCELLED):
            if (runs / name).exists():
                rename(runs / name, moved / name)
        write_new_ledger(runs / LEDGER_FILE, rows, cancelled, {"recovered": stamp})
    states = dict(Counter(e["state"] for e in rows.values()))
    log.info("run ledger %s: rebuilt with %d runs (%d from the damaged ledger, %d from run folders) and %d cancel "
             "records; the damaged files are kept in %s", runs / LEDGER_FILE, len(rows), from_ledger, from_folders,
             len(cancelled), moved)
    return {"moved_to": str(moved), "runs": len(rows), "from_ledger": from_ledger, "from_folders": from_folders,
            "cancelled": len(cancelled), "unreadable_rows": lost, "states": states}
