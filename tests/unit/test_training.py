"""The local training loop: epochs vs a fixed number of steps per round."""

import numpy as np
import pytest
import torch

from dfl_agent.learning.training import TrainConfig, round_batches, train_local


def test_round_batches_epochs_and_steps():
    rng = np.random.default_rng(0)
    epochs = round_batches(10, TrainConfig(epochs=2, batch_size=4), rng)
    assert [len(b) for b in epochs] == [4, 4, 2, 4, 4, 2]
    assert sorted(np.concatenate(epochs[:3]).tolist()) == list(range(10))
    steps = round_batches(10, TrainConfig(steps=5, batch_size=4, epochs=3), rng)  # steps override epochs
    assert [len(b) for b in steps] == [4, 4, 2, 4, 4]
    one = round_batches(10, TrainConfig(steps=1, batch_size=32), rng)
    assert len(one) == 1 and sorted(one[0].tolist()) == list(range(10))


def test_train_local_counts_the_samples_of_its_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x = np.random.default_rng(1).normal(size=(20, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    before = model.weight.detach().clone()
    # 3 steps of a 20-sample split in batches of 8: 8 + 8 + 4
    out = train_local(model, x, y, TrainConfig(steps=3, batch_size=8, lr=0.1, momentum=0.0), np.random.default_rng(0))
    assert out["samples"] == 20.0 and out["diverged"] == 0.0
    assert not torch.equal(before, model.weight)
    out = train_local(model, x, y, TrainConfig(epochs=2, batch_size=8), np.random.default_rng(0))
    assert out["samples"] == 40.0


@pytest.mark.parametrize("bad", [{"steps": -1}, {"steps": 1.5}, {"epochs": 0}])
def test_bad_train_config_names_the_key(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=f"training.{key}"):
        TrainConfig(**bad)


@pytest.mark.parametrize("clip", [0.0, 0.01])
def test_clip_grad_norm_bounds_every_step(clip):
    """``training.clip_grad_norm``: each SGD step moves the parameters by at most lr x the
    clip (no momentum); off (0), one batch that the model fits badly moves them far."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = np.full((8, 4), 100.0, np.float32)  # large inputs: a large gradient
    y = np.zeros(8, np.int64)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    cfg = TrainConfig(epochs=1, batch_size=8, lr=0.1, momentum=0.0, clip_grad_norm=clip)
    train_local(model, x, y, cfg, np.random.default_rng(0))
    moved = float(torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()]) - before))
    if clip:
        assert moved <= 0.1 * clip + 1e-6
    else:
        assert moved > 1.0
    with pytest.raises(ValueError, match="clip_grad_norm"):
        TrainConfig(clip_grad_norm=-1.0)


def test_clip_grad_norm_in_the_configuration():
    from dfl_agent.runtime.shared.config import ConfigError, config_from_dict

    base = {"federation": "f", "algorithm": {"name": "local", "rounds": 1}}
    assert config_from_dict(base).training.clip_grad_norm == 0.0
    assert config_from_dict({**base, "training": {"clip_grad_norm": 5.0}}).training.clip_grad_norm == 5.0
    with pytest.raises(ConfigError, match="training.clip_grad_norm"):
        config_from_dict({**base, "training": {"clip_grad_norm": -1.0}})
