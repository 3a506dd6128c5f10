"""Training side of the inference-only member: export and send the deployable model.

:class:`OnnxPublisher` is a :class:`~dfl_agent.runtime.node.Node` round hook.  After each
evaluated round it remembers whether the deployable model improved (local accuracy,
on the node's own validation split); when inference members (peers advertising
algorithm ``inference``) are live, it exports the model with
:func:`dfl_agent.models.onnx_export.export_onnx` (only when it changed since the last
export) and sends it to every member that does not hold this version yet.

With a deployed-model folder (``models``, a :class:`dfl_agent.deploy.ModelStore`: the agent
trains on its sample store and deploys after each run) the members receive the *deployed*
version only, never an intermediate improvement: the round hook sends ``models/current``
(the ``model.onnx`` the deploy gate accepted, unchanged) to members that do not hold it,
and :meth:`OnnxPublisher.deliver` is called after each deployment.
torch is imported only inside the methods.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from dfl_agent.algorithms.context import Message
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.onnx_model import ONNX_KIND

log = logging.getLogger(__name__)


class OnnxPublisher:
    """Args: ``ctx`` (RuntimeContext), ``algorithm`` (its ``deployable_model()``),
    ``input_shape`` of one sample, ``spec`` of the deployable model, ``models`` the
    agent's deployed-model folder (None: send every improvement of the deployable model)."""

    def __init__(self, ctx: Any, algorithm: Any, input_shape: Sequence[int], spec: dict[str, Any],
                 models: Any = None):
        self.ctx, self.algorithm = ctx, algorithm
        self.models = models
        self.input_shape = list(input_shape)
        self.spec = spec
        self.best = float("-inf")
        self.version = 0
        self.data: bytes | None = None
        self.dirty = False
        self.round = 0
        #: the model the record passed to the hook describes (e.g. ``Node.reported_model``); None = the live one
        self.model_source: Any = None
        self.sent: dict[str, int] = {}

    def private(self) -> bool:
        """Whether the node trains under differential privacy: then the meta carries no
        validation accuracy (:mod:`dfl_agent.privacy.policy`)."""
        return bool(getattr(self.algorithm, "private", lambda: False)())

    def members(self) -> list[str]:
        """Live peers that advertise algorithm ``inference``."""
        out = []
        for p in self.ctx.peers.live_peers():
            info = self.ctx.peers.get(p)
            if info is not None and info.algorithm == "inference":
                out.append(p)
        return out

    async def __call__(self, t: int, record: dict[str, Any]) -> None:
        if self.models is not None:  # deployed versions only
            await self.deliver(t)
            return
        acc = record.get("local_accuracy")
        if isinstance(acc, float) and acc == acc and acc > self.best:
            self.best, self.dirty, self.round = acc, True, t
        members = self.members()
        if not members or (self.data is None and not self.dirty):
            return
        if self.dirty:
            from dfl_agent.models import spec_hash
            from dfl_agent.models.onnx_export import OnnxExportError, export_onnx

            source = self.model_source() if self.model_source is not None else self.algorithm.deployable_model()
            model = copy.deepcopy(source).to("cpu")
            try:
                run = getattr(self.ctx, "compute_ungated", self.ctx.compute)
                self.data = await run(export_onnx, model, self.input_shape, spec=self.spec)
            except OnnxExportError as exc:
                log.error("cannot export the model to ONNX: %s", exc)
                return
            self.version += 1
            self.dirty = False
            self.hash = spec_hash(self.spec)
            log.info("exported model v%d (round %d, local accuracy %.3f) to ONNX: %d bytes",
                     self.version, self.round, self.best, len(self.data))
        assert self.data is not None
        for p in members:
            if self.sent.get(p) == self.version:
                continue
            meta = {"version": self.version, "round": self.round, "accuracy": None if self.private() else self.best,
                    "spec_hash": self.hash}
            await self.ctx.send(p, Message(ONNX_KIND, t, {"onnx": np.frombuffer(self.data, np.uint8).copy()}, meta))
            self.sent[p] = self.version

    async def deliver(self, t: int = 0) -> int:
        """Send the deployed version (``models/current``, :func:`deployed_onnx`) to the live
        members that do not hold it yet.  Nothing is sent when nothing is deployed, the
        version has no ``model.onnx`` (no onnx extra) or it fails its hash check.  Returns the
        number of members sent to."""
        if self.models is None:
            return 0
        v = self.models.current_version()
        members = self.members()
        if v is None or not members or all(self.sent.get(p) == v for p in members):
            return 0
        got = deployed_onnx(self.models, self.spec, private=self.private())
        if got is None:
            return 0
        v, data, meta = got
        n = 0
        for p in members:
            if self.sent.get(p) == v:
                continue
            await self.ctx.send(p, Message(ONNX_KIND, t, {"onnx": np.frombuffer(data, np.uint8).copy()}, meta))
            self.sent[p] = v
            n += 1
        log.info("sent deployed model v%d (run %s) to %d inference member(s)", v, meta["run_id"], n)
        return n


def deployed_onnx(models: Any, spec: dict[str, Any] | None = None, *,
                  private: bool = False) -> tuple[int, bytes, dict[str, Any]] | None:
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
        held_spec = bounded_loads((folder / "spec.json").read_bytes(), "manifest").get("spec", spec)
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
