"""The inbox of a node: one pipeline from received bytes to checked, buffered messages.

Both transports feed it: the memory transport hands it frames (or a broadcast shared by
its receivers, decoded once), MQTT hands it frames already decoded and verified on its
network thread (:meth:`Inbox.prepare_frame`).  Every frame goes through the same checks
in the same order: bounded decode (:mod:`dfl_agent.transport.wire`), self-addressed,
excluded sender, signature/trust/replay (with security), duplicate message id, stale
round, the algorithm's arrival check (with catch-up), then the per-sender queue.  A
frame that fails a check is dropped, logged and counted in the context's ``rejected``
under its reason; nothing received can stop the node.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dfl_agent.algorithms.context import Message
from dfl_agent.jsonbound import LogLimit
from dfl_agent.transport import wire

if TYPE_CHECKING:
    from dfl_agent.runtime.node.context import RuntimeContext

log = logging.getLogger("dfl_agent.runtime.node.context")

#: how many recent message ids the duplicate check remembers
SEEN_IDS = 4096
#: dropped messages logged per sender and reason before the limit applies, and then at most
#: one line per this many seconds (the count of each drop stays exact in ``rejected``)
DROP_LOG_BURST, DROP_LOG_EVERY = 5, 60.0


@dataclasses.dataclass(slots=True)
class PreparedFrame:
    """A received frame decoded and its signature checked off the event loop (on the
    MQTT network thread, :meth:`Inbox.prepare_frame`): what is left for the event loop
    are the checks against this node's state (replays, duplicates, rounds) and buffering.

    ``error``: ``(reason, detail)`` when decoding failed (``msg`` is then ``None``);
    ``verdict``: :meth:`dfl_agent.security.SecurityGuard.verify`'s, ``None`` without
    security; ``seconds``: the time it took (added to the round's ``receive_s``)."""

    msg: Message | None
    header: dict[str, Any] | None
    error: tuple[str, str] | None
    verdict: str | None
    seconds: float


class Inbox:
    """Decode, check, de-duplicate and queue one node's incoming frames.

    Args:
        ctx: the node's context (identity, security, exclusions, round, counters).
        max_queued_per_sender: buffered messages kept per sender; older ones are dropped
            (counted as ``queue_full``) so no peer can exhaust memory.
    """

    def __init__(self, ctx: RuntimeContext, max_queued_per_sender: int = 16):
        self.ctx = ctx
        self.max_queued_per_sender = max_queued_per_sender
        self.buffer: list[Message] = []
        self.per_sender: collections.Counter[str] = collections.Counter()
        # recent message ids (duplicate check), the oldest forgotten beyond SEEN_IDS: a set
        # for lookups and a FIFO of the same strings for the order (smaller than an OrderedDict)
        self.seen_ids: set[str] = set()
        self.seen_order: collections.deque[str] = collections.deque()
        self.waiters: set[asyncio.Future[bool]] = set()
        #: catch-up evidence: peer -> highest round of one of its messages that passed every
        #: check on arrival, tensors included (:meth:`check_on_arrival`)
        self.latest_round: dict[str, int] = {}
        self.arrival_checks: dict[str, Callable[[Message], str | None]] = {}
        self.bytes_received_by_kind: collections.Counter[str] = collections.Counter()
        self.round_received: collections.Counter[str] = collections.Counter()
        #: how often each (sender, reason)'s drops are logged (senders are not verified yet
        #: when dropped: the keys are bounded)
        self.drop_log = LogLimit(DROP_LOG_EVERY, DROP_LOG_BURST)

    def drop(self, reason: str, detail: str, sender: str = "?") -> None:
        """Count a dropped message under ``reason`` and log it (WARNING): the first
        :data:`DROP_LOG_BURST` of each sender and reason, then at most one line per
        :data:`DROP_LOG_EVERY` seconds with the number not logged, so that a flood of bad
        messages never floods the log."""
        self.ctx.rejected[reason] += 1
        log_it, unlogged, _ = self.drop_log.check((sender, reason))
        if log_it:
            more = f" ({unlogged} more from {sender} not logged)" if unlogged else ""
            log.warning("dropped message from %s: %s %s%s", sender, reason, detail, more)

    def prepare_frame(self, frame: bytes, wire_bytes: int) -> PreparedFrame:
        """Decode ``frame`` and check its signature; safe to call on another thread than
        the event loop's (it reads the context's settings and the security guard's
        trust store, and changes nothing else).  Never raises: failures are in the
        result, and the event loop's :meth:`on_frame` counts them."""
        ctx = self.ctx
        t0 = time.perf_counter()
        msg: Message | None = None
        header: dict[str, Any] | None = None
        error: tuple[str, str] | None = None
        verdict: str | None = None
        try:
            msg, header = wire.decode_with_header(
                frame, federation=ctx.federation, recipient=ctx.node_id, max_frame_bytes=ctx.max_frame_bytes)
        except wire.WireError as exc:
            error = (exc.reason, exc.detail)
        except Exception as exc:  # never let bad input kill the node
            error = ("malformed", repr(exc))
        if msg is not None and header is not None and ctx.security is not None:
            try:
                verdict = ctx.security.verify(header, getattr(header, "signed_bytes", None))
            except Exception as exc:  # never let bad input kill the node
                verdict = "malformed"
                log.debug("security check failed on %r", exc)
        return PreparedFrame(msg, header, error, verdict, time.perf_counter() - t0)

    def on_frame(self, frame: bytes | PreparedFrame, wire_bytes: int) -> None:
        """A frame arrived: check it and queue its message (the time counts as ``receive_s``)."""
        t0 = time.perf_counter()
        try:
            self._on_frame_checked(frame, wire_bytes)
        finally:
            self.ctx.timing["receive_s"] += time.perf_counter() - t0 + (
                frame.seconds if isinstance(frame, PreparedFrame) else 0.0)

    def _decode(self, frame: bytes | PreparedFrame) -> tuple[Message, dict[str, Any] | None, str | None, bool] | None:
        """``(message, parsed envelope or None, signature verdict or None, shared)``, or None
        (dropped and counted) when the frame does not decode; ``shared``: a shared
        broadcast of the memory transport, decoded once for all its receivers."""
        ctx = self.ctx
        if isinstance(frame, PreparedFrame):
            if frame.error is not None or frame.msg is None:
                reason, detail = frame.error or ("malformed", "no message")
                self.drop(reason, detail)
                return None
            return frame.msg, frame.header, frame.verdict, False
        try:
            shared = ctx.transport.decode_shared(frame, federation=ctx.federation, recipient=ctx.node_id,
                                                 max_frame_bytes=ctx.max_frame_bytes)
            if shared is not None:  # a shared broadcast (memory transport), decoded once
                return shared, None, None, True
            msg, parsed = wire.decode_with_header(frame, federation=ctx.federation, recipient=ctx.node_id,
                                                  max_frame_bytes=ctx.max_frame_bytes)
            return msg, parsed, None, False
        except wire.WireError as exc:
            self.drop(exc.reason, exc.detail)
        except Exception as exc:  # never let bad input kill the node
            self.drop("malformed", repr(exc))
        return None

    def _security_check(self, frame: Any, msg: Message, parsed: dict[str, Any] | None,
                        verdict: str | None) -> tuple[bool, dict[str, Any] | None]:
        """``(passed, header)``: signature, trust and replay checks (the round is
        remembered only once every check passed, in :meth:`_on_frame_checked`)."""
        security = self.ctx.security
        if security is None:
            return True, None
        header: dict[str, Any] | None = None
        try:
            header = parsed if parsed is not None else wire.raw_header(frame)
            reason = (verdict if verdict == "malformed" else
                      security.check(header, remember_round=False,
                                     signed_bytes=getattr(parsed, "signed_bytes", None), verdict=verdict))
        except Exception as exc:  # never let bad input kill the node
            reason = "malformed"
            log.debug("security check failed on %r", exc)
        if reason is not None:
            self.drop(reason, f"{msg.kind} round {msg.round}", msg.sender)
            return False, header
        return True, header

    def _fresh(self, msg: Message, remember: bool = True) -> bool:
        """Not a duplicate (remembers its id, unless ``remember`` is False) and not stale.

        A shared broadcast of the memory transport is not remembered: the network hands it
        to each of its receivers once (a receiver list holds each node once, and a frame
        sent again is a new frame with a new id), so its id can never come back, and a node
        that hears a thousand neighbours keeps no thousands of ids per round."""
        if msg.msg_id in self.seen_ids:
            self.ctx.rejected["duplicate"] += 1
            return False
        if remember:
            self.seen_ids.add(msg.msg_id)
            self.seen_order.append(msg.msg_id)
            if len(self.seen_order) > SEEN_IDS:
                self.seen_ids.discard(self.seen_order.popleft())
        # older rounds: no algorithm takes them.  An algorithm that takes late updates drops old
        # ones itself (its update market), where a compressed stream's copy still follows them
        oldest = self.ctx.current_round - 1
        if msg.round < oldest and not self.ctx.max_staleness:
            self.drop("stale", f"round {msg.round} < {oldest}", msg.sender)
            return False
        return True

    def _on_frame_checked(self, frame: bytes | PreparedFrame, wire_bytes: int) -> None:
        ctx = self.ctx
        decoded = self._decode(frame)
        if decoded is None:
            return
        msg, parsed, verdict, shared = decoded
        if msg.sender == ctx.node_id:
            # no transport hands a node its own frames (MQTT skips its own "out" topic, the
            # memory network its sender): this one was forged or replayed in our name
            self.drop("self_addressed", f"{msg.kind} round {msg.round}", msg.sender)
            return
        excluded = ctx.membership.excluded
        if msg.sender in excluded and msg.kind != "onnx.model":
            self.drop("incompatible_peer", excluded[msg.sender], msg.sender)
            return
        passed, header = self._security_check(frame, msg, parsed, verdict)
        if not passed or not self._fresh(msg, remember=not shared):
            return
        msg.wire_bytes = wire_bytes
        self.bytes_received_by_kind[msg.kind] += wire_bytes
        self.round_received[msg.kind] += wire_bytes
        ctx.peers.touch(msg.sender)
        # the algorithm's own checks (tensor names/shapes/dtypes, meta), where they decide
        # something here: catch-up evidence (the daemon; the simulator leaves it off and
        # the algorithm checks what it takes)
        check = self.arrival_checks.get(msg.kind) if ctx.catch_up else None
        if check is not None:
            try:
                problem = check(msg)
            except Exception as exc:  # never let bad input kill the node
                problem = f"malformed: {exc!r}"
            if problem:
                self.drop(problem.split(":", 1)[0], problem, msg.sender)
                return
            # only now, with every check passed, is the message catch-up evidence
            if msg.round > self.latest_round.get(msg.sender, -1):
                self.latest_round[msg.sender] = msg.round
        if header is not None and ctx.security is not None:
            ctx.security.remember_round(header)
        self._queue(msg)

    def _queue(self, msg: Message) -> None:
        if self.per_sender[msg.sender] >= self.max_queued_per_sender:
            oldest = next(i for i, m in enumerate(self.buffer) if m.sender == msg.sender)
            self.buffer.pop(oldest)
            self.per_sender[msg.sender] -= 1
            self.ctx.rejected["queue_full"] += 1
        self.buffer.append(msg)
        self.per_sender[msg.sender] += 1
        self.notify()

    def notify(self) -> None:
        """Wake every :meth:`receive` waiting (a message or a presence change arrived)."""
        for fut in list(self.waiters):
            if not fut.done():
                fut.set_result(True)

    def take(self, kind: str | tuple[str, ...], round: int | None, sender: str | None) -> Message | None:
        """The oldest buffered message that matches, removed from the buffer; None if none."""
        kinds = (kind,) if isinstance(kind, str) else kind
        for i, m in enumerate(self.buffer):
            if m.kind in kinds and (round is None or m.round == round) and (sender is None or m.sender == sender):
                self.per_sender[m.sender] -= 1
                return self.buffer.pop(i)
        return None

    async def receive(self, kind: str | tuple[str, ...], *, round: int | None = None, sender: str | None = None,
                      deadline: float | None = None) -> Message | None:
        """The next matching message, waiting until ``deadline`` (loop time; None:
        forever); None when the deadline passed first."""
        loop = asyncio.get_running_loop()
        while True:
            msg = self.ctx._take(kind, round, sender)
            if msg is not None:
                return msg
            if deadline is not None and loop.time() >= deadline:
                return None
            # Wait for the next arrival or presence change, or the absolute deadline
            # (call_at keeps the deadline exact, so virtual time lands on it).
            fut: asyncio.Future[bool] = loop.create_future()
            self.waiters.add(fut)
            handle = None
            if deadline is not None:

                def expire(f: asyncio.Future[bool] = fut) -> None:
                    if not f.done():
                        f.set_result(False)

                handle = loop.call_at(deadline, expire)
            try:
                await fut
            finally:
                self.waiters.discard(fut)
                if handle is not None:
                    handle.cancel()

    def reject(self, message: Message, reason: str) -> None:
        """The algorithm refused ``message``: drop it, count the reason, and forget its
        round as catch-up evidence."""
        self.drop(reason.split(":", 1)[0], reason, message.sender)
        if self.latest_round.get(message.sender, -1) <= message.round:
            self.latest_round.pop(message.sender, None)

    def end_round(self, round: int) -> dict[str, int]:
        """Forget buffered messages of rounds before ``round`` (they can no longer be
        used); returns the bytes received this round by kind, and starts a new count."""
        self.per_sender.subtract(m.sender for m in self.buffer if m.round < round)
        self.buffer = [m for m in self.buffer if m.round >= round]
        received = dict(self.round_received)
        self.round_received.clear()
        return received
