"""SQLite sample store with a validated spool-directory ingestion.

Layout under ``state_dir``::

    store/samples.sqlite       the store (WAL mode; the agent is its only writer)
    spool/                     applications drop ``*.npz`` files here (write, then rename)
    spool/rejected/NAME        a refused file, with NAME.reason (one line)

Spool files are ``np.savez`` archives with ``x`` ``(N, *input_shape)`` (any real
dtype, finite), ``y`` ``(N,)`` integer labels in ``[0, num_classes)``, optional ``t``
``(N,)`` unix timestamps (seconds; default: the ingestion time) and optional
``groups`` ``(N,)`` integer user ids ``>= 0``.

Guarantees:

* **Exactly once.**  A spool file is identified by the SHA-256 of its bytes.  Its
  samples and its hash enter the store in one transaction; the file is unlinked
  only after the commit.  A crash between the two leaves a file whose hash is known:
  the next pass deletes it without adding anything.  So a file is in the store
  exactly once, or still in the spool.
* **Validated.**  ``np.load(..., allow_pickle=False)``; wrong keys, shapes, dtypes,
  non-finite values, labels out of range, object arrays or an unreadable (e.g.
  truncated) archive move the file to ``spool/rejected/`` with a ``.reason`` file;
  the store is unchanged.  Files modified less than ``settle_seconds`` ago are left
  for the next pass (a writer that renamed too early may still be writing).
* **Bounded.**  After each insertion, in the same transaction: samples older than
  ``max_age`` are evicted; then each class above ``max_per_class`` loses its oldest
  samples; then, while the store holds more than ``max_samples``, the oldest samples
  go (``eviction="oldest"``) or the oldest samples of the currently largest classes
  (``eviction="largest-class"``, so a rare class is not evicted by a frequent one).
  A committed store never holds more than ``max_samples``.
* **Validation slice.**  A sample belongs to the validation slice when a hash of
  its id falls below ``validation_share`` (:func:`validation_mask`): stable as data
  arrives and independent of the other samples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.fsutil import atomic_writer, rename

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DB_NAME = "samples.sqlite"
MAX_FILE_BYTES = 512 * 1024 * 1024
#: spool (and spool/rejected) mode: group-writable, setgid (files keep the agent's group)
SPOOL_MODE = 0o2770


class StoreError(ValueError):
    """A store that cannot be opened or used (bad schema, mismatch with the config)."""


class RejectedFile(ValueError):
    """A spool file that failed validation; ``args[0]`` is the one-line reason."""


def parse_duration(text: str | None) -> float | None:
    """``"30d"``, ``"12h"``, ``"45m"``, ``"90s"`` (or a bare number of seconds) -> seconds;
    ``None``, ``""`` or ``"none"`` -> None.

    Raises:
        ValueError: any other text.
    """
    if text is None or str(text).strip().lower() in ("", "none"):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. '30d', '12h', '90s' or 'none')")
    mult = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]
    return float(m.group(1)) * mult


def validation_mask(ids: np.ndarray, share: float) -> np.ndarray:
    """Bool ``(n,)``: which sample ids are in the validation slice.

    A sample is held out when ``blake2b(id) / 2**64 < share``: deterministic per id,
    so the slice stays stable as data arrives and is evicted.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.zeros(ids.shape[0], dtype=bool)
    for i, sid in enumerate(ids.tolist()):
        h = hashlib.blake2b(int(sid).to_bytes(8, "little", signed=True), digest_size=8, person=b"dfl-val").digest()
        out[i] = int.from_bytes(h, "little") / 2.0**64 < share
    return out


@dataclasses.dataclass(frozen=True)
class Schema:
    """What a sample must look like: ``input_shape`` of one sample, ``num_classes``,
    and ``class_names`` (default ``"0"``, ``"1"``, ...)."""

    input_shape: tuple[int, ...]
    num_classes: int
    class_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.input_shape)
        if not shape or any(s < 1 for s in shape):
            raise StoreError(f"data.input_shape: must be a non-empty list of positive sizes, got {list(shape)}")
        if int(self.num_classes) < 1:
            raise StoreError(f"data.num_classes: must be >= 1, got {self.num_classes}")
        names = tuple(str(c) for c in self.class_names) or tuple(str(i) for i in range(int(self.num_classes)))
        if len(names) != int(self.num_classes):
            raise StoreError(f"data.class_names: {len(names)} names for num_classes={self.num_classes}")
        object.__setattr__(self, "input_shape", shape)
        object.__setattr__(self, "num_classes", int(self.num_classes))
        object.__setattr__(self, "class_names", names)

    def to_json(self) -> str:
        return json.dumps({"input_shape": list(self.input_shape), "num_classes": self.num_classes,
                           "class_names": list(self.class_names)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Schema:
        d = json.loads(text)
        return cls(tuple(d["input_shape"]), int(d["num_classes"]), tuple(d.get("class_names") or ()))

    @classmethod
    def from_meta(cls, path: str | os.PathLike[str]) -> Schema:
        """From a ``meta.json`` (FORMAT.md keys plus ``input_shape``).

        Raises:
            StoreError: unreadable file, missing ``input_shape`` or class information.
        """
        p = Path(path)
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StoreError(f"{p}: unreadable meta.json ({exc})") from None
        if not isinstance(d, dict) or "input_shape" not in d:
            raise StoreError(f"{p}: input_shape: missing (the store needs the shape of one sample)")
        names = d.get("class_names") or ()
        k = d.get("num_classes", len(names))
        if not k:
            raise StoreError(f"{p}: num_classes: missing (give num_classes or class_names)")
        return cls(tuple(d["input_shape"]), int(k), tuple(names))


def _check_arrays(z: Any, schema: Schema) -> dict[str, np.ndarray]:
    """Validate an opened npz; returns x (float32), y (int64), t (float64|None), groups (int64|None)."""
    out: dict[str, Any] = {}
    for key in ("x", "y", "t", "groups"):
        if key not in z.files:
            if key in ("x", "y"):
                raise RejectedFile(f"{key}: missing (the file must hold arrays 'x' and 'y')")
            out[key] = None
            continue
        try:
            out[key] = z[key]
        except ValueError as exc:
            if "pickle" in str(exc).lower() or "object" in str(exc).lower():
                raise RejectedFile(f"{key}: object array refused (store plain numeric arrays)") from None
            raise RejectedFile(f"{key}: unreadable array ({exc})") from None
        except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
            raise RejectedFile(f"{key}: unreadable array, truncated or corrupt ({type(exc).__name__})") from None
    x, y = out["x"], out["y"]
    if x.dtype.hasobject or y.dtype.hasobject:
        raise RejectedFile("object array refused (store plain numeric arrays)")
    if x.dtype.kind not in "iuf":
        raise RejectedFile(f"x: dtype {x.dtype} is not a real number type")
    if x.ndim < 1 or tuple(x.shape[1:]) != schema.input_shape:
        raise RejectedFile(f"x: shape {tuple(x.shape)} does not match (N, {', '.join(map(str, schema.input_shape))})")
    n = x.shape[0]
    if n == 0:
        raise RejectedFile("x: no samples")
    if y.dtype.kind not in "iu":
        raise RejectedFile(f"y: dtype {y.dtype} is not an integer type")
    if y.shape != (n,):
        raise RejectedFile(f"y: shape {tuple(y.shape)}, expected ({n},)")
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x32).all():
        raise RejectedFile("x: non-finite values (NaN or inf)")
    if y.min() < 0 or y.max() >= schema.num_classes:
        raise RejectedFile(f"y: labels must lie in [0, {schema.num_classes}), got [{y.min()}, {y.max()}]")
    t = out["t"]
    if t is not None:
        if t.dtype.kind not in "iuf" or t.shape != (n,) or not np.isfinite(t.astype(np.float64)).all():
            raise RejectedFile(f"t: must be ({n},) finite unix timestamps, got {t.dtype} {tuple(t.shape)}")
        t = t.astype(np.float64)
    g = out["groups"]
    if g is not None:
        if g.dtype.kind not in "iu" or g.shape != (n,) or (n and g.min() < 0):
            raise RejectedFile(f"groups: must be ({n},) integers >= 0, got {g.dtype} {tuple(g.shape)}")
        g = g.astype(np.int64)
    return {"x": x32, "y": y.astype(np.int64), "t": t, "groups": g}


def validate_bytes(data: bytes, schema: Schema) -> dict[str, np.ndarray]:
    """Parse and validate the bytes of one spool file (see the module docstring).

    Raises:
        RejectedFile: with the one-line reason.
    """
    if not data.startswith(b"PK\x03\x04"):
        raise RejectedFile("not an .npz archive (empty, truncated or another format)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise RejectedFile("not an .npz archive (a single .npy array)")
            return _check_arrays(z, schema)
    except RejectedFile:
        raise
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise RejectedFile("object array refused (store plain numeric arrays)") from None
        raise RejectedFile(f"unreadable archive ({exc})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise RejectedFile(f"unreadable archive, truncated or corrupt ({type(exc).__name__}: {exc})") from None


class SampleStore:
    """The store of one agent (see the module docstring).

    Args:
        state_dir: the agent's state directory (``store/`` and ``spool/`` go there).
        schema: the expected samples; None = the schema recorded in the store (an
            existing store) - a new store needs one.
        spool_dir: default ``state_dir/spool``.
        max_samples: most samples kept (>= 1).
        max_age: seconds a sample is kept (None: no limit).
        max_per_class: most samples per class (0: no limit).
        eviction: ``"oldest"`` or ``"largest-class"`` (what goes when over ``max_samples``).
        settle_seconds: spool files younger than this are left for the next pass.

    Raises:
        StoreError: no schema for a new store, or ``schema`` differs from the stored one.
    """

    def __init__(self, state_dir: str | os.PathLike[str], schema: Schema | None = None, *,
                 spool_dir: str | os.PathLike[str] | None = None, max_samples: int = 100_000,
                 max_age: float | None = None, max_per_class: int = 0, eviction: str = "oldest",
                 settle_seconds: float = 1.0, create: bool = True):
        if max_samples < 1:
            raise StoreError(f"data.store_max_samples: must be >= 1, got {max_samples}")
        if eviction not in ("oldest", "largest-class"):
            raise StoreError(f"data.store_eviction: must be 'oldest' or 'largest-class', got {eviction!r}")
        self.state_dir = Path(state_dir)
        self.spool_dir = Path(spool_dir) if spool_dir else self.state_dir / "spool"
        self.rejected_dir = self.spool_dir / "rejected"
        self.path = self.state_dir / "store" / DB_NAME
        self.max_samples, self.max_age = int(max_samples), max_age
        self.max_per_class, self.eviction = int(max_per_class), eviction
        self.settle_seconds = settle_seconds
        if not create and not self.path.exists():
            raise StoreError(f"no sample store at {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)  # the samples stay private to the agent
        for folder in (self.spool_dir, self.rejected_dir):  # the application's group writes the spool
            folder.mkdir(parents=True, exist_ok=True)
            try:
                os.chmod(folder, SPOOL_MODE)
            except PermissionError:  # a spool that someone else owns: leave its mode
                pass
        self._lock = threading.Lock()
        self.db = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript("""
            CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            CREATE TABLE IF NOT EXISTS files (sha256 TEXT PRIMARY KEY, name TEXT NOT NULL,
                samples INTEGER NOT NULL, ingested REAL NOT NULL);
            CREATE TABLE IF NOT EXISTS samples (id INTEGER PRIMARY KEY AUTOINCREMENT,
                file TEXT NOT NULL, t REAL NOT NULL, y INTEGER NOT NULL, grp INTEGER NOT NULL,
                x BLOB NOT NULL);
            CREATE INDEX IF NOT EXISTS samples_t ON samples (t, id);
            CREATE INDEX IF NOT EXISTS samples_y_t ON samples (y, t, id);
            CREATE TABLE IF NOT EXISTS rejected (sha256 TEXT PRIMARY KEY, name TEXT NOT NULL,
                reason TEXT NOT NULL, time REAL NOT NULL);
            CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
        """)
        row = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            if schema is None:
                raise StoreError(f"{self.path}: a new store needs a schema (data.input_shape and "
                                 "data.num_classes, or a meta.json)")
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (schema.to_json(),))
            self.schema = schema
        else:
            stored = Schema.from_json(row[0])
            if schema is not None and schema != stored:
                raise StoreError(f"{self.path}: the store holds samples of shape {list(stored.input_shape)} with "
                                 f"{stored.num_classes} classes, the configuration says {list(schema.input_shape)} "
                                 f"with {schema.num_classes}; use another state_dir or delete the store")
            self.schema = stored
        self._row_bytes = int(np.prod(self.schema.input_shape)) * 4

    def close(self) -> None:
        self.db.close()

    # -- ingestion ---------------------------------------------------------------
    def spool_files(self) -> list[Path]:
        """``*.npz`` files in the spool (hidden and temporary names skipped), oldest first."""
        if not self.spool_dir.is_dir():
            return []
        files = [p for p in self.spool_dir.iterdir()
                 if p.name.endswith(".npz") and not p.name.startswith(".") and p.is_file()]
        return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))

    def ingest_spool(self, now: float | None = None) -> dict[str, int]:
        """One pass over the spool.  Returns ``{"ingested": files, "samples": n, "rejected": files,
        "duplicates": files, "waiting": files}``.  Never raises for a bad file."""
        out = {"ingested": 0, "samples": 0, "rejected": 0, "duplicates": 0, "waiting": 0}
        for p in self.spool_files():
            try:
                age = time.time() - p.stat().st_mtime
            except FileNotFoundError:
                continue
            if age < self.settle_seconds:
                out["waiting"] += 1
                continue
            try:
                res = self.ingest_file(p, now=now, remove=True)
            except OSError as exc:  # vanished or unreadable: try again next pass
                log.warning("spool file %s: %s", p.name, exc)
                continue
            out[res["status"]] += 1
            out["samples"] += res.get("samples", 0)
        return out

    def ingest_file(self, path: str | os.PathLike[str], *, now: float | None = None,
                    remove: bool = False) -> dict[str, Any]:
        """Ingest one ``.npz`` file (see the module docstring).

        Args:
            path: the file.
            now: ingestion time (default: ``time.time()``), the timestamp of samples without ``t``.
            remove: delete (or, when rejected, move to ``spool/rejected/``) afterwards -
                for spool files; a seed file stays where it is.

        Returns:
            ``{"status": "ingested"|"duplicates"|"rejected", "samples": n, "reason": str, "sha256": hex}``.

        Raises:
            OSError: the file cannot be read.
        """
        p = Path(path)
        if p.stat().st_size > MAX_FILE_BYTES:
            data = b""
            sha = hashlib.sha256(f"oversize:{p.name}:{p.stat().st_size}".encode()).hexdigest()
        else:
            data = p.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
        with self._lock:
            if self.db.execute("SELECT 1 FROM files WHERE sha256=?", (sha,)).fetchone():
                if remove:
                    p.unlink(missing_ok=True)
                return {"status": "duplicates", "samples": 0, "sha256": sha}
            try:
                if not data:
                    raise RejectedFile(f"file larger than {MAX_FILE_BYTES >> 20} MiB")
                arrays = validate_bytes(data, self.schema)
            except RejectedFile as exc:
                reason = str(exc.args[0])
                self._reject(p, sha, reason, remove)
                return {"status": "rejected", "samples": 0, "reason": reason, "sha256": sha}
            n = self._insert(p.name, sha, arrays, time.time() if now is None else now)
            if remove:
                p.unlink(missing_ok=True)
            return {"status": "ingested", "samples": n, "sha256": sha}

    def _reject(self, p: Path, sha: str, reason: str, move: bool) -> None:
        log.warning("rejected spool file %s: %s", p.name, reason)
        self.db.execute("INSERT OR IGNORE INTO rejected VALUES (?, ?, ?, ?)", (sha, p.name, reason, time.time()))
        if not move:
            return
        self.rejected_dir.mkdir(parents=True, exist_ok=True)
        dest = self.rejected_dir / p.name
        if dest.exists():
            dest = self.rejected_dir / f"{p.stem}-{sha[:12]}{p.suffix}"
        (self.rejected_dir / (dest.name + ".reason")).write_text(reason + "\n", encoding="utf-8")
        try:
            rename(p, dest)
        except OSError:
            shutil.move(str(p), str(dest))

    def _insert(self, name: str, sha: str, a: dict[str, np.ndarray], now: float) -> int:
        x, y = a["x"], a["y"]
        n = len(y)
        t = a["t"] if a["t"] is not None else np.full(n, now)
        g = a["groups"] if a["groups"] is not None else np.full(n, -1, np.int64)
        rows = ((sha, float(t[i]), int(y[i]), int(g[i]), x[i].tobytes()) for i in range(n))
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            if db.execute("SELECT 1 FROM files WHERE sha256=?", (sha,)).fetchone():  # another writer won
                db.execute("ROLLBACK")
                return 0
            db.executemany("INSERT INTO samples (file, t, y, grp, x) VALUES (?, ?, ?, ?, ?)", rows)
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?)", (sha, name, n, now))
            db.execute("INSERT INTO counters VALUES ('ingested_samples', ?) ON CONFLICT(key) "
                       "DO UPDATE SET value = value + excluded.value", (n,))
            self._evict(now)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return n

    def _evict(self, now: float) -> None:
        db = self.db
        evicted = 0
        if self.max_age is not None:
            evicted += db.execute("DELETE FROM samples WHERE t < ?", (now - self.max_age,)).rowcount
        if self.max_per_class > 0:
            for y, c in db.execute("SELECT y, COUNT(*) FROM samples GROUP BY y").fetchall():
                if c > self.max_per_class:
                    evicted += self._drop_oldest(c - self.max_per_class, y)
        total = db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
        excess = total - self.max_samples
        if excess > 0:
            if self.eviction == "oldest":
                evicted += self._drop_oldest(excess)
            else:
                counts = dict(db.execute("SELECT y, COUNT(*) FROM samples GROUP BY y").fetchall())
                for y, k in _level_down(counts, excess).items():
                    evicted += self._drop_oldest(k, y)
        if evicted:
            db.execute("INSERT INTO counters VALUES ('evicted_samples', ?) ON CONFLICT(key) "
                       "DO UPDATE SET value = value + excluded.value", (evicted,))

    def _drop_oldest(self, k: int, label: int | None = None) -> int:
        if k <= 0:
            return 0
        args: tuple[int, ...]
        if label is None:
            q, args = "SELECT id FROM samples ORDER BY t, id LIMIT ?", (k,)
        else:
            q, args = "SELECT id FROM samples WHERE y = ? ORDER BY t, id LIMIT ?", (label, k)
        return self.db.execute(f"DELETE FROM samples WHERE id IN ({q})", args).rowcount

    # -- reading -----------------------------------------------------------------
    def count(self) -> int:
        """Samples in the store."""
        return int(self.db.execute("SELECT COUNT(*) FROM samples").fetchone()[0])

    def count_since(self, last_id: int) -> int:
        """Samples that arrived after the sample ``last_id`` (ids grow and are never reused,
        so these are the samples a snapshot ending at ``last_id`` did not have)."""
        with self._lock:
            return int(self.db.execute("SELECT COUNT(*) FROM samples WHERE id > ?", (int(last_id),)).fetchone()[0])

    def snapshot(self) -> np.ndarray:
        """The ids of every sample now in the store, int64 ascending (a run's data)."""
        with self._lock:
            rows = self.db.execute("SELECT id FROM samples ORDER BY id").fetchall()
        return np.asarray([r[0] for r in rows], dtype=np.int64)

    def load(self, ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, x, y, groups)`` for the requested ids still present (evicted ones are skipped):
        int64 ``(n,)``, float32 ``(n, *input_shape)``, int64 ``(n,)``, int64 ``(n,)``, ordered by id."""
        want = np.asarray(ids, dtype=np.int64).reshape(-1)
        got_ids, ys, gs, xs = [], [], [], []
        with self._lock:
            for start in range(0, len(want), 900):
                chunk = want[start:start + 900].tolist()
                q = f"SELECT id, y, grp, x FROM samples WHERE id IN ({','.join('?' * len(chunk))}) ORDER BY id"
                for sid, y, g, x in self.db.execute(q, chunk):
                    got_ids.append(sid)
                    ys.append(y)
                    gs.append(g)
                    xs.append(x)
        order = np.argsort(np.asarray(got_ids, dtype=np.int64), kind="stable")
        shape = (len(xs), *self.schema.input_shape)
        x = np.frombuffer(b"".join(xs), dtype=np.float32).reshape(shape) if xs else np.zeros(shape, np.float32)
        return (np.asarray(got_ids, np.int64)[order], np.ascontiguousarray(x[order]),
                np.asarray(ys, np.int64)[order], np.asarray(gs, np.int64)[order])

    def status(self) -> dict[str, Any]:
        """The ``dflctl data status --json`` document (see the docs)."""
        db = self.db
        per = {str(y): int(c) for y, c in db.execute("SELECT y, COUNT(*) FROM samples GROUP BY y ORDER BY y")}
        oldest, newest = db.execute("SELECT MIN(t), MAX(t) FROM samples").fetchone()
        counters = dict(db.execute("SELECT key, value FROM counters").fetchall())
        rejected = [{"name": n, "sha256": s, "reason": r, "time": t}
                    for s, n, r, t in db.execute("SELECT sha256, name, reason, time FROM rejected ORDER BY time")]
        files = db.execute("SELECT COUNT(*), COALESCE(SUM(samples), 0) FROM files").fetchone()
        return {
            "schema_version": SCHEMA_VERSION,
            "store": str(self.path),
            "samples": sum(per.values()),
            "per_class": per,
            "class_names": list(self.schema.class_names),
            "input_shape": list(self.schema.input_shape),
            "oldest": oldest,
            "newest": newest,
            "ingested_files": int(files[0]),
            "ingested_samples": int(counters.get("ingested_samples", 0)),
            "evicted_samples": int(counters.get("evicted_samples", 0)),
            "rejected": len(rejected),
            "rejected_files": rejected,
            "spool_waiting": len(self.spool_files()),
            "max_samples": self.max_samples,
        }


def _level_down(counts: dict[int, int], excess: int) -> dict[int, int]:
    """How many to drop per class to remove ``excess`` samples, largest classes first
    (water-filling: the classes end at most one apart from a common level)."""
    left = dict(counts)
    drop = {y: 0 for y in counts}
    for _ in range(excess):
        y = max(left, key=lambda k: (left[k], -k))
        if left[y] == 0:
            break
        left[y] -= 1
        drop[y] += 1
    return drop


def copy_into_spool(src: str | os.PathLike[str], spool_dir: str | os.PathLike[str]) -> Path:
    """``dflctl data add``: copy ``src`` into the spool under a temporary name, fsync,
    then rename it in (the agent never sees a partial file).  Returns the spool path.

    Raises:
        FileNotFoundError: ``src`` is missing.
    """
    s, spool = Path(src), Path(spool_dir)
    if not s.is_file():
        raise FileNotFoundError(f"{s}: no such file")
    spool.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(s.read_bytes()).hexdigest()[:12]
    dest = spool / f"{s.stem}-{digest}.npz"
    with open(s, "rb") as fin, atomic_writer(dest) as fout:  # a hidden temporary name, then renamed in
        shutil.copyfileobj(fin, fout)
    return dest
