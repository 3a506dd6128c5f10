"""Architecture modes of DFML (seed 000, App. A.2, Table 10), sized for our data and CPU.

- ``H0`` homogeneous: one CNN of widths [32, 64].
- ``H1`` restrictive heterogeneous: one CNN at width rates 1, ½, ¼, ⅛, 1/16 of [64, 128]
  (the seed scales [128, 256]; we halve it for a 2-core CPU).
- ``H1-resnet`` restrictive heterogeneous, ResNet type: a pre-activation ResNet18
  (two blocks per stage) at width rates 1, ½, ¼, ⅛, 1/16 of [32, 64, 128, 256]
  (the seed scales [64, 128, 256, 512]; halved like H1), for ``(C, L)`` and ``(C, H, W)``
  inputs alike (:mod:`dfl_agent.models.resnet`).
- ``H2`` nonrestrictive heterogeneous: CNNs of different depth and width:
  [32, 64, 128, 256], [32, 64, 128], [32, 64], [16, 32, 64], [8, 16, 32, 64].

For sensor windows ``(C, L)`` the CNNs are ``cnn1d`` with a LayerNorm after each
pooling (like the seeds' CNN family; without it the deeper members diverge); for images ``(C, H, H)`` the
seeds' ``cnn`` family.  An 8×8 image (digits) allows at most 3 pooling layers, so
deeper H2 members are cut to 3 layers there.  Models are spread evenly over nodes
(node i gets member ``i mod len(family)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dfl_agent.models import validate_spec

FAMILIES: dict[str, list[list[int]]] = {
    "H0": [[32, 64]],
    "H1": [[64, 128], [32, 64], [16, 32], [8, 16], [4, 8]],
    "H1-resnet": [[32, 64, 128, 256], [16, 32, 64, 128], [8, 16, 32, 64], [4, 8, 16, 32], [2, 4, 8, 16]],
    "H2": [[32, 64, 128, 256], [32, 64, 128], [32, 64], [16, 32, 64], [8, 16, 32, 64]],
}


def family_specs(name: str, input_shape: Sequence[int], num_classes: int) -> list[dict[str, Any]]:
    """The model specs of architecture mode ``name`` for inputs of ``input_shape``.

    Raises:
        ValueError: unknown family or an input shape no CNN family member fits.
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    shape = list(input_shape)
    if name == "H1-resnet":
        if len(shape) not in (2, 3):
            raise ValueError(f"model family {name} needs (C, L) windows or (C, H, W) images, got {tuple(shape)}")
        return [validate_spec({"type": "resnet", "input_shape": shape, "widths": widths, "blocks": [2] * len(widths),
                               "num_classes": num_classes, "norm": "layer"}) for widths in FAMILIES[name]]
    specs = []
    for widths in FAMILIES[name]:
        if len(shape) == 2:
            depth = min(len(widths), max(1, shape[1].bit_length() - 1))
            spec = {"type": "cnn1d", "in_channels": shape[0], "length": shape[1], "channels": widths[:depth],
                    "kernel": 5, "num_classes": num_classes, "norm": "layer"}
        elif len(shape) == 3 and shape[1] == shape[2]:
            depth = min(len(widths), max(1, shape[1].bit_length() - 1))
            spec = {"type": "cnn", "in_channels": shape[0], "image_size": shape[1], "widths": widths[:depth],
                    "kernel": 5, "num_classes": num_classes}
        else:
            raise ValueError(f"model family {name} needs (C, L) windows or (C, H, H) images, got {tuple(shape)}")
        specs.append(validate_spec(spec))
    return specs


#: which member of a family a size tier trains (index into the family's list, widest first)
TIER_MEMBER = {"large": 0, "medium": 1, "small": 2}


def family_member(name: str, input_shape: Sequence[int], num_classes: int, size: str = "medium") -> dict[str, Any]:
    """The member of family ``name`` that a device of size tier ``size`` trains:
    ``large`` the widest (first) member, ``medium`` the second, ``small`` the third
    (the last one when the family is shorter, e.g. ``H0`` has one member).

    Raises:
        ValueError: unknown family or size tier, or an input shape the family does not fit.
    """
    if size not in TIER_MEMBER:
        raise ValueError(f"model size must be one of {sorted(TIER_MEMBER)}, got {size!r}")
    specs = family_specs(name, input_shape, num_classes)
    return specs[min(TIER_MEMBER[size], len(specs) - 1)]
