"""Transport benchmark: the agents' path against raw paho carrying the same bytes, message by message.

One loopback mosquitto, QoS 1, MQTT 5, one message in flight. The sender and the receiver are
two processes, as two agents are; the receiver stamps each complete receipt with
``time.perf_counter`` (the system-wide monotonic clock, comparable between the two processes)
and reports it over a pipe, after the stamp. A message's time is publish (or ``broadcast``) to
that stamp.

Paths:

* ``raw``, the baseline: raw paho publishes the payload (the tensors' bytes) in pieces of at
  most the agent's chunk size (``--chunk-size``, default 256 KiB), each the documented 36-byte
  chunk header (``b"DFC"``, version, 16-byte transfer id, index, count, total length;
  ``docs/reference/wire-format.md``) and the next bytes, all built first and then published.
  Its subscriber, on paho's network thread, copies every piece into one buffer of the declared
  length and stamps the receipt when the last piece is in. This code is the benchmark's own:
  it shares nothing with the agent's.
* ``signed``: the agents' full path in the production configuration: ``RuntimeContext.broadcast``
  on node a (frame the tensors with the wire format, BLAKE3 payload hash, Ed25519 signature,
  chunk, publish) to ``RuntimeContext.receive`` on node b (reassemble, hash check, decode,
  signature, trust and replay checks, duplicate check, queue, the waiting coroutine wakes),
  without compression: the same bytes as ``raw``, so the agents' framing, hashing, signing and
  checks are the difference.
* ``unsigned``: the same without signatures (for the share of the signature).
* ``compressed``: ``signed`` with the tensors compressed (``--codec``, default ``q8+zstd``)
  on node a and decompressed on node b; its ratio is still to ``raw`` carrying the
  uncompressed tensors, so the codec's work is in it and fewer bytes travel.
* ``floor_signed``: the least work any signed design does, on raw paho: the sender hashes the
  payload (BLAKE3, the wire format's hash), signs the 64 hex digits with Ed25519
  (as the agents sign: libsodium where PyNaCl is installed) and sends digest, signature and payload in ``raw``'s
  chunks; the receiver reassembles them as ``raw`` does, hashes the payload, compares and
  verifies the signature on paho's network thread, and stamps the receipt there.
* ``floor_signed_loop``: ``floor_signed``, then the checked message is handed to the
  receiver's asyncio event loop (``call_soon_threadsafe``) and the receipt is stamped by the
  coroutine it wakes - the handover of any asyncio agent whose MQTT client has its own
  network thread.

Every message of every path is paired with the ``raw`` message sent next to it: per size,
``--n`` rounds each send one message of every path, in an order that rotates from round to
round (so no path always follows another), after ``--warmup`` rounds that are not kept. A
message's ratio is its time over its round's ``raw`` time; a path's ratio is reported as the
median, minimum and maximum of those ratios. Load from other processes then hits a message
and its baseline alike.

The record keeps the command exactly as it was run (the interpreter, the arguments, ``nice -n
N`` only when the process ran niced), the commit (``+dirty`` when the tree had changes), the
machine, the load average before and after, and the library versions. ``--stages`` adds a
per-stage CPU profile (no network) of one message's encoding and checks.

Usage (repository root)::

    nice -n 10 .venv/bin/python bench/scale/transport.py --label LABEL --stages --out bench/scale/transport.jsonl
    python bench/scale/transport.py --report bench/scale/transport.jsonl > bench/scale/transport.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SIZES = (55_000, 1 << 20, 10 << 20)
FED = "bench"
PATHS = ("raw", "signed", "unsigned", "compressed", "floor_signed", "floor_signed_loop")
FLOOR = ("floor_signed", "floor_signed_loop")
#: the agent's default ``mqtt.chunk_size``: largest MQTT payload it sends
CHUNK_SIZE = 256 * 1024
#: the documented chunk header: magic, version, transfer id, index, count, total length
CHUNK_HEADER = struct.Struct(">3sB16sIIQ")
PIECE_HEADER = CHUNK_HEADER.size  # 36
RAW_TOPIC = "bench/raw"
ROOT = Path(__file__).resolve().parents[2]


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


def pieces(payload: bytes, chunk_size: int = CHUNK_SIZE, transfer_id: bytes | None = None) -> list[bytes]:
    """``payload`` as the raw baseline sends it: pieces of at most ``chunk_size`` bytes, each
    the 36-byte chunk header of the wire format and the next bytes (one piece when it fits)."""
    step = chunk_size - PIECE_HEADER
    count = max(1, -(-len(payload) // step))
    tid = transfer_id if transfer_id is not None else os.urandom(16)
    view = memoryview(payload)
    return [b"".join((CHUNK_HEADER.pack(b"DFC", 2, tid, i, count, len(payload)), view[i * step:(i + 1) * step]))
            for i in range(count)]


class RawAssembler:
    """The receiving end of ``raw``: copies every piece into one buffer of the declared total
    (one transfer in flight) and calls ``report(buffer)`` when the last piece is in (on paho's
    network thread). ``chunk_size`` must be the sender's."""

    def __init__(self, report: Callable[[bytearray], None], chunk_size: int = CHUNK_SIZE):
        self.report = report
        self.step = chunk_size - PIECE_HEADER
        self.tid = b""
        self.buf = bytearray()
        self.got = 0

    def on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        payload = msg.payload
        _, _, tid, index, count, total = CHUNK_HEADER.unpack_from(payload)
        if tid != self.tid:
            self.tid, self.buf, self.got = tid, bytearray(total), 0
        start = index * self.step
        self.buf[start:start + len(payload) - PIECE_HEADER] = memoryview(payload)[PIECE_HEADER:]
        self.got += 1
        if self.got == count:
            self.report(self.buf)


class FloorSigner:
    """The sending end of the floor paths: ``frame(payload)`` is the payload's BLAKE3 digest
    (64 hex digits), their Ed25519 signature (64 bytes) and the payload, joined. The signature
    is made as the agents make theirs (:func:`dfl_agent.security.keys.signer`: libsodium where
    PyNaCl is installed)."""

    def __init__(self, key: bytes):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from dfl_agent.security.keys import signer

        self.sign = signer(Ed25519PrivateKey.from_private_bytes(key))

    def frame(self, payload: bytes) -> bytes:
        import blake3

        digest = blake3.blake3(payload).hexdigest().encode()
        return b"".join((digest, self.sign(digest), payload))


class FloorChecker:
    """The receiving end of the floor paths (``key``: the sender's raw private key, whose
    public half verifies, as the agents verify: :func:`dfl_agent.security.keys.verifier`):
    :meth:`check` is True when the reassembled frame's payload hash matches its digest and
    the digest's signature verifies."""

    def __init__(self, key: bytes):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from dfl_agent.security.keys import verifier

        self.verify = verifier(Ed25519PrivateKey.from_private_bytes(key).public_key())

    def check(self, frame: bytearray) -> bool:
        import blake3
        from cryptography.exceptions import InvalidSignature

        view = memoryview(frame)
        digest = bytes(view[:64])
        if len(frame) < 128 or blake3.blake3(view[128:]).hexdigest().encode() != digest:
            return False
        try:
            self.verify(bytes(view[64:128]), digest)
        except InvalidSignature:
            return False
        return True


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


def _guards(keys: tuple[bytes, bytes], fed: str = FED) -> tuple[Any, Any]:
    """Security guards of nodes a and b of federation ``fed`` (signatures required)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dfl_agent.security import SecurityGuard, TrustStore
    from dfl_agent.security.keys import public_key_b64

    ka, kb = (Ed25519PrivateKey.from_private_bytes(k) for k in keys)
    trust = {"a": public_key_b64(ka), "b": public_key_b64(kb)}
    return (SecurityGuard("a", ka, TrustStore(fed, trust), require_signatures=True),
            SecurityGuard("b", kb, TrustStore(fed, trust), require_signatures=True))


# ------------------------------------------------------------------- ours


class Ours:
    """Node ``node`` (a sends, b receives) of the federation of one agents' path: a
    RuntimeContext over an MqttTransport, signed or not, compressing with ``codec`` or not."""

    def __init__(self, endpoint: str, path: str, node: str, keys: tuple[bytes, bytes], codec: str):
        self.endpoint = endpoint
        self.path = path
        self.node = node
        self.keys = keys
        self.codec = codec
        self.fed = f"{FED}-{path}"
        self.round = 0

    async def start(self) -> None:
        from dfl_agent.discovery.peers import PeerTable
        from dfl_agent.discovery.presence import node_transport
        from dfl_agent.learning.compression import CompressionPolicy
        from dfl_agent.runtime.node.context import RuntimeContext

        guard = None
        if self.path != "unsigned":  # the trust store's federation is the transport's
            guard = _guards(self.keys, self.fed)[0 if self.node == "a" else 1]
        policy = CompressionPolicy.from_config(self.codec) if self.path == "compressed" else None
        peers = PeerTable(self.node, self.fed)
        transport = node_transport(self.node, self.fed, broker=self.endpoint, peers=peers, descriptor={},
                                   control=guard)
        self.ctx = RuntimeContext(node_id=self.node, federation=self.fed, transport=transport, peers=peers,
                                  data=None, model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0),
                                  security=guard, compression=policy)
        await self.ctx.start()

    async def send(self, tensors: dict[str, np.ndarray]) -> int:
        """Broadcast one model from node a; returns its round number."""
        from dfl_agent.algorithms.context import Message

        self.round += 1
        await self.ctx.broadcast(Message("model", self.round, dict(tensors), meta={"samples": 100}))
        return self.round

    async def listen(self, report: Callable[[str, int], None]) -> None:
        """Node b: report every message received (until cancelled)."""
        loop = asyncio.get_running_loop()
        while True:
            got = await self.ctx.receive("model", deadline=loop.time() + 3600)
            if got is not None:
                report(self.path, got.round)

    async def stop(self) -> None:
        await self.ctx.stop()


def _receiver(endpoint: str, keys: tuple[bytes, bytes], conn: Any, paths: tuple[str, ...], codec: str,
              chunk_size: int) -> None:
    """Child process: the raw paho subscriber and node b of every agents' path; each complete
    receipt is sent as ``(path, sequence number, perf_counter)`` on ``conn``."""
    import logging

    import paho.mqtt.client as mqtt

    logging.basicConfig(level=logging.ERROR)
    host, port = endpoint.rsplit(":", 1)
    lock = threading.Lock()

    def report(path: str, seq: int) -> None:
        t = time.perf_counter()
        with lock:
            conn.send((path, seq, t))

    def raw_done(buf: bytearray) -> None:
        t = time.perf_counter()
        with lock:
            conn.send(("raw", len(buf), t))

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-sub", protocol=mqtt.MQTTv5)
    subscribed = threading.Event()
    sub.on_subscribe = lambda *a: subscribed.set()
    sub.on_connect = lambda c, *a: c.subscribe([(RAW_TOPIC, 1)] + [(f"bench/{p}", 1) for p in FLOOR if p in paths])
    sub.on_message = RawAssembler(raw_done, chunk_size).on_message
    checker = FloorChecker(keys[0])
    loop_box: list[asyncio.AbstractEventLoop] = []
    waiter: list[asyncio.Future[int]] = []

    def wake(n: int) -> None:
        if waiter and not waiter[0].done():
            waiter[0].set_result(n)

    def floor_done(path: str) -> Callable[[bytearray], None]:
        def done(buf: bytearray) -> None:
            if not checker.check(buf):
                return  # not reported: the sender times out and says so
            if path == "floor_signed":
                t = time.perf_counter()
                with lock:
                    conn.send((path, len(buf), t))
            else:
                loop_box[0].call_soon_threadsafe(wake, len(buf))
        return done

    for fp in FLOOR:
        if fp in paths:
            sub.message_callback_add(f"bench/{fp}", RawAssembler(floor_done(fp), chunk_size).on_message)
    sub.connect(host, int(port))
    sub.loop_start()

    async def floor_loop() -> None:
        loop = asyncio.get_running_loop()
        while True:
            waiter[:] = [loop.create_future()]
            n = await waiter[0]
            report("floor_signed_loop", n)

    async def main() -> None:
        loop_box.append(asyncio.get_running_loop())
        nodes = [Ours(endpoint, p, "b", keys, codec) for p in paths if p != "raw" and p not in FLOOR]
        for o in nodes:
            await o.start()
        tasks = [asyncio.create_task(o.listen(report)) for o in nodes]
        if "floor_signed_loop" in paths:
            tasks.append(asyncio.create_task(floor_loop()))
        subscribed.wait(10)
        conn.send(("ready", 0, 0.0))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
        for t in tasks:
            t.cancel()
        for o in nodes:
            await o.stop()

    asyncio.run(main())
    sub.disconnect()
    sub.loop_stop()


class Sender:
    """The raw paho publisher and node a of every agents' path here, the receiver in a child."""

    def __init__(self, endpoint: str, paths: tuple[str, ...], codec: str, chunk_size: int = CHUNK_SIZE):
        import multiprocessing as mp

        self.endpoint = endpoint
        self.paths = paths
        self.codec = codec
        self.chunk_size = chunk_size
        self.keys = _keys()
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=_receiver, args=(endpoint, self.keys, child, paths, codec, chunk_size), daemon=True)

    async def start(self) -> None:
        import paho.mqtt.client as mqtt

        self.proc.start()
        host, port = self.endpoint.rsplit(":", 1)
        self.pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-pub", protocol=mqtt.MQTTv5)
        self.pub.connect(host, int(port))
        self.pub.loop_start()
        self.ours = {p: Ours(self.endpoint, p, "a", self.keys, self.codec) for p in self.paths
                     if p != "raw" and p not in FLOOR}
        self.signer = FloorSigner(self.keys[0])
        for o in self.ours.values():
            await o.start()
        if not self.conn.poll(60) or self.conn.recv()[0] != "ready":
            raise RuntimeError("receiver process did not start")
        await asyncio.sleep(1.0)  # the receiver's subscriptions settle

    async def once(self, path: str, tensors: dict[str, np.ndarray], payload: bytes) -> float:
        """Seconds from publish to the receiver's stamp of one message on ``path``."""
        t0 = time.perf_counter()
        if path == "raw":
            for piece in pieces(payload, self.chunk_size):  # all built, then published
                self.pub.publish(RAW_TOPIC, piece, qos=1)
            expect = len(payload)
        elif path in FLOOR:
            frame = self.signer.frame(payload)
            for piece in pieces(frame, self.chunk_size):
                self.pub.publish(f"bench/{path}", piece, qos=1)
            expect = len(frame)
        else:
            expect = await self.ours[path].send(tensors)
        # wait here, blocking this thread: nothing of the sender's event loop is left to run
        # for this message (paho's thread writes it), and no thread hop delays the reading
        if not self.conn.poll(60):
            raise RuntimeError(f"{path}: message lost")
        got, seq, t = self.conn.recv()
        if (got, seq) != (path, expect):
            raise RuntimeError(f"expected the receipt of {path} #{expect}, got {got} #{seq}")
        return float(t) - t0

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
    """Per-stage CPU time (median seconds, no network) of one message of ``size`` bytes on
    the agents' path, signed, and of its parts."""
    from dfl_agent.algorithms.context import Message
    from dfl_agent.transport import chunking, wire

    tensors = model_of(size)
    ga, gb = _guards(_keys())
    raw = b"".join(a.tobytes() for a in tensors.values())

    def enc(sign: bool) -> bytes:
        m = Message("model", 1, dict(tensors), meta={"samples": 100})
        return wire.encode(m, federation=FED, sender="a", **({"sign": ga.sign} if sign else {}))

    sframe = enc(True)
    header = wire.raw_header(sframe)
    body = header.signed_bytes  # type: ignore[attr-defined]
    import base64

    raw_sig = base64.b64decode(header["sig"].split(":", 1)[1])
    pub = ga.key.public_key()
    chunks = chunking.split(sframe, CHUNK_SIZE)

    def reasm() -> Any:
        r = chunking.Reassembler(hash_from=wire.payload_offset)
        out = None
        for c in chunks:
            out = r.feed(c) or out
        return out

    def verify() -> None:
        gb._seen.clear()
        gb._rounds.clear()
        h = wire.raw_header(sframe)
        gb.check(h, signed_bytes=h.signed_bytes)

    import hashlib

    return {
        "blake3_payload": _time(lambda: wire.payload_digest(raw), reps),
        "sha256_payload": _time(lambda: hashlib.sha256(raw).digest(), reps),
        "ed25519_sign": _time(lambda: ga.sign(body), reps),
        "ed25519_sign_cryptography": _time(lambda: ga.key.sign(body), reps),
        "wire_encode": _time(lambda: enc(False), reps),
        "wire_encode_signed": _time(lambda: enc(True), reps),
        "chunk_split": _time(lambda: chunking.split(sframe, CHUNK_SIZE), reps),
        "reassemble": _time(reasm, reps),
        "wire_decode": _time(lambda: wire.decode(sframe, federation=FED), reps),
        "signature_trust_replay_check": _time(verify, reps),
        "ed25519_verify_cryptography": _time(lambda: pub.verify(raw_sig, body), reps),
        "frame_bytes": len(sframe),
    }


# ------------------------------------------------------------------- main


def _commit() -> str:
    """The commit of the working tree, ``+dirty`` when it has uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine() -> str:
    """CPU model, logical cores and memory of this machine, in words."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1024 ** 2:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{platform.machine()} {model}, {os.cpu_count()} logical cores{mem}, {platform.system()} {platform.release()}"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("paho-mqtt", "cryptography", "blake3", "zstandard", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    try:
        out["mosquitto"] = subprocess.run(["mosquitto", "-h"], capture_output=True, text=True).stdout.split("\n")[0]
    except OSError:
        pass
    return out


def ratio_summary(ratios: list[float]) -> dict[str, float]:
    """Median, minimum and maximum of per-message ratios (and their count)."""
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


async def run(sizes: list[int], n: int, warmup: int, paths: tuple[str, ...], codec: str,
              chunk_size: int = CHUNK_SIZE) -> dict[str, Any]:
    """Measure ``paths`` (``raw`` always among them) at every size: per path its seconds per
    message (``samples``, and their min/median/max) and, for every path but ``raw``, the
    per-message ratios to the ``raw`` message of the same round (``ratios``) with their
    median, min and max (``ratio``)."""
    from dfl_agent.cli.broker import start_broker

    paths = ("raw",) + tuple(p for p in paths if p != "raw")
    results: dict[str, Any] = {}
    with start_broker("mosquitto") as broker:
        sender = Sender(broker.endpoint, paths, codec, chunk_size)
        await sender.start()
        try:
            for size in sizes:
                tensors = model_of(size)
                payload = b"".join(a.tobytes() for a in tensors.values())
                samples: dict[str, list[float]] = {p: [] for p in paths}
                for i in range(warmup + n):
                    k = i % len(paths)  # rotate the order: no path always follows another
                    rnd = {p: await sender.once(p, tensors, payload) for p in paths[k:] + paths[:k]}
                    if i >= warmup:
                        for p, s in rnd.items():
                            samples[p].append(s)
                row: dict[str, Any] = {"payload_bytes": len(payload)}
                for p, smp in samples.items():
                    row[p] = {"min": min(smp), "median": statistics.median(smp), "max": max(smp), "samples": smp}
                    if p != "raw":
                        ratios = [a / b for a, b in zip(smp, samples["raw"], strict=True)]
                        row[p]["ratios"] = ratios
                        row[p]["ratio"] = ratio_summary(ratios)
                results[str(size)] = row
                print(json.dumps({"size": size, **{f"{p}_ms": round(1e3 * row[p]["median"], 3) for p in paths},
                                  **{f"{p}_ratio": {k: round(v, 3) for k, v in row[p]["ratio"].items()}
                                     for p in paths if p != "raw"}}), flush=True)
        finally:
            await sender.stop()
    return results


def _size_label(size: str) -> str:
    return {"55000": "55 kB", str(1 << 20): "1 MiB", str(10 << 20): "10 MiB"}.get(size, f"{size} B")


def report(path: Path) -> str:
    """Markdown tables of every run in the JSON-lines file ``path``."""
    lines = ["# Transport: the agents' path against raw paho, message by message", "",
             "One loopback mosquitto, QoS 1, MQTT 5, sender and receiver in two processes, one message in "
             "flight. `raw`: raw paho carrying the same bytes in pieces of at most the chunk size with the "
             "36-byte chunk header, reassembled into one buffer. Each ratio is a message's time over the "
             "time of the `raw` message of the same round (interleaved, order rotating); the columns give "
             "the median, minimum and maximum over the messages. How to run: `bench/scale/README.md`.", ""]
    for line in path.read_text().splitlines():
        r = json.loads(line)
        load = r["load_before"], r["load_after"]
        lines += [f"## {r['label']}", "",
                  f"- command: `{r['command']}`",
                  f"- commit: `{r['commit']}`; {r['time']}"
                  + (f"; the agents' code: the package at PYTHONPATH={r['pythonpath']}" if r.get("pythonpath") else ""),
                  f"- machine: {r['machine']}",
                  f"- load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load[0])}; "
                  f"after: {', '.join(f'{x:.2f}' for x in load[1])} (other jobs share the cores; the "
                  "interleaving exposes both paths to the same load)",
                  f"- {r['n']} messages per path and size after {r['warmup']} warm-up rounds; chunk size "
                  f"{r['chunk_size']} bytes; `compressed` codec: `{r['codec']}`", "",
                  "| message | path | median ms | min ms | max ms | ratio to raw: median | min | max |",
                  "|---|---|---|---|---|---|---|---|"]
        for size, row in r["results"].items():
            for p in r["paths"]:
                s = row[p]
                cells = (f"| {_size_label(size)} | {p} | {1e3 * s['median']:.3f} | {1e3 * s['min']:.3f} | "
                         f"{1e3 * s['max']:.3f} |")
                if p == "raw":
                    cells += " 1 | | |"
                else:
                    q = s["ratio"]
                    cells += f" {q['median']:.2f}x | {q['min']:.2f}x | {q['max']:.2f}x |"
                lines.append(cells)
        if r.get("stages"):
            lines += ["", "Per-stage CPU time of one signed message (median, microseconds, no network):", "",
                      "| stage | " + " | ".join(_size_label(s) for s in r["stages"]) + " |",
                      "|---|" + "---|" * len(r["stages"])]
            for k in next(iter(r["stages"].values())):
                vals = [str(s[k]) if k.endswith("bytes") else f"{1e6 * s[k]:.0f}" for s in r["stages"].values()]
                lines.append(f"| {k} | " + " | ".join(vals) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="payload sizes in bytes")
    p.add_argument("--n", type=int, default=100, help="messages per path and size (each paired with a raw one)")
    p.add_argument("--warmup", type=int, default=3, help="rounds per size not kept")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=["raw", "signed", "unsigned"], metavar="PATH",
                   help="paths to measure (default: raw signed unsigned): " + ", ".join(PATHS) +
                   "; raw (the baseline) is always measured")
    p.add_argument("--codec", default="q8+zstd", help="compression spec of the compressed path")
    p.add_argument("--chunk-size", type=int, default=CHUNK_SIZE,
                   help="largest MQTT payload, chunk header included (default: the agent's mqtt.chunk_size, "
                   "%(default)s)")
    p.add_argument("--label", default="run", help="name of this run in the results file")
    p.add_argument("--out", default=None, help="append the results as one JSON line to this file")
    p.add_argument("--stages", action="store_true", help="also profile one message's stages (no network)")
    p.add_argument("--report", default=None, help="print the Markdown report of a results file and exit")
    a = p.parse_args(argv)
    if a.report:
        print(report(Path(a.report)))
        return 0
    import logging

    import dfl_agent

    logging.basicConfig(level=logging.ERROR)
    paths = ("raw",) + tuple(x for x in PATHS if x in a.paths and x != "raw")
    record: dict[str, Any] = {
        "label": a.label, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit(),
        "machine": machine(), "versions": _versions(), "command": invocation(),
        "package": str(Path(dfl_agent.__file__).parent), "pythonpath": os.environ.get("PYTHONPATH"),
        "load_before": list(os.getloadavg()), "n": a.n, "warmup": a.warmup, "paths": list(paths),
        "codec": a.codec, "chunk_size": a.chunk_size,
    }
    record["results"] = asyncio.run(run(a.sizes, a.n, a.warmup, paths, a.codec, a.chunk_size))
    record["load_after"] = list(os.getloadavg())
    if a.stages:
        record["stages"] = {str(s): stages(s, 50 if s < (1 << 20) else 9) for s in a.sizes}
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "results"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
