"""Conversion between torch models and the named numpy tensors that travel on the wire."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn


class IncompatibleUpdate(ValueError):
    """Received tensors do not fit the local model (names, shapes or dtypes differ)."""


def model_to_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """All entries of ``model.state_dict()`` as C-contiguous numpy arrays (copies)."""
    return {k: np.ascontiguousarray(v.detach().cpu().numpy()).copy() for k, v in model.state_dict().items()}


def check_compatible(tensors: Mapping[str, np.ndarray], template: Mapping[str, np.ndarray]) -> None:
    """Check that ``tensors`` has exactly ``template``'s names, shapes and dtypes.

    Raises:
        IncompatibleUpdate: naming the first difference.
    """
    if set(tensors) != set(template):
        missing = sorted(set(template) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(template))[:3]
        raise IncompatibleUpdate(f"tensor names differ (missing {missing}, unexpected {extra})")
    for k, t in template.items():
        a = tensors[k]
        if a.shape != t.shape or a.dtype != t.dtype:
            raise IncompatibleUpdate(f"{k}: got {a.dtype}{list(a.shape)}, expected {t.dtype}{list(t.shape)}")


def load_numpy(model: nn.Module, tensors: Mapping[str, np.ndarray]) -> None:
    """Copy ``tensors`` into ``model`` in place.

    Raises:
        IncompatibleUpdate: names/shapes/dtypes differ (the model is left untouched).
    """
    check_compatible(tensors, model_to_numpy(model))
    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in tensors.items()})
