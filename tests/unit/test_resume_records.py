"""No round record is lost or written twice when a node is killed between a round's
checkpoint and its metrics record (background evaluation writes the record later).

A record is written only after its round's checkpoint is on disk, and the records not
yet written are saved with each checkpoint.  On resume the node writes those that the
metrics file lacks: the checkpointed round's evaluated on the restored model, which is
the model the lost record would have evaluated.
"""

import asyncio
import json

import numpy as np
import pytest

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.data import load_dataset, node_data_for
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.training import TrainConfig
from dfl_agent.models import default_spec, spec_hash
from dfl_agent.runtime.node.checkpoint import CheckpointStore, NodeCheckpointer
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.metrics import end_torn_line as _end_torn_line
from dfl_agent.runtime.node.metrics import written_rounds
from dfl_agent.runtime.node.node import Node
from dfl_agent.transport.memory import MemoryNetwork

ROUNDS = 3


def _node(tmp_path, metrics, background=True):
    """One ``local`` node writing its records to ``metrics`` (JSON lines, as the daemon)
    and a checkpoint after every round; returns (node, checkpointer)."""
    bundle = load_dataset("digits")
    spec = default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small")
    cls = get_algorithm("local")
    ctx = RuntimeContext(node_id="n0", federation="f", transport=MemoryNetwork().transport("n0", "f", {}),
                         peers=PeerTable("n0", "f"), data=node_data_for(bundle, 8, 0, "iid", seed=0),
                         model_spec=spec, train=TrainConfig(epochs=1, batch_size=32), init_seed=7,
                         rng=np.random.default_rng([0, 0]), seed=0, compute_in_thread=background)

    def sink(record):
        with open(metrics, "a") as f:
            f.write(json.dumps(record, sort_keys=True, default=float) + "\n")

    node = Node(ctx, cls(ctx, parse_options(cls, {})), bundle.test.x[:120], bundle.test.y[:120],
                rounds=ROUNDS, sink=sink, eval_background=background)
    ck = NodeCheckpointer(CheckpointStore(tmp_path / "checkpoints"), node.algorithm, ctx, spec_hash(spec),
                          pending=node.pending_records)
    node.hooks.checkpoint = ck.save_async
    return node, ck


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("background", [True, False])
def test_a_record_lost_after_its_checkpoint_is_written_at_resume(tmp_path, background):
    metrics = tmp_path / "metrics.jsonl"
    node, ck = _node(tmp_path, metrics, background)
    order = []  # (event, round): checkpoints saved and records written, in order
    save = node.hooks.checkpoint

    async def checkpoint(t):
        await save(t)
        order.append(("checkpoint", t))

    inner_sink = node.sink

    def sink(record):
        order.append(("record", record["round"]))
        inner_sink(record)

    node.hooks.checkpoint, node.sink = checkpoint, sink

    async def main():
        await node.ctx.start()
        await node.setup()
        await node.run(ROUNDS)
        await node.ctx.stop()

    asyncio.run(main())
    # every record is written after its round's checkpoint: a kill can never leave a
    # record whose round the resumed node runs again
    for t in range(1, ROUNDS + 1):
        assert order.index(("checkpoint", t)) < order.index(("record", t)), order
    # the checkpoint of the last round holds its record, not yet written when it was saved
    last = CheckpointStore(tmp_path / "checkpoints").load(ROUNDS)
    pending = json.loads(last.manifest["pending_records"])
    assert pending[-1]["round"] == ROUNDS  # (and an older one, when its evaluation was still running)
    assert "global_accuracy" not in pending[-1] and pending[-1]["train_loss"] > 0

    # the kill: the process died after the checkpoint of the last round, before its record
    lines = metrics.read_text().splitlines()
    lost = json.loads(lines[-1])
    assert lost["round"] == ROUNDS and "global_accuracy" in lost
    metrics.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])  # even a torn last line

    # resume: a fresh node restores the checkpoint and writes the record the file lacks
    fresh, fresh_ck = _node(tmp_path, metrics, background)
    asyncio.run(fresh.setup())
    _end_torn_line(metrics)
    assert fresh_ck.restore() == ROUNDS
    written = written_rounds(metrics, "n0", None, since=1)
    assert written == set(range(1, ROUNDS))
    assert fresh.recover_records(ROUNDS, fresh_ck.restored_pending, written) == [ROUNDS]
    records = [r for r in (json.loads(x) for x in metrics.read_text().splitlines() if x.startswith("{")
                           and x.endswith("}")) if r.get("node") == "n0"]
    rounds = [r["round"] for r in records]
    assert rounds == list(range(1, ROUNDS + 1))  # every round exactly once
    again = records[-1]
    assert again["written_at_resume"] is True
    # evaluated on the restored model: the model the lost record evaluated
    assert again["global_accuracy"] == lost["global_accuracy"]
    assert again["local_accuracy"] == lost["local_accuracy"]
    assert again["train_loss"] == lost["train_loss"]  # the round's own figures come from the checkpoint
    # nothing to write a second time
    assert fresh.recover_records(ROUNDS, fresh_ck.restored_pending, written_rounds(metrics, "n0", None, 1)) == []


def test_older_pending_records_lose_only_their_evaluation(tmp_path):
    """Records chained behind a long background evaluation: the checkpointed round's is
    evaluated, an older one is written without accuracy (``eval_skipped``), and rounds
    the file already has or that lie beyond the checkpoint are left alone."""
    metrics = tmp_path / "metrics.jsonl"
    node, _ = _node(tmp_path, metrics)
    node.rounds = 10
    asyncio.run(node.setup())
    pending = [{"node": "n0", "round": r, "train_loss": 1.0} for r in (3, 4, 5, 6)]
    assert node.recover_records(5, pending, {3}) == [4, 5]
    by_round = {r["round"]: r for r in _records(metrics)}
    assert sorted(by_round) == [4, 5]
    assert by_round[4]["eval_skipped"] is True and "global_accuracy" not in by_round[4]
    assert 0 <= by_round[5]["global_accuracy"] <= 1 and "eval_skipped" not in by_round[5]
    assert all(r["written_at_resume"] for r in by_round.values())


def test_written_rounds_reads_the_tail_of_this_node_and_run(tmp_path):
    path = tmp_path / "m.jsonl"
    recs = [{"node": "a", "round": r} for r in range(1, 200)] + [
        {"node": "b", "round": 500}, {"node": "a", "round": 300, "run": "r1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"node": "a", "rou')
    assert written_rounds(path, "a", None, since=190) == set(range(190, 200))
    assert written_rounds(path, "a", "r1", since=1) == {300}
    tail = written_rounds(path, "a", None, since=1, tail_bytes=200)  # only the newest lines are read
    assert tail and max(tail) == 199 and min(tail) > 150
    assert written_rounds(tmp_path / "missing.jsonl", "a", None, since=1) == set()
    _end_torn_line(path)
    assert path.read_text().endswith('"rou\n')
