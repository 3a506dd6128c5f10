"""Rounds led by a rotating aggregator (token holder), without any server.

This is the coordination of DFML (seed 000 Alg. 1, App. A.2), its decentralized
FedAvg/FedProx baselines (Alg. 2) and the serverless FedD2S of ALGORITHMS.md.
Subclasses of :class:`RotatingAggregator` only say what a participant contributes,
how the aggregator aggregates and how a participant applies its update.

Protocol of round t (message kinds are prefixed with the algorithm's name):

1. The aggregator a draws the senders S (``sender_ratio`` of its live peers, itself
   excluded) and the next aggregator (uniformly among its live peers), and sends
   ``invite`` to each sender.  Round 1's aggregator is the lowest live node id.
2. Each sender does its local update and replies ``model`` (or ``decline`` if it is
   already busy with round t); a sender that does not answer by ``invite_timeout``
   is left out of the round.  a does its own local update meanwhile.
3. a aggregates and sends every sender its ``update``, applies its own, then
   broadcasts ``done`` (round t, next aggregator, token state).  The ``done`` message
   *is* the token: the node it names leads round t+1.
4. Every node that sees ``done`` for a newer round records it (end of round t).

Failover.  A node that sees no round complete for ``token_timeout`` seconds, and is
the lowest id among the live nodes it knows, leads the next round itself with the
latest token state it saw.  Two aggregators can then briefly coexist; the rule
"a newer round wins, for the same round the lower aggregator id wins" resolves it:
an aggregator that learns of a better ``done`` for its round before it has sent its
updates abandons the round, and a node designated by a worse ``done`` does not lead.
A participant applies an update only for a round newer than the last one it applied,
so no round is ever applied twice by a node.  Every wait has a deadline.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Awaitable, Mapping
from typing import Any, ClassVar

import numpy as np

from dfl_agent.algorithms.base import Algorithm
from dfl_agent.algorithms.context import Message, NodeContext
from dfl_agent.algorithms.protocols.stragglers import AdaptiveDeadline, adaptive_deadline
from dfl_agent.learning import d2s
from dfl_agent.learning.params import IncompatibleUpdate, check_compatible

log = logging.getLogger(__name__)

Tensors = dict[str, np.ndarray]


@dataclasses.dataclass
class RotationOptions:
    """Coordination options shared by every rotating-aggregator algorithm.

    Attributes:
        sender_ratio: fraction of the aggregator's live peers drawn as senders (seed: 50%).
        invite_timeout: seconds the aggregator waits for the senders' models.
        update_timeout: seconds a sender waits for its updated model after sending.
        token_timeout: seconds without a completed round after which the lowest live
            node leads the next round (failover).
    """

    sender_ratio: float = 0.5
    invite_timeout: float = 60.0
    update_timeout: float = 300.0
    token_timeout: float = 120.0

    def __post_init__(self) -> None:
        if not 0.0 < self.sender_ratio <= 1.0:
            raise ValueError(f"sender_ratio must be in (0, 1], got {self.sender_ratio}")
        for key in ("invite_timeout", "update_timeout", "token_timeout"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")


def _json_scalars(info: dict[str, Any]) -> dict[str, Any]:
    """The finite JSON scalars of ``info`` (NaN/Inf would make the envelope invalid)."""
    return {k: v for k, v in info.items()
            if isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v))}


def _completion_times(info: dict[str, Any]) -> list[float]:
    """The senders' completion times a round's ``done`` carries (``completion_s``: seconds
    from the invitations to each contribution, comma-separated); [] when absent or bad."""
    try:
        times = [float(s) for s in str(info.get("completion_s", "")).split(",") if s]
    except ValueError:
        return []
    return [s for s in times if math.isfinite(s)]


@dataclasses.dataclass(frozen=True)
class Done:
    """A completed round as announced by its aggregator (the token)."""

    round: int
    aggregator: str
    next: str
    token: dict[str, Any]
    info: dict[str, Any]
    tensors: Tensors = dataclasses.field(default_factory=dict, compare=False)  # see token_tensors

    def beats(self, other: Done | None) -> bool:
        """Newer round wins; for the same round, the lower aggregator id wins."""
        if other is None:
            return True
        return self.round > other.round or (self.round == other.round and self.aggregator < other.aggregator)


class RotatingAggregator(Algorithm):
    """Base class: one node's side of the rotating-aggregator protocol.

    Subclasses implement :meth:`local_update`, :meth:`contribution`,
    :meth:`check_contribution`, :meth:`aggregate` and :meth:`apply_update`, and may
    override :meth:`initial_token` / :meth:`next_token` (schedule state that travels
    with the token), :meth:`select` (who takes part), :meth:`invite_payload` /
    :meth:`accept_invite` (what an invitation carries) and :meth:`token_tensors`
    (tensors that travel with ``done``, e.g. FedD2S's global model).  The defaults are
    DFML's behaviour.
    """

    Options = RotationOptions
    GRACE = 5.0  # s a sender still waits for its update after its aggregator's ``done``

    def __init__(self, ctx: NodeContext, options: Any = None):
        super().__init__(ctx, options)
        p = self.name
        self.K_INVITE, self.K_MODEL, self.K_DECLINE = f"{p}.invite", f"{p}.model", f"{p}.decline"
        self.K_UPDATE, self.K_DONE = f"{p}.update", f"{p}.done"
        self.rounds = 0
        self.completed = 0  # newest round known to be complete
        self.applied = 0  # newest round whose update this node applied
        self.best: Done | None = None
        self.role = "peer"
        self._participated: set[int] = set()
        #: round -> ids whose contributions this node's model took in that round: the
        #: aggregator's contributors, or a sender's aggregator (metrics ``neighbour_ids``)
        self._used: dict[int, list[str]] = {}
        self._awaiting_update = 0  # the round whose update this sender waits for (0: none)
        self._deferred: Done | None = None  # its ``done``, reported after the update
        self._lead_next: tuple[int, dict[str, Any]] | None = None
        self._last_progress = 0.0
        self._reported = 0
        self.deadlines: AdaptiveDeadline | None = None  # runtime.straggler = "quorum" (set in run); None: paper

    # -- hooks for subclasses --------------------------------------------------------
    def initial_token(self) -> dict[str, Any]:
        """Token state for round 1 (e.g. DFML's α schedule)."""
        return {}

    def next_token(self, t: int, token: dict[str, Any]) -> dict[str, Any]:
        """Token state to hand over after round ``t`` was led with ``token``."""
        return token

    def select(self, t: int, token: dict[str, Any], live: list[str]) -> tuple[list[str], bool, str]:
        """Who takes part in round ``t``: ``(senders (self excluded), whether this node takes
        part itself, next aggregator)``.  Default (DFML): ``sender_ratio`` of the live peers
        drawn with the node's rng, the aggregator always takes part, the next aggregator
        uniform among the live peers that may aggregate (their profile's roles)."""
        ctx = self.ctx
        k = min(len(live), max(1, math.ceil(self.options.sender_ratio * len(live)))) if live else 0
        senders = sorted(ctx.rng.choice(live, size=k, replace=False).tolist()) if k else []
        leaders = [p for p in live if self._may_aggregate(p)]  # device profiles: aggregator role
        nxt = str(ctx.rng.choice(leaders)) if leaders else ctx.node_id
        return senders, True, nxt

    def invite_payload(self, t: int, token: dict[str, Any]) -> tuple[Tensors, dict[str, Any]]:
        """Tensors and meta the aggregator sends with each ``invite`` (default: none)."""
        return {}, {}

    def accept_invite(self, invite: Message) -> None:
        """Read an ``invite`` before :meth:`local_update`; raise ``ValueError`` to decline it
        (the invite is counted as rejected)."""

    def token_tensors(self, t: int) -> Tensors:
        """Tensors broadcast with round ``t``'s ``done`` (default: none); a node finds the
        ones of the best ``done`` it saw in ``self.best.tensors``."""
        return {}

    def round_evidence(self) -> dict[str, Any]:
        """This node's own counters added to each round record (JSON scalars), e.g.
        FedD2S's distillations so far (default: none)."""
        return {}

    async def local_update(self, t: int) -> dict[str, Any]:
        """A participant's local training before it contributes (info for metrics)."""
        raise NotImplementedError

    def contribution(self, t: int) -> tuple[Tensors, dict[str, Any]]:
        """What a participant sends to the aggregator: (tensors, JSON meta)."""
        raise NotImplementedError

    def check_contribution(self, msg: Message) -> None:
        """Raise ``ValueError`` (e.g. IncompatibleUpdate) if a sender's model is unusable."""

    async def aggregate(
        self, t: int, token: dict[str, Any], contributions: dict[str, Message]
    ) -> tuple[dict[str, tuple[Tensors, dict[str, Any]]], dict[str, Any]]:
        """Aggregate the own state and ``contributions`` (sender -> message).

        Returns ``({node_id: (tensors, meta)} for every sender and for this node, info)``.
        """
        raise NotImplementedError

    def apply_update(self, t: int, tensors: Tensors, meta: dict[str, Any]) -> Awaitable[None] | None:
        """Apply the aggregator's update for round ``t`` (called at most once per round).
        May be a coroutine function (e.g. FedD2S trains while applying)."""
        raise NotImplementedError

    async def _apply(self, t: int, tensors: Tensors, meta: dict[str, Any]) -> None:
        """:meth:`apply_update` under the divergence guard: an update that leaves a
        non-finite model is undone (the node keeps its model) and counted."""
        with self.divergence_guard("update"):
            res = self.apply_update(t, tensors, meta)
            if inspect.isawaitable(res):
                await res

    # -- the protocol ----------------------------------------------------------------
    def _now(self) -> float:
        return self.ctx.clock.now()

    def _may_aggregate(self, node: str) -> bool:
        """Device profiles: a node without the aggregator role never leads (default: all may)."""
        return self.ctx.may_aggregate(node)

    def _lowest_live(self) -> str:
        nodes = [self.ctx.node_id, *self.ctx.live_peers()]
        return min([n for n in nodes if self._may_aggregate(n)] or nodes)

    async def run(self, rounds: int, start_round: int = 1) -> None:
        self.rounds = rounds
        self.deadlines = adaptive_deadline(self.ctx)  # None: the paper's invite_timeout
        self.completed = max(self.completed, start_round - 1)
        self._reported = max(self._reported, self.completed)
        self._last_progress = self._now()
        if self.completed == 0 and self._lowest_live() == self.ctx.node_id:
            self._lead_next = (1, self.initial_token())
        while self.completed < rounds:
            if self._lead_next is not None:
                t, token = self._lead_next
                self._lead_next = None
                if t == self.completed + 1:
                    await self._lead(t, token)
                continue
            self.role = "peer"
            msg = await self.ctx.receive(
                (self.K_INVITE, self.K_DONE), deadline=self._last_progress + self.options.token_timeout
            )
            if msg is None:
                self._on_token_timeout()
            elif msg.kind == self.K_DONE:
                await self._on_done(msg)
            else:
                await self._participate(msg)

    def _on_token_timeout(self) -> None:
        self._last_progress = self._now()
        if self._lowest_live() == self.ctx.node_id:
            token = self.best.token if self.best is not None else self.initial_token()
            log.warning("%s: no round completed for %.0fs; leading round %d (failover); live %s",
                        self.ctx.node_id, self.options.token_timeout, self.completed + 1, self.ctx.live_peers())
            self._lead_next = (self.completed + 1, token)

    async def _on_done(self, msg: Message) -> None:
        m = msg.meta
        if not (isinstance(m.get("next"), str) and isinstance(m.get("token"), dict)):
            self.ctx.reject(msg, "bad_meta: done")
            return
        info = m.get("info")
        await self._record(Done(msg.round, msg.sender, m["next"], m["token"], info if isinstance(info, dict) else {},
                                dict(msg.tensors)))

    async def _record(self, done: Done) -> None:
        if done.beats(self.best):
            self.best = done
        if done.round > self.completed:
            self.completed = done.round
            self._last_progress = self._now()
            if self.deadlines is not None:  # every node learns the senders' completion times, not only aggregators
                self.deadlines.observe(_completion_times(done.info))
        best = self.best
        if best is not None and best.round == self.completed and best.next == self.ctx.node_id:
            if self.completed < self.rounds and (self._lead_next is None or self._lead_next[0] <= self.completed):
                self._lead_next = (self.completed + 1, best.token)
        if self.completed > self._reported:
            if self._awaiting_update == self.completed:
                # a sender whose update (another topic) trails its aggregator's ``done``:
                # reported once the update is applied or given up (end of _participate)
                self._deferred = done
                return
            await self._report(done)

    async def _report(self, done: Done) -> None:
        """End round ``self.completed`` in the metrics (``done`` announced it)."""
        # a node that missed rounds (restart, lost messages) reports only the newest
        self._reported = self.completed
        self._deferred = None
        used = self._used.pop(done.round, [])
        for r in [r for r in self._used if r < done.round]:
            del self._used[r]
        info = {"aggregator": done.aggregator, "participated": done.round in self._participated,
                "neighbour_ids": used,
                **{k: v for k, v in done.info.items() if isinstance(v, (int, float, str, bool))},
                **self.round_evidence()}
        await self.ctx.end_round(self.completed, **info)

    def _beaten(self, aggregator: str, t: int) -> bool:
        """True when ``aggregator``'s round ``t`` loses to the best ``done`` seen."""
        b = self.best
        return b is not None and (b.round > t or (b.round == t and b.aggregator < aggregator))

    async def _participate(self, invite: Message) -> None:
        t, agg = invite.round, invite.sender
        gate = self.ctx.gate  # device profiles: a gated node declines at once
        if t <= self.completed or t <= self.applied or t in self._participated or (gate is not None and gate()):
            await self.ctx.send(agg, Message(self.K_DECLINE, t))
            return
        try:
            self.accept_invite(invite)
        except ValueError as exc:
            self.ctx.reject(invite, f"incompatible: {exc}")
            await self.ctx.send(agg, Message(self.K_DECLINE, t))
            return
        self._participated.add(t)
        self.role = "sender"
        self._awaiting_update = t
        try:
            await self._contribute(t, agg)
        finally:
            self._awaiting_update = 0
        deferred = self._deferred
        if deferred is not None and self.completed > self._reported:
            await self._report(deferred)

    async def _contribute(self, t: int, agg: str) -> None:
        """A sender's part of round ``t``: local update, send, wait for the update, apply it."""
        await self.local_update(t)
        tensors, meta = self.contribution(t)
        await self.ctx.send(agg, Message(self.K_MODEL, t, tensors, meta))
        deadline = self._now() + self.options.update_timeout
        while True:
            msg = await self.ctx.receive((self.K_UPDATE, self.K_DONE), deadline=deadline)
            if msg is None:
                log.warning("%s: no update from aggregator %s for round %d; going on", self.ctx.node_id, agg, t)
                return
            if msg.kind == self.K_DONE:
                await self._on_done(msg)
                if msg.sender == agg and msg.round == t:
                    # our aggregator announced; its update to us (another topic) may trail it
                    deadline = min(deadline, self._now() + self.GRACE)
                elif self._beaten(agg, t):
                    return  # our aggregator loses round t to another one: no update will come
                continue
            if msg.sender != agg or msg.round != t:
                self.ctx.reject(msg, "unexpected: update")
                continue
            if t > self.applied:
                try:
                    await self._apply(t, msg.tensors, msg.meta)
                    self.applied = t
                    self._used[t] = [agg]
                except ValueError as exc:
                    self.ctx.reject(msg, f"incompatible: {exc}")
            return

    async def _lead(self, t: int, token: dict[str, Any]) -> None:
        ctx = self.ctx
        self.role = "aggregator"
        live = ctx.live_peers()
        senders, self_too, nxt = self.select(t, token, live)
        if self_too:
            self._participated.add(t)
        inv_tensors, inv_meta = self.invite_payload(t, token)
        for s in senders:
            await ctx.send(s, Message(self.K_INVITE, t, inv_tensors, inv_meta))
        if self_too:
            await self.local_update(t)
        contributions: dict[str, Message] = {}
        pending = set(senders)
        timeout, late, arrivals = self.options.invite_timeout, 0, []
        if self.deadlines is not None:  # adaptive, at most runtime.max_round_timeout and invite_timeout
            timeout = self.deadlines.timeout(min(self.deadlines.high, timeout))
        start = self._now()
        deadline = start + timeout
        while pending:
            msg = await ctx.receive((self.K_MODEL, self.K_DECLINE, self.K_DONE), deadline=deadline)
            if msg is None:
                break
            if msg.kind == self.K_DONE:
                await self._on_done(msg)
                if self._beaten(ctx.node_id, t):
                    log.info("%s: round %d was completed elsewhere; abandoning it", ctx.node_id, t)
                    return
                continue
            if msg.round != t or msg.sender not in pending:
                late += int(msg.kind == self.K_MODEL and msg.round < t)
                continue  # late answer to an older round: its round was closed without it
            pending.discard(msg.sender)
            arrivals.append(self._now() - start)
            if msg.kind == self.K_MODEL:
                try:
                    self.check_contribution(msg)
                except ValueError as exc:
                    ctx.reject(msg, f"incompatible: {exc}")
                    continue
                contributions[msg.sender] = msg
        with self.divergence_guard("aggregation"):  # the aggregator's own models stay finite
            updates, info = await self.aggregate(t, token, contributions)
        while (msg := await ctx.receive(self.K_DONE, deadline=self._now())) is not None:  # every done buffered
            await self._on_done(msg)
        if self._beaten(ctx.node_id, t):
            log.info("%s: round %d was completed elsewhere; abandoning it", ctx.node_id, t)
            return
        for s in contributions:
            tensors, meta = updates[s]
            await ctx.send(s, Message(self.K_UPDATE, t, tensors, meta))
        if self_too and ctx.node_id in updates and t > self.applied:
            own_tensors, own_meta = updates[ctx.node_id]
            await self._apply(t, own_tensors, own_meta)
            self.applied = t
            self._used[t] = sorted(contributions)
        nxt_token = self.next_token(t, token)
        info = {**info, "participants": len(contributions) + int(self_too), "missing": sorted(pending),
                "contributors": ",".join(sorted(contributions)),
                "participants_expected": len(senders) + int(self_too),
                "participants_used": len(contributions) + int(self_too), "late_used": 0, "late_dropped": late,
                "deadline_s": round(timeout, 3), "completion_s": ",".join(f"{s:.3f}" for s in arrivals)}
        meta = {"next": nxt, "token": nxt_token, "info": _json_scalars(info)}
        tok_tensors = self.token_tensors(t)
        await ctx.broadcast(Message(self.K_DONE, t, tok_tensors, meta=meta))
        await self._record(Done(t, ctx.node_id, nxt, nxt_token, info, dict(tok_tensors)))

    def status(self) -> dict[str, Any]:
        return {"role": self.role, "round_completed": self.completed, "applied": self.applied}

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Models (base class) plus the rotation state: newest completed and applied
        round, and the best ``done`` seen (its token carries e.g. DFML's α schedule,
        needed to lead a failover round after a restart)."""
        tensors, meta = super().state_dict()
        b = self.best
        meta["rotation"] = {
            "completed": self.completed, "applied": self.applied,
            "best": None if b is None else {"round": b.round, "aggregator": b.aggregator, "next": b.next,
                                            "token": b.token, "info": _json_scalars(b.info)},
        }
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        super().load_state_dict(tensors, meta)
        rot = meta.get("rotation")
        if not isinstance(rot, dict):
            raise ValueError("checkpoint has no rotation state")
        self.completed = self._reported = int(rot["completed"])
        self.applied = int(rot["applied"])
        b = rot.get("best")
        self.best = None if b is None else Done(int(b["round"]), str(b["aggregator"]), str(b["next"]),
                                                dict(b["token"]), dict(b["info"]))


# -- one global state carried with the token (FedD2S, FedPer) ------------------------------
GLOBAL_STREAM = 0xD25  # domain separator of the global-model seed and the per-round draw


def global_init_seed(seed: int) -> int:
    """Torch seed of the initial global model θ^g, the same on every node (from the federation seed)."""
    return int(np.random.SeedSequence([int(seed), GLOBAL_STREAM]).generate_state(1)[0])


def draw_round(seed: int, t: int, nodes: list[str], ratio: float) -> tuple[list[str], np.random.Generator]:
    """Participants of round ``t``: ⌈ρN⌉ of ``nodes`` without replacement (seed 002 Alg. 1
    line 2), from a generator seeded with (federation seed, t).

    Returns ``(sorted participants, the generator)``; the caller draws the next holder from
    the same generator afterwards.  The serverless holder and the centralized reference
    both call this, so they draw the same participants.
    """
    nodes = sorted(nodes)
    rng = np.random.default_rng([int(seed), GLOBAL_STREAM, int(t)])
    k = d2s.ceil_count(ratio, len(nodes))
    return sorted(rng.choice(nodes, size=k, replace=False).tolist()), rng


class GlobalModelRotation(RotatingAggregator):
    """Rotating-aggregator rounds that carry one global state θ^g with the token.

    Shared by ``fedd2s`` (θ^g = the global model) and ``fedper`` (θ^g = the shared base).
    The holder draws the participants with :func:`draw_round` (``sender_ratio`` = ρ over
    all live nodes, itself included in the draw), sends θ^g with each invite, and
    broadcasts the new θ^g with ``done``.
    """

    #: the θ^g this node produced is checked and restored with the models by the
    #: divergence guard of its aggregation (a non-finite θ^g is never broadcast)
    guarded_state: ClassVar[tuple[str, ...]] = ("_theta_out",)

    def initial_global(self) -> Tensors:
        """θ^g before round 1 (the same on every node)."""
        raise NotImplementedError

    def current_global(self) -> Tensors:
        """The newest θ^g this node knows: that of the best ``done`` seen, else the initial one."""
        if self.best is not None and self.best.tensors:
            try:
                check_compatible(self.best.tensors, self._template)
                return self.best.tensors
            except IncompatibleUpdate as exc:
                log.warning("%s: global state of round %d unusable (%s)", self.ctx.node_id, self.best.round, exc)
        return self._initial

    def _init_global(self) -> None:
        self._initial = self.initial_global()
        self._template = self._initial
        self._theta_in: Tensors | None = None  # θ^g received for the round being worked on
        self._theta_out: Tensors = {}  # θ^g produced by the round this node led

    def select(self, t: int, token: dict[str, Any], live: list[str]) -> tuple[list[str], bool, str]:
        me = self.ctx.node_id
        participants, rng = draw_round(self.ctx.seed, t, [me, *live], self.options.sender_ratio)
        leaders = [p for p in live if self._may_aggregate(p)]  # device profiles: aggregator role
        nxt = str(rng.choice(leaders)) if leaders else me
        self._theta_in = self.current_global()
        return [p for p in participants if p != me], me in participants, nxt

    def invite_payload(self, t: int, token: dict[str, Any]) -> tuple[Tensors, dict[str, Any]]:
        assert self._theta_in is not None
        return self._theta_in, {}

    def accept_invite(self, invite: Message) -> None:
        check_compatible(invite.tensors, self._template)
        self._theta_in = invite.tensors

    def check_contribution(self, msg: Message) -> None:
        check_compatible(msg.tensors, self._template)

    def token_tensors(self, t: int) -> Tensors:
        return self._theta_out
