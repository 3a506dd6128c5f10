"""Communication graphs (neighbourhoods) for the simulator and the daemon.

:func:`build_topology` returns an undirected graph as ``{node: sorted neighbour ids}``
(self never included; algorithms that aggregate over N_i ∪ {i}, like DecHW, add
themselves).  Everything is seeded; no global RNG.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

Graph = dict[str, list[str]]


def _from_adjacency(ids: Sequence[str], adj: np.ndarray) -> Graph:
    return {a: [ids[j] for j in np.flatnonzero(adj[i]) if j != i] for i, a in enumerate(ids)}


def full(ids: Sequence[str], rng: np.random.Generator) -> Graph:
    """Every node is every other node's neighbour."""
    return {a: [b for b in ids if b != a] for a in ids}


def ring(ids: Sequence[str], rng: np.random.Generator) -> Graph:
    """Node i is connected to i-1 and i+1 (mod N)."""
    n = len(ids)
    adj = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if n > 1:
            adj[i, (i + 1) % n] = adj[(i + 1) % n, i] = True
    return _from_adjacency(ids, adj)


TOPOLOGIES: dict[str, Callable[..., Graph]] = {"full": full, "ring": ring}


def build_topology(name: str, ids: Sequence[str], seed: int, **options: Any) -> Graph:
    """Build the graph ``name`` over ``ids`` (seeded).

    Raises:
        ValueError: unknown name (the message lists the known ones) or bad options.
    """
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(sorted(TOPOLOGIES))}")
    rng = np.random.default_rng([seed, 0x70B0])
    return TOPOLOGIES[name](list(ids), rng, **options)
