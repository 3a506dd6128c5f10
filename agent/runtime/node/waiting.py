"""A round's waiting policy, behind one call: :meth:`RoundWaiting.collect`
(``await ctx.collect(kind, t, ...)`` for the algorithms).

An algorithm asks for the updates of a round; how long it waits and what it takes is the
runtime's, in one place, the same in the simulator and on a device:

- **deadlines**: the algorithm's ``round_timeout`` (the paper's), or, under
  ``runtime.straggler = "quorum"``, an adaptive one learnt from the peers' completion times
  (:class:`~dfl_agent.algorithms.protocols.stragglers.AdaptiveDeadline`), whose first round
  waits for every member still starting;
- **quorum**: the update market (:class:`~dfl_agent.algorithms.protocols.synchronization.UpdateMarket`,
  the seed 003 synchronization strategies) takes a quorum of current updates; a node that
  got nothing by the adaptive deadline waits on up to ``round_timeout`` and takes its
  neighbours' newest updates when a quorum of them is ahead (the one majority rule,
  :func:`~dfl_agent.algorithms.protocols.synchronization.evidence_quorum`);
- **the broker-outage hold**: a round never closes because this node's broker went away
  (:func:`~dfl_agent.algorithms.protocols.synchronization.suspend_deadline`); the time held
  does not count against ``round_timeout`` and is not learnt as a completion time;
- **keyframe retries**: compressed updates (CHOCO copies) that cannot be decoded because
  their stream lost its sequence are dropped from the market, the node asks for keyframes and
  takes the neighbours' next updates, up to ``round_timeout``;
- **staleness weights**: a late update (an earlier round, within ``max_staleness``) is used
  with FedAsync's weight (:func:`~dfl_agent.algorithms.protocols.stragglers.weigh_late`);
- **an update taken ahead is decoded once**: a node behind its neighbours takes their newest
  updates at once, and the market keeps one of a later round queued for that round
  (:meth:`UpdateMarket.take`); what it decoded to is kept with it, so that its own round uses
  it again instead of decoding a CHOCO difference a second time (out of sequence: dropped, and
  the round waited its whole deadline for an update it had already received).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dfl_agent.algorithms.context import Collected, Message
from dfl_agent.algorithms.protocols.stragglers import AdaptiveDeadline, weigh_late
from dfl_agent.algorithms.protocols.synchronization import UpdateMarket

if TYPE_CHECKING:
    from dfl_agent.runtime.node.context import RuntimeContext

#: ``decode(taken) -> usable``: sender -> the taken update, as the algorithm can use it (e.g. a
#: CHOCO difference turned into the neighbour's model); an update left out cannot be decoded
Decode = Callable[[dict[str, Message]], dict[str, Message]]


class RoundWaiting:
    """The waiting policy of one kind of update of one node (see the module docstring).

    Args:
        ctx: the node's context.
        market: the algorithm's update market (its synchronization strategy and queues).
        round_timeout: the algorithm's round deadline in seconds (the upper bound under quorum).
        poll: seconds between re-checks of the live neighbours while waiting.
    """

    def __init__(self, ctx: RuntimeContext, market: UpdateMarket, round_timeout: float, poll: float):
        self.ctx, self.market, self.round_timeout, self.poll = ctx, market, float(round_timeout), float(poll)
        policy = ctx.straggler
        #: the adaptive deadline under ``runtime.straggler = "quorum"``; None: the paper's fixed one
        self.deadlines = AdaptiveDeadline(policy.min_round_timeout, policy.max_round_timeout) \
            if policy is not None and policy.quorum else None
        #: the quorum's waits count only current-round updates (``fresh_quorum`` of ``UpdateMarket.collect``)
        self.fresh_quorum = market.strategy == "one_from_min_percent" and self.deadlines is not None
        #: updates taken ahead and kept queued for their own round: id -> (the update, what it decoded to)
        self.ahead: dict[int, tuple[Message, Message]] = {}

    async def collect(self, kind: str, t: int, *, accept: Callable[[Message], str | None],
                      decode: Decode) -> Collected:
        """The round-``t`` updates of ``kind`` from the neighbours (``accept(msg)``: why an
        update cannot be used, or None; ``decode``: see :data:`Decode`)."""
        ctx, market = self.ctx, self.market
        timeout, strategy = self.round_timeout, None
        if self.deadlines is not None:  # adaptive: the algorithm's round_timeout is the upper bound
            timeout = self.deadlines.timeout(timeout)
            if not self.deadlines.times:  # the first round waits for every member still starting (loading,
                strategy = "one_from_each"  # warming up), so that none is left behind from the start
        start, paused = ctx.clock.now(), ctx.disconnected_seconds

        def until() -> float:  # round_timeout from the start, not counting what a broker outage held
            return start + self.round_timeout + ctx.disconnected_seconds - paused

        # a node left behind by a capped catch-up (ctx.catching_up) takes its neighbours' newest at once
        raw, missing = await self._take(kind, t, start + timeout, accept, take_ahead=ctx.catching_up, strategy=strategy)
        if not raw and missing and timeout < self.round_timeout:  # nothing by the adaptive deadline (a
            # partition, a slow link): never close alone early; wait on up to round_timeout, unless behind
            raw, missing = await self._take(kind, t, until(), accept, take_ahead=True, strategy=strategy)
        last = market.last
        if self.deadlines is not None and last is not None and ctx.disconnected_seconds == paused:
            # (a round held by a broker outage measured the outage, not its peers: not learnt)
            self.deadlines.observe([last.arrivals[s] for s, m in raw.items() if m.round == t])
        got = self._decoded(raw, decode, t)
        while raw and not got and self.deadlines is not None and ctx.clock.now() < until():
            # quorum: none of the updates taken decoded (CHOCO copies that lost their sequence wait
            # for the keyframes a gap asks for) while the neighbours go on: take their next ones,
            # up to round_timeout (and what an outage held), instead of closing alone; ask for the keyframes now
            await ctx.request_keyframes()
            raw, missing = await self._take(kind, t, until(), accept, take_ahead=True)
            got = self._decoded(raw, decode, t)
        last = market.last
        late = {s for s, m in got.items() if m.round < t}
        if late and self.deadlines is not None:  # FedAsync's staleness weight on a late update's samples
            got = weigh_late(got, t)
        info = {**(last.info() if last is not None else {}), "late_dropped": last.stale if last is not None else 0,
                "deadline_s": round(timeout, 3)}
        return Collected(got, missing, late, info)

    async def _take(self, kind: str, t: int, deadline: float, accept: Callable[[Message], str | None],
                    take_ahead: bool = False, strategy: str | None = None) -> tuple[dict[str, Message], list[str]]:
        res = await self.market.collect(self.ctx, kind, t, deadline=deadline, poll=self.poll, validate=accept,
                                        take_ahead=take_ahead, strategy=strategy, fresh_quorum=self.fresh_quorum)
        return res.latest(), res.missing

    def _decoded(self, raw: dict[str, Message], decode: Decode, t: int) -> dict[str, Message]:
        """The taken updates as the algorithm can use them; those that cannot be decoded are
        also dropped from the market, never to be taken again.  An update taken ahead (a round
        after ``t``) keeps what it decoded to for its own round (see the module docstring)."""
        reused = {s: self.ahead[id(m)][1] for s, m in raw.items() if id(m) in self.ahead}
        fresh = {s: m for s, m in raw.items() if s not in reused}
        got = {**(decode(fresh) if fresh else {}), **reused}
        self.market.discard(m for s, m in fresh.items() if s not in got)
        for s, m in fresh.items():
            if m.round > t and s in got:  # queued again for its own round (UpdateMarket.take, keep_after)
                copy = {k: np.array(v, copy=True) for k, v in got[s].tensors.items()}
                self.ahead[id(m)] = (m, dataclasses.replace(got[s], tensors=copy))
        self.ahead = {k: v for k, v in self.ahead.items() if v[0].round > t}  # used, or its round has passed
        return got
