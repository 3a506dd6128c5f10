"""The transport interface shared by the in-memory and the MQTT implementations.

A transport moves opaque *frames* (bytes, see :mod:`dfl_agent.transport.wire`) between
nodes of one federation and reports peers' presence.  Decoding, validation and
buffering of messages happen above it, in :class:`dfl_agent.runtime.node.context.RuntimeContext`,
so both implementations behave the same for the algorithms.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dfl_agent.algorithms.context import Message

#: drop-counter key prefixes of the control plane (presence and status messages); the
#: status document's ``control_dropped`` holds the counters that start with one of them
CONTROL_DROP_PREFIXES = ("presence_", "status_", "bad_presence", "bad_status")

#: Called for every complete frame received: ``on_frame(frame, wire_bytes)``.
#: ``wire_bytes`` counts what the frame occupied on the wire (chunk headers included).
FrameHandler = Callable[[bytes, int], None]
#: Called when a peer's presence changes: ``on_presence(node_id, descriptor_or_None)``;
#: ``None`` means the peer went offline (last will, clean shutdown).
PresenceHandler = Callable[[str, "dict[str, Any] | None"], None]


@dataclasses.dataclass
class TransportStats:
    """Counters of one transport (bytes are bytes on the wire, headers included)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dropped": dict(self.dropped)}


class Transport(abc.ABC):
    """Moves frames for one node (``node_id``) of one federation."""

    node_id: str
    federation: str
    stats: TransportStats

    @abc.abstractmethod
    async def start(self, on_frame: FrameHandler, on_presence: PresenceHandler) -> None:
        """Connect, announce presence ("online" + descriptor) and start delivering."""

    @abc.abstractmethod
    async def send(self, peer: str, frame: bytes) -> int:
        """Deliver ``frame`` to ``peer``'s inbox (at-least-once). Returns wire bytes."""

    @abc.abstractmethod
    async def broadcast(self, frame: bytes, audience: Collection[str] | None = None) -> int:
        """Publish ``frame`` on this node's broadcast channel. Returns wire bytes.

        ``audience``: the node ids the broadcast is meant for (the sender's graph
        neighbours), or None for every member.  It is a hint: a transport that can
        address it (the simulator's memory network) delivers the frame to those nodes
        only; MQTT ignores it, since a topic reaches every subscriber, and the
        receivers outside the audience reject the message."""

    @abc.abstractmethod
    async def publish_status(self, status: dict[str, Any]) -> None:
        """Publish this node's status (retained JSON on MQTT)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Announce "offline" and disconnect cleanly. Idempotent."""

    @property
    def connected(self) -> bool:
        """Whether the transport reaches its network now (True unless it can lose it:
        the MQTT home broker, a simulated node killed or stopped)."""
        return True

    def use_prepare_frame(self, prepare: Callable[[bytes, int], object]) -> bool:
        """Have ``prepare(frame, wire_bytes)`` called for every complete frame on the
        transport's network thread, and its result handed to ``on_frame`` instead of
        the frame (the runtime decodes and verifies there).  Returns False where the
        transport has no such thread (frames then reach ``on_frame`` as bytes)."""
        return False

    def decode_shared(self, frame: bytes, *, federation: str, recipient: str, max_frame_bytes: int) -> Message | None:
        """The :class:`~dfl_agent.transport.wire.Message` of ``frame`` for ``recipient``
        where the transport shares one frame among its receivers and decodes it once for
        all of them (the memory transport's broadcasts), or None: an ordinary frame, to
        decode with :func:`dfl_agent.transport.wire.decode`.

        Raises:
            WireError: a shared frame failed a check (the same checks as ``wire.decode``).
        """
        return None
