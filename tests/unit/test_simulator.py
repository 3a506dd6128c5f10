"""Simulator: the summary.json contract, determinism, and fault injection."""

import json

import pytest

from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.simulator import SimConfig, simulate

KEYS = {"algorithm", "nodes", "rounds_completed", "global_accuracy", "local_accuracy", "bytes_sent",
        "bytes_received", "wall_seconds"}


def _cfg(**kw):
    base = dict(algorithm="fedavg", nodes=4, rounds=3, dataset="har", partition="by-user",
                train=TrainConfig(batch_size=64))
    base.update(kw)
    return SimConfig(**base)


def test_summary_contract_and_files(tmp_path):
    s = simulate(_cfg(out=str(tmp_path), baseline_local=True))
    assert set(s) >= KEYS
    assert s["rounds_completed"] == 3 and s["nodes"] == 4
    for key in ("global_accuracy", "local_accuracy", "local_only_global_accuracy"):
        assert {"mean", "std", "per_node"} <= set(s[key])
        assert all(0.0 <= v <= 1.0 for v in s[key]["per_node"].values())
    assert s["bytes_sent"] > 0 and s["bytes_received"] >= s["bytes_sent"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["rounds_completed"] == 3
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 12
    assert (tmp_path / "accuracy.png").stat().st_size > 1000


def test_deterministic_for_a_seed():
    a = simulate(_cfg(seed=3))
    b = simulate(_cfg(seed=3))
    c = simulate(_cfg(seed=4, partition="iid"))
    assert a["global_accuracy"]["per_node"] == b["global_accuracy"]["per_node"]
    # envelopes carry a wall-clock timestamp whose JSON length may vary by a few bytes
    assert abs(a["bytes_sent"] - b["bytes_sent"]) <= 1e-4 * a["bytes_sent"]
    assert c["global_accuracy"]["per_node"] != a["global_accuracy"]["per_node"]


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "shards"])
def test_partitions_on_digits(partition):
    s = simulate(_cfg(dataset="digits", partition=partition, nodes=3, rounds=2))
    assert s["rounds_completed"] == 2


def test_killed_node_does_not_stall_the_others():
    s = simulate(_cfg(nodes=3, rounds=4, kill={2: 2}, options={"round_timeout": 10.0}))
    assert s["rounds_per_node"] == {"node00": 4, "node01": 4, "node02": 1}


def test_unknown_algorithm_and_bad_option():
    with pytest.raises(KeyError):
        simulate(_cfg(algorithm="nope"))
    with pytest.raises(ValueError, match="algorithm.options.x"):
        simulate(_cfg(options={"x": 1}))


def test_samples_per_node_draws_fixed_count_per_node():
    """Growth figures: every node gets k distinct samples, nodes may share samples."""
    from dfl_agent.runtime.node.simulator import sampled_parts

    parts = sampled_parts(50, 200, 10, seed=3)
    assert len(parts) == 200 and all(len(p) == 10 and len(set(p.tolist())) == 10 for p in parts)
    assert all(p.min() >= 0 and p.max() < 50 for p in parts)
    assert len({int(i) for p in parts for i in p}) == 50  # 2000 draws cover the 50-sample pool: shared
    again = sampled_parts(50, 200, 10, seed=3)
    assert all((a == b).all() for a, b in zip(parts, again))
    import pytest

    with pytest.raises(ValueError, match="pool size"):
        sampled_parts(5, 2, 6, seed=0)
