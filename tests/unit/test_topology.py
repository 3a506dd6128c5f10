"""Communication graphs: connectivity, symmetry, seeding, adjacency-file validation."""

import json

import numpy as np
import pytest

from dfl_agent.algorithms.topology import TOPOLOGIES, build_topology, graph_is_connected, read_adjacency

IDS = [f"node{i:02d}" for i in range(50)]


def _symmetric(g):
    return all(a in g[b] for a, nbrs in g.items() for b in nbrs) and all(a not in g[a] for a in g)


@pytest.mark.parametrize("name,opts", [("full", {}), ("ring", {}), ("erdos_renyi", {"p": 0.2}),
                                       ("barabasi_albert", {"m": 2})])
def test_graphs_are_connected_symmetric_and_seeded(name, opts):
    g = build_topology(name, IDS, seed=3, **opts)
    assert sorted(g) == IDS and _symmetric(g) and graph_is_connected(g)
    assert g == build_topology(name, IDS, seed=3, **opts)
    assert all(nbrs == sorted(nbrs) for nbrs in g.values())


def test_erdos_renyi_density_and_seed_dependence():
    g = build_topology("erdos_renyi", IDS, seed=0, p=0.2)
    edges = sum(len(v) for v in g.values()) / 2
    assert 0.15 < edges / (50 * 49 / 2) < 0.25  # density ≈ p
    assert g != build_topology("erdos_renyi", IDS, seed=1, p=0.2)
    # a sparse p is redrawn until connected
    sparse = build_topology("erdos_renyi", IDS[:20], seed=0, p=0.15)
    assert graph_is_connected(sparse)


def test_erdos_renyi_gives_up_with_a_clear_error():
    with pytest.raises(ValueError, match="no connected graph in 5 draws.*ln\\(N\\)/N"):
        build_topology("erdos_renyi", IDS, seed=0, p=0.01, max_tries=5)
    with pytest.raises(ValueError, match="p must be"):
        build_topology("erdos_renyi", IDS, seed=0, p=0.0)


def test_barabasi_albert_degrees():
    g = build_topology("barabasi_albert", IDS, seed=0, m=3)
    degrees = np.array([len(v) for v in g.values()])
    assert degrees.min() >= 3 and sum(degrees) / 2 == 6 + 3 * (50 - 4)  # K4 core + 3 links per new node
    assert degrees.max() > 10  # hubs
    small = build_topology("barabasi_albert", IDS[:3], seed=0, m=5)
    assert all(len(v) == 2 for v in small.values())  # N <= m+1: complete
    with pytest.raises(ValueError, match="m must be"):
        build_topology("barabasi_albert", IDS, seed=0, m=0)


def test_adjacency_formats(tmp_path):
    adj = [[0, 1, 0], [1, 0, 1], [0, 1, 0]]
    ids = ["a", "b", "c"]
    expect = {"a": ["b"], "b": ["a", "c"], "c": ["b"]}
    (tmp_path / "m.json").write_text(json.dumps(adj))
    (tmp_path / "m.csv").write_text("# path graph\n0,1,0\n1,0,1\n\n0,1,0\n")
    (tmp_path / "m.txt").write_text("0 1 0\n1 1 1\n0 1 0\n")  # diagonal ignored
    for f in ("m.json", "m.csv", "m.txt"):
        assert build_topology("adjacency", ids, seed=0, path=str(tmp_path / f)) == expect
    assert read_adjacency(tmp_path / "m.csv").dtype == bool


@pytest.mark.parametrize("text,match", [
    ("0,1\n0,0\n", "symmetric; entry \\(0, 1\\)"),
    ("0,1,0\n1,0\n0,0,0\n", "square; row 1"),
    ("0,2\n2,0\n", "must be 0 or 1"),
    ("[[0, 1], [1]]", "square"),
    ("[1, 2]", "list of lists"),
    ("[[0, 1", "invalid JSON"),
    ("\n# nothing\n", "empty"),
])
def test_adjacency_validation_errors(tmp_path, text, match):
    f = tmp_path / "adj.txt"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        build_topology("adjacency", ["a", "b"], seed=0, path=str(f))


def test_adjacency_size_and_path_errors(tmp_path):
    f = tmp_path / "adj.csv"
    f.write_text("0,1\n1,0\n")
    with pytest.raises(ValueError, match="2x2 but there are 3 nodes"):
        build_topology("adjacency", ["a", "b", "c"], seed=0, path=str(f))
    with pytest.raises(ValueError, match="needs the option path"):
        build_topology("adjacency", ["a", "b"], seed=0)
    with pytest.raises(ValueError, match="cannot read"):
        build_topology("adjacency", ["a", "b"], seed=0, path=str(tmp_path / "missing.csv"))


def test_unknown_topology_and_option():
    with pytest.raises(ValueError, match="unknown topology 'star'; known: adjacency, barabasi_albert"):
        build_topology("star", IDS, seed=0)
    with pytest.raises(ValueError, match="bad options"):
        build_topology("ring", IDS, seed=0, p=0.3)
    assert {"full", "ring", "erdos_renyi", "barabasi_albert", "adjacency"} <= set(TOPOLOGIES)


def _edges(g):
    """The undirected edges of ``g``, each once; asserts no self-loop and no repeated neighbour."""
    for a, nbrs in g.items():
        assert a not in nbrs and len(set(nbrs)) == len(nbrs)
    return {tuple(sorted((a, b))) for a, nbrs in g.items() for b in nbrs}


@pytest.mark.parametrize("n,k", [(50, 4), (51, 4), (20, 3), (200, 6), (10, 9)])
def test_k_regular_every_degree_is_k(n, k):
    ids = [f"node{i:03d}" for i in range(n)]
    g = build_topology("k_regular", ids, seed=5, k=k)
    assert sorted(g) == ids and _symmetric(g) and graph_is_connected(g)
    assert {len(v) for v in g.values()} == {k}
    assert len(_edges(g)) == n * k // 2
    assert g == build_topology("k_regular", ids, seed=5, k=k)
    if k < n - 1:  # k = N - 1 is the complete graph, whatever the seed
        assert g != build_topology("k_regular", ids, seed=6, k=k)


def test_k_regular_refuses_impossible_degrees():
    with pytest.raises(ValueError, match="N·k must be even"):
        build_topology("k_regular", IDS[:5], seed=0, k=3)
    with pytest.raises(ValueError, match="k must be < N"):
        build_topology("k_regular", IDS[:5], seed=0, k=5)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        build_topology("k_regular", IDS, seed=0, k=0)
    with pytest.raises(ValueError, match="no connected 2-regular graph on 50 nodes in 3 draws"):
        build_topology("k_regular", IDS, seed=0, k=2, max_tries=3)  # mostly a union of several cycles


@pytest.mark.parametrize("k,p", [(4, 0.1), (6, 0.3), (2, 0.0), (4, 1.0)])
def test_watts_strogatz_keeps_the_mean_degree_k(k, p):
    g = build_topology("watts_strogatz", IDS, seed=2, k=k, p=p)
    assert sorted(g) == IDS and _symmetric(g) and graph_is_connected(g)
    edges = _edges(g)
    assert len(edges) == 50 * k // 2  # rewiring keeps the edge count: mean degree exactly k
    lattice = {tuple(sorted((IDS[i], IDS[(i + j) % 50]))) for i in range(50) for j in range(1, k // 2 + 1)}
    if p == 0:
        assert edges == lattice  # no rewiring: the ring lattice
    else:
        assert min(len(v) for v in g.values()) >= k // 2 and len(edges - lattice) > 0


def test_watts_strogatz_options():
    with pytest.raises(ValueError, match="k must be even"):
        build_topology("watts_strogatz", IDS, seed=0, k=3)
    with pytest.raises(ValueError, match="p must be a number in"):
        build_topology("watts_strogatz", IDS, seed=0, p=1.5)


def test_torus_is_a_wrapped_grid():
    ids = [f"node{i:02d}" for i in range(30)]
    g = build_topology("torus", ids, seed=0)  # 5 x 6
    assert _symmetric(g) and graph_is_connected(g) and {len(v) for v in g.values()} == {4}
    assert g["node00"] == ["node01", "node05", "node06", "node24"]  # right, wrap left, down, wrap up
    assert {len(v) for v in build_topology("torus", ids, seed=0, rows=3).values()} == {4}
    assert build_topology("torus", ids[:7], seed=0) == build_topology("ring", ids[:7], seed=0)  # prime N: 1 x N
    with pytest.raises(ValueError, match="rows = 4 does not divide N = 30"):
        build_topology("torus", ids, seed=0, rows=4)
    assert {"k_regular", "watts_strogatz", "torus"} <= set(TOPOLOGIES)
