"""The Adam algorithms (fedd2s, fedper, local_adam) follow ``training.lr`` when the user sets
it; left unset they keep their own 0.01 (the SGD default 0.05 never reaches Adam), and their
``adam_lr`` option wins over both."""

import asyncio

import numpy as np
import pytest
import torch

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.data import NodeData
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning import d2s, training
from dfl_agent.learning.training import DEFAULT_ADAM_LR, DEFAULT_LR, TrainConfig, adam_lr
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml, load_config
from dfl_agent.transport.memory import MemoryNetwork, run_virtual

SPEC = {"type": "convdense", "input_shape": [1, 8, 8], "conv": [4, 8, 8], "dense": [8, 8], "num_classes": 4}
OPTIONS = {"fedd2s": {"sender_ratio": 1.0, "z0": 1, "c2s_epochs": 1, "s2c_epochs": 1},
           "fedper": {"sender_ratio": 1.0}, "local_adam": {}}


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _data(i, n=20):
    g = np.random.default_rng(100 + i)
    x = g.random((n, 1, 8, 8), dtype=np.float32)
    y = g.integers(0, 4, n).astype(np.int64)
    return NodeData(train_x=x[:16].copy(), train_y=y[:16].copy(), val_x=x[16:].copy(), val_y=y[16:].copy(),
                    num_classes=4, input_shape=(1, 8, 8), class_names=list("abcd"), groups=[])


def _adam_rates(monkeypatch, algorithm, train, options=None):
    """The learning rates of every Adam optimizer two nodes of ``algorithm`` build in one round."""
    built = []
    real = training.make_optimizer

    def spy(params, kind="sgd", **kw):
        built.append((kind, kw["lr"]))
        return real(params, kind, **kw)

    monkeypatch.setattr(training, "make_optimizer", spy)
    monkeypatch.setattr(d2s, "make_optimizer", spy)
    net, cls = MemoryNetwork(), get_algorithm(algorithm)
    opts = parse_options(cls, {**OPTIONS[algorithm], **(options or {})})
    nodes = []
    for i in range(2):
        ctx = RuntimeContext(node_id=f"n{i}", federation="f", transport=net.transport(f"n{i}", "f"),
                             peers=PeerTable(f"n{i}", "f"), data=_data(i), model_spec=SPEC, train=train,
                             init_seed=1000 + i, rng=np.random.default_rng(i), seed=3)
        nodes.append(Node(ctx, cls(ctx, opts), _data(50).val_x, _data(50).val_y))

    async def main():
        for nd in nodes:
            await nd.ctx.start()
        for nd in nodes:
            await nd.setup()
        await asyncio.gather(*(nd.run(1) for nd in nodes))
        for nd in nodes:
            await nd.ctx.stop()

    run_virtual(main())
    rates = {lr for kind, lr in built if kind == "adam"}
    assert rates, f"{algorithm} built no Adam optimizer"
    return rates


@pytest.mark.parametrize("algorithm", ["fedd2s", "fedper", "local_adam"])
def test_adam_algorithms_follow_a_set_training_lr_and_keep_001_otherwise(monkeypatch, algorithm):
    assert _adam_rates(monkeypatch, algorithm, TrainConfig(batch_size=8, lr=0.001, lr_is_set=True)) == {0.001}
    assert _adam_rates(monkeypatch, algorithm, TrainConfig(batch_size=8)) == {DEFAULT_ADAM_LR}
    # the option wins over a set training.lr
    assert _adam_rates(monkeypatch, algorithm, TrainConfig(batch_size=8, lr=0.001, lr_is_set=True),
                       {"adam_lr": 0.002}) == {0.002}


def test_adam_lr_rule():
    assert adam_lr(None, None) == adam_lr(None, TrainConfig()) == DEFAULT_ADAM_LR == 0.01
    assert adam_lr(None, TrainConfig(lr=DEFAULT_LR, lr_is_set=True)) == 0.05  # set explicitly, even to 0.05
    assert adam_lr(0.003, TrainConfig(lr=0.2, lr_is_set=True)) == 0.003
    with pytest.raises(ValueError, match="adam_lr"):
        parse_options(get_algorithm("fedper"), {"adam_lr": 0.0})


def test_the_configuration_tells_a_set_training_lr_from_the_default(tmp_path):
    unset = config_from_dict({})
    assert unset.training.lr is None
    (tmp_path / "a.toml").write_text(dump_toml(unset))
    assert load_config(tmp_path / "a.toml").training.lr is None  # unset stays unset through dump/load
    given = config_from_dict({"training": {"lr": 0.001}})
    (tmp_path / "b.toml").write_text(dump_toml(given))
    assert load_config(tmp_path / "b.toml").training.lr == 0.001


def test_dflctl_simulate_lr_is_unset_unless_given():
    from dfl_agent.cli.dflctl import build_parser

    p = build_parser()
    assert p.parse_args(["simulate"]).lr is None
    assert p.parse_args(["simulate", "--lr", "0.001"]).lr == 0.001
