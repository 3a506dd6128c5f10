"""``dechetero``: decentralized FedAvg over a static graph with heterogeneous
initialisation (DecHW seed 001 §V-A4 baseline, Eq. 3).

Same protocol as ``dechw`` (:mod:`dfl_agent.algorithms.protocols.neighbourhood`, Algorithm 1 of seed 001: aggregate
the neighbours' previous-round models, train, send), with the aggregation

    w_i⁽ᵗ⁾ = Σ_{j∈N_i∪{i}} τ_j w_j⁽ᵗ⁻¹⁾,   τ_j = |D_j| / Σ_{k∈N_i∪{i}} |D_k|     (Eq. 3)

and no Hessian in the messages.
"""

from __future__ import annotations

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.protocols.neighbourhood import NeighbourhoodAlgorithm, NeighbourhoodOptions
from dfl_agent.privacy import policy as dp_policy


@register
class DecHetero(NeighbourhoodAlgorithm):
    """Data-size weighted neighbourhood averaging (Eq. 3:
    :meth:`NeighbourhoodAlgorithm.aggregate`, or its robust rule ``aggregation``)."""

    name = "dechetero"
    traits = Traits("neighbourhood", same_architecture=True, choco_gossip=True,
                    dp=dp_policy.DPSupport({"model": dp_policy.MODEL, "model samples": dp_policy.SAMPLES}))
    Options = NeighbourhoodOptions
