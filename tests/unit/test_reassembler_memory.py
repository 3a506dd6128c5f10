"""After incomplete chunked transfers expire, the reassembler holds nothing and its
buffers are released (Python-level allocations back to the baseline)."""

import gc
import tracemalloc

from dfl_agent.transport.chunking import Reassembler, split

MIB = 1 << 20


def test_expired_incomplete_transfers_release_their_memory():
    now = [0.0]
    r = Reassembler(max_transfers=128, max_bytes=1 << 30, timeout=30.0, max_frame_bytes=8 * MIB,
                    clock=lambda: now[0])
    frame = bytes(4 * MIB)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        chunks = split(frame, MIB // 4)
        for _ in range(100):  # 100 incomplete 4 MiB transfers, 4 of 17 chunks each
            for chunk in split(frame, MIB // 4)[:4]:
                assert r.feed(chunk) is None
        del chunks
        gc.collect()
        assert r.pending == 100 and r.held_bytes > 99 * MIB and r.buffers == 400
        assert tracemalloc.get_traced_memory()[0] - base > 99 * MIB
        now[0] = 31.0
        assert r.expire() == 100
        gc.collect()
        assert (r.pending, r.held_bytes, r.buffers) == (0, 0, 0)
        assert tracemalloc.get_traced_memory()[0] - base < 2 * MIB  # every chunk buffer was freed
    finally:
        tracemalloc.stop()
