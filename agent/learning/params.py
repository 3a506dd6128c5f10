"""Conversion between torch models and the named numpy tensors that travel on the wire."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn, torch


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
    if tensors.keys() != template.keys():
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
    # the model's own tensors (state_dict: detached, sharing the parameters' storage) as
    # the template, without copies
    state = model.state_dict()
    check_compatible(tensors, {k: v.cpu().numpy() for k, v in state.items()})
    if any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks
           or type(m)._load_from_state_dict is not nn.Module._load_from_state_dict for m in model.modules()):
        # a module with its own loading logic: torch's load_state_dict
        model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in tensors.items()})
        return
    # plain modules: copied in place, as load_state_dict does; a read-only array (a shared
    # received message) or a strided one is read through a copy
    with torch.no_grad():
        for k, v in tensors.items():
            a = v if isinstance(v, np.ndarray) and v.flags.writeable and v.flags.c_contiguous else np.array(v)
            state[k].copy_(torch.from_numpy(a))
