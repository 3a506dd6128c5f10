"""MqttTransport against real brokers on 127.0.0.1 (mosquitto, amqtt)."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from dfl_agent.cli.broker import free_port
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import node_transport
from dfl_agent.transport.chunking import CHUNK_MAGIC, CHUNK_VERSION, HEADER_LEN, split
from dfl_agent.transport.mqtt import MqttTransport, topic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REPO_ROOT = Path(__file__).resolve().parents[2]


def _frame(n: int) -> bytes:
    return b"DFL" + os.urandom(n - 3)


async def wait_until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


class Node:
    """A transport plus everything its handlers received."""

    def __init__(self, transport: MqttTransport):
        self.t = transport
        self.frames: list[tuple[bytes, int]] = []
        self.presence: list[tuple[str, dict | None]] = []
        self.heartbeats: list[tuple[str, dict]] = []
        transport.channel.on_heartbeat = lambda nid, st: self.heartbeats.append((nid, st))

    async def start(self) -> Node:
        await self.t.start(lambda f, w: self.frames.append((f, w)),
                           lambda nid, d: self.presence.append((nid, d)))
        return self

    def online(self, nid: str) -> bool:
        last = [d for n, d in self.presence if n == nid]
        return bool(last) and last[-1] is not None

    def offline(self, nid: str) -> bool:
        last = [d for n, d in self.presence if n == nid]
        return bool(last) and last[-1] is None


@pytest.fixture
async def make():
    """``await make(node_id, broker, federation, **kwargs)`` -> started Node; all stopped after."""
    nodes: list[Node] = []

    async def _make(node_id, broker, federation, *, peers=None, start=True, **kwargs):
        kwargs.setdefault("protocol", broker.protocols[0])
        t = node_transport(node_id, federation, broker=broker.endpoint,
                           peers=peers or PeerTable(node_id, federation),
                           descriptor={"profile": "test", "node": node_id}, **kwargs)
        node = Node(t)
        nodes.append(node)
        return await node.start() if start else node

    yield _make
    for node in nodes:
        await node.t.stop()


def raw_publish(broker, messages, protocol=mqtt.MQTTv311) -> None:
    """Publish ``[(topic, payload), ...]`` with a plain paho client (QoS 1), blocking."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"raw-{os.getpid()}-{time.time_ns()}",
                    protocol=protocol)
    c.connect(broker.host, broker.port)
    c.loop_start()
    try:
        for t, payload in messages:
            c.publish(t, payload, qos=1).wait_for_publish(5)
    finally:
        c.disconnect()
        c.loop_stop()


class Spy:
    """A plain paho subscriber recording payload sizes on a topic filter."""

    def __init__(self, broker, topic_filter: str):
        self.sizes: list[int] = []
        self._ready = threading.Event()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"spy-{time.time_ns()}",
                             protocol=mqtt.MQTTv311)
        self.c.on_message = lambda c, u, m: self.sizes.append(len(m.payload))
        self.c.on_subscribe = lambda *a: self._ready.set()
        self.c.connect(broker.host, broker.port)
        self.c.subscribe(topic_filter, 1)
        self.c.loop_start()
        assert self._ready.wait(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


# ---------------------------------------------------------------- exchange


@pytest.mark.parametrize(
    "broker_fixture,protocol",
    [("mosquitto_broker", "5"), ("mosquitto_broker", "3.1.1"), ("amqtt_broker", "3.1.1")],
)
async def test_exchange_inbox_and_broadcast(request, make, federation, broker_fixture, protocol):
    broker = request.getfixturevalue(broker_fixture)
    a = await make("A", broker, federation, protocol=protocol, chunk_size=64 * 1024)
    b = await make("B", broker, federation, protocol=protocol, chunk_size=64 * 1024)
    f1, f2, f3, f4 = _frame(1000), _frame(200_000), _frame(5000), _frame(150_000)

    n1 = await a.t.send("B", f1)
    n2 = await b.t.send("A", f2)  # chunked
    n3 = await a.t.broadcast(f3)
    n4 = await b.t.broadcast(f4)  # chunked
    assert n1 == len(f1) and n3 == len(f3)
    assert n2 > len(f2) and n4 > len(f4)  # chunk headers counted

    await wait_until(lambda: len(a.frames) >= 2 and len(b.frames) >= 2, what="frames")
    await asyncio.sleep(0.1)  # nothing more (no echo of own broadcasts)
    assert sorted(f for f, _ in b.frames) == sorted([f1, f3])
    assert sorted(f for f, _ in a.frames) == sorted([f2, f4])
    assert {bytes(f): n for f, n in b.frames}[f1] == n1 and {bytes(f): n for f, n in a.frames}[f2] == n2
    assert a.t.stats.bytes_sent == n1 + n3 == b.t.stats.bytes_received
    assert b.t.stats.bytes_sent == n2 + n4 == a.t.stats.bytes_received
    assert a.t.stats.frames_sent == b.t.stats.frames_received == 2
    assert b.t.stats.frames_sent == a.t.stats.frames_received == 2
    assert not a.t.stats.dropped and not b.t.stats.dropped


# ---------------------------------------------------------------- chunking


async def test_large_frame_is_chunked_within_limit(make, federation):
    from dfl_agent.cli.broker import mosquitto_path, start_broker

    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed (apt install mosquitto)")
    chunk = 64 * 1024
    # the broker itself rejects (disconnects) any packet bigger than one chunk + headers
    with start_broker("mosquitto", max_packet_size=chunk + 256) as broker:
        a = await make("A", broker, federation, chunk_size=chunk)
        b = await make("B", broker, federation, chunk_size=chunk)
        spy = Spy(broker, topic(federation, "B", "inbox"))
        try:
            frame = _frame(3_000_000)
            n = await a.t.send("B", frame)
            await wait_until(lambda: b.frames, timeout=15, what="3 MB frame")
            # the spy is another subscriber: its copy of the last chunk may come later
            await wait_until(lambda: sum(spy.sizes) >= n, timeout=5, what="spy saw every chunk")
            got, wire = b.frames[0]
            assert got == frame
            assert wire == n == sum(spy.sizes) == b.t.stats.bytes_received
            assert len(spy.sizes) == -(-len(frame) // (chunk - HEADER_LEN))
            assert max(spy.sizes) <= chunk
            assert a.t.connected and b.t.connected  # nobody was cut off by the broker
        finally:
            spy.close()
            await a.t.stop()
            await b.t.stop()


async def test_frames_are_prepared_on_the_network_thread(mosquitto_broker, make, federation):
    """With ``prepare_frame`` set (the runtime's decode and signature check), every
    complete frame - one message or reassembled from chunks, whose payload was hashed as
    the chunks arrived - is prepared on paho's network thread, and the event loop's
    handler gets the result."""
    import numpy as np

    from dfl_agent.algorithms.context import Message
    from dfl_agent.transport import wire
    from dfl_agent.transport.chunking import Frame

    a = await make("A", mosquitto_broker, federation, chunk_size=64 * 1024)
    b = await make("B", mosquitto_broker, federation, chunk_size=64 * 1024)
    seen: list[tuple[str, Any]] = []

    def prepare(frame, wire_bytes):
        seen.append((threading.current_thread().name, frame))
        return ("prepared", wire.decode(frame).round, wire_bytes)

    b.t.prepare_frame = prepare
    small = wire.encode(Message("model", 1, {"w": np.ones(10, np.float32)}), federation=federation, sender="A")
    big = wire.encode(Message("model", 2, {"w": np.ones(100_000, np.float32)}), federation=federation, sender="A")
    n_small = await a.t.send("B", small)
    n_big = await a.t.send("B", big)
    await wait_until(lambda: len(b.frames) == 2, timeout=15, what="two prepared frames")
    assert b.frames == [(("prepared", 1, n_small), n_small), (("prepared", 2, n_big), n_big)]
    assert all(name != threading.main_thread().name for name, _ in seen)  # not on the loop's thread
    reassembled = seen[1][1]
    assert isinstance(reassembled, Frame) and reassembled.payload_digest is not None  # hashed on arrival


# ---------------------------------------------------------------- presence


BROKERS = pytest.mark.parametrize("broker_fixture", ["mosquitto_broker", "amqtt_broker"])


@BROKERS
async def test_presence_status_and_clean_stop(request, broker_fixture, make, federation):
    broker = request.getfixturevalue(broker_fixture)
    a = await make("A", broker, federation, heartbeat_interval=0.2)
    b = await make("B", broker, federation)
    await wait_until(lambda: b.online("A"), what="A online at B")
    assert [d for n, d in b.presence if n == "A"][-1] == {"profile": "test", "node": "A"}
    await wait_until(lambda: a.online("B"), what="B online at A")

    await a.t.publish_status({"round": 3, "role": "aggregator"})
    await wait_until(lambda: b.t.statuses.get("A", {}).get("round") == 3, what="status")
    first = b.t.statuses["A"]["heartbeat"]
    await wait_until(lambda: b.t.statuses["A"]["heartbeat"] >= first + 2, timeout=3, what="heartbeats")
    assert b.t.statuses["A"]["role"] == "aggregator" and b.t.statuses["A"]["node_id"] == "A"
    assert any(n == "A" and st.get("round") == 3 for n, st in b.heartbeats)

    await a.t.stop()
    await wait_until(lambda: b.offline("A"), what="A offline at B")
    await a.t.stop()  # idempotent
    assert await a.t.send("B", b"x") == 0 and a.t.stats.dropped["not_connected"] == 1


_CHILD = """
import asyncio, sys
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import node_transport

async def main():
    fed, endpoint, protocol = sys.argv[1:4]
    t = node_transport("C", fed, broker=endpoint, peers=PeerTable("C"), descriptor={"child": True},
                       keepalive=int(sys.argv[4]), protocol=protocol)
    await t.start(lambda f, w: None, lambda n, d: None)
    print("ready", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "broker_fixture,how",
    [("mosquitto_broker", "kill"), ("amqtt_broker", "kill"), ("mosquitto_broker", "freeze")],
)
async def test_last_will_when_process_dies(request, broker_fixture, how, make, federation):
    """kill -9 closes the socket: the broker sends the will at once.  SIGSTOP leaves the
    socket open: the broker must notice the missing keepalive (1.5 x keepalive; mosquitto
    2.0 checks keepalives only every ~5 s; amqtt 0.12 never does, so not tested there)."""
    broker = request.getfixturevalue(broker_fixture)
    keepalive = 1
    limit = keepalive * 1.5 + (2 if how == "kill" else 5 + 2)
    b = await make("B", broker, federation)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, federation, broker.endpoint, broker.protocols[0], str(keepalive),
        stdout=asyncio.subprocess.PIPE, env=env, cwd=str(REPO_ROOT))
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.strip() == b"ready"
        await wait_until(lambda: b.online("C"), what="child online")
        assert [d for n, d in b.presence if n == "C"][-1] == {"child": True}
        t0 = time.monotonic()
        if how == "kill":
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        else:
            proc.send_signal(signal.SIGSTOP)
        await wait_until(lambda: b.offline("C"), timeout=limit, what="last will")
        assert time.monotonic() - t0 <= limit
    finally:
        if proc.returncode is None:
            proc.kill()  # also ends a stopped process
            await proc.wait()


# ---------------------------------------------------------------- robustness


async def test_hostile_payloads_are_counted_and_survived(mosquitto_broker, make, federation):
    a = await make("A", mosquitto_broker, federation, max_frame_bytes=64 * 1024,
                   chunk_size=16 * 1024, reassembly_timeout=0.3)
    b = await make("B", mosquitto_broker, federation)
    inbox = topic(federation, "A", "inbox")
    good = _frame(40_000)
    corrupt = split(good, 16 * 1024)
    corrupt[1] = corrupt[1][:-1] + bytes([corrupt[1][-1] ^ 1])
    corrupted = b"".join(c[HEADER_LEN:] for c in corrupt)
    oversized_header = struct.pack(">3sB16sIIQ", CHUNK_MAGIC, CHUNK_VERSION, b"O" * 16, 0, 2, 2**40)
    incomplete = split(_frame(40_000), 16 * 1024)[0]
    messages = [
        (inbox, b"garbage"),  # not a chunk: handed up as it is
        (inbox, CHUNK_MAGIC + b"\x01short"),  # truncated chunk header
        (inbox, oversized_header + b"x"),  # declares a 1 TB frame
        (inbox, b"DFL" + bytes(64 * 1024)),  # bigger than max_frame_bytes
        (inbox, bytes(200_000)),  # much bigger
        *[(inbox, c) for c in corrupt],  # reassembled; the wire envelope's hash rejects it above
        (inbox, incomplete),  # never completed
        (inbox, b""),  # empty
        (topic(federation, "Z", "presence"), b"{not json"),
        (topic(federation, "Z", "presence"), b'{"state": "dancing"}'),
        (topic(federation, "Z", "presence"), b'\xff\xfe'),
        (topic(federation, "Z", "presence"), b'{"state": "online", "descriptor": 5}'),
        (topic(federation, "Z", "status"), b"[1, 2"),
        (topic(federation, "Z", "out"), b"DFC" + bytes(10)),
    ]
    await asyncio.to_thread(raw_publish, mosquitto_broker, messages)
    await b.t.send("A", good)
    await wait_until(lambda: any(f == good for f, _ in a.frames), what="valid frame after garbage")
    await wait_until(lambda: a.t.stats.dropped["incomplete_transfer"] == 1, timeout=3, what="expiry")
    assert [f for f, _ in a.frames] == [b"garbage", corrupted, b"", good]
    assert dict(a.t.stats.dropped) == {
        "bad_chunk": 2, "oversized": 3, "incomplete_transfer": 1,
        "bad_presence": 4, "bad_status": 1,
    }
    assert a.t.connected
    # and it still sends
    await a.t.send("B", good)
    await wait_until(lambda: b.frames, what="A still sends")


async def test_constructor_validation():
    base = dict(broker="127.0.0.1:1883", peers=PeerTable("A"), descriptor={})
    node_transport("A", "f", **base)  # fine
    bad = [
        ("node_id", dict(node_id="a/b")), ("node_id", dict(node_id="+")),
        ("federation", dict(federation="")), ("broker", dict(broker="localhost")),
        ("broker", dict(broker="h:70000")), ("peers", dict(peers=None)),
        ("descriptor", dict(descriptor={"x": object()})), ("protocol", dict(protocol="4")),
        ("chunk_size", dict(chunk_size=HEADER_LEN + 1)), ("max_frame_bytes", dict(max_frame_bytes=0)),
        ("reassembly_timeout", dict(reassembly_timeout=0)), ("keepalive", dict(keepalive=0)),
        ("heartbeat_interval", dict(heartbeat_interval=-1)), ("password", dict(password="x")),
        ("qos", dict(qos=3)), ("connect_timeout", dict(connect_timeout=0)),
    ]
    for name, override in bad:
        kwargs = {"node_id": "A", "federation": "f", **base, **override}
        with pytest.raises(ValueError, match=name):
            node_transport(kwargs.pop("node_id"), kwargs.pop("federation"), **kwargs)


async def test_start_fails_clearly_without_broker():
    port = free_port()
    t = node_transport("A", "f", broker=f"127.0.0.1:{port}", peers=PeerTable("A"), descriptor={},
                       connect_timeout=0.5)
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        await t.start(lambda f, w: None, lambda n, d: None)
    await t.stop()  # safe after a failed start
    assert await t.send("B", b"x") == 0  # dropped, not raised
    fresh = node_transport("A", "f", broker=f"127.0.0.1:{port}", peers=PeerTable("A"), descriptor={})
    with pytest.raises(RuntimeError):
        await fresh.send("B", b"x")  # before start()


# ---------------------------------------------------------------- reconnection


async def test_reconnect_after_broker_restart(fresh_mosquitto, make, federation):
    a = await make("A", fresh_mosquitto, federation)
    b = await make("B", fresh_mosquitto, federation)
    await wait_until(lambda: b.online("A"), what="A online")
    fresh_mosquitto.stop()
    await wait_until(lambda: not a.t.connected and not b.t.connected, what="disconnect noticed")
    # while the broker is away nothing raises; QoS 1 frames are queued by paho
    assert await a.t.send("B", _frame(500)) == 500
    assert await a.t.broadcast(_frame(500)) == 500
    await a.t.publish_status({"round": 1})
    n_presence = len(b.presence)
    await asyncio.to_thread(fresh_mosquitto.start)
    await wait_until(lambda: a.t.connected and b.t.connected, timeout=15, what="reconnect")
    # presence was republished (the restarted broker lost the retained one)
    await wait_until(lambda: len(b.presence) > n_presence and b.online("A"), what="presence again")
    f1, f2 = _frame(1000), _frame(300_000)
    await a.t.send("B", f1)
    await b.t.broadcast(f2)
    await wait_until(lambda: any(f == f1 for f, _ in b.frames) and any(f == f2 for f, _ in a.frames),
                     what="frames after reconnect")
    await wait_until(lambda: b.t.statuses.get("A", {}).get("round") == 1, what="status republished")
    assert not a.t.stats.dropped and not b.t.stats.dropped


# ---------------------------------------------------------------- two brokers


async def test_two_brokers_connection_pool(mosquitto_broker, mosquitto_broker2, make, federation):
    x, y = mosquitto_broker, mosquitto_broker2
    peers_a = PeerTable("A", federation)
    peers_a.upsert("B", "static", federation=federation, broker=y.endpoint)
    peers_b = PeerTable("B", federation)
    b = await make("B", y, federation, peers=peers_b)
    a = await make("A", x, federation, peers=peers_a)
    f1, f2, f3 = _frame(2000), _frame(100_000), _frame(3000)

    assert await a.t.send("B", f1) == len(f1)  # goes to B's inbox on Y
    await wait_until(lambda: b.frames, what="A -> B across brokers")
    assert b.frames[0][0] == f1
    assert set(a.t.connections()) == {x.endpoint, y.endpoint}
    await wait_until(lambda: all(a.t.connections().values()), what="pool connected")
    await wait_until(lambda: a.online("B"), what="A hears B's presence on Y")

    await b.t.broadcast(f2)  # on Y; A is subscribed there through its pool
    await wait_until(lambda: a.frames, what="B's broadcast at A")
    assert a.frames[0][0] == f2

    # B learns that A lives on X (e.g. from mDNS): the listener connects B there
    peers_b.upsert("A", "static", federation=federation, broker=x.endpoint)
    await wait_until(lambda: b.t.connections().get(x.endpoint), what="B's pool to X")
    await b.t.send("A", f3)
    await wait_until(lambda: len(a.frames) == 2, what="B -> A across brokers")
    assert a.frames[1][0] == f3
    assert list(b.t.connections()) == [y.endpoint, x.endpoint]


# ---------------------------------------------------------------- broker launcher


@pytest.mark.parametrize("kind", ["mosquitto", "amqtt"])
def test_broker_handle(kind):
    import socket

    from dfl_agent.cli.broker import amqtt_available, mosquitto_path, start_broker

    if kind == "mosquitto" and mosquitto_path() is None:
        pytest.skip("mosquitto is not installed")
    if kind == "amqtt" and not amqtt_available():
        pytest.skip("amqtt is not installed")
    with start_broker(kind) as broker:
        assert broker.kind == kind and broker.host == "127.0.0.1"
        assert broker.endpoint == f"127.0.0.1:{broker.port}"
        assert broker.protocols == (("5", "3.1.1") if kind == "mosquitto" else ("3.1.1",))
        port = broker.port
        broker.restart()
        assert broker.port == port and broker.running
        socket.create_connection((broker.host, port), timeout=1).close()
        broker.stop()
        broker.stop()  # idempotent
        assert not broker.running
        with pytest.raises(OSError):
            socket.create_connection((broker.host, port), timeout=1).close()
