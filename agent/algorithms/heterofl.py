"""``heterofl``: the seed's decentralized HeteroFL (seed 000 App. A.3.3, Algorithm 3), and
:class:`PartialTraining`, the round it shares with ``fedrolex`` (:mod:`dfl_agent.algorithms.fedrolex`).

Same coordination and communication as DFML: senders train locally (WSM, Eq. 2) and
send their width-scaled models to the round's aggregator, which takes the largest
available model as W_g, averages every position over the participants holding it
(Eq. 6; sub-model indices by Eq. 8 for HeteroFL, Eq. 9 for FedRolex) and returns each
participant its slice.  Meant for DFML's H1 mode (one architecture at several widths);
a model that is not a width-scaled member of the same family is rejected.
"""

from __future__ import annotations

from typing import Any

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.dfedavg import DFedAvg
from dfl_agent.learning.params import IncompatibleUpdate, model_to_numpy
from dfl_agent.learning.partial import aggregate_partial, check_sub_model
from dfl_agent.privacy import policy as dp_policy


class PartialTraining(DFedAvg):
    """DFedAvg's rotating round with partial-training aggregation (seed 000 Eq. 6) of the
    sub-model ``scheme`` (Eq. 8 ``heterofl``, Eq. 9 ``fedrolex``)."""

    scheme = ""

    def check_contribution(self, msg: Message) -> None:
        super().check_contribution(msg)
        own = model_to_numpy(self.model)
        try:  # one of the two must be a slice of the other
            check_sub_model(msg.tensors, own)
        except ValueError:
            try:
                check_sub_model(own, msg.tensors)
            except ValueError as exc:
                raise IncompatibleUpdate(str(exc)) from None

    async def aggregate(self, t: int, token: dict[str, Any], contributions: dict[str, Message]):
        """Seed 000 App. A.3.3, Eq. 6: every position of the largest model W_g averaged over
        the participants holding it (sub-model indices by Eq. 8, HeteroFL, or Eq. 9, FedRolex);
        each participant gets its slice back.  Returns ``({participant: (tensors, meta)}, info)``."""
        me = self.ctx.node_id
        order = [me, *sorted(contributions)]
        states = [model_to_numpy(self.model)] + [contributions[s].tensors for s in order[1:]]
        try:
            new = await self.ctx.compute(aggregate_partial, states, self.scheme, t)
        except ValueError:  # participants of different families: keep every model
            new = states
        widths = len({sum(a.size for a in st.values()) for st in states})
        return {n: (st, {}) for n, st in zip(order, new)}, {"widths": widths}


@register
class HeteroFL(PartialTraining):
    """Decentralized HeteroFL: sub-models are the leading slices of W_g (Eq. 8)."""

    name = "heterofl"
    traits = Traits("rotating", mixes_architectures=True, required_roles=("trainer", "sender"),
                    models_held=(6.0, 6.0), aggregator_holds_all=True, default_model="width-scaled",
                    dp=dp_policy.rotating())
    scheme = "heterofl"
