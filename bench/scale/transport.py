"""Transport benchmark: publish -> full receipt over one loopback mosquitto.

Three paths carry the same model (float32 tensors of the given total size), QoS 1,
one message in flight at a time.  By default the sender and the receiver are two
processes (as two agents are), and the receiver reports the receipt time
(``time.perf_counter``, the system-wide monotonic clock) back over a pipe;
``--processes 1`` runs both ends in one process, where they also compete for one
interpreter lock:

* ``raw``: raw paho - one client publishes the tensors' bytes, another receives them
  (timed from ``publish`` to the receiver's ``on_message``);
* ``ours``: the daemon's full path - ``RuntimeContext.broadcast`` (encode, chunk,
  publish) on node A to ``RuntimeContext.receive`` on node B (reassemble, decode,
  validate), unsigned;
* ``signed``: the same with Ed25519-signed envelopes verified by B's ``SecurityGuard``.

Every repeat runs ``--n`` messages of each path and size, interleaved, and keeps the
median; the ratio of a repeat is its median over raw paho's median of that repeat,
and the reported ratio is the worst (largest) of the repeats.  ``--stages`` adds a
per-stage CPU profile (no network) of encode and decode.

Usage (repository root)::

    nice -n 10 python bench/scale/transport.py --label after --stages --out bench/scale/transport.jsonl
    python bench/scale/transport.py --report bench/scale/transport.jsonl > bench/scale/transport.md
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import shlex
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SIZES = (55_000, 1 << 20, 10 << 20)
FED = "bench"


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
    """Two paho clients on one broker: ``once(payload)`` returns publish->receipt seconds."""

    def __init__(self, host: str, port: int):
        import paho.mqtt.client as mqtt

        self.got = threading.Event()
        self.t_recv = 0.0
        self.n_recv = 0
        self.topic = "bench/raw"
        self.sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-sub", protocol=mqtt.MQTTv5)
        self.pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-pub", protocol=mqtt.MQTTv5)
        subscribed = threading.Event()
        self.sub.on_subscribe = lambda *a: subscribed.set()
        self.sub.on_connect = lambda c, *a: c.subscribe(self.topic, qos=1)

        def on_message(client: Any, userdata: Any, msg: Any) -> None:
            self.n_recv = len(msg.payload)
            self.t_recv = time.perf_counter()
            self.got.set()

        self.sub.on_message = on_message
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

    def close(self) -> None:
        for c in (self.sub, self.pub):
            c.disconnect()
            c.loop_stop()


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
        from dfl_agent.runtime.context import RuntimeContext
        from dfl_agent.transport.mqtt import MqttTransport

        fed = FED + ("-s" if self.signed else "")
        # the trust store's federation is the transport's: signed presence is verified too
        ga, gb = _guards(self.keys, fed) if self.signed else (None, None)
        self.ctx = {}
        for node, guard in (("a", ga), ("b", gb)):
            if node not in self.nodes:
                continue
            peers = PeerTable(node, fed)
            transport = MqttTransport(node, fed, broker=self.endpoint, peers=peers, descriptor={},
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


def _receiver(endpoint: str, keys: tuple[bytes, bytes], conn: Any) -> None:
    """Child process: node b of both federations and a raw paho subscriber; every
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
    sub.on_connect = lambda c, *a: c.subscribe("bench/raw", qos=1)
    sub.on_message = lambda c, u, msg: report("raw")
    sub.connect(host, int(port))
    sub.loop_start()

    async def main() -> None:
        nodes = {"ours": Ours(endpoint, False, ("b",)), "signed": Ours(endpoint, True, ("b",), keys)}
        for o in nodes.values():
            await o.start()

        async def listen(path: str, o: Ours) -> None:
            while True:
                got = await o.ctx["b"].receive("model", deadline=asyncio.get_running_loop().time() + 3600)
                if got is not None:
                    report(path)

        tasks = [asyncio.create_task(listen(p, o)) for p, o in nodes.items()]
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

    def __init__(self, endpoint: str):
        import multiprocessing as mp

        self.endpoint = endpoint
        self.keys = _keys()
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_receiver, args=(endpoint, self.keys, child), daemon=True)

    async def start(self) -> None:
        import paho.mqtt.client as mqtt

        self.proc.start()
        host, port = self.endpoint.rsplit(":", 1)
        self.pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-pub", protocol=mqtt.MQTTv5)
        self.pub.connect(host, int(port))
        self.pub.loop_start()
        self.ours = {"ours": Ours(self.endpoint, False, ("a",)), "signed": Ours(self.endpoint, True, ("a",), self.keys)}
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
              "msg_id": "0" * 32, "time": time.time(), "payload_sha256": "0" * 64, "payload_len": len(st),
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


async def run(sizes: list[int], n: int, repeats: int, processes: int = 2) -> dict[str, Any]:
    from dfl_agent.cli.broker import start_broker

    results: dict[str, Any] = {}
    with start_broker("mosquitto") as broker:
        if processes == 2:
            two = TwoProcesses(broker.endpoint)
            await two.start()

            async def once(path: str, tensors: dict[str, np.ndarray], payload: bytes) -> float:
                return await two.once(path, tensors, payload)

            async def stop() -> None:
                await two.stop()
        else:
            host, port = broker.endpoint.rsplit(":", 1)
            raw = RawPaho(host, int(port))
            ours, signed = Ours(broker.endpoint, False), Ours(broker.endpoint, True)
            await ours.start()
            await signed.start()
            await asyncio.sleep(0.5)

            async def once(path: str, tensors: dict[str, np.ndarray], payload: bytes) -> float:
                if path == "raw":
                    return raw.once(payload)
                return await (ours if path == "ours" else signed).once(tensors)

            async def stop() -> None:
                raw.close()
                await ours.stop()
                await signed.stop()
        try:
            for size in sizes:
                tensors = model_of(size)
                payload = b"".join(a.tobytes() for a in tensors.values())
                paths = ("raw", "ours", "signed")
                per: dict[str, Any] = {m: {"samples": [], "medians": []} for m in paths}
                for _ in range(2):  # warm-up
                    for m in paths:
                        await once(m, tensors, payload)
                for _ in range(repeats):
                    rep: dict[str, list[float]] = {m: [] for m in paths}
                    for _ in range(n):  # interleaved, so load changes hit all three alike
                        for m in paths:
                            rep[m].append(await once(m, tensors, payload))
                    for m, smp in rep.items():
                        per[m]["samples"] += smp
                        per[m]["medians"].append(statistics.median(smp))
                row: dict[str, Any] = {"payload_bytes": len(payload)}
                for m in per:
                    row[m] = {**_summary(per[m]["samples"]), "medians": per[m]["medians"]}
                for m in ("ours", "signed"):
                    ratios = [a / b for a, b in zip(per[m]["medians"], per["raw"]["medians"], strict=True)]
                    row[f"{m}_ratio"] = max(ratios)
                    row[f"{m}_ratios"] = ratios
                    row[f"{m}_MBps"] = len(payload) / max(per[m]["medians"]) / 1e6
                results[str(size)] = row
                print(json.dumps({"size": size, "ours_ratio": row["ours_ratio"], "signed_ratio": row["signed_ratio"],
                                  "raw_median_ms": 1e3 * row["raw"]["median"],
                                  "ours_median_ms": 1e3 * row["ours"]["median"]}), flush=True)
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
                  "", f"Command: `{r['command']}`", "",
                  "| message | path | min ms | median ms | max ms | ratio to raw paho (worst repeat) | rate MB/s |",
                  "|---|---|---|---|---|---|---|"]
        for size, row in r["results"].items():
            label = {"55000": "55 kB", str(1 << 20): "1 MiB", str(10 << 20): "10 MiB"}.get(size, f"{size} B")
            for m in ("raw", "ours", "signed"):
                s = row[m]
                ratio = f"{row[m + '_ratio']:.2f}x" if m != "raw" else "1"
                rate = f"{row[m + '_MBps']:.0f}" if m != "raw" else f"{row['payload_bytes'] / max(s['medians']) / 1e6:.0f}"
                lines.append(f"| {label} | {m} | {1e3 * s['min']:.2f} | {1e3 * s['median']:.2f} | "
                             f"{1e3 * s['max']:.2f} | {ratio} | {rate} |")
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
    p.add_argument("--stages", action="store_true", help="also profile encode/decode per stage (no network)")
    p.add_argument("--report", default=None, help="print the Markdown report of a results file and exit")
    a = p.parse_args(argv)
    if a.report:
        print(report(Path(a.report)))
        return 0
    import logging
    import sys

    import dfl_agent
    from dfl_agent.transport import wire

    logging.basicConfig(level=logging.ERROR)
    res = asyncio.run(run(a.sizes, a.n, a.repeats, a.processes))
    record: dict[str, Any] = {
        "label": a.label, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wire_version": getattr(dfl_agent, "WIRE_VERSION", None), "frame_version": wire.WIRE_VERSION,
        "n": a.n, "repeats": a.repeats, "processes": a.processes, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "command": "nice -n 10 python bench/scale/transport.py " + shlex.join(sys.argv[1:]), "results": res,
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
