"""Local training that blows up without leaving a non-finite value (``training.divergence_factor``).

In the field lab, a device's loss went from below 1 to 10^1-10^3 within a round, its model
broke (finite), and the plain mean passed it on to every neighbour.  Local training now
stops such a round, undoes it and counts it ``diverged``, so the device re-joins from its
neighbours and sends nothing broken.  Each test fails with the check off (factor 0)."""

from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np
import pytest
import torch

from bench.blow_up.sim import wild_in_round
from dfl_agent.learning.training import TrainConfig, evaluate, train_local
from dfl_agent.runtime.node.batching import train_group
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16).astype(np.float32), y.astype(np.int64)


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_a_round_whose_loss_blows_up_is_stopped_and_undone():
    """At a learning rate of 5 the loss leaves its first batch's value far behind but stays
    finite: with the check the round stops there and the model is as before; without it the
    model ends broken (chance accuracy) and nothing says so."""
    x, y = _digits()
    model = _mlp()
    before = _state(model)
    out = train_local(model, x, y, TrainConfig(epochs=3, lr=5.0, divergence_factor=10.0),
                    np.random.default_rng(0))
    assert out["diverged"] == 1.0 and out["exploded"] > 10 * np.log(10), out
    assert out["samples"] < len(x)  # it stopped within the first epoch
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    off = _mlp()
    out = train_local(off, x, y, TrainConfig(epochs=3, lr=5.0, divergence_factor=0.0), np.random.default_rng(0))
    assert out["diverged"] == 0.0 and np.isfinite(out["loss"])
    assert evaluate(off, x, y)["accuracy"] < 0.2


@pytest.mark.parametrize("seed", range(3))
def test_sound_training_is_never_stopped(seed):
    x, y = _digits()
    out = train_local(_mlp(seed), x, y, TrainConfig(epochs=3, divergence_factor=10.0),
                      np.random.default_rng(seed))
    assert out["diverged"] == 0.0 and "exploded" not in out


def test_batched_training_stops_the_same_member_at_the_same_batch():
    """The simulator's vectorised training (``train_group``) applies the same check: a
    member that blows up keeps its old parameters and reports what ``train_local`` does."""
    from dfl_agent.learning.training import round_batches

    x, y = _digits()
    cfg = TrainConfig(epochs=2, lr=5.0, divergence_factor=10.0)
    models = [_mlp(0), _mlp(1)]
    befores = [_state(m) for m in models]
    alone = [copy.deepcopy(m) for m in models]
    got = train_group([(m, x, y, round_batches(len(x), cfg, np.random.default_rng(i))) for i, m in enumerate(models)],
                      cfg)
    want = [train_local(m, x, y, cfg, np.random.default_rng(i)) for i, m in enumerate(alone)]
    assert [g["diverged"] for g in got] == [w["diverged"] for w in want] == [1.0, 0.0]  # one blew up, one did not
    for g, w in zip(got, want):
        assert g["samples"] == w["samples"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-3)
    assert got[0]["exploded"] == pytest.approx(want[0]["exploded"], rel=1e-3) and "exploded" not in got[1]
    assert all(torch.equal(befores[0][k], v) for k, v in models[0].state_dict().items())  # kept its old parameters
    assert not all(torch.equal(befores[1][k], v) for k, v in models[1].state_dict().items())  # trained on
    off = dataclasses.replace(cfg, divergence_factor=0.0)
    got = train_group([(_mlp(0), x, y, round_batches(len(x), off, np.random.default_rng(0)))], off)
    assert got[0]["diverged"] == 0.0 and "exploded" not in got[0]


def _wild_federation(factor: float) -> dict[str, list[dict]]:
    """Four fedavg nodes under ``quorum`` with the default compression and the plain mean;
    node00's local training of round 4 runs at a learning rate of 5 (its loss goes from
    about 2 to 10^1-10^2, finite).  Each node's round records, in round order."""
    from dfl_agent.runtime.node.simulator import SimConfig, round_records

    cfg = SimConfig(algorithm="fedavg", nodes=4, rounds=12, dataset="digits", partition="iid", model_size="small",
                    straggler="quorum", train=TrainConfig(epochs=1, lr=0.05, divergence_factor=factor))
    return round_records(cfg, lambda fed: wild_in_round(fed.nodes[0].algorithm, 4))


def test_the_plain_mean_no_longer_passes_a_blown_up_model_on(caplog):
    """With the check (the default), node00's wild round is undone, it re-joins from its
    neighbours (``cold_start: "diverged"``) and they leave its update out; every node learns
    on.  Without it, the plain mean spreads node00's broken model to every node."""
    with caplog.at_level(logging.WARNING):
        on = _wild_federation(10.0)
    others = ["node01", "node02", "node03"]
    assert [r["round"] for r in on["node00"] if r.get("cold_start") == "diverged"] == [4]
    assert all(on[n][3].get("cold_excluded") == ["node00"] for n in others), [on[n][3] for n in others]
    assert min(on[n][-1]["global_accuracy"] for n in on) > 0.75, {n: on[n][-1]["global_accuracy"] for n in on}
    assert [on[n][-1]["diverged"] for n in others] == [0, 0, 0]
    assert any("local training step blew up (a mini-batch loss of" in r.getMessage() for r in caplog.records)
    off = _wild_federation(0.0)
    assert max(off[n][-1]["global_accuracy"] for n in off) < 0.3


def test_divergence_factor_config():
    base = {"federation": "f", "algorithm": {"name": "local", "rounds": 1}}
    assert config_from_dict(base).training.divergence_factor == 10.0
    assert config_from_dict({**base, "training": {"divergence_factor": 0}}).training.divergence_factor == 0
    for bad in (0.5, 1, -2):
        with pytest.raises(ConfigError, match="training.divergence_factor"):
            config_from_dict({**base, "training": {"divergence_factor": bad}})
    with pytest.raises(ValueError, match="divergence_factor"):
        TrainConfig(divergence_factor=1.0)
    assert TrainConfig().divergence_factor == 0  # the simulator and the benchmarks train as the papers do


def test_a_last_step_that_blows_the_model_up_is_caught():
    """One SGD step a round (CHOCO-SGD's setting): the only batch sets the limit, and the
    step that breaks the model is the last.  The last batch's loss after it exceeds the
    limit, so the round is undone, per node and in the simulator's batched training."""
    from dfl_agent.learning.training import round_batches

    x, y = _digits()
    cfg = TrainConfig(steps=1, lr=50.0, divergence_factor=10.0)
    for run in (lambda m: train_local(m, x, y, cfg, np.random.default_rng(0)),
                lambda m: train_group([(m, x, y, round_batches(len(x), cfg, np.random.default_rng(0)))], cfg)[0]):
        model = _mlp()
        before = _state(model)
        out = run(model)
        assert out["diverged"] == 1.0 and out["exploded"] > 10 * np.log(10) and out["samples"] == 32, out
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_dflctl_simulate_trains_as_the_papers_unless_asked(monkeypatch):
    import dfl_agent.cli.progress as progress
    from dfl_agent.cli.dflctl import main

    seen = []

    class Stop(Exception):
        pass

    def capture(cfg, enabled):
        seen.append(cfg.train.divergence_factor)
        raise Stop

    monkeypatch.setattr(progress, "simulate_with_progress", capture)
    for args, want in (([], 0.0), (["--divergence-factor", "10"], 10.0)):
        with pytest.raises(Stop):
            main(["simulate", "--dataset", "digits", *args])
        assert seen[-1] == want


def test_the_check_changes_nothing_in_a_sound_round():
    """A round the check does not stop ends exactly as without the check: the extra pass over
    the last batch leaves batch-norm statistics as they were."""
    x, y = _digits()
    models = []
    for factor in (10.0, 0.0):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
        out = train_local(m, x, y, TrainConfig(epochs=1, divergence_factor=factor), np.random.default_rng(0))
        assert out["diverged"] == 0.0
        models.append(m.state_dict())
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
