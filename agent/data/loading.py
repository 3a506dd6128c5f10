"""Entry points: load a data set by name, and build one node's local data.

Typical use (what the simulator and the daemon do)::

    bundle = load_dataset("har")
    parts = partition(bundle.pool, num_nodes, "dirichlet", seed=seed, beta=0.5)
    node = make_node_data(bundle, parts[i], seed=seed)   # == node_data_for(...)
    # global accuracy on bundle.test, local accuracy on node.val_x / node.val_y
"""

from __future__ import annotations

import os

import numpy as np

from dfl_agent.data.dataset import DatasetBundle, NodeData, split_indices, stream_rng
from dfl_agent.data.partition import partition

__all__ = ["DATASETS", "load_dataset", "make_node_data", "node_data_for"]

DATASETS: tuple[str, ...] = ("har", "digits", "idx", "npz", "iris")


def load_dataset(name: str, *, path: str | os.PathLike[str] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> DatasetBundle:
    """Load the pool and the global test set of data set ``name``.

    Args:
        name: one of :data:`DATASETS`:
            ``har`` (UCI HAPT from the installed package, cached as npz in
            ``cache_dir``; see :mod:`dfl_agent.data.har`),
            ``digits`` (scikit-learn; :mod:`dfl_agent.data.digits`),
            ``iris`` (scikit-learn; :mod:`dfl_agent.data.digits`),
            ``idx`` (MNIST-format files in directory ``path``;
            :mod:`dfl_agent.data.idx`),
            ``npz`` (device data directory ``path``; :mod:`dfl_agent.data.npzdir`).
        path: data directory, required for ``idx`` and ``npz``, refused for
            the others.
        cache_dir: cache directory for ``har`` (default ``$DFL_CACHE_DIR`` or
            ``~/.cache/dfl-agent``); ignored by the others.

    Raises:
        ValueError: unknown name, or ``path`` missing/superfluous.
        ImportError: the optional package a data set needs is not installed.
        FileNotFoundError, ValueError: from the loader, naming file and key.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    if name in ("idx", "npz"):
        if path is None:
            raise ValueError(f"dataset {name!r} needs path= (the data directory)")
    elif path is not None:
        raise ValueError(f"dataset {name!r} takes no path (got {path!r}); "
                         "use 'idx' or 'npz' for data from a directory")
    if name == "har":
        from dfl_agent.data.har import load_har
        return load_har(cache_dir)
    if name in ("digits", "iris"):
        from dfl_agent.data import digits
        return digits.load_digits() if name == "digits" else digits.load_iris()
    if name == "idx":
        from dfl_agent.data.idx import load_idx
        return load_idx(path)  # type: ignore[arg-type]
    from dfl_agent.data.npzdir import load_npz_dir
    return load_npz_dir(path)  # type: ignore[arg-type]


def make_node_data(bundle: DatasetBundle, indices: np.ndarray, *, seed: int,
                   val_fraction: float = 0.2) -> NodeData:
    """One node's data: a seeded train/validation split of its pool positions.

    The split is drawn from ``stream_rng(seed, "node-split")`` and is
    stratified when every class on the node has >= 2 samples (see
    :func:`dfl_agent.data.dataset.split_indices`); ``val`` gets
    ``round(val_fraction * n)`` samples (never all of them).

    Args:
        bundle: the loaded data set.
        indices: int ``(n,)`` positions into ``bundle.pool`` (one partition part).
        seed: non-negative integer.
        val_fraction: validation share in ``[0, 1)``.

    Returns:
        :class:`NodeData` with copies (float32 x, int64 y) and the sorted user ids
        present (empty when the pool has none).

    Raises:
        ValueError: empty or duplicate ``indices``, ``val_fraction`` out of range.
        IndexError: a position outside the pool.
        TypeError: non-integer ``indices`` or seed.
    """
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"node indices must be integers, got dtype {idx.dtype}")
    idx = idx.astype(np.int64).reshape(-1)
    if idx.size == 0:
        raise ValueError("node has no samples (empty index array)")
    n_pool = len(bundle.pool)
    if idx.min() < 0 or idx.max() >= n_pool:
        raise IndexError(f"node indices must lie in [0, {n_pool}), got range "
                         f"[{idx.min()}, {idx.max()}]")
    if np.unique(idx).size != idx.size:
        raise ValueError("node indices contain duplicates")
    pool = bundle.pool
    y = pool.y[idx]
    train_pos, val_pos = split_indices(y, val_fraction, stream_rng(seed, "node-split"))
    tr, va = idx[train_pos], idx[val_pos]
    users = np.unique(pool.groups[idx])
    return NodeData(
        train_x=np.ascontiguousarray(pool.x[tr]), train_y=pool.y[tr],
        val_x=np.ascontiguousarray(pool.x[va]), val_y=pool.y[va],
        num_classes=pool.num_classes, input_shape=pool.input_shape,
        class_names=list(pool.class_names),
        groups=[int(u) for u in users if u >= 0],
    )


def node_data_for(bundle: DatasetBundle, num_nodes: int, node_index: int, scheme: str, *,
                  seed: int, beta: float = 0.5, zeta: int = 2,
                  val_fraction: float = 0.2) -> NodeData:
    """``make_node_data(bundle, partition(bundle.pool, ...)[node_index], seed=seed)``.

    A daemon on one device calls this with the federation's shared seed and
    its own index, and gets the same data the simulator would give that node.

    Raises:
        IndexError: ``node_index`` not in ``[0, num_nodes)``.
        ValueError, TypeError: as :func:`partition` and :func:`make_node_data`.
    """
    if isinstance(node_index, bool) or not isinstance(node_index, (int, np.integer)) \
            or not 0 <= node_index < num_nodes:
        raise IndexError(f"node_index must be an integer in [0, {num_nodes}), got {node_index!r}")
    parts = partition(bundle.pool, num_nodes, scheme, seed=seed, beta=beta, zeta=zeta)
    return make_node_data(bundle, parts[int(node_index)], seed=seed,
                          val_fraction=val_fraction)
