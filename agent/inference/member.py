"""The inference-only member: a federation peer that never trains (no torch).

It connects to its MQTT broker like any node (presence with the descriptor
``{"profile": "inference-only", "algorithm": "inference"}``, retained status, last
will), optionally advertises itself over mDNS, and waits for ``onnx.model`` messages
that training peers' services send it (:class:`dfl_agent.runtime.service.member_delivery.MemberDelivery`):
the sender's deployed model, or, where it deploys none, its deployable model exported to ONNX
whenever its accuracy improved.  Each
accepted model is written atomically to ``state_dir/model.onnx`` and described by one JSON
line appended to ``state_dir/models.jsonl`` (``time``, ``version``, ``round``, ``source``,
``accuracy``, and ``run_id``/``sha256`` when sent); when a window file is configured, the
member predicts on it and writes ``state_dir/predictions.json``.
Training peers exclude it from their rounds (it advertises algorithm ``inference``).

Message ``kind="onnx.model"``: tensors ``{"onnx": uint8 (nbytes,)}``; meta
``{"version": int, "source": node id, "round": int, "accuracy": float|None,
"spec_hash": str}``; from an agent that deploys (the sample store) also ``run_id``,
``sha256`` and ``deployed: true``, and ``version`` is its deployed version number (it
sends deployed versions only) with ``deployed_at``.  A model that onnxruntime cannot load, or
that is older than the one held (:meth:`InferenceMember.stale`: deployed earlier, or else a
lower round), is rejected and counted; the member keeps the old one.  The status names the
held deployment (``model_run_id``, ``model_sha256``, ``model_deployed_at``): an agent's
supervisor sends its deployed version to members whose status lacks it
(:mod:`dfl_agent.runtime.service.member_delivery`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.algorithms.context import Message
from dfl_agent.data import NodeData
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.fsutil import atomic_write
from dfl_agent.inference.windows import load_windows, predictions_document
from dfl_agent.jsonbound import RateLimitedLog
from dfl_agent.learning.training import TrainConfig
from dfl_agent.onnx_model import ONNX_KIND, InferenceError, OnnxModel, deployment_order
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.transport.versions import descriptor_versions, status_versions

if TYPE_CHECKING:
    from dfl_agent.security.trust import SecurityGuard
    from dfl_agent.transport.base import Transport

log = logging.getLogger(__name__)
#: rate-limited log of the exceptions caught per model message (``handler_error``)
_ERRORS = RateLimitedLog(log)

DESCRIPTOR = {"profile": "inference-only", "algorithm": "inference", "model_hash": ""}


class InferenceMember:
    """One inference-only node.

    Args:
        node_id, federation: wire ids.
        transport: a started-or-not :class:`~dfl_agent.transport.base.Transport`
            (e.g. ``MqttTransport`` with :data:`DESCRIPTOR`), or None to build an
            MQTT one for ``broker``.
        peers: its peer table (built when None).
        state_dir: where ``model.onnx`` and ``predictions.json`` go.
        windows: a ``.npz``/``.csv`` window file to predict on after each new model.
        threads: onnxruntime threads.
        sign: sign presence and status with the node key in ``state_dir`` (created on
            first start; ``node_cert.json`` there is sent along), as training nodes do,
            so that federations with ``require_signatures`` trust them.
        guard: the node's :class:`~dfl_agent.security.SecurityGuard` from its ``[security]``
            (:func:`dfl_agent.runtime.shared.assembly.build_security`): it signs presence and status
            and also verifies every model message; with ``require_signatures`` a model is
            taken only from an enrolled device (unsigned, unknown or badly signed frames are
            dropped and counted in the status's ``errors``).  None: ``sign`` decides.
        mqtt: further :class:`~dfl_agent.transport.mqtt.MqttTransport` arguments (``username``,
            ``password``, ``tls_ca``, ``tls_cert``, ``tls_key``, ``keepalive``, ...).
        address: the device's own address, carried in its presence (``dflctl peers``).
    """

    def __init__(self, node_id: str, federation: str, *, state_dir: str | os.PathLike[str],
                 transport: Transport | None = None, peers: PeerTable | None = None, broker: str = "127.0.0.1:1883",
                 windows: str | None = None, threads: int = 1, max_frame_bytes: int = 64 * 1024 * 1024,
                 heartbeat_interval: float = 5.0, protocol: str = "5", sign: bool = True, guard: SecurityGuard | None = None,
                 mqtt: dict[str, Any] | None = None, address: str | None = None):
        self.node_id, self.federation = node_id, federation
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.peers = peers or PeerTable(node_id, federation, heartbeat_timeout=30.0, home_broker=broker)
        self.descriptor: dict[str, Any] = {**DESCRIPTOR, "broker": broker, **descriptor_versions()}
        if address:
            self.descriptor["address"] = address
        #: verifies model messages too (a guard from the node's ``[security]``), else None
        self.verifier = guard
        self.guard = guard if guard is not None else self._guard(node_id, federation) if sign else None
        if guard is not None and guard.certificate is not None:
            self.descriptor["cert"] = guard.certificate  # presence carries the device certificate
        if transport is None:
            from dfl_agent.discovery.presence import node_transport

            transport = node_transport(node_id, federation, broker=broker, peers=self.peers, descriptor=self.descriptor,
                                       protocol=protocol, max_frame_bytes=max_frame_bytes,
                                       heartbeat_interval=heartbeat_interval,
                                       on_heartbeat=lambda peer, status: self.peers.touch(peer), control=self.guard,
                                       broadcasts=False, **(mqtt or {}))  # its models come addressed to it
        empty = np.empty((0,), np.float32)  # a member holds no training data (it never trains)
        self.ctx = RuntimeContext(node_id=node_id, federation=federation, transport=transport, peers=self.peers,
                                  data=NodeData(empty, empty.astype(np.int64), empty, empty.astype(np.int64),
                                                num_classes=0, input_shape=(), class_names=[], groups=[]),
                                  model_spec={}, train=TrainConfig(), init_seed=0, rng=np.random.default_rng(0),
                                  max_frame_bytes=max_frame_bytes, security=self.verifier)
        self.windows = windows
        self.threads = threads
        self.model: OnnxModel | None = None
        self.model_meta: dict[str, Any] = {}
        self.predictions: dict[str, Any] | None = None
        self.state = "waiting_for_model"
        self.started = time.time()
        #: the drop counts of the last status published (a change is published within a second)
        self.published_errors: dict[str, int] = {}

    def _guard(self, node_id: str, federation: str) -> SecurityGuard:
        """A signing :class:`~dfl_agent.security.SecurityGuard` (signatures not required
        of others) with the key and certificate of ``state_dir``."""
        from dfl_agent.security import SecurityGuard, SeqCounter, TrustStore
        from dfl_agent.security.keys import CERT_FILE, load_certificate, load_or_create_key, public_key_b64
        from dfl_agent.security.trust import SEQ_FILE

        key = load_or_create_key(self.state_dir)
        cert_path = self.state_dir / CERT_FILE
        cert = load_certificate(cert_path) if cert_path.exists() else None
        if cert is not None:
            self.descriptor["cert"] = cert  # presence carries the device certificate
        return SecurityGuard(node_id, key, TrustStore(federation, {node_id: public_key_b64(key)}), certificate=cert,
                             seq=SeqCounter(self.state_dir / SEQ_FILE))

    async def start(self) -> None:
        await self.ctx.start()
        await self.publish_status()

    async def stop(self) -> None:
        self.state = "stopped"
        await self.publish_status()
        await self.ctx.stop()

    def status(self) -> dict[str, Any]:
        """The retained status document (``dflctl status``)."""
        c = self.ctx.counters()
        p = self.predictions or {}
        return {
            "node_id": self.node_id, "state": self.state, "algorithm": "inference", "role": "inference",
            "profile": "inference-only", "round": self.model_meta.get("round", 0),
            "model_version": self.model_meta.get("version"), "model_source": self.model_meta.get("source"),
            "model_accuracy": self.model_meta.get("accuracy"), "model_run_id": self.model_meta.get("run_id"),
            "model_sha256": self.model_meta.get("sha256"), "model_deployed_at": self.model_meta.get("deployed_at"),
            "predictions": p.get("n"),
            "prediction_accuracy": p.get("accuracy"), "global_accuracy": None, "gated": None,
            "bytes_sent": c["bytes_sent"], "bytes_received": c["bytes_received"], "errors": c["dropped"],
            "live_peers": self.peers.live_peers(), "time": time.time(), **status_versions(),
        }

    async def publish_status(self) -> None:
        doc = self.status()
        self.published_errors = doc["errors"]
        try:
            await self.ctx.transport.publish_status(doc)
        except Exception as exc:  # noqa: BLE001 - status is best effort
            log.warning("could not publish status: %s", exc)

    def stale(self, meta: dict[str, Any]) -> str:
        """Why a model with ``meta`` is older than the one held ("" when it is not; "held":
        the very deployment held).  A deployed model (``deployed_at``, the sender's deployment
        time) is older when it was deployed before the held one: each run's deployment is
        newer than the last run's, whatever their round counts.  Another model is older
        when its ``round`` is lower."""
        held = self.model_meta
        at, held_at = meta.get("deployed_at"), held.get("deployed_at")
        if meta.get("deployed") and isinstance(at, (int, float)):
            order = deployment_order(at, meta.get("sha256"), held_at, held.get("sha256"))
            if order == "older":
                return f"deployed at {at:.0f}, no later than the one held ({held_at:.0f})"
            return "held" if order == "held" else ""
        rnd = meta.get("round", 0)
        return f"round {rnd!r} older than the one held" if rnd < held.get("round", -1) else ""

    def accept(self, msg: Message) -> bool:
        """Validate and load one ``onnx.model`` message; returns whether it was taken."""
        blob = msg.tensors.get("onnx")
        if blob is None or blob.dtype != np.uint8 or blob.ndim != 1 or set(msg.tensors) != {"onnx"}:
            self.ctx.reject(msg, "bad_model: want one uint8 tensor 'onnx'")
            return False
        if self.verifier is not None and self.verifier.require_signatures \
                and self.verifier.role_of(msg.sender) != "device":  # verified, but an operator's key
            self.ctx.reject(msg, "not_a_device: models come from enrolled devices only")
            return False
        rnd = msg.meta.get("round", 0)
        if not isinstance(rnd, int):
            self.ctx.reject(msg, f"bad_model: round {rnd!r} is not an int")
            return False
        stale = self.stale(msg.meta)
        if stale == "held":  # sent again (e.g. after a lost status): nothing to do
            return False
        if stale:
            self.ctx.reject(msg, f"stale_model: {stale}")
            return False
        try:
            model = OnnxModel(blob.tobytes(), self.threads)
        except InferenceError as exc:
            self.ctx.reject(msg, f"bad_model: {exc}")
            return False
        self.model = model
        self.model_meta = {"round": rnd, "version": msg.meta.get("version"), "source": msg.sender,
                           "accuracy": msg.meta.get("accuracy"), "spec_hash": msg.meta.get("spec_hash", ""),
                           **{k: msg.meta[k] for k in ("run_id", "sha256", "deployed", "deployed_at")
                              if k in msg.meta}}
        atomic_write(self.state_dir / "model.onnx", blob.tobytes())
        with open(self.state_dir / "models.jsonl", "a", encoding="utf-8") as f:  # every model taken, in order
            f.write(json.dumps({"time": time.time(), **{k: v for k, v in self.model_meta.items()
                                                        if k != "spec_hash"}}, default=str) + "\n")
        log.info("model v%s of round %s from %s (%d bytes)", self.model_meta["version"], rnd, msg.sender, blob.size)
        self.state = "serving"
        if self.windows:
            try:
                x, y = load_windows(self.windows, model.input_shape)
                self.predictions = predictions_document(model, x, y, {"model": self.model_meta})
                atomic_write(self.state_dir / "predictions.json", json.dumps(self.predictions))
            except InferenceError as exc:
                log.error("cannot predict: %s", exc)
                self.predictions = {"error": str(exc)}
        return True

    async def run(self, stop: asyncio.Event, poll: float = 1.0) -> None:
        """Receive models until ``stop`` is set."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            msg = await self.ctx.receive(ONNX_KIND, deadline=loop.time() + poll)
            if msg is None:
                if self.ctx.counters()["dropped"] != self.published_errors:  # frames dropped (unsigned, ...)
                    await self.publish_status()
                continue
            try:
                taken = self.accept(msg)
            except Exception as exc:  # noqa: BLE001 - one bad model message never ends the member
                self.ctx.reject(msg, f"handler_error: {type(exc).__name__}: {exc}"[:300])
                _ERRORS.exception("error handling a model message from %s", msg.sender)
                continue
            if taken:
                await self.publish_status()
