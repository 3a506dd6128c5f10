"""A tiny two-class data set and MLP spec shared by the federation unit tests."""

from __future__ import annotations

import types

import numpy as np

#: a 4-input, 8-hidden, 2-class MLP
SPEC = {"type": "mlp", "input_shape": [4], "hidden": [8], "num_classes": 2}


def toy_data(seed: int, n: int = 40) -> types.SimpleNamespace:
    """``n`` samples of 4 normal features, label ``x0 + x1 > 0``; the first 32 train, the rest validate."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    return types.SimpleNamespace(train_x=x[:32], train_y=y[:32], val_x=x[32:], val_y=y[32:], num_classes=2)
