"""bench/scale/workers.py: node groups split in halves (as its worker processes hold them)
end a fedavg round with the same parameters as one group of all nodes (the simulator's
one-process design), so the benchmark compares equal work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("bench_scale_workers", ROOT / "bench" / "scale" / "workers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_split_groups_equal_one_group_after_a_round():
    w = _load()
    nodes = 4
    whole = w.Group(nodes, list(range(nodes)), seed=0, epochs=1)
    halves = [w.Group(nodes, [0, 1], seed=0, epochs=1), w.Group(nodes, [2, 3], seed=0, epochs=1)]
    before = whole.params()
    whole.train(1)
    whole.aggregate_and_evaluate(1, {})
    outs = [h.train(1) for h in halves]
    assert len(outs[0]) == len(outs[1]) == 2
    halves[0].aggregate_and_evaluate(1, outs[1])  # each half gets the other's broadcasts
    halves[1].aggregate_and_evaluate(1, outs[0])
    split = {**halves[0].params(), **halves[1].params()}
    after = whole.params()
    assert w.max_param_diff(after, split) <= 1e-6
    assert w.max_param_diff(before, after) > 0  # the round changed the models
    # fedavg over the full graph: every node ends with the same average
    first = after["node00"]
    assert all(np.allclose(after[n][k], first[k], atol=1e-6) for n in after for k in first)
