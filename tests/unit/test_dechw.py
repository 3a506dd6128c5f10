"""DecHW (seed 001 Eq. 6-8, Alg. 1), its θ cut-off, and the DecHetero / CFA baselines."""

import math
import types

import numpy as np
import pytest

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.dechw import HESSIAN_PREFIX
from dfl_agent.learning.consensus import consensus_step
from dfl_agent.learning.hessian import data_size_weights, hessian_weighted_average
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.metrics import read_jsonl
from dfl_agent.runtime.node.simulator import SimConfig, simulate

# -- Eq. 6-8 on hand-made tensors ---------------------------------------------------


def test_hessian_weighted_average_eq6_to_8():
    models = [
        {"w": np.array([1.0, 2.0, 3.0], np.float32), "buf": np.array([10.0]), "n": np.array([7])},
        {"w": np.array([5.0, 4.0, 9.0], np.float32), "buf": np.array([20.0]), "n": np.array([8])},
        {"w": np.array([9.0, 0.0, 6.0], np.float32), "buf": np.array([40.0]), "n": np.array([9])},
    ]
    hessians = [  # entry 2 has Σ_j Ĥ = 0: Eq. 8 fallback
        {"w": np.array([1.0, 0.0, 0.0], np.float32)},
        {"w": np.array([3.0, 1.0, 0.0], np.float32)},
        {"w": np.array([0.0, 3.0, 0.0], np.float32)},
    ]
    samples = [10, 30, 60]
    out, fallback = hessian_weighted_average(models, hessians, samples)
    tau = np.array([0.1, 0.3, 0.6])
    np.testing.assert_allclose(data_size_weights(samples), tau)
    # entry 0: p = (1/4, 3/4, 0) -> 0.25*1 + 0.75*5; entry 1: p = (0, 1/4, 3/4) -> 0.25*4 + 0
    # entry 2: fallback τ -> 0.1*3 + 0.3*9 + 0.6*6
    np.testing.assert_allclose(out["w"], [4.0, 1.0, 0.3 + 2.7 + 3.6], rtol=1e-6)
    assert out["w"].dtype == np.float32
    assert fallback == pytest.approx(1 / 3)
    np.testing.assert_allclose(out["buf"], [0.1 * 10 + 0.3 * 20 + 0.6 * 40])  # no Ĥ: τ (Eq. 3)
    assert out["n"].tolist() == [7]  # integer tensors: own copy


def test_hessian_weighted_average_threshold_and_scale_invariance():
    models = [{"w": np.array([0.0])}, {"w": np.array([1.0])}]
    tiny = [{"w": np.array([1e-13])}, {"w": np.array([1e-13])}]  # Σ < 1e-12: τ
    out, fb = hessian_weighted_average(models, tiny, [1, 3])
    assert out["w"][0] == pytest.approx(0.75) and fb == 1.0
    out, fb = hessian_weighted_average(models, tiny, [1, 3], eps=0.0)  # Eq. 6 with equal Ĥ: mean
    assert out["w"][0] == pytest.approx(0.5) and fb == 0.0
    a, _ = hessian_weighted_average(models, [{"w": np.array([1.0])}, {"w": np.array([3.0])}], [1, 1])
    b, _ = hessian_weighted_average(models, [{"w": np.array([10.0])}, {"w": np.array([30.0])}], [1, 1])
    assert a["w"][0] == pytest.approx(0.75) and b["w"][0] == pytest.approx(0.75)


def test_single_node_neighbourhood_is_identity():
    m = {"w": np.array([1.5, -2.0], np.float32)}
    out, _ = hessian_weighted_average([m], [{"w": np.array([0.0, 2.0])}], [5])
    np.testing.assert_array_equal(out["w"], m["w"])


def test_hessian_weighted_average_errors():
    m = [{"w": np.zeros(2)}, {"w": np.zeros(2)}]
    with pytest.raises(ValueError, match="as many"):
        hessian_weighted_average(m, [{"w": np.ones(2)}], [1, 1])
    with pytest.raises(ValueError, match="negative or non-finite"):
        hessian_weighted_average(m, [{"w": np.ones(2)}, {"w": -np.ones(2)}], [1, 1])
    with pytest.raises(ValueError, match="shape"):
        hessian_weighted_average(m, [{"w": np.ones(2)}, {"w": np.ones(3)}], [1, 1])
    with pytest.raises(ValueError, match="sample counts"):
        hessian_weighted_average(m, [{"w": np.ones(2)}] * 2, [0, 0])


def test_cfa_consensus_step():
    own = {"w": np.array([1.0, 1.0], np.float32), "n": np.array([3])}
    nbrs = [{"w": np.array([3.0, 1.0], np.float32), "n": np.array([4])},
            {"w": np.array([1.0, 5.0], np.float32), "n": np.array([5])}]
    out = consensus_step(own, nbrs, [0.25, 0.5], epsilon=0.5)
    # w + 0.5 * (0.25 * (2, 0) + 0.5 * (0, 4)) = (1.25, 2.0)
    np.testing.assert_allclose(out["w"], [1.25, 2.0])
    assert out["n"].tolist() == [3]
    np.testing.assert_array_equal(consensus_step(own, [], [], 0.3)["w"], own["w"])
    with pytest.raises(ValueError, match="one weight per neighbour"):
        consensus_step(own, nbrs, [1.0], 0.1)


# -- options ------------------------------------------------------------------------


def test_options_defaults_and_validation():
    o = parse_options(get_algorithm("dechw"), {})
    assert (o.estimator, o.hessian_batch_size, o.norm, o.accumulate, o.beta, o.fallback_eps) == (
        "batch_sq_grad", 100, "l2", "sum", 1.0, 1e-12)
    assert math.isinf(o.theta)
    assert parse_options(get_algorithm("dechw"), {"theta": 30}).theta == 30.0
    for bad in ({"theta": 2.5}, {"theta": -1}, {"norm": "l1"}, {"estimator": "exact"}, {"beta": 2.0},
                {"accumulate": "max"}, {"delivery": "flood"}):
        with pytest.raises(ValueError):
            parse_options(get_algorithm("dechw"), bad)
    c = parse_options(get_algorithm("cfa"), {})
    assert c.epsilon == 0.0 and c.weights == "neighbourhood"
    with pytest.raises(ValueError):
        parse_options(get_algorithm("cfa"), {"weights": "uniform"})


# -- received Hessians are validated ----------------------------------------------------


def _bare_dechw():
    import asyncio

    spec = {"type": "mlp", "input_shape": [4], "hidden": [3], "num_classes": 2}
    rejected = []
    ctx = types.SimpleNamespace(
        init_seed=1, model_spec=spec, device="cpu", data=types.SimpleNamespace(train_y=np.zeros(10)),
        reject=lambda msg, reason: rejected.append(reason), check_on_arrival=lambda kind, check: None,
        keep_late_updates=lambda rounds: None, train=None, note_diverged=lambda step, detail: None, compression=None,
    )
    alg = get_algorithm("dechw")(ctx)
    asyncio.run(alg.setup())
    return alg, rejected


def test_arrival_check_covers_the_hessian_tensors():
    """The check run on arrival (what decides catch-up evidence) covers the Ĥ tensors too,
    not only the model's: a far-future update with a misshapen or negative Ĥ fails it."""
    from dfl_agent.learning.params import model_to_numpy

    alg, _ = _bare_dechw()
    own = model_to_numpy(alg.model)
    good_h = {HESSIAN_PREFIX + k: np.ones_like(v) for k, v in own.items()}
    msg = lambda t: Message("model", 10**6, t, meta={"samples": 10}, sender="b")  # noqa: E731
    assert alg.update_check(msg({**own, **good_h})) is None
    assert alg.update_check(msg(dict(own))) is None  # no Ĥ (after round θ)
    first = next(iter(good_h))
    for bad in (np.ones(7, np.float32), -good_h[first]):
        assert alg.update_check(msg({**own, **good_h, first: bad})).startswith("bad_hessian: "), bad
    wrong = {k: np.ones((3,) + v.shape, v.dtype) for k, v in own.items()}
    assert alg.update_check(msg({**wrong, **good_h})).startswith("incompatible: ")


def test_malformed_hessian_is_rejected_and_aggregation_falls_back():
    from dfl_agent.learning.params import model_to_numpy

    alg, rejected = _bare_dechw()
    own = model_to_numpy(alg.model)
    alg.hessian = {k: np.ones_like(v) for k, v in own.items()}
    good_h = {HESSIAN_PREFIX + k: np.ones_like(v) for k, v in own.items()}
    bad_h = dict(good_h)
    first = next(iter(bad_h))
    bad_h[first] = -bad_h[first]
    nb = {k: v + 1 for k, v in own.items()}
    good = Message("model", 0, {**nb, **good_h}, meta={"samples": 10}, sender="b")
    bad = Message("model", 0, {**nb, **bad_h}, meta={"samples": 10}, sender="c")
    out, info = alg.aggregate(1, own, [good, bad])
    assert rejected == ["bad_hessian: Hessian of " + repr(first[len(HESSIAN_PREFIX):]) + " has negative entries"]
    assert info["neighbours"] == 1 and info["hessian_weighted"]
    for k in own:  # equal Ĥ, equal sizes: plain mean of own and the good neighbour
        np.testing.assert_allclose(out[k], own[k] + 0.5, rtol=1e-6)
    # a neighbour without Ĥ: the whole aggregation uses τ
    plain = Message("model", 0, dict(nb), meta={"samples": 30}, sender="d")
    out, info = alg.aggregate(1, own, [plain])
    assert not info["hessian_weighted"]
    for k in own:
        np.testing.assert_allclose(out[k], own[k] + 0.75, rtol=1e-5)


def test_non_finite_hessians_never_crash_the_round():
    """A neighbour's non-finite Ĥ is rejected; a non-finite own Ĥ (a diverging model, e.g.
    lossy compressed gossip without error feedback) falls back to τ for the round."""
    from dfl_agent.learning.params import model_to_numpy

    alg, rejected = _bare_dechw()
    own = model_to_numpy(alg.model)
    good_h = {HESSIAN_PREFIX + k: np.ones_like(v) for k, v in own.items()}
    nan_h = dict(good_h)
    first = next(iter(nan_h))
    nan_h[first] = np.full_like(nan_h[first], np.nan)
    nb = {k: v + 1 for k, v in own.items()}
    alg.hessian = {k: np.ones_like(v) for k, v in own.items()}
    out, info = alg.aggregate(1, own, [Message("model", 0, {**nb, **nan_h}, meta={"samples": 10}, sender="c")])
    assert rejected == ["bad_hessian: Hessian of " + repr(first[len(HESSIAN_PREFIX):]) + " has non-finite entries"]
    alg.hessian = {k: np.full_like(v, np.inf) for k, v in own.items()}
    good = Message("model", 0, {**nb, **good_h}, meta={"samples": 10}, sender="b")
    out, info = alg.aggregate(1, own, [good])
    assert not info["hessian_weighted"] and "non-finite" in info["hessian_error"]
    for k in own:  # τ with equal sizes: the plain mean
        np.testing.assert_allclose(out[k], own[k] + 0.5, rtol=1e-6)


# -- end to end in the simulator ----------------------------------------------------------


def _cfg(tmp_path=None, **kw):
    base = dict(algorithm="dechw", nodes=6, rounds=4, dataset="digits", partition="dirichlet", beta=0.5,
                init="independent", topology="erdos_renyi", topology_options={"p": 0.5}, seed=1,
                train=TrainConfig(epochs=2, batch_size=32, lr=0.05, momentum=0.5))
    base.update(kw)
    if tmp_path is not None:
        base["out"] = str(tmp_path)
    return SimConfig(**base)


def _per_round_bytes(path):
    by_node = {}
    for r in read_jsonl(path / "metrics.jsonl"):
        by_node.setdefault(r["node"], []).append(r)
    rounds = len(next(iter(by_node.values())))
    out = np.zeros(rounds)
    for recs in by_node.values():
        recs.sort(key=lambda r: r["round"])
        cum = [0] + [r["bytes_sent"] for r in recs]
        out += np.diff(cum)
    return out, by_node


@pytest.mark.parametrize("alg", ["dechw", "dechetero", "cfa"])
def test_end_to_end_in_simulator(tmp_path, alg):
    s = simulate(_cfg(tmp_path, algorithm=alg))
    assert s["rounds_completed"] == 4 and s["nodes"] == 6
    _, by_node = _per_round_bytes(tmp_path)
    from dfl_agent.algorithms.topology import build_topology

    graph = build_topology("erdos_renyi", sorted(by_node), seed=1, p=0.5)
    for node, recs in by_node.items():
        assert all(r["neighbours"] == len(graph[node]) and r["missing"] == [] for r in recs)
        assert all(0 <= r["global_accuracy"] <= 1 for r in recs)
    if alg == "dechw":
        assert all(r["hessian_weighted"] for recs in by_node.values() for r in recs)


def test_dechw_learns_where_dechetero_stalls():
    """Seed 001's point, at toy scale: with independent initialisations DecHW's accuracy
    rises within a few rounds while plain averaging stays near chance."""
    kw = dict(nodes=8, rounds=6, topology_options={"p": 0.4}, seed=0)
    hw = simulate(_cfg(**kw))["global_accuracy"]["mean"]
    het = simulate(_cfg(algorithm="dechetero", **kw))["global_accuracy"]["mean"]
    assert hw > het + 0.05


def test_theta_cut_off_halves_bytes_after_theta(tmp_path):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    simulate(_cfg(full_dir, rounds=5))
    simulate(_cfg(cut_dir, rounds=5, options={"theta": 2}))
    full, _ = _per_round_bytes(full_dir)
    cut, by_node = _per_round_bytes(cut_dir)
    # rounds 1..θ-1 send Ĥ in both (round 1 also carries the round-0 message)
    np.testing.assert_allclose(cut[:1], full[:1], rtol=1e-3)
    # from round θ on the messages carry the model alone: about half the bytes
    ratio = cut[2:] / full[2:]
    assert ((ratio > 0.45) & (ratio < 0.56)).all(), ratio
    for recs in by_node.values():
        assert [r["hessian_weighted"] for r in sorted(recs, key=lambda r: r["round"])] == [True, True, False,
                                                                                          False, False]


def test_theta_zero_is_dechetero():
    a = simulate(_cfg(rounds=3, options={"theta": 0}))
    b = simulate(_cfg(rounds=3, algorithm="dechetero"))
    assert a["global_accuracy"]["per_node"] == b["global_accuracy"]["per_node"]


def test_deterministic_for_a_seed():
    kw = dict(nodes=4, rounds=2, topology="ring", topology_options={}, options={"estimator": "per_sample_sq_grad"})
    a = simulate(_cfg(**kw))
    b = simulate(_cfg(**kw))
    assert a["global_accuracy"]["per_node"] == b["global_accuracy"]["per_node"]
    c = simulate(_cfg(seed=2, **kw))
    assert c["global_accuracy"]["per_node"] != a["global_accuracy"]["per_node"]


def test_missing_neighbour_does_not_stall(tmp_path):
    s = simulate(_cfg(tmp_path, nodes=4, rounds=4, topology="full", topology_options={}, kill={3: 2},
                      options={"round_timeout": 5.0}))
    assert s["rounds_per_node"] == {"node00": 4, "node01": 4, "node02": 4, "node03": 1}


def test_an_unnormalised_hessian_beyond_float32_saturates_instead_of_turning_inf():
    """norm = "none" accumulates raw squared gradients; an Inf on the wire would get the
    whole model message dropped as non-finite by every neighbour."""
    import asyncio

    from dfl_agent.algorithms.dechw import DecHW, DecHWOptions

    alg = DecHW.__new__(DecHW)
    alg.options = DecHWOptions(norm="none")
    alg.hessian = None
    alg.hessian_sent = False

    class Ctx:
        data = type("D", (), {"train_x": None, "train_y": None})()
        device = "cpu"

        async def compute(self, fn, *a, **k):
            return {"w": np.array([1e39, 2.0, np.inf], dtype=np.float64)}

    alg.ctx = Ctx()
    alg.model = None
    out = asyncio.run(alg.after_training(0))  # the estimate: compute() returns the raw diagonal
    h = out[HESSIAN_PREFIX + "w"]
    assert h.dtype == np.float32 and np.isfinite(h).all()
    assert h[0] == np.finfo(np.float32).max and h[1] == 2.0


def test_size_weighting_puts_the_data_set_size_into_the_hessian_weights():
    """p_{j,n} ∝ τ_j Ĥ_{j,n}: with equal Hessians the result is DecHetero's τ average
    (Eq. 3); without the option it is the plain mean (Eq. 4 removed the sizes)."""
    models = [{"w": np.array([0.0, 1.0], dtype=np.float32)}, {"w": np.array([3.0, 5.0], dtype=np.float32)}]
    hs = [{"w": np.array([1.0, 2.0], dtype=np.float32)}] * 2
    plain, _ = hessian_weighted_average(models, hs, [100, 300])
    sized, _ = hessian_weighted_average(models, hs, [100, 300], size_weighting=True)
    np.testing.assert_allclose(plain["w"], [1.5, 3.0])
    np.testing.assert_allclose(sized["w"], [0.25 * 0 + 0.75 * 3, 0.25 * 1 + 0.75 * 5])
    alg = get_algorithm("dechw")
    assert parse_options(alg, {"size_weighting": True}).size_weighting is True
    assert parse_options(alg, {}).size_weighting is False  # the paper's Eq. 6 by default
