"""The warm start's linear probe (dfl_agent.learning.probe, training.warm_start_probe): before
round 1 a warm-started run fits the deployed model's output layer to the device's store on
the frozen features, and loads the fitted layer into every model the warm start loads."""

import numpy as np
import pytest

from dfl_agent.runtime.shared.config import ConfigError, config_from_dict
from tests.unit.test_warm_start import WARM, _deploy, _flat, _node, _other_weights, _same

torch = pytest.importorskip("torch")


def _head(model):
    from dfl_agent.learning.probe import output_layer

    return output_layer(model)[0]


@pytest.mark.parametrize("algorithm", sorted(WARM))
def test_a_warm_start_fits_the_output_layer_into_every_model_it_loads(tmp_path, algorithm):
    from dfl_agent.runtime.run.warm_start import warm_start

    node = _node(algorithm)
    algo = node.algorithm
    deployed = _flat(_other_weights(algo.deployable_model()))  # random weights: a high loss to fit down
    _deploy(tmp_path, _other_weights(algo.deployable_model()), node.ctx.model_spec, node)
    start = warm_start(algo, tmp_path, "deployed")
    probe = start["probe"]
    if "already predicts every class" in probe.get("skipped", ""):  # random weights predict them all, by chance
        pytest.skip("the random deployed model predicts every class")
    assert "skipped" not in probe and probe["loss_after"] < probe["loss_before"], probe
    assert probe["samples"] == len(node.ctx.data.train_y)
    head = _head(algo.deployable_model())
    assert probe["layer"] == head
    fitted = _flat(algo.deployable_model())
    assert not np.array_equal(fitted[f"{head}.weight"], deployed[f"{head}.weight"])  # the output layer moved
    assert _same({k: v for k, v in fitted.items() if not k.startswith(head + ".")},
                 {k: v for k, v in deployed.items() if not k.startswith(head + ".")})  # nothing else did
    for attr in WARM[algorithm]:
        assert _same(_flat(getattr(algo, attr)), fitted), attr
    if algorithm == "gt":
        assert _same(algo.reference, fitted)
    if algorithm == "fedd2s":
        assert _same(algo.current_global(), fitted)


def test_the_probe_lets_a_warm_start_predict_a_class_the_deployed_model_never_saw(tmp_path):
    """The deployed model learnt two of iris's three classes; the store now holds all three.
    Loaded as it is, it never predicts the third; with the probe, it does, and scores higher
    on the store before any training step."""
    from dfl_agent.learning.training import TrainConfig, train_local
    from dfl_agent.runtime.run.warm_start import warm_start

    node = _node("local")
    algo, d = node.algorithm, node.ctx.data
    old = d.train_y != 2
    trained = _other_weights(algo.model, seed=3)
    torch.manual_seed(0)
    for p in trained.parameters():
        torch.nn.init.normal_(p, std=0.1)
    train_local(trained, d.train_x[old], d.train_y[old], TrainConfig(epochs=60, lr=0.05), np.random.default_rng(0))
    _deploy(tmp_path, trained, node.ctx.model_spec, node)

    def predictions():
        with torch.no_grad():
            return algo.model(torch.from_numpy(d.train_x)).argmax(1).numpy()

    warm_start(algo, tmp_path, "deployed", probe=False)
    plain = predictions()
    assert not (plain == 2).any()  # the deployed model as it is: never the new class
    start = warm_start(algo, tmp_path, "deployed")
    probed = predictions()
    assert (probed[d.train_y == 2] == 2).mean() > 0.5, start
    assert (probed == d.train_y).mean() > (plain == d.train_y).mean() + 0.2


def test_the_probe_is_skipped_under_dp_without_the_ramp_and_when_turned_off(tmp_path):
    from dfl_agent.runtime.run.warm_start import RAMPLESS, warm_start

    node = _node("local")
    algo = node.algorithm
    deployed = _other_weights(algo.model)
    _deploy(tmp_path, deployed, node.ctx.model_spec, node)
    assert "probe" not in warm_start(algo, tmp_path, "deployed", probe=False)
    assert warm_start(algo, tmp_path, "deployed", ramp=0)["probe"] == {"skipped": RAMPLESS}  # it needs the ramp
    assert _same(_flat(algo.model), _flat(deployed))
    algo.private = lambda: True  # privacy.dp: the fit would use the data outside the accountant
    start = warm_start(algo, tmp_path, "deployed")
    assert start["probe"]["skipped"].startswith("privacy.dp"), start
    assert _same(_flat(algo.model), _flat(deployed))


def test_linear_probe_refuses_what_it_cannot_fit():
    from dfl_agent.learning.probe import linear_probe

    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    y = np.arange(40) % 3
    squashed = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())  # logits are not the layer's output
    assert linear_probe(squashed, x, y).record == {"skipped": "the model's output is not its last linear layer's"}
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        plain[2].bias[2] = -100.0  # it never predicts class 2
    before = _flat(plain)
    assert linear_probe(plain, x, np.zeros(40, dtype=np.int64)).record["skipped"] == \
        "the data hold fewer than two classes"
    assert "class indices" in linear_probe(plain, x, y.astype(np.float32)).record["skipped"]
    assert "class indices" in linear_probe(plain, x, y + 1).record["skipped"]  # label 3 of 3 classes
    result = linear_probe(plain, x, y)
    assert set(result.state) == {"2.weight", "2.bias"} and result.record["layer"] == "2"
    assert result.record["unlearned"] == [2] and result.record["loss_after"] < result.record["loss_before"]
    assert result.state["2.weight"].shape == (3, 8) and result.state["2.bias"].shape == (3,)
    assert _same(_flat(plain), before)  # the model itself is left as it was
    plain.load_state_dict({k: torch.from_numpy(v) for k, v in result.state.items()}, strict=False)
    with torch.no_grad():
        assert set(plain(torch.from_numpy(x)).argmax(1).tolist()) == {0, 1, 2}
    # a model that predicts every class of the data keeps its output layer, unless always
    assert linear_probe(plain, x, y).record == {"skipped": "the model already predicts every class of the data"}
    assert linear_probe(plain, x, y, always=True).state
    # features a thousand times larger: the fit still descends (at the step of 1/L, which cannot diverge)
    big = linear_probe(plain, x * 1000, y, always=True).record
    assert np.isfinite(big["loss_after"]) and big["loss_after"] < big["loss_before"], big


def test_warm_start_probe_config():
    base = {"federation": "f", "algorithm": {"name": "local", "rounds": 1}}
    assert config_from_dict(base).training.warm_start_probe is True
    assert config_from_dict({**base, "training": {"warm_start_probe": False}}).training.warm_start_probe is False
    with pytest.raises(ConfigError, match="training.warm_start_probe"):
        config_from_dict({**base, "training": {"warm_start_probe": "yes"}})


def test_a_failing_fit_never_fails_the_run_and_a_large_store_is_sampled(tmp_path, monkeypatch, caplog):
    from dfl_agent.learning import probe
    from dfl_agent.runtime.run.warm_start import warm_start

    node = _node("local")
    algo = node.algorithm
    deployed = _other_weights(algo.model)
    _deploy(tmp_path, deployed, node.ctx.model_spec, node)

    def broken(*a, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(probe, "linear_probe", broken)
    with caplog.at_level("WARNING", logger="dfl_agent.daemon"):
        start = warm_start(algo, tmp_path, "deployed")
    assert start["started_from"] is not None and start["probe"] == {"skipped": "the fit failed: RuntimeError: out of memory"}
    assert _same(_flat(algo.model), _flat(deployed)) and "the output layer was not fitted" in caplog.text
    monkeypatch.undo()
    monkeypatch.setattr(probe, "MAX_SAMPLES", 50)
    assert warm_start(algo, tmp_path, "deployed")["probe"]["samples"] == 50 < len(node.ctx.data.train_y)
