"""The delivery of this node's model to inference-only members: one owner, the service.

The supervisor (torch-free) sends this device's deployed version (``models/current``, as
:func:`deployed_onnx` reads it) to every inference member whose status shows that it holds an
older deployment, or none.  A node that trains without deployment sends the run's best model so
far instead (``live_model/``, which the run writes: :mod:`dfl_agent.runtime.run.live_export`;
:func:`live_onnx`) to every member whose status shows another model.  The member's retained status
(``dfl/{fed}/node/{id}/status``, verified by the run lobby like every status) names what it
holds: ``model_sha256`` and ``model_deployed_at``
(:class:`dfl_agent.inference.member.InferenceMember`).  So a member gets the model after each
deployment, when it starts, and again when a copy was lost: for example one sent while its
broker was down, or just before the member subscribed again after an outage.  A run process
has ended by then, and nothing else would send it until the next run.

A member is sent a version again only while its status still lacks it: first after
``retry_s`` seconds, then after twice as long each time, up to ``max_retry_s``.  When its
status shows another state or another model than when the last copy went (it restarted, or
took another device's model), the wait starts again from ``retry_s``: never more than one copy
of a version per ``retry_s``, so that a device whose status keeps changing cannot take the
node's upload.  A member that is gone (its status ``stopped``) gets nothing, nor does any
member while the node's broker connection is down.

Frames go through the node's home broker to the member's inbox
(``dfl/{fed}/node/{member}/inbox``), chunked to ``mqtt.chunk_size`` (or the size that
``mqtt.link_rate`` gives), signed with the node's key when it has one.  A member on another
site's broker is reached where the brokers are bridged (``mqtt.bridged``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.deploy.versions import LIVE_DIR
from dfl_agent.jsonbound import RateLimitedLog
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.onnx_model import deployment_order

if TYPE_CHECKING:
    from dfl_agent.algorithms.context import Message
    from dfl_agent.deploy.versions import ModelStore
    from dfl_agent.runtime.service.lobby import RunLobby
    from dfl_agent.runtime.shared.config import NodeConfig

log = logging.getLogger("dfl_agent.daemon")
_ERRORS = RateLimitedLog(log)

#: seconds between two checks of the members' statuses
PERIOD_S = 2.0


@dataclass
class _Sent:
    """What was sent to one member: the version's ``sha256``, when (monotonic s), the wait
    before the next copy (s), and what the member's status showed then (:func:`holding`)."""

    sha256: str
    at: float
    wait: float
    held: tuple[object, object]


def holding(status: Mapping[str, object]) -> tuple[object, object]:
    """A member status's ``(state, model_sha256)``."""
    return status.get("state"), status.get("model_sha256")


def lacks(status: Mapping[str, object], meta: dict[str, Any]) -> bool:
    """Whether an inference member's ``status`` shows it lacks the model ``meta`` describes.
    A deployment (:func:`deployed_onnx`'s): it holds nothing, another model deployed no later, or
    a model that was not deployed; a member that holds a newer deployment (another device's, of a
    later run) does not lack it.  A live model (:func:`live_onnx`'s): it holds another model."""
    if meta.get("deployed") is False:  # the run's live model
        return status.get("model_sha256") != meta["sha256"]
    return deployment_order(meta["deployed_at"], meta["sha256"], status.get("model_deployed_at"),
                            status.get("model_sha256")) == "newer"


class MemberDelivery:
    """Send ``models/current`` to the inference members that lack it (see the module).

    Args:
        cfg: the node's :class:`~dfl_agent.runtime.shared.config.NodeConfig` (federation, ``mqtt``,
            ``deploy``, ``state_dir``).
        lobby: the node's :class:`~dfl_agent.runtime.service.lobby.RunLobby`: its MQTT session, the
            peers' verified statuses and the node's signing guard.
        retry_s, max_retry_s: the first and the longest wait before a member that still
            lacks the version gets it again, in seconds.
        clock: monotonic seconds (tests).
    """

    def __init__(self, cfg: NodeConfig, lobby: RunLobby, *, retry_s: float = 15.0, max_retry_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic):
        from dfl_agent.deploy.versions import ModelStore
        from dfl_agent.privacy.policy import dp_enabled
        from dfl_agent.transport.link_rate import derive

        self.cfg, self.lobby = cfg, lobby
        #: the deployed versions (``deploy.enabled``; installed by the runs, or by hand), else None
        self.models = ModelStore(cfg.state_dir, keep=cfg.deploy.keep) if cfg.deploy.enabled else None
        self.private = dp_enabled(cfg)
        m = cfg.mqtt
        self.chunk_size = derive(m.link_rate, chunk_size=m.chunk_size, keepalive=m.keepalive).chunk_size
        self.retry_s, self.max_retry_s, self.clock = float(retry_s), float(max_retry_s), clock
        self.sent: dict[str, _Sent] = {}
        #: copies sent, by member
        self.copies: dict[str, int] = {}
        self._cached: tuple[object, tuple[int, bytes, dict[str, Any]] | None] = (None, None)

    def current(self) -> tuple[int, bytes, dict[str, Any]] | None:
        """The model to send, ``(version, model.onnx, meta)``: the deployed version
        (``models/current``, its files' hashes checked), else, on a node whose runs deploy
        nothing, the run's live model; read once per version; None when there is none (or it has
        no ``model.onnx``)."""
        models = self.models
        v = models.current_version() if models is not None else None
        if models is not None and v is not None:
            if self._cached[0] != v:
                self._cached = (v, deployed_onnx(models, private=self.private))
            return self._cached[1]
        if self.cfg.deploys:
            return None  # the runs deploy: members get deployed versions only
        key = _stamp(Path(self.cfg.state_dir) / LIVE_DIR / "manifest.json")
        if key is None:
            return None
        if self._cached[0] != key:
            self._cached = (key, live_onnx(self.cfg.state_dir))
        return self._cached[1]

    def due(self, meta: dict[str, Any]) -> list[str]:
        """The members to send the deployment ``meta`` describes to now."""
        with self.lobby.lock:
            statuses = {n: dict(s) for n, s in self.lobby.statuses.items() if isinstance(s, dict)}
        now, out = self.clock(), []
        for node, st in sorted(statuses.items()):
            if "inference" not in (st.get("role"), st.get("algorithm")) or st.get("state") == "stopped":
                continue
            if not lacks(st, meta):
                self.sent.pop(node, None)
                continue
            last = self.sent.get(node)
            if last is not None and last.sha256 == meta["sha256"]:
                wait = last.wait if holding(st) == last.held else self.retry_s  # it changed: from the start
                if now - last.at < wait:
                    continue
            out.append(node)
        return out

    def tick(self) -> int:
        """Send the deployed version to the members that lack it; returns how many were sent to."""
        if self.lobby.client is None or not self.lobby.up():
            return 0
        got = self.current()
        if got is None:
            return 0
        v, data, meta = got
        members = self.due(meta)
        for node in members:
            self._send(node, data, meta)
        if members:
            log.info("sent %s model v%d (run %s) to inference member(s) %s",
                     "live" if meta.get("deployed") is False else "deployed", v, meta["run_id"], ", ".join(members))
        return len(members)

    def _send(self, node: str, data: bytes, meta: dict[str, Any]) -> None:
        from dfl_agent.algorithms.context import Message
        from dfl_agent.onnx_model import ONNX_KIND

        msg = Message(ONNX_KIND, int(meta["round"]), {"onnx": np.frombuffer(data, np.uint8)}, dict(meta))
        send_frame(self.lobby, self.cfg.federation, node, msg, self.chunk_size)
        last = self.sent.get(node)
        with self.lobby.lock:
            held = holding(self.lobby.statuses.get(node) or {})
        again = last is not None and last.sha256 == meta["sha256"] and last.held == held  # still lacking it
        wait = min(2 * last.wait, self.max_retry_s) if again and last is not None else self.retry_s
        self.sent[node] = _Sent(meta["sha256"], self.clock(), wait, held)
        self.copies[node] = self.copies.get(node, 0) + 1

    async def run(self, stop: asyncio.Event, period: float = PERIOD_S) -> None:
        """:meth:`tick` every ``period`` seconds until ``stop``; an error is logged (rate-limited)
        and the loop goes on (delivery is best effort; the files are deployed)."""
        await tick_every(self.tick, stop, period, _ERRORS, "could not send the deployed model to inference members")


async def tick_every(tick: Callable[[], object], stop: asyncio.Event, period: float, errors: RateLimitedLog,
                     failed: str) -> None:
    """``tick()``, in a thread, every ``period`` seconds until ``stop``; an exception is logged
    through ``errors`` (rate-limited) as ``failed``, and the loop goes on."""
    while not stop.is_set():
        try:
            await asyncio.to_thread(tick)
        except Exception:  # noqa: BLE001 - the loops are best effort: the next period tries again
            errors.exception(failed)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period)


def send_frame(lobby: RunLobby, federation: str, node: str, msg: Message, chunk_size: int) -> int:
    """Frame ``msg`` (a :class:`~dfl_agent.algorithms.context.Message`) for ``node`` of ``federation``, signed with
    the node's key (``lobby.guard``), in the wire version ``node`` reads (the highest that its
    status announces, :func:`dfl_agent.transport.versions.negotiate`), and publish it to ``node``'s
    inbox on the lobby's session, in chunks of ``chunk_size`` bytes (QoS 1).  Returns the frame's bytes.

    Raises:
        WireError: the message cannot be framed.
    """
    from dfl_agent.runtime.shared.framing import frame
    from dfl_agent.transport.chunking import iter_chunks
    from dfl_agent.transport.mqtt import topic
    from dfl_agent.transport.versions import negotiate, versions_of

    msg.recipient = node
    with lobby.lock:  # the wire version the member reads: the one its status announces
        wires = versions_of((lobby.statuses.get(node) or {}).get("wires"))
    data = frame(msg, federation=federation, sender=lobby.node_id, security=lobby.guard, version=negotiate([wires]))
    name, client = topic(federation, node, "inbox"), lobby.client
    assert client is not None  # its callers send only while the lobby's session is up
    for chunk in list(iter_chunks(data, chunk_size)):
        client.publish(name, chunk, qos=1)
    return len(data)


def deployed_onnx(models: ModelStore, *, private: bool = False) -> tuple[int, bytes, dict[str, Any]] | None:
    """The deployed version (``models/current`` of ``models``, a
    :class:`dfl_agent.deploy.ModelStore`) as an ``onnx.model`` message's parts:
    ``(version, model.onnx bytes, meta)``.  Meta: ``version`` (the deployed version number),
    ``round``, ``accuracy`` (its validation accuracy; None when ``private``: differential
    privacy), ``run_id``, ``sha256`` of ``model.onnx``, ``spec_hash``, ``deployed: true`` and
    ``deployed_at`` (the manifest's ``time``, unix s: inference members keep the newest
    deployment).  None when nothing is deployed, the version has no ``model.onnx`` (no onnx
    extra) or it fails its hash check (logged).  Torch-free."""
    from dfl_agent.deploy.versions import DeployError, verify_folder
    from dfl_agent.models import spec_hash

    v = models.current_version()
    if v is None:
        return None
    folder = models.folder(v)
    try:
        manifest = verify_folder(folder)
        if "model.onnx" not in manifest.get("files", {}):
            return None
        data = (folder / "model.onnx").read_bytes()
        held_spec = bounded_loads((folder / "spec.json").read_bytes(), "manifest").get("spec")
        held_hash = spec_hash(held_spec or {})
    except (DeployError, OSError, ValueError) as exc:  # ValueError: also a SpecError
        log.error("cannot send deployed model v%d to inference members: %s", v, exc)
        return None
    meta = {"version": v, "round": int(manifest.get("round") or 0),
            "accuracy": None if private else manifest.get("accuracy"),
            "run_id": manifest.get("run_id"), "sha256": manifest["files"]["model.onnx"]["sha256"],
            "spec_hash": held_hash, "deployed": True,
            "deployed_at": float(manifest.get("time") or 0.0)}
    return v, data, meta


def live_onnx(state_dir: str | Path) -> tuple[int, bytes, dict[str, Any]] | None:
    """The run's live model (``STATE_DIR/live_model/``, :mod:`dfl_agent.runtime.run.live_export`) as
    an ``onnx.model`` message's parts ``(version, model.onnx bytes, meta)``; None when there is
    none, or its file does not match its manifest's SHA-256 (being rewritten).  Torch-free."""
    import hashlib

    folder = Path(state_dir) / LIVE_DIR
    try:
        meta = bounded_loads((folder / "manifest.json").read_bytes(), "manifest")
        data = (folder / "model.onnx").read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return None
    meta = {k: meta.get(k) for k in ("version", "round", "accuracy", "run_id", "sha256", "spec_hash", "deployed")}
    return int(meta["version"] or 0), data, meta


def _stamp(path: Path) -> tuple[int, int] | None:
    """``(mtime_ns, size)`` of ``path``, None when it is missing: a new export changes it."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
