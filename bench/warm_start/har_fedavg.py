"""The set-up the warm-start benchmarks share: four HAR users, one device each, and an
exact FedAvg round (no network: the learning only).

Each device holds the first 320 windows of one user's recording, ``(320, 9, 128)`` float32
with labels ``(320,)``, and the deploy gate's validation slice (``validation_mask``, share
0.2).  The model is the profile's ``cnn1d`` (medium), trained one epoch a round at lr 0.05.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class HarDevices:
    """Four HAR devices: ``data[i] = (x, y, val)`` (``val``: bool mask of the validation
    slice), the model ``spec``, the full-rate ``base`` TrainConfig and the ``pool``."""

    pool: Any
    data: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    spec: Any
    base: Any


def har_devices(windows: int = 320, users: int = 4) -> HarDevices:
    """The first ``windows`` windows of each of the first ``users`` HAR users.

    Sets torch to one thread (several benchmarks share two cores)."""
    import torch

    from dfl_agent.data import load_dataset
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.models import default_spec
    from dfl_agent.store.sqlite import validation_mask

    torch.set_num_threads(1)
    pool = load_dataset("har").pool
    data = []
    for u in sorted({int(g) for g in pool.groups})[:users]:
        m = pool.groups == u
        x, y = pool.x[m][:windows], pool.y[m][:windows]
        data.append((x, y, validation_mask(np.arange(len(y)), 0.2)))
    return HarDevices(pool, data, default_spec(pool.input_shape, pool.num_classes, "medium"),
                      TrainConfig(epochs=1, lr=0.05))


def fedavg_round(models: list, data: list, n: int, cfg: Any, rng: np.random.Generator) -> None:
    """One FedAvg round with exact averaging: each model trains on the training part of its
    device's first ``n`` windows (``cfg``: a TrainConfig), then every model takes the mean
    of the state dicts (McMahan et al. 2017, eq. 1 with equal weights).  In place."""
    from dfl_agent.learning.training import train_local

    for i, m in enumerate(models):
        x, y, val = data[i]
        train_local(m, x[:n][~val[:n]], y[:n][~val[:n]], cfg, rng)
    states = [m.state_dict() for m in models]
    mean = {k: sum(s[k] for s in states) / len(states) for k in states[0]}
    for m in models:
        m.load_state_dict(mean)
