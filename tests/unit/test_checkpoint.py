"""Crash-safe checkpoints: atomic files, fallback to the previous checkpoint on a
corrupt/partial one, and bit-identical restore of every algorithm's state."""

import json
import logging

import numpy as np
import pytest

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.data import load_dataset, node_data_for
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.training import TrainConfig
from dfl_agent.models import default_spec, spec_hash
from dfl_agent.runtime.node.checkpoint import CheckpointStore, NodeCheckpointer, state_digest
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.transport.memory import MemoryNetwork, run_virtual


def _arrays(seed=0):
    r = np.random.default_rng(seed)
    return {"model.w": r.standard_normal((3, 4)).astype(np.float32), "model.n": np.arange(3, dtype=np.int64)}


def test_save_load_roundtrip_and_keep_previous(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for t in (1, 2, 3):
        store.save(t, _arrays(t), {"alpha_n": 0.1 * t}, persistent={"ef/p/w": np.ones(2, np.float32)},
                   info={"node_id": "a"})
    assert store.rounds() == [3, 2]  # round 1 pruned
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "round-00000002.json", "round-00000002.safetensors", "round-00000003.json", "round-00000003.safetensors"]
    ck = store.load_latest()
    assert ck.round == 3 and ck.meta == {"alpha_n": pytest.approx(0.3)}
    for k, v in _arrays(3).items():
        assert ck.tensors[k].dtype == v.dtype and np.array_equal(ck.tensors[k], v)
    assert np.array_equal(ck.persistent["ef/p/w"], np.ones(2, np.float32))
    assert ck.manifest["state_digest"] == state_digest(_arrays(3), {"alpha_n": 0.1 * 3})


@pytest.mark.parametrize("damage", ["truncate_tensors", "flip_tensors", "delete_tensors", "bad_json",
                                    "empty_json", "wrong_format"])
def test_corrupt_or_partial_checkpoint_falls_back_to_previous(tmp_path, damage, caplog):
    store = CheckpointStore(tmp_path)
    store.save(1, _arrays(1), {"r": 1})
    store.save(2, _arrays(2), {"r": 2})
    j, st = tmp_path / "round-00000002.json", tmp_path / "round-00000002.safetensors"
    if damage == "truncate_tensors":
        st.write_bytes(st.read_bytes()[:40])
    elif damage == "flip_tensors":
        b = bytearray(st.read_bytes())
        b[-1] ^= 0xFF
        st.write_bytes(bytes(b))
    elif damage == "delete_tensors":
        st.unlink()
    elif damage == "bad_json":
        j.write_text(j.read_text()[:-10])
    elif damage == "empty_json":
        j.write_text("")
    else:
        doc = json.loads(j.read_text())
        doc["format"] = "something-else"
        j.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="dfl_agent.runtime.node.checkpoint"):
        ck = store.load_latest()
    assert ck is not None and ck.round == 1 and ck.meta == {"r": 1}
    assert np.array_equal(ck.tensors["model.w"], _arrays(1)["model.w"])
    assert "round 2 is unusable" in caplog.text


def test_interrupted_save_leaves_previous_readable(tmp_path):
    """A kill between the tensors and the manifest (or mid-write) leaves a stray file only."""
    store = CheckpointStore(tmp_path)
    store.save(4, _arrays(4), {"r": 4})
    (tmp_path / "round-00000005.safetensors").write_bytes(b"partial")  # manifest never written
    (tmp_path / ".round-00000005.json.tmp").write_bytes(b"{\"form")  # torn temporary
    assert store.load_latest().round == 4
    store.save(5, _arrays(5), {"r": 5})
    assert store.load_latest().round == 5
    assert not list(tmp_path.glob(".*.tmp"))


def test_no_checkpoint_is_none(tmp_path):
    assert CheckpointStore(tmp_path / "missing").load_latest() is None


# -- every algorithm's state survives a save/restore bit for bit -------------------------

OPTIONS = {
    "fedavg": {"round_timeout": 5.0},
    "local": {},
    "dfml": {"mutual_epochs": 1, "invite_timeout": 5.0, "update_timeout": 10.0, "token_timeout": 20.0},
    "dfedavg": {"invite_timeout": 5.0, "update_timeout": 10.0, "token_timeout": 20.0},
    "dechw": {"round_timeout": 5.0},
    "defkt": {},
}


# algorithms that need a particular model type (the rest use the small default model)
SPECS = {
    "fedd2s": {"type": "convdense", "input_shape": [1, 8, 8], "conv": [4, 8, 8], "dense": [8, 8], "num_classes": 10},
}


def _federation(name, n, bundle, spec, tmp_path):
    cls = get_algorithm(name)
    opts = parse_options(cls, OPTIONS.get(name, {}))
    net = MemoryNetwork()
    train = TrainConfig(epochs=1, batch_size=32, lr=0.05, momentum=0.9)
    nodes = []
    for i in range(n):
        nid = f"n{i}"
        data = node_data_for(bundle, 8, i, "iid", seed=0)  # 1/8 of the data each: fast
        ctx = RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f", {}),
                             peers=PeerTable(nid, "f"), data=data, model_spec=spec, train=train, init_seed=7,
                             rng=np.random.default_rng([0, i]), seed=0)
        nodes.append(Node(ctx, cls(ctx, opts), bundle.test.x[:50], bundle.test.y[:50], rounds=2))
    return nodes


def _all_algorithms():
    from dfl_agent.algorithms.base import available

    return available()


@pytest.mark.parametrize("name", _all_algorithms())  # every registered algorithm, new ones included
def test_algorithm_state_restores_bit_identical(tmp_path, name):
    bundle = load_dataset("digits")
    spec = SPECS.get(name) or default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small")
    nodes = _federation(name, 2, bundle, spec, tmp_path)
    saved = {}

    def attach(node):
        ck = NodeCheckpointer(CheckpointStore(tmp_path / node.ctx.node_id), node.algorithm, node.ctx,
                              spec_hash(spec))

        async def save(t):
            await ck.save_async(t)
            saved[node.ctx.node_id] = t
        node.hooks.checkpoint = save

    async def main():
        for nd in nodes:
            await nd.ctx.start()
            attach(nd)
        for nd in nodes:
            await nd.setup()
        import asyncio
        await asyncio.gather(*(nd.run(2) for nd in nodes))
        for nd in nodes:
            await nd.ctx.stop()

    run_virtual(main())
    node = nodes[0]
    node.ctx.persistent_state["ef/n1/w"] = np.full(3, 0.5, np.float32)  # the error-feedback hook
    ck = NodeCheckpointer(CheckpointStore(tmp_path / "n0"), node.algorithm, node.ctx, spec_hash(spec))
    run_virtual(ck.save_async(2))
    before_t, before_m = node.algorithm.state_dict()
    before_rng = node.ctx.rng.bit_generator.state

    # a fresh process: same config, new objects, restore from disk
    fresh = _federation(name, 2, bundle, spec, tmp_path)[0]
    run_virtual(fresh.setup())
    restorer = NodeCheckpointer(CheckpointStore(tmp_path / "n0"), fresh.algorithm, fresh.ctx, spec_hash(spec))
    assert restorer.restore() == 2
    after_t, after_m = fresh.algorithm.state_dict()
    assert sorted(after_t) == sorted(before_t) and len(after_t) > 0
    for k in before_t:
        assert after_t[k].dtype == before_t[k].dtype and np.array_equal(after_t[k], before_t[k]), k
    assert json.dumps(after_m, sort_keys=True) == json.dumps(before_m, sort_keys=True)
    assert restorer.restored_digest == state_digest(before_t, before_m)
    assert fresh.ctx.rng.bit_generator.state == before_rng
    assert np.array_equal(fresh.ctx.persistent_state["ef/n1/w"], np.full(3, 0.5, np.float32))
    assert {p.node_id for p in fresh.ctx.peers.all()} >= {"n1"}  # the directory came back
    assert fresh.ctx.peers.live_peers() == []  # ... but liveness comes from discovery


def test_checkpoint_of_another_model_is_skipped(tmp_path, caplog):
    bundle = load_dataset("digits")
    small = default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small")
    large = default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "large")
    a = _federation("local", 1, bundle, small, tmp_path)[0]
    run_virtual(a.setup())
    writer = NodeCheckpointer(CheckpointStore(tmp_path / "c"), a.algorithm, a.ctx)  # no model hash recorded
    run_virtual(writer.save_async(3))
    b = _federation("local", 1, bundle, large, tmp_path)[0]
    run_virtual(b.setup())
    with caplog.at_level(logging.WARNING):
        assert NodeCheckpointer(CheckpointStore(tmp_path / "c"), b.algorithm, b.ctx).restore() == 0
    assert "does not fit" in caplog.text
