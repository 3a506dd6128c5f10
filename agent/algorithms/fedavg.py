"""``fedavg``: decentralized FedAvg gossip.

Each round ``t`` a node (1) trains its model locally, (2) broadcasts it with its
training-sample count, (3) waits until every live neighbour's round-``t`` model
arrived or the round deadline passed, and (4) replaces its model by the
sample-weighted average of its own and the received models (McMahan et al. 2017;
the same rule as Def-KT seed 004 Eq. 9, applied over the neighbourhood).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.algorithms import gossip_compression as gc
from dfl_agent.algorithms.base import Algorithm, Traits, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.market import SyncOptions, UpdateMarket, is_empty, send_with_participation
from dfl_agent.learning.params import IncompatibleUpdate, check_compatible, load_numpy, model_to_numpy
from dfl_agent.learning.robust import check_options as check_robust_options
from dfl_agent.learning.robust import robust_aggregate
from dfl_agent.learning.training import train_local

if TYPE_CHECKING:
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn

MODEL_KIND = "model"


@dataclasses.dataclass
class GossipOptions(SyncOptions):
    """Options of every averaging gossip algorithm (``fedavg``, ``dechw``, ``dechetero``,
    ``cfa``), plus the synchronization options of
    :class:`dfl_agent.algorithms.market.SyncOptions` (``sync``, ``participation``, ...).

    Attributes:
        round_timeout: seconds a round waits for the neighbours' models (the round
            deadline); the round then proceeds with what arrived.
        poll_interval: seconds between re-checks of the live-peer set while waiting
            (a peer that leaves stops being waited for).
        aggregation: ``mean`` (default, the papers' rule), or a robust rule against
            poisoned updates (:mod:`dfl_agent.learning.robust`): ``clip`` (neighbours'
            deviation from the own model clipped to ``clip_norm``), ``median``
            (coordinate-wise), ``trimmed_mean`` (coordinate-wise, ``trim_ratio``).
        clip_norm: L2 bound of ``clip``; 0 = median of the neighbours' deviation norms.
        trim_ratio: fraction β trimmed at each end by ``trimmed_mean``, in [0, 0.5).

    Raises:
        ValueError: a non-positive timeout or poll interval, or an invalid robust rule.
    """

    round_timeout: float = 30.0
    poll_interval: float = 0.5
    aggregation: str = "mean"
    clip_norm: float = 0.0
    trim_ratio: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.round_timeout > 0:
            raise ValueError(f"round_timeout must be > 0, got {self.round_timeout}")
        if not self.poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0, got {self.poll_interval}")
        check_robust_options(self.aggregation, self.clip_norm, self.trim_ratio)


@dataclasses.dataclass
class FedAvgOptions(GossipOptions):
    """Options of ``fedavg``: those of :class:`GossipOptions`."""


def update_problem(msg: Message, template, extra_tensors: frozenset[str] = frozenset()) -> str | None:
    """Why ``msg`` is not a usable model update (``"reason: detail"``), or None.

    Checks the tensors against ``template`` (names/shapes/dtypes; names in
    ``extra_tensors`` may come in addition) and that ``meta["samples"]`` is a positive number.
    """
    try:
        tensors = msg.tensors if not extra_tensors else {k: v for k, v in msg.tensors.items() if k not in extra_tensors}
        check_compatible(tensors, template)
    except IncompatibleUpdate as exc:
        return f"incompatible: {exc}"
    samples = msg.meta.get("samples")
    if not isinstance(samples, (int, float)) or isinstance(samples, bool) or not samples > 0:
        return "bad_meta: samples"
    return None


def shape_template(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Zero-stride arrays with ``tensors``' names, shapes and dtypes (no memory held):
    a template for :func:`update_problem`."""
    return {k: np.broadcast_to(np.zeros((), np.asarray(v).dtype), np.shape(v)) for k, v in tensors.items()}


def arrival_check(template: Mapping[str, np.ndarray], extra_tensors: Callable[[], frozenset[str]] | None = None,
                  ) -> Callable[[Message], str | None]:
    """The check :meth:`NodeContext.check_on_arrival` runs on each arriving model update:
    :func:`update_problem` against ``template`` (``extra_tensors()``, asked each time, names
    the tensors that may come in addition); empty partial-participation updates pass."""

    def check(msg: Message) -> str | None:
        if is_empty(msg):
            return None
        return update_problem(msg, template, extra_tensors() if extra_tensors is not None else frozenset())

    return check


async def collect_round(
    ctx, kind: str, t: int, deadline: float, poll: float, template, extra_tensors: frozenset[str] = frozenset(),
    market: UpdateMarket | None = None,
) -> tuple[dict, list[str]]:
    """Receive round-``t`` messages of ``kind`` from every live neighbour
    (``ctx.neighbours()``) until ``deadline``; messages of non-neighbours are rejected
    and counted (``not_neighbour``).  An update that arrived from a neighbour which has
    left since (``ctx.is_neighbour``: it sent its last round and went offline) counts.

    With a ``market`` (:mod:`dfl_agent.algorithms.market`), its synchronization strategy
    decides when the round proceeds and which queued updates it takes; the newest
    taken update of each sender is returned (empty partial-participation updates are
    left out, and their senders are not missing).  Without one: ``one_from_each``.

    Messages whose tensors do not match ``template`` (names/shapes/dtypes; names in
    ``extra_tensors`` may come in addition and are not checked here) or whose
    ``meta["samples"]`` is not a positive number are rejected and counted.

    Returns:
        ``({sender: message}, missing_peer_ids)``.
    """
    if market is not None:
        res = await market.collect(
            ctx, kind, t, deadline=deadline, poll=poll,
            validate=lambda m: update_problem(m, template, extra_tensors),
        )
        return res.latest(), res.missing
    got: dict[str, Message] = {}

    def intake(msg: Message) -> None:
        if msg.sender not in neighbours and not ctx.is_neighbour(msg.sender):
            ctx.reject(msg, "not_neighbour: sender is not a neighbour")
            return
        problem = update_problem(msg, template, extra_tensors)
        if problem:
            ctx.reject(msg, problem)
            return
        got[msg.sender] = msg

    while True:
        neighbours = ctx.neighbours()
        now = ctx.clock.now()
        # what already arrived counts, also from a neighbour that has left since
        while (msg := await ctx.receive(kind, round=t, deadline=now)) is not None:
            intake(msg)
        missing = [p for p in neighbours if p not in got]
        if not missing or now >= deadline:
            return got, missing
        msg = await ctx.receive(kind, round=t, deadline=min(deadline, now + poll))
        if msg is not None:
            intake(msg)


@register
class FedAvg(Algorithm):
    """Decentralized FedAvg gossip over all live peers (neighbourhood = everyone)."""

    name = "fedavg"
    traits = Traits("neighbourhood", same_architecture=True, choco_gossip=True)
    Options = FedAvgOptions

    async def setup(self) -> None:
        self.model = self.new_model()
        self.market = UpdateMarket.from_options(self.options)
        self.choco = gc.choco_for(self.ctx, MODEL_KIND)  # compressed gossip (issue 8), None = raw models
        # bad updates are dropped on arrival; only good ones are catch-up evidence
        self.ctx.check_on_arrival(MODEL_KIND, arrival_check(shape_template(model_to_numpy(self.model))))
        if self.choco is not None and self.options.participation:
            raise ValueError("algorithm.options.participation: partial participation cannot be combined with "
                             "compressed gossip (CHOCO needs every neighbour to receive every difference)")

    async def round(self, t: int) -> dict[str, Any]:
        ctx, d = self.ctx, self.ctx.data
        stats = await ctx.compute(train_local, self.model, d.train_x, d.train_y, ctx.train, ctx.rng, ctx.device)
        own = model_to_numpy(self.model)
        n_own = int(len(d.train_y))
        if self.options.participation:  # partial device participation (seed 003 §3.6.4)
            await send_with_participation(ctx, MODEL_KIND, t, own, {"samples": n_own}, self.options.participation)
        else:
            await ctx.broadcast(gc.model_message(self.choco, MODEL_KIND, t, own, {"samples": n_own}),
                                neighbours_only=True)
        deadline = ctx.clock.now() + self.options.round_timeout
        got, missing = await collect_round(
            ctx, MODEL_KIND, t, deadline, self.options.poll_interval, own, market=self.market
        )
        got = gc.received_copies(ctx, self.choco, got)
        senders = sorted(got)
        base = gc.own_for_mixing(self.choco, own)
        o = self.options
        with self.divergence_guard("aggregation") as guard:  # a non-finite aggregate is undone
            avg, _ = robust_aggregate(base, [got[s].tensors for s in senders],
                                      [n_own] + [got[s].meta["samples"] for s in senders],
                                      o.aggregation, clip_norm=o.clip_norm, trim_ratio=o.trim_ratio)
            load_numpy(self.model, gc.finish_mixing(self.choco, own, avg))
        used = [] if guard.diverged else senders
        return {"train_loss": stats["loss"], "neighbours": len(used), "neighbour_ids": used,
                "missing": missing, **(self.market.last.info() if self.market.last is not None else {})}

    def catches_up(self) -> bool:
        """Lock-step gossip: with round-``t`` updates only (``max_staleness = 0``) a node
        behind its neighbours gets nothing from them, so it skips to their round."""
        return self.market.max_staleness == 0

    def deployable_model(self) -> nn.Module:
        return self.model

    def status(self) -> dict[str, Any]:
        return self.market.status()
