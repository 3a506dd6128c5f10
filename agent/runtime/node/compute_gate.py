"""The compute gate of a node: when and where its training runs.

Training waits while the device's resource gate says no (battery, temperature, load,
outside the training window) and, with ``runtime.pause_when_disconnected``, while the
transport has lost its broker; then it runs in a worker thread (the daemon: messaging
goes on meanwhile, and a stopped run aborts it at the next mini-batch), inline (the
simulator), or in the simulator's vectorised batch of the nodes training in the same
virtual instant (:class:`~dfl_agent.runtime.node.batching.BatchTrainer`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar, cast

if TYPE_CHECKING:
    from dfl_agent.runtime.node.context import RuntimeContext

log = logging.getLogger("dfl_agent.runtime.node.context")
T = TypeVar("T")
P = ParamSpec("P")


class ComputeGate:
    """Resource gating, the disconnect pause, and where one node's compute runs.

    Args:
        ctx: the node's context (``gate``, ``gate_poll``, ``gate_hook``,
            ``pause_when_disconnected``, ``batcher``, ``compute_in_thread``, transport, clock).
    """

    def __init__(self, ctx: RuntimeContext):
        self.ctx = ctx
        #: set when the node's run stops (cancel, shutdown): local training running in a
        #: worker thread ends at its next mini-batch (dfl_agent.learning.training.abortable)
        self.abort: threading.Event | None = threading.Event() if ctx.compute_in_thread else None
        self.gated: str | None = None  # this node's current gating reason
        self.reconnect_poll = 0.5  # seconds between connection checks while paused
        self.disconnected_seconds = 0.0  # time spent paused for a lost broker connection
        #: after the broker is back, the longest wait for the neighbours of before the
        #: outage to be back in this node's verified presence (:meth:`hold_round`)
        self.reconnect_grace = 15.0
        #: the verified neighbours this node expected in its current round: those at its
        #: start and every one seen while it waited (:meth:`note_neighbours`)
        self.round_expected: set[str] = set()
        self.round_paused = 0.0  # seconds the current round was held for the broker
        self.paused = False  # held now: the broker is away (the status says ``paused``)
        #: the message kinds this node's rounds wait for (:meth:`hold_round`): after an
        #: outage the node sends its own messages of these kinds again
        self.resend_kinds: set[str] = set()

    async def wait_until_allowed(self) -> None:
        """Return when resource gating allows training; meanwhile report the reason.

        Checks ``gate`` now and then every ``gate_poll`` seconds; each change of the
        reason is logged and passed to ``gate_hook`` (the node republishes its status).
        First, with ``pause_when_disconnected``, waits for a lost broker connection to
        come back (:meth:`hold_round`): a node cut off from its broker hears nothing from
        its peers, and without the pause would train and close rounds alone until it
        reconnects.  The simulator leaves the option off; a transport without a
        ``connected`` attribute never pauses."""
        ctx = self.ctx
        await self.hold_round()
        if ctx.gate is None:
            return
        while True:
            reason = ctx.gate()
            kind = (reason or "").split(" ", 1)[0]  # battery / temperature / load / outside
            changed = kind != (self.gated or "").split(" ", 1)[0]
            self.gated = reason
            if changed:  # log and republish when the cause changes, not every reading
                if reason:
                    log.warning("%s: training paused: %s", ctx.node_id, reason)
                else:
                    log.info("%s: training resumed", ctx.node_id)
                if ctx.gate_hook is not None:
                    await ctx.gate_hook(reason)
            if reason is None:
                return
            await ctx.clock.sleep(ctx.gate_poll)

    def note_neighbours(self) -> None:
        """Add the node's live neighbours to :attr:`round_expected` (while connected:
        a node cut off from its broker sees its neighbours leave, which says nothing)."""
        ctx = self.ctx
        if getattr(ctx.transport, "connected", True):
            self.round_expected.update(ctx.neighbours())

    async def hold_round(self, kinds: tuple[str, ...] = ()) -> float:
        """:meth:`RuntimeContext.hold_round`: the seconds held while the broker was away.

        The neighbours waited for are :attr:`round_expected`; the messages sent again are
        this round's and the one before's of the ``kinds`` the rounds wait for (remembered
        in :attr:`resend_kinds`).  Protocols that never wait through it (pairs, rotating
        aggregators) have nothing sent again."""
        ctx = self.ctx
        self.resend_kinds.update(kinds)
        self.note_neighbours()
        await self.resend_to_returned()
        if not ctx.pause_when_disconnected or getattr(ctx.transport, "connected", True):
            return 0.0
        since = ctx.clock.now()
        previous, self.gated, self.paused = self.gated, "not connected to the MQTT broker", True
        log.warning("%s: training paused: not connected to the MQTT broker (the round waits; "
                    "its deadline is suspended)", ctx.node_id)
        if ctx.gate_hook is not None:
            await ctx.gate_hook(self.gated)
        try:
            while not ctx.transport.connected:
                await ctx.clock.sleep(self.reconnect_poll)
            # connected: no longer paused, and the peers must see it at once (a status that
            # still said "gated" would leave this node out of their rounds while they wait for it)
            self.gated, self.paused = previous, False
            if ctx.gate_hook is not None:
                await ctx.gate_hook(self.gated)
            back = ctx.clock.now()
            expected = set(self.round_expected)
            while expected - set(ctx.neighbours()) and ctx.clock.now() - back < self.reconnect_grace:
                await ctx.clock.sleep(self.reconnect_poll)
        finally:
            self.gated, self.paused = previous, False
            held = ctx.clock.now() - since
            self.disconnected_seconds += held
            self.round_paused += held
        missing = sorted(self.round_expected - set(ctx.neighbours()))
        log.info("%s: training resumed: connected again after %.1f s%s", ctx.node_id, held,
                 f" (not back within {self.reconnect_grace:g} s: {', '.join(missing)})" if missing else "")
        if self.resend_kinds:
            await ctx.resend_round(self.resend_kinds)
            returned = ctx.membership.returned
            for peer in [p for p, restarted in returned.items() if not (restarted and ctx.membership.streams)]:
                del returned[peer]  # sent to it just now (a restarted one needs CHOCO keyframes)
        return held

    async def resend_to_returned(self) -> int:
        """Send the messages of this round and the round before again (the kinds the
        rounds wait for), to each neighbour that came back since (the membership's
        ``returned``): what this node sent while the neighbour was cut off never reached
        it, and a round of the neighbour that waits for it would close alone at its
        deadline.  A neighbour that may have restarted gets the latest message of each
        CHOCO stream as an exact keyframe instead (:meth:`Outbox.as_keyframe`): it lost its
        copies.  Returns the wire bytes sent."""
        ctx = self.ctx
        returned = ctx.membership.returned
        if not returned or not self.resend_kinds or not getattr(ctx.transport, "connected", True):
            return 0
        live, n = set(ctx.neighbours()), 0
        for peer in [p for p in returned if p in live]:
            restarted = returned.pop(peer)
            n += await ctx.resend_round(self.resend_kinds, peer=peer, restarted=restarted)
        return n

    def end_round(self) -> tuple[set[str], float]:
        """The round's expected neighbours and the seconds it was held; starts the next
        round's with the neighbours live now."""
        out = (self.round_expected, self.round_paused)
        self.round_expected, self.round_paused = set(), 0.0
        self.note_neighbours()
        return out

    async def compute(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` once gating allows (``train_s`` of the round's timing)."""
        ctx = self.ctx
        await self.wait_until_allowed()  # resource gating: no training while gated
        if ctx.virtual_train_s:  # the simulator's per-node speed (--speeds): training takes virtual time
            await asyncio.sleep(ctx.virtual_train_s)
        if ctx.batcher is not None and not ctx.compute_in_thread:
            # the simulator's batched training: a qualifying call waits for its group's
            # vectorised step (which adds this node's share to timing["train_s"])
            fut = ctx.batcher.submit(ctx, fn, args, kwargs)
            if fut is not None:  # a batched training function's result: its metrics
                return cast(T, await fut)
        t0 = time.perf_counter()
        try:
            return await ctx.compute_ungated(fn, *args, **kwargs)
        finally:
            ctx.timing["train_s"] += time.perf_counter() - t0

    async def compute_ungated(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """:meth:`compute` without resource gating (evaluation, ONNX export)."""
        if self.abort is not None:  # compute_in_thread: in a worker thread, which a stopped run aborts
            call = functools.partial(_abortable_call, self.abort, fn, args, kwargs)
            return await asyncio.get_running_loop().run_in_executor(None, call)
        return fn(*args, **kwargs)


def _abortable_call(event: threading.Event, fn: Callable[..., T], args: tuple[object, ...],
                    kwargs: dict[str, object]) -> T:
    """``fn(*args, **kwargs)`` in a worker thread whose local training stops when
    ``event`` is set."""
    from dfl_agent.learning.training import abortable

    with abortable(event):
        return fn(*args, **kwargs)
