"""Partitioners: how the pool is distributed among ``num_nodes`` nodes.

Each returns one sorted int64 array of positions into ``pool`` per node; the
arrays are pairwise disjoint.  Everything is drawn from
``stream_rng(seed, "partition/<scheme>")``, so the same (pool, num_nodes,
scheme, seed, beta, zeta) always gives the same partition.

Schemes
    ``iid``        seeded shuffle, then near-equal contiguous chunks (sizes
                   differ by at most one).  Covers the pool.
    ``dirichlet``  label skew: for every class k the fractions of its samples
                   given to the nodes are drawn ~ Dir(beta * 1_num_nodes), the
                   class's shuffled samples are cut at those fractions.  Small
                   beta = strong skew.  The draw is repeated (same stream)
                   until every node has at least ``min_samples`` samples; after
                   ``max_tries`` failures a ValueError says so.  Covers the pool.
    ``shards``     Def-KT / McMahan et al.: stable sort by label, cut into
                   ``num_nodes * zeta`` equal shards (``np.array_split`` sizes),
                   each node gets ``zeta`` shards drawn without replacement, so
                   a node sees about ``zeta`` classes.  Covers the pool.
    ``by-user``    node i gets all samples of the i-th user id in sorted order
                   (``np.unique(pool.groups)[i]``); users beyond ``num_nodes``
                   are left out.  Needs user ids (``groups >= 0``).
"""

from __future__ import annotations

import numpy as np

from dfl_agent.data.dataset import Dataset, stream_rng

PARTITIONS: tuple[str, ...] = ("iid", "dirichlet", "shards", "by-user")


def _check_nodes(num_nodes: int, n: int, scheme: str, min_each: int = 1) -> None:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)) \
            or num_nodes < 1:
        raise ValueError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
    if n < num_nodes * min_each:
        raise ValueError(f"{scheme} partition: pool has {n} samples, too few for "
                         f"{num_nodes} nodes (needs >= {num_nodes * min_each})")


def partition_iid(y: np.ndarray, num_nodes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """IID: seeded shuffle, near-equal split (see module docstring)."""
    _check_nodes(num_nodes, len(y), "iid")
    perm = rng.permutation(len(y)).astype(np.int64)
    return [np.sort(p) for p in np.array_split(perm, num_nodes)]


def partition_dirichlet(y: np.ndarray, num_nodes: int, rng: np.random.Generator, *,
                        beta: float, min_samples: int = 10,
                        max_tries: int = 1000) -> list[np.ndarray]:
    """Dirichlet label skew (see module docstring).

    Raises:
        ValueError: ``beta <= 0``, pool too small for ``num_nodes *
            min_samples``, or no draw met ``min_samples`` within ``max_tries``.
    """
    if not beta > 0 or not np.isfinite(beta):
        raise ValueError(f"dirichlet partition: beta must be a finite number > 0, got {beta!r}")
    if min_samples < 0:
        raise ValueError(f"dirichlet partition: min_samples must be >= 0, got {min_samples}")
    _check_nodes(num_nodes, len(y), "dirichlet", max(min_samples, 1))
    classes = np.unique(y)
    members = [np.flatnonzero(y == c) for c in classes]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_nodes)]
        for idx in members:
            idx = idx[rng.permutation(idx.shape[0])]
            p = rng.dirichlet(np.full(num_nodes, float(beta)))
            cuts = (np.cumsum(p)[:-1] * idx.shape[0]).astype(np.int64)
            for node, chunk in enumerate(np.split(idx, cuts)):
                parts[node].append(chunk)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(o.shape[0] for o in out) >= min_samples:
            return out
    raise ValueError(
        f"dirichlet partition: no draw in {max_tries} tries gave each of {num_nodes} nodes "
        f">= {min_samples} samples (pool {len(y)}, {len(classes)} classes, beta={beta}); "
        "use a larger beta or fewer nodes")


def partition_shards(y: np.ndarray, num_nodes: int, rng: np.random.Generator, *,
                     zeta: int) -> list[np.ndarray]:
    """Def-KT shards: ``zeta`` label-sorted shards per node (see module docstring).

    Raises:
        ValueError: ``zeta < 1`` or fewer samples than shards.
    """
    if isinstance(zeta, bool) or not isinstance(zeta, (int, np.integer)) or zeta < 1:
        raise ValueError(f"shards partition: zeta must be an integer >= 1, got {zeta!r}")
    _check_nodes(num_nodes, len(y), "shards", int(zeta))
    order = np.argsort(y, kind="stable").astype(np.int64)
    shards = np.array_split(order, num_nodes * int(zeta))
    pick = rng.permutation(len(shards))
    return [np.sort(np.concatenate([shards[s] for s in pick[i * zeta:(i + 1) * zeta]]))
            for i in range(num_nodes)]


def partition_by_user(groups: np.ndarray, num_nodes: int, name: str = "pool"
                      ) -> list[np.ndarray]:
    """By user: node i gets the i-th user id in sorted order.

    Raises:
        ValueError: some sample has no user id (``groups < 0``), or there are
            fewer users than nodes.
    """
    _check_nodes(num_nodes, len(groups), "by-user")
    if len(groups) and groups.min() < 0:
        raise ValueError(f"by-user partition: dataset {name!r} has no user ids "
                         "(groups == -1); use iid, dirichlet or shards")
    users = np.unique(groups)
    if num_nodes > users.shape[0]:
        raise ValueError(f"by-user partition: {num_nodes} nodes but dataset {name!r} has only "
                         f"{users.shape[0]} users in its pool; use at most {users.shape[0]} "
                         "nodes or another scheme")
    return [np.flatnonzero(groups == u).astype(np.int64) for u in users[:num_nodes]]


def partition(pool: Dataset, num_nodes: int, scheme: str, *, seed: int,
              beta: float = 0.5, zeta: int = 2, min_samples: int = 10) -> list[np.ndarray]:
    """Split ``pool`` among ``num_nodes`` nodes.

    Args:
        pool: the data to distribute.
        num_nodes: number of nodes (>= 1).
        scheme: one of :data:`PARTITIONS`.
        seed: non-negative integer; same inputs + seed = same partition.
        beta: Dirichlet concentration (``dirichlet`` only), > 0.
        zeta: shards per node (``shards`` only), >= 1.
        min_samples: least samples per node for ``dirichlet``.

    Returns:
        ``num_nodes`` sorted, disjoint int64 arrays of positions into ``pool``.

    Raises:
        ValueError: unknown scheme or invalid argument (see the scheme functions).
    """
    if scheme not in PARTITIONS:
        raise ValueError(f"unknown partition scheme {scheme!r}; known: {', '.join(PARTITIONS)}")
    # Validate every argument up front, whichever scheme uses it.
    if not isinstance(beta, (int, float, np.floating, np.integer)) or isinstance(beta, bool) \
            or not beta > 0 or not np.isfinite(beta):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    if isinstance(zeta, bool) or not isinstance(zeta, (int, np.integer)) or zeta < 1:
        raise ValueError(f"zeta must be an integer >= 1, got {zeta!r}")
    rng = stream_rng(seed, f"partition/{scheme}")
    y = pool.y
    if scheme == "by-user":
        return partition_by_user(pool.groups, num_nodes, pool.name)
    if scheme == "iid":
        return partition_iid(y, num_nodes, rng)
    if scheme == "dirichlet":
        return partition_dirichlet(y, num_nodes, rng, beta=beta, min_samples=min_samples)
    return partition_shards(y, num_nodes, rng, zeta=zeta)
