"""FedD2S (seed 002) without a server: schedule (Eq. 6), distillation math (Eq. 8–13), the
convdense model family, the serverless protocol vs the centralized reference (same personal
models), FedPer, and the UA metric."""

import numpy as np
import pytest
import torch

from bench.fedd2s.reference import run_reference
from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.algorithms.fedd2s import FedD2SOptions, resolve_l_min
from dfl_agent.algorithms.fedper import personal_keys
from dfl_agent.algorithms.protocols.rotating import draw_round
from dfl_agent.data import NodeData
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning import d2s
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import TrainConfig
from dfl_agent.models import SpecError, build_model, validate_spec
from dfl_agent.runtime.node import metrics
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.transport.memory import MemoryNetwork, run_virtual

SPEC = {"type": "convdense", "input_shape": [1, 8, 8], "conv": [4, 8, 8], "dense": [8, 8], "num_classes": 4}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is much faster on a shared, loaded CPU."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _model(seed=0, spec=SPEC):
    torch.manual_seed(seed)
    return build_model(spec)


# -- model family -----------------------------------------------------------------------
def test_convdense_has_six_layers_in_2d_and_1d():
    m = build_model({"type": "convdense", "input_shape": [1, 8, 8], "conv": [8, 16, 32], "dense": [32, 16],
                     "num_classes": 10})
    assert m.layer_names == ["C1", "C2", "C3", "F1", "F2", "F3"]
    x = torch.randn(2, 1, 8, 8)
    assert m(x).shape == (2, 10) and d2s.features(m, x, 3).shape == (2, 32, 1, 1)
    assert torch.equal(d2s.head(m, d2s.features(m, x, 3), 3), m(x))
    har = build_model({"type": "convdense", "input_shape": [3, 128], "conv": [8, 16, 32], "dense": [32, 16],
                       "num_classes": 6})
    assert har(torch.randn(2, 3, 128)).shape == (2, 6) and isinstance(har.blocks[0][0], torch.nn.Conv1d)
    assert validate_spec({**SPEC})["kernel"] == 3
    with pytest.raises(SpecError, match="conv"):
        validate_spec({**SPEC, "conv": []})
    with pytest.raises(SpecError, match="input_shape"):
        validate_spec({**SPEC, "input_shape": [8]})


# -- schedule -----------------------------------------------------------------------------
def test_distillation_layer_follows_eq6_and_is_clamped():
    # L = 6, Z0 = 3, dropping set [C3, F1, F2, F3] -> l_min = 3
    got = [d2s.distillation_layer(z, 6, 3, 3) for z in range(1, 15)]
    assert got == [6, 6, 6, 5, 5, 5, 4, 4, 4, 3, 3, 3, 3, 3]
    assert resolve_l_min(["C1", "C2", "C3", "F1", "F2", "F3"], ["C3", "F1", "F2", "F3"]) == 3
    assert resolve_l_min(["C1", "C2", "C3", "F1", "F2", "F3"], ["F2", "F3"]) == 5
    with pytest.raises(ValueError, match="suffix"):
        resolve_l_min(["C1", "C2", "C3", "F1", "F2", "F3"], ["C3", "F1"])
    with pytest.raises(ValueError, match="dropping_set"):
        resolve_l_min(["C1", "F1"], ["C9"])
    with pytest.raises(ValueError):
        d2s.distillation_layer(0, 6, 3, 3)


def test_draw_round_is_a_function_of_seed_and_round_only():
    nodes = [f"n{i}" for i in range(20)]
    a, _ = draw_round(7, 3, nodes, 0.2)
    b, _ = draw_round(7, 3, list(reversed(nodes)), 0.2)
    assert a == b and len(a) == 4 and a == sorted(a)
    assert draw_round(7, 4, nodes, 0.2)[0] != a or draw_round(8, 3, nodes, 0.2)[0] != a
    assert d2s.ceil_count(0.2, 20) == 4 and d2s.ceil_count(0.01, 5) == 1


# -- distillation math ------------------------------------------------------------------------
def _batch(n=12, seed=0):
    g = np.random.default_rng(seed)
    return g.random((n, 1, 8, 8), dtype=np.float32), g.integers(0, 4, n).astype(np.int64)


def test_c2s_trains_layers_2_to_L_of_the_copy_and_uses_the_features():
    personal, g = _model(1), _model(2)
    x, y = _batch()
    trip = d2s.extract_features(personal, x, y, 4, batch_size=5)
    assert [t[0].shape[0] for t in trip] == [5, 5, 2]
    assert torch.equal(trip[0][1], d2s.features(personal, torch.from_numpy(x[:5]), 4))
    before = model_to_numpy(g)
    stats = d2s.c2s_distill(g, trip, 4, lr=0.01)
    after = model_to_numpy(g)
    assert np.isfinite(stats["kl"]) and np.isfinite(stats["ce"])
    assert all(np.array_equal(before[k], after[k]) for k in before if k.startswith("blocks.0."))  # layer 1 unused
    assert all(not np.array_equal(before[k], after[k]) for k in before if not k.startswith("blocks.0."))


def test_c2s_is_one_kl_step_then_one_ce_step_with_l_equal_L_distilling_the_personal_prediction():
    # with l = L the head is empty: p = softmax(H_L), the personal model's own output
    personal, g = _model(1), _model(2)
    x, y = _batch(4)
    (h1, hl, yb), = d2s.extract_features(personal, x, y, 6, batch_size=4)
    assert torch.allclose(d2s.head(g, hl, 6), personal(torch.from_numpy(x)))
    opt = torch.optim.Adam(g.parameters(), lr=0.01)  # hand-computed Eq. 9 then Eq. 10
    kl = torch.nn.functional.kl_div(torch.log_softmax(d2s.head(g, h1, 1), 1), torch.log_softmax(hl, 1),
                                    log_target=True, reduction="batchmean")
    opt.zero_grad(set_to_none=True)
    kl.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(d2s.head(g, h1, 1), yb).backward()
    opt.step()
    g2 = _model(2)
    d2s.c2s_distill(g2, [(h1, hl, yb)], 6, lr=0.01)
    for k, v in model_to_numpy(g).items():
        np.testing.assert_allclose(model_to_numpy(g2)[k], v, atol=1e-7)


def test_s2c_freezes_the_global_head_and_trains_the_personal_model():
    personal, g = _model(1), _model(2)
    x, y = _batch()
    trip = d2s.extract_features(personal, x, y, 3, batch_size=6)
    targets = d2s.global_soft_targets(g, [t[0] for t in trip])
    g_before, p_before = model_to_numpy(g), model_to_numpy(personal)
    d2s.s2c_distill(personal, g, x, y, targets, 3, batch_size=6, lr=0.01)
    assert all(np.array_equal(v, model_to_numpy(g)[k]) for k, v in g_before.items())
    assert all(not np.array_equal(v, model_to_numpy(personal)[k]) for k, v in p_before.items())
    with pytest.raises(ValueError, match="batches"):
        d2s.s2c_distill(personal, g, x, y, targets[:1], 3, batch_size=6)


def test_s2c_kl_step_reaches_only_layers_up_to_l():
    personal, g = _model(1), _model(2)
    x, _ = _batch(6)
    t = d2s.head(g, d2s.features(personal, torch.from_numpy(x), 1), 1).detach()
    from dfl_agent.learning.losses import kl_divergence

    kl_divergence(t, d2s.head(g, d2s.features(personal, torch.from_numpy(x), 3), 3)).backward()
    grads = {n: p.grad for n, p in personal.named_parameters()}
    assert all(grads[n] is not None for n in grads if int(n.split(".")[1]) < 3)
    assert all(grads[n] is None for n in grads if int(n.split(".")[1]) >= 3)


def test_average_states_is_the_unweighted_mean():
    a = {"w": np.array([1.0, 2.0], np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32)}
    assert np.allclose(d2s.average_states([a, b])["w"], [2.0, 4.0])
    with pytest.raises(ValueError):
        d2s.average_states([])


# -- the serverless protocol vs the centralized reference ------------------------------------
def _node_data(i, n=30):
    g = np.random.default_rng(100 + i)
    x = g.random((n, 1, 8, 8), dtype=np.float32)
    y = g.choice(4, n, p=g.dirichlet(np.full(4, 0.5))).astype(np.int64)
    x += y[:, None, None, None] * 0.3  # learnable signal
    return NodeData(train_x=x[:24].copy(), train_y=y[:24].copy(), val_x=x[24:].copy(), val_y=y[24:].copy(),
                    num_classes=4, input_shape=(1, 8, 8), class_names=list("abcd"), groups=[])


OPTS = {"sender_ratio": 0.4, "z0": 1, "c2s_epochs": 1, "s2c_epochs": 2}


def _federation(n, algorithm="fedd2s", options=OPTS, seed=5, sent=None):
    net = MemoryNetwork()
    cls = get_algorithm(algorithm)
    opts = parse_options(cls, options)
    nodes = []
    for i in range(n):
        nid = f"n{i}"
        ctx = RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f"),
                             peers=PeerTable(nid, "f"), data=_node_data(i), model_spec=SPEC,
                             train=TrainConfig(batch_size=8), init_seed=1000 + i, rng=np.random.default_rng(i),
                             seed=seed)
        if sent is not None:
            orig_send = ctx.send

            async def send(peer, msg, _orig=orig_send, _nid=nid):
                sent.append((_nid, msg.kind, set(msg.tensors)))
                return await _orig(peer, msg)

            ctx.send = send
        nodes.append(Node(ctx, cls(ctx, opts), _node_data(50).val_x, _node_data(50).val_y))
    return net, nodes


def _run(nodes, rounds):
    async def main():
        for nd in nodes:
            await nd.ctx.start()
        for nd in nodes:
            await nd.setup()
        await __import__("asyncio").gather(*(nd.run(rounds) for nd in nodes))
        for nd in nodes:
            await nd.ctx.stop()

    run_virtual(main())


def test_serverless_fedd2s_equals_the_centralized_reference():
    rounds, seed = 6, 5
    sent: list = []
    _, nodes = _federation(5, seed=seed, sent=sent)
    _run(nodes, rounds)
    ref = run_reference({f"n{i}": _node_data(i) for i in range(5)}, SPEC, FedD2SOptions(**OPTS), seed=seed,
                        init_seeds={f"n{i}": 1000 + i for i in range(5)}, rounds=rounds, batch_size=8)
    # same participants, and every node took part at least once with layers dropped
    assert sum(len(p) for p in ref.participants) == 2 * rounds
    assert sum(nd.algorithm.z for nd in nodes) == 2 * rounds
    assert {nd.ctx.node_id: nd.algorithm.z for nd in nodes} == {n: c for n, c in
                                                               _counts(ref.participants).items()}
    assert min(nd.algorithm.l for nd in nodes if nd.algorithm.z > 1) < 6
    for nd in nodes:
        mine, theirs = model_to_numpy(nd.algorithm.personal), model_to_numpy(ref.personal[nd.ctx.node_id])
        for k in mine:
            np.testing.assert_allclose(mine[k], theirs[k], rtol=0, atol=1e-6, err_msg=f"{nd.ctx.node_id} {k}")
    # the serverless variant sends parameters only: every tensor sent is a model parameter
    names = set(model_to_numpy(nodes[0].algorithm.personal))
    assert sent and all(t <= names for _, _, t in sent)
    assert {k for _, k, _ in sent} >= {"fedd2s.invite", "fedd2s.model", "fedd2s.update"}


def _counts(parts):
    out = {f"n{i}": 0 for i in range(5)}
    for p in parts:
        for n in p:
            out[n] += 1
    return out


def test_fedd2s_rejects_a_non_layered_model():
    net = MemoryNetwork()
    ctx = RuntimeContext(node_id="a", federation="f", transport=net.transport("a", "f"), peers=PeerTable("a", "f"),
                         data=_node_data(0), model_spec={"type": "mlp", "input_shape": [1, 8, 8], "hidden": [8],
                                                         "num_classes": 4},
                         train=TrainConfig(), init_seed=0, rng=np.random.default_rng(0))
    alg = get_algorithm("fedd2s")(ctx, None)
    with pytest.raises(TypeError, match="convdense"):
        run_virtual(alg.setup())
    with pytest.raises(ValueError, match="z0"):
        parse_options(get_algorithm("fedd2s"), {"z0": 0})


# -- FedPer ---------------------------------------------------------------------------------------
def test_fedper_shares_the_base_and_keeps_heads_personal():
    m = _model(0)
    assert personal_keys(m, 1) == {"blocks.5.0.weight", "blocks.5.0.bias"}
    assert personal_keys(m, 0) == set()
    with pytest.raises(ValueError, match="head_layers"):
        personal_keys(m, 6)
    mlp = build_model({"type": "mlp", "input_shape": [4], "hidden": [8], "num_classes": 3})
    assert personal_keys(mlp, 1) == {"net.3.weight", "net.3.bias"}
    _, nodes = _federation(4, "fedper", {"sender_ratio": 0.5})
    _run(nodes, 4)
    states = [model_to_numpy(nd.algorithm.model) for nd in nodes]
    assert all(nd.algorithm.completed == 4 for nd in nodes)
    # the last round's two participants hold the same base but different heads
    last = [nd for nd in nodes if nd.algorithm.applied == 4]
    assert len(last) == 2
    a, b = (model_to_numpy(nd.algorithm.model) for nd in last)
    assert np.array_equal(a["blocks.0.0.weight"], b["blocks.0.0.weight"])
    assert not np.array_equal(a["blocks.5.0.weight"], b["blocks.5.0.weight"])
    assert len(states) == 4


# -- UA metric -------------------------------------------------------------------------------------
def test_user_accuracy_averages_the_last_rounds_then_the_nodes():
    hist = {
        "a": [{"round": r, "local_accuracy": 0.0 if r <= 5 else 1.0} for r in range(1, 16)],
        "b": [{"round": r, "local_accuracy": 0.5} for r in range(1, 16)] + [{"round": 16}],
    }
    ua = metrics.user_accuracy(hist, last=10)
    assert ua["per_node"]["a"] == pytest.approx(1.0) and ua["per_node"]["b"] == pytest.approx(0.5)
    assert ua["mean"] == pytest.approx(0.75) and ua["histogram"][9] == 1 and ua["histogram"][5] == 1


def test_fedavg_mode_deploys_the_global_model_and_local_adam_trains_only_when_drawn():
    _, nodes = _federation(4, "fedper", {"sender_ratio": 0.5, "head_layers": 0})
    _run(nodes, 3)
    views = [model_to_numpy(nd.algorithm.deployable_model()) for nd in nodes]
    assert all(np.array_equal(v["blocks.5.0.weight"], views[0]["blocks.5.0.weight"]) for v in views)
    _, nodes = _federation(5, "local_adam", {"participation": 0.4})
    _run(nodes, 4)
    trained = sum(1 for nd in nodes for r in nd.history if r.get("trained") is not False)
    assert trained == 2 * 4  # ⌈0.4 · 5⌉ = 2 nodes train per round, the rounds fedd2s would draw them


def test_killing_the_token_holder_mid_round_the_others_go_on_from_the_last_global_model():
    import asyncio

    opts = {**OPTS, "token_timeout": 40.0, "invite_timeout": 10.0, "update_timeout": 20.0}
    net, nodes = _federation(5, options=opts)
    killed = {}
    for node in nodes:
        original = node.algorithm.aggregate

        async def aggregate(t, token, contributions, _node=node, _orig=original):
            if t == 3 and not killed:  # the round-3 holder dies after collecting the copies
                killed["node"] = _node.ctx.node_id
                killed["theta"] = _node.algorithm.current_global()
                net.kill(_node.ctx.node_id)
                raise asyncio.CancelledError
            return await _orig(t, token, contributions)

        node.algorithm.aggregate = aggregate

    async def main():
        for nd in nodes:
            await nd.ctx.start()
            await nd.setup()
        await asyncio.gather(*(nd.run(5) for nd in nodes), return_exceptions=True)

    run_virtual(main())
    survivors = [nd for nd in nodes if nd.ctx.node_id != killed["node"]]
    assert killed and all(nd.history[-1]["round"] == 5 for nd in survivors)
    assert all(nd.algorithm.best.round == 5 and nd.algorithm.best.tensors for nd in survivors)
