"""``RuntimeContext``: the :class:`~dfl_agent.algorithms.context.NodeContext` over any transport.

A thin façade over four parts: the inbox decodes, validates, de-duplicates and buffers
incoming frames (:mod:`dfl_agent.runtime.node.inbox`); the outbox encodes, compresses and
counts outgoing messages (:mod:`dfl_agent.runtime.node.outbox`); membership says who takes
part (:mod:`dfl_agent.runtime.node.membership`); the compute gate says when and where training
runs (:mod:`dfl_agent.runtime.node.compute_gate`).  A frame that fails any check is dropped,
logged and counted in ``rejected`` (by reason); the node keeps running and its model is
untouched.  The same class serves the simulator (memory transport, virtual-time loop,
inline compute) and the daemon (MQTT, wall clock, compute in a worker thread).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import operator
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import numpy as np

from dfl_agent.algorithms.context import BROADCAST, Message
from dfl_agent.algorithms.protocols.synchronization import UpdateMarket
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.compression import CompressionPolicy
from dfl_agent.runtime.node.compute_gate import ComputeGate
from dfl_agent.runtime.node.inbox import Inbox, PreparedFrame
from dfl_agent.runtime.node.membership import Membership
from dfl_agent.runtime.node.outbox import Outbox
from dfl_agent.runtime.node.waiting import Collected, RoundWaiting
from dfl_agent.transport import wire
from dfl_agent.transport.base import Transport

if TYPE_CHECKING:
    from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy
    from dfl_agent.data import NodeData
    from dfl_agent.discovery.peers import PeerInfo
    from dfl_agent.learning.error_feedback import ChocoGossip
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.profiles.behaviour import Behaviour
    from dfl_agent.runtime.node.batching import BatchTrainer
    from dfl_agent.security.trust import SecurityGuard

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")

#: per-round time accounting keys of :attr:`RuntimeContext.timing` (seconds)
TIMING_KEYS = ("train_s", "encode_s", "send_s", "receive_s")

RoundHook = Callable[[int, dict[str, Any]], Awaitable[None]]

#: ``runtime.max_catch_up_rounds``'s default: the most rounds one catch-up skips
MAX_CATCH_UP_ROUNDS = 10


class LoopClock:
    """The running event loop's clock (monotonic wall time, or virtual time in the simulator)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


def _part_state(part: str, name: str, doc: str) -> Any:
    """A read-only façade attribute: ``self.<part>.<name>``."""
    return property(operator.attrgetter(f"{part}.{name}"), doc=doc)


class RuntimeContext:
    """One node's :class:`NodeContext`: a thin façade over its parts.

    - :attr:`inbox` (:class:`~dfl_agent.runtime.node.inbox.Inbox`): received bytes -> checked,
      buffered messages, one pipeline for both transports;
    - :attr:`outbox` (:class:`~dfl_agent.runtime.node.outbox.Outbox`): encode, compress with
      error feedback, sign, account bytes;
    - :attr:`membership` (:class:`~dfl_agent.runtime.node.membership.Membership`): live peers,
      neighbours, exclusions, peers' gating, catch-up;
    - :attr:`gate_part` (:class:`~dfl_agent.runtime.node.compute_gate.ComputeGate`): resource
      gating, the disconnect pause, where compute runs (thread, inline, batched).

    The settings below are the context's own attributes, which the parts read.

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
        batcher: the simulator's :class:`~dfl_agent.runtime.node.batching.BatchTrainer`
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
        straggler: ``runtime.straggler``'s policy (None: the papers' lock step).
        alone_waits: ``() -> bool``: whether a round with no live neighbour waits for its
            deadline (the run has members that are away); None: it does not.
        virtual_train_s: the simulator's ``--speeds``: virtual seconds each training call takes.

    Attributes beside the arguments: ``timing``, real seconds spent this round
    (perf_counter): ``train_s`` in :meth:`compute`, ``encode_s`` encoding outgoing
    messages, ``send_s`` in the transport's send, ``receive_s`` decoding and checking
    incoming frames, reset by :meth:`end_round` (the finished round's copy is
    ``last_round_timing``); ``persistent_state``, state that survives restarts (name ->
    numpy array, saved in every checkpoint and restored before the first round, e.g.
    error-feedback residuals "ef/{peer}/{tensor}"; see :mod:`dfl_agent.runtime.node.checkpoint`);
    ``diverged``, steps whose non-finite result the algorithm restored
    (:meth:`note_diverged`); ``rejected``, dropped messages by reason.

    The context is complete when constructed: setting an attribute it does not declare
    raises ``AttributeError`` (a typo cannot silently add a setting nobody reads).
    """

    #: rounds an update may lag beyond the previous round before the inbox drops it as
    #: stale (an algorithm whose update market keeps late updates says so: :meth:`keep_late_updates`)
    max_staleness: int = 0

    def __init__(
        self,
        *,
        node_id: str,
        federation: str,
        transport: Transport,
        peers: PeerTable,
        data: NodeData,
        model_spec: Mapping[str, Any],
        train: TrainConfig,
        init_seed: int,
        rng: np.random.Generator,
        device: str = "cpu",
        compute_in_thread: bool = False,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        max_queued_per_sender: int = 16,
        graph_neighbours: list[str] | None = None,
        seed: int = 0,
        compression: CompressionPolicy | None = None,
        security: SecurityGuard | None = None,
        behaviour: Behaviour | None = None,
        compatibility: Callable[[PeerInfo], str | None] | None = None,
        batcher: BatchTrainer | None = None,
        gate: Callable[[], str | None] | None = None,
        gate_poll: float = 5.0,
        pause_when_disconnected: bool = False,
        max_catch_up_rounds: int = MAX_CATCH_UP_ROUNDS,
        final_round: int | None = None,
        catch_up: bool = False,
        persistent_state: Mapping[str, Any] | None = None,
        straggler: StragglerPolicy | None = None,
        alone_waits: Callable[[], bool] | None = None,
        virtual_train_s: float = 0.0,
    ):
        self.node_id, self.federation, self.transport, self.peers = node_id, federation, transport, peers
        self.data, self.model_spec, self.train = data, dict(model_spec), train
        self.init_seed, self.seed, self.rng, self.device = init_seed, seed, rng, device
        self.clock = LoopClock()
        self.compute_in_thread, self.max_frame_bytes = compute_in_thread, max_frame_bytes
        self.graph_neighbours = None if graph_neighbours is None else sorted(set(graph_neighbours) - {node_id})
        self.round_hook: RoundHook | None = None
        self.gate_hook: Callable[[str | None], Awaitable[None]] | None = None  # on a change of the gating reason
        self.status_hook: Callable[[], Awaitable[None]] | None = None  # publishes the node's status now
        self.current_round = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self.persistent_state: dict[str, Any] = dict(persistent_state or {})
        # the straggler policy (None: lock step), whether a round alone waits, the simulator's --speeds
        self.straggler, self.alone_waits, self.virtual_train_s = straggler, alone_waits, virtual_train_s
        self._started = False
        self.behaviour, self.compatibility, self.batcher = behaviour, compatibility, batcher
        self.gate: Callable[[], str | None] | None = gate  # None = may train, else the reason
        self.gate_poll = gate_poll  # seconds between gate checks while gated
        self.catch_up, self.max_catch_up_rounds = catch_up, max_catch_up_rounds
        self.pause_when_disconnected, self.final_round = pause_when_disconnected, final_round
        self.diverged = 0  # non-finite steps restored (Algorithm.divergence_guard): note_diverged
        self._diverged_warned = -1  # the round of the last WARNING about it
        self.compression, self.security = compression, security
        self.last_round_bytes: dict[str, Any] = {}
        self.timing: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
        self.last_round_timing: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
        #: the finished round: the verified neighbours this node expected in it (live while
        #: it was connected: at its start, while it waited, or as it closed) and the seconds
        #: it was held for a lost broker (:meth:`hold_round`)
        self.last_round_expected: list[str] = []
        self.last_round_paused = 0.0
        # -- the parts
        self.inbox = Inbox(self, max_queued_per_sender)
        self.outbox = Outbox(self, init_seed)
        self.membership = Membership(self)
        self.gate_part = ComputeGate(self)
        self._waiting: dict[str, RoundWaiting] = {}  # the round's waiting policy, by kind (collect)
        self._sealed = True  # from here on, only declared attributes may be set (__setattr__)

    # -- the parts' state, under the names algorithms, the node and tests read ------------
    excluded = _part_state("membership", "excluded", "peer -> why it is excluded (incompatible model)")
    caught_up = _part_state("membership", "caught_up", "rounds skipped to catch up with the neighbours")
    latest_round = _part_state("inbox", "latest_round", "catch-up evidence: peer -> highest checked round")
    bytes_received_by_kind = _part_state("inbox", "bytes_received_by_kind", "wire bytes received by kind")
    bytes_sent_by_kind = _part_state("outbox", "bytes_sent_by_kind", "wire bytes sent by kind")
    gated = _part_state("gate_part", "gated", "this node's current gating reason (None: training allowed)")
    disconnected_seconds = _part_state("gate_part", "disconnected_seconds",
                                       "time spent paused for a lost broker connection")
    reconnect_poll = _part_state("gate_part", "reconnect_poll", "seconds between connection checks while paused")
    abort = _part_state("gate_part", "abort", "set when the run stops: training in a worker thread ends")
    paused = _part_state("gate_part", "paused", "held now because the broker is away (status state ``paused``)")
    reconnect_grace = _part_state("gate_part", "reconnect_grace",
                                  "after a broker outage, the longest wait for the expected neighbours (s)")

    def __setattr__(self, name: str, value: Any) -> None:
        if "_sealed" in self.__dict__ and not hasattr(self, name):
            raise AttributeError(f"RuntimeContext has no attribute {name!r}: pass settings to its constructor")
        object.__setattr__(self, name, value)

    async def collect(self, kind: str, t: int, *, market: UpdateMarket, round_timeout: float, poll: float,
                      accept: Callable[[Message], str | None],
                      decode: Callable[[dict[str, Message]], dict[str, Message]]) -> Collected:
        """The round-``t`` updates of ``kind`` from the neighbours, as the round's waiting policy
        decides (:class:`~dfl_agent.runtime.node.waiting.RoundWaiting`: deadlines fixed or adaptive,
        quorum, the broker-outage hold, keyframe retries, staleness weights) over the
        algorithm's update ``market`` (the first call of a kind fixes its market, deadline and poll)."""
        waiting = self._waiting.get(kind)
        if waiting is None:
            waiting = self._waiting[kind] = RoundWaiting(self, market, round_timeout, poll)
        return await waiting.collect(kind, t, accept=accept, decode=decode)

    @property
    def quorum(self) -> bool:
        """Whether the node runs under ``runtime.straggler = "quorum"`` (else the papers' lock step)."""
        return self.straggler is not None and bool(self.straggler.quorum)

    def use_train(self, train: TrainConfig) -> None:
        """Train with ``train`` (a :class:`~dfl_agent.learning.training.TrainConfig`) from now on
        (a warm start's learning-rate ramp changes it round by round)."""
        self.train = train

    def track_stream(self, stream: ChocoGossip) -> None:
        """Follow a CHOCO gossip stream: ask for the keyframes its copies lost
        (:meth:`request_keyframes`), and send a keyframe to a peer that came back (its epoch
        moves with :attr:`Membership.rejoins`)."""
        membership = self.membership
        membership.streams.append(stream)
        stream.epoch_source = lambda: (membership.rejoins, stream.gaps)

    def keep_late_updates(self, rounds: int) -> None:
        """The algorithm takes updates up to ``rounds`` rounds late (its update market's
        ``max_staleness``): the inbox keeps them that long instead of dropping them as stale."""
        self.max_staleness = rounds

    def set_hooks(self, *, round_hook: RoundHook | None = None,
                  gate_hook: Callable[[str | None], Awaitable[None]] | None = None,
                  status_hook: Callable[[], Awaitable[None]] | None = None) -> None:
        """Install the node's callbacks: ``round_hook(round, info)`` after every round
        (:meth:`end_round`), ``gate_hook(reason)`` when the gating reason changes and
        ``status_hook()`` to publish the status now (:meth:`request_keyframes`)."""
        self.round_hook = round_hook
        self.gate_hook = gate_hook
        self.status_hook = status_hook

    async def request_keyframes(self) -> None:
        """Ask the neighbours whose CHOCO stream this node lost for keyframes now: publish
        the status (its ``keyframe_wanted``, :meth:`Membership.keyframe_wanted`) when that
        list changed, else at most once a second.  A round that waits for updates it can
        decode would otherwise ask only at its end, and the status heartbeat repeats the
        last status published."""
        wanted, now = self.membership.keyframe_wanted(), self.clock.now()
        asked, at = self.membership.keyframes_asked
        if not wanted or self.status_hook is None or (wanted == asked and now - at < 1.0):
            return
        self.membership.keyframes_asked = (wanted, now)
        await self.status_hook()

    def enable_catch_up(self) -> None:
        """Turn on catch-up (``runtime.rejoin``): lock-step algorithms skip ahead when a
        quorum of the neighbours shows later rounds (:meth:`catch_up_round`)."""
        self.catch_up = True

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Start the transport and begin receiving."""
        self._started = True
        # decode and verify on the transport's network thread where it has one: the event
        # loop is handed finished messages (MqttTransport)
        self.transport.use_prepare_frame(self.prepare_frame)
        await self.transport.start(self._on_frame, self._on_presence)

    async def stop(self) -> None:
        await self.transport.stop()

    # -- inbound (the inbox) ----------------------------------------------------------
    def _on_presence(self, node_id: str, descriptor: dict[str, Any] | None) -> None:
        self.membership.on_presence(node_id, descriptor)
        self.inbox.notify()

    def prepare_frame(self, frame: bytes, wire_bytes: int) -> PreparedFrame:
        """Decode ``frame`` and check its signature, on any thread (:meth:`Inbox.prepare_frame`)."""
        return self.inbox.prepare_frame(frame, wire_bytes)

    def _on_frame(self, frame: bytes | PreparedFrame, wire_bytes: int) -> None:
        self.inbox.on_frame(frame, wire_bytes)

    def _take(self, kind: str | tuple[str, ...], round: int | None, sender: str | None) -> Message | None:
        return self.inbox.take(kind, round, sender)

    async def receive(
        self, kind: str | tuple[str, ...], *, round: int | None = None, sender: str | None = None, deadline: float | None = None
    ) -> Message | None:
        assert self._started, "RuntimeContext.start() not called"
        return await self.inbox.receive(kind, round=round, sender=sender, deadline=deadline)

    def check_on_arrival(self, kind: str, check: Callable[[Message], str | None]) -> None:
        """Check every arriving message of ``kind`` with ``check`` (``"reason: detail"``
        for a bad one, None for a good one) as soon as it passed the envelope checks
        (signature, trust, replay, staleness).  A bad message is dropped and counted under
        its reason; only a good one is catch-up evidence (:meth:`catch_up_round`).
        Messages of kinds without a check are delivered as before but are no evidence.
        The checks run while :attr:`catch_up` is on (the daemon); otherwise only the
        algorithm checks what it takes, once."""
        self.inbox.arrival_checks[kind] = check

    def reject(self, message: Message, reason: str) -> None:
        """The algorithm refused ``message`` (bad tensors, ...): drop it, count the
        reason, and forget its round as catch-up evidence."""
        self.inbox.reject(message, reason)

    # -- outbound (the outbox) ------------------------------------------------------------
    async def send(self, peer: str, message: Message) -> int:
        message.recipient = peer
        return await self._transmit(message, peer, None)

    async def broadcast(self, message: Message, *, neighbours_only: bool = False) -> int:
        message.recipient = BROADCAST
        # the audience is the configured graph (None: no graph, every member); the
        # transport delivers to it where it can address receivers (the simulator)
        return await self._transmit(message, None, self.graph_neighbours if neighbours_only else None)

    async def _transmit(self, message: Message, peer: str | None, audience: list[str] | None) -> int:
        """Encode ``message``, send it to ``peer`` (None: broadcast to ``audience``), and
        account its time and bytes; returns the wire bytes."""
        t0 = time.perf_counter()
        frame, reference = self.outbox.encode(message)
        on_wire = self.outbox.last_encoded
        t1 = time.perf_counter()
        n = await (self.transport.send(peer, frame) if peer is not None else self.transport.broadcast(frame, audience))
        self.outbox.keep(peer, audience, on_wire)
        self.timing["encode_s"] += t1 - t0
        self.timing["send_s"] += time.perf_counter() - t1
        self.outbox.account(message.kind, n, reference)
        return n

    async def resend_round(self, kinds: Collection[str] | None = None, *, peer: str | None = None,
                           restarted: bool = False) -> int:
        """Send again the messages (of ``kinds``; None: all) sent this round and the round
        before, after a broker outage: a peer that reconnected later than this node missed what the broker
        passed on meanwhile.  Each goes as it went on the wire (not compressed again) in
        a new frame (:meth:`Outbox.reframe`: new message id and signature); a peer that
        has it already keeps one update per sender and round, and drops one of a round
        it has left behind as stale.  Returns the wire bytes sent.

        With ``peer``: only to that peer, the messages it was sent or among whose
        audience it was (a neighbour that came back: :meth:`ComputeGate.resend_to_returned`);
        with ``restarted`` too, each CHOCO difference goes as an exact keyframe, or not at
        all when it is not its stream's latest (:meth:`Outbox.as_keyframe`)."""
        n = 0
        for to, audience, message in self.outbox.recent():
            if kinds is not None and message.kind not in kinds:
                continue
            if peer is not None:
                if (to is not None and to != peer) or (to is None and audience is not None and peer not in audience):
                    continue
                resent = self.outbox.as_keyframe(message) if restarted else message
                if resent is None:
                    continue
                message, to, audience = dataclasses.replace(resent, recipient=peer), peer, None
            try:
                frame = self.outbox.reframe(message)
                n += await (self.transport.send(to, frame) if to is not None
                            else self.transport.broadcast(frame, audience))
            except Exception as exc:  # a peer whose broker is unreachable: the round goes on
                log.warning("%s: could not send %s of round %d again after the broker outage: %s",
                            self.node_id, message.kind, message.round, exc)
        return n

    def byte_accounting(self) -> dict[str, Any]:
        """Bytes on the wire by kind (cumulative and for the last finished round) and
        the compression ratio against the same messages with float32 tensors."""
        sent = sum(self.outbox.bytes_sent_by_kind.values())
        return {
            "bytes_sent_by_kind": dict(self.outbox.bytes_sent_by_kind),
            "bytes_received_by_kind": dict(self.inbox.bytes_received_by_kind),
            "float32_bytes_sent": self.outbox.float32_bytes_sent,
            "compression_ratio": (self.outbox.float32_bytes_sent / sent) if sent else 1.0,
            **self.last_round_bytes,
        }

    # -- membership -----------------------------------------------------------------------
    def live_peers(self) -> list[str]:
        """Live peers that take part, without incompatible or gated peers (and, with security,
        peers without a trusted key): :meth:`Membership.live_peers` (memoised in the simulator)."""
        return self.membership.live_peers()

    def live_peer_count(self) -> int:
        """How many peers are live and take part (:meth:`Membership.live_count`: the transport's
        count where presence reaches graph neighbours only, the simulator on a sparse graph)."""
        return self.membership.live_count()

    def neighbours(self) -> list[str]:
        return self.membership.neighbours()

    def is_neighbour(self, peer: str) -> bool:
        return self.membership.is_neighbour(peer)

    def note_status(self, peer: str, status: object) -> None:
        """A peer's status document arrived (heartbeat): remember whether it is gated."""
        self.membership.note_status(peer, status)

    def may_aggregate(self, peer: str) -> bool:
        """Whether ``peer`` (or this node) may lead a rotating round: its advertised
        roles include ``aggregator`` (no roles advertised = yes)."""
        return self.membership.may_aggregate(peer)

    @property
    def catching_up(self) -> bool:
        """Whether this node's last catch-up was capped (``runtime.max_catch_up_rounds``) and
        left it behind most of its live neighbours: its next round need not wait its deadline
        for updates of a round they have left; it takes their newest ones as soon as a quorum
        of them is there (``take_ahead`` of :meth:`UpdateMarket.collect`), then skips again."""
        return self.membership.behind

    def catch_up_round(self, next_round: int) -> int:
        """The round to run after ``next_round - 1`` (see :func:`~dfl_agent.runtime.node.membership.catch_up_target`).

        Evidence: updates of later rounds received from live (verified, when signatures
        are on) neighbours that passed every check on arrival, tensors included (a
        round-``r`` update shows that its sender completed round ``r - 1``).  The node
        skips only when more than half of its live neighbours (at least two distinct
        senders when two or more are live) showed a later round, and then by at most
        :attr:`max_catch_up_rounds` rounds and never past :attr:`final_round`; without
        :attr:`catch_up` it never skips."""
        return self.membership.catch_up_round(next_round, self.inbox.latest_round)

    # -- the compute gate -----------------------------------------------------------------
    async def hold_round(self, kinds: str | tuple[str, ...] = ()) -> float:
        """Hold a round that waits for its peers' messages of ``kinds`` while the broker is
        away; returns the seconds held (0.0 when connected).

        A protocol calls it where its round waits for peers, before it decides to close
        the round, and extends the round's deadline by what it returns: a round never
        closes with whatever arrived because this node's broker went away.  With
        ``pause_when_disconnected`` (on in the daemon) and the transport disconnected,
        the node is paused (:attr:`paused`, status ``state: paused``, one WARNING) until
        the transport is back; then it waits up to :attr:`reconnect_grace` seconds for
        the neighbours it expected this round to be back in its verified presence (their
        agents reconnect at their own pace), sends its own messages of the kinds its
        rounds wait for again (:meth:`resend_round`; also after a pause in
        :meth:`ComputeGate.wait_until_allowed`) and logs one INFO line.  The time held counts in
        ``paused_s`` of the round's record and in ``disconnected_seconds``."""
        return await self.gate_part.hold_round((kinds,) if isinstance(kinds, str) else tuple(kinds))

    def note_neighbours(self) -> None:
        """Remember the live neighbours as expected in this round (while connected; see
        :attr:`last_round_expected`)."""
        self.gate_part.note_neighbours()

    async def compute(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        result = await self.gate_part.compute(fn, *args, **kwargs)
        # local training undoes a round that blew up itself (train_local, train_adam): count it
        if getattr(fn, "restores_itself", False) and isinstance(result, dict) and result.get("diverged"):
            if (blown := result.get("exploded")) is None:
                self.note_diverged("local training", "a non-finite loss or parameters")
            else:  # a finite blow-up (TrainConfig.divergence_factor)
                self.note_diverged("local training", f"a mini-batch loss of {blown:.3g}, over "
                                   f"{self.train.divergence_factor:g} times the round's first", what="blew up")
        return result

    async def compute_ungated(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """:meth:`compute` without resource gating (evaluation, ONNX export)."""
        return await self.gate_part.compute_ungated(fn, *args, **kwargs)

    # -- rounds and reporting -------------------------------------------------------------
    def note_diverged(self, step: str, detail: str, what: str = "left non-finite parameters") -> None:
        """An aggregation, mutual-learning, transfer or local-training step left a non-finite
        model (or loss), or local training's loss blew up (``what``), and the model was restored
        to its state before the step: count it (``diverged`` in :meth:`counters`, round records
        and the status) and log a WARNING, at most once per round (further ones that round are
        counted only)."""
        self.diverged += 1
        if self._diverged_warned != self.current_round:
            self._diverged_warned = self.current_round
            log.warning("%s: %s step %s (%s); restored the model from before the step "
                        "and going on (diverged steps so far: %d; not logged again this round)",
                        self.node_id, step, what, detail, self.diverged)

    async def end_round(self, round: int, **info: Any) -> None:
        self.current_round = round + 1
        # forget buffered messages of rounds that can no longer be used; an algorithm that takes late
        # updates (max_staleness) drops them itself, so that a compressed stream stays in sequence
        received = self.inbox.end_round(round if not self.max_staleness else -(2**62))
        sent = self.outbox.end_round()
        self.last_round_bytes = {
            "round_bytes_sent": sum(sent.values()),
            "round_bytes_received": sum(received.values()),
            "round_bytes_sent_by_kind": sent,
            "round_bytes_received_by_kind": received,
        }
        self.last_round_timing = dict(self.timing)  # ("round" is the parameter here)
        self.timing = dict.fromkeys(TIMING_KEYS, 0.0)
        self.note_neighbours()  # the neighbours live as the round closes were expected too
        expected, paused = self.gate_part.end_round()
        self.last_round_expected = sorted(expected)
        self.last_round_paused = paused
        if self.round_hook is not None:
            await self.round_hook(round, info)

    def counters(self) -> dict[str, Any]:
        """Byte and drop counters (transport + message level) and ``diverged`` (steps whose
        non-finite result was restored, :meth:`note_diverged`) as a JSON-friendly dict."""
        s = self.transport.stats
        dropped = collections.Counter(s.dropped)
        dropped.update(self.rejected)
        dropped.update(getattr(self.peers, "dropped", {}))  # discovery input (an untrusted mDNS broker)
        return {
            "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received,
            "bytes_sent_by_kind": dict(self.outbox.bytes_sent_by_kind),
            "bytes_received_by_kind": dict(self.inbox.bytes_received_by_kind),
            "dropped": dict(dropped),
            "diverged": self.diverged,
            "float32_bytes_sent": self.outbox.float32_bytes_sent,
            "compression_ratio": self.byte_accounting()["compression_ratio"],
            #: error-feedback streams reset because their residual went non-finite
            "ef_resets": self.outbox.ef_resets(),
        }
