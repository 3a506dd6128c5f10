"""npz: a field device's own sensor data, from a directory of ``.npz`` files.

Directory format (also in ``agent/data/FORMAT.md``)::

    <dir>/train.npz   required  x (N, *input_shape) real numbers
                                y (N,) integer labels in [0, num_classes)
                                groups (N,) integer user ids >= 0 (optional)
    <dir>/test.npz    optional  the global test set, same keys and input_shape
    <dir>/meta.json   optional  {"name": str, "class_names": [str, ...],
                                 "num_classes": int}

* Files are read with ``numpy.load(..., allow_pickle=False)``: object arrays
  are refused.  Other keys in the npz files are ignored.
* ``x`` may be any real dtype (float16/32/64, ints); it is converted to
  float32 as is: scale or standardise it before saving, the loader does not.
  Values must be finite.  ``input_shape = x.shape[1:]`` (at least one axis,
  e.g. ``(C, T)`` for a sensor window, ``(1, H, W)`` for an image).
* ``y`` must have an integer dtype.  ``num_classes`` = meta's
  ``num_classes``, else ``len(class_names)``, else largest label + 1 (over
  train and test); class names default to ``"0", "1", ...``.
* ``groups`` missing = unknown (-1); it enables the ``by-user`` partition.
* Without ``test.npz`` the test set is a fixed stratified 20 % split of
  train.npz drawn with seed 0 (the same for every run); the pool is the rest.
  (It is a sample-level split: a user can appear in both.)

Every error is a ``ValueError`` (``FileNotFoundError`` for a missing
directory/train.npz) naming the file and the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.data.cache import read_npz
from dfl_agent.data.dataset import Dataset, DatasetBundle, split_indices, stream_rng
from dfl_agent.jsonbound import loads as bounded_loads

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def _read_part(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x float32, y int64, groups int64) of one npz file, validated."""
    arrays = read_npz(path)
    for key in ("x", "y"):
        if key not in arrays:
            raise ValueError(f"{path}: missing array {key!r} (has {sorted(arrays)})")
    x, y = arrays["x"], arrays["y"]
    if x.dtype.kind not in "fiu":
        raise ValueError(f"{path}: 'x' must hold real numbers, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{path}: 'x' must have shape (N, *input_shape), got {x.shape}")
    if y.dtype.kind not in "iu":
        raise ValueError(f"{path}: 'y' must have an integer dtype, got {y.dtype}")
    if y.shape != (x.shape[0],):
        raise ValueError(f"{path}: 'y' has shape {y.shape}, expected ({x.shape[0]},) to "
                         "match 'x'")
    if y.size and y.min() < 0:
        raise ValueError(f"{path}: 'y' has negative labels (min {y.min()})")
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x32).all():
        raise ValueError(f"{path}: 'x' holds non-finite values (or overflows float32)")
    if "groups" in arrays:
        g = arrays["groups"]
        if g.dtype.kind not in "iu" or g.shape != y.shape:
            raise ValueError(f"{path}: 'groups' must be integer with shape {y.shape}, got "
                             f"{g.dtype} {g.shape}")
        if g.size and g.min() < 0:
            raise ValueError(f"{path}: 'groups' has negative user ids (min {g.min()})")
        groups = g.astype(np.int64)
    else:
        groups = np.full(y.shape, -1, np.int64)
    return x32, y.astype(np.int64), groups


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        meta = bounded_loads(path.read_bytes(), "manifest")
    except (OSError, ValueError) as e:  # JSONBoundError: oversized, too_deep, malformed
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    if "class_names" in meta and (not isinstance(meta["class_names"], list) or not all(
            isinstance(c, str) for c in meta["class_names"])):
        raise ValueError(f"{path}: 'class_names' must be a list of strings")
    if "num_classes" in meta and (not isinstance(meta["num_classes"], int)
                                  or isinstance(meta["num_classes"], bool)
                                  or meta["num_classes"] < 1):
        raise ValueError(f"{path}: 'num_classes' must be an integer >= 1")
    if "name" in meta and not isinstance(meta["name"], str):
        raise ValueError(f"{path}: 'name' must be a string")
    if "class_names" in meta and "num_classes" in meta \
            and len(meta["class_names"]) != meta["num_classes"]:
        raise ValueError(f"{path}: {len(meta['class_names'])} 'class_names' but "
                         f"'num_classes' = {meta['num_classes']}")
    return meta


def load_npz_dir(path: str | os.PathLike[str]) -> DatasetBundle:
    """Load a device data directory (see module docstring for the format).

    Raises:
        FileNotFoundError: the directory or its ``train.npz`` is missing.
        ValueError: any content error, naming the file and key.
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"npz data directory {directory} does not exist")
    train_path, test_path, meta_path = (directory / "train.npz", directory / "test.npz",
                                        directory / "meta.json")
    if not train_path.is_file():
        raise FileNotFoundError(f"{train_path} not found (required: arrays 'x' and 'y')")
    meta = _read_meta(meta_path)
    x, y, g = _read_part(train_path)
    if test_path.is_file():
        xt, yt, gt = _read_part(test_path)
        if xt.shape[1:] != x.shape[1:]:
            raise ValueError(f"{test_path}: 'x' samples have shape {xt.shape[1:]} but "
                             f"{train_path} has {x.shape[1:]}")
    else:
        pool_idx, test_idx = split_indices(y, TEST_FRACTION,
                                           stream_rng(SPLIT_SEED, "npz/test"))
        pool_idx, test_idx = np.sort(pool_idx), np.sort(test_idx)
        xt, yt, gt = x[test_idx], y[test_idx], g[test_idx]
        x, y, g = x[pool_idx], y[pool_idx], g[pool_idx]
    top = int(max(y.max(initial=-1), yt.max(initial=-1))) + 1
    if "num_classes" in meta:
        k = int(meta["num_classes"])
    elif "class_names" in meta:
        k = len(meta["class_names"])
    else:
        k = max(top, 1)
    if top > k:
        bad = train_path if y.max(initial=-1) >= k else test_path
        raise ValueError(f"{bad}: 'y' has label {top - 1} but {meta_path.name} declares "
                         f"{k} classes (labels must be in [0, {k}))")
    names = meta.get("class_names") or [str(i) for i in range(k)]
    name = meta.get("name", "npz")
    shape = tuple(x.shape[1:])
    info = {"source": str(directory)}

    def make(xa: np.ndarray, ya: np.ndarray, ga: np.ndarray) -> Dataset:
        return Dataset(name=name, x=np.ascontiguousarray(xa), y=ya, groups=ga,
                       num_classes=k, class_names=list(names), input_shape=shape,
                       meta=dict(info))

    return DatasetBundle(pool=make(x, y, g), test=make(xt, yt, gt))
