"""Splitting large frames into bounded chunks and reassembling them (pure, no I/O).

MQTT brokers limit the size of one message (mosquitto ``max_packet_size``, memory of
small device brokers), and paho does not honour the limit announced by the broker.
The MQTT transport therefore passes every outgoing frame through :func:`split` and
every incoming payload through a :class:`Reassembler`.

Chunk layout (all integers big-endian)::

    b"DFC" | version:u8 (=2) | transfer_id:16 bytes | index:u32 | count:u32
           | total_len:u64 | data

The header is :data:`HEADER_LEN` (36) bytes.  ``index`` runs from 0 to ``count-1``,
every chunk carries at least one byte of data, the data of all chunks concatenated
in index order is the frame (``total_len`` bytes).  Chunks carry no hash of their
own: the frame's integrity is the wire envelope's ``payload_blake3`` (see
:mod:`dfl_agent.transport.wire`), checked once when the frame is decoded, so an
altered chunk is dropped there (``hash_mismatch``) and never reaches a model.
Chunks of the older version 1 (with a SHA-256 of the frame in every header) are
rejected as ``bad_chunk``.

A frame that fits into one message is sent as it is (a plain frame, e.g. a wire
frame starting with ``b"DFL"``) - except a frame that itself starts with the chunk
magic ``b"DFC"``, which is always wrapped in chunks so the receiver cannot mistake it
for one.  The receiver tells the two apart by the first three bytes.

Errors are :class:`ChunkError` with a short ``reason`` used as a counter key:

``bad_chunk``
    truncated header, unknown version, impossible index/count/length, a header that
    disagrees with earlier chunks of the same transfer, more data than declared.
``oversized``
    a declared total above ``max_frame_bytes`` (checked before anything is stored).
``too_many_transfers``
    a new transfer while ``max_transfers`` are pending, or a chunk that would make
    the pending data exceed ``max_bytes``.
"""

from __future__ import annotations

import collections
import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import blake3

#: First bytes of every chunk.
CHUNK_MAGIC = b"DFC"
#: Chunk format version.
CHUNK_VERSION = 2
_HEADER = struct.Struct(">3sB16sIIQ")
#: Bytes of chunk header before the data.
HEADER_LEN = _HEADER.size  # 36
_MAX_U32 = 0xFFFFFFFF

CHUNK_ERROR_REASONS = ("bad_chunk", "oversized", "too_many_transfers")


class ChunkError(ValueError):
    """A received chunk was rejected. ``reason`` is one of :data:`CHUNK_ERROR_REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def is_chunk(payload: bytes) -> bool:
    """True when ``payload`` starts with the chunk magic (it must then parse as a chunk)."""
    return payload[:3] == CHUNK_MAGIC


def split(frame: bytes, chunk_size: int, *, transfer_id: bytes | None = None) -> list[bytes]:
    """Split ``frame`` into messages of at most ``chunk_size`` bytes each.

    Args:
        frame: the bytes to send (opaque).
        chunk_size: maximum size in bytes of one message, chunk header included.
        transfer_id: 16 bytes naming the transfer (default: random, ``os.urandom``).

    Returns:
        ``[frame]`` unchanged when ``len(frame) <= chunk_size`` (and the frame does not
        start with :data:`CHUNK_MAGIC`), else the chunks in index order, each of
        ``len <= chunk_size``; chunk ``i`` carries ``frame[i*d:(i+1)*d]`` with
        ``d = chunk_size - HEADER_LEN``.  The frame's bytes are copied once, into
        the chunks; the frame itself is not hashed.

    Raises:
        ValueError: ``chunk_size <= HEADER_LEN + 1``, a bad ``transfer_id``, or a frame
            that would need more than 2**32-1 chunks.
    """
    return list(iter_chunks(frame, chunk_size, transfer_id=transfer_id))


def chunked_size(frame: bytes, chunk_size: int) -> int:
    """Bytes of all the messages :func:`split` makes of ``frame`` (headers included),
    without making them."""
    if len(frame) <= chunk_size and not is_chunk(frame):
        return len(frame)
    return len(frame) + HEADER_LEN * max(1, -(-len(frame) // (chunk_size - HEADER_LEN)))


def iter_chunks(frame: bytes, chunk_size: int, *, transfer_id: bytes | None = None) -> Iterator[bytes]:
    """The messages of :func:`split`, one at a time (each built when it is asked for, so
    the first can be on its way while the next is copied).

    Raises:
        ValueError: as :func:`split`.
    """
    if not isinstance(chunk_size, int) or chunk_size <= HEADER_LEN + 1:
        raise ValueError(f"chunk_size must be an int > {HEADER_LEN + 1}, got {chunk_size!r}")
    if len(frame) <= chunk_size and not is_chunk(frame):
        yield bytes(frame)
        return
    if transfer_id is None:
        transfer_id = os.urandom(16)
    if len(transfer_id) != 16:
        raise ValueError("transfer_id must be 16 bytes")
    data_size = chunk_size - HEADER_LEN
    total = len(frame)
    count = max(1, -(-total // data_size))
    if count > _MAX_U32:
        raise ValueError(f"frame of {total} bytes needs too many chunks of {chunk_size} bytes")
    view = memoryview(frame).cast("B") if isinstance(frame, memoryview) else memoryview(frame)
    for index in range(count):
        header = _HEADER.pack(CHUNK_MAGIC, CHUNK_VERSION, transfer_id, index, count, total)
        yield b"".join((header, view[index * data_size:(index + 1) * data_size]))


class Frame(bytearray):
    """A reassembled frame: a ``bytearray`` that nothing else holds, with the BLAKE3 digest
    of its bytes from ``payload_offset`` on (hex, ``payload_digest``; the wire format's
    payload hash, :func:`dfl_agent.transport.wire.payload_digest`), computed while its
    chunks arrived; ``payload_offset`` is -1 and ``payload_digest`` ``None`` when it was
    not computed (see :class:`Reassembler`'s ``hash_from``)."""

    __slots__ = ("payload_digest", "payload_offset")

    def __init__(self) -> None:
        super().__init__()
        self.payload_offset = -1
        self.payload_digest: str | None = None


@dataclass
class _Transfer:
    count: int
    total: int
    parts: dict[int, memoryview] = field(default_factory=dict)
    held: int = 0  # data bytes stored
    wire_bytes: int = 0  # message bytes of the distinct chunks received
    last_seen: float = 0.0
    # -- the hash of the frame's bytes from ``offset`` on, fed in index order as chunks arrive
    hasher: Any = None
    hashing: bool = True
    offset: int = 0
    next_index: int = 0  # the next chunk to hash
    pos: int = 0  # frame position where that chunk starts


def _trim_heap() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``); a no-op elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes
            import ctypes.util

            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


class Reassembler:
    """Reassembles chunked frames from one stream of messages (one MQTT topic).

    Args:
        max_transfers: most transfers pending at once.
        max_bytes: most data bytes held by all pending transfers together.
        timeout: seconds without a new chunk after which :meth:`expire` drops a
            pending transfer (an inactivity deadline, so slow links can still
            deliver large frames).
        max_frame_bytes: largest declared frame size accepted.
        clock: monotonic time source in seconds (injectable for tests).

        hash_from: ``hash_from(first)`` maps the data of a transfer's chunk 0 to the frame
            offset from which the frame's bytes are hashed (BLAKE3) while the chunks
            arrive - each chunk as soon as the chunks before it are in - or to ``None``
            (no hash); e.g. :func:`dfl_agent.transport.wire.payload_offset`, so that the
            payload's one hash on the receiving side is mostly done before the last chunk
            arrives.  The result is :attr:`Frame.payload_digest`.

    Memory: chunks are stored as they arrive, without copying (views into the
    received messages; nothing is preallocated from a declared size), at most
    ``max_bytes`` of data in all; a completed frame is joined once, into a fresh
    :class:`Frame` (a ``bytearray``) that :func:`dfl_agent.transport.wire.decode`
    decodes in place.  Not thread-safe: use one per thread or guard it with a lock.
    """

    #: how many completed transfer ids are remembered to ignore late duplicates
    RECENT_COMPLETED = 1024

    def __init__(
        self,
        max_transfers: int = 64,
        max_bytes: int = 256 * 1024 * 1024,
        timeout: float = 30.0,
        max_frame_bytes: int = 64 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
        hash_from: Callable[[memoryview], int | None] | None = None,
    ):
        if max_transfers < 1:
            raise ValueError("max_transfers must be >= 1")
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        if max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be >= 1")
        self.max_transfers = max_transfers
        self.max_bytes = max_bytes
        self.timeout = float(timeout)
        self.max_frame_bytes = max_frame_bytes
        self._clock = clock
        self._hash_from = hash_from
        self._transfers: dict[bytes, _Transfer] = {}
        self._held = 0
        self._completed: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    @property
    def pending(self) -> int:
        """Number of incomplete transfers held."""
        return len(self._transfers)

    @property
    def idle(self) -> bool:
        """True when nothing is pending or remembered (the object may be discarded)."""
        return not self._transfers and not self._completed

    def holds(self, data: bytes) -> bool:
        """True when ``data`` is a chunk of a transfer already pending here (or just
        completed), i.e. feeding it cannot start a new transfer."""
        if len(data) < HEADER_LEN or not is_chunk(data):
            return False
        tid = bytes(data[4:20])
        return tid in self._transfers or tid in self._completed

    @property
    def held_bytes(self) -> int:
        """Data bytes held by incomplete transfers."""
        return self._held

    def feed(self, data: bytes) -> bytes | bytearray | None:
        """Take one received message; return a complete frame or ``None``.

        A message that does not start with :data:`CHUNK_MAGIC` is a plain frame and
        is returned as it is.  Duplicated chunks (QoS 1 redelivery), also of an
        already completed transfer, are ignored.

        Raises:
            ChunkError: see the module docstring for the reasons.
        """
        result = self.feed_with_size(data)
        return None if result is None else result[0]

    def feed_with_size(self, data: bytes) -> tuple[bytes | bytearray, int] | None:
        """Like :meth:`feed`, but returns ``(frame, wire_bytes)`` where ``wire_bytes`` is
        the total size of the distinct messages (headers included) the frame came in.
        A plain frame is returned as it was given (``bytes``); a reassembled one is a
        ``bytearray`` that nothing else holds."""
        if not isinstance(data, bytes):
            data = bytes(data)
        if not is_chunk(data):
            return data, len(data)
        if len(data) < HEADER_LEN + 1:
            raise ChunkError("bad_chunk", f"chunk of {len(data)} bytes is shorter than its header + 1")
        _, version, tid, index, count, total = _HEADER.unpack_from(data)
        if version != CHUNK_VERSION:
            raise ChunkError("bad_chunk", f"unknown chunk version {version}")
        if total > self.max_frame_bytes:
            raise ChunkError("oversized", f"declared frame of {total} bytes > {self.max_frame_bytes}")
        payload = memoryview(data)[HEADER_LEN:]
        if count < 1 or index >= count or total < count or len(payload) > total:
            raise ChunkError("bad_chunk", f"impossible chunk index={index} count={count} total={total}")
        now = self._clock()
        if tid in self._completed:
            return None  # late duplicate of a delivered frame
        transfer = self._transfers.get(tid)
        if transfer is None:
            if len(self._transfers) >= self.max_transfers:
                raise ChunkError("too_many_transfers", f"{len(self._transfers)} transfers pending")
            transfer = _Transfer(count=count, total=total, last_seen=now)
            new = True
        else:
            new = False
            if (transfer.count, transfer.total) != (count, total):
                raise ChunkError("bad_chunk", "header disagrees with earlier chunks of the transfer")
            if index in transfer.parts:
                return None  # duplicate
        if transfer.held + len(payload) > total:
            raise ChunkError("bad_chunk", "more data than the declared total")
        if self._held + len(payload) > self.max_bytes:
            raise ChunkError("too_many_transfers", f"pending chunks would exceed {self.max_bytes} bytes")
        if new:
            self._transfers[tid] = transfer
        transfer.parts[index] = payload
        transfer.held += len(payload)
        transfer.wire_bytes += len(data)
        transfer.last_seen = now
        self._held += len(payload)
        if self._hash_from is not None and transfer.hashing:
            self._hash_ready(transfer)
        if len(transfer.parts) < transfer.count:
            return None
        # complete
        del self._transfers[tid]
        self._held -= transfer.held
        if transfer.held != transfer.total:
            raise ChunkError("bad_chunk", f"chunks carry {transfer.held} bytes, declared {transfer.total}")
        frame = Frame()
        for i in range(transfer.count):
            frame += transfer.parts[i]
        if transfer.hasher is not None and transfer.next_index == transfer.count:
            frame.payload_offset = transfer.offset
            frame.payload_digest = transfer.hasher.hexdigest()
        transfer.parts.clear()
        self._completed[tid] = now
        while len(self._completed) > self.RECENT_COMPLETED:
            self._completed.popitem(last=False)
        return frame, transfer.wire_bytes

    def _hash_ready(self, transfer: _Transfer) -> None:
        """Hash the chunks that now follow the hashed ones without a gap (index order;
        each one's frame position is the sum of the lengths before it, as in the frame)."""
        parts = transfer.parts
        while transfer.next_index in parts:
            part = parts[transfer.next_index]
            if transfer.next_index == 0:
                offset = self._hash_from(part) if self._hash_from is not None else None
                if offset is None or not 0 <= offset <= transfer.total:
                    transfer.hashing = False
                    return
                transfer.offset = offset
                transfer.hasher = blake3.blake3()
            end = transfer.pos + len(part)
            if end > transfer.offset:
                transfer.hasher.update(part[max(0, transfer.offset - transfer.pos):])
            transfer.pos = end
            transfer.next_index += 1

    @property
    def buffers(self) -> int:
        """Chunk buffers held by incomplete transfers (0 after they all expired)."""
        return sum(len(t.parts) for t in self._transfers.values())

    def expire(self) -> int:
        """Drop transfers without a new chunk for ``timeout`` seconds; return how many.

        Their chunk buffers are released at once, and when at least 1 MiB was freed the
        C allocator is asked to return free memory to the system (``malloc_trim``,
        glibc only), so an attack of incomplete transfers leaves no resident memory."""
        now = self._clock()
        stale = [tid for tid, t in self._transfers.items() if now - t.last_seen > self.timeout]
        freed = 0
        for tid in stale:
            transfer = self._transfers.pop(tid)
            self._held -= transfer.held
            freed += transfer.held
            transfer.parts.clear()
        if freed >= 1 << 20:
            _trim_heap()
        while self._completed:
            tid, seen = next(iter(self._completed.items()))
            if now - seen <= self.timeout:
                break
            self._completed.popitem(last=False)
        return len(stale)
