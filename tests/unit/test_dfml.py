"""DFML (seed 000): schedule, WSM, mutual learning, peak rule, spec checks, coordination
with heterogeneous models, a killed aggregator, and competing aggregators."""

import asyncio
import math
import types

import numpy as np
import pytest
import torch

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.algorithms.dfml import check_model_message, class_proportions
from dfl_agent.algorithms.protocols.rotating import Done
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.losses import cross_entropy, kl_divergence, weighted_softmax_ce
from dfl_agent.learning.mutual import kl_weights, mutual_learning
from dfl_agent.learning.params import IncompatibleUpdate, model_to_numpy
from dfl_agent.learning.schedules import AlphaState, CyclicAlpha
from dfl_agent.learning.training import TrainConfig
from dfl_agent.models import build_model
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.transport.memory import MemoryNetwork, run_virtual

SPECS = [
    {"type": "mlp", "input_shape": [4], "hidden": [16], "num_classes": 3},
    {"type": "mlp", "input_shape": [4], "hidden": [8, 8], "num_classes": 3},
    {"type": "mlp", "input_shape": [4], "hidden": [], "num_classes": 3},
]


# -- schedule -------------------------------------------------------------------------
def test_cyclic_alpha_rises_restarts_and_grows():
    s = CyclicAlpha()
    state, alphas = s.initial(), []
    for t in range(1, 35):
        state = s.advance(state, t)
        alphas.append((t, state.cycle, state.period, s.alpha(state, t)))
    assert alphas[0][3] == 0.0  # round 1: alpha_min
    assert alphas[10][3] == pytest.approx(0.9)  # round 11 = t_c = P_0 = 10: alpha_max
    assert all(a[3] <= b[3] for a, b in zip(alphas[:10], alphas[1:11]))  # rising
    assert alphas[11][1:3] == (1, 20) and alphas[11][3] == 0.0  # restart with P_1 = 20
    assert alphas[31][3] == pytest.approx(0.9)  # round 32 = 12 + 20


def test_cyclic_alpha_full_shape_fixed_and_multiplicative():
    full = CyclicAlpha(shape="full")
    st = full.initial()
    assert full.alpha(st, 6) == pytest.approx(0.9) and full.alpha(st, 11) == pytest.approx(0.0, abs=1e-12)
    assert CyclicAlpha(mode="fixed", alpha_fixed=0.3).alpha(st, 7) == 0.3
    mul = CyclicAlpha(growth="multiplicative", factor=2.0)
    assert mul.advance(mul.initial(), 12).period == 20
    with pytest.raises(ValueError):
        CyclicAlpha(alpha_min=0.5, alpha_max=0.2)
    with pytest.raises(ValueError):
        AlphaState.from_meta({"cycle": 0})


# -- losses -----------------------------------------------------------------------------
def test_wsm_equals_ce_for_uniform_beta_and_masks_absent_classes():
    torch.manual_seed(0)
    z, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    assert weighted_softmax_ce(z, y, torch.full((4,), 0.25)).item() == pytest.approx(cross_entropy(z, y).item())
    beta = torch.tensor([0.5, 0.25, 0.25, 0.0])
    expected = -(z.gather(1, y[:, None]).squeeze(1) + beta[y].log()
                 - torch.logsumexp(z[:, :3] + beta[:3].log(), dim=1)).mean()
    assert weighted_softmax_ce(z, y, beta).item() == pytest.approx(expected.item(), rel=1e-5)
    # a sample of a class with beta 0 falls back to CE instead of +inf
    y_bad = torch.tensor([3] * 8)
    assert math.isfinite(weighted_softmax_ce(z, y_bad, beta).item())
    with pytest.raises(ValueError):
        weighted_softmax_ce(z, y, torch.zeros(4))


def test_kl_detaches_the_teacher_and_scales_with_temperature():
    t, s = torch.randn(5, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    kl_divergence(t, s).backward()
    assert t.grad is None and s.grad is not None
    p = torch.softmax(t / 2, 1)
    manual = (p * (p.log() - torch.log_softmax(s / 2, 1))).sum(1).mean() * 4
    assert kl_divergence(t, s, 2.0).item() == pytest.approx(manual.item(), rel=1e-5)


def test_kl_weights_are_phi_proportional_without_self():
    w = kl_weights([100, 300, 600])
    assert np.allclose(np.diag(w), 0) and np.allclose(w.sum(1), 1)
    assert w[0, 1] == pytest.approx(300 / 900) and w[2, 0] == pytest.approx(100 / 400)


def test_mutual_learning_matches_a_hand_computed_step():
    torch.manual_seed(1)
    a, b = build_model(SPECS[0]), build_model(SPECS[2])
    a0, b0 = build_model(SPECS[0]), build_model(SPECS[2])
    a0.load_state_dict(a.state_dict()), b0.load_state_dict(b.state_dict())
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2])
    beta = np.array([0.5, 0.5, 0.0], np.float32)
    alpha, lr = 0.4, 0.1
    mutual_learning([a, b], [10, 30], x, y, alpha=alpha, epochs=1, batch_size=6, lr=lr, momentum=0.0,
                    weight_decay=0.0, beta=beta, rng=np.random.default_rng(0))
    # by hand: both logits first, teachers detached, one SGD step each on its own loss
    xt, yt, bt = torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(beta)
    za, zb = a0(xt), b0(xt)
    la = (1 - alpha) * weighted_softmax_ce(za, yt, bt) + alpha * kl_divergence(zb, za)
    lb = (1 - alpha) * weighted_softmax_ce(zb, yt, bt) + alpha * kl_divergence(za, zb)
    ga = torch.autograd.grad(la, list(a0.parameters()))
    gb = torch.autograd.grad(lb, list(b0.parameters()))
    for p, p0, g in zip(a.parameters(), a0.parameters(), ga):
        assert torch.allclose(p, p0 - lr * g, atol=1e-6)
    for p, p0, g in zip(b.parameters(), b0.parameters(), gb):
        assert torch.allclose(p, p0 - lr * g, atol=1e-6)


def test_class_proportions():
    assert class_proportions(np.array([0, 0, 2]), 4).tolist() == pytest.approx([2 / 3, 0, 1 / 3, 0])


def test_check_model_message_rejects_without_allocating():
    m = build_model(SPECS[0])
    assert check_model_message(model_to_numpy(m), SPECS[0])["type"] == "mlp"
    with pytest.raises(IncompatibleUpdate):
        check_model_message(model_to_numpy(m), SPECS[1])
    huge = {"type": "mlp", "input_shape": [4096], "hidden": [4096] * 16, "num_classes": 3}
    with pytest.raises(IncompatibleUpdate):  # shapes only on the meta device: no 1 GB allocation
        check_model_message(model_to_numpy(m), huge)
    with pytest.raises(IncompatibleUpdate):
        check_model_message(model_to_numpy(m), {"type": "rm -rf"})


# -- the protocol ---------------------------------------------------------------------
def _data(seed, n=60):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (np.digitize(x[:, 0] + 0.5 * x[:, 1], [-0.5, 0.5])).astype(np.int64)
    return types.SimpleNamespace(train_x=x[:48], train_y=y[:48], val_x=x[48:], val_y=y[48:], num_classes=3)


def _federation(n, algorithm="dfml", **options):
    net = MemoryNetwork()
    cls = get_algorithm(algorithm)
    opts = parse_options(cls, {"mutual_epochs": 2, **options} if algorithm == "dfml" else options)
    test = _data(99, 90)
    nodes = []
    for i in range(n):
        nid = f"n{i}"
        ctx = RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f"),
                             peers=PeerTable(nid, "f"), data=_data(i), model_spec=SPECS[i % len(SPECS)],
                             train=TrainConfig(batch_size=16, lr=0.1), init_seed=i, rng=np.random.default_rng(i))
        node = Node(ctx, cls(ctx, opts), test.train_x, test.train_y)
        nodes.append(node)
    return net, nodes


def _track_applies(node):
    applied = []
    original = node.algorithm.apply_update

    def wrapper(t, tensors, meta):
        applied.append(t)
        return original(t, tensors, meta)

    node.algorithm.apply_update = wrapper
    return applied


def test_dfml_with_three_architectures_runs_every_round_on_every_node():
    net, nodes = _federation(4)
    applied = {n.ctx.node_id: _track_applies(n) for n in nodes}

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        await asyncio.gather(*(n.run(12) for n in nodes))

    run_virtual(main())
    for n in nodes:
        assert [r["round"] for r in n.history] == list(range(1, 13))
        assert "regular_global_accuracy" in n.history[-1]
    for seq in applied.values():
        assert seq == sorted(set(seq))  # strictly increasing: no round applied twice
    first = nodes[0].history[0]
    assert first["aggregator"] == "n0"  # round 1: the lowest id
    assert max(r.get("architectures", 0) for n in nodes for r in n.history) >= 2
    # alpha_n reached alpha_max at the end of the first cycle for somebody
    assert max(n.algorithm.alpha_n for n in nodes) == pytest.approx(0.9)


def test_killing_the_aggregator_mid_round_recovers_within_two_token_timeouts():
    token_timeout = 40.0
    net, nodes = _federation(4, token_timeout=token_timeout, invite_timeout=10.0, update_timeout=20.0)
    applied = {n.ctx.node_id: _track_applies(n) for n in nodes}
    killed = {}

    for node in nodes:
        original = node.algorithm.aggregate

        async def aggregate(t, token, contributions, _node=node, _orig=original):
            if t == 3 and not killed:  # the round-3 aggregator dies after collecting the senders' models
                killed["node"], killed["time"] = _node.ctx.node_id, _node.ctx.clock.now()
                net.kill(_node.ctx.node_id)
                raise asyncio.CancelledError
            return await _orig(t, token, contributions)

        node.algorithm.aggregate = aggregate

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        await asyncio.gather(*(n.run(6) for n in nodes), return_exceptions=True)

    run_virtual(main())
    survivors = [n for n in nodes if n.ctx.node_id != killed["node"]]
    for n in survivors:
        assert n.history[-1]["round"] == 6
        r3 = next(r for r in n.history if r["round"] == 3)
        assert r3["time"] - killed["time"] <= 2 * token_timeout
    for seq in applied.values():
        assert seq == sorted(set(seq))


def test_two_competing_aggregators_merge_and_no_round_is_applied_twice():
    net, nodes = _federation(5)
    applied = {n.ctx.node_id: _track_applies(n) for n in nodes}

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        async def rogue():  # n3 wrongly believes it must lead round 1 too (a stale liveness view)
            alg = nodes[3].algorithm
            alg._lead_next = (1, alg.initial_token())
            await nodes[3].run(8)

        await asyncio.gather(*(n.run(8) for i, n in enumerate(nodes) if i != 3), rogue())

    run_virtual(main())
    for n in nodes:
        assert n.history[-1]["round"] == 8
    for seq in applied.values():
        assert seq == sorted(set(seq))
    # the lower id won round 1
    assert nodes[3].algorithm.best.round == 8
    assert Done(1, "n0", "x", {}, {}).beats(Done(1, "n3", "y", {}, {}))
    assert not Done(1, "n3", "y", {}, {}).beats(Done(1, "n0", "x", {}, {}))
    assert Done(2, "n3", "y", {}, {}).beats(Done(1, "n0", "x", {}, {}))


@pytest.mark.parametrize("algorithm", ["dfedavg", "dfedprox"])
def test_cluster_wise_baselines_average_only_identical_architectures(algorithm):
    net, nodes = _federation(6, algorithm)

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        await asyncio.gather(*(n.run(4) for n in nodes))

    run_virtual(main())
    assert all(n.history[-1]["round"] == 4 for n in nodes)
    assert max(r.get("clusters", 0) for n in nodes for r in n.history) >= 2


def test_dfml_in_the_simulator_with_the_h2_family():
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    # on 8x8 digits the two deepest H2 members are cut to 3 layers, so 4 nodes hold 3 architectures
    s = simulate(SimConfig(algorithm="dfml", nodes=4, rounds=2, dataset="digits", partition="iid",
                           model_family="H2", options={"mutual_epochs": 1}, train=TrainConfig(batch_size=64)))
    assert s["rounds_completed"] == 2 and len({str(v) for v in s["model_specs"].values()}) == 3
