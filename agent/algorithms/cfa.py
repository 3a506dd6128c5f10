"""``cfa``: consensus-based federated averaging (Savazzi et al. 2019; DecHW seed 001
§V-A4 baseline; rule fixed by ALGORITHMS.md).

Same protocol as ``dechw`` (:mod:`dfl_agent.algorithms.protocols.neighbourhood`, Algorithm 1 of seed 001: aggregate
the neighbours' previous-round models, train, send), with the consensus step

    w_i ← w_i + ε Σ_{j∈N_i} τ_j (w_j − w_i),   ε = 1/|N_i| by default,

where N_i are the neighbours whose message arrived this round and τ_j are data-size
weights: ``weights = "neighbourhood"`` (default, ALGORITHMS.md: τ_j = |D_j| /
Σ_{k∈N_i∪{i}} |D_k|, as in Eq. 3) or ``"neighbours"`` (Savazzi's α_{i,j} = |D_j| /
Σ_{k∈N_i} |D_k|, which sum to 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.neighbourhood import NeighbourhoodAlgorithm, NeighbourhoodOptions
from dfl_agent.learning.consensus import consensus_step
from dfl_agent.learning.robust import clip_updates, robust_aggregate
from dfl_agent.privacy import policy as dp_policy


@dataclasses.dataclass
class CFAOptions(NeighbourhoodOptions):
    """Options of ``cfa``.

    Attributes:
        epsilon: consensus step size ε; 0 (default) means 1/|N_i| with |N_i| the
            number of neighbour models received this round.
        weights: normalisation of τ_j: ``neighbourhood`` (over N_i ∪ {i}, default) or
            ``neighbours`` (over N_i).
    """

    epsilon: float = 0.0
    weights: str = "neighbourhood"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0 (0 = 1/|N_i|), got {self.epsilon}")
        if self.weights not in ("neighbourhood", "neighbours"):
            raise ValueError(f"weights must be 'neighbourhood' or 'neighbours', got {self.weights!r}")


@register
class CFA(NeighbourhoodAlgorithm):
    """Consensus-based federated averaging over the neighbourhood."""

    name = "cfa"
    traits = Traits("neighbourhood", same_architecture=True, choco_gossip=True,
                    dp=dp_policy.DPSupport({"model": dp_policy.MODEL, "model samples": dp_policy.SAMPLES}))
    Options = CFAOptions

    def aggregate(self, t: int, own: dict[str, np.ndarray], got: list[Message]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The consensus step of CFA (Savazzi et al. 2019, Eq. 5; DecHW seed 001 §V-A4):
        ``w_i ← w_i + ε Σ_{j∈N_i} τ_j (w_j − w_i)`` over the neighbours that arrived, or the
        robust rule of the option ``aggregation``.  Returns ``(tensors, info)``."""
        if not got:
            return own, {"epsilon": 0.0}
        o = self.options
        if o.aggregation in ("median", "trimmed_mean"):  # robust rule replaces the consensus step
            samples = [self.samples] + [m.meta["samples"] for m in got]
            tensors, _ = robust_aggregate(own, [m.tensors for m in got], samples, o.aggregation, trim_ratio=o.trim_ratio)
            return tensors, {"epsilon": 1.0}
        models = [m.tensors for m in got]
        if o.aggregation == "clip":
            models = clip_updates(models, own, o.clip_norm)[0]
        sizes = np.array([m.meta["samples"] for m in got], dtype=np.float64)
        denom = sizes.sum() + (self.samples if self.options.weights == "neighbourhood" else 0.0)
        eps = self.options.epsilon or 1.0 / len(got)
        return consensus_step(own, models, list(sizes / denom), eps), {"epsilon": eps}
