"""Unit tests of dfl_agent.transport.chunking (split / Reassembler)."""

from __future__ import annotations

import random
import struct

import pytest

from dfl_agent.transport.chunking import (
    CHUNK_MAGIC,
    HEADER_LEN,
    ChunkError,
    Reassembler,
    is_chunk,
    split,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _frame(n: int, seed: int = 0) -> bytes:
    return b"DFL" + random.Random(seed).randbytes(max(0, n - 3)) if n >= 3 else b"D" * n


def _reassemble(chunks: list[bytes], r: Reassembler | None = None) -> bytes:
    r = r or Reassembler()
    out = [r.feed(c) for c in chunks]
    assert all(o is None for o in out[:-1])
    assert out[-1] is not None
    assert r.pending == 0 and r.held_bytes == 0
    return out[-1]


def test_small_frame_passes_unchanged():
    frame = _frame(100)
    assert split(frame, 100) == [frame]
    assert Reassembler().feed(frame) == frame
    assert Reassembler().feed_with_size(frame) == (frame, 100)


def test_empty_frame_passes_unchanged():
    assert split(b"", 1000) == [b""]
    assert Reassembler().feed(b"") == b""


@pytest.mark.parametrize("chunk_size", [HEADER_LEN + 2, HEADER_LEN + 7, 200, 1024])
def test_round_trip_boundaries(chunk_size):
    d = chunk_size - HEADER_LEN
    sizes = {chunk_size, chunk_size + 1, d, 2 * d, 2 * d + 1, 3 * d - 1, 5 * d, 1}
    for n in sorted(sizes):
        frame = _frame(n, seed=n)
        chunks = split(frame, chunk_size)
        assert all(len(c) <= chunk_size for c in chunks)
        if n <= chunk_size:
            assert chunks == [frame]
            continue
        assert len(chunks) == -(-n // d)
        assert all(is_chunk(c) for c in chunks)
        assert _reassemble(chunks) == frame


def test_round_trip_random_sizes():
    rng = random.Random(42)
    r = Reassembler()
    for trial in range(200):
        chunk_size = rng.randint(HEADER_LEN + 2, 4096)
        frame = _frame(rng.randint(0, 20000), seed=trial)
        chunks = split(frame, chunk_size)
        assert all(len(c) <= chunk_size for c in chunks)
        assert _reassemble(chunks, r) == frame


def test_wire_bytes_counts_every_chunk():
    frame = _frame(10_000)
    chunks = split(frame, 1000)
    r = Reassembler()
    results = [r.feed_with_size(c) for c in chunks]
    assert results[-1] == (frame, sum(len(c) for c in chunks))


def test_frame_starting_with_chunk_magic_is_always_wrapped():
    frame = CHUNK_MAGIC + b"not really a chunk"
    chunks = split(frame, 1000)
    assert len(chunks) == 1 and chunks[0] != frame
    assert _reassemble(chunks) == frame
    # and if wrapping does not fit in one message, it still round-trips
    frame = CHUNK_MAGIC + bytes(200)
    chunks = split(frame, 210)
    assert len(chunks) == 2 and all(len(c) <= 210 for c in chunks)
    assert _reassemble(chunks) == frame


def test_out_of_order_and_duplicated_chunks():
    frame = _frame(50_000, seed=3)
    chunks = split(frame, 1000)
    order = chunks + chunks[::3]  # duplicates
    random.Random(7).shuffle(order)
    last_unique = max(order.index(c) for c in chunks)
    r = Reassembler()
    results = [r.feed(c) for c in order]
    done = [i for i, x in enumerate(results) if x is not None]
    assert done == [last_unique]  # delivered exactly once, duplicates after it ignored
    assert results[last_unique] == frame
    assert r.pending == 0 and r.held_bytes == 0


def test_interleaved_transfers():
    a, b = _frame(5000, 1), _frame(7000, 2)
    ca, cb = split(a, 500), split(b, 500)
    r = Reassembler()
    got = []
    for i in range(max(len(ca), len(cb))):
        for cs in (ca, cb):
            if i < len(cs):
                out = r.feed(cs[i])
                if out is not None:
                    got.append(out)
    assert sorted(got) == sorted([a, b])


def test_corrupt_chunk_is_caught_by_the_envelope_hash():
    """Chunks carry no hash of their own: a corrupted chunk reassembles, and the wire
    envelope's one payload hash rejects the frame (it never reaches a model)."""
    import numpy as np

    from dfl_agent.algorithms.context import Message
    from dfl_agent.transport import wire

    frame = wire.encode(Message("model", 1, {"w": np.arange(2000, dtype=np.float32)}), federation="f", sender="s")
    chunks = split(frame, 1000)
    bad = bytearray(chunks[-2])
    bad[-1] ^= 0xFF
    chunks[-2] = bytes(bad)
    out = _reassemble(chunks)
    assert isinstance(out, bytearray) and len(out) == len(frame) and out != frame
    with pytest.raises(wire.WireError) as ei:
        wire.decode(out)
    assert ei.value.reason == "hash_mismatch"
    assert wire.decode(_reassemble(split(frame, 1000))).tensors["w"][-1] == 1999


def test_reassembled_frame_is_a_fresh_writable_buffer():
    frame = _frame(5000)
    out = _reassemble(split(frame, 1000))
    assert isinstance(out, bytearray) and out == frame


def test_version_1_chunks_are_bad_chunk():
    """Chunks of the previous format (version 1, with a 32-byte frame hash) are rejected."""
    old = struct.pack(">3sB16sIIQ32s", CHUNK_MAGIC, 1, b"T" * 16, 0, 2, 100, b"\0" * 32) + b"x" * 50
    with pytest.raises(ChunkError) as ei:
        Reassembler().feed(old)
    assert ei.value.reason == "bad_chunk"


@pytest.mark.parametrize("cut", [3, 4, 20, HEADER_LEN - 1, HEADER_LEN])
def test_truncated_header_is_bad_chunk(cut):
    chunk = split(_frame(5000), 1000)[0]
    with pytest.raises(ChunkError) as ei:
        Reassembler().feed(chunk[:cut])
    assert ei.value.reason == "bad_chunk"


def _header(tid=b"T" * 16, index=0, count=2, total=100, version=2):
    return struct.pack(">3sB16sIIQ", CHUNK_MAGIC, version, tid, index, count, total)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"version": 1},
        {"version": 3},
        {"index": 2, "count": 2},
        {"count": 0},
        {"count": 200, "total": 100},
    ],
)
def test_impossible_headers_are_bad_chunk(kwargs):
    with pytest.raises(ChunkError) as ei:
        Reassembler().feed(_header(**kwargs) + b"x")
    assert ei.value.reason == "bad_chunk"


def test_more_data_than_declared_is_bad_chunk():
    r = Reassembler()
    with pytest.raises(ChunkError) as ei:
        r.feed(_header(total=3, count=2) + b"xxxx")
    assert ei.value.reason == "bad_chunk"
    assert r.feed(_header(total=3, count=2, index=0) + b"xx") is None
    with pytest.raises(ChunkError) as ei:
        r.feed(_header(total=3, count=2, index=1) + b"xx")
    assert ei.value.reason == "bad_chunk"


def test_inconsistent_headers_are_bad_chunk():
    frame = _frame(3000)
    chunks = split(frame, 1000, transfer_id=b"A" * 16)
    r = Reassembler()
    assert r.feed(chunks[0]) is None
    _, _, tid, index, count, total = struct.unpack_from(">3sB16sIIQ", chunks[1])
    forged = _header(tid=tid, index=index, count=count, total=total + 1)
    with pytest.raises(ChunkError) as ei:
        r.feed(forged + chunks[1][HEADER_LEN:])
    assert ei.value.reason == "bad_chunk"
    # the genuine transfer still completes
    for c in chunks[1:]:
        out = r.feed(c)
    assert out == frame


def test_oversized_declared_total_rejected_before_allocation():
    r = Reassembler(max_frame_bytes=1000)
    with pytest.raises(ChunkError) as ei:
        r.feed(_header(total=2**63, count=2) + b"x")
    assert ei.value.reason == "oversized"
    assert r.pending == 0 and r.held_bytes == 0
    # a declared total just at the limit is accepted
    frame = _frame(1000)
    assert _reassemble(split(frame, 300), r) == frame


def test_expiry_with_fake_clock():
    clock = FakeClock()
    r = Reassembler(timeout=30.0, clock=clock)
    chunks = split(_frame(5000), 1000)
    r.feed(chunks[0])
    clock.now += 20
    r.feed(chunks[1])  # activity keeps it alive
    clock.now += 20
    assert r.expire() == 0
    assert r.pending == 1
    clock.now += 10.5
    assert r.expire() == 1
    assert r.pending == 0 and r.held_bytes == 0
    assert r.expire() == 0


def test_late_duplicate_of_completed_transfer_is_ignored():
    frame = _frame(5000)
    chunks = split(frame, 1000)
    r = Reassembler()
    assert _reassemble(chunks, r) == frame
    assert r.feed(chunks[1]) is None
    assert r.pending == 0


def test_too_many_transfers():
    r = Reassembler(max_transfers=2)
    frames = [_frame(3000, seed=i) for i in range(3)]
    chunks = [split(f, 1000) for f in frames]
    r.feed(chunks[0][0])
    r.feed(chunks[1][0])
    with pytest.raises(ChunkError) as ei:
        r.feed(chunks[2][0])
    assert ei.value.reason == "too_many_transfers"
    for c in chunks[0][1:]:
        out = r.feed(c)
    assert out == frames[0]
    # one slot free again
    assert r.feed(chunks[2][0]) is None


def test_max_bytes_limit():
    r = Reassembler(max_bytes=2500)
    a = split(_frame(3000, 1), 1000 + HEADER_LEN)
    b = split(_frame(3000, 2), 1000 + HEADER_LEN)
    r.feed(a[0])
    r.feed(a[1])
    with pytest.raises(ChunkError) as ei:
        r.feed(b[0])
    assert ei.value.reason == "too_many_transfers"
    assert r.held_bytes == 2000


def test_split_validates_chunk_size():
    with pytest.raises(ValueError):
        split(b"x" * 1000, HEADER_LEN + 1)
    with pytest.raises(ValueError):
        split(b"x" * 1000, 0)
    assert len(split(b"x" * 1000, HEADER_LEN + 2)) == 500


def test_chunk_header_is_36_bytes_without_a_hash():
    frame = _frame(3000)
    chunks = split(frame, 1000)
    assert HEADER_LEN == 36
    assert b"".join(c[HEADER_LEN:] for c in chunks) == frame
    for i, c in enumerate(chunks):
        assert struct.unpack_from(">3sB16sIIQ", c)[3:] == (i, len(chunks), len(frame))


@pytest.mark.parametrize("order", ["in_order", "reversed", "shuffled_with_duplicates"])
def test_payload_hashed_while_chunks_arrive(order):
    """With ``hash_from`` the payload's BLAKE3 digest is computed as the chunks come in (each
    as soon as the ones before it are in), over exactly the bytes of the joined frame;
    the decoder uses it instead of hashing again, so a wrong one is a hash mismatch."""
    import blake3
    import numpy as np

    from dfl_agent.algorithms.context import Message
    from dfl_agent.transport import wire
    from dfl_agent.transport.chunking import Frame

    frame = wire.encode(Message("model", 1, {"w": np.arange(5000, dtype=np.float32)}), federation="f", sender="s")
    chunks = split(frame, 3000)
    if order == "reversed":
        chunks.reverse()
    elif order == "shuffled_with_duplicates":
        chunks = chunks + chunks[:3]
        random.Random(1).shuffle(chunks)
    r = Reassembler(hash_from=wire.payload_offset)
    outs = [r.feed(c) for c in chunks]
    done = [o for o in outs if o is not None]
    assert len(done) == 1
    out = done[0]
    assert isinstance(out, Frame) and out == frame
    offset = wire.payload_offset(frame)
    assert offset is not None and out.payload_offset == offset
    assert out.payload_digest == blake3.blake3(frame[offset:]).hexdigest()
    assert wire.decode(out).tensors["w"][-1] == 4999
    out.payload_digest = "0" * 64  # the decoder takes the digest computed here
    with pytest.raises(wire.WireError) as ei:
        wire.decode(out)
    assert ei.value.reason == "hash_mismatch"


def test_payload_hash_of_a_corrupt_chunk_mismatches():
    import numpy as np

    from dfl_agent.algorithms.context import Message
    from dfl_agent.transport import wire

    frame = wire.encode(Message("model", 1, {"w": np.arange(2000, dtype=np.float32)}), federation="f", sender="s")
    chunks = split(frame, 1000)
    bad = bytearray(chunks[-2])
    bad[-1] ^= 0xFF
    chunks[-2] = bytes(bad)
    out = _reassemble(chunks, Reassembler(hash_from=wire.payload_offset))
    assert out.payload_digest is not None
    with pytest.raises(wire.WireError) as ei:
        wire.decode(out)
    assert ei.value.reason == "hash_mismatch"


def test_no_payload_hash_for_frames_that_are_not_wire_frames():
    from dfl_agent.transport import wire

    out = _reassemble(split(_frame(5000), 1000), Reassembler(hash_from=wire.payload_offset))
    assert out.payload_digest is None and out.payload_offset == -1


@pytest.mark.parametrize("n", [0, 10, 999, 1000, 1001, 5000])
def test_iter_chunks_and_chunked_size_match_split(n):
    from dfl_agent.transport.chunking import chunked_size, iter_chunks

    tid = bytes(16)
    for frame in (_frame(n), CHUNK_MAGIC + _frame(n)):
        chunks = split(frame, 1000, transfer_id=tid)
        assert list(iter_chunks(frame, 1000, transfer_id=tid)) == chunks
        assert chunked_size(frame, 1000) == sum(len(c) for c in chunks)
