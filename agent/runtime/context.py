"""``RuntimeContext``: the :class:`~dfl_agent.algorithms.context.NodeContext` over any transport.

It encodes outgoing messages, and decodes, validates, de-duplicates and buffers
incoming frames.  A frame that fails any check is dropped, logged and counted in
``rejected`` (by reason); the node keeps running and its model is untouched.  The
same class serves the simulator (memory transport, virtual-time loop, inline compute)
and the daemon (MQTT, wall clock, compute in a worker thread).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from dfl_agent.algorithms.context import BROADCAST, Message
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.compression import CompressionPolicy
from dfl_agent.learning.error_feedback import ErrorFeedback
from dfl_agent.transport import codec, wire
from dfl_agent.transport.base import Transport

log = logging.getLogger(__name__)
T = TypeVar("T")

#: per-round time accounting keys of :attr:`RuntimeContext.timing` (seconds)
TIMING_KEYS = ("train_s", "encode_s", "send_s", "receive_s")

RoundHook = Callable[[int, dict[str, Any]], Awaitable[None]]

#: ``runtime.max_catch_up_rounds``'s default: the most rounds one catch-up skips
MAX_CATCH_UP_ROUNDS = 10


def evidence_quorum(live: int) -> int:
    """How many of ``live`` verified neighbours must show a round before a node acts on
    it: more than half, and at least two distinct senders when two or more are live
    (one sender with one live neighbour; 0 for none, which nothing can satisfy).

    >>> [evidence_quorum(n) for n in range(6)]
    [0, 1, 2, 2, 3, 3]
    """
    if live <= 0:
        return 0
    return max(live // 2 + 1, min(2, live))


def catch_up_target(next_round: int, shown: Mapping[str, int], live: int, cap: int) -> int:
    """The round to run next when neighbours show later rounds (fault tolerance).

    Args:
        next_round: the round this node would run next (>= 1).
        shown: live verified neighbour -> the highest round it showed it completed
            (one entry per distinct sender; entries of other peers must be left out).
        live: how many verified neighbours are live (the quorum's base, >= len(shown)
            is expected; a smaller value is raised to ``len(shown)``).
        cap: ``runtime.max_catch_up_rounds``, the most rounds skipped at once (0 = never).

    Returns:
        ``next_round`` unless :func:`evidence_quorum` of the live neighbours showed a
        round >= ``next_round``; then one past the highest round that a quorum showed,
        but at most ``next_round + cap``.  One insider's claim (a signed frame or status
        with round + 1000) is never enough where two or more neighbours are live, and no
        claim moves a node more than ``cap`` rounds per event.
    """
    need = evidence_quorum(max(int(live), len(shown)))
    if need == 0 or len(shown) < need or cap <= 0:
        return next_round
    ahead = sorted(shown.values(), reverse=True)[need - 1]  # the need-th highest: a quorum showed it
    if ahead < next_round:
        return next_round
    return min(ahead + 1, next_round + cap)


@dataclasses.dataclass(slots=True)
class PreparedFrame:
    """A received frame decoded and its signature checked off the event loop (on the
    MQTT network thread, :meth:`RuntimeContext.prepare_frame`): what is left for the
    event loop are the checks against this node's state (replays, duplicates, rounds)
    and buffering.

    ``error``: ``(reason, detail)`` when decoding failed (``msg`` is then ``None``);
    ``verdict``: :meth:`dfl_agent.security.SecurityGuard.verify`'s, ``None`` without
    security; ``seconds``: the time it took (added to the round's ``receive_s``)."""

    msg: Message | None
    header: dict[str, Any] | None
    error: tuple[str, str] | None
    verdict: str | None
    seconds: float


class LoopClock:
    """The running event loop's clock (monotonic wall time, or virtual time in the simulator)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class RuntimeContext:
    """One node's :class:`NodeContext`.

    Args:
        node_id, federation: identities (wire ids).
        transport: started by :meth:`start`.
        peers: live peer table (fed by presence here, and by mDNS/static in the daemon).
        data: the node's :class:`dfl_agent.data.NodeData`.
        model_spec, train, init_seed, device: what algorithms need to build and train models.
        rng: the node's seeded generator.
        compute_in_thread: run :meth:`compute` in a worker thread (daemon) or inline (simulator).
        max_frame_bytes: frames above this are rejected as ``oversized``.
        max_queued_per_sender: buffered messages kept per sender; older ones are dropped
            (counted as ``queue_full``) so no peer can exhaust memory.
        graph_neighbours: this node's neighbours in the configured communication graph
            (``None``: every peer is a neighbour).
        seed: the federation's seed (the same on every node), for shared schedules.
        compression: which spec per message kind (``None``: none).  Plain messages are
            compressed on send with ``compression.message_spec(kind)`` (with an error
            feedback residual per stream for sparsified kinds); messages an algorithm
            already encoded (``Message.encoding``, e.g. CHOCO gossip) go as they are.
            Algorithms read it as ``ctx.compression``.
        security: an :class:`dfl_agent.security.SecurityGuard` (``None``: frames are
            neither signed nor verified, as in the simulator).  With it, outgoing
            frames are signed, incoming ones verified and replay-checked (rejections
            counted as ``unsigned``, ``unknown_sender``, ``bad_signature``, ``replay``),
            and only trusted peers are members when signatures are required.
        behaviour: the device profile's :class:`dfl_agent.profiles.Behaviour` (roles: may
            this node lead a rotating round), None without a profile.
        compatibility: peer info -> the reason its model cannot take part (None: it can);
            None: every peer can.
        batcher: the simulator's :class:`~dfl_agent.runtime.batching.BatchTrainer`
            (None: every :meth:`compute` runs on its own, as in the daemon).
        gate, gate_poll: resource gating (``() -> reason or None``, checked every
            ``gate_poll`` seconds while gated); None: always allowed.
        pause_when_disconnected: ``runtime.pause_when_disconnected``: no training while
            the transport has lost its broker.
        max_catch_up_rounds, final_round, catch_up: fault tolerance
            (``runtime.max_catch_up_rounds``, the run's last round, ``runtime.rejoin``;
            :meth:`enable_catch_up` turns catch-up on later).
        persistent_state: initial entries of :attr:`persistent_state` (e.g. the data
            snapshot saved with every checkpoint).

    The context is complete when constructed: setting an attribute it does not declare
    raises ``AttributeError`` (a typo cannot silently add a setting nobody reads).
    """

    def __init__(
        self,
        *,
        node_id: str,
        federation: str,
        transport: Transport,
        peers: PeerTable,
        data: Any,
        model_spec: Mapping[str, Any],
        train: Any,
        init_seed: int,
        rng: np.random.Generator,
        device: str = "cpu",
        compute_in_thread: bool = False,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        max_queued_per_sender: int = 16,
        graph_neighbours: list[str] | None = None,
        seed: int = 0,
        compression: CompressionPolicy | None = None,
        security: Any = None,
        behaviour: Any = None,
        compatibility: Callable[[Any], str | None] | None = None,
        batcher: Any = None,
        gate: Callable[[], str | None] | None = None,
        gate_poll: float = 5.0,
        pause_when_disconnected: bool = False,
        max_catch_up_rounds: int = MAX_CATCH_UP_ROUNDS,
        final_round: int | None = None,
        catch_up: bool = False,
        persistent_state: Mapping[str, Any] | None = None,
    ):
        self.node_id = node_id
        self.federation = federation
        self.transport = transport
        self.peers = peers
        self.data = data
        self.model_spec = dict(model_spec)
        self.train = train
        self.init_seed = init_seed
        self.seed = seed
        self.rng = rng
        self.device = device
        self.clock = LoopClock()
        self.compute_in_thread = compute_in_thread
        #: set when the node's run stops (cancel, shutdown): local training running in a
        #: worker thread ends at its next mini-batch (dfl_agent.learning.training.abortable)
        self.abort: threading.Event | None = threading.Event() if compute_in_thread else None
        self.max_frame_bytes = max_frame_bytes
        self.max_queued_per_sender = max_queued_per_sender
        self.graph_neighbours = None if graph_neighbours is None else sorted(set(graph_neighbours) - {node_id})
        self._graph_src: list[str] | None = None  # the list _graph_set was made from
        self._graph_set: frozenset[str] = frozenset()
        self._graph_len = 0
        #: live_peers() memo: (key, result); valid while the peer table, the exclusions and
        #: the gated peers are unchanged (only without heartbeat expiry or security)
        self._live_cache: tuple[tuple[Any, int, int], list[str]] | None = None
        self._gated_changes = 0
        self.round_hook: RoundHook | None = None
        self.current_round = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        #: state that survives restarts (issue 10): name -> numpy array, saved in every
        #: checkpoint and restored before the first round (e.g. error-feedback residuals
        #: of compressed updates, "ef/{peer}/{tensor}"); see dfl_agent.runtime.checkpoint.
        self.persistent_state: dict[str, Any] = dict(persistent_state or {})
        self.bytes_sent_by_kind: collections.Counter[str] = collections.Counter()
        self.bytes_received_by_kind: collections.Counter[str] = collections.Counter()
        self._buffer: list[Message] = []
        self._per_sender: collections.Counter[str] = collections.Counter()
        # recent message ids (duplicate check), the oldest forgotten beyond 4096: a set
        # for lookups and a FIFO of the same strings for the order (smaller than an OrderedDict)
        self._seen_ids: set[str] = set()
        self._seen_order: collections.deque[str] = collections.deque()
        self._waiters: set[asyncio.Future[bool]] = set()
        self._started = False
        # -- device profile (dfl_agent.profiles): behaviour, compatibility, resource gating --
        self.behaviour: Any = behaviour  # dfl_agent.profiles.Behaviour, when a profile applies
        self.compatibility: Callable[[Any], str | None] | None = compatibility  # peer info -> reason to exclude
        self.excluded: dict[str, str] = {}  # peer -> why it is excluded (incompatible)
        self.peer_gated: dict[str, str] = {}  # peer -> its gating reason (from its status)
        #: fault tolerance (``runtime.rejoin``, set by the daemon): lock-step algorithms
        #: skip ahead when updates received from the neighbours show them rounds ahead
        self.catch_up = catch_up
        #: catch-up evidence: peer -> highest round of one of its messages that passed every
        #: check on arrival, tensors included (:meth:`check_on_arrival`)
        self.latest_round: dict[str, int] = {}
        self._arrival_checks: dict[str, Callable[[Message], str | None]] = {}
        self.caught_up = 0  # rounds skipped to catch up with the neighbours
        #: aggregation / mutual-learning / transfer steps that left a non-finite model, which
        #: the algorithm restored (Algorithm.divergence_guard); see :meth:`note_diverged`
        self.diverged = 0
        self._diverged_warned = -1  # the round of the last WARNING about it
        #: ``runtime.max_catch_up_rounds``: the most rounds one skip moves this node
        self.max_catch_up_rounds = max_catch_up_rounds
        #: the run's last round (set by the daemon): a skip never passes it, so the node
        #: runs the last round itself and no claim of its neighbours ends its run
        self.final_round: int | None = final_round
        self.gate: Callable[[], str | None] | None = gate  # None = may train, else the reason
        self.gate_poll = gate_poll  # seconds between gate checks while gated
        self.gated: str | None = None  # this node's current gating reason
        self.gate_hook: Callable[[str | None], Awaitable[None]] | None = None  # on change
        #: ``runtime.pause_when_disconnected`` (set by the daemon): no training while the
        #: transport has lost its broker, instead of running rounds alone
        self.pause_when_disconnected = pause_when_disconnected
        self.reconnect_poll = 0.5  # seconds between connection checks while paused
        self.disconnected_seconds = 0.0  # time spent paused for a lost broker connection
        # -- compression and byte accounting (issue 8) --
        self.compression = compression
        self.compression_rng = np.random.default_rng([init_seed, 0xC0DEC])
        self._error_feedback: dict[str, ErrorFeedback] = {}
        self.float32_bytes_sent = 0  # what the sent messages would have taken with float32 tensors
        self._round_sent: collections.Counter[str] = collections.Counter()
        self._round_received: collections.Counter[str] = collections.Counter()
        self.last_round_bytes: dict[str, Any] = {}
        #: real seconds spent this round (perf_counter): ``train_s`` in :meth:`compute`,
        #: ``encode_s`` encoding outgoing messages, ``send_s`` in the transport's send,
        #: ``receive_s`` decoding and checking incoming frames; reset by :meth:`end_round`
        #: (the finished round's copy is :attr:`last_round_timing`)
        self.timing: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
        self.last_round_timing: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
        self.security = security
        #: the simulator's :class:`~dfl_agent.runtime.batching.BatchTrainer` (None: every
        #: :meth:`compute` runs on its own, as in the daemon)
        self.batcher: Any = batcher
        self._sealed = True  # from here on, only declared attributes may be set (__setattr__)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_sealed" in self.__dict__ and not hasattr(self, name):
            raise AttributeError(f"RuntimeContext has no attribute {name!r}: pass settings to its constructor")
        object.__setattr__(self, name, value)

    def set_hooks(self, *, round_hook: RoundHook | None = None,
                  gate_hook: Callable[[str | None], Awaitable[None]] | None = None) -> None:
        """Install the node's callbacks: ``round_hook(round, info)`` after every round
        (:meth:`end_round`) and ``gate_hook(reason)`` when the gating reason changes."""
        self.round_hook = round_hook
        self.gate_hook = gate_hook

    def enable_catch_up(self) -> None:
        """Turn on catch-up (``runtime.rejoin``): lock-step algorithms skip ahead when a
        quorum of the neighbours shows later rounds (:meth:`catch_up_round`)."""
        self.catch_up = True

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Start the transport and begin receiving."""
        self._started = True
        if hasattr(self.transport, "prepare_frame"):
            # decode and verify on the transport's network thread: the event loop is
            # handed finished messages (MqttTransport)
            self.transport.prepare_frame = self.prepare_frame
        await self.transport.start(self._on_frame, self._on_presence)

    async def stop(self) -> None:
        await self.transport.stop()

    # -- inbound ------------------------------------------------------------------
    def _on_presence(self, node_id: str, descriptor: dict[str, Any] | None) -> None:
        if descriptor is None:
            self.peers.withdraw(node_id, "presence")
        else:
            if self.security is not None and isinstance(descriptor.get("cert"), dict):
                self.security.learn(node_id, descriptor["cert"])  # a hint; trust needs a valid certificate
            fields = {k: v for k, v in descriptor.items() if isinstance(v, (str, int, float))}
            fields.pop("node_id", None)
            self.peers.upsert(node_id, "presence", **fields)
            if node_id != self.node_id:
                self._compatible(node_id)  # exclude an incompatible peer as soon as it is seen
        self._notify()

    def _drop(self, reason: str, detail: str, sender: str = "?") -> None:
        self.rejected[reason] += 1
        log.warning("dropped message from %s: %s %s", sender, reason, detail)

    def prepare_frame(self, frame: bytes, wire_bytes: int) -> PreparedFrame:
        """Decode ``frame`` and check its signature; safe to call on another thread than
        the event loop's (it reads this context's settings and the security guard's
        trust store, and changes nothing else).  Never raises: failures are in the
        result, and the event loop's :meth:`_on_frame` counts them."""
        t0 = time.perf_counter()
        msg: Message | None = None
        header: dict[str, Any] | None = None
        error: tuple[str, str] | None = None
        verdict: str | None = None
        try:
            msg, header = wire.decode_with_header(
                frame, federation=self.federation, recipient=self.node_id, max_frame_bytes=self.max_frame_bytes)
        except wire.WireError as exc:
            error = (exc.reason, exc.detail)
        except Exception as exc:  # never let bad input kill the node
            error = ("malformed", repr(exc))
        if msg is not None and header is not None and self.security is not None:
            try:
                verdict = self.security.verify(header, getattr(header, "signed_bytes", None))
            except Exception as exc:  # never let bad input kill the node
                verdict = "malformed"
                log.debug("security check failed on %r", exc)
        return PreparedFrame(msg, header, error, verdict, time.perf_counter() - t0)

    def _on_frame(self, frame: bytes | PreparedFrame, wire_bytes: int) -> None:
        t0 = time.perf_counter()
        try:
            self._on_frame_checked(frame, wire_bytes)
        finally:
            self.timing["receive_s"] += time.perf_counter() - t0 + (
                frame.seconds if isinstance(frame, PreparedFrame) else 0.0)

    def _on_frame_checked(self, frame: bytes | PreparedFrame, wire_bytes: int) -> None:
        parsed: dict[str, Any] | None = None  # the parsed envelope, when decoding gave it
        verdict: str | None = None  # the signature verdict, when it was checked off the loop
        if isinstance(frame, PreparedFrame):
            if frame.error is not None or frame.msg is None:
                reason, detail = frame.error or ("malformed", "no message")
                self._drop(reason, detail)
                return
            msg, parsed, verdict = frame.msg, frame.header, frame.verdict
        else:
            try:
                decode_once = getattr(frame, "decode_once", None)  # a shared broadcast (memory transport)
                if decode_once is not None:
                    msg = decode_once(federation=self.federation, recipient=self.node_id,
                                      max_frame_bytes=self.max_frame_bytes)
                else:
                    msg, parsed = wire.decode_with_header(
                        frame, federation=self.federation, recipient=self.node_id,
                        max_frame_bytes=self.max_frame_bytes)
            except wire.WireError as exc:
                self._drop(exc.reason, exc.detail)
                return
            except Exception as exc:  # never let bad input kill the node
                self._drop("malformed", repr(exc))
                return
        if msg.sender == self.node_id:
            # no transport hands a node its own frames (MQTT skips its own "out" topic, the
            # memory network its sender): this one was forged or replayed in our name
            self._drop("self_addressed", f"{msg.kind} round {msg.round}", msg.sender)
            return
        if msg.sender in self.excluded and msg.kind != "onnx.model":
            self._drop("incompatible_peer", self.excluded[msg.sender], msg.sender)
            return
        header: dict[str, Any] | None = None
        if self.security is not None:  # -- security: signature, trust and replay checks
            try:
                header = parsed if parsed is not None else wire.raw_header(frame)  # type: ignore[arg-type]
                # the round is remembered (replay rule) only once every check passed, below
                reason = (verdict if verdict == "malformed" else
                          self.security.check(header, remember_round=False,
                                              signed_bytes=getattr(parsed, "signed_bytes", None), verdict=verdict))
            except Exception as exc:  # never let bad input kill the node
                reason = "malformed"
                log.debug("security check failed on %r", exc)
            if reason is not None:
                self._drop(reason, f"{msg.kind} round {msg.round}", msg.sender)
                return
        if msg.msg_id in self._seen_ids:
            self.rejected["duplicate"] += 1
            return
        self._seen_ids.add(msg.msg_id)
        self._seen_order.append(msg.msg_id)
        if len(self._seen_order) > 4096:
            self._seen_ids.discard(self._seen_order.popleft())
        if msg.round < self.current_round - 1:
            self._drop("stale", f"round {msg.round} < {self.current_round - 1}", msg.sender)
            return
        msg.wire_bytes = wire_bytes
        self.bytes_received_by_kind[msg.kind] += wire_bytes
        self._round_received[msg.kind] += wire_bytes
        self.peers.touch(msg.sender)
        # the algorithm's own checks (tensor names/shapes/dtypes, meta), where they decide
        # something here: catch-up evidence (the daemon; the simulator leaves it off and
        # the algorithm checks what it takes)
        check = self._arrival_checks.get(msg.kind) if self.catch_up else None
        if check is not None:
            try:
                problem = check(msg)
            except Exception as exc:  # never let bad input kill the node
                problem = f"malformed: {exc!r}"
            if problem:
                self._drop(problem.split(":", 1)[0], problem, msg.sender)
                return
            # only now, with every check passed, is the message catch-up evidence
            if msg.round > self.latest_round.get(msg.sender, -1):
                self.latest_round[msg.sender] = msg.round
        if header is not None and self.security is not None:
            self.security.remember_round(header)
        if self._per_sender[msg.sender] >= self.max_queued_per_sender:
            oldest = next(i for i, m in enumerate(self._buffer) if m.sender == msg.sender)
            self._buffer.pop(oldest)
            self._per_sender[msg.sender] -= 1
            self.rejected["queue_full"] += 1
        self._buffer.append(msg)
        self._per_sender[msg.sender] += 1
        self._notify()

    def _notify(self) -> None:
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_result(True)

    # -- NodeContext ----------------------------------------------------------------
    async def send(self, peer: str, message: Message) -> int:
        message.recipient = peer
        t0 = time.perf_counter()
        frame, reference = self._encode(message)
        t1 = time.perf_counter()
        n = await self.transport.send(peer, frame)
        self.timing["encode_s"] += t1 - t0
        self.timing["send_s"] += time.perf_counter() - t1
        self._account_sent(message.kind, n, reference)
        return n

    async def broadcast(self, message: Message, *, neighbours_only: bool = False) -> int:
        message.recipient = BROADCAST
        t0 = time.perf_counter()
        frame, reference = self._encode(message)
        t1 = time.perf_counter()
        # the audience is the configured graph (None: no graph, every member); the
        # transport delivers to it where it can address receivers (the simulator)
        n = await self.transport.broadcast(frame, self.graph_neighbours if neighbours_only else None)
        self.timing["encode_s"] += t1 - t0
        self.timing["send_s"] += time.perf_counter() - t1
        self._account_sent(message.kind, n, reference)
        return n

    # -- compression and byte accounting (issue 8) ------------------------------------
    def _encode(self, message: Message) -> tuple[bytes, int]:
        """Compress (per ``self.compression``) and frame ``message``.

        Returns ``(frame, reference)``: ``reference`` = bytes of the tensors as float32
        minus the bytes that replaced them (0 when nothing was compressed), so that
        ``wire bytes + reference`` is the message's float32 size.
        """
        orig = out = message
        policy = self.compression
        if message.encoding is not None and set(message.tensors) != {codec.BLOB}:
            # a received (already decoded) message sent on: its description no longer applies
            out = message = dataclasses.replace(message, encoding=None)
        if message.encoding is None and message.tensors and policy is not None:
            spec = policy.message_spec(message.kind)
            if not spec.is_identity:
                if spec.sparse and policy.error_feedback:
                    ef = self._error_feedback.setdefault(message.kind, ErrorFeedback(spec))
                    blob, desc, _ = ef.compress(message.recipient, message.tensors, self.compression_rng)
                    wire_tensors = {codec.BLOB: blob}
                else:
                    wire_tensors, desc, _ = codec.encode_tensors(message.tensors, spec, self.compression_rng)
                out = dataclasses.replace(message, tensors=wire_tensors, encoding=desc)
        frame = wire.encode(out, federation=self.federation, sender=self.node_id, **self._signing())
        if out is not orig:
            orig.msg_id, orig.time, orig.sender, orig.wire_bytes = out.msg_id, out.time, out.sender, out.wire_bytes
        reference = 0
        if out.encoding is not None and codec.BLOB in out.tensors:
            reference = codec.float32_bytes_of(out.encoding) - int(np.asarray(out.tensors[codec.BLOB]).nbytes)
        return frame, reference

    def _account_sent(self, kind: str, n: int, reference: int) -> None:
        self.bytes_sent_by_kind[kind] += n
        self._round_sent[kind] += n
        self.float32_bytes_sent += n + reference if n else 0

    def byte_accounting(self) -> dict[str, Any]:
        """Bytes on the wire by kind (cumulative and for the last finished round) and
        the compression ratio against the same messages with float32 tensors."""
        sent = sum(self.bytes_sent_by_kind.values())
        return {
            "bytes_sent_by_kind": dict(self.bytes_sent_by_kind),
            "bytes_received_by_kind": dict(self.bytes_received_by_kind),
            "float32_bytes_sent": self.float32_bytes_sent,
            "compression_ratio": (self.float32_bytes_sent / sent) if sent else 1.0,
            **self.last_round_bytes,
        }
    def _signing(self) -> dict[str, Any]:
        sec = self.security
        if sec is None or sec.key is None:
            return {}
        return {"sign": sec.sign, "cert": sec.certificate}

    def _take(self, kind: str | tuple[str, ...], round: int | None, sender: str | None) -> Message | None:
        kinds = (kind,) if isinstance(kind, str) else kind
        for i, m in enumerate(self._buffer):
            if m.kind in kinds and (round is None or m.round == round) and (sender is None or m.sender == sender):
                self._per_sender[m.sender] -= 1
                return self._buffer.pop(i)
        return None

    async def receive(
        self, kind: str | tuple[str, ...], *, round: int | None = None, sender: str | None = None, deadline: float | None = None
    ) -> Message | None:
        assert self._started, "RuntimeContext.start() not called"
        loop = asyncio.get_running_loop()
        while True:
            msg = self._take(kind, round, sender)
            if msg is not None:
                return msg
            if deadline is not None and loop.time() >= deadline:
                return None
            # Wait for the next arrival or presence change, or the absolute deadline
            # (call_at keeps the deadline exact, so virtual time lands on it).
            fut: asyncio.Future[bool] = loop.create_future()
            self._waiters.add(fut)
            handle = None
            if deadline is not None:

                def expire(f: asyncio.Future[bool] = fut) -> None:
                    if not f.done():
                        f.set_result(False)

                handle = loop.call_at(deadline, expire)
            try:
                await fut
            finally:
                self._waiters.discard(fut)
                if handle is not None:
                    handle.cancel()

    def live_peers(self) -> list[str]:
        """Live peers that take part: incompatible peers (``compatibility``) and peers
        that report themselves gated are left out.

        Without heartbeat expiry and without security (the simulator), the answer only
        changes with the peer table, the exclusions or the gated peers, and is memoised
        on those: a thousand nodes asking several times a round stay O(N) each."""
        changes = getattr(self.peers, "changes", None)
        cacheable = (self.security is None and changes is not None
                     and getattr(self.peers, "heartbeat_timeout", 0) is None)
        key = (changes, len(self.excluded), self._gated_changes) if cacheable else None
        if key is not None and self._live_cache is not None and self._live_cache[0] == key:
            return list(self._live_cache[1])
        live = [p for p in self.peers.live_peers() if self._participates(p)]
        if self.security is not None:  # discovery is a hint: members need a trusted key
            live = [p for p in live if self.security.is_member(p)]
        if key is not None:  # _participates may have excluded peers: key on the state after
            self._live_cache = ((changes, len(self.excluded), self._gated_changes), list(live))
        return live

    def _participates(self, peer: str) -> bool:
        if self.peer_gated.get(peer):
            return False
        return self._compatible(peer)

    def _compatible(self, peer: str) -> bool:
        """Whether ``peer``'s advertised model can take part (``compatibility``);
        an incompatible peer is excluded (and counted) the first time it is seen."""
        if self.compatibility is None:
            return True
        if peer in self.excluded:
            return False
        info = self.peers.get(peer)
        reason = self.compatibility(info) if info is not None else None
        if reason is None:
            return True
        self.excluded[peer] = reason
        if not reason.startswith("inference-only"):
            self.rejected["incompatible_peer"] += 1
            log.warning("excluding peer %s: %s", peer, reason)
        return False

    def note_status(self, peer: str, status: Any) -> None:
        """A peer's status document arrived (heartbeat): remember whether it is gated."""
        if isinstance(status, dict):
            gated = status.get("gated")
            before = self.peer_gated.get(peer)
            if isinstance(gated, str) and gated:
                self.peer_gated[peer] = gated
            else:
                self.peer_gated.pop(peer, None)
            if self.peer_gated.get(peer) != before:
                self._gated_changes += 1

    def may_aggregate(self, peer: str) -> bool:
        """Whether ``peer`` (or this node) may lead a rotating round: its advertised
        roles include ``aggregator`` (no roles advertised = yes)."""
        if peer == self.node_id:
            return self.behaviour is None or "aggregator" in self.behaviour.roles
        info = self.peers.get(peer)
        roles = str(info.extra.get("roles", "")) if info is not None else ""
        return not roles or "aggregator" in roles.split(",")

    async def wait_until_allowed(self) -> None:
        """Return when resource gating allows training; meanwhile report the reason.

        Checks ``gate`` now and then every ``gate_poll`` seconds; each change of the
        reason is logged and passed to ``gate_hook`` (the node republishes its status).
        First, with ``pause_when_disconnected``, waits for a lost broker connection to
        come back (:meth:`wait_for_broker`)."""
        await self.wait_for_broker()
        if self.gate is None:
            return
        while True:
            reason = self.gate()
            kind = (reason or "").split(" ", 1)[0]  # battery / temperature / load / outside
            changed = kind != (self.gated or "").split(" ", 1)[0]
            self.gated = reason
            if changed:  # log and republish when the cause changes, not every reading
                if reason:
                    log.warning("%s: training paused: %s", self.node_id, reason)
                else:
                    log.info("%s: training resumed", self.node_id)
                if self.gate_hook is not None:
                    await self.gate_hook(reason)
            if reason is None:
                return
            await self.clock.sleep(self.gate_poll)

    async def wait_for_broker(self) -> None:
        """With ``pause_when_disconnected``: return once the transport is connected.

        A node cut off from its broker hears nothing from its peers; without the pause it
        would train and close rounds alone until it reconnects (and then has to catch
        up).  While paused, :attr:`gated` says why and :attr:`disconnected_seconds`
        grows (status ``paused_disconnected_s``).  The simulator leaves the option off;
        a transport without a ``connected`` attribute never pauses."""
        if not self.pause_when_disconnected or getattr(self.transport, "connected", True):
            return
        since = self.clock.now()
        previous, self.gated = self.gated, "not connected to the MQTT broker"
        log.warning("%s: training paused: not connected to the MQTT broker", self.node_id)
        try:
            while not getattr(self.transport, "connected", True):
                await self.clock.sleep(self.reconnect_poll)
        finally:
            self.gated = previous
            self.disconnected_seconds += self.clock.now() - since
        log.info("%s: training resumed: connected again after %.1f s", self.node_id, self.clock.now() - since)

    def neighbours(self) -> list[str]:
        live = self.live_peers()
        if self.graph_neighbours is None:
            return live
        allowed = self._graph_allowed()
        assert allowed is not None
        return [p for p in live if p in allowed]

    def _graph_allowed(self) -> frozenset[str] | None:
        """``graph_neighbours`` as a set (rebuilt when the list is replaced or resized)."""
        g = self.graph_neighbours
        if g is None:
            return None
        if self._graph_src is not g or len(g) != self._graph_len:
            self._graph_src, self._graph_set, self._graph_len = g, frozenset(g), len(g)
        return self._graph_set

    def check_on_arrival(self, kind: str, check: Callable[[Message], str | None]) -> None:
        """Check every arriving message of ``kind`` with ``check`` (``"reason: detail"``
        for a bad one, None for a good one) as soon as it passed the envelope checks
        (signature, trust, replay, staleness).  A bad message is dropped and counted under
        its reason; only a good one is catch-up evidence (:meth:`catch_up_round`).
        Messages of kinds without a check are delivered as before but are no evidence.
        The checks run while :attr:`catch_up` is on (the daemon); otherwise only the
        algorithm checks what it takes, once."""
        self._arrival_checks[kind] = check

    def catch_up_round(self, next_round: int) -> int:
        """The round to run after ``next_round - 1`` (see :func:`catch_up_target`).

        Evidence: updates of later rounds received from live (verified, when signatures
        are on) neighbours that passed every check on arrival, tensors included (a
        round-``r`` update shows that its sender completed round ``r - 1``).  The node
        skips only when more than half of its live neighbours (at least two distinct
        senders when two or more are live) showed a later round, and then by at most
        :attr:`max_catch_up_rounds` rounds and never past :attr:`final_round`; without
        :attr:`catch_up` it never skips."""
        if not self.catch_up:
            return next_round
        live = self.neighbours()
        shown = {p: self.latest_round[p] - 1 for p in live if p in self.latest_round}
        target = catch_up_target(next_round, shown, len(live), self.max_catch_up_rounds)
        if self.final_round is not None:
            target = max(next_round, min(target, self.final_round))
        if target == next_round:
            return next_round
        self.caught_up += target - next_round
        log.warning("%s: most live neighbours completed later rounds without this node; skipping rounds %d-%d "
                    "to rejoin them (at most runtime.max_catch_up_rounds = %d at once)",
                    self.node_id, next_round, target - 1, self.max_catch_up_rounds)
        return target

    def is_neighbour(self, peer: str) -> bool:
        if peer == self.node_id or self.peers.get(peer) is None or not self._compatible(peer):
            return False
        allowed = self._graph_allowed()
        if allowed is not None and peer not in allowed:
            return False
        return self.security is None or self.security.is_member(peer)

    async def compute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        await self.wait_until_allowed()  # resource gating: no training while gated
        if self.batcher is not None and not self.compute_in_thread:
            # the simulator's batched training: a qualifying call waits for its group's
            # vectorised step (which adds this node's share to timing["train_s"])
            fut = self.batcher.submit(self, fn, args, kwargs)
            if fut is not None:
                return await fut
        t0 = time.perf_counter()
        try:
            return await self.compute_ungated(fn, *args, **kwargs)
        finally:
            self.timing["train_s"] += time.perf_counter() - t0

    async def compute_ungated(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """:meth:`compute` without resource gating (evaluation, ONNX export)."""
        if self.compute_in_thread:
            loop = asyncio.get_running_loop()
            if self.abort is None:
                return await loop.run_in_executor(None, functools.partial(fn, *args, **kwargs))
            return await loop.run_in_executor(None, functools.partial(_abortable_call, self.abort, fn, args, kwargs))
        return fn(*args, **kwargs)

    def reject(self, message: Message, reason: str) -> None:
        """The algorithm refused ``message`` (bad tensors, ...): drop it, count the
        reason, and forget its round as catch-up evidence."""
        self._drop(reason.split(":", 1)[0], reason, message.sender)
        if self.latest_round.get(message.sender, -1) <= message.round:
            self.latest_round.pop(message.sender, None)

    def note_diverged(self, step: str, detail: str) -> None:
        """An aggregation, mutual-learning or transfer step left a non-finite model, which
        the algorithm restored to its state before the step: count it (``diverged`` in
        :meth:`counters`, round records and the status) and log a WARNING, at most once
        per round (further ones that round are counted only)."""
        self.diverged += 1
        if self._diverged_warned != self.current_round:
            self._diverged_warned = self.current_round
            log.warning("%s: %s step left non-finite parameters (%s); restored the model from before the step "
                        "and going on (diverged steps so far: %d; not logged again this round)",
                        self.node_id, step, detail, self.diverged)

    async def end_round(self, round: int, **info: Any) -> None:
        self.current_round = round + 1
        # forget buffered messages of rounds that can no longer be used
        keep = [m for m in self._buffer if m.round >= round]
        for m in self._buffer:
            if m.round < round:
                self._per_sender[m.sender] -= 1
        self._buffer = keep
        self.last_round_bytes = {
            "round_bytes_sent": sum(self._round_sent.values()),
            "round_bytes_received": sum(self._round_received.values()),
            "round_bytes_sent_by_kind": dict(self._round_sent),
            "round_bytes_received_by_kind": dict(self._round_received),
        }
        self._round_sent.clear()
        self._round_received.clear()
        self.last_round_timing = dict(self.timing)  # ("round" is the parameter here)
        self.timing = dict.fromkeys(TIMING_KEYS, 0.0)
        if self.round_hook is not None:
            await self.round_hook(round, info)

    # -- reporting ------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        """Byte and drop counters (transport + message level) and ``diverged`` (steps whose
        non-finite result was restored, :meth:`note_diverged`) as a JSON-friendly dict."""
        s = self.transport.stats
        dropped = collections.Counter(s.dropped)
        dropped.update(self.rejected)
        return {
            "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received,
            "bytes_sent_by_kind": dict(self.bytes_sent_by_kind),
            "bytes_received_by_kind": dict(self.bytes_received_by_kind),
            "dropped": dict(dropped),
            "diverged": self.diverged,
            "float32_bytes_sent": self.float32_bytes_sent,
            "compression_ratio": self.byte_accounting()["compression_ratio"],
            #: error-feedback streams reset because their residual went non-finite
            "ef_resets": sum(ef.resets for ef in self._error_feedback.values()),
        }


def _abortable_call(event: threading.Event, fn: Callable[..., T], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> T:
    """``fn(*args, **kwargs)`` in a worker thread whose local training stops when
    ``event`` is set."""
    from dfl_agent.learning.training import abortable

    with abortable(event):
        return fn(*args, **kwargs)
