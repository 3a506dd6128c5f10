"""What an algorithm sees of the world: :class:`Message` and :class:`NodeContext`.

An algorithm is the behaviour of one node, written as async code against a
``NodeContext``.  It never knows whether messages travel through MQTT or a Python
queue, nor whether the clock is the wall clock or the simulator's virtual clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy
    from dfl_agent.algorithms.protocols.synchronization import UpdateMarket
    from dfl_agent.data import NodeData
    from dfl_agent.learning.compression import CompressionPolicy
    from dfl_agent.learning.error_feedback import ChocoGossip
    from dfl_agent.learning.training import TrainConfig

T = TypeVar("T")
P = ParamSpec("P")

BROADCAST = "*"


@dataclasses.dataclass(slots=True)
class Message:
    """One protocol message between nodes.

    Attributes:
        kind: message type, e.g. ``"model"``; a short ``[a-z0-9_.-]`` string.
        round: the sender's round number the message belongs to (>= 0).
        tensors: named numpy arrays (C-contiguous; float16/32/64, int8/16/32/64,
            uint8, bool). Travels as raw little-endian bytes described by the envelope, never pickled.
        meta: small JSON-serialisable dict (sample counts, architecture spec, ...).
        sender: node id of the sender; filled in by the transport on receipt.
        recipient: node id, or ``"*"`` for a broadcast.
        msg_id: unique id (hex), set when encoded.
        time: sender's wall-clock time (s since epoch) when encoded.
        wire_bytes: bytes this message occupied on the wire (envelope and chunk
            headers included), set by the transport on send and on receipt.
        encoding: codec description when ``tensors`` are already compressed wire
            tensors (see :mod:`dfl_agent.transport.codec`; the runtime sends them as they
            are); ``None``: plain tensors.  On receipt: the sender's codec
            description (``tensors`` are then already decoded), or ``None``.
    """

    kind: str
    round: int = 0
    tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    sender: str = ""
    recipient: str = BROADCAST
    msg_id: str = ""
    time: float = 0.0
    wire_bytes: int = 0
    encoding: dict[str, Any] | None = None  # compression (issue 8)


class Clock(Protocol):
    """Time source. ``now()`` is in seconds; monotonic within one run.

    In the daemon it is the event loop's monotonic clock; in the simulator the
    loop's virtual clock, which jumps forward whenever every node is waiting.
    """

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


@dataclasses.dataclass
class Collected:
    """What a round's wait took.

    Attributes:
        updates: sender -> its update (decoded; a late one staleness-weighted: its
            ``meta["samples"]`` scaled and ``meta["staleness_weight"]`` set).
        missing: neighbours that sent nothing usable in time.
        late: senders whose update is of an earlier round than the one waited for.
        info: the round's wait for its record: the market's (``sync_waited``,
            ``sync_deadline_hit``, ``updates_taken``, ``update_bytes_taken``), ``late_dropped``
            (updates dropped as too old) and ``deadline_s`` (this round's deadline, seconds).
    """

    updates: dict[str, Message]
    missing: list[str]
    late: set[str]
    info: dict[str, Any]


@runtime_checkable
class NodeContext(Protocol):
    """The interface between one node's algorithm and the runtime.

    Implemented by :class:`dfl_agent.runtime.node.context.RuntimeContext` over either the
    in-memory transport (simulator, tests) or MQTT (daemon).
    """

    node_id: str
    rng: np.random.Generator  # this node's seeded stream (batch order, selections)
    compression: CompressionPolicy | None  # None: nothing compressed
    straggler: StragglerPolicy | None  # runtime.straggler's policy (quorum, adaptive deadlines), or None: lock step
    #: whether a round with no live neighbour waits for its deadline (members away), or None: it does not
    alone_waits: Callable[[], bool] | None
    gate: Callable[[], str | None] | None  # resource gating: the reason training is not allowed now, or None
    reconnect_grace: float  # after a broker outage, the longest wait for the expected neighbours (s)
    data: NodeData  # train_x/train_y/val_x/val_y, num_classes
    init_seed: int  # torch seed for this node's initial weights
    seed: int  # the federation's seed, the same on every node (shared schedules)
    train: TrainConfig
    device: str  # torch device for compute ("cpu", "cuda:0")

    # read-only members (properties), so that an implementation may narrow their types
    @property
    def clock(self) -> Clock: ...

    @property
    def model_spec(self) -> Mapping[str, Any]: ...  # see dfl_agent.models

    async def send(self, peer: str, message: Message) -> int:
        """Send ``message`` to one peer; returns bytes put on the wire."""
        ...

    async def broadcast(self, message: Message, *, neighbours_only: bool = False) -> int:
        """Publish ``message`` to every live peer; returns bytes put on the wire (one
        publish: counted once, whatever the number of receivers).

        ``neighbours_only=True``: the message is meant for this node's neighbours in the
        configured communication graph only (an algorithm that rejects non-neighbours'
        messages, like ``fedavg``).  The simulator then delivers it to those neighbours
        alone; on MQTT it is the same one publish, which every member receives and the
        non-neighbours reject.  Leave it False for messages every live peer must see
        (tokens, pair schedules, group synchronization)."""
        ...

    async def receive(
        self,
        kind: str | tuple[str, ...],
        *,
        round: int | None = None,
        sender: str | None = None,
        deadline: float | None = None,
    ) -> Message | None:
        """Next buffered message of ``kind`` (one kind, or any of a tuple of kinds; and
        ``round``/``sender`` when given), oldest first.

        Waits until one arrives or the clock reaches ``deadline`` (absolute time,
        same scale as ``clock.now()``); returns ``None`` on timeout.  Messages of
        other kinds or rounds stay buffered.
        """
        ...

    def live_peers(self) -> list[str]:
        """Ids of the peers currently believed alive (sorted, self excluded)."""
        ...

    def live_peer_count(self) -> int:
        """``len(live_peers())``, also where a node keeps state for its graph neighbours
        only (the simulator on a sparse graph counts the federation's live members)."""
        ...

    def neighbours(self) -> list[str]:
        """Live peers that are this node's neighbours in the configured communication
        graph (all live peers when no graph is configured). Sorted, self excluded."""
        ...

    def is_neighbour(self, peer: str) -> bool:
        """Whether a message from ``peer`` counts as a neighbour's, live or not.

        True for a known peer inside the configured graph (any peer when there is no
        graph) that is a member and not excluded, even after it left: a peer that sent
        its round-``t`` update and then went offline (its last round) still counted for
        round ``t``, since it had used ours.  Self is never a neighbour."""
        ...

    def check_on_arrival(self, kind: str, check: Callable[[Message], str | None]) -> None:
        """Check each arriving message of ``kind`` with ``check`` (returns
        ``"reason: detail"`` for a bad message, None for a good one).  A bad message is
        dropped and counted before the algorithm sees it; only good ones count as
        catch-up evidence (:meth:`catch_up_round`)."""
        ...

    def catch_up_round(self, next_round: int) -> int:
        """The round a lock-step algorithm runs next: ``next_round``, or, when the runtime
        catches up (``runtime.rejoin`` on a device) and updates already received from
        live neighbours show them past ``next_round`` without this node (it lagged: a
        broker outage, a partition; a round-r update means its sender completed round
        r - 1), one past the highest round that more than half of the live neighbours
        completed (at least two distinct senders when two or more are live), but at most
        ``runtime.max_catch_up_rounds`` past ``next_round``.  Never less than
        ``next_round``.  The evidence is updates that passed every check on arrival
        (:meth:`check_on_arrival`: envelope, signature, tensors), not the status."""
        ...

    async def compute(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run CPU/GPU-heavy ``fn`` (training) without blocking messaging.

        The daemon runs it in a worker thread; the simulator inline.
        """
        ...

    def reject(self, message: Message, reason: str) -> None:
        """Drop a received message that the algorithm found invalid, and count it."""
        ...

    def note_diverged(self, step: str, detail: str, what: str = "left non-finite parameters") -> None:
        """An aggregation, mutual-learning or transfer ``step`` left a non-finite model
        (``detail``: the first non-finite tensor), which the algorithm restored
        (:meth:`dfl_agent.algorithms.base.Algorithm.divergence_guard`), or local training
        blew up (``what``): count it as ``diverged`` and log it at WARNING, at most once
        per round."""
        ...

    async def end_round(self, round: int, **info: Any) -> None:
        """Tell the runtime a round finished (metrics, status, checkpoint)."""
        ...

    async def collect(self, kind: str, t: int, *, market: UpdateMarket, round_timeout: float, poll: float,
                      accept: Callable[[Message], str | None],
                      decode: Callable[[dict[str, Message]], dict[str, Message]]) -> Collected:
        """The round-``t`` updates of ``kind`` from the neighbours, as the runtime's waiting
        policy decides (deadlines fixed or adaptive, quorum, the broker-outage hold, keyframe
        retries, staleness weights) over the algorithm's update ``market``
        (:class:`~dfl_agent.algorithms.protocols.synchronization.UpdateMarket`); ``accept(msg)``
        says why an update cannot be used (None: it can), ``decode`` turns the taken updates
        into usable ones (leaving out those it cannot)."""
        ...

    @property
    def quorum(self) -> bool:
        """Whether the node runs under ``runtime.straggler = "quorum"`` (else the papers' lock step)."""
        ...

    def may_aggregate(self, peer: str) -> bool:
        """Whether ``peer`` (or this node) may lead a rotating round (its roles include ``aggregator``)."""
        ...

    async def hold_round(self, kinds: str | tuple[str, ...] = ()) -> float:
        """Hold a round that waits for peers' ``kinds`` messages while the broker is away;
        returns the seconds held (0.0 when connected)."""
        ...

    def track_stream(self, stream: ChocoGossip) -> None:
        """A compressed gossip stream (a :class:`~dfl_agent.learning.error_feedback.ChocoGossip`)
        the runtime follows: it asks for the keyframes a neighbour's copy lost, and sends one to a
        peer that came back (a context that does neither leaves it alone)."""
        ...

    def keep_late_updates(self, rounds: int) -> None:
        """The algorithm takes updates up to ``rounds`` rounds late (an update market's
        ``max_staleness``): the runtime keeps them that long instead of dropping them as stale."""
        ...

