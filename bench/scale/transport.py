"""Transport benchmark: publish -> full receipt over one loopback mosquitto.

Three paths carry the same model (float32 tensors of the given total size), QoS 1,
one message in flight at a time.  By default the sender and the receiver are two
processes (as two agents are), and the receiver reports the receipt time
(``time.perf_counter``, the system-wide monotonic clock) back over a pipe;
``--processes 1`` runs both ends in one process, where they also compete for one
interpreter lock:

* ``raw``: raw paho - one client publishes the tensors' bytes in one message, another
  receives them (timed from ``publish`` to the receiver's ``on_message``);
* ``raw_chunked``: raw paho carrying the same bytes in pieces of at most the agent's chunk
  size (``--chunk-size``, default 256 KiB, an 8-byte index/count header included), every piece
  built first and then published, QoS 1, as the agent's transport does; timed from the first
  ``publish`` to the receiver's ``on_message`` of the last piece. Below the chunk size it is
  one message, like ``raw``;
* ``ours``: the daemon's full path - ``RuntimeContext.broadcast`` (encode, chunk,
  publish) on node A to ``RuntimeContext.receive`` on node B (reassemble, decode,
  validate), unsigned;
* ``signed``: the same with Ed25519-signed envelopes verified by B's ``SecurityGuard``;
* ``floor``: the least work any integrity-checked envelope must do, on the raw paho
  clients: the sender hashes the payload with the wire format's digest
  (``wire.payload_digest`` where it exists, else SHA-256), puts a fixed header (hex
  digest + 8-byte length) in front of it (one join) and publishes; the receiver's
  ``on_message`` (paho's network thread) recomputes the digest and compares it;
* ``floor_signed``: the same, the header signed with Ed25519 by the sender and the
  signature verified by the receiver before it reports;
* ``floor_loop``: like ``floor``, but the receiver hands the checked message to an
  asyncio event loop (``call_soon_threadsafe``) and reports once a coroutine awaiting
  an ``asyncio.Future`` has woken - the handover any asyncio agent pays.

``--paths`` picks the paths (both raw paho paths are always measured: the ratios need them).

Every repeat runs ``--n`` messages of each path and size, interleaved, and keeps the
median; the ratio of a repeat is its median over a raw paho path's median of that
repeat (``raw``: ``<path>_ratio``; ``raw_chunked``: ``<path>_ratio_chunked``), and the
reported ratio is the worst (largest) of the repeats.  ``--stages`` adds a per-stage
CPU profile (no network) of encode and decode.  The record keeps the command exactly
as it was run (the interpreter, the arguments, and ``nice -n N`` only when the process
ran niced).

Usage (repository root)::

    nice -n 10 python bench/scale/transport.py --label after --stages --out bench/scale/transport.jsonl
    nice -n 10 python bench/scale/transport.py --sizes 55000 --paths raw floor floor_signed floor_loop
    python bench/scale/transport.py --report bench/scale/transport.jsonl > bench/scale/transport.md
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SIZES = (55_000, 1 << 20, 10 << 20)
FED = "bench"
PATHS = ("raw", "raw_chunked", "ours", "signed", "floor", "floor_signed", "floor_loop")
FLOOR = ("floor", "floor_signed", "floor_loop")
#: the baselines every run measures (the ratios need them)
BASELINES = ("raw", "raw_chunked")
#: the agent's default ``mqtt.chunk_size``: largest MQTT payload it sends
CHUNK_SIZE = 256 * 1024
PIECE_HEADER = 8  # raw_chunked: 4-byte piece index, 4-byte piece count (big-endian)


def invocation(argv: list[str] | None = None, executable: str | None = None) -> str:
    """The command line of this process as it was run: ``nice -n N`` when it runs niced
    (``os.nice(0)``), the interpreter (relative to the working directory when inside it)
    and ``argv`` (default ``sys.argv``), shell-quoted."""
    exe = executable or sys.executable or "python"
    try:
        rel = os.path.relpath(exe)
        exe = rel if not rel.startswith("..") else exe
    except ValueError:
        pass
    niceness = os.nice(0)
    return ((f"nice -n {niceness} " if niceness > 0 else "")
            + shlex.join([exe, *(sys.argv if argv is None else argv)]))


def pieces(payload: bytes, chunk_size: int = CHUNK_SIZE) -> list[bytes]:
    """``payload`` split as raw paho's chunked baseline sends it: pieces of at most
    ``chunk_size`` bytes, each an 8-byte header (index, count) and the next bytes."""
    step = chunk_size - PIECE_HEADER
    count = max(1, -(-len(payload) // step))
    view = memoryview(payload)
    return [i.to_bytes(4, "big") + count.to_bytes(4, "big") + view[i * step:(i + 1) * step]
            for i in range(count)]


class PieceCounter:
    """Receiving end of ``raw_chunked``: counts the pieces of one payload (one in flight)
    and calls ``report("raw_chunked")`` on the last one (on paho's network thread)."""

    def __init__(self, report: Callable[[str], None]):
        self.report = report
        self.got = 0
        self.nbytes = 0

    def on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        payload = msg.payload
        count = int.from_bytes(payload[4:8], "big")
        self.got += 1
        self.nbytes += len(payload) - PIECE_HEADER
        if self.got >= count:
            self.got = 0
            self.report("raw_chunked")

    def take_bytes(self) -> int:
        """Payload bytes received since the last call."""
        n, self.nbytes = self.nbytes, 0
        return n


def model_of(nbytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 tensors of about ``nbytes`` in all, shaped like a small CNN (8 tensors)."""
    n = max(8, nbytes // 4)
    rng = np.random.default_rng(seed)
    parts = [int(n * f) for f in (0.55, 0.3, 0.08, 0.04, 0.01, 0.01, 0.005)]
    parts.append(n - sum(parts))
    return {f"layer{i}.{'weight' if i % 2 == 0 else 'bias'}": rng.standard_normal(p).astype(np.float32)
            for i, p in enumerate(parts)}


def _keys() -> tuple[bytes, bytes]:
    """Two fresh Ed25519 private keys (raw bytes), for nodes a and b."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    raw = (serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    return tuple(Ed25519PrivateKey.generate().private_bytes(*raw) for _ in range(2))  # type: ignore[return-value]


def _guards(keys: tuple[bytes, bytes] | None = None, fed: str = FED) -> tuple[Any, Any]:
    """Security guards of nodes a and b of federation ``fed`` (signatures required)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dfl_agent.security import SecurityGuard, TrustStore
    from dfl_agent.security.keys import public_key_b64

    ka, kb = (Ed25519PrivateKey.from_private_bytes(k) for k in (keys or _keys()))
    trust = {"a": public_key_b64(ka), "b": public_key_b64(kb)}
    return (SecurityGuard("a", ka, TrustStore(fed, trust), require_signatures=True),
            SecurityGuard("b", kb, TrustStore(fed, trust), require_signatures=True))


# ---------------------------------------------------------------- raw paho


class RawPaho:
    """Two paho clients on one broker: ``once(payload)`` returns publish->receipt seconds.
    The subscriber subscribes to ``topics`` (QoS 1); ``bench/raw`` is the raw path's."""

    def __init__(self, host: str, port: int, topics: tuple[str, ...] = ("bench/raw",),
                 chunk_size: int = CHUNK_SIZE):
        import paho.mqtt.client as mqtt

        self.got = threading.Event()
        self.t_recv = 0.0
        self.n_recv = 0
        self.topic = "bench/raw"
        self.chunk_size = chunk_size
        topics = tuple(dict.fromkeys((*topics, "bench/raw_chunked")))
        self.sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-sub", protocol=mqtt.MQTTv5)
        self.pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-pub", protocol=mqtt.MQTTv5)
        subscribed = threading.Event()
        self.sub.on_subscribe = lambda *a: subscribed.set()
        self.sub.on_connect = lambda c, *a: c.subscribe([(t, 1) for t in topics])

        def on_message(client: Any, userdata: Any, msg: Any) -> None:
            self.n_recv = len(msg.payload)
            self.t_recv = time.perf_counter()
            self.got.set()

        def on_chunked(path: str) -> None:
            self.n_recv = self.counter.take_bytes()
            self.t_recv = time.perf_counter()
            self.got.set()

        self.sub.on_message = on_message
        self.counter = PieceCounter(on_chunked)
        self.sub.message_callback_add("bench/raw_chunked", self.counter.on_message)
        for c in (self.sub, self.pub):
            c.connect(host, port)
            c.loop_start()
        if not subscribed.wait(10):
            raise RuntimeError("raw paho subscriber did not subscribe")

    def once(self, payload: bytes) -> float:
        self.got.clear()
        t0 = time.perf_counter()
        self.pub.publish(self.topic, payload, qos=1)
        if not self.got.wait(60) or self.n_recv != len(payload):
            raise RuntimeError("raw paho: message lost")
        return self.t_recv - t0

    def once_chunked(self, payload: bytes) -> float:
        """Publish->receipt seconds of ``payload`` sent in pieces (``raw_chunked``)."""
        self.got.clear()
        t0 = time.perf_counter()
        for piece in pieces(payload, self.chunk_size):
            self.pub.publish("bench/raw_chunked", piece, qos=1)
        if not self.got.wait(60) or self.n_recv != len(payload):
            raise RuntimeError("raw paho, chunked: message lost")
        return self.t_recv - t0

    def close(self) -> None:
        for c in (self.sub, self.pub):
            c.disconnect()
            c.loop_stop()



# ------------------------------------------------------------------ floor


def _digest_fn() -> tuple[Callable[[Any], str], str]:
    """The wire format's payload digest (hex str) and its name: ``wire.payload_digest``
    where the wire module has it, else SHA-256 (the wire hash before it)."""
    from dfl_agent.transport import wire

    fn = getattr(wire, "payload_digest", None)
    if fn is not None:
        return fn, "wire.payload_digest"
    return (lambda buf: hashlib.sha256(buf).hexdigest()), "sha256"


class FloorSender:
    """Builds the floor paths' frames: ``hex digest | 8-byte big-endian payload length``
    (the header), then for ``floor_signed`` the header's 64-byte Ed25519 signature, then
    the payload, in one join. ``key``: the sender's raw Ed25519 private key."""

    def __init__(self, key: bytes):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self.key = Ed25519PrivateKey.from_private_bytes(key)
        self.digest, self.digest_name = _digest_fn()

    def frame(self, path: str, payload: bytes) -> bytes:
        head = self.digest(payload).encode() + len(payload).to_bytes(8, "big")
        if path == "floor_signed":
            return b"".join((head, self.key.sign(head), payload))
        return b"".join((head, payload))


class FloorReceiver:
    """Receiving end of the floor paths on a raw paho ``client`` (topics ``bench/<path>``).

    Every message is checked on paho's network thread (length, digest recomputed over a
    memoryview of the payload, and for ``floor_signed`` the header's signature by
    ``key``, the sender's raw Ed25519 private key, whose public half verifies), then
    ``report(path)`` is called there - except ``floor_loop``, whose checked payload is
    handed to ``loop`` with ``call_soon_threadsafe`` and resolves ``fut`` (both set by
    the user: :meth:`listen` or the one-process runner). A message that fails a check is
    dropped and counted in ``rejected``."""

    def __init__(self, client: Any, key: bytes, report: Callable[[str], None]):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self.pub = Ed25519PrivateKey.from_private_bytes(key).public_key()
        self.digest, self.digest_name = _digest_fn()
        self.dlen = len(self.digest(b""))
        self.report = report
        self.rejected = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fut: asyncio.Future[memoryview] | None = None
        for path in FLOOR:
            client.message_callback_add(f"bench/{path}", self._handler(path))

    def check(self, payload: bytes, signed: bool) -> memoryview | None:
        """The payload of a floor frame when every check passes, else None."""
        from cryptography.exceptions import InvalidSignature

        view = memoryview(payload)
        hl = self.dlen + 8
        body = view[hl + 64:] if signed else view[hl:]
        if len(view) < hl or int.from_bytes(view[self.dlen:hl], "big") != len(body):
            return None
        if self.digest(body).encode() != view[:self.dlen]:
            return None
        if signed:
            try:
                self.pub.verify(bytes(view[hl:hl + 64]), bytes(view[:hl]))
            except InvalidSignature:
                return None
        return body

    def _wake(self, body: memoryview) -> None:
        fut = self.fut
        if fut is not None and not fut.done():
            fut.set_result(body)

    def _handler(self, path: str) -> Callable[[Any, Any, Any], None]:
        signed = path == "floor_signed"

        def on_message(client: Any, userdata: Any, msg: Any) -> None:
            body = self.check(msg.payload, signed)
            if body is None:
                self.rejected += 1
            elif path == "floor_loop":
                assert self.loop is not None
                self.loop.call_soon_threadsafe(self._wake, body)
            else:
                self.report(path)

        return on_message

    async def listen(self) -> None:
        """Report ``floor_loop`` each time a handed-over message wakes this coroutine
        (runs until cancelled; the next future exists before the report goes out)."""
        self.loop = asyncio.get_running_loop()
        self.fut = self.loop.create_future()
        while True:
            await self.fut
            self.fut = self.loop.create_future()
            self.report("floor_loop")


class FloorOne:
    """The floor paths with both ends in this process, on ``raw``'s two paho clients
    (its subscriber must subscribe to the ``bench/floor*`` topics); node a's key signs."""

    def __init__(self, raw: RawPaho, keys: tuple[bytes, bytes]):
        self.raw = raw
        self.got = threading.Event()
        self.t_recv = 0.0
        self.tx = FloorSender(keys[0])
        self.rx = FloorReceiver(raw.sub, keys[0], self._report)

    def _report(self, path: str) -> None:
        self.t_recv = time.perf_counter()
        self.got.set()

    async def once(self, path: str, payload: bytes) -> float:
        """Publish->receipt seconds of one message on floor path ``path``."""
        if path == "floor_loop":
            loop = asyncio.get_running_loop()
            self.rx.loop = loop
            fut = self.rx.fut = loop.create_future()
            timer = loop.call_later(60, fut.cancel)
            t0 = time.perf_counter()
            self.raw.pub.publish("bench/floor_loop", self.tx.frame(path, payload), qos=1)
            try:
                await fut
            except asyncio.CancelledError:
                raise RuntimeError(f"floor_loop: message lost ({self.rx.rejected} rejected)") from None
            t1 = time.perf_counter()
            timer.cancel()
            return t1 - t0
        self.got.clear()
        t0 = time.perf_counter()
        self.raw.pub.publish(f"bench/{path}", self.tx.frame(path, payload), qos=1)
        if not self.got.wait(60):
            raise RuntimeError(f"{path}: message lost ({self.rx.rejected} rejected)")
        return self.t_recv - t0


# ------------------------------------------------------------------- ours


class Ours:
    """Nodes A and B, each a RuntimeContext over an MqttTransport (signed or not)."""

    def __init__(self, endpoint: str, signed: bool, nodes: tuple[str, ...] = ("a", "b"),
                 keys: tuple[bytes, bytes] | None = None):
        self.endpoint = endpoint
        self.signed = signed
        self.nodes = nodes
        self.keys = keys
        self.round = 0

    async def start(self) -> None:
        from dfl_agent.discovery.peers import PeerTable
        from dfl_agent.discovery.presence import node_transport
        from dfl_agent.runtime.context import RuntimeContext

        fed = FED + ("-s" if self.signed else "")
        # the trust store's federation is the transport's: signed presence is verified too
        ga, gb = _guards(self.keys, fed) if self.signed else (None, None)
        self.ctx = {}
        for node, guard in (("a", ga), ("b", gb)):
            if node not in self.nodes:
                continue
            peers = PeerTable(node, fed)
            transport = node_transport(node, fed, broker=self.endpoint, peers=peers, descriptor={},
                                       control=guard)
            ctx = RuntimeContext(node_id=node, federation=fed, transport=transport, peers=peers, data=None,
                                 model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0),
                                 security=guard)
            await ctx.start()
            self.ctx[node] = ctx

    async def once(self, tensors: dict[str, np.ndarray]) -> float:
        from dfl_agent.algorithms.context import Message

        self.round += 1
        msg = Message("model", self.round, dict(tensors), meta={"samples": 100})
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        await self.ctx["a"].broadcast(msg)
        got = await self.ctx["b"].receive("model", round=self.round, deadline=loop.time() + 60)
        t1 = time.perf_counter()
        if got is None:
            raise RuntimeError(f"ours (signed={self.signed}): message lost; dropped {dict(self.ctx['b'].rejected)}")
        return t1 - t0

    async def send(self, tensors: dict[str, np.ndarray]) -> int:
        """Broadcast one model from node a; returns its round number."""
        from dfl_agent.algorithms.context import Message

        self.round += 1
        await self.ctx["a"].broadcast(Message("model", self.round, dict(tensors), meta={"samples": 100}))
        return self.round

    async def stop(self) -> None:
        for ctx in self.ctx.values():
            await ctx.stop()


def _receiver(endpoint: str, keys: tuple[bytes, bytes], conn: Any, paths: tuple[str, ...] = PATHS) -> None:
    """Child process: node b of the federations of ``ours``/``signed`` and a raw paho
    subscriber (``raw`` and the floor paths), for those of ``paths`` selected; every
    complete receipt is reported as ``(path, perf_counter)`` on ``conn``."""
    import logging

    import paho.mqtt.client as mqtt

    logging.basicConfig(level=logging.ERROR)
    host, port = endpoint.rsplit(":", 1)
    lock = threading.Lock()

    def report(path: str) -> None:
        t = time.perf_counter()
        with lock:
            conn.send((path, t))

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-sub", protocol=mqtt.MQTTv5)
    subscribed = threading.Event()
    sub.on_subscribe = lambda *a: subscribed.set()
    topics = [("bench/raw", 1), ("bench/raw_chunked", 1)] + [(f"bench/{p}", 1) for p in FLOOR if p in paths]
    sub.on_connect = lambda c, *a: c.subscribe(topics)
    sub.on_message = lambda c, u, msg: report("raw")
    sub.message_callback_add("bench/raw_chunked", PieceCounter(report).on_message)
    floor = FloorReceiver(sub, keys[0], report)
    sub.connect(host, int(port))
    sub.loop_start()

    async def main() -> None:
        nodes = {p: Ours(endpoint, p == "signed", ("b",), keys) for p in ("ours", "signed") if p in paths}
        for o in nodes.values():
            await o.start()

        async def listen(path: str, o: Ours) -> None:
            while True:
                got = await o.ctx["b"].receive("model", deadline=asyncio.get_running_loop().time() + 3600)
                if got is not None:
                    report(path)

        tasks = [asyncio.create_task(listen(p, o)) for p, o in nodes.items()]
        if "floor_loop" in paths:
            tasks.append(asyncio.create_task(floor.listen()))
        subscribed.wait(10)
        conn.send(("ready", 0.0))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
        for t in tasks:
            t.cancel()
        for o in nodes.values():
            await o.stop()

    asyncio.run(main())
    sub.disconnect()
    sub.loop_stop()


class TwoProcesses:
    """Sender here (raw paho publisher, node a of both federations), receiver in a child."""

    def __init__(self, endpoint: str, paths: tuple[str, ...] = PATHS, chunk_size: int = CHUNK_SIZE):
        import multiprocessing as mp

        self.endpoint = endpoint
        self.paths = paths
        self.chunk_size = chunk_size
        self.keys = _keys()
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_receiver, args=(endpoint, self.keys, child, paths),
                                                    daemon=True)

    async def start(self) -> None:
        import paho.mqtt.client as mqtt

        self.proc.start()
        host, port = self.endpoint.rsplit(":", 1)
        self.pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-pub", protocol=mqtt.MQTTv5)
        self.pub.connect(host, int(port))
        self.pub.loop_start()
        self.floor = FloorSender(self.keys[0])
        self.ours: dict[str, Ours] = {p: Ours(self.endpoint, p == "signed", ("a",), self.keys)
                     for p in ("ours", "signed") if p in self.paths}
        for o in self.ours.values():
            await o.start()
        if not self.conn.poll(60) or self.conn.recv()[0] != "ready":
            raise RuntimeError("receiver process did not start")
        await asyncio.sleep(1.0)  # subscriptions of the receiver's nodes settle

    def _wait(self, path: str) -> float:
        if not self.conn.poll(60):
            raise RuntimeError(f"{path}: message lost")
        got, t = self.conn.recv()
        if got != path:
            raise RuntimeError(f"expected a receipt on {path}, got {got}")
        return float(t)

    async def once(self, path: str, tensors: dict[str, np.ndarray], payload: bytes) -> float:
        t0 = time.perf_counter()
        if path == "raw":
            self.pub.publish("bench/raw", payload, qos=1)
        elif path == "raw_chunked":
            for piece in pieces(payload, self.chunk_size):  # all built, then published
                self.pub.publish("bench/raw_chunked", piece, qos=1)
        elif path in FLOOR:
            self.pub.publish(f"bench/{path}", self.floor.frame(path, payload), qos=1)
        else:
            await self.ours[path].send(tensors)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._wait, path) - t0

    async def stop(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)
        self.pub.disconnect()
        self.pub.loop_stop()
        for o in self.ours.values():
            await o.stop()


# ----------------------------------------------------------------- stages


def _time(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def stages(size: int, reps: int) -> dict[str, float]:
    """Per-stage CPU time (median seconds, no network) of one message of ``size`` bytes."""
    import zstandard
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save as st_save

    from dfl_agent.algorithms.context import Message
    from dfl_agent.transport import chunking, wire

    tensors = model_of(size)
    ga, gb = _guards()
    raw = b"".join(a.tobytes() for a in tensors.values())
    st = st_save(tensors)
    header = {"v": 1, "fed": FED, "sender": "a", "recipient": "*", "kind": "model", "round": 1,
              "msg_id": "0" * 32, "time": time.time(), "payload_blake3": "0" * 64, "payload_len": len(st),
              "encoding": {"format": "safetensors",
                           "tensors": {k: {"dtype": "float32", "shape": list(a.shape)} for k, a in tensors.items()}},
              "meta": {"samples": 100}}
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hz = zstandard.ZstdCompressor(level=3).compress(hjson)
    canon = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    sig = ga.key.sign(canon)
    pub = ga.key.public_key()
    out: dict[str, float] = {
        "safetensors_save": _time(lambda: st_save(tensors), reps),
        "safetensors_load": _time(lambda: st_load(st), reps),
        "tobytes_concat": _time(lambda: b"".join(a.tobytes() for a in tensors.values()), reps),
        "sha256": _time(lambda: hashlib.sha256(raw).digest(), reps),
        "blake3": _time(lambda: wire.payload_digest(raw), reps),
        "json_dumps_header": _time(lambda: json.dumps(header, separators=(",", ":")), reps),
        "json_loads_header": _time(lambda: json.loads(hjson), reps),
        "zstd_header": _time(lambda: zstandard.ZstdCompressor(level=3).compress(hjson), reps),
        "unzstd_header": _time(lambda: zstandard.ZstdDecompressor().decompress(hz), reps),
        "ed25519_sign": _time(lambda: ga.key.sign(canon), reps),
        "ed25519_verify": _time(lambda: pub.verify(sig, canon), reps),
        "header_bytes": len(hjson),
        "header_zstd_bytes": len(hz),
    }

    def enc(sign: bool) -> bytes:
        m = Message("model", 1, dict(tensors), meta={"samples": 100})
        return wire.encode(m, federation=FED, sender="a", **({"sign": ga.sign} if sign else {}))

    frame = enc(False)
    sframe = enc(True)
    chunks = chunking.split(frame, 256 * 1024)

    def reasm() -> Any:
        # as the MQTT transport does it: the payload is hashed while the chunks arrive
        r = chunking.Reassembler(hash_from=wire.payload_offset)
        out = None
        for c in chunks:
            out = r.feed(c) or out
        return out

    out["wire_encode"] = _time(lambda: enc(False), reps)
    out["wire_encode_signed"] = _time(lambda: enc(True), reps)
    out["chunk_split"] = _time(lambda: chunking.split(frame, 256 * 1024), reps)
    out["reassemble"] = _time(reasm, reps)
    out["wire_decode"] = _time(lambda: wire.decode(frame, federation=FED), reps)
    reassembled = reasm()
    # a chunked frame: the hash was taken during reassembly (a one-message frame is hashed here)
    out["wire_decode_reassembled"] = _time(lambda: wire.decode(reassembled, federation=FED), reps)

    def check() -> None:
        gb._seen.clear()
        gb._rounds.clear()
        h = wire.raw_header(sframe)
        gb.check(h, signed_bytes=h.signed_bytes)

    out["guard_check"] = _time(check, reps)
    out["frame_bytes"] = len(frame)
    return out


# ------------------------------------------------------------------- main


def _summary(samples: list[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


async def run(sizes: list[int], n: int, repeats: int, processes: int = 2,
              paths: tuple[str, ...] = PATHS, chunk_size: int = CHUNK_SIZE) -> dict[str, Any]:
    """Measure ``paths`` (of :data:`PATHS`; both raw paho baselines are always added) at
    every size: per path its samples' min/median/max and each repeat's median (seconds),
    and per path but ``raw`` its ratios to raw paho in one message (``<path>_ratios``,
    the worst as ``<path>_ratio``), per path but the baselines its ratios to raw paho in
    pieces (``<path>_ratios_chunked``, ``<path>_ratio_chunked``), and its rate."""
    from dfl_agent.cli.broker import start_broker

    paths = BASELINES + tuple(p for p in PATHS if p in paths and p not in BASELINES)
    results: dict[str, Any] = {}
    with start_broker("mosquitto") as broker:
        if processes == 2:
            two = TwoProcesses(broker.endpoint, paths, chunk_size)
            await two.start()

            async def once(path: str, tensors: dict[str, np.ndarray], payload: bytes) -> float:
                return await two.once(path, tensors, payload)

            async def stop() -> None:
                await two.stop()
        else:
            host, port = broker.endpoint.rsplit(":", 1)
            raw = RawPaho(host, int(port), ("bench/raw",) + tuple(f"bench/{p}" for p in FLOOR if p in paths),
                          chunk_size)
            floor = FloorOne(raw, _keys())
            nodes: dict[str, Ours] = {p: Ours(broker.endpoint, p == "signed") for p in ("ours", "signed") if p in paths}
            for o in nodes.values():
                await o.start()
            await asyncio.sleep(0.5)

            async def once(path: str, tensors: dict[str, np.ndarray], payload: bytes) -> float:
                if path == "raw":
                    return raw.once(payload)
                if path == "raw_chunked":
                    return raw.once_chunked(payload)
                if path in FLOOR:
                    return await floor.once(path, payload)
                return await nodes[path].once(tensors)

            async def stop() -> None:
                raw.close()
                for o in nodes.values():
                    await o.stop()
        try:
            for size in sizes:
                tensors = model_of(size)
                payload = b"".join(a.tobytes() for a in tensors.values())
                per: dict[str, Any] = {m: {"samples": [], "medians": []} for m in paths}
                for _ in range(2):  # warm-up
                    for m in paths:
                        await once(m, tensors, payload)
                for _ in range(repeats):
                    rep: dict[str, list[float]] = {m: [] for m in paths}
                    for _ in range(n):  # interleaved, so load changes hit all paths alike
                        for m in paths:
                            rep[m].append(await once(m, tensors, payload))
                    for m, smp in rep.items():
                        per[m]["samples"] += smp
                        per[m]["medians"].append(statistics.median(smp))
                row: dict[str, Any] = {"payload_bytes": len(payload)}
                for m in per:
                    row[m] = {**_summary(per[m]["samples"]), "medians": per[m]["medians"]}
                for m in paths[1:]:
                    for base, suffix in (("raw", ""), ("raw_chunked", "_chunked")):
                        if m in BASELINES and suffix:
                            continue
                        ratios = [a / b for a, b in zip(per[m]["medians"], per[base]["medians"], strict=True)]
                        row[f"{m}_ratio{suffix}"] = max(ratios)
                        row[f"{m}_ratios{suffix}"] = ratios
                    row[f"{m}_MBps"] = len(payload) / max(per[m]["medians"]) / 1e6
                results[str(size)] = row
                print(json.dumps({"size": size, **{f"{m}_ratio": round(row[f"{m}_ratio"], 3) for m in paths[1:]},
                                  **{f"{m}_ratio_chunked": round(row[f"{m}_ratio_chunked"], 3)
                                     for m in paths[2:]},
                                  **{f"{m}_median_ms": round(1e3 * row[m]["median"], 4) for m in paths}}),
                      flush=True)
        finally:
            await stop()
    return results


def report(path: Path) -> str:
    """Markdown tables of every run in the JSON-lines file ``path``."""
    lines = ["# Transport: publish to full receipt, one loopback mosquitto, QoS 1", ""]
    for line in path.read_text().splitlines():
        r = json.loads(line)
        procs = r.get("processes", 1)
        lines += [f"## {r['label']} ({r['time']}, wire v{r['wire_version']}, n={r['n']} x {r['repeats']} repeats, "
                  f"{'sender and receiver in two processes' if procs == 2 else 'both ends in one process'})",
                  "", f"Command: `{r['command']}`", ""]
        if r.get("floor_digest") and any(p in row for row in r["results"].values() for p in FLOOR):
            lines += [f"Floor paths' payload digest: {r['floor_digest']}.", ""]
        chunked = any("raw_chunked" in row for row in r["results"].values())
        if chunked:
            lines += [f"`raw_chunked`: the same bytes as `raw` in pieces of at most {r.get('chunk_size', CHUNK_SIZE)} "
                      "bytes, as the agent sends them; ratios to it in the last column.", ""]
        lines += ["| message | path | min ms | median ms | max ms | ratio to raw paho (worst repeat) | rate MB/s |"
                  + (" ratio to chunked raw paho (worst repeat) |" if chunked else ""),
                  "|---|---|---|---|---|---|---|" + ("---|" if chunked else "")]
        for size, row in r["results"].items():
            label = {"55000": "55 kB", str(1 << 20): "1 MiB", str(10 << 20): "10 MiB"}.get(size, f"{size} B")
            for m in PATHS:
                if m not in row:  # runs before the floor paths, or --paths left it out
                    continue
                s = row[m]
                ratio = f"{row[m + '_ratio']:.2f}x" if m != "raw" else "1"
                rate = f"{row[m + '_MBps']:.0f}" if m != "raw" else f"{row['payload_bytes'] / max(s['medians']) / 1e6:.0f}"
                cells = (f"| {label} | {m} | {1e3 * s['min']:.2f} | {1e3 * s['median']:.2f} | "
                         f"{1e3 * s['max']:.2f} | {ratio} | {rate} |")
                if chunked:
                    rc = row.get(m + "_ratio_chunked")
                    cells += " 1 |" if m == "raw_chunked" else " |" if rc is None else f" {rc:.2f}x |"
                lines.append(cells)
        if r.get("stages"):
            lines += ["", "Per-stage CPU time (median, microseconds, no network):", "",
                      "| stage | " + " | ".join(r["stages"]) + " |", "|---|" + "---|" * len(r["stages"])]
            keys = list(next(iter(r["stages"].values())))
            for k in keys:
                vals = []
                for s in r["stages"].values():
                    v = s.get(k)
                    vals.append("" if v is None else (f"{v}" if k.endswith("bytes") else f"{1e6 * v:.0f}"))
                lines.append(f"| {k} | " + " | ".join(vals) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="message sizes in bytes")
    p.add_argument("--n", type=int, default=20, help="messages per path, size and repeat")
    p.add_argument("--repeats", type=int, default=3, help="repeats (the worst median is reported)")
    p.add_argument("--label", default="run", help="name of this run in the results file")
    p.add_argument("--out", default=None, help="append the results as one JSON line to this file")
    p.add_argument("--processes", type=int, choices=(1, 2), default=2,
                   help="2: sender and receiver in two processes (as two agents); 1: both in this one")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), metavar="PATH",
                   help="paths to measure (default: all): " + ", ".join(PATHS) + "; raw and raw_chunked "
                   "(raw paho in one message; in pieces of --chunk-size) are always measured, as the ratios "
                   "need them. floor, floor_signed, floor_loop: the least work of an "
                   "integrity-checked (signed; handed to an asyncio loop) envelope on raw paho")
    p.add_argument("--chunk-size", type=int, default=CHUNK_SIZE,
                   help="largest MQTT payload of raw_chunked, header included (default: the agent's "
                   "mqtt.chunk_size, %(default)s)")
    p.add_argument("--stages", action="store_true", help="also profile encode/decode per stage (no network)")
    p.add_argument("--report", default=None, help="print the Markdown report of a results file and exit")
    a = p.parse_args(argv)
    if a.report:
        print(report(Path(a.report)))
        return 0
    import logging

    import dfl_agent
    from dfl_agent.transport import wire

    logging.basicConfig(level=logging.ERROR)
    paths = BASELINES + tuple(p for p in PATHS if p in a.paths and p not in BASELINES)
    res = asyncio.run(run(a.sizes, a.n, a.repeats, a.processes, paths, a.chunk_size))
    record: dict[str, Any] = {
        "label": a.label, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wire_version": getattr(dfl_agent, "WIRE_VERSION", None), "frame_version": wire.WIRE_VERSION,
        "n": a.n, "repeats": a.repeats, "processes": a.processes, "paths": list(paths),
        "floor_digest": _digest_fn()[1],
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "chunk_size": a.chunk_size, "command": invocation(), "results": res,
    }
    if a.stages:
        record["stages"] = {str(s): stages(s, 30 if s < (1 << 20) else 7) for s in a.sizes}
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "results"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
