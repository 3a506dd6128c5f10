"""RSS of a process before, during and after 100 incomplete 4 MiB chunked transfers
expire in a Reassembler (the chunk-flood attack): prints a JSON line.

    nice -n 10 python bench/security/reassembler_rss.py
"""

import gc
import json
import os

from dfl_agent.transport.chunking import Reassembler, split

MIB = 1 << 20


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def main() -> None:
    now = [0.0]
    r = Reassembler(max_transfers=128, max_bytes=1 << 30, timeout=30.0, max_frame_bytes=8 * MIB,
                    clock=lambda: now[0])
    gc.collect()
    before = rss_mb()
    for i in range(100):  # every chunk but the last of a 4 MiB frame (a distinct transfer each)
        frame = i.to_bytes(4, "big") * (MIB)
        for chunk in split(frame, 256 * 1024)[:-1]:
            r.feed(chunk)
        del frame
    gc.collect()
    held = r.held_bytes / MIB
    during = rss_mb()
    now[0] = 31.0
    r.expire()
    gc.collect()
    after = rss_mb()
    print(json.dumps({"transfers": 100, "held_mb_before_expiry": round(held, 1), "rss_mb_start": round(before, 1),
                      "rss_mb_attack": round(during, 1), "rss_mb_after_expiry": round(after, 1),
                      "held_bytes_after": r.held_bytes, "buffers_after": r.buffers}))


if __name__ == "__main__":
    main()
