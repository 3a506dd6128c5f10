"""Training side of the inference-only member: export and send the deployable model.

:class:`OnnxPublisher` is a :class:`~dfl_agent.runtime.node.Node` round hook.  After each
evaluated round it remembers whether the deployable model improved (local accuracy,
on the node's own validation split); when inference members (peers advertising
algorithm ``inference``) are live, it exports the model with
:func:`dfl_agent.models.onnx_export.export_onnx` (only when it changed since the last
export) and sends it to every member that does not hold this version yet.
torch is imported only inside the methods.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from dfl_agent.algorithms.context import Message
from dfl_agent.inference.member import ONNX_KIND

log = logging.getLogger(__name__)


class OnnxPublisher:
    """Args: ``ctx`` (RuntimeContext), ``algorithm`` (its ``deployable_model()``),
    ``input_shape`` of one sample, ``spec`` of the deployable model."""

    def __init__(self, ctx: Any, algorithm: Any, input_shape: Sequence[int], spec: dict[str, Any]):
        self.ctx, self.algorithm = ctx, algorithm
        self.input_shape = list(input_shape)
        self.spec = spec
        self.best = float("-inf")
        self.version = 0
        self.data: bytes | None = None
        self.dirty = False
        self.round = 0
        self.sent: dict[str, int] = {}

    def members(self) -> list[str]:
        """Live peers that advertise algorithm ``inference``."""
        out = []
        for p in self.ctx.peers.live_peers():
            info = self.ctx.peers.get(p)
            if info is not None and info.algorithm == "inference":
                out.append(p)
        return out

    async def __call__(self, t: int, record: dict[str, Any]) -> None:
        acc = record.get("local_accuracy")
        if isinstance(acc, float) and acc == acc and acc > self.best:
            self.best, self.dirty, self.round = acc, True, t
        members = self.members()
        if not members or (self.data is None and not self.dirty):
            return
        if self.dirty:
            from dfl_agent.models import spec_hash
            from dfl_agent.models.onnx_export import OnnxExportError, export_onnx

            model = copy.deepcopy(self.algorithm.deployable_model()).to("cpu")
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
            meta = {"version": self.version, "round": self.round, "accuracy": self.best, "spec_hash": self.hash}
            await self.ctx.send(p, Message(ONNX_KIND, t, {"onnx": np.frombuffer(self.data, np.uint8).copy()}, meta))
            self.sent[p] = self.version
