"""``convdense``: FedD2S's 3-conv + 3-dense model family (seed 002, §IV-A "Model Architecture").

The seed's M1 = [C1(8); C2(16); C3(32); F1(32); F2(16); F3(10)] and M2 = [C1(16); C2(64);
C3(128); F1(128); F2(32); F3(10)], with a flatten between the last conv and the first dense
layer.  Spec (conv widths and dense widths are options; the last dense layer has
``num_classes`` units)::

    {"type": "convdense", "input_shape": [1, 8, 8], "conv": [8, 16, 32], "dense": [32, 16],
     "num_classes": 10, "kernel": 3, "pool": 2}

``input_shape`` of length 3 ``(C, H, W)`` gives 2-D convolutions (images); of length 2
``(C, L)`` gives the 1-D equivalent for sensor windows (HAR), default kernel 5.

The model is a cascade of *layers* ``blocks[0..L-1]`` (L = len(conv) + len(dense) + 1),
which is what FedD2S's layer dropping needs: H_l = output of layer l (1-based),
``head(l)`` = layers l+1..L.

- conv layer i: Conv(k, pad k//2) -> ReLU -> MaxPool(pool)   (pooling skipped once the
  spatial size is below ``pool``)
- dense layer 1: Flatten -> Linear -> ReLU; further hidden dense layers: Linear -> ReLU;
- last layer: Linear(…, num_classes) -> logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ConvDense", "validate_convdense_spec", "layer_names"]

MAX_WIDTH = 4096


def _err(msg: str) -> Exception:
    from dfl_agent.models import SpecError

    return SpecError(msg)


def _ints(spec: Mapping[str, Any], key: str, lo: int, hi: int, n_max: int = 8, allow_empty: bool = False) -> list[int]:
    v = spec.get(key)
    if not isinstance(v, (list, tuple)) or (not v and not allow_empty) or len(v) > n_max or not all(
        isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in v
    ):
        raise _err(f"model spec (convdense) key {key!r} must be a list of up to {n_max} integers in [{lo}, {hi}], got {v!r}")
    return list(v)


def _int(spec: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int) -> int:
    v = spec.get(key, default)
    if v is None:
        raise _err(f"model spec (convdense) lacks {key!r}")
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _err(f"model spec (convdense) key {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def validate_convdense_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Check a ``convdense`` spec and return it normalised (defaults filled in).

    Raises:
        SpecError: a missing or out-of-range key (named in the message).
    """
    shape = _ints(spec, "input_shape", 1, 1 << 16, n_max=3)
    if len(shape) not in (2, 3):
        raise _err(f"model spec (convdense) key 'input_shape' must be (C, L) or (C, H, W), got {shape!r}")
    out: dict[str, Any] = {"type": "convdense", "input_shape": shape}
    out["conv"] = _ints(spec, "conv", 1, MAX_WIDTH)
    out["dense"] = _ints(spec, "dense", 1, MAX_WIDTH, allow_empty=True)
    out["kernel"] = _int(spec, "kernel", 3 if len(shape) == 3 else 5, 1, 63)
    out["pool"] = _int(spec, "pool", 2, 1, 8)
    out["num_classes"] = _int(spec, "num_classes", None, 2, 100000)
    return out


def layer_names(spec: Mapping[str, Any]) -> list[str]:
    """The seed's layer names ``["C1", "C2", "C3", "F1", "F2", "F3"]`` for a spec."""
    s = validate_convdense_spec(spec)
    return [f"C{i + 1}" for i in range(len(s["conv"]))] + [f"F{i + 1}" for i in range(len(s["dense"]) + 1)]


class ConvDense(nn.Module):
    """Cascade of conv and dense layers.  Input ``(B, *input_shape)`` -> logits ``(B, K)``.

    Attributes:
        blocks: ``nn.ModuleList`` of the L layers (see the module docstring).
        layer_names: ``["C1", …, "F1", …]``.
    """

    def __init__(self, input_shape: Sequence[int], conv: Sequence[int], dense: Sequence[int], num_classes: int,
                 kernel: int = 3, pool: int = 2):
        super().__init__()
        two_d = len(input_shape) == 3
        Conv, Pool = (nn.Conv2d, nn.MaxPool2d) if two_d else (nn.Conv1d, nn.MaxPool1d)
        c, size = int(input_shape[0]), [int(s) for s in input_shape[1:]]
        blocks: list[nn.Module] = []
        for w in conv:
            layer: list[nn.Module] = [Conv(c, w, kernel, padding=kernel // 2), nn.ReLU()]
            if pool > 1 and min(size) >= pool:
                layer.append(Pool(pool))
                size = [s // pool for s in size]
            blocks.append(nn.Sequential(*layer))
            c = w
        f = c
        for s in size:
            f *= s
        for i, w in enumerate(dense):
            pre: list[nn.Module] = [nn.Flatten()] if i == 0 else []
            blocks.append(nn.Sequential(*pre, nn.Linear(f, w), nn.ReLU()))
            f = w
        last: list[nn.Module] = [] if dense else [nn.Flatten()]
        blocks.append(nn.Sequential(*last, nn.Linear(f, num_classes)))
        self.blocks = nn.ModuleList(blocks)
        self.layer_names = [f"C{i + 1}" for i in range(len(conv))] + [f"F{i + 1}" for i in range(len(dense) + 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x
