"""``fedrolex``: the seed's decentralized FedRolex (seed 000 App. A.3.3, Algorithm 3): the
partial-training round of :class:`~dfl_agent.algorithms.heterofl.PartialTraining` with
sub-models that are windows rolling with the round (Eq. 9).
"""

from __future__ import annotations

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.heterofl import PartialTraining


@register
class FedRolex(PartialTraining):
    """Decentralized FedRolex: sub-models are windows rolling with the round (Eq. 9)."""

    name = "fedrolex"
    traits = Traits("rotating", mixes_architectures=True, required_roles=("trainer", "sender"),
                    models_held=(6.0, 6.0), aggregator_holds_all=True, default_model="width-scaled")
    scheme = "fedrolex"

