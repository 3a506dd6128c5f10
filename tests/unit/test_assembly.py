"""Node assembly (dfl_agent.runtime.shared.assembly): one model-spec rule for the daemon and the
simulator, a RuntimeContext complete at construction, and the simulator's kill hook."""

import numpy as np
import pytest

pytest.importorskip("torch")

from dfl_agent.discovery.peers import PeerTable  # noqa: E402
from dfl_agent.learning.training import TrainConfig  # noqa: E402
from dfl_agent.models.families import family_member, family_specs  # noqa: E402
from dfl_agent.runtime.node.context import RuntimeContext  # noqa: E402
from dfl_agent.runtime.shared.assembly import (  # noqa: E402
    algorithm_default_spec,
    choose_model_specs,
    model_spec_for,
    simulator_default_specs,
)
from dfl_agent.runtime.shared.config import config_from_dict  # noqa: E402
from dfl_agent.transport.memory import MemoryNetwork  # noqa: E402
from tests.unit.toy import SPEC, toy_data  # noqa: E402

SHAPE, CLASSES = (3, 128), 6


def _ctx(**kw):
    net = MemoryNetwork()
    return RuntimeContext(node_id="a", federation="f", transport=net.transport("a", "f"), peers=PeerTable("a", "f"),
                          data=toy_data(0), model_spec=SPEC, train=TrainConfig(batch_size=8), init_seed=0,
                          rng=np.random.default_rng(0), **kw)


def test_context_is_complete_at_construction():
    ctx = _ctx(gate_poll=2.0, final_round=7, max_catch_up_rounds=3, pause_when_disconnected=True,
               persistent_state={"k": np.zeros(2)})
    assert (ctx.gate_poll, ctx.final_round, ctx.max_catch_up_rounds, ctx.pause_when_disconnected) == (2.0, 7, 3, True)
    assert list(ctx.persistent_state) == ["k"] and not ctx.catch_up
    ctx.enable_catch_up()
    assert ctx.catch_up
    ctx.gate_poll = 1.0  # a declared setting may still change
    with pytest.raises(AttributeError, match="gate_pol"):
        ctx.gate_pol = 1.0  # a typo never adds a setting nobody reads


def test_one_spec_rule_for_both_worlds():
    # the simulator without profiles: width-scaled algorithms spread H1, the others their default
    assert choose_model_specs("heterofl", SHAPE, CLASSES, 4) == simulator_default_specs("heterofl", SHAPE, CLASSES, 4)
    assert choose_model_specs("fedd2s", SHAPE, CLASSES, 2, size="small") == [
        algorithm_default_spec("fedd2s", SHAPE, CLASSES, "small")] * 2
    # nodes whose tier is known (profiles, a device) get their tier's default
    assert choose_model_specs("heterofl", SHAPE, CLASSES, 2, tiers=["large", None], size="small") == [
        algorithm_default_spec("heterofl", SHAPE, CLASSES, "large"),
        algorithm_default_spec("heterofl", SHAPE, CLASSES, "small")]
    # a family: spread over the nodes, or the member of a device's tier
    h2 = family_specs("H2", SHAPE, CLASSES)
    assert choose_model_specs("dfml", SHAPE, CLASSES, 6, family="H2") == [h2[i % len(h2)] for i in range(6)]
    assert choose_model_specs("dfml", SHAPE, CLASSES, 1, family="H2", family_tier="small") == [
        family_member("H2", SHAPE, CLASSES, "small")]
    # the family comes before per-node specs, which come before one spec
    assert choose_model_specs("fedavg", SHAPE, CLASSES, 2, family="H0", spec=SPEC) == family_specs("H0", SHAPE, CLASSES) * 2
    assert choose_model_specs("fedavg", SHAPE, CLASSES, 2, specs=[SPEC], spec=None)[1]["type"] == SPEC["type"]
    # a device: model_spec_for is the same rule for one node
    cfg = config_from_dict({"model": {"family": "H2"}})
    assert model_spec_for(cfg, "dfml", SHAPE, CLASSES, profile_size="large") == h2[0]
    assert model_spec_for(config_from_dict({}), "heterofl", SHAPE, CLASSES, tier="small") == \
        algorithm_default_spec("heterofl", SHAPE, CLASSES, "small")


def test_simulator_kill_hook_ends_the_node_before_its_round():
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    s = simulate(SimConfig(nodes=3, rounds=3, dataset="iris", partition="iid", kill={1: 2}, model_size="small",
                           train=TrainConfig(batch_size=16)))
    assert s["rounds_per_node"]["node01"] == 1  # crashed as round 2 started
    assert s["rounds_per_node"]["node00"] == s["rounds_per_node"]["node02"] == 3


def test_kill_also_ends_a_rotating_aggregator_node():
    """DFML's rounds run in the rotating-aggregator protocol, not through ``round()``: the
    simulator's kill (once a patch of ``round``) used to leave such a node running."""
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    s = simulate(SimConfig(algorithm="dfml", nodes=3, rounds=4, dataset="iris", partition="iid", kill={1: 2},
                           model_size="small", train=TrainConfig(batch_size=16)))
    assert s["rounds_per_node"] == {"node00": 4, "node01": 1, "node02": 4}
