"""Dataset containers shared by every loader, and the seeded helpers they use.

A :class:`Dataset` is a plain bundle of numpy arrays with one sample per row:

* ``x``: float32, shape ``(N, *input_shape)``, C-contiguous, model-ready
  (already scaled / standardised by its loader);
* ``y``: int64, shape ``(N,)``, class labels ``0 .. num_classes - 1``;
* ``groups``: int64, shape ``(N,)``, the id of the user (recording owner) a
  sample comes from, or ``-1`` when the dataset does not know it.

Randomness: nothing here touches numpy's global RNG.  Every draw comes from
:func:`stream_rng` ``(seed, stream)``, a ``numpy.random.Generator`` seeded with
``SeedSequence(seed, spawn_key=(crc32(stream),))``, so independent purposes
(partition, per-node split, a loader's fixed test split) get independent,
reproducible streams from one integer seed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


def stream_rng(seed: int, stream: str) -> np.random.Generator:
    """A generator for one named purpose, derived from an integer seed.

    Args:
        seed: non-negative integer (python or numpy int).
        stream: name of the purpose, e.g. ``"partition/iid"``; different names
            give statistically independent streams for the same seed.

    Raises:
        TypeError: ``seed`` is not an integer (bools are rejected too).
        ValueError: ``seed`` is negative.
    """
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be a non-negative integer, got {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    key = zlib.crc32(stream.encode("utf-8"))
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(key,)))


@dataclass(eq=False)
class Dataset:
    """One labelled set of samples (see the module docstring for the arrays).

    Attributes:
        name: loader name, e.g. ``"har"``.
        x: float32 ``(N, *input_shape)``, C-contiguous.
        y: int64 ``(N,)`` in ``[0, num_classes)``.
        groups: int64 ``(N,)``, user id or ``-1`` when unknown.
        num_classes: number of classes the labels index into (some may be
            absent from this particular set).
        class_names: ``num_classes`` display names.
        input_shape: shape of one sample, e.g. ``(3, 128)`` for HAR.
        meta: loader-specific constants (e.g. HAR's per-channel standardisation
            ``channel_mean``/``channel_std``); plain JSON-able values.

    Raises:
        ValueError: on construction, when shapes, dtypes or label range do not
            match the description above (the message names the field).
    """

    name: str
    x: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    groups: np.ndarray = field(repr=False)
    num_classes: int
    class_names: list[str]
    input_shape: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.input_shape = tuple(int(d) for d in self.input_shape)
        self.num_classes = int(self.num_classes)
        self.class_names = [str(c) for c in self.class_names]
        where = f"dataset {self.name!r}"
        if not isinstance(self.x, np.ndarray) or self.x.dtype != np.float32:
            raise ValueError(f"{where}: x must be a float32 numpy array, got "
                             f"{getattr(self.x, 'dtype', type(self.x))}")
        if not self.x.flags.c_contiguous:
            raise ValueError(f"{where}: x must be C-contiguous")
        n = self.x.shape[0] if self.x.ndim else -1
        if self.x.shape[1:] != self.input_shape or n < 0:
            raise ValueError(f"{where}: x has shape {self.x.shape}, expected "
                             f"(N, *{self.input_shape})")
        for key in ("y", "groups"):
            arr = getattr(self, key)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.int64:
                raise ValueError(f"{where}: {key} must be an int64 numpy array, got "
                                 f"{getattr(arr, 'dtype', type(arr))}")
            if arr.shape != (n,):
                raise ValueError(f"{where}: {key} has shape {arr.shape}, expected ({n},)")
        if self.num_classes < 1:
            raise ValueError(f"{where}: num_classes must be >= 1, got {self.num_classes}")
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"{where}: {len(self.class_names)} class_names for "
                             f"num_classes={self.num_classes}")
        if n and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ValueError(f"{where}: labels y must lie in [0, {self.num_classes}), "
                             f"got range [{self.y.min()}, {self.y.max()}]")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, idx: np.ndarray) -> Dataset:
        """The samples at integer positions ``idx`` (copies; order kept).

        Args:
            idx: integer array ``(M,)`` of positions into this dataset.

        Raises:
            TypeError: ``idx`` is not an integer array.
            IndexError: a position is out of range.
        """
        idx = np.asarray(idx)
        if idx.dtype.kind not in "iu" and not (idx.size == 0 and idx.dtype.kind == "f"):
            raise TypeError(f"subset indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        return replace(self, x=np.ascontiguousarray(self.x[idx]), y=self.y[idx], groups=self.groups[idx],
                       class_names=list(self.class_names), meta=dict(self.meta))


@dataclass(eq=False)
class DatasetBundle:
    """What a loader returns.

    Attributes:
        pool: the data that gets distributed among the nodes (``partition``).
        test: the one shared global test set ("global accuracy").
    """

    pool: Dataset
    test: Dataset

    def __post_init__(self) -> None:
        p, t = self.pool, self.test
        if (p.input_shape, p.num_classes) != (t.input_shape, t.num_classes):
            raise ValueError(
                f"pool and test of {p.name!r} disagree: input_shape {p.input_shape} vs "
                f"{t.input_shape}, num_classes {p.num_classes} vs {t.num_classes}")


@dataclass(eq=False)
class NodeData:
    """One node's local data.

    Attributes:
        train_x: float32 ``(N_train, *input_shape)``; the node's training split.
        train_y: int64 ``(N_train,)``.
        val_x: float32 ``(N_val, *input_shape)``; validation split, used for
            "local accuracy".
        val_y: int64 ``(N_val,)``.
        num_classes, input_shape, class_names: as in the pool :class:`Dataset`.
        groups: sorted user ids present on this node (empty when unknown);
            for display only.
    """

    train_x: np.ndarray = field(repr=False)
    train_y: np.ndarray = field(repr=False)
    val_x: np.ndarray = field(repr=False)
    val_y: np.ndarray = field(repr=False)
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: list[str]
    groups: list[int]

    @property
    def num_train(self) -> int:
        """Number of training samples."""
        return int(self.train_y.shape[0])

    @property
    def num_val(self) -> int:
        """Number of validation samples."""
        return int(self.val_y.shape[0])


def split_indices(y: np.ndarray, fraction: float, rng: np.random.Generator
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of positions ``0..N-1`` into (keep, held_out).

    ``held_out`` has ``round(fraction * N)`` positions (at most ``N - 1``, so
    ``keep`` is never emptied).  When every class present has at least 2
    samples the split is stratified: each class contributes to ``held_out`` in
    proportion to its size (largest-remainder rounding, at most ``n_c - 1`` per
    class, which can make ``held_out`` slightly smaller for extreme fractions);
    otherwise it is a plain shuffle split.

    Args:
        y: int labels ``(N,)``.
        fraction: held-out fraction in ``[0, 1)``.
        rng: the generator that draws the split.

    Returns:
        Two int64 arrays of positions, each in random order, disjoint, covering
        ``0..N-1``.

    Raises:
        ValueError: ``fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation/test fraction must be in [0, 1), got {fraction}")
    y = np.asarray(y).reshape(-1)
    n = int(y.shape[0])
    n_out = min(int(round(fraction * n)), max(n - 1, 0))
    perm = rng.permutation(n).astype(np.int64)
    classes, counts = np.unique(y, return_counts=True)
    if n_out == 0 or counts.min() < 2:
        return perm[n_out:], perm[:n_out]
    # Stratified: largest-remainder allocation of n_out over the classes, each
    # class keeping at least one sample.
    ideal = counts * (n_out / n)
    take = np.minimum(np.floor(ideal).astype(np.int64), counts - 1)
    order = np.argsort(-(ideal - take), kind="stable")
    while take.sum() < n_out and np.any(take < counts - 1):
        for c in order:
            if take.sum() >= n_out:
                break
            if take[c] < counts[c] - 1:
                take[c] += 1
    held: list[np.ndarray] = []
    keep: list[np.ndarray] = []
    y_perm = y[perm]
    for c, k in zip(classes, take):
        members = perm[y_perm == c]          # already in random order
        held.append(members[:k])
        keep.append(members[k:])
    held_out = np.concatenate(held)
    kept = np.concatenate(keep)
    # Mix classes so neither split is grouped by label.
    return kept[rng.permutation(kept.shape[0])], held_out[rng.permutation(held_out.shape[0])]
