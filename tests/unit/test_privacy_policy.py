"""What a device sends under differential privacy (dfl_agent.privacy.policy): the policy
table covers every registered algorithm, uncovered combinations are refused with one line,
and the status and announcement leave out the values DP does not protect."""

from __future__ import annotations

import pytest

from dfl_agent.algorithms.base import available, check_dp_combination, get_algorithm
from dfl_agent.privacy.policy import TREATMENTS, dp_enabled, redact_status

#: every registered algorithm's DP declaration (Traits.dp)
DP_SUPPORT = {name: get_algorithm(name).traits.dp for name in available()}


def test_every_registered_algorithm_declares_its_dp_support():
    missing = [name for name, support in DP_SUPPORT.items() if support is None]
    assert missing == [], "declare Traits(dp=...) on the algorithm's class"
    for support in DP_SUPPORT.values():
        assert all(t in TREATMENTS for t, _ in support.messages.values())


@pytest.mark.parametrize("algorithm", ["fedavg", "dfml", "gt", "local-steps", "dechetero", "cfa", "dfedavg",
                                       "fedper", "heterofl", "fedrolex", "dfedprox", "fullavg", "combo", "local",
                                       "local_adam"])
def test_covered_algorithms_pass(algorithm):
    check_dp_combination(algorithm, {})


@pytest.mark.parametrize(("algorithm", "options", "words"), [
    ("dechw", {}, "Hessian diagonals"),
    ("dechw", {"theta": 3}, "theta = 0"),
    ("defkt", {}, "transfer"),
    ("fedd2s", {}, "distillation"),
    ("my-new-algorithm", {}, "not in the privacy policy"),
])
def test_uncovered_combinations_are_refused_in_one_line(algorithm, options, words):
    with pytest.raises(ValueError) as err:
        check_dp_combination(algorithm, options)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"privacy.dp: algorithm {algorithm!r} cannot run under differential")
    assert words in msg


def test_dechw_without_hessians_is_covered_also_with_parsed_options():
    from dfl_agent.algorithms.base import get_algorithm, parse_options

    check_dp_combination("dechw", {"theta": 0})
    check_dp_combination("dechw", parse_options(get_algorithm("dechw"), {"theta": 0}))
    with pytest.raises(ValueError, match="Hessian"):
        check_dp_combination("dechw", parse_options(get_algorithm("dechw"), {}))


def test_redact_status_drops_accuracies_and_sample_counts_at_every_level():
    st = {"node_id": "a", "round": 3, "global_accuracy": 0.8, "local_accuracy": 0.9, "regular_global_accuracy": 0.7,
          "local_only_global_accuracy": 0.5, "global_accuracy_source": "local validation",
          "run": {"id": "r1", "state": "training", "accuracy": 0.9, "train_samples": 300},
          "run_history": {"r0": {"state": "recorded", "validation_samples": 66,
                                 "privacy": {"epsilon": 2.0, "state": "spent", "noise_multiplier": 1.1,
                                             "sample_rate": 0.1, "steps": 200, "delta": 1e-5}}},
          "privacy": {"dp": True, "epsilon_spent": 2.0, "epsilon_remaining": 8.0}, "bytes_sent": 10}
    out = redact_status(st)  # N (the training split's size) shows through the plan's q = batch/N, steps, sigma
    assert out == {"node_id": "a", "round": 3, "global_accuracy_source": "local validation",
                   "run": {"id": "r1", "state": "training"},
                   "run_history": {"r0": {"state": "recorded",
                                          "privacy": {"epsilon": 2.0, "state": "spent", "delta": 1e-5}}},
                   "privacy": {"dp": True, "epsilon_spent": 2.0, "epsilon_remaining": 8.0}, "bytes_sent": 10}
    assert st["global_accuracy"] == 0.8  # unchanged


def test_dp_enabled_reads_privacy_dp():
    import types

    from dfl_agent.privacy.config import DPConfig, DPSection, PrivacyConfig, PrivacySection

    assert not dp_enabled(types.SimpleNamespace())
    assert not dp_enabled(types.SimpleNamespace(privacy=PrivacyConfig(None)))
    assert dp_enabled(types.SimpleNamespace(privacy=PrivacyConfig(DPConfig(max_grad_norm=1.0, target_epsilon=8.0))))
    assert not dp_enabled(types.SimpleNamespace(privacy=PrivacySection()))
    assert not dp_enabled(types.SimpleNamespace(privacy=PrivacySection(dp=DPSection(enabled=False, max_grad_norm=1.0))))
    assert dp_enabled(types.SimpleNamespace(privacy=PrivacySection(dp=DPSection(max_grad_norm=1.0))))


# -- real nodes over the memory transport: what leaves the device under DP ---------------
def _federation(algorithm, dp, n=3, **options):
    import numpy as np

    from dfl_agent.algorithms.base import get_algorithm, parse_options
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.node.node import Node
    from dfl_agent.transport.memory import MemoryNetwork
    from tests.unit.toy import SPEC, toy_data

    net, cls = MemoryNetwork(), get_algorithm(algorithm)
    opts = parse_options(cls, options)
    test = toy_data(99)
    sent: list = []
    nodes = []
    for i in range(n):
        nid = f"n{i}"
        data = toy_data(i)
        data.train_x, data.train_y = data.train_x[:32 - 8 * i], data.train_y[:32 - 8 * i]  # 32, 24, 16 samples
        ctx = RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
                             data=data, model_spec=SPEC, init_seed=0,
                             train=TrainConfig(batch_size=8, lr=0.1, dp=dp), rng=np.random.default_rng(i))
        for name in ("send", "broadcast"):  # what leaves the node
            original = getattr(ctx, name)

            async def record(*args, _original=original, **kw):
                sent.append(next(a for a in args if hasattr(a, "meta")))
                return await _original(*args, **kw)

            setattr(ctx, name, record)
        nodes.append(Node(ctx, cls(ctx, opts), test.train_x, test.train_y))
    return nodes, sent


def _run(nodes, rounds=2):
    import asyncio

    from dfl_agent.transport.memory import run_virtual

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()
        await asyncio.gather(*(n.run(rounds) for n in nodes))

    run_virtual(main())


def _dp():
    pytest.importorskip("opacus")
    from dfl_agent.learning.dp import DPTraining

    return DPTraining(noise_multiplier=0.5, max_grad_norm=1.0, sample_rate=0.25)


@pytest.mark.parametrize("algorithm", ["fedavg", "dfedavg"])
def test_under_dp_models_carry_sample_count_1_and_the_status_no_accuracy(algorithm):
    nodes, sent = _federation(algorithm, _dp())
    _run(nodes)
    models = [m for m in sent if "samples" in m.meta]
    assert models and {m.meta["samples"] for m in models} == {1}  # uniform weights, not 32/24/16
    for n in nodes:
        assert "global_accuracy" in n.history[-1]  # evaluated on the device...
        st = n.status()  # ...but not sent
        assert not [k for k in st if k.endswith("accuracy")], st
        assert st["round"] == 2


def test_without_dp_nothing_changes():
    nodes, sent = _federation("fedavg", None)
    _run(nodes, rounds=1)
    assert {m.meta["samples"] for m in sent if "samples" in m.meta} == {32, 24, 16}
    assert all(isinstance(n.status()["global_accuracy"], float) for n in nodes)


def test_dfml_under_dp_uses_uniform_class_proportions():
    nodes, _ = _federation("dfml", _dp(), n=1)
    nodes[0].algorithm.ctx.data.train_y[:] = 0  # one class only: WSM would drop the other

    import asyncio

    asyncio.run(nodes[0].setup())
    assert list(nodes[0].algorithm.beta) == [0.5, 0.5]


def test_node_config_refuses_an_uncovered_algorithm_under_dp_in_one_line():
    from dfl_agent.runtime.shared.config import ConfigError, config_from_dict

    dp = {"dp": {"max_grad_norm": 1.0, "target_epsilon": 8.0}}
    with pytest.raises(ConfigError) as err:
        config_from_dict({"algorithm": {"name": "dechw"}, "privacy": dp})
    assert str(err.value).startswith("privacy.dp: algorithm 'dechw' cannot run under differential privacy: it sends "
                                     "Hessian diagonals") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="'fedd2s' cannot run under differential privacy"):  # DP from the profile
        config_from_dict({"algorithm": {"name": "fedd2s"}, "profile_overrides": {"privacy": dp}})
    config_from_dict({"algorithm": {"name": "dechw", "options": {"theta": 0}}, "privacy": dp})
    config_from_dict({"algorithm": {"name": "dechw"}})  # without DP: every algorithm


def test_announcement_of_a_dp_model_carries_no_accuracy(tmp_path):
    import numpy as np
    import torch

    from dfl_agent.deploy import ModelStore
    from dfl_agent.deploy.gate import announcement, deploy_model
    from dfl_agent.models import build_model, default_spec

    spec = default_spec((3, 16), 4, "small")
    torch.manual_seed(0)
    model = build_model(spec).eval()
    x = np.random.default_rng(0).normal(size=(30, 3, 16)).astype(np.float32)
    with torch.no_grad():
        y = model(torch.from_numpy(x)).argmax(1).numpy().astype(np.int64)
    plain, private = ModelStore(tmp_path / "plain"), ModelStore(tmp_path / "dp")
    deploy_model(plain, model, spec, (3, 16), list("abcd"), x, y, run_id="r", round=1, algorithm="fedavg", onnx=False)
    deploy_model(private, model, spec, (3, 16), list("abcd"), x, y, run_id="r", round=1, algorithm="fedavg",
                 onnx=False, privacy={"epsilon_run": 1.0, "epsilon_lifetime": 1.0, "delta": 1e-5})
    assert announcement(plain, "n1", "fed")["accuracy"] == 1.0  # the validation accuracy, without DP
    assert announcement(plain, "n1", "fed", private=True)["accuracy"] is None  # the node trains under DP now
    assert announcement(private, "n1", "fed")["accuracy"] is None  # a model trained under DP
    assert private.manifest(1)["accuracy"] == 1.0  # kept on the device


def test_the_privacy_page_lists_every_algorithm_of_the_policy():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "explanation" / "privacy.md").read_text()
    table = page[page.index("## What each algorithm sends under DP"):page.index("## How to choose")]
    for algorithm, support in DP_SUPPORT.items():
        assert f"`{algorithm}`" in table, algorithm
        if support.refused:
            assert f"| `{algorithm}` | all | **refused**" in table


def test_admission_declines_a_run_of_an_uncovered_algorithm_under_dp(tmp_path):
    import numpy as np

    from dfl_agent.profiles import get_profile
    from dfl_agent.runtime.service.privacy_budget import PrivacyBudget
    from dfl_agent.runtime.shared.config import config_from_dict
    from dfl_agent.runtime.shared.descriptor import RunDescriptor
    from dfl_agent.runtime.shared.sample_store import open_store

    cfg = config_from_dict({"state_dir": str(tmp_path), "algorithm": {"name": "local", "rounds": 2},
                            "training": {"batch_size": 20, "steps": 4},
                            "data": {"dataset": "store", "input_shape": [3, 4], "num_classes": 2},
                            "privacy": {"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}}})
    store = open_store(cfg)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.normal(size=(200, 3, 4)).astype(np.float32), y=rng.integers(0, 2, 200))
    store.ingest_file(tmp_path / "a.npz")
    budget = PrivacyBudget(cfg, get_profile("generic-x86"), store)
    reason = budget.admit(RunDescriptor(run_id="r1", federation="default", algorithm="fedd2s", rounds=2))
    assert reason and reason.startswith("privacy.dp: algorithm 'fedd2s' cannot run under differential privacy")
    assert budget.ledger.get("r1") is None  # nothing reserved
    assert budget.admit(RunDescriptor(run_id="r2", federation="default", algorithm="dechw", rounds=2,
                                      options={"theta": 0})) is None
