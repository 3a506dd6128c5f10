"""The state folder's schema version, and the migrations that bring an older folder forward.

``STATE_DIR/state_version`` (JSON, written atomically) records the schema of the whole state
folder, one integer for every file in it::

    {"schema": 2, "release": "0.2.0",
     "migrations": [{"from": 1, "to": 2, "name": "...", "release": "0.2.0", "time": unix s,
                     "backup": "state-backup/schema-1-20261202T101500Z" | null, "did": "..."}]}

A folder without the file was written by release 0.1.0 (schema 1), unless it is missing or
empty (a new device: it gets this release's schema at once).  :func:`open_state` runs at every
start of the agent (:func:`~dfl_agent.runtime.service.run_manager.build_run_manager`), before
anything else reads the folder:

* a folder of this release's schema (:data:`STATE_VERSION`) is used as it is;
* an older one is migrated forward, one schema at a time, by the registered steps
  (:data:`MIGRATIONS`, keyed by the schema each step produces).  Before a step runs, the files it
  may rewrite (:attr:`Migration.rewrites`) are copied to ``STATE_DIR/state-backup/schema-N-TIME/``
  (SQLite files through SQLite's backup, so the copy is consistent whatever its journal holds;
  the copy is complete and fsynced before it gets its name); after it ran, ``state_version``
  records the new schema.  Each step is atomic or idempotent, so a power cut during a migration
  leaves the folder at the last schema recorded and the next start runs the step again;
* a newer one (written by a later release) is refused with :class:`StateVersionError`, one line
  naming the folder, its schema, the release that wrote it and what to do: the agent exits 2 and
  changes nothing.

Adding a migration: write the step (``apply(state_dir) -> str | None``: what it did, or None
when there was nothing to do), :func:`register` it with ``to = STATE_VERSION + 1`` and the
paths it may rewrite, and raise :data:`STATE_VERSION` by one.  A schema's step may have several
parts, registered by the modules that own the files (a service file's part by the service
module, since this module is shared and imports no service code): their files are copied to one
backup first, then the parts run in the order registered.  Torch-free.

Schemas: 1: release 0.1.0.  2: release 0.2.0: the privacy ledger is hash-chained
(:mod:`dfl_agent.runtime.shared.privacy_ledger`, registered here) and the run ledger moves from
``runs/ledger.json`` and ``runs/cancelled.json`` to ``runs/ledger.sqlite``
(:mod:`dfl_agent.runtime.service.ledger`, registered there).

Order at the agent's start: this migration first, then the run ledger opens and every state
file is checked (:func:`dfl_agent.runtime.service.state_files.open_checked`,
:mod:`dfl_agent.runtime.service.state_files`), so the checks see the folder in this release's
schema.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dfl_agent import __version__
from dfl_agent.fsutil import atomic_write, fsync_dir, rename
from dfl_agent.jsonbound import JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.shared.assembly import StartupError

log = logging.getLogger("dfl_agent.state")

#: the file that records the state folder's schema
STATE_FILE = "state_version"
#: where a migration keeps the files it rewrote, one folder per step
BACKUP_DIR = "state-backup"
#: the schema of a folder without :data:`STATE_FILE` (written by release 0.1.0)
FIRST_SCHEMA = 1
#: the schema this release writes and reads
STATE_VERSION = 2
#: entries of ``migrations`` kept in :data:`STATE_FILE` (the oldest are dropped)
MAX_HISTORY = 32


class StateVersionError(StartupError):
    """The state folder cannot be used by this release: written by a newer release (its schema
    above :data:`STATE_VERSION`), or its :data:`STATE_FILE` is unreadable.  The message is one line
    naming the folder and what to do."""


@dataclasses.dataclass(frozen=True)
class Migration:
    """One step of the state folder's schema, from ``to - 1`` to ``to``.

    Attributes:
        to: the schema the step produces.
        name: what it does, in a few words (logged, recorded in :data:`STATE_FILE`).
        rewrites: the paths (relative to the state folder: files or folders) the step may change;
            those that exist are copied to the step's backup before it runs.
        apply: ``apply(state_dir)`` makes the change: atomic (one SQLite transaction, an atomic
            file replacement) or idempotent, since a step cut short runs again at the next start.
            Returns a short account of what it did, or None when the folder had nothing to change.
    """

    to: int
    name: str
    rewrites: tuple[str, ...]
    apply: Callable[[Path], str | None]


#: the registered steps, keyed by the schema each produces (``2`` migrates schema 1 to 2): the
#: parts of each step, in the order they run
MIGRATIONS: dict[int, list[Migration]] = {}


def register(migration: Migration) -> Migration:
    """Add ``migration`` to :data:`MIGRATIONS` (a part of the step to ``migration.to``).

    Raises:
        ValueError: a part of that name is registered already for that schema, or ``to`` is below 2.
    """
    parts = MIGRATIONS.setdefault(migration.to, []) if migration.to > FIRST_SCHEMA else None
    if parts is None or any(m.name == migration.name for m in parts):
        raise ValueError(f"the state migration to schema {migration.to} ({migration.name}) is registered already "
                         f"or impossible")
    parts.append(migration)
    return migration


@dataclasses.dataclass
class StateInfo:
    """What :func:`open_state` found and did.

    Attributes:
        path: the state folder.
        schema: its schema now (:data:`STATE_VERSION`).
        found: its schema before (``None``: a new folder).
        migrated: the steps applied now, oldest first (the entries added to ``migrations``).
    """

    path: Path
    schema: int
    found: int | None
    migrated: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def read_state_version(state_dir: str | os.PathLike[str]) -> tuple[int | None, dict[str, Any]]:
    """The schema of ``state_dir`` and its :data:`STATE_FILE` document: ``(None, {})`` for a new
    folder (missing or empty), ``(FIRST_SCHEMA, {})`` for one without the file.

    Raises:
        StateVersionError: the file is unreadable or holds no schema number.
    """
    d = Path(state_dir)
    path = d / STATE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        try:
            empty = not any(d.iterdir())
        except FileNotFoundError:
            empty = True
        return (None if empty else FIRST_SCHEMA), {}
    except OSError as exc:
        raise StateVersionError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        doc = bounded_loads(raw, max_bytes=1 << 20)
    except JSONBoundError as exc:
        raise StateVersionError(f"{path} is not a state version document ({exc}); it records the state folder's "
                                f"schema: restore it (dfl-agent {__version__} writes schema {STATE_VERSION})") from None
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < FIRST_SCHEMA:
        raise StateVersionError(f"{path} holds no schema number (\"schema\": an integer >= {FIRST_SCHEMA}); it records "
                                f"the state folder's schema: restore it")
    return schema, doc


def open_state(state_dir: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> StateInfo:
    """Check the state folder's schema and migrate it to :data:`STATE_VERSION` (see the module
    docstring); a new folder is created with this schema.

    Raises:
        StateVersionError: the folder was written by a newer release, or its :data:`STATE_FILE`
            is unreadable (nothing is changed).
        StartupError: a migration step failed (the folder stays at the last schema recorded; the
            message names the step and the error).
        OSError: the folder cannot be created or written.
    """
    d = Path(state_dir)
    found, doc = read_state_version(d)
    info = StateInfo(d, STATE_VERSION, found)
    if found is None:  # a new device
        d.mkdir(parents=True, exist_ok=True)
        _write(d, {"schema": STATE_VERSION, "release": __version__, "migrations": []})
        return info
    if found > STATE_VERSION:
        by = doc.get("release")
        raise StateVersionError(
            f"the state folder {d} has schema {found}" + (f", written by dfl-agent {by}" if isinstance(by, str) else "")
            + f"; this dfl-agent {__version__} reads schema {STATE_VERSION} and older: run the newer release, or "
            f"restore the copy its migration kept in {d / BACKUP_DIR} (docs: operations, roll back an upgrade)")
    history = list(doc.get("migrations") or []) if isinstance(doc.get("migrations"), list) else []
    for to in range(found + 1, STATE_VERSION + 1):
        parts = MIGRATIONS.get(to, [])
        backup = _backup(d, [rel for m in parts for rel in m.rewrites], to - 1, clock())
        done: list[str] = []
        for step in parts:
            try:
                did = step.apply(d)
            except StartupError:  # the part's own one line, naming its recovery; the schema is not raised
                raise
            except Exception as exc:
                raise StartupError(f"the state folder {d}: migration to schema {to} ({step.name}) failed: "
                                   f"{type(exc).__name__}: {exc}; it stays at schema {to - 1}"
                                   + (f" (a copy of its files before is in {backup})" if backup else "")) from exc
            if did:
                done.append(did)
        entry = {"from": to - 1, "to": to, "name": "; ".join(m.name for m in parts), "release": __version__,
                 "time": round(clock(), 3), "backup": str(backup.relative_to(d)) if backup is not None else None,
                 "did": "; ".join(done) or None}
        history = (history + [entry])[-MAX_HISTORY:]
        _write(d, {"schema": to, "release": __version__, "migrations": history})
        info.migrated.append(entry)
        log.info("state folder %s: schema %d -> %d (%s)%s%s", d, to - 1, to, entry["name"],
                 f": {entry['did']}" if entry["did"] else ": nothing to change",
                 f"; the files before are kept in {backup}" if backup is not None else "")
    return info


def _write(d: Path, doc: dict[str, Any]) -> None:
    atomic_write(d / STATE_FILE, json.dumps(doc, sort_keys=True, indent=1) + "\n")


def _backup(d: Path, rewrites: list[str], schema: int, now: float) -> Path | None:
    """Copy the files a step may rewrite (``rewrites``) to ``STATE_DIR/state-backup/schema-{schema}-TIME/``
    (built under a hidden name, fsynced, then renamed into place); None when none of them exists."""
    present = [rel for rel in rewrites if (d / rel).exists()]
    if not present:
        return None
    root = d / BACKUP_DIR
    root.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    final = root / f"schema-{schema}-{stamp}"
    n = 1
    while final.exists():
        n += 1
        final = root / f"schema-{schema}-{stamp}-{n}"
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for rel in present:
        src, dst = d / rel, tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, copy_function=_copy_file)
        else:
            _copy_file(str(src), str(dst))
    for folder, _, files in os.walk(tmp):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(folder)
    rename(tmp, final)
    fsync_dir(root)
    return final


def _copy_file(src: str, dst: str) -> str:
    """Copy one file; an SQLite database through SQLite's backup (a consistent copy whatever its
    write-ahead log holds; its ``-wal``/``-shm`` files are then not copied)."""
    if src.endswith(("-wal", "-shm")) and os.path.exists(src[:-4]):
        return dst
    if src.endswith((".sqlite", ".db")):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{src}?mode=ro", uri=True)) as source, \
                    contextlib.closing(sqlite3.connect(dst)) as target:
                source.backup(target)
            return dst
        except sqlite3.DatabaseError:
            pass  # not a readable database: copied byte for byte, as it is
    shutil.copy2(src, dst)
    return dst


# -- the steps ----------------------------------------------------------------------------------


def _chain_privacy_ledger(state_dir: Path) -> str | None:
    """Schema 2: the privacy ledger of release 0.1.0 gets its hash chain (one transaction:
    :meth:`~dfl_agent.runtime.shared.privacy_ledger.PrivacyLedger.state`).  A damaged ledger is
    left as it is: its own check declines DP runs with one line naming the recovery."""
    from dfl_agent.runtime.shared.privacy_chain import LEDGER_FILE, LedgerDamaged
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger

    if not (state_dir / LEDGER_FILE).exists():
        return None
    try:
        st = PrivacyLedger(state_dir).state()
    except LedgerDamaged as exc:
        log.warning("state folder %s: the privacy ledger was not chained: %s", state_dir, exc)
        return "privacy ledger damaged: left to its own check"
    return f"privacy ledger chained ({st.migrated} rows)" if st.migrated else None


register(Migration(2, "the privacy ledger is hash-chained", ("privacy", "privacy-head.json"), _chain_privacy_ledger))
