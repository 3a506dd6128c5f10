"""``fedavg``: decentralized FedAvg gossip.

A neighbourhood-gossip algorithm (:mod:`dfl_agent.algorithms.protocols.neighbourhood`,
``train_first``): each round ``t`` a node (1) trains its model locally, (2) broadcasts
it with its training-sample count, (3) waits until every live neighbour's round-``t``
model arrived or the round deadline passed, and (4) replaces its model by the
sample-weighted average of its own and the received models (McMahan et al. 2017;
the same rule as Def-KT seed 004 Eq. 9, applied over the neighbourhood).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from dfl_agent.algorithms import gossip_compression as gc
from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.protocols.neighbourhood import MODEL_KIND, GossipOptions, NeighbourhoodAlgorithm
from dfl_agent.algorithms.protocols.synchronization import send_with_participation
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.privacy import policy as dp_policy


@dataclasses.dataclass
class FedAvgOptions(GossipOptions):
    """Options of ``fedavg``: those of :class:`~dfl_agent.algorithms.protocols.neighbourhood.GossipOptions`."""


@register
class FedAvg(NeighbourhoodAlgorithm):
    """Decentralized FedAvg gossip over the neighbourhood (all live peers without a graph);
    aggregation: FedAvg's sample-weighted mean (McMahan et al. 2017; seed 004 Eq. 9 over
    N_i ∪ {i}), :meth:`NeighbourhoodAlgorithm.aggregate`."""

    name = "fedavg"
    traits = Traits("neighbourhood", same_architecture=True, choco_gossip=True,
                    dp=dp_policy.DPSupport({"model": dp_policy.MODEL, "model samples": dp_policy.SAMPLES}))
    Options = FedAvgOptions
    train_first = True

    async def send_model(self, t: int, extra: Mapping[str, np.ndarray]) -> None:
        """Broadcast the round-``t`` model with ``meta = {"samples": |D_i|}`` to the
        neighbours (or send it to ``participation`` of them, seed 003 §3.6.4)."""
        ctx = self.ctx
        own = model_to_numpy(self.model)
        meta = {"samples": self.samples, **self.cold_meta()}  # samples: 1 under DP (dfl_agent.privacy.policy)
        if self.options.participation:  # partial device participation (seed 003 §3.6.4)
            await send_with_participation(ctx, MODEL_KIND, t, own, meta, self.options.participation)
        else:
            await ctx.broadcast(gc.model_message(self.choco, MODEL_KIND, t, own, meta), neighbours_only=True)
