"""``fullavg``: the FullAvg baseline of Def-KT (seed 004 Algorithm 2, Eq. 9).

``scope = pair`` (default, the paper's Algorithm 2): the same rounds and pairs as
``defkt`` (Q senders train M epochs and send their model), but the receiver fuses by
the sample-count-weighted average of Eq. 9,
``w ← N_s/(N_s+N_r)·w̃ + N_r/(N_s+N_r)·w``.  The communication per round is Q models,
the same as Def-KT and Combo (§IV-B).  Runs in ``rounds`` or ``gossip`` mode
(:mod:`dfl_agent.algorithms.protocols.pairs`).

``scope = all`` (not in the paper): every node trains M epochs, broadcasts, and
averages all live neighbours' models with Eq. 9's weights each round, i.e.
decentralized FedAvg over the full graph (``dfl_agent.algorithms.fedavg`` pieces); it
sends N models per round instead of Q, so compare it at equal bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.neighbourhood import collect_round
from dfl_agent.algorithms.protocols.pairs import PushAlgorithm, PushOptions
from dfl_agent.learning.aggregation import weighted_average
from dfl_agent.learning.params import load_numpy, model_to_numpy
from dfl_agent.learning.training import train_local
from dfl_agent.privacy import policy as dp_policy


@dataclasses.dataclass
class FullAvgOptions(PushOptions):
    """Options of ``fullavg`` (see :class:`~dfl_agent.algorithms.protocols.pairs.PushOptions`).

    Attributes:
        scope: ``pair`` (paper, Algorithm 2) or ``all`` (every node averages every
            live neighbour's model each round; ``rounds`` mode only; a round waits at
            most ``round_timeout`` for the models).
    """

    scope: str = "pair"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scope not in ("pair", "all"):
            raise ValueError(f"scope must be 'pair' or 'all', got {self.scope!r}")
        if self.scope == "all" and self.mode != "rounds":
            raise ValueError("scope = 'all' runs in mode = 'rounds' only")


@register
class FullAvg(PushAlgorithm):
    """FullAvg (seed 004 Algorithm 2); deployable model = the local model."""

    name = "fullavg"
    traits = Traits("pairs", same_architecture=True, dp=dp_policy.DPSupport({
        "defkt.model": dp_policy.MODEL, "defkt.model samples": dp_policy.SAMPLES,
        "defkt.model schedule": ("public", "fingerprint of the shared pair schedule")}))
    Options = FullAvgOptions
    fuse_step = "aggregation"

    def fuse(self, incoming: dict, samples: float) -> dict[str, Any]:
        """Eq. 9: ``w ← (N_s·w̃ + N_r·w) / (N_s + N_r)``, N = training-sample counts."""
        avg = weighted_average([incoming, model_to_numpy(self.model)], [samples, self.samples])
        load_numpy(self.model, avg)
        return {}

    async def round(self, t: int) -> dict[str, Any]:
        """Round ``t`` of Def-KT's FullAvg baseline (seed 004 Algorithm 2, Eq. 9): the pairs
        round (``scope = pair``), or every node averaging all live neighbours with Eq. 9's
        weights (``scope = all``).  Returns the round's info."""
        if self.options.scope == "all":
            return await self._average_all(t)
        return await super().round(t)

    async def _average_all(self, t: int) -> dict[str, Any]:
        ctx, d = self.ctx, self.ctx.data
        stats = await ctx.compute(train_local, self.model, d.train_x, d.train_y, self.sender_train, ctx.rng, ctx.device)
        own = model_to_numpy(self.model)
        await ctx.broadcast(Message(self.kind("model"), t, own, meta={"samples": self.samples}), neighbours_only=True)
        deadline = ctx.clock.now() + self.options.round_timeout
        got, missing = await collect_round(ctx, self.kind("model"), t, deadline, self.options.poll_interval, own)
        senders = sorted(got)
        with self.divergence_guard("aggregation") as guard:  # a non-finite average is undone
            avg = weighted_average([own] + [got[s].tensors for s in senders],
                                   [self.samples] + [got[s].meta["samples"] for s in senders])
            load_numpy(self.model, avg)
        used = [] if guard.diverged else senders
        return {"role": "all", "train_loss": stats["loss"], "neighbours": len(used), "neighbour_ids": used,
                "missing": missing}
