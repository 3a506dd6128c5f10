"""``fedrolex``: the seed's decentralized FedRolex (seed 000 App. A.3.3, Algorithm 3): the
partial-training round of :class:`~dfl_agent.algorithms.heterofl.PartialTraining` with
sub-models that are windows rolling with the round (Eq. 9).
"""

from __future__ import annotations

from dfl_agent.algorithms.base import register
from dfl_agent.algorithms.heterofl import HeteroFL, PartialTraining


@register
class FedRolex(PartialTraining):
    """Decentralized FedRolex: sub-models are windows rolling with the round (Eq. 9)."""

    name = "fedrolex"
    traits = HeteroFL.traits  # the same protocol, memory and width-scaled default model as HeteroFL
    scheme = "fedrolex"

