"""The model update market and its synchronization strategies (seed 003, MoDeFL thesis §3.6.3).

Received updates queue per sender (``putUpdate()``); a *synchronization strategy*
decides when a round's aggregation may proceed and which queued updates it takes
(``get()``, Fig. 3.3):

==========================  ===========================================================
``one_from_each``           one update from every neighbour (strictly synchronous)
``available``               every update queued now, no waiting (asynchronous)
``min_one_from_each``       every update queued, but at least one from each neighbour
``one_from_min_percent``    one update from at least ⌈p·|neighbours|⌉ neighbours
``min_k``                   every update queued, but at least k in total
``one_from_each_t``         one from each neighbour, or whatever arrived by a timeout
==========================  ===========================================================

On real devices every strategy also has a *deadline* (ALGORITHMS.md): when it passes,
the round proceeds with whatever the strategy can take, so no round waits forever
for a dead peer.  Neighbours are re-read while waiting (``ctx.neighbours()`` or the
caller's ``peers``): a peer whose presence went away stops being waited for, and
``min_k`` never asks for more updates than there are live neighbours.

A lost broker is not a deadline: while this node's broker is away its peers' presence
goes away too (their last wills, or silence), and closing the round then would close it
alone.  :func:`suspend_deadline` holds the wait instead (the context's ``hold_round``:
paused until the broker is back and the expected neighbours with it) and moves the
deadline by the time held, leaving the round at least ``min(its timeout, the context's
reconnect_grace)`` after the node resumes for the updates its peers re-send.

Rounds: an update is *eligible* for target round t when
``t − max_staleness <= update.round <= t``.  Updates of later rounds stay queued for
their round (under the quorum, unless a quorum of neighbours is past t: see
:meth:`UpdateMarket.ahead_round`); older ones are dropped (counted ``stale``).  With ``max_staleness = 0``
(default) only round-t updates count, which is the lock-step behaviour of the
averaging algorithms before the market existed.  A sender's queue keeps at most
``max_queue`` updates (oldest dropped, counted ``overflow``).

Partial device participation (§3.6.4): :func:`select_participants` draws k random
neighbours that receive the model; the others receive an *empty update*
(``meta["empty"] = True``, no tensors), which counts as "arrived" for the strategies
but is not aggregated, so nobody waits for a model that was never sent.

This module knows nothing about models: the caller validates updates
(``validate(msg) -> reason | None``) and aggregates what :meth:`UpdateMarket.collect`
returns.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import numpy as np

from dfl_agent.algorithms.context import Message, NodeContext

STRATEGIES = (
    "one_from_each",
    "available",
    "min_one_from_each",
    "one_from_min_percent",
    "min_k",
    "one_from_each_t",
)

EMPTY_KEY = "empty"


def evidence_quorum(members: int, *, lone: bool = True) -> int:
    """The one majority rule: how many of ``members`` (distinct, verified) must say the same
    before a node acts on it: more than half of them, and at least two where two or more
    exist.  Catch-up evidence (:func:`quorum_shown`, the quorum's take-ahead) and a run
    finished by its members' say (:func:`~dfl_agent.runtime.run.rejoin.finished_by_members`)
    both use it; they differ only where a node has a single member to listen to: its word
    counts for catch-up (``lone``: a node with one neighbour follows it, by at most
    ``runtime.max_catch_up_rounds``), never for ending the node's run (``lone=False``: 2,
    which one member cannot meet).  No member: 0, which nothing satisfies.

    >>> [evidence_quorum(n) for n in range(6)]
    [0, 1, 2, 2, 3, 3]
    >>> [evidence_quorum(n, lone=False) for n in range(6)]
    [0, 2, 2, 2, 3, 3]
    """
    if members <= 0:
        return 0
    if members == 1:
        return 1 if lone else 2
    return max(members // 2 + 1, 2)


def majority(agreeing: int, members: int, *, lone: bool = True) -> bool:
    """Whether ``agreeing`` of ``members`` meet :func:`evidence_quorum` (never with no member)."""
    need = evidence_quorum(members, lone=lone)
    return need > 0 and agreeing >= need


def quorum_shown(shown: Mapping[str, int], live: int) -> int | None:
    """The latest round that :func:`evidence_quorum` of ``live`` neighbours showed.

    Args:
        shown: neighbour -> the highest round it showed (one entry per distinct sender).
        live: how many verified neighbours are live (raised to ``len(shown)`` if smaller).

    Returns:
        the ``need``-th highest of ``shown``'s rounds, ``need = evidence_quorum(live)``;
        ``None`` when fewer than ``need`` neighbours showed any round (or none is live).
        One insider's round + 1000 is never enough where two or more neighbours are live.

    >>> quorum_shown({"a": 7, "b": 5, "c": 1000}, 3)
    7
    >>> quorum_shown({"c": 1000}, 3) is None
    True
    """
    need = evidence_quorum(max(int(live), len(shown)))
    if need == 0 or len(shown) < need:
        return None
    return sorted(shown.values(), reverse=True)[need - 1]


async def suspend_deadline(ctx: NodeContext, deadline: float, budget: float, kind: str | tuple[str, ...] = ()) -> float:
    """``deadline`` (clock time) of a round that waits for its peers' ``kind`` messages,
    suspended for a broker outage: ``ctx.hold_round(kind)`` holds the round while the
    broker is away (a context without it never holds; after the outage the node sends
    its own ``kind`` messages again) and returns the seconds held; then the deadline
    moves by that time, and at least ``min(budget, ctx.reconnect_grace)`` seconds
    remain after resuming (``budget``: the round's whole timeout).  Unchanged when
    nothing was held."""
    held = await ctx.hold_round(kind)
    if not held:
        return deadline
    grace = float(ctx.reconnect_grace)
    return max(deadline + held, ctx.clock.now() + min(budget, grace))


def waits_alone(ctx: NodeContext, peers: Collection[str]) -> bool:
    """Whether a round with no live neighbour (``peers`` empty) waits for its deadline
    instead of closing at once: where the node's context says so (``ctx.alone_waits``, the
    agent's: the run has other members, and they have not finished it).  A peer set that
    emptied because a WAN outage or a partition outlasted the heartbeat timeout must not
    make the node race through its rounds alone, ahead of the members it will meet again.
    The simulator's contexts have no ``alone_waits``: a node without neighbours goes on."""
    check = ctx.alone_waits
    return not peers and check is not None and bool(check())


def is_empty(msg: Message) -> bool:
    """Whether ``msg`` is a partial-participation placeholder (no model in it)."""
    return msg.meta.get(EMPTY_KEY) is True and not msg.tensors


@dataclasses.dataclass
class SyncOptions:
    """Synchronization options shared by the averaging algorithms (``fedavg``, ``dechw``,
    ``dechetero``, ``cfa``); the defaults reproduce their lock-step behaviour.

    Attributes:
        sync: the strategy (see the module table).
        sync_k: k of ``min_k`` (>= 1; capped at the number of live neighbours).
        sync_percent: p of ``one_from_min_percent`` in (0, 1] (⌈p·n⌉ neighbours).
        sync_timeout: seconds ``one_from_each_t`` waits (the round deadline still
            applies when it is shorter).
        max_staleness: rounds an update may lag behind the round it is used in (0 = only
            the current round's updates).
        max_queue: updates kept per sender in the market (oldest dropped beyond it).
        participation: partial device participation: send the model to this many random
            neighbours, an empty update to the others (0 = all neighbours, default).
    """

    sync: str = "one_from_each"
    sync_k: int = 1
    sync_percent: float = 0.5
    sync_timeout: float = 2.0
    max_staleness: int = 0
    max_queue: int = 16
    participation: int = 0

    def __post_init__(self) -> None:
        if self.sync not in STRATEGIES:
            raise ValueError(f"sync must be one of {STRATEGIES}, got {self.sync!r}")
        if self.sync_k < 1:
            raise ValueError(f"sync_k must be >= 1, got {self.sync_k}")
        if not 0.0 < self.sync_percent <= 1.0:
            raise ValueError(f"sync_percent must be in (0, 1], got {self.sync_percent}")
        if not self.sync_timeout > 0:
            raise ValueError(f"sync_timeout must be > 0, got {self.sync_timeout}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.participation < 0:
            raise ValueError(f"participation must be >= 0 (0 = all neighbours), got {self.participation}")


@dataclasses.dataclass
class CollectResult:
    """What one :meth:`UpdateMarket.collect` call took.

    Attributes:
        taken: ``{sender: [updates, oldest first]}`` (empty updates included).
        missing: neighbours that had no eligible update when the call returned.
        deadline_hit: the strategy was not satisfied before the deadline.
        waited: seconds (clock) the call waited.
        messages: updates taken; ``bytes``: their wire bytes (envelopes included).
        arrivals: ``{sender: seconds}`` after the call started at which each taken
            sender's update was queued (0 for one queued before): its completion time.
        stale: updates dropped during the call as older than ``max_staleness`` rounds.
    """

    taken: dict[str, list[Message]]
    missing: list[str]
    deadline_hit: bool
    waited: float
    messages: int
    bytes: int
    arrivals: dict[str, float] = dataclasses.field(default_factory=dict)
    stale: int = 0

    def latest(self, include_empty: bool = False) -> dict[str, Message]:
        """The newest taken update of every sender (empty ones left out unless asked)."""
        out = {}
        for sender, msgs in self.taken.items():
            usable = [m for m in msgs if include_empty or not is_empty(m)]
            if usable:
                out[sender] = max(usable, key=lambda m: m.round)
        return out

    def info(self) -> dict[str, Any]:
        """Round info for metrics (JSON-friendly)."""
        return {
            "sync_waited": self.waited,
            "sync_deadline_hit": self.deadline_hit,
            "updates_taken": self.messages,
            "update_bytes_taken": self.bytes,
        }


class UpdateMarket:
    """Per-sender update queues and one synchronization strategy (seed 003 §3.6.3).

    A wait may ask for another strategy than the market's, and for the quorum's rule of
    ``runtime.straggler = "quorum"`` (``fresh_quorum``): only current-round updates count
    towards :meth:`required`, and a sender's newest eligible update is taken (its older
    ones go to :attr:`on_drop`, counted ``superseded``), so a round never closes on late
    updates alone and a late update is used only where its sender sent nothing newer.
    The round's waiting policy asks for both wait by wait; the market keeps none of it.

    Args:
        strategy: one of :data:`STRATEGIES`.
        k, percent, timeout: the strategy parameters (see :class:`SyncOptions`).
        max_staleness, max_queue: see the module docstring.

    Raises:
        ValueError: unknown strategy or out-of-range parameter.
    """

    def __init__(
        self,
        strategy: str = "one_from_each",
        *,
        k: int = 1,
        percent: float = 0.5,
        timeout: float = 2.0,
        max_staleness: int = 0,
        max_queue: int = 16,
    ):
        SyncOptions(strategy, k, percent, timeout, max_staleness, max_queue)  # validation
        self.strategy = strategy
        self.k = k
        self.percent = percent
        self.timeout = timeout
        self.max_staleness = max_staleness
        self.max_queue = max_queue
        # short lists (at most max_queue), and a sender's entry goes once it is empty: a
        # node with a thousand neighbours keeps no thousand idle queue objects
        self.queues: dict[str, list[Message]] = collections.defaultdict(list)
        self.stats: collections.Counter[str] = collections.Counter()
        self.last: CollectResult | None = None
        #: called with every update dropped unused (stale or overflow), oldest first: a
        #: compressed stream keeps its sequence (CHOCO copies) through what it drops
        self.on_drop: Callable[[Message], None] | None = None

    @classmethod
    def from_options(cls, o: SyncOptions) -> UpdateMarket:
        """The market an algorithm's :class:`SyncOptions` describe."""
        return cls(o.sync, k=o.sync_k, percent=o.sync_percent, timeout=o.sync_timeout,
                   max_staleness=o.max_staleness, max_queue=o.max_queue)

    # -- putUpdate ------------------------------------------------------------------
    def put(self, msg: Message) -> None:
        """Queue a (validated) update under its sender; drops the oldest beyond ``max_queue``."""
        q = self.queues[msg.sender]
        q.append(msg)
        self.stats["received"] += 1
        self.stats["received_bytes"] += int(msg.wire_bytes)
        while len(q) > self.max_queue:
            self._dropped(q.pop(0))
            self.stats["overflow"] += 1

    def _dropped(self, msg: Message) -> None:
        if self.on_drop is not None:
            self.on_drop(msg)

    def _prune(self, t: int) -> None:
        lo = t - self.max_staleness
        for sender, q in list(self.queues.items()):
            keep = [m for m in q if m.round >= lo]
            self.stats["stale"] += len(q) - len(keep)
            for m in q:
                if m.round < lo:
                    self._dropped(m)
            if keep:
                q[:] = keep
            else:
                del self.queues[sender]

    def _eligible(self, sender: str, t: int) -> list[Message]:
        return [m for m in self.queues.get(sender, ()) if m.round <= t]

    def ahead_round(self, t: int, peers: list[str], fresh_quorum: bool = False) -> int:
        """Under ``fresh_quorum``, the round to take up to: ``t``, or, when
        :func:`evidence_quorum` of ``peers`` have queued updates of a round later than ``t``,
        the newest round any of them queued.

        Such a node is behind: the quorum has closed round ``t`` without it and will send
        no round-``t`` update, so waiting for one would end at the deadline alone (a node
        back from a partition, or a restarted one).  Only queued (verified, checked)
        updates count, and one insider's round + 1000 is never enough where two or more
        neighbours are live."""
        if not fresh_quorum:
            return t
        newest = {p: max(m.round for m in self.queues[p]) for p in set(peers) if self.queues.get(p)}
        ahead = quorum_shown(newest, len(set(peers)))
        return max(newest.values()) if ahead is not None and ahead > t else t

    # -- the strategies ------------------------------------------------------------------
    def required(self, peers: list[str], strategy: str | None = None) -> int:
        """How many updates (``min_k``) or senders (the others) must be there before the
        deadline; 0 for ``available``.  ``strategy``: another than the market's, for one wait."""
        n, strategy = len(peers), strategy or self.strategy
        if strategy == "available":
            return 0
        if strategy == "min_k":
            return min(self.k, n)
        if strategy == "one_from_min_percent":
            return min(n, math.ceil(self.percent * n - 1e-9))
        return n

    def _present(self, p: str, t: int, fresh: bool) -> bool:
        """Whether sender ``p`` has queued what counts towards round ``t``: an update of round
        ``t`` under the quorum (``fresh``), else an eligible one."""
        q = self.queues.get(p)
        if not q:
            return False
        return any(m.round == t for m in q) if fresh else any(m.round <= t for m in q)

    def ready(self, t: int, peers: list[str], strategy: str | None = None, fresh_quorum: bool = False) -> bool:
        """Whether the strategy may proceed now for target round ``t`` over ``peers``."""
        strategy = strategy or self.strategy
        need = self.required(peers, strategy)
        if strategy == "min_k" and not fresh_quorum:
            return sum(len(self._eligible(p, t)) for p in peers if p in self.queues) >= need
        return sum(1 for p in peers if self._present(p, t, fresh_quorum)) >= need

    def take(self, t: int, peers: list[str], keep_after: int | None = None,
             strategy: str | None = None, fresh_quorum: bool = False) -> dict[str, list[Message]]:
        """``get()``: remove and return what the strategy takes now (does not wait).

        ``one_from_each``/``one_from_each_t``/``one_from_min_percent`` take the oldest
        eligible update of every neighbour that has one; ``available``,
        ``min_one_from_each`` and ``min_k`` take all eligible updates.

        ``keep_after``: under ``fresh_quorum``, a taken update of a round later than
        this one stays queued for its own round (a node behind that takes a neighbour's
        round-``t + 1`` update in round ``t`` uses it again in round ``t + 1``, where that
        neighbour sends no other: taking it away would leave the node one update short in
        every later round, each one closed at its deadline).
        """
        one = (strategy or self.strategy) in ("one_from_each", "one_from_each_t", "one_from_min_percent")
        out: dict[str, list[Message]] = {}
        for p in peers:
            el = self._eligible(p, t)
            if not el:
                continue
            chosen = el[:1] if one else el
            q = self.queues[p]
            if fresh_quorum:  # the newest (the first of its round: a re-sent copy comes later);
                newest = max(m.round for m in el)  # the others go, in order, to on_drop
                chosen = [next(m for m in el if m.round == newest)]
                for m in el:
                    if m is not chosen[0]:
                        self.stats["superseded"] += 1
                        self._dropped(m)
            gone = {id(m) for m in (el if fresh_quorum else chosen)}
            if fresh_quorum and keep_after is not None and chosen[0].round > keep_after:
                gone.discard(id(chosen[0]))  # taken ahead: used again in its own round
            q[:] = [m for m in q if id(m) not in gone]  # by identity: == compares the tensors
            if not q:
                del self.queues[p]
            out[p] = chosen
        return out

    def discard(self, msgs: Iterable[Message]) -> None:
        """Remove these updates from the queues (by identity): ones the caller took and could
        not use (a CHOCO difference out of sequence), where :meth:`take` kept them for their
        own round.  Taken again, they would close every wait at once with nothing usable."""
        ids = {id(m) for m in msgs}
        for p, q in list(self.queues.items()):
            q[:] = [m for m in q if id(m) not in ids]
            if not q:
                del self.queues[p]

    # -- collection from a NodeContext --------------------------------------------------
    async def collect(
        self,
        ctx: NodeContext,
        kind: str | tuple[str, ...],
        t: int,
        *,
        deadline: float,
        poll: float = 0.5,
        peers: Callable[[], Iterable[str]] | None = None,
        validate: Callable[[Message], str | None] | None = None,
        outsider_reason: str = "not_neighbour: sender is not a neighbour",
        take_ahead: bool = False,
        strategy: str | None = None,
        fresh_quorum: bool = False,
    ) -> CollectResult:
        """Pull ``kind`` messages from ``ctx`` into the market until the strategy is
        satisfied for round ``t`` or ``deadline`` (absolute clock time) passes, then take.
        With ``take_ahead``, under ``fresh_quorum``, a node behind its neighbours
        (:meth:`ahead_round`) stops waiting at once and takes each one's newest update, of
        any round (counted ``behind``; the caller's catch-up then moves it towards the quorum's
        round, by at most ``runtime.max_catch_up_rounds``; an update of a later round stays queued for that round, see :meth:`take`).  Callers ask for it only once a round has waited its adaptive deadline: a
        node that closed its rounds as soon as it saw later ones would never work through
        the backlog of a slow device, whose updates would then carry rounds too old to use.
        Under ``fresh_quorum``, once no neighbour is live and the run's members finished it
        (:func:`waits_alone` is False), the newest updates the neighbours that left have
        queued are taken at once, of any round: a node that connected late missed their
        round-``t`` updates, and they send no more.

        Args:
            ctx: a :class:`~dfl_agent.algorithms.context.NodeContext`.
            peers: who to wait for (re-read every ``poll`` seconds); default ``ctx.neighbours``,
                and then updates that arrived from a neighbour which has left since
                (``ctx.is_neighbour``) are taken too.
            validate: returns a rejection reason (``"reason: detail"``) for a bad update;
                rejected updates are counted by ``ctx.reject`` and never queued.
            outsider_reason: rejection reason for updates from senders not in ``peers``.
            strategy: the strategy of this wait, where it is not the market's (None: the market's);
            fresh_quorum: this wait follows the quorum's rule (see the class docstring).

        Returns:
            :class:`CollectResult` (also kept in :attr:`last`).
        """
        clock = ctx.clock
        start = clock.now()
        peer_fn = peers or ctx.neighbours
        # with the default neighbourhood, an update from a neighbour that has left since
        # it sent (its last round) is still taken; a caller's ``peers`` is strict
        departed = (lambda p: False) if peers is not None else ctx.is_neighbour
        strategy = strategy or self.strategy
        if strategy == "one_from_each_t":
            deadline = min(deadline, start + self.timeout)
        budget = deadline - start
        stale0 = self.stats["stale"]
        arrived: dict[str, float] = {}
        self._prune(t)
        while True:
            deadline = await suspend_deadline(ctx, deadline, budget, kind)  # none runs while the broker is away
            current = sorted(peer_fn())
            members = set(current)  # O(1) sender checks: a round brings one update per neighbour
            now = clock.now()
            # drain what already arrived without waiting
            while True:
                msg = await ctx.receive(kind, deadline=now)
                if msg is None:
                    break
                self._intake(ctx, msg, t, members, validate, outsider_reason, departed, arrived, now - start)
            # a neighbour that sent its update and left since (it finished the run) counts
            left = [p for p in self.queues if p not in members and departed(p) and self._present(p, t, fresh_quorum)]
            satisfied = self.ready(t, current + left, strategy, fresh_quorum) and not waits_alone(ctx, current + left)
            # behind the quorum (runtime.straggler = "quorum"): take their newest updates now
            upto = t if satisfied or not take_ahead else self.ahead_round(t, current, fresh_quorum)
            if not current and upto == t and not waits_alone(ctx, current):  # every neighbour left, and
                # the run's members finished it (a partition or a crash waits: ctx.alone_waits): take the newest
                # updates they queued, of later rounds where this node missed their round-t ones while it
                # started, instead of closing alone (catch-up follows live neighbours only)
                upto = self.ahead_round(t, [p for p in self.queues if departed(p)], fresh_quorum)
            if satisfied or upto > t or now >= deadline:
                held = await suspend_deadline(ctx, deadline, budget, kind)
                if held != deadline:  # the broker went away: wait on instead of closing alone
                    deadline = held
                    continue
                gone = [p for p in self.queues if p not in members and self._eligible(p, upto) and departed(p)]
                taken = self.take(upto, current + gone, keep_after=t, strategy=strategy, fresh_quorum=fresh_quorum)
                self.stats["behind"] += int(upto > t)
                satisfied = satisfied or upto > t  # not a deadline hit
                missing = [p for p in current if p not in taken]
                msgs = [m for ms in taken.values() for m in ms]
                res = CollectResult(
                    taken, missing, not satisfied, now - start, len(msgs), sum(int(m.wire_bytes) for m in msgs),
                    {p: arrived.get(p, 0.0) for p in taken}, self.stats["stale"] - stale0,
                )
                self.stats["deadline_hit"] += int(not satisfied)
                self.last = res
                return res
            msg = await ctx.receive(kind, deadline=min(deadline, now + poll))
            if msg is not None:
                self._intake(ctx, msg, t, members, validate, outsider_reason, departed, arrived,
                             clock.now() - start)

    def _intake(self, ctx: NodeContext, msg: Message, t: int, peers: Collection[str], validate, outsider_reason: str,
                departed: Callable[[str], bool], arrived: dict[str, float] | None = None, at: float = 0.0) -> None:
        if msg.sender not in peers and not departed(msg.sender):
            ctx.reject(msg, outsider_reason)
            return
        if msg.round < t - self.max_staleness:
            self.stats["stale"] += 1
            self._dropped(msg)
            return
        if validate is not None and not is_empty(msg):
            problem = validate(msg)
            if problem:
                ctx.reject(msg, problem)
                return
        if arrived is not None and msg.sender not in self.queues:
            arrived[msg.sender] = at  # the first update a sender has queued: its completion time
        self.put(msg)

    def status(self) -> dict[str, Any]:
        """Market counters for the status topic."""
        return {"sync": self.strategy, "market": dict(self.stats),
                "queued": {p: len(q) for p, q in self.queues.items() if q}}


def select_participants(neighbours: list[str], k: int, rng: np.random.Generator) -> list[str]:
    """Partial device participation (seed 003 §3.6.4): ``k`` neighbours drawn uniformly
    without replacement with the node's rng (all of them when ``k <= 0`` or ``k >= n``).

    Returns:
        The chosen ids, sorted.
    """
    if k <= 0 or k >= len(neighbours):
        return sorted(neighbours)
    idx = rng.choice(len(neighbours), size=k, replace=False)
    return sorted(neighbours[int(i)] for i in idx)


async def send_with_participation(
    ctx: NodeContext, kind: str, t: int, tensors: dict[str, np.ndarray], meta: dict[str, Any], participation: int,
    neighbours: list[str] | None = None,
) -> dict[str, int]:
    """Send a model update to ``participation`` random neighbours and an empty update to
    the rest (unicast; seed 003 §3.6.4).

    Returns:
        ``{"participants": k, "pdp_bytes": bytes sent}``.
    """
    nbrs = sorted(ctx.neighbours() if neighbours is None else neighbours)
    chosen = set(select_participants(nbrs, participation, ctx.rng))
    sent = 0
    for p in nbrs:
        if p in chosen:
            sent += await ctx.send(p, Message(kind, t, tensors, meta=dict(meta)))
        else:
            sent += await ctx.send(p, Message(kind, t, {}, meta={**meta, EMPTY_KEY: True}))  # the placeholder
    return {"participants": len(chosen), "pdp_bytes": sent}
