"""Warm start (dfl_agent.runtime.run.warm_start): a run starts from the device's deployed model
when its architecture matches, fresh otherwise (saying why), as the descriptor's ``init`` or
``runtime.run_init`` says; the start is recorded in the run's records and the manifest."""

import asyncio
import copy
import types

import numpy as np
import pytest

from dfl_agent.runtime.shared.config import ConfigError, config_from_dict
from dfl_agent.runtime.shared.descriptor import RunDescriptor
from dfl_agent.runtime.shared.run_config import run_config_for

torch = pytest.importorskip("torch")


def _flat(model):
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def _same(a, b):
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _node(algorithm, **kw):
    """One node of a two-node simulated federation (iris), set up: its models exist, round 1 not run."""
    from dfl_agent.runtime.node.simulator import SimConfig, _assemble

    kw.setdefault("dataset", "digits" if algorithm == "fedd2s" else "iris")  # fedd2s: a layered conv model
    kw.setdefault("model_size", "small")
    fed = _assemble(SimConfig(algorithm=algorithm, nodes=2, rounds=2, partition="iid", **kw),
                    "cpu", lambda r: None)
    node = fed.nodes[0]
    asyncio.run(node.algorithm.setup())
    return node


def _deploy(state_dir, model, spec, node, run_id="r0", started_from=None):
    """Install ``model`` as the device's deployed version (the real gate and model store)."""
    from dfl_agent.deploy import ModelStore
    from dfl_agent.deploy.gate import deploy_model

    d = node.ctx.data
    res = deploy_model(ModelStore(state_dir), model, spec, d.train_x.shape[1:], [str(c) for c in range(d.num_classes)],
                       d.val_x, d.val_y, run_id=run_id, round=1, algorithm="x", tolerance=1.0, onnx=False,
                       started_from=started_from, min_validation=0)
    assert res["deployed"]
    return res["version"]


def _other_weights(model, seed=7):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


#: algorithm -> the models (attribute names) that must hold the deployed weights after a warm start
WARM = {"local": ["model"], "fedavg": ["model"], "dfedavg": ["model"], "defkt": ["model"],
        "gt": ["model"], "dfml": ["peak", "regular"], "fedd2s": ["personal"]}


@pytest.mark.parametrize("algorithm", sorted(WARM))
def test_warm_start_loads_exactly_the_deployed_weights_and_fresh_does_not(tmp_path, algorithm):
    from dfl_agent.runtime.run.warm_start import warm_start

    node = _node(algorithm)
    algo = node.algorithm
    deployed = _other_weights(algo.deployable_model())
    v = _deploy(tmp_path, deployed, node.ctx.model_spec, node)
    before = _flat(algo.deployable_model())
    start = warm_start(algo, tmp_path, "fresh")
    assert start == {"init": "fresh", "started_from": None, "reason": "init = fresh"}
    assert _same(_flat(algo.deployable_model()), before)  # fresh: the run's own initial weights
    start = warm_start(algo, tmp_path, "deployed", probe=False)
    assert start == {"init": "deployed", "started_from": v, "reason": ""}
    for attr in WARM[algorithm]:
        assert _same(_flat(getattr(algo, attr)), _flat(deployed)), attr
    if algorithm == "gt":  # the thresholds' reference M_R is the warm-started model
        assert _same(algo.reference, _flat(deployed))
    if algorithm == "fedd2s":  # the initial global model of the rotation, too
        assert _same(algo.current_global(), _flat(deployed))


def test_fedavg_rotation_warm_starts_its_global_base(tmp_path):
    """FedPer in FedAvg mode (head_layers 0) deploys the global model: the rotation's initial
    global model is the deployed one."""
    from dfl_agent.runtime.run.warm_start import warm_start

    node = _node("fedper", options={"head_layers": 0})
    algo = node.algorithm
    deployed = _other_weights(algo.model)
    v = _deploy(tmp_path, deployed, node.ctx.model_spec, node)
    assert warm_start(algo, tmp_path, "deployed", probe=False)["started_from"] == v
    assert _same(_flat(algo.deployable_model()), _flat(deployed)) and _same(_flat(algo.model), _flat(deployed))


def test_another_architecture_starts_fresh_with_the_reason(tmp_path, caplog):
    from dfl_agent.models import build_model
    from dfl_agent.runtime.run.warm_start import warm_start

    node = _node("local")
    algo = node.algorithm
    spec = copy.deepcopy(node.ctx.model_spec)
    other = _node("local", model_size="large").ctx.model_spec  # another width / depth
    assert other != spec
    v = _deploy(tmp_path, build_model(other), other, node)
    before = _flat(algo.model)
    with caplog.at_level("INFO", logger="dfl_agent.daemon"):
        start = warm_start(algo, tmp_path, "deployed")
    assert start["started_from"] is None and start["init"] == "deployed"
    assert f"v{v} has another architecture" in start["reason"], start
    assert _same(_flat(algo.model), before)  # nothing loaded
    assert "starts from fresh weights" in caplog.text and "another architecture" in caplog.text


def test_nothing_deployed_or_a_corrupt_version_starts_fresh(tmp_path):
    from dfl_agent.deploy import ModelStore
    from dfl_agent.runtime.run.warm_start import warm_start

    node = _node("local")
    assert warm_start(node.algorithm, tmp_path, "deployed")["reason"] == "no model is deployed on this device yet"
    v = _deploy(tmp_path, _other_weights(node.algorithm.model), node.ctx.model_spec, node)
    (ModelStore(tmp_path).folder(v) / "model.safetensors").write_bytes(b"broken")
    start = warm_start(node.algorithm, tmp_path, "deployed")
    assert start["started_from"] is None and "cannot be read" in start["reason"]


def test_a_deployed_file_that_is_not_safetensors_starts_fresh(tmp_path):
    # found by CI (test_supervisor): a version installed with a valid manifest and checksums but a
    # model.safetensors that is no safetensors file raised SafetensorError (no OSError or
    # ValueError) out of the run's set-up: the run process crashed three times and the run failed
    from dfl_agent.deploy import ModelStore
    from dfl_agent.runtime.run.warm_start import warm_start

    node = _node("local")
    ModelStore(tmp_path).install({"spec.json": b"{}", "model.safetensors": b"x"}, {"run_id": "earlier", "round": 1})
    start = warm_start(node.algorithm, tmp_path, "deployed")
    assert start["started_from"] is None and "SafetensorError" in start["reason"]


def test_a_resumed_run_reports_the_start_it_saved(tmp_path):
    from dfl_agent.runtime.run.warm_start import begin_run

    node = _node("local")
    v = _deploy(tmp_path / "state", _other_weights(node.algorithm.model), node.ctx.model_spec, node)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = begin_run(node.algorithm, tmp_path / "state", run_dir, "deployed", resumed=False)
    assert first["started_from"] == v
    algo = types.SimpleNamespace(warm_start=lambda s: pytest.fail("a resumed run restores its checkpoint"))
    assert begin_run(algo, tmp_path / "state", run_dir, "deployed", resumed=True) == first


def test_run_init_default_descriptor_init_and_validation():
    base = {"federation": "f", "algorithm": {"name": "local", "rounds": 1}}
    assert config_from_dict(base).runtime.run_init == "deployed"
    assert config_from_dict({**base, "runtime": {"run_init": "fresh"}}).runtime.run_init == "fresh"
    with pytest.raises(ConfigError, match="runtime.run_init"):
        config_from_dict({**base, "runtime": {"run_init": "warm"}})
    raw = {"run_id": "r1", "federation": "f", "algorithm": "local", "rounds": 1}
    assert RunDescriptor.from_dict(raw).init is None  # descriptors from before the field
    with pytest.raises(ValueError, match="init must be 'deployed' or 'fresh'"):
        RunDescriptor.from_dict({**raw, "init": "warm"})
    cfg = config_from_dict(base)
    assert run_config_for(cfg, RunDescriptor.from_dict(raw)).runtime.run_init == "deployed"  # the node's default
    assert run_config_for(cfg, RunDescriptor.from_dict({**raw, "init": "fresh"})).runtime.run_init == "fresh"
    fresh_node = config_from_dict({**base, "runtime": {"run_init": "fresh"}})
    assert run_config_for(fresh_node, RunDescriptor.from_dict(raw)).runtime.run_init == "fresh"
    assert run_config_for(fresh_node, RunDescriptor.from_dict({**raw, "init": "deployed"})).runtime.run_init == \
        "deployed"


def test_demo_feed_summary_and_table_name_the_start(tmp_path):
    import json

    from rich.console import Console

    from dfl_agent.cli.demo_feed import collect, final_table

    node = _node("local")
    state = tmp_path / "n1"
    for k, (rid, start) in enumerate((("r1", None), ("r2", 1)), 1):
        assert _deploy(state, _other_weights(node.algorithm.model, k), node.ctx.model_spec, node, rid, start) == k
        (state / "runs" / rid).mkdir(parents=True)
        (state / "runs" / rid / "metrics.jsonl").write_text(json.dumps(
            {"round": 1, "global_accuracy": 0.5 + k / 10, "init": "deployed", "started_from": start}) + "\n")
    summary = collect({"n1": state}, ["r1", "r2"])
    runs = summary["nodes"]["n1"]["runs"]
    assert [(r["deployed_version"], r["started_from"], r["first_round_accuracy"]) for r in runs] == [
        (1, None, 0.6), (2, 1, 0.7)]
    console = Console(record=True, width=200)
    console.print(final_table({**summary, "runs": ["r1", "r2"]}))
    assert console.export_text().count("started from v1") == 1


def _dist(a, b):
    return float(np.sqrt(sum(np.sum((a[k] - b[k]) ** 2) for k in a if np.issubdtype(a[k].dtype, np.floating))))


@pytest.mark.parametrize("compression", ["none", "q4+zstd"])
def test_a_cold_member_adopts_its_warm_neighbours_and_they_leave_it_out(compression):
    """A run meant to start from the deployed models, with one member that has none (a device
    added to the fleet): its random weights would pull its warm neighbours' first average a
    third of the way to a random model.  Instead the warm nodes leave its first model out
    (``cold_excluded``) and it adopts their mean (``cold_start = adopted``); round 1 is not
    alone for anyone.  With CHOCO gossip the copies stay exact: the cold node's next message
    is a keyframe."""
    from dfl_agent.runtime.node.node import round_alone
    from dfl_agent.runtime.node.simulator import SimConfig, _assemble
    from dfl_agent.transport.memory import run_virtual

    fed = _assemble(SimConfig(algorithm="fedavg", nodes=3, rounds=2, partition="iid", dataset="iris",
                              model_size="small", compression=compression), "cpu", lambda r: None)
    nodes = fed.nodes
    out = {}

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.algorithm.setup()
        warm = copy.deepcopy(nodes[0].algorithm.model)  # the deployed model of the warm nodes
        nodes[1].algorithm.model.load_state_dict(warm.state_dict())
        nodes[2].algorithm.model.load_state_dict(_other_weights(warm, seed=3).state_dict())  # fresh weights
        nodes[2].algorithm.join_cold()  # what warm_start does when nothing deployed fits
        out["warm"], out["cold0"] = _flat(warm), _flat(nodes[2].algorithm.model)
        out["info"] = await asyncio.gather(*(n.algorithm.round(1) for n in nodes))

    run_virtual(main())
    info = out["info"]
    cold_id = nodes[2].ctx.node_id
    for i in (0, 1):
        assert info[i].get("cold_excluded") == [cold_id] and cold_id not in info[i]["neighbour_ids"]
        assert not round_alone(info[i], [nodes[1 - i].ctx.node_id, cold_id])
    assert info[2]["cold_start"] == "adopted" and info[2]["neighbour_ids"] == sorted(n.ctx.node_id for n in nodes[:2])
    models = [_flat(n.algorithm.model) for n in nodes]
    # every model is now near the warm one (one local epoch away), none near the cold start
    start_gap = _dist(out["warm"], out["cold0"])
    for m in models:
        assert _dist(m, out["warm"]) < 0.1 * start_gap
    assert not nodes[2].algorithm.joins_cold  # once: round 2 aggregates as usual
    if compression != "none":
        assert nodes[2].algorithm.choco.own is None  # its next message is a keyframe of the adopted model


def test_the_learning_rate_ramp_of_a_warm_start():
    """A run that started from a deployed model ramps its learning rates up from a tenth over
    ``training.warm_start_ramp`` rounds; a fresh start, or a ramp of 0, runs at the full rate."""
    from dfl_agent.learning.training import DEFAULT_ADAM_LR, TrainConfig, adam_lr, ramped
    from dfl_agent.runtime.run.warm_start import ramp_factor

    warm, fresh = {"started_from": 3}, {"started_from": None}
    assert [round(ramp_factor(warm, 5, t), 2) for t in range(1, 8)] == [0.1, 0.28, 0.46, 0.64, 0.82, 1.0, 1.0]
    assert ramp_factor(fresh, 5, 1) == ramp_factor(warm, 0, 1) == 1.0
    base = TrainConfig(lr=0.05)
    r = ramped(base, 0.1)
    assert r.lr == pytest.approx(0.005) and r.lr_scale == 0.1 and ramped(base, 1.0) is base
    assert adam_lr(None, r) == pytest.approx(DEFAULT_ADAM_LR * 0.1) and adam_lr(0.02, r) == pytest.approx(0.002)
    assert adam_lr(None, ramped(TrainConfig(lr=0.03, lr_is_set=True), 0.5)) == pytest.approx(0.015)
    with pytest.raises(ValueError, match="lr_scale"):
        TrainConfig(lr_scale=0.0)
    cfg = {"federation": "f", "algorithm": {"name": "local", "rounds": 1}}
    assert config_from_dict(cfg).training.warm_start_ramp == 5
    with pytest.raises(ConfigError, match="training.warm_start_ramp"):
        config_from_dict({**cfg, "training": {"warm_start_ramp": -1}})


@pytest.mark.parametrize("algorithm", ["gt", "defkt"])
def test_the_ramp_reaches_the_rates_algorithms_derive(algorithm):
    """GT's accumulated-gradient η and Def-KT's sender training follow ``ctx.train`` every
    round (a copy taken at set-up would miss the ramp)."""
    from dfl_agent.learning.training import ramped

    node = _node(algorithm)
    full = node.ctx.train.lr
    node.ctx.train = ramped(node.ctx.train, 0.1)
    got = node.algorithm.lr if algorithm == "gt" else node.algorithm.sender_train.lr
    assert got == pytest.approx(full * 0.1)


@pytest.mark.parametrize("ramp", [0, 5])
def test_a_warm_started_node_takes_small_steps_first(ramp):
    """Round 1 of a warm-started run moves the model about a tenth as far as the full rate
    would, and its record says ``lr_scale``; the ramp ends at the full rate (round 6)."""
    from dfl_agent.transport.memory import run_virtual

    moved, records = {}, {}
    for start in ({"init": "deployed", "started_from": 1, "reason": ""}, {"init": "fresh", "started_from": None}):
        node = _node("local")
        node.lr_ramp = ramp
        node.start_from(start)
        before = _flat(node.algorithm.model)
        trained = []

        async def hook(t, info, node=node, trained=trained):
            trained.append((node.ctx.train.lr, _flat(node.algorithm.model)))

        async def main(node=node):
            await node.ctx.start()
            node.ctx.round_hook, original = None, node.ctx.round_hook

            async def both(t, info):
                await hook(t, info)
                await original(t, info)
            node.ctx.round_hook = both
            await node.run(6)

        run_virtual(main())
        key = start["started_from"] is not None
        moved[key] = _dist(trained[0][1], before)
        records[key] = [(h.get("lr_scale"), lr) for h, (lr, _) in zip(node.history, trained)]
    full = records[False][0][1]
    assert [s for s, _ in records[False]] == [None] * 6  # a fresh start: no ramp
    if ramp == 0:
        assert records[True] == records[False] and moved[True] == pytest.approx(moved[False])
        return
    assert [s for s, _ in records[True]] == [0.1, 0.28, 0.46, 0.64, 0.82, None]
    assert records[True][0][1] == pytest.approx(full * 0.1) and records[True][5][1] == pytest.approx(full)
    assert moved[True] < 0.3 * moved[False]
