"""Chunk size and keepalive on a slow link (dfl_agent.transport.link_rate), as root in lab
namespaces with a real mosquitto: two senders on 64 kbit/s links each send a 180 kB
model frame to a receiver at once, one with the fixed defaults (256 KiB chunks, keepalive
10 s), one with the settings ``mqtt.link_rate = "64kbit"`` derives (16 KiB chunks,
keepalive 10 s).

The fixed-default frame goes as one 180 kB message, 22.5 s on the link.  Nothing comes
back while it is written, so paho sends a PINGREQ after one keepalive (queued behind the
message) and closes the connection after a second ("Keep alive timeout"); it reconnects
and sends the QoS 1 message again from its start, to be cut again (a copy whose bytes the
kernel still drains after the close may arrive late; usually none does).  The derived chunks take 2 s each, every PUBACK comes back within the keepalive,
and the frame arrives (about 30 s in all)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from dfl_agent.transport.link_rate import FAST_CHUNK, FAST_KEEPALIVE, derive

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="the field lab needs Linux and root"),
    pytest.mark.skipif(shutil.which("mosquitto") is None, reason="needs mosquitto"),
    pytest.mark.timeout(120),
]

RATE = "64kbit"
FRAME = 180_000  # 22.5 s at 64 kbit/s: more than 2 x keepalive

# one MqttTransport: argv = node id, broker, chunk size, keepalive, [peer to send FRAME bytes to]
PEER = r"""
import asyncio, json, os, sys, time
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.transport.mqtt import MqttTransport
nid, broker, chunk, keepalive = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
to = sys.argv[5] if len(sys.argv) > 5 else None
async def main():
    t = MqttTransport(nid, "linkrate", broker=broker, peers=PeerTable(nid, "linkrate"), chunk_size=chunk,
                      keepalive=keepalive)
    t0 = time.monotonic()
    def on_frame(frame, wire):
        print(json.dumps({"frame": frame[:3].decode(), "bytes": len(frame), "t": round(time.monotonic() - t0, 1)}),
              flush=True)
    await t.start(on_frame, lambda *a: None)
    print(json.dumps({"ready": nid}), flush=True)
    if to:
        await asyncio.sleep(1.0)  # the receiver is subscribed
        await t.send(to, nid[:3].encode() + os.urandom(%d - 3))
    await asyncio.sleep(3600)
asyncio.run(main())
""" % FRAME


def _lines(proc: subprocess.Popen) -> list[dict]:
    out = []
    for line in (proc.stdout.read() if proc.stdout else "").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_derived_chunks_get_through_where_the_fixed_defaults_are_cut(tmp_path):
    from dfl_agent.cli.lab.net import LabNet

    derived = derive(RATE)
    assert (derived.chunk_size, derived.keepalive) == (16_384, FAST_KEEPALIVE)
    conf = tmp_path / "mosquitto.conf"
    with LabNet() as lab:
        lab.add_site("s")
        broker = lab.add_host("broker", "s")
        lab.add_host("rx", "s")
        lab.add_host("old", "s", rate=RATE)
        lab.add_host("new", "s", rate=RATE)
        conf.write_text(f"listener 1883 {broker.address}\nallow_anonymous true\n")
        lab.popen("broker", ["mosquitto", "-c", str(conf)])
        endpoint = f"{broker.address}:1883"
        time.sleep(0.5)
        env = dict(os.environ, PYTHONUNBUFFERED="1")

        def peer(host: str, chunk: int, keepalive: int, to: str | None = None) -> subprocess.Popen:
            argv = [sys.executable, "-c", PEER, host, endpoint, str(chunk), str(keepalive), *([to] if to else [])]
            return lab.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

        rx = peer("rx", FAST_CHUNK, FAST_KEEPALIVE)
        assert rx.stdout and "ready" in rx.stdout.readline()
        old = peer("old", FAST_CHUNK, FAST_KEEPALIVE, to="rx")
        new = peer("new", derived.chunk_size, derived.keepalive, to="rx")
        time.sleep(28.0)
        for p in (rx, old, new):
            lab.stop(p)
        got = {r["frame"]: r for r in _lines(rx) if "frame" in r}
        old_out = old.stdout.read() if old.stdout else ""  # its log: the lost connection
    assert "new" in got and got["new"]["bytes"] == FRAME, (got, old_out[-2000:])
    # the fixed defaults' connection is cut by its keepalive while the frame is on the link; the
    # frame is not asserted lost: after paho closes the socket the kernel may still drain the
    # bytes it had queued (a graceful close) and the broker then delivers that copy (seen once in
    # CI, at 24.1 s), or reset it (the usual case), depending on what sat unread at the close
    assert "Keep alive timeout" in old_out, old_out[-2000:]
