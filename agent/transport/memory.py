"""In-memory transport and a virtual-time event loop, for the simulator and tests.

:class:`MemoryNetwork` connects any number of :class:`MemoryTransport` instances in
one process.  Frames are the same bytes as on MQTT (so byte counts are real) and are
delivered through the event loop (``call_later(latency)``), in a deterministic order.

:class:`VirtualTimeLoop` is an asyncio event loop whose clock only moves when every
task is waiting: the selector, instead of blocking for ``timeout`` seconds, advances
the virtual clock by ``timeout``.  Every ``asyncio.sleep``/``wait_for`` deadline then
costs no real time, and a run is reproducible.  Compute runs inline, taking no
virtual time.  A state where every task waits without any deadline is a deadlock
and raises :class:`SimulationDeadlock`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import selectors
from collections.abc import Awaitable, Collection, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from dfl_agent.algorithms.context import Message
from dfl_agent.transport.base import FrameHandler, PresenceHandler, Transport, TransportStats

# decode_once copies a Message field by field: it must name every field
assert [f.name for f in dataclasses.fields(Message)] == [
    "kind", "round", "tensors", "meta", "sender", "recipient", "msg_id", "time", "wire_bytes", "encoding"]

T = TypeVar("T")

#: how many broadcast buffers and decodes the memory transport made (process-wide,
#: for tests and benchmarks: one buffer and at most one decode per broadcast)
SHARED_STATS = {"buffers": 0, "decodes": 0}


class SharedDict(dict[Any, Any]):
    """A dict that every receiver of one broadcast shares: reads work as on a dict,
    writes raise ``TypeError`` (copy it with ``dict(d)`` to change it).  Copies made
    with ``copy``/``pickle`` are plain dicts."""

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("a received message's tensors/meta are shared by all its receivers: copy with dict() first")

    __setitem__ = __delitem__ = _read_only
    pop = popitem = clear = update = setdefault = __ior__ = _read_only

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))

    def __copy__(self) -> dict[Any, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, object]) -> dict[Any, Any]:
        import copy

        return copy.deepcopy(dict(self), memo)


class SharedFrame(bytes):
    """A broadcast frame, stored once and shared read-only by all its receivers.

    The first receiver that decodes it (:meth:`decode_once`) keeps the decoded
    :class:`~dfl_agent.transport.wire.Message` on the frame; every receiver gets its
    own small message record (sender, round, byte counts) whose ``tensors`` and
    ``meta`` are the same read-only :class:`SharedDict` objects holding the same
    read-only numpy arrays.  Memory per broadcast is then one frame plus one decoded
    model, whatever the number of receivers (O(N x model) for N nodes instead of
    O(N^2 x model)).  The frame and its decoded copy are freed when the last receiver
    has dropped its message.
    """

    def decode_once(self, *, federation: str, recipient: str, max_frame_bytes: int) -> Message:
        """The decoded message for ``recipient`` (the same checks as ``wire.decode``).

        Raises:
            WireError: the frame failed a check (cached, raised for every receiver).
        """
        from dfl_agent.transport import wire

        key = (federation, max_frame_bytes)
        cached = self.__dict__.get("_decoded")
        if cached is None or cached[0] != key:
            try:
                decoded = wire.decode(self, federation=federation, max_frame_bytes=max_frame_bytes)
                for arr in decoded.tensors.values():
                    arr.setflags(write=False)  # shared by every receiver: nobody may write into it
                decoded.tensors, decoded.meta = SharedDict(decoded.tensors), SharedDict(decoded.meta)
                msg: Message | Exception = decoded
            except Exception as exc:  # noqa: BLE001 - cached and re-raised for every receiver
                msg = exc
            SHARED_STATS["decodes"] += 1
            cached = self.__dict__["_decoded"] = (key, msg)
        msg = cached[1]
        if isinstance(msg, Exception):
            raise msg
        if msg.recipient not in (wire.BROADCAST, recipient):
            raise wire.WireError("wrong_recipient", msg.recipient)
        # a new record (cheaper than dataclasses.replace), sharing the read-only tensors and meta
        return Message(msg.kind, msg.round, msg.tensors, msg.meta, msg.sender, msg.recipient, msg.msg_id,
                       msg.time, msg.wire_bytes, msg.encoding)


class SimulationDeadlock(RuntimeError):
    """Every task of a simulation waits for something with no deadline."""


class _VirtualSelector(selectors.SelectSelector):
    def __init__(self, loop: VirtualTimeLoop):
        super().__init__()
        self._vloop = loop

    def select(self, timeout: float | None = None):
        if timeout is None:
            raise SimulationDeadlock("every task waits with no deadline (simulation deadlock)")
        if timeout > 0:
            # jump exactly to the earliest timer's due time (adding ``timeout`` would
            # accumulate rounding error and could leave a deadline never quite reached)
            scheduled = self._vloop._scheduled  # type: ignore[attr-defined]  # the loop's own timer heap
            due = scheduled[0]._when if scheduled else self._vloop._vtime + timeout
            self._vloop._vtime = max(self._vloop._vtime, due)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """Event loop with virtual time (seconds since the loop was created, starting at 0).

    Only for code without real I/O or threads (the memory transport, inline compute).
    """

    def __init__(self) -> None:
        self._vtime = 0.0
        super().__init__(selector=_VirtualSelector(self))

    def time(self) -> float:
        return self._vtime


def run_virtual(coro: Awaitable[T]) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop` and close it."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


class MemoryNetwork:
    """A federation's in-process network: all attached nodes can reach each other.

    A broadcast meant for the sender's graph neighbours (``Transport.broadcast``'s
    ``audience``) is delivered to those neighbours only, so that on a sparse graph no
    node receives, decodes and rejects the broadcasts of its non-neighbours.

    Presence (a node coming online, stopping, crashing, coming back) reaches every other
    node, as retained presence on a broker does, or, with ``presence_graph``, only the
    node's neighbours in that graph: each node then keeps peer-table entries for its
    neighbours alone, so that a node's state does not grow with N on a sparse graph (the
    simulator's choice for algorithms that talk to their graph neighbours only).
    :meth:`MemoryTransport.members_online` still counts the whole federation.

    Args:
        latency: one-way delivery delay in (loop) seconds.
        scoped_broadcasts: False: every broadcast reaches every online node, whatever
            its audience, as a broadcast over MQTT does (the non-neighbours reject it);
            for comparing with the traffic of agents on a broker.
        presence_graph: ``{node: its neighbours}`` (undirected: each edge listed at both
            ends) along which presence travels; None: presence reaches every node.
    """

    def __init__(self, latency: float = 0.0, *, scoped_broadcasts: bool = True,
                 presence_graph: Mapping[str, Sequence[str]] | None = None):
        if latency < 0:
            raise ValueError("latency must be >= 0")
        self.latency = latency
        self.scoped_broadcasts = scoped_broadcasts
        self.presence_graph = presence_graph
        self._nodes: dict[str, MemoryTransport] = {}
        self._online = 0  # how many attached nodes are online

    def transport(self, node_id: str, federation: str, descriptor: dict[str, Any] | None = None) -> MemoryTransport:
        """Create the transport of ``node_id`` (not yet started).

        Raises:
            ValueError: ``node_id`` already attached.
        """
        if node_id in self._nodes:
            raise ValueError(f"node {node_id!r} already attached")
        t = MemoryTransport(self, node_id, federation, descriptor or {})
        self._nodes[node_id] = t
        return t

    def online(self) -> list[str]:
        return sorted(n for n, t in self._nodes.items() if t.online)

    def online_count(self) -> int:
        """How many attached nodes are online now (O(1))."""
        return self._online

    def kill(self, node_id: str) -> None:
        """Crash ``node_id``: it stops sending and receiving; peers see its last will."""
        t = self._nodes[node_id]
        if t.online:
            t._set_online(False)
            self._announce(node_id, None)

    def reconnect(self, node_id: str) -> None:
        """Bring ``node_id`` back after :meth:`kill` (a connection that came back): it
        announces itself again and learns who is online, as from retained presence."""
        t = self._nodes[node_id]
        if not t.online and t.on_frame is not None and t.on_presence is not None:
            t._set_online(True)
            self._announce(node_id, t.descriptor)
            self._retained(node_id, t.on_presence)

    def deliver_raw(self, node_id: str, frame: bytes) -> None:
        """Inject raw bytes into ``node_id``'s inbox (for tests of bad input)."""
        self._deliver_many([node_id], frame)

    # -- internals -------------------------------------------------------------
    def _hearers(self, node_id: str) -> list[MemoryTransport]:
        """The attached nodes that ``node_id``'s presence reaches (and whose presence it
        learns): its ``presence_graph`` neighbours, or every other node; in attach order."""
        if self.presence_graph is None:
            return [t for n, t in self._nodes.items() if n != node_id]
        nodes = self._nodes
        return [nodes[n] for n in self.presence_graph.get(node_id, ()) if n != node_id and n in nodes]

    def _announce(self, node_id: str, descriptor: dict[str, Any] | None) -> None:
        for other in self._hearers(node_id):
            if other.online and other.on_presence:
                other.on_presence(node_id, descriptor)

    def _retained(self, node_id: str, on_presence: PresenceHandler) -> None:
        """Tell ``node_id`` the presence of the online nodes it hears, as retained
        presence does when it subscribes."""
        for other in self._hearers(node_id):
            if other.online:
                on_presence(other.node_id, other.descriptor)

    def _deliver_many(self, node_ids: list[str], frame: bytes) -> None:
        """Deliver ``frame`` to each of ``node_ids`` in that order, after ``latency``.

        One loop callback for all receivers (a broadcast to N nodes schedules one
        handle, not N), so the arrivals run back to back in receiver order."""
        if not node_ids:
            return
        loop = asyncio.get_running_loop()
        n = len(frame)

        def arrive() -> None:
            for node_id in node_ids:
                t = self._nodes.get(node_id)
                if t is not None and t.online and t.on_frame:
                    t.stats.bytes_received += n
                    t.stats.frames_received += 1
                    t.on_frame(frame, n)

        if self.latency:
            loop.call_later(self.latency, arrive)
        else:
            loop.call_soon(arrive)


class MemoryTransport(Transport):
    """One node's endpoint on a :class:`MemoryNetwork` (same interface as MQTT)."""

    def __init__(self, network: MemoryNetwork, node_id: str, federation: str, descriptor: dict[str, Any]):
        self.network = network
        self.node_id = node_id
        self.federation = federation
        self.descriptor = descriptor
        self.stats = TransportStats()
        self.online = False
        self.on_frame: FrameHandler | None = None
        self.on_presence: PresenceHandler | None = None
        self.last_status: dict[str, Any] = {}

    @property
    def connected(self) -> bool:
        """Whether this endpoint is attached (not killed or stopped)."""
        return self.online

    def _set_online(self, online: bool) -> None:
        if online != self.online:
            self.network._online += 1 if online else -1
        self.online = online

    def members_online(self) -> int | None:
        """How many other nodes of the federation are online (O(1)), where presence
        travels along the network's ``presence_graph`` and this node's peer table
        therefore holds its neighbours only; None otherwise (the peer table knows every
        member)."""
        if self.network.presence_graph is None:
            return None
        return self.network.online_count() - (1 if self.online else 0)

    def decode_shared(self, frame: bytes, *, federation: str, recipient: str, max_frame_bytes: int) -> Message | None:
        """A broadcast's :class:`SharedFrame` decoded once for all its receivers
        (:meth:`SharedFrame.decode_once`), None for any other frame.

        Raises:
            WireError: the shared frame failed a check.
        """
        if not isinstance(frame, SharedFrame):
            return None
        return frame.decode_once(federation=federation, recipient=recipient, max_frame_bytes=max_frame_bytes)

    async def start(self, on_frame: FrameHandler, on_presence: PresenceHandler) -> None:
        self.on_frame, self.on_presence = on_frame, on_presence
        self._set_online(True)
        self.network._announce(self.node_id, self.descriptor)
        self.network._retained(self.node_id, on_presence)  # retained presence of those already there

    async def send(self, peer: str, frame: bytes) -> int:
        if not self.online:
            self.stats.dropped["not_connected"] += 1
            return 0
        self.stats.bytes_sent += len(frame)
        self.stats.frames_sent += 1
        self.network._deliver_many([peer], frame)
        return len(frame)

    async def broadcast(self, frame: bytes, audience: Collection[str] | None = None) -> int:
        """Deliver ``frame`` to every online node of ``audience`` (the sender's graph
        neighbours), or to every other online node when ``audience`` is None.

        One buffer for all receivers.  Bytes count as on the wire: the sender counts
        the frame once (one publish), each receiver counts it once."""
        if not self.online:
            self.stats.dropped["not_connected"] += 1
            return 0
        self.stats.bytes_sent += len(frame)
        self.stats.frames_sent += 1
        if not isinstance(frame, SharedFrame):
            frame = SharedFrame(frame)  # one buffer for every receiver
            SHARED_STATS["buffers"] += 1
        if audience is None or not self.network.scoped_broadcasts:
            receivers = [o for o in self.network.online() if o != self.node_id]
        else:
            nodes = self.network._nodes
            receivers = sorted(o for o in set(audience)
                               if o != self.node_id and o in nodes and nodes[o].online)
        self.network._deliver_many(receivers, frame)
        return len(frame)

    async def publish_status(self, status: dict[str, Any]) -> None:
        self.last_status = dict(status)

    async def stop(self) -> None:
        if self.online:
            self._set_online(False)
            self.network._announce(self.node_id, None)
