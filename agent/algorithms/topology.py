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
``k_regular``       [k = 4, max_tries = 100] a random k-regular graph: every node has
                    exactly k neighbours (Steger & Wormald's pairing, the algorithm of
                    networkx's ``random_regular_graph``), redrawn until connected; the
                    regular graphs of decentralized-learning studies (decentralizepy).
``watts_strogatz``  [k = 4, p = 0.1, max_tries = 100] small world (Watts & Strogatz
                    1998): a ring lattice where each node links to its k/2 nearest
                    neighbours on either side, then each lattice edge (i, i+j) is
                    rewired with probability p to (i, w), w uniform among the nodes
                    not yet linked to i; redrawn until connected.  Rewiring keeps the
                    number of edges, so the mean degree is exactly k.
``torus``           [rows = 0] a 2-D torus grid (D-PSGD's torus): node r*cols + c links
                    to its four grid neighbours, wrapping around; N = rows × cols with
                    ``rows`` = the largest divisor of N up to √N when 0.  Every node has
                    degree 4 when rows, cols >= 3 (fewer on thinner grids: a 1-row torus
                    is the ring).
``adjacency``       [path] a 0/1 adjacency matrix from a file: CSV or whitespace
                    separated rows, or a JSON list of lists (``.json`` or text starting
                    with ``[``); square, symmetric, one row per node in id order.  The
                    diagonal is ignored (self-loops carry no meaning here).

Node order: row/column ``k`` of every adjacency matrix is ``ids[k]``; the simulator's
ids are ``node00, node01, ...``.

Memory: the fixed-degree graphs (``ring``, ``k_regular``, ``watts_strogatz``, ``torus``)
are built from edge lists, O(N·k); ``erdos_renyi``, ``barabasi_albert`` and ``adjacency``
hold a dense N×N matrix while they are built.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.jsonbound import loads as bounded_loads

Graph = dict[str, list[str]]


def _from_adjacency(ids: Sequence[str], adj: np.ndarray) -> Graph:
    return {a: [ids[int(j)] for j in np.flatnonzero(adj[i]) if j != i] for i, a in enumerate(ids)}


def _from_edges(ids: Sequence[str], edges: Iterable[tuple[int, int]]) -> Graph:
    """The graph of the undirected index pairs ``edges`` (no self-loops, no repeats),
    each neighbour list in index order, as :func:`_from_adjacency` gives."""
    nbrs: list[list[int]] = [[] for _ in ids]
    for i, j in edges:
        nbrs[i].append(j)
        nbrs[j].append(i)
    return {a: [ids[j] for j in sorted(nbrs[i])] for i, a in enumerate(ids)}


def graph_is_connected(graph: Graph) -> bool:
    """Whether a :data:`Graph` (``{node: neighbours}``) is connected (breadth-first search
    over its lists, O(N + edges); the empty and the 1-node graph are connected)."""
    if len(graph) <= 1:
        return True
    start = next(iter(graph))
    seen = {start}
    queue = deque([start])
    while queue:
        for b in graph[queue.popleft()]:
            if b not in seen:
                seen.add(b)
                queue.append(b)
    return len(seen) == len(graph)


def _positive_int(topology: str, name: str, value: Any, low: int = 1) -> int:
    """``value`` as an option ``name`` of ``topology`` that must be an integer >= ``low``.

    Raises:
        ValueError: anything else (the message names the topology and the option)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{topology}: {name} must be an integer >= {low}, got {value!r}")
    return value


def full(ids: Sequence[str], rng: np.random.Generator) -> Graph:
    """Every node is every other node's neighbour."""
    return {a: [b for b in ids if b != a] for a in ids}


def ring(ids: Sequence[str], rng: np.random.Generator) -> Graph:
    """Node i is connected to i-1 and i+1 (mod N) (N = 2: one edge; N = 1: none)."""
    n = len(ids)
    return _from_edges(ids, {(min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n) if n > 1})


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
        graph = _from_adjacency(ids, adj)
        if graph_is_connected(graph):
            return graph
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


def k_regular(ids: Sequence[str], rng: np.random.Generator, k: int = 4, max_tries: int = 100) -> Graph:
    """A random ``k``-regular graph: every node has exactly ``k`` distinct neighbours,
    no self-loops; redrawn until connected.

    The pairing of Steger & Wormald (1999), as networkx's ``random_regular_graph``: the
    N·k stubs (k per node) are shuffled and paired; a pair that would make a self-loop or
    a repeated edge returns its stubs to the pool, which is shuffled and paired again
    while a suitable pair remains (else the draw restarts).  For k >= 3 a random
    k-regular graph is connected with high probability; for k = 2 it is a union of
    cycles (use ``ring`` for one cycle).  O(N·k) memory.

    Raises:
        ValueError: ``k`` not an integer in [1, N-1], N·k odd, ``max_tries`` < 1, or no
            connected draw within ``max_tries``.
    """
    n = len(ids)
    _positive_int("k_regular", "k", k)
    _positive_int("k_regular", "max_tries", max_tries)
    if k >= n:
        raise ValueError(f"k_regular: k must be < N (= {n}), got {k}")
    if (n * k) % 2:
        raise ValueError(f"k_regular: N·k must be even (N = {n}, k = {k}): change N or k")
    for _ in range(max_tries):
        edges = _regular_pairing(n, k, rng)
        if edges is not None:
            graph = _from_edges(ids, sorted(edges))
            if graph_is_connected(graph):
                return graph
    raise ValueError(f"k_regular: no connected {k}-regular graph on {n} nodes in {max_tries} draws "
                     f"(k = 2 is mostly disconnected cycles: use ring, or k >= 3); raise k or max_tries")


def _regular_pairing(n: int, k: int, rng: np.random.Generator) -> set[tuple[int, int]] | None:
    """One attempt of :func:`k_regular`'s pairing: a set of ``n·k/2`` edges ``(i, j)``,
    ``i < j``, every node in ``k`` of them; None when the remaining stubs cannot be paired."""
    edges: set[tuple[int, int]] = set()
    stubs = np.repeat(np.arange(n), k)
    while len(stubs):
        rng.shuffle(stubs)
        left: list[int] = []
        for s1, s2 in zip(stubs[0::2].tolist(), stubs[1::2].tolist()):
            a, b = (s1, s2) if s1 < s2 else (s2, s1)
            if a != b and (a, b) not in edges:
                edges.add((a, b))
            else:
                left += (s1, s2)
        if not left:
            return edges
        # another round can succeed only if some remaining pair is a new edge
        rest = sorted(set(left))
        if not any(a < b and (a, b) not in edges for i, a in enumerate(rest) for b in rest[i + 1:]):
            return None
        stubs = np.array(left)
    return edges


def watts_strogatz(ids: Sequence[str], rng: np.random.Generator, k: int = 4, p: float = 0.1,
                   max_tries: int = 100) -> Graph:
    """Watts–Strogatz small world (Watts & Strogatz 1998, the rewiring of networkx's
    ``watts_strogatz_graph``), redrawn until connected.

    A ring lattice links node i to i±1, ..., i±k/2 (mod N); then for j = 1..k/2 and each
    node i in order, the edge (i, i+j) is rewired with probability ``p`` to (i, w), w
    uniform among the nodes other than i and not yet linked to i (left as it is when i
    is linked to every node).  The number of edges stays N·k/2: the mean degree is
    exactly k, the minimum at least k/2.  O(N·k) memory.

    Raises:
        ValueError: ``k`` not an even integer in [2, N-1], ``p`` outside [0, 1],
            ``max_tries`` < 1, or no connected draw within ``max_tries``.
    """
    n = len(ids)
    _positive_int("watts_strogatz", "k", k, low=2)
    _positive_int("watts_strogatz", "max_tries", max_tries)
    if k % 2 or k >= n:
        raise ValueError(f"watts_strogatz: k must be even and < N (= {n}), got {k}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ValueError(f"watts_strogatz: p must be a number in [0, 1], got {p!r}")
    for _ in range(max_tries):
        nbrs: list[set[int]] = [set() for _ in range(n)]
        for i in range(n):
            for j in range(1, k // 2 + 1):
                nbrs[i].add((i + j) % n)
                nbrs[(i + j) % n].add(i)
        for j in range(1, k // 2 + 1):
            draws = rng.random(n)
            for i in range(n):
                v = (i + j) % n
                if draws[i] < p and v in nbrs[i] and len(nbrs[i]) < n - 1:
                    w = int(rng.integers(n))
                    while w == i or w in nbrs[i]:
                        w = int(rng.integers(n))
                    nbrs[i].discard(v)
                    nbrs[v].discard(i)
                    nbrs[i].add(w)
                    nbrs[w].add(i)
        graph = {a: [ids[j] for j in sorted(nbrs[i])] for i, a in enumerate(ids)}
        if graph_is_connected(graph):
            return graph
    raise ValueError(f"watts_strogatz: no connected graph on {n} nodes with k = {k}, p = {p} in {max_tries} "
                     "draws; lower p or raise k or max_tries")


def torus(ids: Sequence[str], rng: np.random.Generator, rows: int = 0) -> Graph:
    """A 2-D torus (wrap-around grid) of ``rows`` × N/rows nodes: node ``r*cols + c``
    links to ``((r±1) mod rows, c)`` and ``(r, (c±1) mod cols)`` (D-PSGD's torus, Lian et
    al. 2017).  ``rows`` = 0: the largest divisor of N up to √N (5 × 6 for 30 nodes, 1 ×
    N for a prime N: the ring).  Degree 4 when rows, cols >= 3.

    Raises:
        ValueError: ``rows`` not an integer >= 0 or not a divisor of N.
    """
    n = len(ids)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"torus: rows must be an integer >= 0, got {rows!r}")
    if rows == 0:
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0) if n else 1
    if n % rows:
        raise ValueError(f"torus: rows = {rows} does not divide N = {n}")
    cols = n // rows
    edges = set()
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            for j in (((r + 1) % rows) * cols + c, r * cols + (c + 1) % cols):
                if j != i:
                    edges.add((min(i, j), max(i, j)))
    return _from_edges(ids, sorted(edges))


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
    "k_regular": k_regular,
    "watts_strogatz": watts_strogatz,
    "torus": torus,
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
