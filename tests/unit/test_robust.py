"""Robust aggregation rules (norm clipping, coordinate-wise median, trimmed mean) and
the ``aggregation`` option of the averaging algorithms."""

import numpy as np
import pytest

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.learning.robust import (
    clip_updates,
    coordinate_median,
    deviation_norm,
    robust_aggregate,
    trimmed_mean,
)
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.simulator import SimConfig, simulate


def _m(*vals, dtype=np.float32):
    return {"w": np.array(vals, dtype), "n": np.array([len(vals)])}


def test_median_and_trimmed_mean_ignore_one_outlier():
    honest = [_m(1.0, 2.0), _m(1.2, 2.2), _m(0.8, 1.8), _m(1.1, 2.1)]
    poisoned = honest + [_m(1e6, -1e6)]
    med = coordinate_median(poisoned)
    np.testing.assert_allclose(med["w"], [1.1, 2.0], rtol=1e-6)
    assert med["w"].dtype == np.float32 and med["n"].tolist() == [2]
    tm = trimmed_mean(poisoned, 0.2)  # b = 1: drop min and max per coordinate
    np.testing.assert_allclose(tm["w"], [(1.0 + 1.2 + 1.1) / 3, (2.0 + 1.8 + 2.1) / 3], rtol=1e-6)
    np.testing.assert_allclose(trimmed_mean(honest, 0.0)["w"], np.mean([h["w"] for h in honest], 0), rtol=1e-6)
    # a plain weighted mean is dragged away
    mean, _ = robust_aggregate(poisoned[0], poisoned[1:], [1] * 5, "mean")
    assert abs(mean["w"][0]) > 1e4


def test_clipping_bounds_the_deviation():
    own = _m(0.0, 0.0)
    others = [_m(3.0, 4.0), _m(0.3, 0.4), _m(30.0, 40.0)]
    clipped, bound = clip_updates(others, own, 1.0)
    assert bound == 1.0
    assert [round(deviation_norm(c, own), 5) for c in clipped] == [1.0, 0.5, 1.0]
    np.testing.assert_allclose(clipped[0]["w"], [0.6, 0.8], rtol=1e-6)
    _, adaptive = clip_updates(others, own, 0.0)
    assert adaptive == pytest.approx(5.0)  # median of 5, 0.5, 50
    out, info = robust_aggregate(own, others, [1, 1, 1, 1], "clip", clip_norm=1.0)
    assert info["clip_norm"] == 1.0 and np.linalg.norm(out["w"]) <= 1.0


def test_errors_are_clear():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        robust_aggregate(_m(1.0), [], [1], "krum")
    with pytest.raises(ValueError, match="trim_ratio"):
        trimmed_mean([_m(1.0)], 0.5)
    with pytest.raises(ValueError, match="shape"):
        coordinate_median([_m(1.0), _m(1.0, 2.0)])
    with pytest.raises(ValueError, match="at least one"):
        coordinate_median([])
    with pytest.raises(ValueError, match="algorithm.options.aggregation: must be one of"):
        parse_options(get_algorithm("fedavg"), {"aggregation": "krum"})
    with pytest.raises(ValueError, match="algorithm.options.trim_ratio: "):
        parse_options(get_algorithm("dechetero"), {"aggregation": "trimmed_mean", "trim_ratio": 0.7})


@pytest.mark.parametrize("alg,rule", [("fedavg", "median"), ("dechetero", "trimmed_mean"), ("cfa", "clip"),
                                      ("dechw", "median")])
def test_algorithms_run_with_a_robust_rule(alg, rule, monkeypatch):
    import importlib

    # fedavg and dechetero aggregate with NeighbourhoodAlgorithm.aggregate
    where = "protocols.neighbourhood" if alg in ("fedavg", "dechetero") else alg
    module = importlib.import_module(f"dfl_agent.algorithms.{where}")
    real = module.robust_aggregate
    used: list[str] = []

    def spy(own, others, weights, how, **kw):  # the real rule, recording which one the algorithm asked for
        used.append(how)
        return real(own, others, weights, how, **kw)

    monkeypatch.setattr(module, "robust_aggregate", spy)
    if hasattr(module, "clip_updates"):  # cfa clips neighbours' models before its own consensus step
        real_clip = module.clip_updates

        def clip_spy(*a, **kw):
            used.append("clip")
            return real_clip(*a, **kw)

        monkeypatch.setattr(module, "clip_updates", clip_spy)
    opts = {"aggregation": rule}
    s = simulate(SimConfig(algorithm=alg, nodes=5, rounds=2, dataset="digits", partition="iid", seed=0,
                           options=opts, train=TrainConfig(epochs=1, batch_size=32, lr=0.05, momentum=0.5)))
    assert s["rounds_completed"] == 2
    assert 0.0 < s["global_accuracy"]["mean"] <= 1.0
    # the option reached the aggregation: every aggregation used the configured rule, none fell back to mean
    assert used and set(used) == {rule}, used


def _blown_up(aggregation: str, compression: str) -> dict[str, list[dict]]:
    """Four fedavg nodes under ``quorum``; in round 4 node00's model blows up (its weights
    times 1,000: finite, as in the field lab's blow-ups) before it sends it.  Each node's
    round records, in round order."""
    import torch

    from dfl_agent.runtime.node.simulator import round_records

    cfg = SimConfig(algorithm="fedavg", nodes=4, rounds=16, dataset="digits", partition="iid", model_size="small",
                    straggler="quorum", compression=compression, options={"aggregation": aggregation},
                    train=TrainConfig(epochs=1, lr=0.05))

    def blow_up_node0(fed):
        node0 = fed.nodes[0].algorithm
        send = node0.send_model

        async def blow_up_then_send(t, extra):
            if t == 4:
                with torch.no_grad():
                    for p in node0.model.parameters():
                        p.mul_(1000.0)
            return await send(t, extra)

        node0.send_model = blow_up_then_send

    return round_records(cfg, blow_up_node0)


@pytest.mark.parametrize("compression", ["none", "auto"])
def test_clip_contains_a_blown_up_model_that_the_mean_spreads(compression):
    """The plain mean passes one node's blown-up model on to every node, which never recover;
    ``aggregation = "clip"`` (the deviation from the node's own model clipped to the median
    norm) keeps the others as they were, and the blown-up node recovers from its neighbours'
    models.  With compressed gossip (CHOCO copies, q4+zstd with error feedback) its own
    training diverges, so it re-joins: its update goes out flagged cold, its neighbours leave
    it out, and it adopts their mean (before, its model shrank back by a quarter a round, still
    at 10^7 twelve rounds later)."""
    runs = {rule: _blown_up(rule, compression) for rule in ("mean", "clip")}
    acc = {rule: {n: [r["global_accuracy"] for r in recs] for n, recs in by.items()} for rule, by in runs.items()}
    others = ["node01", "node02", "node03"]
    assert all(a[2] > 0.3 for a in acc["mean"].values()), acc  # round 3, before the blow-up: every node learns
    assert max(acc["mean"][n][-1] for n in others) < 0.3, acc  # spread: chance is 0.1
    assert min(acc["clip"][n][-1] for n in others) > 0.75, acc
    assert [runs["clip"][n][-1]["diverged"] for n in others] == [0, 0, 0]  # their training never saw it
    assert acc["clip"]["node00"][-1] > 0.75, acc
    if compression == "auto":
        rejoined = [r["round"] for r in runs["clip"]["node00"] if r.get("cold_start") == "diverged"]
        assert rejoined and rejoined[0] >= 4, rejoined
        assert all(any("node00" in r.get("cold_excluded", []) for r in runs["clip"][n]) for n in others)
