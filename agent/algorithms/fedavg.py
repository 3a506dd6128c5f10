"""``fedavg``: decentralized FedAvg gossip.

Each round ``t`` a node (1) trains its model locally, (2) broadcasts it with its
training-sample count, (3) waits until every live neighbour's round-``t`` model
arrived or the round deadline passed, and (4) replaces its model by the
sample-weighted average of its own and the received models (McMahan et al. 2017;
the same rule as Def-KT seed 004 Eq. 9, applied over the neighbourhood).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from agent.algorithms.base import Algorithm, register
from agent.algorithms.context import Message
from agent.algorithms import gossip_compression as gc
from agent.learning.aggregation import weighted_average
from agent.learning.params import IncompatibleUpdate, check_compatible, load_numpy, model_to_numpy
from agent.learning.training import train_local

MODEL_KIND = "model"


@dataclasses.dataclass
class FedAvgOptions:
    """Options of ``fedavg``.

    Attributes:
        round_timeout: seconds a round waits for neighbours' models after sending its own.
        poll_interval: seconds between re-checks of the live-peer set while waiting
            (a peer that leaves stops being waited for).
    """

    round_timeout: float = 30.0
    poll_interval: float = 0.5

    def __post_init__(self) -> None:
        if not self.round_timeout > 0:
            raise ValueError(f"round_timeout must be > 0, got {self.round_timeout}")
        if not self.poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0, got {self.poll_interval}")


async def collect_round(
    ctx, kind: str, t: int, deadline: float, poll: float, template, extra_tensors: frozenset[str] = frozenset()
) -> tuple[dict, list[str]]:
    """Receive round-``t`` messages of ``kind`` from every live neighbour
    (``ctx.neighbours()``) until ``deadline``; messages of non-neighbours are rejected
    and counted (``not_neighbour``).

    Messages whose tensors do not match ``template`` (names/shapes/dtypes; names in
    ``extra_tensors`` may come in addition and are not checked here) or whose
    ``meta["samples"]`` is not a positive number are rejected and counted.

    Returns:
        ``({sender: message}, missing_peer_ids)``.
    """
    got: dict[str, Message] = {}
    while True:
        neighbours = ctx.neighbours()
        missing = [p for p in neighbours if p not in got]
        now = ctx.clock.now()
        if not missing or now >= deadline:
            return got, missing
        msg = await ctx.receive(kind, round=t, deadline=min(deadline, now + poll))
        if msg is None:
            continue
        if msg.sender not in neighbours:
            ctx.reject(msg, "not_neighbour: sender is not a live neighbour")
            continue
        try:
            check_compatible({k: v for k, v in msg.tensors.items() if k not in extra_tensors}, template)
        except IncompatibleUpdate as exc:
            ctx.reject(msg, f"incompatible: {exc}")
            continue
        samples = msg.meta.get("samples")
        if not isinstance(samples, (int, float)) or isinstance(samples, bool) or not samples > 0:
            ctx.reject(msg, "bad_meta: samples")
            continue
        got[msg.sender] = msg


@register
class FedAvg(Algorithm):
    """Decentralized FedAvg gossip over all live peers (neighbourhood = everyone)."""

    name = "fedavg"
    Options = FedAvgOptions

    async def setup(self) -> None:
        self.model = self.new_model()
        self.choco = gc.choco_for(self.ctx, MODEL_KIND)  # compressed gossip (issue 8), None = raw models

    async def round(self, t: int) -> dict[str, Any]:
        ctx, d = self.ctx, self.ctx.data
        stats = await ctx.compute(train_local, self.model, d.train_x, d.train_y, ctx.train, ctx.rng, ctx.device)
        own = model_to_numpy(self.model)
        n_own = int(len(d.train_y))
        await ctx.broadcast(gc.model_message(self.choco, MODEL_KIND, t, own, {"samples": n_own}))
        deadline = ctx.clock.now() + self.options.round_timeout
        got, missing = await collect_round(ctx, MODEL_KIND, t, deadline, self.options.poll_interval, own)
        got = gc.received_copies(ctx, self.choco, got)
        senders = sorted(got)
        base = gc.own_for_mixing(self.choco, own)
        avg = weighted_average([base] + [got[s].tensors for s in senders], [n_own] + [got[s].meta["samples"] for s in senders])
        load_numpy(self.model, gc.finish_mixing(self.choco, own, avg))
        return {"train_loss": stats["loss"], "neighbours": len(senders), "missing": missing}

    def deployable_model(self) -> nn.Module:
        return self.model
