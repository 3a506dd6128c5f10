"""Batched simulator training (dfl_agent.runtime.node.batching): a vectorised group equals the
per-node ``train_local`` loop within float tolerance, for the same seeds."""

import copy
import types

import numpy as np
import pytest
import torch

from dfl_agent.learning.training import TrainConfig, train_local
from dfl_agent.models import build_model
from dfl_agent.runtime.node.batching import BatchTrainer
from dfl_agent.transport.memory import run_virtual

SPEC = {"type": "mlp", "input_shape": [1, 4, 4], "hidden": [16, 8], "num_classes": 3}


def _node_data(i, n):
    rng = np.random.default_rng(100 + i)
    x = rng.normal(size=(n, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, n).astype(np.int64)
    return x, y


def _models(k):
    out = []
    for i in range(k):
        torch.manual_seed(i)
        out.append(build_model(SPEC))
    return out


@pytest.mark.parametrize("cfg", [
    TrainConfig(batch_size=8, lr=0.05, momentum=0.9),
    TrainConfig(batch_size=5, lr=0.1, momentum=0.0, weight_decay=0.01, epochs=2),
    TrainConfig(batch_size=4, lr=0.05, momentum=0.5, steps=7),
])
def test_batched_group_equals_per_node_loop(cfg):
    torch.set_num_threads(1)
    sizes = [20, 20, 20, 13, 17]  # node 4's last batch is shorter: padded and masked
    models = _models(len(sizes))
    reference = copy.deepcopy(models)
    data = [_node_data(i, n) for i, n in enumerate(sizes)]
    expected = [train_local(m, x, y, cfg, np.random.default_rng(i), "cpu")
                for i, (m, (x, y)) in enumerate(zip(reference, data))]

    trainer = BatchTrainer()
    ctxs = [types.SimpleNamespace(timing={"train_s": 0.0}) for _ in sizes]

    async def main():
        import asyncio

        futs = [trainer.submit(c, train_local, (m, x, y, cfg, np.random.default_rng(i), "cpu"), {})
                for i, (c, m, (x, y)) in enumerate(zip(ctxs, models, data))]
        assert all(f is not None for f in futs)
        return await asyncio.gather(*futs)

    got = run_virtual(main())
    # node 3 takes fewer steps per epoch (its own group of one), unless the step count is fixed
    # (then its shorter last batches are padded and masked inside the one group)
    assert trainer.stats == ({"batched_nodes": 5, "groups": 1, "single": 0} if cfg.steps else
                             {"batched_nodes": 4, "groups": 1, "single": 1})
    assert all(c.timing["train_s"] > 0 for c in ctxs)
    for e, g, m_ref, m in zip(expected, got, reference, models):
        assert g["samples"] == e["samples"] and g["diverged"] == e["diverged"] == 0.0
        assert g["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6)
        for (n, p_ref), (_, p) in zip(m_ref.named_parameters(), m.named_parameters()):
            torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6, msg=n)


def test_unqualified_calls_are_left_to_the_caller():
    trainer = BatchTrainer()
    x, y = _node_data(0, 10)
    cfg = TrainConfig()
    ctx = types.SimpleNamespace(timing={"train_s": 0.0})

    async def main():
        with_dropout = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))
        with_bn = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3), torch.nn.BatchNorm1d(3))
        rng = np.random.default_rng(0)
        assert trainer.submit(ctx, train_local, (with_dropout, x, y, cfg, rng, "cpu"), {}) is None
        assert trainer.submit(ctx, train_local, (with_bn, x, y, cfg, rng, "cpu"), {}) is None
        m = _models(1)[0]
        assert trainer.submit(ctx, train_local, (m, x, y, cfg, rng, "cpu"), {"loss_fn": lambda z, t: z.sum()}) is None
        assert trainer.submit(ctx, train_local, (m, x, y, cfg, rng, "cpu"), {"regularizer": lambda mm: 0.0}) is None
        assert trainer.submit(ctx, print, (m, x, y, cfg, rng, "cpu"), {}) is None

    run_virtual(main())
    assert trainer.stats["groups"] == 0


def test_simulator_batches_by_default_and_matches_no_batch():
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    base = dict(algorithm="fedavg", nodes=4, rounds=2, dataset="har", partition="by-user",
                train=TrainConfig(batch_size=64))
    batched = simulate(SimConfig(**base))
    single = simulate(SimConfig(**base, batch=False))
    b = batched["batching"]
    # every training went through the batcher; users with the same step count trained together
    assert b["batched_nodes"] + b["single"] == 4 * 2 and b["groups"] >= 2 and b["batched_nodes"] >= 4
    # every round's evaluation too: the shared test set in one pass per round (4 nodes), and
    # the validation splits, stacked where their sizes agree
    assert b["evaluated_batched"] + b["eval_single"] == 2 * 4 * 2 and b["eval_groups"] >= 2
    assert b["evaluated_batched"] >= 2 * 4
    assert single["batching"] is None
    for node, acc in single["global_accuracy"]["per_node"].items():
        assert batched["global_accuracy"]["per_node"][node] == pytest.approx(acc, abs=0.01)


def test_batched_evaluation_equals_per_node_evaluate():
    """evaluate_group on a shared test set (one input for all) and on per-node sets
    (stacked), chunked: per-node accuracy exact, loss within float tolerance; the models'
    train/eval mode is left as it was."""
    from dfl_agent.learning.training import evaluate
    from dfl_agent.runtime.node.batching import evaluate_group

    torch.set_num_threads(1)
    models = _models(6)
    for m in models[3:]:
        m.eval()
    test_x, test_y = _node_data(99, 37)
    own = [_node_data(i, 11) for i in range(6)]
    shared = evaluate_group(models, [test_x] * 6, [test_y] * 6, batch_size=16)
    stacked = evaluate_group(models, [x for x, _ in own], [y for _, y in own], batch_size=4)
    for m, s, (x, y), st in zip(models, shared, own, stacked):
        e = evaluate(m, test_x, test_y, batch_size=16)
        assert s["accuracy"] == e["accuracy"] and s["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6)
        e = evaluate(m, x, y, batch_size=4)
        assert st["accuracy"] == e["accuracy"] and st["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6)
    assert [m.training for m in models] == [True] * 3 + [False] * 3
    assert len({round(s["loss"], 6) for s in shared}) == 6  # six different models, six results


def test_batch_trainer_groups_evaluations_and_leaves_unqualified_ones():
    """submit_eval: the shared test set is one group, per-node validation splits another;
    a frozen model (not trainable in a group) is evaluated in the group; a batch-norm
    model is not queued (None); results equal evaluate's."""
    from dfl_agent.learning.training import evaluate

    trainer = BatchTrainer()
    models = _models(5)
    models[0].requires_grad_(False)  # e.g. DFML's frozen peak model
    assert trainer._arch_key(models[0]) is None and trainer._arch_key(models[0], for_eval=True) is not None
    test_x, test_y = _node_data(50, 30)
    own = [_node_data(i, 7) for i in range(5)]
    with_bn = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3), torch.nn.BatchNorm1d(3))

    async def main():
        import asyncio

        assert trainer.submit_eval(with_bn, test_x, test_y) is None
        futs = [trainer.submit_eval(m, test_x, test_y) for m in models]
        futs += [trainer.submit_eval(m, x, y) for m, (x, y) in zip(models, own)]
        return await asyncio.gather(*futs)

    got = run_virtual(main())
    assert trainer.eval_stats == {"evaluated_batched": 10, "eval_groups": 2, "eval_single": 0}
    expected = [evaluate(m, test_x, test_y) for m in models] + [evaluate(m, x, y) for m, (x, y) in zip(models, own)]
    for g, e in zip(got, expected):
        assert g["accuracy"] == e["accuracy"] and g["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6)
