"""``dfedprox``: the seed's decentralized FedProx (seed 000 App. A.3.2, Algorithm 2 with the
proximal term): ``dfedavg``'s rotating round (:mod:`dfl_agent.algorithms.dfedavg`) whose
senders train with ``μ/2 ‖w − w_start‖²`` added to the loss.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from dfl_agent.algorithms.base import register
from dfl_agent.algorithms.dfedavg import DFedAvg, DFedAvgOptions

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclasses.dataclass
class DFedProxOptions(DFedAvgOptions):
    """Options of ``dfedprox``: ``mu`` is the proximal coefficient μ >= 0."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu < 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")


@register
class DFedProx(DFedAvg):
    """Decentralized FedProx (seed 000 Alg. 2 with the proximal term)."""

    name = "dfedprox"
    traits = DFedAvg.traits  # the same protocol and memory as DFedAvg
    Options = DFedProxOptions

    def _regularizer(self):
        mu = self.options.mu
        if mu == 0:
            return None
        start = [p.detach().clone() for p in self.model.parameters()]

        def prox(model: nn.Module) -> torch.Tensor:
            return 0.5 * mu * sum(((p - s) ** 2).sum() for p, s in zip(model.parameters(), start))

        return prox
