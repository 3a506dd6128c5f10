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
* **Bounded memory.**  Before any array is decompressed, the zip directory and each
  read array's ``.npy`` header (shape, dtype) are read (:func:`inspect_archive`): a
  file whose arrays ``x``, ``y``, ``t``, ``groups`` would take more than
  ``max_ingest_bytes`` uncompressed (``x`` counted as float32 when stored smaller), a
  file above :data:`MAX_FILE_BYTES`, or an archive with more than :data:`MAX_MEMBERS`
  members is refused, so a small compressed "bomb" never allocates its arrays.
* **Regular files only.**  Spool entries are examined with ``lstat`` and opened with
  ``O_NOFOLLOW``: a symbolic link (dangling or not; its target is never read), a
  directory, a FIFO, a socket or a device named ``*.npz`` is moved to
  ``spool/rejected/`` with its reason, and counted.
* **Counted.**  Every rejection is a row of the ``rejected`` table (name, reason) and
  adds one to the counter of its kind (:data:`REJECT_KINDS`, ``status()["rejected_by_kind"]``).
* **Bounded.**  After each insertion, in the same transaction: samples older than
  ``max_age`` are evicted; then each class above ``max_per_class`` loses its oldest
  samples; then, while the store holds more than ``max_samples``, the oldest samples
  go (``eviction="oldest"``) or the oldest samples of the currently largest classes
  (``eviction="largest-class"``, so a rare class is not evicted by a frequent one).
  A committed store never holds more than ``max_samples``.
* **Seeded once.**  :meth:`SampleStore.seed` ingests a seed file (``data.path/train.npz``)
  at the store's first start only: its samples and a ``seed`` row of the ``meta`` table
  (the file's name, SHA-256 and sample count) commit in one transaction, so a crash leaves
  the store either seeded or not, and a later start, with the same file or another one,
  ingests nothing.
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
import math
import os
import shutil
import sqlite3
import stat
import struct
import threading
import time
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.fsutil import atomic_write, atomic_writer, rename
from dfl_agent.jsonbound import loads as bounded_loads

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DB_NAME = "samples.sqlite"
#: largest spool file read (its bytes are held in memory while it is validated)
MAX_FILE_BYTES = 512 * 1024 * 1024
#: default of ``max_ingest_bytes`` (``data.store_max_ingest_bytes``): most bytes the arrays of one
#: file may take once decompressed
DEFAULT_MAX_INGEST_BYTES = 256 * 1024 * 1024
#: most members of one archive (a spool file needs 2 to 4) and most bytes of its zip directory
MAX_MEMBERS = 64
MAX_DIRECTORY_BYTES = 1 << 20
#: the arrays the store reads from a spool file; other members are never decompressed
READ_KEYS = ("x", "y", "t", "groups")
#: kinds of rejection, counted separately (``status()["rejected_by_kind"]``)
REJECT_KINDS = ("not_regular_file", "file_too_large", "arrays_too_large", "not_npz", "object_array",
                "invalid_content")
#: spool (and spool/rejected) mode: group-writable, setgid (files keep the agent's group)
SPOOL_MODE = 0o2770


class StoreError(ValueError):
    """A store that cannot be opened or used (bad schema, mismatch with the config)."""


class RejectedFile(ValueError):
    """A spool file that failed validation; ``args[0]`` is the one-line reason and
    ``kind`` one of :data:`REJECT_KINDS` (default ``"invalid_content"``)."""

    def __init__(self, reason: str, kind: str = "invalid_content"):
        super().__init__(reason)
        self.kind = kind if kind in REJECT_KINDS else "invalid_content"


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
            d = bounded_loads(p.read_bytes(), "manifest")  # size and nesting depth bounded
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
                raise RejectedFile(f"{key}: object array refused (store plain numeric arrays)",
                                   "object_array") from None
            raise RejectedFile(f"{key}: unreadable array ({exc})") from None
        except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
            raise RejectedFile(f"{key}: unreadable array, truncated or corrupt ({type(exc).__name__})") from None
    x, y = out["x"], out["y"]
    if x.dtype.hasobject or y.dtype.hasobject:
        raise RejectedFile("object array refused (store plain numeric arrays)", "object_array")
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


def _zip_directory(data: bytes) -> None:
    """Bound the archive's member count and directory size from its end record, before
    ``zipfile`` builds one object per member.

    Raises:
        RejectedFile: no end record (truncated) or a directory above the bounds.
    """
    tail = data[-(22 + 65535):]
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        raise RejectedFile("unreadable archive, truncated or corrupt (no zip directory at its end)", "not_npz")
    _sig, _disk, _cd_disk, _here, members, cd_size, _cd_off, _comment = struct.unpack("<4s4H2LH", tail[at:at + 22])
    if members > MAX_MEMBERS:
        raise RejectedFile(f"archive has {members} members, at most {MAX_MEMBERS} are accepted", "invalid_content")
    if cd_size > MAX_DIRECTORY_BYTES:
        raise RejectedFile(f"archive directory of {cd_size} bytes, at most {MAX_DIRECTORY_BYTES} are accepted",
                           "invalid_content")


def inspect_archive(data: bytes, max_ingest_bytes: int = DEFAULT_MAX_INGEST_BYTES) -> dict[str, tuple[Any, ...]]:
    """Shapes and dtypes of the arrays the store reads (:data:`READ_KEYS`), from the
    archive's own headers, without decompressing any array data.

    The zip directory bounds the members (:data:`MAX_MEMBERS`) and each member's
    uncompressed size; each member's ``.npy`` header (``numpy.lib.format``) gives
    ``(shape, dtype)``.  The sum of ``prod(shape) * itemsize`` over these arrays (``x``
    counted at 4 bytes per value when stored smaller, as it is converted to float32)
    must not exceed ``max_ingest_bytes``.

    Args:
        data: the file's bytes.
        max_ingest_bytes: most bytes the read arrays may take once decompressed.

    Returns:
        ``{key: (shape, dtype)}`` for the read keys present.

    Raises:
        RejectedFile: not a zip archive, a member that is not a ``.npy`` array, an object
            dtype, or arrays above ``max_ingest_bytes`` (the reason names the sizes).
    """
    if not data:
        raise RejectedFile("empty file (0 bytes), not an .npz archive", "not_npz")
    if not data.startswith(b"PK\x03\x04"):
        raise RejectedFile("not an .npz archive (truncated or another format)", "not_npz")
    _zip_directory(data)
    found: dict[str, tuple[Any, ...]] = {}
    total = 0
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            if len(zf.infolist()) > MAX_MEMBERS:
                raise RejectedFile(f"archive has {len(zf.infolist())} members, at most {MAX_MEMBERS} are "
                                   "accepted", "invalid_content")
            names = set(zf.namelist())
            for key in READ_KEYS:
                member = key if key in names else f"{key}.npy" if f"{key}.npy" in names else None
                if member is None:  # as numpy.load resolves a key
                    continue
                info = zf.getinfo(member)
                with zf.open(info) as f:  # reads (decompresses) the header only
                    if f.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
                        raise RejectedFile(f"{key}: not a .npy array", "invalid_content")
                    version = (ord(f.read(1) or b"\0"), ord(f.read(1) or b"\0"))
                    if version == (1, 0):
                        shape, _fortran, dtype = np.lib.format.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, _fortran, dtype = np.lib.format.read_array_header_2_0(f)
                    else:
                        raise RejectedFile(f"{key}: unsupported .npy version {version} (store plain numeric "
                                           "arrays)", "invalid_content")
                if dtype.hasobject:
                    raise RejectedFile(f"{key}: object array refused (store plain numeric arrays)", "object_array")
                size = math.prod(int(s) for s in shape) * (max(dtype.itemsize, 4) if key == "x" else dtype.itemsize)
                total += size
                found[key] = (tuple(shape), dtype)
                if total > max_ingest_bytes:
                    arrays = ", ".join(f"{k} {found[k][0]} {found[k][1]}" for k in found)
                    raise RejectedFile(f"arrays need {total} bytes uncompressed ({arrays}), above the ingest limit "
                                       f"of {max_ingest_bytes} bytes (data.store_max_ingest_bytes)",
                                       "arrays_too_large")
                if info.file_size > max_ingest_bytes:  # a member larger than its array: never decompressed
                    raise RejectedFile(f"{key}: member of {info.file_size} bytes uncompressed, above the ingest limit "
                                       f"of {max_ingest_bytes} bytes (data.store_max_ingest_bytes)", "arrays_too_large")
    except RejectedFile:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, RuntimeError,
            NotImplementedError, struct.error) as exc:  # RuntimeError: an encrypted member
        raise RejectedFile(f"unreadable archive, truncated or corrupt ({type(exc).__name__}: {exc})",
                           "not_npz") from None
    return found


def validate_bytes(data: bytes, schema: Schema, max_ingest_bytes: int = DEFAULT_MAX_INGEST_BYTES,
                   ) -> dict[str, np.ndarray]:
    """Parse and validate the bytes of one spool file (see the module docstring): the
    headers first (:func:`inspect_archive`, nothing decompressed), then the arrays.

    Returns:
        ``{"x": float32 (N, *input_shape), "y": int64 (N,), "t": float64 (N,) | None,
        "groups": int64 (N,) | None}``.

    Raises:
        RejectedFile: with the one-line reason and its kind.
    """
    inspect_archive(data, max_ingest_bytes)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise RejectedFile("not an .npz archive (a single .npy array)", "not_npz")
            return _check_arrays(z, schema)
    except RejectedFile:
        raise
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise RejectedFile("object array refused (store plain numeric arrays)", "object_array") from None
        raise RejectedFile(f"unreadable archive ({exc})", "not_npz") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, RuntimeError, NotImplementedError) as exc:
        raise RejectedFile(f"unreadable archive, truncated or corrupt ({type(exc).__name__}: {exc})",
                           "not_npz") from None


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
        max_ingest_bytes: most bytes the arrays of one file may take decompressed
            (checked from the archive's headers before anything is decompressed).

    Raises:
        StoreError: no schema for a new store, or ``schema`` differs from the stored one.
    """

    def __init__(self, state_dir: str | os.PathLike[str], schema: Schema | None = None, *,
                 spool_dir: str | os.PathLike[str] | None = None, max_samples: int = 100_000,
                 max_age: float | None = None, max_per_class: int = 0, eviction: str = "oldest",
                 settle_seconds: float = 1.0, create: bool = True,
                 max_ingest_bytes: int = DEFAULT_MAX_INGEST_BYTES):
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
        if int(max_ingest_bytes) < 1:
            raise StoreError(f"data.store_max_ingest_bytes: must be >= 1, got {max_ingest_bytes}")
        self.max_ingest_bytes = int(max_ingest_bytes)
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

    def close(self) -> None:
        self.db.close()

    # -- ingestion ---------------------------------------------------------------
    def spool_files(self) -> list[Path]:
        """Entries named ``*.npz`` in the spool (hidden and temporary names skipped), oldest
        first, whatever their type (a link, directory or FIFO is rejected by the pass);
        examined with ``lstat``, so symbolic links are never followed."""
        if not self.spool_dir.is_dir():
            return []
        found = []
        for p in self.spool_dir.iterdir():
            if not p.name.endswith(".npz") or p.name.startswith("."):
                continue
            try:
                found.append((os.lstat(p).st_mtime, p.name, p))
            except OSError:  # vanished meanwhile
                continue
        return [p for _, _, p in sorted(found)]

    def ingest_spool(self, now: float | None = None) -> dict[str, int]:
        """One pass over the spool.  Returns ``{"ingested": files, "samples": n, "rejected": files,
        "duplicates": files, "waiting": files}``.  Never raises for a bad file; an entry that
        is not a regular file (symbolic link, directory, FIFO, ...) is rejected unopened."""
        out = {"ingested": 0, "samples": 0, "rejected": 0, "duplicates": 0, "waiting": 0}
        for p in self.spool_files():
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if time.time() - st.st_mtime < self.settle_seconds:
                out["waiting"] += 1
                continue
            if not stat.S_ISREG(st.st_mode):
                try:
                    self._reject_entry(p, st)
                except OSError as exc:  # vanished, or rejected/ not writable: next pass
                    log.warning("spool entry %s: %s", p.name, exc)
                    continue
                out["rejected"] += 1
                continue
            try:
                res = self.ingest_file(p, now=now, remove=True)
            except OSError as exc:  # vanished or unreadable: try again next pass
                log.warning("spool file %s: %s", p.name, exc)
                continue
            out[res["status"]] += 1
            out["samples"] += res.get("samples", 0)
        return out

    def seeded(self) -> dict[str, Any] | None:
        """The store's seed record ``{"name", "sha256", "samples", "time"}``, or None when it
        was never seeded."""
        row = self.db.execute("SELECT value FROM meta WHERE key='seed'").fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def seed(self, path: str | os.PathLike[str], *, now: float | None = None) -> dict[str, Any]:
        """Ingest the seed file ``path`` once in the store's life (see the module docstring).

        Returns:
            ``{"status": "ingested"|"duplicates"|"seeded_before"|"rejected", "samples": n,
            "sha256": hex, ...}``: ``seeded_before`` (nothing read) when the store already
            holds a seed record, ``duplicates`` when the store already held the file's samples
            (e.g. from the spool; the seed record is written), ``rejected`` with ``reason``
            (the store is unchanged and keeps no record, so a corrected file is taken next time).

        Raises:
            OSError: the file cannot be read.
        """
        if (done := self.seeded()) is not None:
            return {"status": "seeded_before", "samples": 0, "sha256": done.get("sha256", ""), "seed": done}
        return self.ingest_file(path, now=now, seed=True)

    def _mark_seeded(self, name: str, sha: str, n: int, now: float) -> None:
        """Write the seed record (inside the caller's transaction)."""
        self.db.execute("INSERT OR IGNORE INTO meta VALUES ('seed', ?)",
                        (json.dumps({"name": name, "sha256": sha, "samples": n, "time": now}, sort_keys=True),))

    def ingest_file(self, path: str | os.PathLike[str], *, now: float | None = None,
                    remove: bool = False, seed: bool = False) -> dict[str, Any]:
        """Ingest one ``.npz`` file (see the module docstring).

        Args:
            path: the file.
            now: ingestion time (default: ``time.time()``), the timestamp of samples without ``t``.
            remove: delete (or, when rejected, move to ``spool/rejected/``) afterwards -
                for spool files; a seed file stays where it is.
            seed: also write the seed record, in the transaction that inserts the samples
                (:meth:`seed`; a file already ingested gets the record alone).

        Returns:
            ``{"status": "ingested"|"duplicates"|"rejected", "samples": n, "reason": str, "sha256": hex}``.

        A spool file (``remove=True``) is opened with ``O_NOFOLLOW``: a symbolic link is
        rejected, never followed.  Any file that is not a regular file (FIFO, directory,
        device) is rejected without being read.

        Raises:
            OSError: the file cannot be read.
        """
        p = Path(path)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (getattr(os, "O_NOFOLLOW", 0) if remove else 0)
        try:
            fd = os.open(p, flags)  # O_NONBLOCK: a FIFO swapped in does not block the open
        except OSError as exc:
            if remove and os.path.islink(p):  # ELOOP: a link put in place after the pass looked
                self._reject_entry(p, os.lstat(p))
                return {"status": "rejected", "samples": 0, "reason": "symbolic link", "sha256": ""}
            raise exc
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            data, rejected = b"", None
            if not stat.S_ISREG(st.st_mode):
                rejected = RejectedFile(f"{_entry_type(st.st_mode)}, not a regular file", "not_regular_file")
            elif st.st_size > MAX_FILE_BYTES:
                rejected = RejectedFile(f"file of {st.st_size} bytes, above the {MAX_FILE_BYTES >> 20} MiB file "
                                        "limit", "file_too_large")
            else:  # read(n) allocates n bytes up front: ask for the size the file has
                data = f.read(st.st_size + 1)
                if len(data) != st.st_size:
                    raise OSError(f"{p.name} changed size while read ({st.st_size} -> {len(data)}+ bytes)")
        sha = hashlib.sha256(data if rejected is None else
                             f"{rejected.kind}:{p.name}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
        with self._lock:
            if rejected is None and self.db.execute("SELECT 1 FROM files WHERE sha256=?", (sha,)).fetchone():
                if remove:
                    p.unlink(missing_ok=True)
                if seed:
                    self._mark_seeded(p.name, sha, 0, time.time() if now is None else now)
                return {"status": "duplicates", "samples": 0, "sha256": sha}
            try:
                if rejected is not None:
                    raise rejected
                arrays = validate_bytes(data, self.schema, self.max_ingest_bytes)
            except RejectedFile as exc:
                reason = str(exc.args[0])
                self._reject(p, sha, reason, remove, exc.kind)
                return {"status": "rejected", "samples": 0, "reason": reason, "sha256": sha}
            n = self._insert(p.name, sha, arrays, time.time() if now is None else now, seed=seed)
            if remove:
                p.unlink(missing_ok=True)
            return {"status": "ingested", "samples": n, "sha256": sha}

    def _reject_entry(self, p: Path, st: os.stat_result) -> None:
        """Reject a spool entry that is not a regular file, from its ``lstat`` alone (never opened)."""
        kind = _entry_type(st.st_mode)
        reason = f"{kind}, not a regular file" + (" (symbolic links are not followed)" if stat.S_ISLNK(st.st_mode)
                                                  else "")
        sha = hashlib.sha256(f"not_regular_file:{p.name}:{st.st_ino}:{st.st_mtime_ns}".encode()).hexdigest()
        with self._lock:
            self._reject(p, sha, reason, True, "not_regular_file")

    def _reject(self, p: Path, sha: str, reason: str, move: bool, kind: str = "invalid_content") -> None:
        log.warning("rejected spool file %s: %s", p.name, reason)
        cur = self.db.execute("INSERT OR IGNORE INTO rejected VALUES (?, ?, ?, ?)", (sha, p.name, reason, time.time()))
        if cur.rowcount == 1:  # counted once per distinct file, like the rows
            self.db.execute("INSERT INTO counters VALUES (?, 1) ON CONFLICT(key) DO UPDATE SET value = value + 1",
                            (f"rejected:{kind}",))
        if not move:
            return
        self.rejected_dir.mkdir(parents=True, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(self.rejected_dir).st_mode):  # e.g. replaced by a link: write nothing there
            log.warning("%s is not a directory; %s stays in the spool", self.rejected_dir, p.name)
            return
        dest = self.rejected_dir / p.name
        if os.path.lexists(dest):
            dest = self.rejected_dir / f"{p.stem}-{sha[:12]}{p.suffix}"
        # atomic, never through a symbolic link (the rename replaces an entry there, not what it points to)
        atomic_write(self.rejected_dir / (dest.name + ".reason"), reason + "\n", mode=0o660)
        try:
            rename(p, dest)  # a link, directory or FIFO is moved as it is (rename never follows a link)
        except OSError as exc:
            if not stat.S_ISREG(os.lstat(p).st_mode):  # a copy would follow or block: leave it
                log.warning("cannot move %s to %s: %s", p.name, self.rejected_dir, exc)
                return
            shutil.move(str(p), str(dest))

    def _insert(self, name: str, sha: str, a: dict[str, np.ndarray], now: float, seed: bool = False) -> int:
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
            if seed:
                self._mark_seeded(name, sha, n, now)
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
        """``(ids, x, y, groups)`` for the requested ids still present, each once (evicted ones are skipped):
        int64 ``(n,)``, float32 ``(n, *input_shape)``, int64 ``(n,)``, int64 ``(n,)``, ordered by id.

        The windows are copied from the database straight into one preallocated array, a chunk of
        rows at a time, so loading takes little more memory than the result (not three times it)."""
        want = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))  # sorted: the chunks come in id order
        shape = tuple(self.schema.input_shape)
        n = len(want)
        got, x = np.empty(n, np.int64), np.empty((n, *shape), np.float32)
        y, g = np.empty(n, np.int64), np.empty(n, np.int64)
        k = 0
        with self._lock:
            for start in range(0, n, 900):
                chunk = want[start:start + 900].tolist()
                q = f"SELECT id, y, grp, x FROM samples WHERE id IN ({','.join('?' * len(chunk))}) ORDER BY id"
                rows = self.db.execute(q, chunk).fetchall()
                if not rows:
                    continue
                m = len(rows)
                got[k:k + m], y[k:k + m], g[k:k + m] = zip(*((r[0], r[1], r[2]) for r in rows))
                x[k:k + m] = np.frombuffer(b"".join(r[3] for r in rows), dtype=np.float32).reshape((m, *shape))
                k += m
        return got[:k], x[:k], y[:k], g[:k]  # rows past k were never written (nor made resident)

    def status(self) -> dict[str, Any]:
        """The ``dflctl data status --json`` document (see the docs)."""
        db = self.db
        per = {str(y): int(c) for y, c in db.execute("SELECT y, COUNT(*) FROM samples GROUP BY y ORDER BY y")}
        oldest, newest = db.execute("SELECT MIN(t), MAX(t) FROM samples").fetchone()
        counters = dict(db.execute("SELECT key, value FROM counters").fetchall())
        by_kind = {k: int(counters.get(f"rejected:{k}", 0)) for k in REJECT_KINDS}
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
            "rejected_by_kind": {k: n for k, n in by_kind.items() if n},
            "rejected_files": rejected,
            "spool_waiting": len(self.spool_files()),
            "max_samples": self.max_samples,
            "seed": self.seeded(),
        }


def _entry_type(mode: int) -> str:
    """What a non-regular directory entry is, in words (for a rejection reason)."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


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
