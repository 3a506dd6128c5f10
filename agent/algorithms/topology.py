"""Communication graphs (neighbourhoods) for the simulator and the daemon.

:func:`build_topology` returns an undirected graph as ``{node: sorted neighbour ids}``
(self never included; algorithms that aggregate over N_i ∪ {i}, like DecHW, add
themselves).  Everything is seeded; no global RNG.

Graphs (``TOPOLOGIES``; options in brackets, passed as ``build_topology(..., **options)``
or ``dflctl simulate --topology NAME --topology-option KEY=VALUE``):

``full``            every node is every other node's neighbour.
``ring``            node i is linked to i-1 and i+1 (mod N).
``erdos_renyi``     [p = 0.2, max_tries = 1000] G(N, p): each of the N(N-1)/2 edges
                    independently with probability p, redrawn until connected (DecHW
                    seed 001 §V-A: 50 nodes, p = 0.2).
``barabasi_albert`` [m = 2] preferential attachment: a complete core of m+1 nodes,
                    then every further node links to m distinct earlier nodes drawn
                    with probability proportional to their degree (always connected).
``adjacency``       [path] a 0/1 adjacency matrix from a file: CSV or whitespace
                    separated rows, or a JSON list of lists (``.json`` or text starting
                    with ``[``); square, symmetric, one row per node in id order.  The
                    diagonal is ignored (self-loops carry no meaning here).

Node order: row/column ``k`` of every adjacency matrix is ``ids[k]``; the simulator's
ids are ``node00, node01, ...``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.jsonbound import loads as bounded_loads

Graph = dict[str, list[str]]


def _from_adjacency(ids: Sequence[str], adj: np.ndarray) -> Graph:
    return {a: [ids[int(j)] for j in np.flatnonzero(adj[i]) if j != i] for i, a in enumerate(ids)}


def is_connected(adj: np.ndarray) -> bool:
    """Whether the undirected graph of the boolean ``(N, N)`` matrix ``adj`` is connected
    (breadth-first search from node 0; the empty and the 1-node graph are connected)."""
    n = adj.shape[0]
    if n <= 1:
        return True
    seen = np.zeros(n, dtype=bool)
    seen[0] = True
    queue = deque([0])
    while queue:
        i = queue.popleft()
        for j in np.flatnonzero(adj[i] & ~seen):
            seen[j] = True
            queue.append(int(j))
    return bool(seen.all())


def graph_is_connected(graph: Graph) -> bool:
    """Whether a :data:`Graph` (``{node: neighbours}``) is connected."""
    ids = sorted(graph)
    index = {a: i for i, a in enumerate(ids)}
    adj = np.zeros((len(ids), len(ids)), dtype=bool)
    for a, nbrs in graph.items():
        for b in nbrs:
            adj[index[a], index[b]] = adj[index[b], index[a]] = True
    return is_connected(adj)


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


def erdos_renyi(ids: Sequence[str], rng: np.random.Generator, p: float = 0.2, max_tries: int = 1000) -> Graph:
    """Erdős–Rényi G(N, p), redrawn until connected (seed 001 §V-A).

    Each unordered pair is an edge independently with probability ``p``.  Connectivity
    is almost sure for p well above ln(N)/N (0.078 for N = 50).

    Raises:
        ValueError: ``p`` outside (0, 1], ``max_tries`` < 1, or no connected draw within
            ``max_tries`` (the message gives the ln(N)/N threshold).
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"erdos_renyi: p must be a number in (0, 1], got {p!r}")
    if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
        raise ValueError(f"erdos_renyi: max_tries must be a positive integer, got {max_tries!r}")
    n = len(ids)
    iu = np.triu_indices(n, k=1)
    for _ in range(max_tries):
        adj = np.zeros((n, n), dtype=bool)
        adj[iu] = rng.random(len(iu[0])) < p
        adj |= adj.T
        if is_connected(adj):
            return _from_adjacency(ids, adj)
    threshold = math.log(n) / n if n > 1 else 0.0
    raise ValueError(
        f"erdos_renyi: no connected graph in {max_tries} draws with N={n}, p={p} "
        f"(connectivity needs p well above ln(N)/N = {threshold:.3f}); raise p or max_tries"
    )


def barabasi_albert(ids: Sequence[str], rng: np.random.Generator, m: int = 2) -> Graph:
    """Barabási–Albert preferential attachment with ``m`` links per new node (connected).

    Nodes ``0..m`` form a complete graph; node k > m then links to ``m`` distinct nodes
    among ``0..k-1``, each drawn with probability proportional to its current degree.
    With N <= m + 1 the result is the complete graph.

    Raises:
        ValueError: ``m`` is not an integer >= 1.
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"barabasi_albert: m must be an integer >= 1, got {m!r}")
    n = len(ids)
    adj = np.zeros((n, n), dtype=bool)
    core = min(n, m + 1)
    adj[:core, :core] = True
    np.fill_diagonal(adj, False)
    for k in range(core, n):
        deg = adj[:k, :k].sum(axis=1).astype(np.float64)
        targets = rng.choice(k, size=m, replace=False, p=deg / deg.sum())
        adj[k, targets] = adj[targets, k] = True
    return _from_adjacency(ids, adj)


def read_adjacency(path: str | Path) -> np.ndarray:
    """Read a 0/1 adjacency matrix from ``path``: JSON list of lists, CSV, or whitespace rows.

    Blank lines and lines starting with ``#`` are skipped in the text formats.

    Returns:
        ``(N, N)`` bool array.

    Raises:
        ValueError: unreadable file, ragged or non-square matrix, entries other than
            0/1, or an asymmetric matrix (the message names the first offending entry).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"adjacency: cannot read {str(p)!r}: {exc}") from None
    rows: list[list[Any]]
    if p.suffix.lower() == ".json" or text.lstrip().startswith("["):
        try:
            rows = bounded_loads(text, max_bytes=1 << 30)  # depth-bounded; a big matrix is fine
        except ValueError as exc:
            raise ValueError(f"adjacency: {p}: invalid JSON: {exc}") from None
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise ValueError(f"adjacency: {p}: JSON must be a list of lists")
    else:
        rows = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            rows.append([c for c in line.replace(",", " ").split() if c])
    n = len(rows)
    if n == 0:
        raise ValueError(f"adjacency: {p}: empty matrix")
    for i, r in enumerate(rows):
        if len(r) != n:
            raise ValueError(f"adjacency: {p}: matrix must be square; row {i} has {len(r)} entries, expected {n}")
    adj = np.zeros((n, n), dtype=bool)
    for i, r in enumerate(rows):
        for j, v in enumerate(r):
            if isinstance(v, bool):
                v = int(v)
            if v in (0, 1, "0", "1", 0.0, 1.0, "0.0", "1.0"):
                adj[i, j] = float(v) == 1.0
            else:
                raise ValueError(f"adjacency: {p}: entry ({i}, {j}) must be 0 or 1, got {v!r}")
    bad = np.argwhere(adj != adj.T)
    if len(bad):
        i, j = bad[0]
        raise ValueError(f"adjacency: {p}: matrix must be symmetric; entry ({i}, {j}) != ({j}, {i})")
    return adj


def adjacency(ids: Sequence[str], rng: np.random.Generator, path: str | None = None) -> Graph:
    """The graph of the adjacency-matrix file ``path`` (see :func:`read_adjacency`).

    Raises:
        ValueError: no ``path``, an invalid file, or a matrix whose size is not the
            number of nodes.
    """
    if not path or not isinstance(path, str):
        raise ValueError("adjacency: needs the option path=FILE")
    adj = read_adjacency(path)
    if adj.shape[0] != len(ids):
        raise ValueError(f"adjacency: {path}: matrix is {adj.shape[0]}x{adj.shape[0]} but there are {len(ids)} nodes")
    return _from_adjacency(ids, adj)


TOPOLOGIES: dict[str, Callable[..., Graph]] = {
    "full": full,
    "ring": ring,
    "erdos_renyi": erdos_renyi,
    "barabasi_albert": barabasi_albert,
    "adjacency": adjacency,
}


def build_topology(name: str, ids: Sequence[str], seed: int, **options: Any) -> Graph:
    """Build the graph ``name`` over ``ids`` (seeded).

    Raises:
        ValueError: unknown name (the message lists the known ones) or bad options.
    """
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(sorted(TOPOLOGIES))}")
    rng = np.random.default_rng([seed, 0x70B0])
    try:
        return TOPOLOGIES[name](list(ids), rng, **options)
    except TypeError as exc:  # unknown option name
        raise ValueError(f"topology {name!r}: bad options {sorted(options)}: {exc}") from None
