"""Neighbourhood gossip: the round structure of ``fedavg``, ``dechw``, ``dechetero`` and
``cfa`` (Algorithm 1 of seed 001, App. C).

Every node holds one model on a communication graph (``ctx.neighbours()``: the
configured graph ∩ live peers, or all live peers without a graph).  A round trains
locally, sends the model to the neighbours, collects their models until the round
deadline (or as the synchronization strategy of
:mod:`dfl_agent.algorithms.protocols.synchronization` decides) and replaces the model by
an aggregate of the neighbourhood N_i ∪ {i}; a round proceeds with whatever arrived.
Only the aggregation rule differs between the algorithms (:meth:`NeighbourhoodAlgorithm.aggregate`).

Two orders of the same steps:

- ``train_first = False`` (DecHW's Algorithm 1, the default): a first training and send
  before round 1 (lines 1-4), then each round t collects the neighbours' round-(t-1)
  messages, aggregates, trains and sends its round-t model (lines 6-11);
- ``train_first = True`` (FedAvg gossip, McMahan et al. 2017 over the neighbourhood):
  each round t trains, sends, collects the neighbours' round-t models and aggregates.

Message ``kind="model"``, ``round=t``: tensors = the model's ``state_dict`` plus the
algorithm's extra tensors (:meth:`NeighbourhoodAlgorithm.extra_names`); ``meta`` carries
``samples`` = |D_i|.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from dfl_agent.algorithms import gossip_compression as gc
from dfl_agent.algorithms.base import Algorithm
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.synchronization import (
    SyncOptions,
    UpdateMarket,
    is_empty,
    send_with_participation,
    suspend_deadline,
    waits_alone,
)
from dfl_agent.learning.params import IncompatibleUpdate, check_compatible, load_numpy, model_to_numpy
from dfl_agent.learning.robust import check_options as check_robust_options
from dfl_agent.learning.robust import robust_aggregate
from dfl_agent.learning.training import train_local

DELIVERIES = ("auto", "unicast", "broadcast")
log = logging.getLogger(__name__)

MODEL_KIND = "model"
#: meta flag of a node's first model when it starts cold in a warm run (:meth:`NeighbourhoodAlgorithm._cold_start`)
COLD_KEY = "cold"


@dataclasses.dataclass
class GossipOptions(SyncOptions):
    """Options of every averaging gossip algorithm (``fedavg``, ``dechw``, ``dechetero``,
    ``cfa``), plus the synchronization options of
    :class:`dfl_agent.algorithms.protocols.synchronization.SyncOptions` (``sync``, ``participation``, ...).

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
        for key in ("round_timeout", "poll_interval"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        check_robust_options(self.aggregation, self.clip_norm, self.trim_ratio)


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
) -> tuple[dict, list[str]]:
    """Receive round-``t`` messages of ``kind`` from every live neighbour
    (``ctx.neighbours()``) until ``deadline`` (``one_from_each``, without an update market:
    the rounds of the neighbourhood family wait through ``ctx.collect``); messages of
    non-neighbours are rejected and counted (``not_neighbour``).  An update that arrived from
    a neighbour which has left since (``ctx.is_neighbour``: it sent its last round and went
    offline) counts.

    Messages whose tensors do not match ``template`` (names/shapes/dtypes; names in
    ``extra_tensors`` may come in addition and are not checked here) or whose
    ``meta["samples"]`` is not a positive number are rejected and counted.

    Returns:
        ``({sender: message}, missing_peer_ids)``.
    """
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

    budget = deadline - ctx.clock.now()
    while True:
        deadline = await suspend_deadline(ctx, deadline, budget, kind)  # none runs while the broker is away
        neighbours = ctx.neighbours()
        now = ctx.clock.now()
        # what already arrived counts, also from a neighbour that has left since
        while (msg := await ctx.receive(kind, round=t, deadline=now)) is not None:
            intake(msg)
        missing = [p for p in neighbours if p not in got]
        if (not missing and not waits_alone(ctx, neighbours or list(got))) or now >= deadline:
            held = await suspend_deadline(ctx, deadline, budget, kind)
            if held != deadline:  # the broker went away: wait on instead of closing alone
                deadline = held
                continue
            return got, missing
        msg = await ctx.receive(kind, round=t, deadline=min(deadline, now + poll))
        if msg is not None:
            intake(msg)


@dataclasses.dataclass
class NeighbourhoodOptions(GossipOptions):
    """Options shared by ``dechw``, ``dechetero`` and ``cfa``: those of
    :class:`GossipOptions` (round deadline, robust aggregation,
    synchronization strategy) plus ``delivery``.

    Attributes:
        delivery: how a model reaches the neighbours: ``unicast`` (one message per
            neighbour: bytes = degree × message), ``broadcast`` (one publish: over MQTT
            every peer receives it and non-neighbours reject it; the simulator delivers
            it to the neighbours only), or ``auto`` (default: broadcast
            when the neighbours are all the live peers, unicast otherwise).

    Robust ``aggregation`` here: in ``dechw``, ``clip`` clips before the Hessian
    weighting; ``median`` and ``trimmed_mean`` replace it.  In ``cfa``, ``clip`` clips
    before the consensus step; ``median``/``trimmed_mean`` replace it by the robust
    aggregate of N_i ∪ {i}.

    Raises:
        ValueError: an unknown ``delivery``, or an invalid inherited option.
    """

    delivery: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delivery not in DELIVERIES:
            raise ValueError(f"delivery must be one of {DELIVERIES}, got {self.delivery!r}")


class NeighbourhoodAlgorithm(Algorithm):
    """Algorithm 1 of seed 001 with a pluggable aggregation rule.

    Subclasses may override :meth:`aggregate` (default: the sample-weighted mean), :meth:`after_training`
    (extra tensors to send), :meth:`extra_names` (the names those may have) and
    :meth:`send_model` (how the model reaches the neighbours).
    """

    #: the order of a round's steps (module docstring): False = aggregate the neighbours'
    #: round-(t-1) models, then train and send (DecHW); True = train and send, then
    #: aggregate the neighbours' round-t models (FedAvg)
    train_first: ClassVar[bool] = False
    #: prefixes of received tensors that must stay >= 0 after CHOCO decoding (DecHW's Hessians)
    nonnegative: ClassVar[tuple[str, ...]] = ()

    async def setup(self) -> None:
        self.model = self.new_model()
        # bad updates are dropped on arrival; only good ones are catch-up evidence
        self._arrival = arrival_check(shape_template(model_to_numpy(self.model)), self.extra_names)
        self.ctx.check_on_arrival(MODEL_KIND, self.update_check)
        self.samples = self.sample_count()  # 1 under DP (dfl_agent.privacy.policy)
        self._bootstrapped = False
        self._cold_sent = self._rejoins = False  # this node's cold model sent; it re-joins (_cold_start)
        self.market = UpdateMarket.from_options(self.options)  # the round's wait: ctx.collect
        self.choco = gc.choco_for(self.ctx, MODEL_KIND)  # compressed gossip, None = raw models
        if self.choco is not None:  # an update dropped as stale still moves its sender's CHOCO copy
            self.market.on_drop = self._copy_dropped
        self.ctx.keep_late_updates(self.market.max_staleness)  # the inbox keeps the late updates it takes
        if self.choco is not None and self.options.participation:
            raise ValueError("algorithm.options.participation: partial participation cannot be combined with "
                             "compressed gossip (CHOCO needs every neighbour to receive every difference)")

    def _copy_dropped(self, msg: Message) -> None:
        if not is_empty(msg) and self.update_check(msg) is None:
            gc.received_copies(self.ctx, self.choco, {msg.sender: msg})

    # -- hooks --------------------------------------------------------------------
    def update_check(self, msg: Message) -> str | None:
        """Why a received model update cannot be used (``"reason: detail"``), or None: the
        model's tensor names, shapes and dtypes and a positive ``samples``
        (:func:`update_problem`; :meth:`extra_names` may come
        in addition).  Run on arrival (:meth:`NodeContext.check_on_arrival`)."""
        return self._arrival(msg)

    def extra_names(self) -> frozenset[str]:
        """Names of the tensors a message may carry besides the model's."""
        return frozenset()

    async def after_training(self, t: int) -> dict[str, np.ndarray]:
        """Called after the local training of round ``t`` (0 = Alg. 1's initial
        training); returns the extra tensors to send with the model."""
        return {}

    def aggregate(self, t: int, own: dict[str, np.ndarray], got: list[Message]) -> tuple[dict[str, np.ndarray], dict]:
        """The aggregation of round ``t`` (seed 001 Alg. 1 line 7) from the own model and the
        neighbours' messages (sorted by sender; round t-1, or round t with :attr:`train_first`).
        Returns ``(tensors, info)``: the new model's tensors (names and shapes of ``own``) and
        JSON-friendly round info.

        This default (``fedavg``, ``dechetero``) is the sample-weighted mean over N_i ∪ {i}
        (DecHW seed 001 Eq. 3: ``w_i = Σ_j τ_j w_j``, ``τ_j = |D_j| / Σ_k |D_k|``; FedAvg's
        rule, McMahan et al. 2017, seed 004 Eq. 9) with ``|D_j|`` = the sender's ``samples``,
        or the robust rule of the option ``aggregation`` (:mod:`dfl_agent.learning.robust`)."""
        o = self.options
        tensors, _ = robust_aggregate(own, [m.tensors for m in got], [self.samples] + [m.meta["samples"] for m in got],
                                      o.aggregation, clip_norm=o.clip_norm, trim_ratio=o.trim_ratio)
        return tensors, {}

    # -- protocol -------------------------------------------------------------------
    async def _train(self) -> dict[str, float]:
        ctx, d = self.ctx, self.ctx.data
        return await ctx.compute(train_local, self.model, d.train_x, d.train_y, ctx.train, ctx.rng, ctx.device)

    async def send_model(self, t: int, extra: Mapping[str, np.ndarray]) -> None:
        """Send the model of round ``t`` (with ``extra`` tensors) to the neighbours, as the
        option ``delivery`` says (or to ``participation`` of them, seed 003 §3.6.4)."""
        ctx = self.ctx
        tensors = {**model_to_numpy(self.model), **extra}
        meta = {"samples": self.samples, "hessian": bool(extra), **self.cold_meta()}
        neighbours = ctx.neighbours()
        if self.options.participation:  # partial device participation (seed 003 §3.6.4)
            await send_with_participation(ctx, MODEL_KIND, t, tensors, meta, self.options.participation, neighbours)
            return
        mode = self.options.delivery
        if mode == "auto":
            # the neighbours (live peers in the graph) are all the live peers
            mode = "broadcast" if len(neighbours) == ctx.live_peer_count() else "unicast"
        msg = gc.model_message(self.choco, MODEL_KIND, t, tensors, meta)  # once: CHOCO copies agree
        if mode == "broadcast":
            await ctx.broadcast(msg, neighbours_only=True)
        else:
            for peer in neighbours:
                await ctx.send(peer, dataclasses.replace(msg, meta=dict(msg.meta), msg_id=""))

    def cold_meta(self) -> dict[str, Any]:
        """``{"cold": True}`` for this node's first model when it starts cold in a warm run
        (:meth:`_cold_start`), else nothing: meta for :meth:`send_model`."""
        if not self.joins_cold or self._cold_sent:
            return {}
        self._cold_sent = True
        return {COLD_KEY: True}

    async def _train_and_send(self, t: int) -> dict[str, float]:
        stats = await self._train()
        if stats.get("diverged"):  # its model cannot be trained (it blew up): it re-joins from its neighbours'
            self.joins_cold, self._cold_sent, self._rejoins = True, False, True  # (see _cold_start)
        await self.send_model(t, await self.after_training(t))
        return stats

    async def round(self, t: int) -> dict[str, Any]:
        """Round ``t`` of seed 001 Algorithm 1 (lines 6-11: collect, aggregate with
        :meth:`aggregate`, train, send), or of FedAvg gossip with :attr:`train_first`
        (train, send, collect round ``t``, aggregate).  Returns the round's info (train
        loss, neighbours used, missing neighbours, the aggregation's and the wait's info)."""
        if self.train_first:
            stats = await self._train_and_send(t)
        elif not self._bootstrapped:  # Alg. 1 lines 2-4: train, Ĥ⁽⁰⁾, send (as round t-1)
            self._bootstrapped = True
            await self._train_and_send(t - 1)
        collect = t if self.train_first else t - 1
        own = model_to_numpy(self.model)
        c = await self.ctx.collect(MODEL_KIND, collect, market=self.market, round_timeout=self.options.round_timeout,
                                   poll=self.options.poll_interval, accept=self.update_check, decode=self._decode)
        got, cold = self._cold_start(c.updates, own)
        with self.divergence_guard("aggregation") as guard:  # a non-finite aggregate is undone
            info: dict[str, Any] = {}
            if not cold.get("adopted"):
                tensors, info = self.aggregate(t, gc.own_for_mixing(self.choco, own), [got[s] for s in sorted(got)])
                load_numpy(self.model, gc.finish_mixing(self.choco, own, tensors))
        used = [] if guard.diverged else sorted(got)
        if not self.train_first:
            stats = await self._train_and_send(t)  # Alg. 1 lines 9-11
        # the round's updates are let go with it: the market's last collection would otherwise
        # hold every neighbour's message (and its frame) until the next round's collection
        self.market.last = None
        return {"train_loss": stats["loss"], "neighbours": len(used), "neighbour_ids": used, "missing": c.missing,
                **info, **{k: v for k, v in cold.items() if k != "adopted"}, **c.info,
                "participants_expected": len(set(got) | set(c.missing)), "participants_used": len(used),
                "late_used": sum(1 for s in used if s in c.late),
                "late_weights": [[s, round(got[s].meta["staleness_weight"], 4)] for s in used
                                 if s in c.late and "staleness_weight" in got[s].meta]}

    def _decode(self, raw: dict[str, Message]) -> dict[str, Message]:
        """The taken updates as the neighbours' models (CHOCO copies, :func:`gc.received_copies`)."""
        return gc.received_copies(self.ctx, self.choco, raw, nonnegative=self.nonnegative)

    def _cold_start(self, got: dict[str, Message], own: Mapping[str, np.ndarray]) -> tuple[dict[str, Message], dict]:
        """Warm start across the federation: a model flagged ``cold`` (fresh weights in a
        run meant to start from the deployed models) would drag a warm-started node's
        average towards a random initialisation, so a warm node leaves it out of this
        aggregation (its CHOCO copy was updated all the same); a node that starts cold
        itself, and heard from warm neighbours, adopts their sample-weighted mean instead
        of its own weights (its next message is then a keyframe).  When every model is
        cold (a federation's first run) the round aggregates as usual.

        A node whose local training diverged this round (:meth:`_train_and_send`: its model
        blew up, and the step was undone) re-joins the same way: its update goes out flagged
        ``cold``, so its neighbours leave it out, and it adopts their mean (``cold_start``
        ``"diverged"`` in the round's info, and a WARNING).  When every model is cold (the
        whole federation blew up) the round aggregates as usual.

        Returns:
            ``(got, info)``: the messages to aggregate, and ``cold_excluded`` (senders left
            out) or ``adopted`` (senders whose mean this node took) for the round's info.
        """
        cold = sorted(s for s, m in got.items() if m.meta.get(COLD_KEY) is True)
        warm = [s for s in sorted(got) if s not in cold]
        me_cold, self.joins_cold = self.joins_cold, False
        rejoins, self._rejoins = self._rejoins, False
        if not me_cold:
            return ({s: got[s] for s in warm}, {"cold_excluded": cold}) if cold else (got, {})
        if not warm:
            return got, {}  # every model is cold: the federation's first run
        weights = np.array([float(got[s].meta.get("samples", 1.0)) for s in warm], np.float64)
        weights /= weights.sum()
        mean = {k: np.sum([w * np.asarray(got[s].tensors[k], np.float64) for w, s in zip(weights, warm)], axis=0)
                .astype(np.asarray(v).dtype) for k, v in own.items()}
        load_numpy(self.model, mean)
        if self.choco is not None:
            self.choco.own = None  # the neighbours' copy of this node is its cold model: a keyframe next
        if rejoins:
            log.warning("local training diverged: took the mean of %d neighbours' models (%s) instead of this "
                        "node's", len(warm), ", ".join(warm))
            return {s: got[s] for s in warm}, {"adopted": warm, "cold_start": "diverged"}
        log.info("cold start: no deployed model fits this run; took the mean of %d warm neighbours' models "
                 "(%s)", len(warm), ", ".join(warm))
        return {s: got[s] for s in warm}, {"adopted": warm, "cold_start": "adopted"}

    def catches_up(self) -> bool:
        """Lock-step gossip: with round-``t`` updates only (``max_staleness = 0``) a node
        behind its neighbours gets nothing from them, so it skips to their round; under
        ``runtime.straggler = "quorum"`` a slow node skips too, so that its updates reach
        the others within ``max_staleness`` rounds."""
        return self.market.max_staleness == 0 or self.ctx.quorum

    def status(self) -> dict[str, Any]:
        return self.market.status()


