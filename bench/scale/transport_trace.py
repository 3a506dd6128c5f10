"""Where the time of one message goes on the live path (two processes, one loopback mosquitto).

Runs the same sender/receiver pair as ``transport.py`` (its raw paho baseline, the agents'
path unsigned and signed; QoS 1; one message in flight) and stamps every message with ``time.perf_counter`` (the system-wide
monotonic clock, comparable between the two processes) at each step of our path:

sender: ``enc0`` broadcast called, ``enc1`` frame encoded (and signed), ``pub1`` handed to
paho (chunked, queued); receiver: ``onmsg`` paho's network thread has the (last) MQTT message,
``disp`` the reassembled frame is handed to the event loop, ``onframe`` the event loop runs
the handler, ``decoded`` decode and hash check done, ``onframe1`` signature/replay checks and
buffering done (decoding and the signature check run on the network thread, before
``disp``, where the MQTT transport prepares frames), ``taken`` the waiting ``receive`` has the message, ``report`` the receipt.

Each cell is the median over the messages of the step's duration (microseconds); the last
column is the median time from ``enc0``.  The instrumentation wraps functions, so it adds a
few microseconds per step.

Usage (repository root)::

    nice -n 10 python bench/scale/transport_trace.py --size 55000 --n 40 --out bench/scale/transport_trace.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transport as T  # noqa: E402

EV: dict[str, list[float]] = collections.defaultdict(list)
STEPS = ("enc0", "enc1", "pub1", "onmsg", "disp", "onframe", "decoded", "onframe1", "taken", "report")


def _patch() -> None:
    """Wrap the steps of the path so that each records its time in ``EV[fed:step]``."""
    from dfl_agent.runtime.node import context
    from dfl_agent.transport import mqtt, wire

    pc = time.perf_counter
    enc = wire.encode

    def encode(m: Any, **kw: Any) -> bytes:
        EV[kw["federation"] + ":enc0"].append(pc())
        r = enc(m, **kw)
        EV[kw["federation"] + ":enc1"].append(pc())
        return r

    wire.encode = encode  # type: ignore[assignment]
    pub = mqtt.MqttTransport._publish_chunks

    def publish_chunks(self: Any, conn: Any, topic: str, frame: bytes) -> int:
        r = pub(self, conn, topic, frame)
        EV[self.federation + ":pub1"].append(pc())
        return r

    mqtt.MqttTransport._publish_chunks = publish_chunks  # type: ignore[method-assign]
    hf = mqtt.MqttTransport._handle_frame

    def handle_frame(self: Any, conn: Any, topic: str, payload: bytes) -> None:
        t = pc()
        before = self.stats.frames_received
        hf(self, conn, topic, payload)
        if self.stats.frames_received != before:  # this message completed a frame
            EV[self.federation + ":onmsg"].append(t)

    mqtt.MqttTransport._handle_frame = handle_frame  # type: ignore[method-assign]
    dis = mqtt.MqttTransport._dispatch

    def dispatch(self: Any, fn: Any, *a: Any) -> None:
        if fn is not None and fn == self._on_frame:
            EV[self.federation + ":disp"].append(pc())
        dis(self, fn, *a)

    mqtt.MqttTransport._dispatch = dispatch  # type: ignore[method-assign]
    of = context.RuntimeContext._on_frame

    def on_frame(self: Any, frame: bytes, wire_bytes: int) -> None:
        EV[self.federation + ":onframe"].append(pc())
        of(self, frame, wire_bytes)
        EV[self.federation + ":onframe1"].append(pc())

    context.RuntimeContext._on_frame = on_frame  # type: ignore[method-assign]
    dwh = wire.decode_with_header

    def decode_with_header(*a: Any, **kw: Any) -> Any:
        r = dwh(*a, **kw)
        EV[str(kw.get("federation")) + ":decoded"].append(pc())
        return r

    wire.decode_with_header = decode_with_header  # type: ignore[assignment]
    tk = context.RuntimeContext._take

    def take(self: Any, *a: Any) -> Any:
        r = tk(self, *a)
        if r is not None:
            EV[self.federation + ":taken"].append(pc())
        return r

    context.RuntimeContext._take = take  # type: ignore[method-assign]


PATHS = ("unsigned", "signed")


class _Reporter:
    """The receiver's pipe end, recording every receipt of the agents' paths as ``report``."""

    def __init__(self, conn: Any):
        self.conn = conn

    def send(self, x: Any) -> None:
        if x[0] in PATHS:
            EV[f"{T.FED}-{x[0]}:report"].append(x[2])
        self.conn.send(x)

    def recv(self) -> Any:
        return self.conn.recv()


def _receiver(endpoint: str, keys: tuple[bytes, bytes], conn: Any, paths: tuple[str, ...], codec: str,
              chunk_size: int, out: str) -> None:
    _patch()
    T._receiver(endpoint, keys, _Reporter(conn), paths, codec, chunk_size)
    with open(out, "w") as f:
        json.dump(EV, f)


async def _run(size: int, n: int, recv_out: str) -> dict[str, Any]:
    import multiprocessing as mp

    from dfl_agent.cli.broker import start_broker

    _patch()
    with start_broker("mosquitto") as broker:
        paths = ("raw", *PATHS)
        two = T.Sender(broker.endpoint, paths, "none")
        two.proc = mp.get_context("spawn").Process(
            target=_receiver, daemon=True,
            args=(broker.endpoint, two.keys, two.proc._args[2], paths, "none", T.CHUNK_SIZE, recv_out))  # type: ignore[attr-defined]
        await two.start()
        tensors = T.model_of(size)
        payload = b"".join(a.tobytes() for a in tensors.values())
        raw = []
        for i in range(n + 2):
            for p in paths:
                d = await two.once(p, tensors, payload)
                if p == "raw" and i >= 2:
                    raw.append(d)
        await two.stop()
    with open(recv_out) as f:
        recv = json.load(f)
    rows: dict[str, Any] = {"raw_median_us": 1e6 * statistics.median(raw)}
    for path in PATHS:
        fed = f"{T.FED}-{path}"
        series = {s: (EV if s in ("enc0", "enc1", "pub1") else recv).get(f"{fed}:{s}", [])[-n:] for s in STEPS}
        if any(len(v) != n for v in series.values()):
            rows[path] = {s: len(v) for s, v in series.items()}  # counts, to see what is missing
            continue
        t0 = series["enc0"]
        row, prev = {}, t0
        # in the order they happen (decoding runs before or after the handover to the loop)
        for s in sorted(STEPS, key=lambda s: statistics.median(b - a for a, b in zip(t0, series[s], strict=True))):
            row[s] = (1e6 * statistics.median(b - a for a, b in zip(prev, series[s], strict=True)),
                      1e6 * statistics.median(b - a for a, b in zip(t0, series[s], strict=True)))
            prev = series[s]
        rows[path] = row
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=55_000, help="message size in bytes")
    p.add_argument("--n", type=int, default=40, help="messages per path (after 2 warm-up messages)")
    p.add_argument("--out", default=None, help="append the Markdown table to this file")
    a = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(_run(a.size, a.n, os.path.join(tmp, "recv.json")))
    lines = [f"## {a.size} bytes, {a.n} messages per path ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"load average {os.getloadavg()[0]:.1f})", "",
             f"Command: `{T.invocation()}`", "",
             f"Commit `{T._commit()}`; {T.machine()}.", "",
             f"Raw paho (36-byte chunk header, reassembled), publish to receipt: median {rows['raw_median_us']:.0f} us.",
             "", "| step | unsigned: step us | unsigned: from start us | signed: step us | signed: from start us |",
             "|---|---|---|---|---|"]
    for s in rows["unsigned"] if isinstance(rows["unsigned"].get("enc0"), tuple) else STEPS:
        cells = []
        for path in PATHS:
            v = rows[path].get(s)
            cells += [f"{v[0]:.0f}", f"{v[1]:.0f}"] if isinstance(v, tuple) else ["?", "?"]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
