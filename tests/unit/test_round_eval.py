"""Round evaluation never delays the federation: background evaluation of model copies,
records still in round order, and the ``eval_every`` schedule."""

import asyncio
import threading
import time

import numpy as np

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.data import load_dataset, node_data_for
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.training import TrainConfig
from dfl_agent.models import default_spec
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict
from dfl_agent.transport.memory import MemoryNetwork

SLOW_EVAL = 1.5  # seconds every evaluation is made to take


def _federation(n, rounds, **node_kw):
    bundle = load_dataset("digits")
    spec = default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small")
    cls = get_algorithm("fedavg")
    net = MemoryNetwork()
    nodes, records = [], []
    for i in range(n):
        nid = f"n{i}"
        ctx = RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f", {}),
                             peers=PeerTable(nid, "f"), data=node_data_for(bundle, 8, i, "iid", seed=0),
                             model_spec=spec, train=TrainConfig(epochs=1, batch_size=32), init_seed=7,
                             rng=np.random.default_rng([0, i]), seed=0, compute_in_thread=True)
        node = Node(ctx, cls(ctx, parse_options(cls, {"round_timeout": 30.0})), bundle.test.x[:60],
                    bundle.test.y[:60], rounds=rounds, sink=records.append, **node_kw)
        nodes.append(node)
    return nodes, records


def _run(nodes, rounds):
    async def main():
        for nd in nodes:
            await nd.ctx.start()
        for nd in nodes:
            await nd.setup()
        await asyncio.wait_for(asyncio.gather(*(nd.run(rounds) for nd in nodes)), 120)
        for nd in nodes:
            await nd.ctx.stop()

    asyncio.run(main())


def test_background_evaluation_overlaps_the_next_round_and_keeps_records_in_order():
    nodes, records = _federation(2, 3, eval_background=True)
    evals: list[tuple[str, float, float, bool]] = []  # node, start, end, on the event loop's thread
    round_ends: dict[tuple[str, int], float] = {}
    for nd in nodes:
        inner, hook = nd._evaluate, nd._on_round

        def slow(models=None, inner=inner, nid=nd.ctx.node_id):
            t0 = time.monotonic()
            time.sleep(SLOW_EVAL)
            out = inner(models)
            evals.append((nid, t0, time.monotonic(), threading.current_thread() is threading.main_thread()))
            return out

        async def on_round(t, info, hook=hook, nid=nd.ctx.node_id):
            round_ends[(nid, t)] = time.monotonic()
            await hook(t, info)

        nd._evaluate = slow
        nd.ctx.round_hook = on_round
    _run(nodes, 3)
    for nid in ("n0", "n1"):
        mine = [r for r in records if r["node"] == nid]
        assert [r["round"] for r in mine] == [1, 2, 3]  # written in round order
        evaluated = [r for r in mine if "global_accuracy" in r]
        assert evaluated[0]["round"] == 1 and evaluated[-1]["round"] == 3  # the first and the last
        assert all(0 <= r["global_accuracy"] <= 1 and r["eval_s"] >= SLOW_EVAL for r in evaluated)
        # a round that ended while the previous evaluation ran was not queued for evaluation
        assert all(r.get("eval_skipped") for r in mine if "global_accuracy" not in r)
        ends = sorted(e[2] for e in evals if e[0] == nid)
        assert len(ends) == len(evaluated)
        # the next round finished before the previous round's evaluation did: it never waited for it
        assert round_ends[(nid, 2)] < ends[0]
    assert not any(e[3] for e in evals)  # evaluated in a worker thread, never on the event loop
    for nd in nodes:
        assert nd.status()["global_accuracy"] == nd.history[-1]["global_accuracy"]
        assert nd.status()["state"] == "finished"


def test_evaluation_between_rounds_when_not_in_background_and_eval_every():
    nodes, records = _federation(2, 4, eval_every=2)
    _run(nodes, 4)
    mine = sorted((r for r in records if r["node"] == "n0"), key=lambda r: r["round"])
    assert [r["round"] for r in mine] == [1, 2, 3, 4]
    assert ["global_accuracy" in r for r in mine] == [True, True, False, True]  # 1, every 2nd, the last


def test_eval_config_keys():
    cfg = config_from_dict({"runtime": {"eval_every": 5}})
    assert cfg.runtime.eval_every == 5 and cfg.runtime.eval_background is True
    assert cfg.runtime.baseline_local is False  # the local-only baseline stays opt-in
    try:
        config_from_dict({"runtime": {"eval_every": 0}})
    except ConfigError as exc:
        assert "runtime.eval_every" in str(exc)
    else:
        raise AssertionError("eval_every = 0 accepted")


def test_background_baseline_trains_every_round_even_when_evaluation_is_skipped():
    nodes, records = _federation(2, 4, eval_background=True, baseline_local=True)
    trained = {nd.ctx.node_id: 0 for nd in nodes}
    for nd in nodes:
        inner_eval, inner_shadow = nd._evaluate, nd._train_shadow

        def slow(models=None, inner=inner_eval):
            time.sleep(SLOW_EVAL)  # longer than a round: the next rounds are not evaluated
            return inner(models)

        def count(inner=inner_shadow, nid=nd.ctx.node_id):
            trained[nid] += 1
            inner()

        nd._evaluate, nd._train_shadow = slow, count
    _run(nodes, 4)
    assert trained == {"n0": 4, "n1": 4}  # one local-only training per round
    last = [r for r in records if r["round"] == 4]
    assert len(last) == 2 and all(0 <= r["local_only_global_accuracy"] <= 1 for r in last)
