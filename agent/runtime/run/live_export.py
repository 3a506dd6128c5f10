"""The run's side of inference-only members when nothing is deployed: export the improved model.

A node that trains without deployment (no sample store, or ``deploy.enabled = false``) has no
deployed version for its inference-only members.  Its members get the run's best model so far
instead: :class:`LiveExport`, a :class:`~dfl_agent.runtime.node.node.Node` round hook, remembers after
each evaluated round whether the deployable model improved (local accuracy, on the node's own
validation slice) and, while an inference member (a peer advertising algorithm ``inference``) is
live, exports it with :func:`~dfl_agent.models.onnx_export.export_onnx` and writes it to
``STATE_DIR/live_model/`` (``model.onnx`` and ``manifest.json``, each atomically).  The service
sends it to the members that lack it (:class:`~dfl_agent.runtime.service.member_delivery.MemberDelivery`,
the one owner of the delivery).  torch is imported only inside the methods.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dfl_agent.deploy.versions import LIVE_DIR
from dfl_agent.fsutil import atomic_write

log = logging.getLogger(__name__)


class LiveExport:
    """Export the improved deployable model for inference-only members (see the module).

    Args:
        state_dir: the node's state directory (the export goes to ``LIVE_DIR`` there).
        peers: the node's live peer table (who is an inference member).
        model: ``() -> nn.Module``: the deployable model of the round record being reported.
        input_shape: one sample's shape; spec: the deployable model's spec.
        run_id: the run whose model it is.
        compute: ``await compute(fn, *args, **kw)``: where the export runs (the node's compute thread).
        private: the node trains under differential privacy (no accuracy in the manifest).
    """

    def __init__(self, state_dir: str | Path, peers: Any, model: Callable[[], Any], input_shape: Sequence[int],
                 spec: dict[str, Any], run_id: str, compute: Callable[..., Any], private: bool = False):
        self.folder = Path(state_dir) / LIVE_DIR
        self.peers, self.model, self.input_shape, self.spec = peers, model, list(input_shape), spec
        self.run_id, self.compute, self.private = run_id, compute, private
        self.best = float("-inf")
        self.round = 0
        self.dirty = False
        #: the exports written so far (the live model's version)
        self.version = 0

    def members(self) -> list[str]:
        """Live peers that advertise algorithm ``inference``."""
        return [p for p in self.peers.live_peers()
                if (info := self.peers.get(p)) is not None and info.algorithm == "inference"]

    async def __call__(self, t: int, record: dict[str, Any]) -> None:
        acc = record.get("local_accuracy")
        if isinstance(acc, float) and acc == acc and acc > self.best:
            self.best, self.dirty, self.round = acc, True, t
        if not self.dirty or not self.members():
            return
        from dfl_agent.models import spec_hash
        from dfl_agent.models.onnx_export import OnnxExportError, export_onnx

        model = copy.deepcopy(self.model()).to("cpu")
        try:
            data = await self.compute(export_onnx, model, self.input_shape, spec=self.spec)
        except OnnxExportError as exc:
            log.error("cannot export the model to ONNX: %s", exc)
            return
        self.dirty = False
        self.version += 1
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(self.folder / "model.onnx", data)
        meta = {"version": self.version, "round": self.round, "accuracy": None if self.private else self.best,
                "run_id": self.run_id, "sha256": hashlib.sha256(data).hexdigest(), "spec_hash": spec_hash(self.spec),
                "deployed": False, "time": time.time()}
        atomic_write(self.folder / "manifest.json", json.dumps(meta, sort_keys=True))
        log.info("exported model v%d (round %d, local accuracy %.3f) to ONNX for inference members: %d bytes",
                 self.version, self.round, self.best, len(data))
