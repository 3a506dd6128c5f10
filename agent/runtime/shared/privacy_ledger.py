"""The privacy ledger: the device's DP history, append-only and hash-chained, that fails closed.
Torch-free.

**What it holds.**  ``STATE_DIR/privacy/ledger.sqlite`` (SQLite, WAL journal, ``synchronous =
FULL``) holds one row per run that trained under DP (table ``runs``: noise multiplier, sampling
rate, DP steps, δ, clipping bound, the ε of the run alone and a state, ``reserved``, ``spent`` or
``released``; :mod:`dfl_agent.runtime.service.privacy_budget` reserves and settles them).  The device's
composed ε is :func:`~dfl_agent.privacy.accountant.rdp_epsilon` over every reserved and spent row,
plus any amount carried over by a recovery (:mod:`dfl_agent.runtime.service.privacy_recovery`).  Every
change appends an event to a hash chain, and a head marker beside the state folder's ``privacy/``
records the chain's length and head (:mod:`dfl_agent.runtime.shared.privacy_chain`: the format).  Writers
take an exclusive ``flock`` on the ``privacy/`` folder around commit and marker write; readers read
the marker first, then the ledger.

**Checks.**  :meth:`PrivacyLedger.state` (at start, at every admission, and for every read;
cached while the files' size, time and inode stay the same) refuses, with :class:`LedgerDamaged`
(one line naming the file, what is wrong and the recovery command), a ledger that is 0 bytes,
shorter than its own header says, missing while the marker records events, not a readable SQLite
database or failing its integrity check, whose chain is broken (an event changed, removed or
reordered), whose table ``runs`` disagrees with its events, that holds fewer events than the
marker or another chain, or whose marker is missing or unreadable.  DP runs are then declined with
that line; nothing is written to a damaged ledger.

**Migration.**  A ledger of an older release (table ``runs`` and no ``events``) is chained on its
first open: a consistent copy goes to ``privacy/ledger.pre-chain.sqlite`` (SQLite's backup,
fsynced), then one transaction appends a ``migrated`` event per row (oldest first); the ε is the
same before and after.  Logged at INFO.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import crash_point, folder_lock, fsync_dir, rename
from dfl_agent.privacy.accountant import rdp_epsilon
from dfl_agent.privacy.config import PrivacyConfig, merge_privacy, parse_privacy
from dfl_agent.runtime.shared.privacy_chain import (
    COLUMNS,
    EVENTS_DDL,
    FORMAT,
    HEAD_FILE,
    LEDGER_FILE,
    META_DDL,
    PLAN_FIELDS,
    PRE_CHAIN_FILE,
    ROW_STATES,
    RUNS_DDL,
    LedgerDamaged,
    LedgerState,
    canonical,
    file_stat,
    fold_body,
    link_hash,
    read_head,
    sqlite_uri,
    write_head,
)
from dfl_agent.runtime.shared.privacy_chain import apply as apply_event
from dfl_agent.runtime.shared.sqlite_file import cut_short, journal_holds_pages

log = logging.getLogger("dfl_agent.daemon")

__all__ = ["HEAD_FILE", "LEDGER_FILE", "PRE_CHAIN_FILE", "ROW_STATES", "LedgerDamaged", "LedgerState",
           "PrivacyLedger", "read_head"]


class PrivacyLedger:
    """The device's DP history (see the module docstring), one SQLite file and its head marker;
    safe to use from the supervisor and the run process at once (each call is its own
    connection and transaction; writers lock the ``privacy/`` folder).

    Args:
        state_dir: the state directory.

    Every read and write checks the ledger first and raises :class:`LedgerDamaged` (a
    ``ValueError``, one line) when it cannot be trusted; writes also raise ``sqlite3.Error`` or
    ``OSError`` when the disk refuses (nothing half-written).
    """

    def __init__(self, state_dir: str | Path):
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / LEDGER_FILE
        self._cache: tuple[Any, LedgerState | LedgerDamaged] | None = None
        self._cache_lock = threading.Lock()

    # -- opening and checking ---------------------------------------------------------
    def _damaged(self, what: str) -> LedgerDamaged:
        return LedgerDamaged(self.state_dir, what)

    def _key(self) -> tuple[Any, ...]:
        p = self.path
        return (file_stat(self.state_dir / HEAD_FILE), file_stat(p), file_stat(p.with_name(p.name + "-wal")))

    def exists(self) -> bool:
        """Whether there is a ledger or a head marker (a device with a DP history)."""
        return self.path.exists() or (self.state_dir / HEAD_FILE).exists()

    def state(self, fresh: bool = False) -> LedgerState:
        """The verified ledger (an empty one when there is neither a ledger nor a marker); an
        older release's ledger is chained first (migration, see the module docstring).  The
        result is kept while the files' inode, size and modification time stay the same; with
        ``fresh`` the whole chain is checked again (admission).  Do not change what it returns.

        Raises:
            LedgerDamaged: see the module docstring.
            sqlite3.OperationalError: the database cannot be read now (busy past the timeout, no
                permission, an I/O error).
        """
        key = self._key()
        with self._cache_lock:
            if not fresh and self._cache is not None and self._cache[0] == key:
                cached = self._cache[1]
                if isinstance(cached, LedgerDamaged):
                    raise cached
                return cached
        try:
            try:
                st = self._load()
            except _Unchained:
                with self._locked():
                    migrated = self._ensure_chained()
                st = self._load()
                st.migrated = migrated
                key = self._key()
        except LedgerDamaged as exc:
            with self._cache_lock:
                self._cache = (key, exc)
            raise
        with self._cache_lock:
            self._cache = (key, st)
        return st

    def check(self) -> tuple[str, LedgerState | None]:
        """A read-only check (``dflctl privacy verify``): ``("ok", state)``, ``("unchained",
        None)`` for an older release's ledger not yet chained (the agent chains it when it next
        opens it), ``("empty", state)`` with neither ledger nor marker.

        Raises:
            LedgerDamaged: see the module docstring.
        """
        if not self.exists():
            return "empty", LedgerState()
        try:
            return "ok", self._load()
        except _Unchained:
            return "unchained", None

    def at_start(self) -> LedgerState | None:
        """The service's check at start: chain an older release's ledger, catch the marker up
        after a power cut between a commit and its marker, and log a damaged ledger at ERROR (one
        line).  Returns the state, None when damaged or when the device has no DP history."""
        if not self.exists():
            return None
        try:
            st = self.state()
            head = read_head(self.state_dir)
            if head is None or head.get("events") != st.events or head.get("head") != st.head:
                with self._locked():
                    write_head(self.state_dir, self._load())
        except LedgerDamaged as exc:
            log.error("%s", exc)
            return None
        except (sqlite3.Error, OSError) as exc:
            log.error("privacy ledger %s: %s", self.path, exc)
            return None
        return st

    def _connect(self, create: bool = False) -> sqlite3.Connection:
        """A connection; the file is never created unless ``create``."""
        con = sqlite3.connect(sqlite_uri(self.path, "rwc" if create else "rw"), uri=True, timeout=30.0,
                              isolation_level=None)
        con.execute("PRAGMA synchronous = FULL")
        return con

    def _empty_file(self) -> bool:
        """Whether the ledger's file is 0 bytes (and no journal holds its pages)."""
        return self.path.stat().st_size == 0 and not journal_holds_pages(self.path)

    def _load(self, con: sqlite3.Connection | None = None) -> LedgerState:
        """Read and verify the ledger (a new connection unless ``con``, in whose transaction the
        caller reads).  Raises :class:`LedgerDamaged`, or :class:`_Unchained` for an older
        release's ledger."""
        head = read_head(self.state_dir)  # the marker first: the ledger is at least as new
        recorded = head["events"] if head is not None else 0
        if not self.path.exists():
            if recorded > 0:
                raise self._damaged(f"is missing, but its head marker {self.state_dir / HEAD_FILE} records "
                                    f"{recorded} rows")
            return LedgerState(chain=head["chain"] if head else "")
        if self._empty_file():
            if head is not None and recorded == 0:
                return LedgerState(chain=head["chain"])  # created, nothing committed yet (a power cut)
            raise self._damaged("is 0 bytes (truncated)" + (f"; its head marker records {recorded} rows"
                                                            if recorded else ""))
        if (cut := cut_short(self.path)) is not None:
            raise self._damaged(cut)
        try:
            if con is not None:
                return self._verify(con, head)
            with contextlib.closing(self._connect()) as con:
                con.execute("BEGIN")  # one consistent snapshot
                return self._verify(con, head)
        except sqlite3.OperationalError:  # busy, locked, no permission, an I/O error: not the file's content
            raise
        except sqlite3.DatabaseError as exc:  # not a database, malformed
            raise self._damaged(f"is not a readable SQLite database ({exc})") from None

    def _verify(self, con: sqlite3.Connection, head: dict[str, Any] | None) -> LedgerState:
        recorded = head["events"] if head is not None else 0
        check = con.execute("PRAGMA quick_check").fetchall()
        if [tuple(r) for r in check] != [("ok",)]:
            first = " ".join(str(check[0][0]).split())[:160]
            raise self._damaged(f"fails SQLite's integrity check ({first})")
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "events" not in tables:
            if "runs" not in tables:  # a database without a ledger in it
                if recorded > 0:
                    raise self._damaged(f"holds no ledger, but its head marker records {recorded} rows")
                return LedgerState(chain=head["chain"] if head else "")
            if recorded > 0:
                raise self._damaged(f"has no hash chain (an older release's format), but its head marker records "
                                    f"{recorded} rows")
            raise _Unchained()
        if head is None:
            raise self._damaged(f"its head marker {self.state_dir / HEAD_FILE} is missing")
        meta = dict(con.execute("SELECT key, value FROM meta").fetchall()) if "meta" in tables else {}
        chain = meta.get("chain", "")
        if meta.get("format") != str(FORMAT) or not chain:
            raise self._damaged("has no chain id (table meta)")
        if recorded > 0 and head["chain"] != chain:
            raise self._damaged(f"is another ledger than the one its head marker records (chain {chain[:12]}, "
                                f"marker {head['chain'][:12]})")
        try:
            base, prev = int(meta.get("base_seq", "0")), str(meta.get("base_head", chain))
        except ValueError:
            raise self._damaged(f"has a malformed start of its chain (table meta: base_seq {meta.get('base_seq')!r})") \
                from None
        if base and recorded < base:
            raise self._damaged(f"starts its history after row {base}, but its head marker records only {recorded} "
                                "rows")
        if base and recorded == base and head["head"] != prev:
            raise self._damaged(f"the start of its history (after row {base}) is not the row its head marker records")
        st = LedgerState(chain=chain, head=prev, events=base, base=base)
        for seq, run_id, kind, body, digest in con.execute("SELECT seq, run_id, kind, body, hash FROM events "
                                                           "ORDER BY seq"):
            if seq == base + 1 and base and kind != "fold":
                raise self._damaged(f"row {seq} of its history follows a fold but is no fold")
            if seq != st.events + 1:
                raise self._damaged(f"row {st.events + 1} of its history is missing (the rows go on at {seq})")
            if not (isinstance(run_id, str) and isinstance(kind, str) and isinstance(body, str)) or \
                    link_hash(prev, seq, run_id, kind, body) != digest:
                raise self._damaged(f"row {seq} of its history (run {run_id}, {kind}) was changed: its hash does "
                                    "not match")
            try:
                apply_event(st, run_id, kind, json.loads(body))
            except (ValueError, KeyError, TypeError) as exc:
                raise self._damaged(f"row {seq} of its history: {exc}") from None
            st.events, st.head, prev = seq, digest, digest
            if seq == recorded and digest != head["head"]:
                raise self._damaged(f"row {seq} of its history is not the one its head marker records")
        if st.events < recorded:
            raise self._damaged(f"holds {st.events} rows of history, but its head marker records {recorded}: rows "
                                "were removed")
        table = {r[0]: dict(zip(COLUMNS, r)) for r in con.execute(f"SELECT {', '.join(COLUMNS)} FROM runs")}
        for run_id in sorted(set(table) | set(st.rows)):
            a, b = table.get(run_id), st.rows.get(run_id)
            if a is None or b is None:
                raise self._damaged(f"table runs {'lacks' if a is None else 'has an extra row for'} run {run_id} "
                                    "(its history says otherwise)")
            for col in COLUMNS:
                if a[col] != b[col]:
                    raise self._damaged(f"table runs disagrees with its history at run {run_id}: {col} {a[col]!r}, "
                                        f"the history says {b[col]!r}")
        return st

    # -- writing ------------------------------------------------------------------------
    def _locked(self) -> contextlib.AbstractContextManager[None]:
        """An exclusive ``flock`` on the ``privacy/`` folder (writers: commit and marker together)."""
        return folder_lock(self.path.parent)

    def _create(self, chain: str) -> None:
        """A new, empty chained ledger with chain id ``chain`` (the marker is written first)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_head(self.state_dir, LedgerState(chain=chain, head=chain))
        for suffix in ("", "-wal", "-shm"):  # a 0-byte file of a power cut at creation
            self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
        with contextlib.closing(self._connect(create=True)) as con:
            _begin_chained(con, chain)
            con.execute("COMMIT")
        fsync_dir(self.path.parent)

    def _ensure_chained(self) -> int:
        """Chain an older release's ledger (see the module docstring; the caller holds the lock
        and another process may have chained it since).  Returns the rows chained (0: nothing to do)."""
        if not self.path.exists() or self._empty_file():
            return 0
        try:
            with contextlib.closing(self._connect()) as con:
                tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError:
            return 0  # the check that follows names what is wrong
        head = read_head(self.state_dir)
        if "events" in tables or "runs" not in tables or (head is not None and head["events"] > 0):
            return 0
        backup = self.state_dir / PRE_CHAIN_FILE
        if backup.exists():
            backup = backup.with_name(f"ledger.pre-chain-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.sqlite")
        tmp = backup.with_name(f".{backup.name}.tmp{os.getpid()}")
        with contextlib.closing(self._connect()) as src, contextlib.closing(sqlite3.connect(tmp)) as dst:
            src.backup(dst)  # a consistent copy, whatever the journal holds
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        rename(tmp, backup)
        chain = secrets.token_hex(16)
        write_head(self.state_dir, LedgerState(chain=chain, head=chain))  # 0 events: a crash here chains again
        con = self._connect()
        try:
            _begin_chained(con, chain)  # table runs, an older release's, stays as it is
            rows = [dict(zip(COLUMNS, r)) for r in con.execute(f"SELECT {', '.join(COLUMNS)} FROM runs "
                                                                "ORDER BY time, run_id")]
            st = LedgerState(chain=chain, head=chain)
            for row in rows:
                self._append(con, st, row["run_id"], "migrated", row)
            crash_point("privacy-ledger", "before-commit")
            con.execute("COMMIT")
        except BaseException:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise
        finally:
            con.close()
        write_head(self.state_dir, st)
        log.info("privacy ledger %s: chained its %d rows (written by an older release); a copy of the file before "
                 "is kept as %s", self.path, len(rows), backup)
        return max(1, len(rows))

    def _append(self, con: sqlite3.Connection, st: LedgerState, run_id: str, kind: str,
                body: dict[str, Any]) -> None:
        """Append one event in the caller's transaction, fold it into ``st`` and write its row of
        table ``runs``."""
        text = canonical(body)
        seq = st.events + 1
        digest = link_hash(st.head, seq, run_id, kind, text)
        apply_event(st, run_id, kind, json.loads(text))
        con.execute("INSERT INTO events (seq, run_id, kind, body, hash) VALUES (?, ?, ?, ?, ?)",
                    (seq, run_id, kind, text, digest))
        if kind == "fold":  # the whole state: table runs is rewritten
            con.execute("DELETE FROM runs")
            con.executemany(f"INSERT INTO runs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                            [tuple(r[c] for c in COLUMNS) for r in st.rows.values()])
        elif kind != "opening":
            row = st.rows[run_id]
            con.execute(f"INSERT OR REPLACE INTO runs ({', '.join(COLUMNS)}) VALUES "
                        f"({', '.join('?' * len(COLUMNS))})", tuple(row[c] for c in COLUMNS))
        st.events, st.head = seq, digest

    def _write(self, events: Callable[[LedgerState], list[tuple[str, str, dict[str, Any]]]],
               after: Callable[[sqlite3.Connection, LedgerState], None] | None = None) -> LedgerState:
        """Append the events ``events(state)`` returns (``(run_id, kind, body)``; none: nothing
        written) in one transaction (``after(con, state)`` then runs in it, when there were
        events), then the marker.

        Raises:
            LedgerDamaged: the ledger cannot be trusted (nothing written).
        """
        with self._locked():
            if not self.path.exists() or self._empty_file():
                head = self._load()  # raises when the marker says a ledger existed
                self._create(head.chain or secrets.token_hex(16))
            self._ensure_chained()
            self.state()  # a damaged ledger is named here, before anything is written
            con = self._connect()
            try:
                con.execute("BEGIN IMMEDIATE")
                key = self._key()
                with self._cache_lock:  # unchanged since it was checked: no other writer can change it now
                    cached = self._cache[1] if self._cache is not None and self._cache[0] == key else None
                if isinstance(cached, LedgerState):
                    st = copy.deepcopy(cached)
                    st.migrated = 0
                else:
                    try:
                        st = self._load(con)
                    except _Unchained:  # pragma: no cover - chained just above
                        raise self._damaged("could not be chained") from None
                todo = events(st)
                for run_id, kind, body in todo:
                    self._append(con, st, run_id, kind, body)
                if todo and after is not None:
                    after(con, st)
                if todo:
                    crash_point("privacy-ledger", "before-commit")
                con.execute("COMMIT")
                if todo:  # committed, its journal not yet folded into the file, no marker yet
                    crash_point("privacy-ledger", "committed")
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise
            finally:
                con.close()
            if todo:
                write_head(self.state_dir, st)
                crash_point("privacy-ledger", "marked")
            with self._cache_lock:  # what was just written, as the files now are
                self._cache = (self._key(), st)
        return copy.deepcopy(st)

    def fold(self, keep: int) -> int:
        """Fold the runs older than the newest ``keep`` (see
        :mod:`~dfl_agent.runtime.shared.privacy_chain`: one ``fold`` event, the events before it
        deleted, all in one transaction, then the marker), once more than ``keep`` of them could
        be folded.  Nothing is folded while the marker lags the ledger (a power cut between a
        commit and its marker: :meth:`at_start` catches it up first).  Returns how many runs were
        folded or dropped (0: nothing done).

        Raises:
            LedgerDamaged: the ledger cannot be trusted (nothing written).
        """
        if not self.path.exists():
            return 0
        st, head = self.state(), read_head(self.state_dir)  # checked as the files are (kept while unchanged)
        if head is None or head.get("events") != st.events or head.get("head") != st.head:
            return 0
        before: list[int] = []

        def events(st: LedgerState) -> list[tuple[str, str, dict[str, Any]]]:
            body = fold_body(st, keep)
            if body is None:
                return []
            before.extend((len(st.rows), st.events))  # the runs not folded yet; the base
            return [("", "fold", body)]

        def after(con: sqlite3.Connection, st: LedgerState) -> None:  # in the fold's transaction
            base = before[1]
            prev = con.execute("SELECT hash FROM events WHERE seq = ?", (base,)).fetchone()
            con.execute("DELETE FROM events WHERE seq <= ?", (base,))
            con.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                            [("base_seq", str(base)), ("base_head", prev[0] if prev else st.chain)])
            st.base = base

        st = self._write(events, after)
        if not before:
            return 0
        gone = before[0] - len(st.rows)
        log.info("privacy ledger %s: folded %d older run(s) into the composed RDP curve (the newest %d kept as they "
                 "are; the composed epsilon is unchanged)", self.path, gone, keep)
        return gone

    # -- the ledger's operations (privacy_budget, dp_run) -------------------------------
    def entries(self) -> list[dict[str, Any]]:
        """Every row, oldest first (``[]`` when the ledger does not exist yet).

        Raises:
            LedgerDamaged: the ledger cannot be trusted.
        """
        rows = self.state().rows.values()
        return [dict(r) for r in sorted(rows, key=lambda r: (r["time"], r["run_id"]))]

    def get(self, run_id: str) -> dict[str, Any] | None:
        """``run_id``'s row, or None.

        Raises:
            LedgerDamaged: the ledger cannot be trusted.
        """
        row = self.state().rows.get(run_id)
        return dict(row) if row is not None else None

    def reserve(self, run_id: str, plan: Any, rounds: int, *, replace: bool = False) -> None:
        """Reserve ``plan``'s spend (a :class:`~dfl_agent.privacy.plan.RunPlan`) for ``run_id``
        (state ``reserved``).  A run that holds a row keeps it (a restart admits its run again),
        unless ``replace`` and the row is still reserved (the run process's own plan, with the N it
        trains on: a ``replan`` event).

        Raises:
            LedgerDamaged: the ledger cannot be trusted (nothing reserved).
        """
        per_round = plan.steps // rounds if rounds > 0 else plan.steps
        body = {"noise_multiplier": float(plan.noise_multiplier), "sample_rate": float(plan.sample_rate),
                "steps": int(plan.steps), "planned_steps": int(plan.steps), "steps_per_round": int(per_round),
                "delta": float(plan.delta), "max_grad_norm": float(plan.max_grad_norm), "epsilon": float(plan.epsilon)}

        def events(st: LedgerState) -> list[tuple[str, str, dict[str, Any]]]:
            row = st.rows.get(run_id)
            if row is None:
                return [(run_id, "reserve", {**body, "time": time.time()})]
            if replace and row["state"] == "reserved" and any(row[k] != body[k] for k in PLAN_FIELDS):
                return [(run_id, "replan", body)]
            return []

        self._write(events)

    def mark_trained(self, run_id: str) -> None:
        """Note that ``run_id`` started training here (its reservation is no longer released)."""
        self._write(lambda st: [(run_id, "trained", {})] if run_id in st.rows and not st.rows[run_id]["trained"]
                    else [])

    def settle(self, run_id: str, steps: int) -> dict[str, Any] | None:
        """A reserved run ended: ``spent`` with the ``steps`` it took (0: ``released``); its ε is
        recomputed for them.  Returns the row (None without one; a settled row is left as it is)."""
        steps = max(0, int(steps))

        def events(st: LedgerState) -> list[tuple[str, str, dict[str, Any]]]:
            row = st.rows.get(run_id)
            if row is None or row["state"] != "reserved":
                return []
            eps = rdp_epsilon([(row["noise_multiplier"], row["sample_rate"], steps)], row["delta"])
            return [(run_id, "settle", {"state": "spent" if steps else "released", "steps": steps,
                                        "epsilon": float(eps), "settled": time.time()})]

        row = self._write(events).rows.get(run_id)
        return dict(row) if row is not None else None

    def history(self, exclude: str | None = None) -> list[tuple[float, float, int]]:
        """``(noise_multiplier, sample_rate, steps)`` of every reserved or spent row (but ``exclude``)."""
        return self.state().history(exclude)

    def epsilon(self, delta: float, exclude: str | None = None,
                plus: Sequence[tuple[float, float, int]] = ()) -> float:
        """The composed ε at ``delta`` over the device's history (but ``exclude``) and ``plus``,
        with any amount a recovery carried over (:meth:`LedgerState.epsilon`)."""
        return self.state().epsilon(delta, exclude, plus)


def _begin_chained(con: sqlite3.Connection, chain: str) -> None:
    """Begin ``con``'s write transaction (WAL journal) and make its tables those of a chained ledger
    (those missing), with chain id ``chain`` in table ``meta``."""
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("BEGIN IMMEDIATE")
    for ddl in (RUNS_DDL, EVENTS_DDL, META_DDL):
        con.execute(ddl)
    con.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", [("format", str(FORMAT)), ("chain", chain)])


class _Unchained(Exception):
    """An older release's ledger, read without migrating it."""


def device_privacy(cfg: Any, profile: Any) -> PrivacyConfig:
    """The device's privacy settings: the node's ``[privacy]`` over the profile's.

    Raises:
        ValueError: one line naming the key.
    """
    return parse_privacy(merge_privacy(getattr(profile, "privacy", None), cfg.privacy), "privacy")


def deployment_privacy(cfg: Any, state_dir: str | Path, run_id: str) -> dict[str, Any] | None:
    """The deployment manifest's ``privacy``: the ε of the run that trained the model (its
    reservation) and the device's composed lifetime ε at deployment, with δ; None when the run
    has no row in the privacy ledger (no DP)."""
    ledger = PrivacyLedger(state_dir)
    try:
        row = ledger.get(run_id)
        if row is None:
            return None
        try:
            from dfl_agent.profiles import resolve_profile

            life = device_privacy(cfg, resolve_profile(cfg.profile, cfg.profile_overrides)[0]).lifetime_epsilon
        except (ValueError, LookupError, OSError):
            life = None
        delta = float(row["delta"])
        return {"epsilon_run": round(float(row["epsilon"]), 4), "epsilon_lifetime": round(ledger.epsilon(delta), 4),
                "lifetime_epsilon": life, "delta": delta, "noise_multiplier": row["noise_multiplier"],
                "sample_rate": row["sample_rate"], "steps": int(row["steps"]), "max_grad_norm": row["max_grad_norm"]}
    except (LedgerDamaged, sqlite3.Error, OSError) as exc:
        log.warning("privacy ledger unreadable for the manifest: %s", exc)
        return None
