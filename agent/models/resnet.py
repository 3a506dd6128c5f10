"""Small pre-activation ResNet (model type ``resnet``), the ResNet member of DFML's
architecture modes (seed 000, App. A.2 / Table 10: "the largest model is pre-activated
ResNet18, while others are scaled versions of ResNet18 ... each layer consists of two
blocks"), for 1-D sensor windows and 2-D images.

Spec::

    {"type": "resnet", "input_shape": [1, 8, 8], "widths": [32, 64, 128, 256],
     "blocks": [2, 2, 2, 2], "num_classes": 10, "norm": "layer"}

- ``input_shape``: ``[C, L]`` (1-D convolutions, e.g. HAR windows ``[3, 128]``) or
  ``[C, H, W]`` (2-D, e.g. digits ``[1, 8, 8]``).  The forward pass reshapes its input
  to ``(B, *input_shape)``, so flattened inputs ``(B, C·H·W)`` work too.
- ``widths``: channels of each stage; ``blocks``: basic blocks per stage (default 2
  each, as ResNet18).  Stage 1 keeps the resolution, every later stage halves it
  (stride 2; at size 1 it stays 1).
- ``norm``: ``layer`` (default) = ``GroupNorm(1, C)``, a layer norm over (C, spatial)
  with a per-channel affine; ``none`` = identity.  BatchNorm is not offered: its
  running statistics do not average across clients of different data and widths
  (HeteroFL uses "static" BN for that reason), and the seed's CNN family also uses
  layer normalisation.  ``GroupNorm(1, C)`` works at every width, so width-scaled
  members are exact slices of the largest one (HeteroFL/FedRolex, seed 000 Eq. 8–9).

Layout (He et al. 2016, "Identity Mappings in Deep Residual Networks", pre-activation)::

    stem:   conv3x3(C -> w_1)
    block:  h = relu(norm1(x)); out = conv3x3_s(h); out = conv3x3(relu(norm2(out)))
            out += x                (same shape)   or   conv1x1_s(h)   (otherwise)
    head:   relu(norm(x)) -> global average pool -> Linear(w_last, num_classes)

Input ``(B, *input_shape)`` (or ``(B, prod(input_shape))``) -> logits ``(B, num_classes)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

NORMS = ("layer", "none")


def _norm(kind: str, c: int) -> nn.Module:
    return nn.GroupNorm(1, c) if kind == "layer" else nn.Identity()


class PreActBlock(nn.Module):
    """Pre-activation basic block: two 3-wide convolutions and a shortcut.

    Input ``(B, c_in, *S)`` -> ``(B, c_out, *S')`` with ``S' = ceil(S / stride)``.
    """

    def __init__(self, conv: type[nn.Module], c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        self.norm1 = _norm(norm, c_in)
        self.conv1 = conv(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm2 = _norm(norm, c_out)
        self.conv2 = conv(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.shortcut = conv(c_in, c_out, 1, stride=stride, bias=False) if stride != 1 or c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(h)
        out = self.conv1(h)
        out = self.conv2(torch.relu(self.norm2(out)))
        return out + skip


class PreActResNet(nn.Module):
    """Pre-activation ResNet for ``(C, L)`` or ``(C, H, W)`` inputs (see module docstring)."""

    def __init__(self, input_shape: Sequence[int], widths: Sequence[int], blocks: Sequence[int], num_classes: int,
                 norm: str = "layer"):
        super().__init__()
        self.input_shape = tuple(int(s) for s in input_shape)
        conv = nn.Conv1d if len(self.input_shape) == 2 else nn.Conv2d
        self.stem = conv(self.input_shape[0], widths[0], 3, stride=1, padding=1, bias=False)
        layers: list[nn.Module] = []
        c = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            for j in range(n):
                layers.append(PreActBlock(conv, c, w, 2 if (i > 0 and j == 0) else 1, norm))
                c = w
        self.layers = nn.Sequential(*layers)
        self.norm = _norm(norm, c)
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.input_shape)
        h = torch.relu(self.norm(self.layers(self.stem(x))))
        return self.classifier(h.flatten(2).mean(dim=-1))


def validate_resnet(spec: Mapping[str, Any], int_list, error: type[Exception]) -> dict[str, Any]:
    """Normalise the ``resnet``-specific keys of ``spec`` (``num_classes`` is checked by the caller).

    Args:
        int_list: the package's list-of-widths checker ``(spec, key) -> list[int]``.
        error: the exception type to raise (``SpecError``).

    Raises:
        error: bad ``input_shape`` (needs 2 or 3 positive ints), ``widths``, ``blocks``
            (one int in [1, 8] per width) or ``norm``; the message names the key.
    """
    shape = spec.get("input_shape")
    if (not isinstance(shape, (list, tuple)) or len(shape) not in (2, 3)
            or not all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 1 << 16 for s in shape)):
        raise error(f"model spec key 'input_shape' must be [C, L] or [C, H, W] of positive integers, got {shape!r}")
    widths = int_list(spec, "widths")
    blocks = spec.get("blocks", [2] * len(widths))
    if (not isinstance(blocks, (list, tuple)) or len(blocks) != len(widths)
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 8 for b in blocks)):
        raise error(f"model spec key 'blocks' must be one integer in [1, 8] per width, got {blocks!r}")
    norm = spec.get("norm", "layer")
    if norm not in NORMS:
        raise error(f"model spec key 'norm' must be one of {NORMS}, got {norm!r}")
    return {"input_shape": list(shape), "widths": widths, "blocks": list(blocks), "norm": norm}
