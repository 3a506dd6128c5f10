"""The run ledger: which runs this node finished, failed, cancelled or declined.

Kept in ``{state_dir}/runs/ledger.sqlite`` (:class:`RunLedger`: SQLite, WAL journal,
``synchronous = FULL``, one transaction per change), so a finished run is never rerun, after a
reboot or a power cut too.  Checkpoints and metrics are per run, under
``{state_dir}/runs/{run_id}/`` (:mod:`~dfl_agent.runtime.service.retention` bounds them).  Which
repeat of a recurring default run is due is decided from the ledger
(:mod:`~dfl_agent.runtime.service.default_run`).

**Tables.**  ``runs``: one row per run (its id, the state the ledger names, the time of its last
change, ``compact`` and the entry as JSON: ``{"state", "round", "reason", "time", ...}``);
``cancelled``: the ids of runs an operator cancelled, also those that never ran here;
``meta``: the format.  A change writes one row; nothing is rewritten whole.  The entries of
older ended runs are kept *compact* (:data:`SUMMARY_FIELDS`, :meth:`RunLedger.compact_older`):
the one-line summary that says the run ended here and how.

**Checked at open.**  A ledger that is 0 bytes, zeroed, cut short, not a readable SQLite
database, failing SQLite's integrity check, without the ledger's tables or with a row that does
not read is refused with :class:`RunLedgerDamaged` (one line naming the file and the recovery
command, ``dflctl state recover``): the agent then does not start (exit code 2), since an empty
ledger would let it run again a run it already ended.  So is a missing ledger while run folders
show that runs ran here.

**Migration.**  A state directory of an earlier release holds ``runs/ledger.json`` and
``runs/cancelled.json`` (one JSON document each, rewritten whole at every change).  Taking them
over is a part of the state folder's migration to schema 2
(:mod:`dfl_agent.runtime.shared.state_version`, registered below): at the agent's start the two
files are first copied to ``state-backup/schema-1-TIME/runs/``, then the ledger opens.  The
first open (at that migration, or in a reader such as ``dflctl state check`` on a folder not yet
migrated) takes them over: a new ledger is written under a temporary name, fsynced and renamed into
place, then the two files are kept as ``*.json.migrated``; one INFO line says so.  An unreadable
``ledger.json`` is refused as above; an unreadable ``cancelled.json`` is taken over without its
records, at WARNING (the broker's retained cancel records are taken again when the agent
connects, and the runs the ledger recorded cancelled stay cancelled).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import crash_point, folder_lock, rename
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.shared.assembly import StartupError
from dfl_agent.runtime.shared.descriptor import TERMINAL
from dfl_agent.runtime.shared.sqlite_file import cut_short
from dfl_agent.runtime.shared.state_version import Migration, register

log = logging.getLogger("dfl_agent.daemon")

#: the ledger's file, under ``{state_dir}/runs``
LEDGER_FILE = "ledger.sqlite"
#: an earlier release's ledger and cancel records (JSON), taken over at the first open
LEGACY_LEDGER, LEGACY_CANCELLED = "ledger.json", "cancelled.json"
#: the suffix the earlier release's files keep after the migration
MIGRATED = ".migrated"
#: the ledger's format (table ``meta``, key ``format``)
FORMAT = "1"
#: the fields an older ended run's compact entry keeps (its one-line summary: how it ended, and how its model
#: ended here: ``model``, ``version``, ``adopted_from``)
SUMMARY_FIELDS = ("state", "round", "reason", "time", "snapshot_last_id", "model", "version", "adopted_from")
#: the longest reason a compact entry keeps (characters)
SUMMARY_REASON = 200
#: the bytes the write-ahead log is cut back to after a checkpoint (``journal_size_limit``)
WAL_LIMIT = 1 << 20
#: the run folder's files whose presence shows that a run ran here (a missing ledger is then refused)
RUN_EVIDENCE = ("ended.json", "metrics.jsonl", "metrics.jsonl.gz", "checkpoints")
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, state TEXT NOT NULL, time REAL NOT NULL, "
    "compact INTEGER NOT NULL DEFAULT 0, entry TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS runs_time ON runs (time)",
    "CREATE TABLE IF NOT EXISTS cancelled (run_id TEXT PRIMARY KEY, time REAL NOT NULL)",
)
TABLES = frozenset({"meta", "runs", "cancelled"})


class RunLedgerDamaged(StartupError):
    """The run ledger cannot be trusted: one line naming the file, what is wrong and the recovery
    command (``str(exc)``); :attr:`what` is the middle part alone.  The agent does not start
    (exit code 2)."""

    def __init__(self, state_dir: str | os.PathLike[str], path: str | os.PathLike[str], what: str):
        self.state_dir, self.path, self.what = Path(state_dir), Path(path), what
        super().__init__(f"run ledger {path}: {what}; the agent does not start, since it could run again runs this "
                         f"device already ended: run 'dflctl state recover --state-dir {state_dir}' (it rebuilds the "
                         "ledger from what the run folders and the damaged file still show, and records every run "
                         "found there as ended), then start the agent again")


def sqlite_uri(path: Path, mode: str) -> str:
    """The SQLite URI of ``path`` opened in ``mode`` (``ro``, ``rw``: never created; ``rwc``)."""
    from urllib.parse import quote

    return f"file:{quote(str(path.absolute()))}?mode={mode}"


def summary(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The compact entry of an older ended run (:data:`SUMMARY_FIELDS`, the reason cut to
    :data:`SUMMARY_REASON` characters)."""
    out = {k: entry[k] for k in SUMMARY_FIELDS if k in entry and entry[k] is not None}
    if isinstance(out.get("reason"), str) and len(out["reason"]) > SUMMARY_REASON:
        out["reason"] = out["reason"][:SUMMARY_REASON - 1] + "…"
    return out


def run_evidence(runs_dir: Path) -> list[str]:
    """The run folders under ``runs_dir`` whose files show that a run ran here (sorted)."""
    try:
        folders = [p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "damaged-"))]
    except OSError:
        return []
    return sorted(p.name for p in folders if any((p / name).exists() for name in RUN_EVIDENCE))


def write_new_ledger(path: Path, rows: Mapping[str, Mapping[str, Any]], cancelled: Mapping[str, float],
                     meta: Mapping[str, str] | None = None) -> None:
    """Write a ledger holding ``rows`` (run id -> entry) and ``cancelled`` (run id -> time) at
    ``path`` atomically: a temporary file beside it, one transaction, fsync, rename, fsync of the
    folder (a crash leaves no ledger, or the whole new one).

    Raises:
        OSError, sqlite3.Error: the disk refused (nothing is left at ``path``).
    """
    tmp = path.with_name(f".{path.name}.new{os.getpid()}")
    for p in (tmp, tmp.with_name(tmp.name + "-journal")):
        p.unlink(missing_ok=True)
    try:
        con = sqlite3.connect(tmp, isolation_level=None)
        try:
            con.execute("PRAGMA synchronous = FULL")
            con.execute("BEGIN IMMEDIATE")
            for ddl in SCHEMA:
                con.execute(ddl)
            con.executemany("INSERT INTO meta (key, value) VALUES (?, ?)",
                            [("format", FORMAT), *sorted(dict(meta or {}).items())])
            con.executemany("INSERT INTO runs (run_id, state, time, compact, entry) VALUES (?, ?, ?, 0, ?)",
                            [(rid, str(e.get("state")), doc_time(e), json.dumps(dict(e), sort_keys=True))
                             for rid, e in rows.items()])
            con.executemany("INSERT INTO cancelled (run_id, time) VALUES (?, ?)",
                            [(rid, float(t)) for rid, t in cancelled.items()])
            con.execute("COMMIT")
        finally:
            con.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        crash_point("write", path.name)  # the crash tests: the new ledger complete under its temporary name
        rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def doc_time(doc: Mapping[str, Any]) -> float:
    """The ``time`` of a ledger entry or a manifest (unix s), 0.0 when it has none."""
    t = doc.get("time")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


def read_entries(state_dir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Every run's entry in the run ledger of ``state_dir``, read-only (for a program beside the
    agent: nothing is created, checked or taken over): ``runs/ledger.sqlite``, else an earlier
    release's ``runs/ledger.json``; {} when neither can be read."""
    runs = Path(state_dir) / "runs"
    path = runs / LEDGER_FILE
    if path.is_file():
        try:
            con = sqlite3.connect(sqlite_uri(path, "ro"), uri=True, timeout=30.0)
            try:
                rows = con.execute("SELECT run_id, entry FROM runs ORDER BY time, run_id").fetchall()
            finally:
                con.close()
            return {rid: json.loads(text) for rid, text in rows}
        except (sqlite3.Error, ValueError):
            return {}
    try:
        raw = bounded_loads((runs / LEGACY_LEDGER).read_bytes(), "state")
    except (OSError, ValueError):
        return {}
    return {str(k): v for k, v in raw.items() if isinstance(v, dict)} if isinstance(raw, dict) else {}


class _Entries(Mapping[str, dict[str, Any]]):
    """``RunLedger.entries``: every run's entry, read from the ledger (a read-only view; the
    recent runs' entries come from memory)."""

    def __init__(self, ledger: RunLedger):
        self._ledger = ledger

    def __getitem__(self, run_id: str) -> dict[str, Any]:
        entry = self._ledger.entry(run_id)
        if entry is None:
            raise KeyError(run_id)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._ledger.run_ids())

    def __len__(self) -> int:
        return self._ledger.count()

    def __contains__(self, run_id: object) -> bool:
        return isinstance(run_id, str) and self._ledger.state(run_id) is not None


class RunLedger:
    """This node's run history, persisted in ``{state_dir}/runs/ledger.sqlite`` (see the module
    docstring).

    Maps run id -> ``{"state", "round", "reason", "time", ...}`` (:attr:`entries`).  Each change
    is one SQLite transaction written through before :meth:`set` returns, so a crash or power cut
    never leaves it half-written.  Beside it, the ids of runs an operator cancelled
    (:attr:`cancelled`), also those that never ran here: a replayed descriptor of one is refused.
    Safe to use from several threads (the lobby's network thread records cancels).

    Args:
        state_dir: the state directory (``runs/`` is made when missing).

    Raises:
        RunLedgerDamaged: the ledger (or an earlier release's ``ledger.json``) cannot be trusted.
        StartupError: it cannot be read or written now (permissions, disk).
    """

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.state_dir = Path(state_dir)
        self.dir = self.state_dir / "runs"
        self.path = self.dir / LEDGER_FILE
        self._lock = threading.RLock()
        #: the entries of the runs not yet compact (the recent ones), by run id
        self._recent: dict[str, dict[str, Any]] = {}
        #: run id -> unix time this node learnt it was cancelled
        self.cancelled: dict[str, float] = {}
        try:
            with folder_lock(self.dir):
                if not self.path.exists():
                    self._create_or_migrate()
                self._con = self._open()
            self._load()
        except sqlite3.OperationalError as exc:  # busy, no permission, an I/O error: not the file's content
            raise StartupError(f"run ledger {self.path}: cannot be opened now ({exc})") from None
        except OSError as exc:
            raise StartupError(f"run ledger {self.path}: {exc}") from None

    # -- opening ---------------------------------------------------------------------------
    def _damaged(self, what: str, path: Path | None = None) -> RunLedgerDamaged:
        return RunLedgerDamaged(self.state_dir, path or self.path, what)

    def _create_or_migrate(self) -> None:
        """No ledger yet (the caller holds the folder's lock): take over an earlier release's
        files, refuse when run folders show runs that ran here, else create an empty one."""
        legacy, cancels = self.dir / LEGACY_LEDGER, self.dir / LEGACY_CANCELLED
        if legacy.exists() or cancels.exists():
            self._migrate(legacy, cancels)
            return
        if ran := run_evidence(self.dir):
            shown = ", ".join(ran[:3]) + (f" and {len(ran) - 3} more" if len(ran) > 3 else "")
            raise self._damaged(f"is missing, but {len(ran)} run folder(s) show runs that ran here ({shown})")
        write_new_ledger(self.path, {}, {})

    def _migrate(self, legacy: Path, cancels: Path) -> None:
        """Take over an earlier release's ``ledger.json`` and ``cancelled.json`` (see the module
        docstring)."""
        rows: dict[str, dict[str, Any]] = {}
        if legacy.exists():
            try:
                raw = bounded_loads(legacy.read_bytes(), "state")
            except (OSError, ValueError) as exc:
                raise self._damaged(f"cannot be read ({exc}): an earlier release's run ledger", legacy) from None
            if not isinstance(raw, dict):
                raise self._damaged(f"is not a run ledger (a JSON {type(raw).__name__}, not an object): an earlier "
                                    "release's run ledger", legacy)
            rows = {str(k): v for k, v in raw.items() if isinstance(v, dict)}
        cancelled: dict[str, float] = {}
        lost = ""
        if cancels.exists():
            try:
                raw = bounded_loads(cancels.read_bytes(), "state")
                if not isinstance(raw, dict):
                    raise ValueError(f"a JSON {type(raw).__name__}, not an object")
                cancelled = {str(k): float(v) for k, v in raw.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)}
            except (OSError, ValueError) as exc:
                lost = str(exc)
        write_new_ledger(self.path, rows, cancelled, {"migrated_from": "json"})
        kept = self._keep_legacy()
        if lost:
            log.warning("run ledger: %s (an earlier release's cancel records) cannot be read (%s): taken over without "
                        "them; the cancels are taken again from the broker's retained cancel records, and the runs "
                        "the ledger recorded cancelled stay cancelled", cancels, lost)
        log.info("run ledger: took over %d runs and %d cancel records of an earlier release's %s into %s; the files "
                 "before are kept as %s", len(rows), len(cancelled), " and ".join(p.name for p in (legacy, cancels)
                                                                                   if p.name in kept),
                 self.path, ", ".join(kept.values()) or "-")

    def _keep_legacy(self) -> dict[str, str]:
        """Move an earlier release's files that the ledger took over to ``*.migrated``."""
        kept = {}
        for name in (LEGACY_LEDGER, LEGACY_CANCELLED):
            src = self.dir / name
            if not src.exists():
                continue
            dst = src.with_name(name + MIGRATED)
            if dst.exists():
                dst = src.with_name(f"{name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}{MIGRATED}")
            rename(src, dst)
            kept[name] = str(dst)
        return kept

    def _open(self) -> sqlite3.Connection:
        """The connection, after the checks of the module docstring."""
        if (cut := cut_short(self.path)) is not None:
            raise self._damaged(cut)
        con = sqlite3.connect(sqlite_uri(self.path, "rw"), uri=True, timeout=30.0, isolation_level=None,
                              check_same_thread=False)
        try:
            con.execute("PRAGMA synchronous = FULL")
            con.execute("PRAGMA journal_mode = WAL")
            con.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT}")
            check = con.execute("PRAGMA quick_check").fetchall()
            if [tuple(r) for r in check] != [("ok",)]:
                raise self._damaged(f"fails SQLite's integrity check ({' '.join(str(check[0][0]).split())[:160]})")
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables >= TABLES:
                raise self._damaged(f"holds no run ledger (tables {', '.join(sorted(tables)) or 'none'})")
            fmt = dict(con.execute("SELECT key, value FROM meta").fetchall()).get("format")
            if fmt != FORMAT:
                raise self._damaged(f"has format {fmt!r}, not {FORMAT} (written by another release?)")
        except sqlite3.OperationalError as exc:
            con.close()
            if "not a database" in str(exc) or "malformed" in str(exc):
                raise self._damaged(f"is not a readable SQLite database ({exc})") from None
            raise
        except sqlite3.DatabaseError as exc:  # not a database, malformed
            con.close()
            raise self._damaged(f"is not a readable SQLite database ({exc})") from None
        except RunLedgerDamaged:
            con.close()
            raise
        self._keep_legacy()  # an earlier release's files left where a crash came before their move
        return con

    def _load(self) -> None:
        """Read the recent entries and the cancel records; every row must read."""
        try:
            rows = self._con.execute("SELECT run_id, state, compact, entry FROM runs").fetchall()
            cancels = self._con.execute("SELECT run_id, time FROM cancelled").fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._damaged(f"is not a readable SQLite database ({exc})") from None
        for run_id, state, compact, text in rows:
            try:
                entry = json.loads(text)
            except (TypeError, ValueError):
                entry = None
            if not (isinstance(run_id, str) and isinstance(state, str) and isinstance(entry, dict)
                    and entry.get("state") == state):
                raise self._damaged(f"the row of run {run_id!r} does not read")
            if not compact:
                self._recent[run_id] = entry
        self.cancelled = {str(r): float(t) for r, t in cancels}

    def close(self) -> None:
        """Close the connection (the ledger is unusable afterwards)."""
        with self._lock:
            self._con.close()

    # -- reading ---------------------------------------------------------------------------
    @property
    def entries(self) -> Mapping[str, dict[str, Any]]:
        """Every run's entry, run id -> ``{"state", "round", "reason", "time", ...}`` (read-only;
        an older ended run's entry is its compact summary)."""
        return _Entries(self)

    def entry(self, run_id: str) -> dict[str, Any] | None:
        """The entry of ``run_id`` (a copy), or None when the ledger does not know it."""
        with self._lock:
            if run_id in self._recent:
                return dict(self._recent[run_id])
            row = self._con.execute("SELECT entry FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return json.loads(row[0]) if row is not None else None

    def run_ids(self) -> list[str]:
        """Every run id the ledger knows, oldest change first."""
        with self._lock:
            return [r[0] for r in self._con.execute("SELECT run_id FROM runs ORDER BY time, run_id")]

    def count(self) -> int:
        """How many runs the ledger knows."""
        with self._lock:
            return int(self._con.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def _select(self, where: str, args: tuple[Any, ...], tail: str = "") -> dict[str, dict[str, Any]]:
        with self._lock:
            rows = self._con.execute(f"SELECT run_id, entry FROM runs WHERE {where} {tail}", args).fetchall()
        return {rid: json.loads(text) for rid, text in rows}

    def in_states(self, states: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """The entries of the runs whose state is one of ``states``, oldest change first (a state
        that is not an end is answered from memory: only ended runs' entries are ever compact)."""
        if not set(states) & set(TERMINAL):
            found = self.recent_entries(states)
            return dict(sorted(found.items(), key=lambda kv: (kv[1].get("time", 0.0), kv[0])))
        return self._select(f"state IN ({', '.join('?' * len(states))})", tuple(states), "ORDER BY time, run_id")

    def with_prefix(self, prefix: str) -> dict[str, dict[str, Any]]:
        """The entries of the runs whose id starts with ``prefix`` (a recurring run's repeats; not empty)."""
        upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        return self._select("run_id >= ? AND run_id < ?", (prefix, upper))

    def recent(self, n: int) -> dict[str, dict[str, Any]]:
        """The entries of the ``n`` runs changed last, oldest first (a status's ``run_history``)."""
        newest = self._select("1", (), f"ORDER BY time DESC, run_id DESC LIMIT {int(n)}")
        return dict(reversed(list(newest.items())))

    def recent_entries(self, states: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """The whole entries (not the compact summaries) of the runs whose state is one of
        ``states`` (copies)."""
        with self._lock:
            return {rid: dict(e) for rid, e in self._recent.items() if e.get("state") in states}

    def is_summary(self, run_id: str) -> bool:
        """Whether ``run_id``'s entry is an older ended run's compact summary."""
        with self._lock:
            row = self._con.execute("SELECT compact FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return bool(row and row[0])

    def state(self, run_id: str) -> str | None:
        """The state the ledger records for ``run_id`` (``finished``, ``training``, ...), or None."""
        with self._lock:
            e = self._recent.get(run_id)
            if e is not None:
                return e.get("state")
            row = self._con.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return row[0] if row is not None else None

    def is_done(self, run_id: str) -> bool:
        """True when the run reached a terminal state here (never rerun)."""
        return self.state(run_id) in TERMINAL

    def is_cancelled(self, run_id: str) -> bool:
        """Whether an operator cancelled ``run_id`` (a cancel record, or the run ended cancelled here)."""
        return run_id in self.cancelled or self.state(run_id) == "cancelled"

    def started(self, run_id: str) -> bool:
        """Whether this node started ``run_id`` (a ledger entry or its run folder exists)."""
        return self.state(run_id) is not None or self.run_dir(run_id).exists()

    def run_dir(self, run_id: str) -> Path:
        """Per-run folder (checkpoints, metrics): ``{state_dir}/runs/{run_id}``."""
        return self.dir / run_id

    # -- writing ---------------------------------------------------------------------------
    def _write(self, sql: str, args: tuple[Any, ...] | list[tuple[Any, ...]]) -> None:
        """One transaction, written through (``synchronous = FULL``) before it returns; ``args``
        a list: the statement once per item."""
        con = self._con
        con.execute("BEGIN IMMEDIATE")
        try:
            if isinstance(args, list):
                con.executemany(sql, args)
            else:
                con.execute(sql, args)
            crash_point("run-ledger", "before-commit")
            con.execute("COMMIT")
        except BaseException:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise

    def remember_cancel(self, run_id: str) -> bool:
        """Remember that an operator cancelled ``run_id`` (written through); False when it was known."""
        with self._lock:
            if run_id in self.cancelled:
                return False
            now = time.time()
            self._write("INSERT OR IGNORE INTO cancelled (run_id, time) VALUES (?, ?)", (run_id, now))
            self.cancelled = {**self.cancelled, run_id: now}
        return True

    def set(self, run_id: str, state: str, round: int = 0, reason: str = "",
            extra: Mapping[str, Any] | None = None) -> None:
        """Record ``run_id``'s state on this node (one transaction, written through); ``extra``
        fields are kept with it (e.g. ``snapshot_last_id``: the newest sample id of the run's data
        snapshot)."""
        entry = {"state": state, "round": int(round), "reason": reason, "time": time.time(), **dict(extra or {})}
        entry["state"] = state  # the row's state column and its entry agree (checked at open)
        with self._lock:
            self._write("INSERT INTO runs (run_id, state, time, compact, entry) VALUES (?, ?, ?, 0, ?) "
                        "ON CONFLICT (run_id) DO UPDATE SET state = excluded.state, time = excluded.time, "
                        "compact = 0, entry = excluded.entry",
                        (run_id, state, entry["time"], json.dumps(entry, sort_keys=True)))
            self._recent[run_id] = entry

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the file and empty it (after a run ended: the log stays
        small between runs)."""
        with self._lock:
            self._con.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def compact_older(self, keep: int) -> list[str]:
        """Keep the newest ``keep`` ended runs' entries whole and make every older ended run's
        entry its compact summary (:func:`summary`), in one transaction.  Returns the runs made
        compact now."""
        keep = max(0, int(keep))
        marks = ", ".join("?" * len(TERMINAL))
        with self._lock:
            rows = self._con.execute(f"SELECT run_id, entry FROM runs WHERE state IN ({marks}) AND compact = 0 AND "
                                     f"run_id NOT IN (SELECT run_id FROM runs WHERE state IN ({marks}) ORDER BY "
                                     f"time DESC, run_id DESC LIMIT {keep})", (*TERMINAL, *TERMINAL)).fetchall()
            if not rows:
                return []
            self._write("UPDATE runs SET compact = 1, entry = ? WHERE run_id = ?",
                        [(json.dumps(summary(json.loads(text)), sort_keys=True), rid) for rid, text in rows])
            for rid, _ in rows:
                self._recent.pop(rid, None)
        return [rid for rid, _ in rows]


def _take_over_json_ledger(state_dir: Path) -> str | None:
    """Schema 2's part for the run ledger: an earlier release's ``runs/ledger.json`` and
    ``runs/cancelled.json`` taken over into ``runs/ledger.sqlite`` (:meth:`RunLedger._migrate`;
    atomic: the new ledger gets its name only when complete).  None when there is nothing to take
    over.

    Raises:
        RunLedgerDamaged: the earlier release's ledger cannot be read (its one line; the folder
            stays at schema 1, the agent does not start).
    """
    runs = state_dir / "runs"
    if (runs / LEDGER_FILE).exists() or not ((runs / LEGACY_LEDGER).exists() or (runs / LEGACY_CANCELLED).exists()):
        return None
    ledger = RunLedger(state_dir)
    try:
        return f"run ledger moved to SQLite ({ledger.count()} runs, {len(ledger.cancelled)} cancel records)"
    finally:
        ledger.close()


register(Migration(2, "the run ledger moves to SQLite", (f"runs/{LEGACY_LEDGER}", f"runs/{LEGACY_CANCELLED}"),
                   _take_over_json_ledger))
