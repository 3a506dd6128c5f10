"""The torch modules of the built-in model types (:func:`dfl_agent.models.build_model`
builds them from a spec; the spec rules and shapes are in :mod:`dfl_agent.models`).

Kept apart from the spec functions so that reading, checking and hashing a spec imports
no torch (the always-on agent, ``dfl-agent check-config``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dfl_agent.models import SpecError

__all__ = ["CNN1d", "MLP", "CNN"]


class CNN1d(nn.Module):
    """1-D CNN for multichannel time windows. Input ``(B, C, L)`` -> logits ``(B, K)``."""

    def __init__(self, in_channels: int, length: int, channels: Sequence[int], kernel: int, num_classes: int,
                 norm: str = "none"):
        super().__init__()
        layers: list[nn.Module] = []
        c, n = in_channels, length
        for w in channels:
            n //= 2
            layers += [nn.Conv1d(c, w, kernel, padding=kernel // 2), nn.ReLU(), nn.MaxPool1d(2)]
            if norm == "layer":
                layers.append(nn.LayerNorm([w, n]))
            c = w
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean(dim=-1))


class MLP(nn.Module):
    """Multilayer perceptron over the flattened input. ``(B, *shape)`` -> ``(B, K)``."""

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        f = in_features
        for h in hidden:
            layers += [nn.Linear(f, h), nn.ReLU()]
            f = h
        layers.append(nn.Linear(f, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """The seeds' CNN family (seed 000 Table 10): [conv5x5-ReLU-pool2-LayerNorm]* + linear.

    Input ``(B, C, H, H)`` -> logits ``(B, K)``.
    """

    def __init__(self, in_channels: int, image_size: int, widths: Sequence[int], kernel: int, num_classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        c, h = in_channels, image_size
        for w in widths:
            if h < 2:
                raise SpecError(f"model spec 'widths' has too many layers for image_size {image_size}")
            h //= 2
            layers += [
                nn.Conv2d(c, w, kernel, padding=kernel // 2),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.LayerNorm([w, h, h]),
            ]
            c = w
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c * h * h, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))
