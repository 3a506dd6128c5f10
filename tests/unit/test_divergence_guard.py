"""The shared divergence guard (Algorithm.divergence_guard): no aggregation,
mutual-learning or transfer step leaves a non-finite model behind, whatever a peer
sends.  A peer's model with one weight of 1e30 is finite, so it passes the wire; the
step it feeds must be undone on the receiver, counted as ``diverged`` (counters, round
records, status) and logged at WARNING once per round, and the round goes on.

Real nodes over the in-memory transport (the same wire frames as MQTT); the poisoned
peer only changes the tensors of the messages it sends."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import types

import numpy as np
import pytest
import torch
from torch import nn

from dfl_agent.algorithms.base import available, get_algorithm, parse_options
from dfl_agent.algorithms.context import Message
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.transport.memory import MemoryNetwork, run_virtual
from tests.unit.toy import SPEC

POISON = 1e30  # finite in float32: the wire lets it through

# short deadlines: a round never waits long for a peer (virtual time anyway)
ROTATION = {"invite_timeout": 5.0, "update_timeout": 10.0, "token_timeout": 20.0}
OPTIONS: dict[str, dict] = {
    "dfml": {"mutual_epochs": 1, **ROTATION},
    "dfedavg": ROTATION, "dfedprox": ROTATION, "heterofl": ROTATION, "fedrolex": ROTATION,
    "fedd2s": {"sender_ratio": 1.0, **ROTATION}, "fedper": {"sender_ratio": 1.0, **ROTATION},
    "fedavg": {"round_timeout": 5.0}, "cfa": {"round_timeout": 5.0}, "dechetero": {"round_timeout": 5.0},
    "dechw": {"round_timeout": 5.0},
}
# a model with named layers for FedD2S (the rest: the toy MLP)
CONV_SPEC = {"type": "convdense", "input_shape": [1, 8, 8], "conv": [4, 8, 8], "dense": [8, 8], "num_classes": 2}


def _data(seed: int, shape: tuple[int, ...]) -> types.SimpleNamespace:
    """40 samples (32 train, 8 validation), label = sign of the first two features' sum."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(40, *shape)).astype(np.float32)
    flat = x.reshape(40, -1)
    y = (flat[:, 0] + flat[:, 1] > 0).astype(np.int64)
    return types.SimpleNamespace(train_x=x[:32], train_y=y[:32], val_x=x[32:], val_y=y[32:], num_classes=2,
                                 num_train=32, num_val=8)


def _federation(name: str, n: int = 2, options: dict | None = None) -> tuple[MemoryNetwork, list[Node]]:
    cls = get_algorithm(name)
    opts = parse_options(cls, OPTIONS.get(name, {}) if options is None else options)
    spec = CONV_SPEC if name == "fedd2s" else SPEC
    shape = tuple(spec["input_shape"])
    test = _data(99, shape)
    net = MemoryNetwork()
    nodes = []
    for i in range(n):
        nid = f"n{i}"
        ctx = RuntimeContext(
            node_id=nid, federation="f", transport=net.transport(nid, "f", {}), peers=PeerTable(nid, "f"),
            data=_data(i, shape), model_spec=spec, train=TrainConfig(batch_size=8, lr=0.1), init_seed=7,
            rng=np.random.default_rng([0, i]), seed=0,
        )
        nodes.append(Node(ctx, cls(ctx, opts), test.val_x, test.val_y, rounds=2))
    return net, nodes


def first_nonfinite(value) -> str | None:
    """The test's own check: path of the first tensor holding NaN/Inf in ``value`` (a
    module, tensor, array, or nested dict/list of them), or None."""
    if isinstance(value, nn.Module):
        value = value.state_dict()
    if torch.is_tensor(value):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return "" if value.dtype.kind == "f" and not np.isfinite(value).all() else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else []
    for k, v in items:
        where = first_nonfinite(v)
        if where is not None:
            return f"{k}.{where}" if where else str(k)
    return None


#: non-module state that must stay finite too: GT's M_R and forecast, FedD2S's θ^g and copy
STATE = ("reference", "forecast", "_theta_out", "_copy")


def _poisoned(msg: Message) -> Message:
    """``msg`` with the first entry of each floating tensor set to 1e30."""
    tensors = {}
    for k, v in msg.tensors.items():
        if v.dtype.kind == "f" and v.size:
            v = np.array(v, copy=True)
            v.reshape(-1)[0] = POISON
        tensors[k] = v
    return dataclasses.replace(msg, tensors=tensors)


def poison_outgoing(ctx: RuntimeContext) -> None:
    """Every message ``ctx`` sends from now on carries a 1e30 weight in each tensor."""
    send, broadcast = ctx.send, ctx.broadcast

    async def poisoned_send(peer: str, message: Message) -> int:
        return await send(peer, _poisoned(message))

    async def poisoned_broadcast(message: Message, *, neighbours_only: bool = False) -> int:
        return await broadcast(_poisoned(message), neighbours_only=neighbours_only)

    ctx.send = poisoned_send  # type: ignore[method-assign]
    ctx.broadcast = poisoned_broadcast  # type: ignore[method-assign]


def _state_of(node: Node) -> dict:
    """Every model of the node's algorithm and its guarded state (GT's M_R, FedD2S's θ^g)."""
    alg = node.algorithm
    out: dict = {a: m for a, m in vars(alg).items() if isinstance(m, nn.Module)}
    out.update({a: getattr(alg, a) for a in STATE if hasattr(alg, a)})
    out["deployable"] = alg.deployable_model()
    return out


def _run(nodes: list[Node], rounds: int, checks: list[str]) -> None:
    """Run ``rounds`` on every node; after each round a node ends, every model of that
    node must be finite (a failure is appended to ``checks``)."""

    def watch(node: Node) -> None:
        end_round = node.ctx.end_round

        async def checked(round: int, **info) -> None:
            where = first_nonfinite(_state_of(node))
            if where is not None:
                checks.append(f"{node.ctx.node_id} round {round}: {where} is not finite")
            await end_round(round, **info)

        node.ctx.end_round = checked  # type: ignore[method-assign]

    async def main() -> None:
        for nd in nodes:
            await nd.ctx.start()
        for nd in nodes:
            await nd.setup()
            watch(nd)
        results = await asyncio.gather(*(nd.run(rounds) for nd in nodes), return_exceptions=True)
        for nd in nodes:
            await nd.ctx.stop()
        for nd, res in zip(nodes, results):
            if isinstance(res, BaseException):
                raise AssertionError(f"{nd.ctx.node_id} crashed: {res!r}") from res

    run_virtual(main())


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- Def-KT: the case ---------------------------------------------------------------


def test_defkt_receiver_keeps_its_finite_model_and_counts_diverged(caplog):
    net, nodes = _federation("defkt")
    for nd in nodes:  # whoever sends in round 1, its model arrives with a 1e30 weight
        poison_outgoing(nd.ctx)
    # the initial weights (init_seed 7 on every node), from a fresh node of the same config
    _, fresh = _federation("defkt", n=1)
    run_virtual(fresh[0].setup())
    initial = model_to_numpy(fresh[0].algorithm.model)
    checks: list[str] = []
    with caplog.at_level(logging.WARNING):
        _run(nodes, 1, checks)
    receiver = next(nd for nd in nodes if nd.history[-1]["role"] == "receiver")
    alg = receiver.algorithm
    # stored model (w̃ after the transfer) and own model: finite, and the own one exactly
    # as before the transfer (a receiver does not train in rounds mode)
    assert first_nonfinite(alg.model) is None, f"receiver's stored model: {first_nonfinite(alg.model)} not finite"
    got = model_to_numpy(alg.model)
    assert all(np.array_equal(got[k], initial[k]) for k in got), "receiver's model changed"
    assert checks == []
    assert receiver.ctx.counters().get("diverged") == 1
    assert receiver.history[-1]["diverged"] == 1 and receiver.history[-1]["fused"] is False
    assert receiver.status()["diverged"] == 1
    assert next(r for r in caplog.records if "non-finite" in r.getMessage()).levelno == logging.WARNING
    sender = next(nd for nd in nodes if nd is not receiver)
    assert sender.ctx.counters().get("diverged") == 0 and sender.history[-1]["diverged"] == 0


def test_defkt_gossip_mode_skips_a_diverged_fusion():
    net, nodes = _federation("defkt", options={"mode": "gossip", "gossip_interval": 1.0})
    poison_outgoing(nodes[0].ctx)
    checks: list[str] = []
    _run(nodes, 3, checks)
    assert checks == []
    assert nodes[1].ctx.counters().get("diverged", 0) >= 1  # n1 fused n0's pushes: each one undone
    assert all(r["fused"] == 0 for r in nodes[1].history)


# -- DFML: its own restore now goes through the shared guard ----------------------------------


def test_dfml_aggregator_restores_every_model_and_counts_diverged():
    net, nodes = _federation("dfml")
    poison_outgoing(nodes[0].ctx)  # round 1: n0 leads; its update to n1 carries 1e30
    checks: list[str] = []
    _run(nodes, 2, checks)
    assert checks == []
    # round 2's mutual learning holds a 1e30 model (n1's own, or n0's poisoned one)
    assert sum(nd.ctx.counters().get("diverged", 0) for nd in nodes) >= 1
    skipped = [r for nd in nodes for r in nd.history if r.get("skipped")]
    assert skipped, "the diverged round must be skipped (participants keep their models)"
    assert all(r["diverged"] == nd.ctx.counters()["diverged"] for nd in nodes for r in nd.history[-1:])


# -- gossip averaging with a 1e30 peer update ------------------------------------------------


@pytest.mark.parametrize("name", ["fedavg", "dechetero"])
def test_gossip_average_with_a_1e30_update_stays_finite(name):
    net, nodes = _federation(name)
    poison_outgoing(nodes[0].ctx)
    checks: list[str] = []
    _run(nodes, 2, checks)
    assert checks == []
    assert all(first_nonfinite(_state_of(nd)) is None for nd in nodes)


# -- the guard itself --------------------------------------------------------------------------


def test_guard_restores_replaced_models_and_guarded_state_and_warns_once_per_round(caplog):
    net, nodes = _federation("defkt", n=1)
    node = nodes[0]
    run_virtual(node.setup())
    alg = node.algorithm
    old = alg.model
    before = model_to_numpy(old)
    extra = nn.Linear(2, 2)
    extra_before = model_to_numpy(extra)
    with caplog.at_level(logging.WARNING, logger="dfl_agent.runtime.node.context"):
        with alg.divergence_guard("transfer", extra) as g:
            replacement = nn.Linear(1, 1)
            with torch.no_grad():
                replacement.weight.fill_(float("nan"))
                extra.weight.fill_(float("inf"))
                next(old.parameters()).add_(1.0)  # the old model changed in place too
            alg.model = replacement  # a step may replace the model (Def-KT stores w̃)
        assert g.diverged and g.detail.startswith("model.")
        assert alg.model is old
        assert all(np.array_equal(model_to_numpy(old)[k], before[k]) for k in before)
        assert all(np.array_equal(model_to_numpy(extra)[k], extra_before[k]) for k in extra_before)
        # a second one the same round: counted only
        with alg.divergence_guard("transfer") as g2, torch.no_grad():
            next(alg.model.parameters()).fill_(float("nan"))
        with alg.divergence_guard("transfer") as g3, torch.no_grad():  # a finite step: nothing happens
            next(alg.model.parameters()).add_(1.0)
        assert g2.diverged and not g3.diverged
        warnings = [r for r in caplog.records if "non-finite" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert node.ctx.diverged == 2 and node.ctx.counters()["diverged"] == 2
        run_virtual(node.ctx.end_round(1))
        with alg.divergence_guard("transfer"), torch.no_grad():
            next(alg.model.parameters()).fill_(float("nan"))
        assert len([r for r in caplog.records if "non-finite" in r.getMessage()]) == 2  # a new round
    assert node.ctx.diverged == 3
    assert first_nonfinite(alg.model) is None


def test_guard_checks_named_state():
    net, nodes = _federation("gt", n=1)
    node = nodes[0]
    run_virtual(node.setup())
    alg = node.algorithm
    assert "reference" in alg.guarded_state
    ref = {k: v.copy() for k, v in alg.reference.items()}
    with alg.divergence_guard("synchronization") as g:
        alg.reference = {k: np.full_like(v, np.nan) for k, v in ref.items()}
    assert g.diverged and g.detail.startswith("reference.")
    assert all(np.array_equal(alg.reference[k], ref[k]) for k in ref)


def test_first_nonfinite_finds_the_entry():
    from dfl_agent.algorithms.base import first_nonfinite

    assert first_nonfinite({"a": np.ones(3, np.float32), "b": [np.zeros(2), torch.ones(2)]}) is None
    assert first_nonfinite({"a": np.ones(3), "b": [np.zeros(2), torch.tensor([1.0, float("inf")])]}) == "b.1"
    assert first_nonfinite(np.array([np.nan])) == ""
    assert first_nonfinite(np.arange(3)) is None and first_nonfinite(None) is None


# -- every registered algorithm ----------------------------------------------------------------


@pytest.mark.parametrize("poisoned", ["n0", "both"])
@pytest.mark.parametrize("name", available())  # every registered algorithm, new ones included
def test_no_algorithm_keeps_or_sends_a_non_finite_model_when_a_peer_sends_1e30(name, poisoned):
    net, nodes = _federation(name)
    for nd in nodes if poisoned == "both" else nodes[:1]:
        poison_outgoing(nd.ctx)
    checks: list[str] = []
    _run(nodes, 2, checks)
    assert checks == [], checks
    for nd in nodes:
        assert first_nonfinite(_state_of(nd)) is None
        assert len(nd.history) == 2
        # 1e30 is finite: a frame refused as non-finite was a NaN/Inf model some node sent
        assert "non_finite" not in nd.ctx.counters()["dropped"], nd.ctx.counters()["dropped"]


# -- local training that blows up -------------------------------------------------------------


def test_local_training_stops_at_a_non_finite_loss_restores_and_says_so():
    """A model whose weights are huge but finite (what averaging in a 1e30 update leaves)
    overflows its logits: the loss is not finite.  Training stops there, puts the model
    back as it was and reports ``diverged`` with a NaN loss."""
    from dfl_agent.learning.training import train_adam, train_local
    from dfl_agent.models import build_model

    d = _data(0, tuple(SPEC["input_shape"]))
    for train in (lambda m: train_local(m, d.train_x, d.train_y, TrainConfig(batch_size=8, lr=0.1),
                                        np.random.default_rng(0)),
                  lambda m: train_adam(m, d.train_x, d.train_y, epochs=1, batch_size=8, lr=0.01,
                                       rng=np.random.default_rng(0))):
        model = build_model(SPEC)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1e30)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        out = train(model)
        assert out["diverged"] == 1.0 and np.isnan(out["loss"])
        assert out.get("samples", 0.0) == 0.0  # it stopped at the first batch: no step on a NaN gradient
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_runtime_counts_a_training_round_that_diverged(caplog):
    """Two fedavg nodes, one of which sends a 1e30 weight in every update: the honest node's
    average is huge but finite, its next local training overflows and is undone, and that
    is counted as ``diverged`` in its counters (round records, status) with a WARNING naming
    local training.  With the count in the runtime removed, ``diverged`` stays 0."""
    net, nodes = _federation("fedavg")
    poison_outgoing(nodes[0].ctx)
    checks: list[str] = []
    with caplog.at_level(logging.WARNING, logger="dfl_agent.runtime.node.context"):
        _run(nodes, 2, checks)
    honest = nodes[1].ctx
    assert honest.counters()["diverged"] >= 1
    assert any("local training step left" in r.getMessage() for r in caplog.records)
