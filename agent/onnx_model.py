"""An ONNX classifier on onnxruntime, without torch: :class:`OnnxModel`.

The one place that opens an exported model with onnxruntime: the inference-only member
predicts with it, and the export check (:func:`dfl_agent.models.onnx_export.max_abs_difference`)
compares it with torch.  :func:`onnx_available` says whether the ``onnx`` extra is
installed.  Only the standard library and numpy are imported at module level.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dfl_agent.jsonbound import JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads

#: the message kind that carries an exported model to inference-only members
ONNX_KIND = "onnx.model"

#: the modules of the ``onnx`` extra (export, check and inference)
ONNX_MODULES = ("onnx", "onnxruntime", "onnxscript")


def deployment_order(at: object, sha256: object, held_at: object, held_sha256: object) -> str:
    """Where a deployed model stands against the one an inference member holds: ``"newer"``
    (the member holds none with a deployment time, or one deployed earlier), ``"held"`` (the
    same bytes: equal SHA-256) or ``"older"`` (deployed no later than the one held).

    Deployments are ordered by their deployment time (``deployed_at``, seconds since the
    epoch, the deploying device's clock): each run's deployment is newer than the last run's,
    whatever their round counts.  The member takes only a ``newer`` model, and a supervisor
    sends its deployment only to a member that lacks it (``newer``): one rule for both."""
    if isinstance(sha256, str) and sha256 and sha256 == held_sha256:
        return "held"
    if not isinstance(held_at, (int, float)) or isinstance(held_at, bool):
        return "newer"
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        return "older"
    return "newer" if at > held_at else "older"


def onnx_available() -> bool:
    """True when the ``onnx`` extra (onnx, onnxruntime, onnxscript) is installed."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ONNX_MODULES)


class InferenceError(ValueError):
    """Unusable model or window file; the message says which and why."""


class OnnxModel:
    """An ONNX classifier from :func:`dfl_agent.models.onnx_export.export_onnx`.

    Args:
        data: the ONNX bytes.
        threads: onnxruntime intra-op threads.

    Raises:
        InferenceError: onnxruntime cannot load it, or it lacks the ``x`` input.
    """

    def __init__(self, data: bytes, threads: int = 1):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, int(threads))
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(bytes(data), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
            raise InferenceError(f"onnxruntime cannot load the model: {exc}") from None
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise InferenceError(f"the model has {len(inputs)} inputs, want 1")
        self.input_name = inputs[0].name
        meta = self.session.get_modelmeta().custom_metadata_map
        self.metadata: dict[str, str] = dict(meta)
        shape = meta.get("dfl.input_shape")
        try:  # bounded: the metadata comes with the model, from another device
            parsed = bounded_loads(shape, max_bytes=4096) if shape else None
        except JSONBoundError as exc:
            raise InferenceError(f"the model's dfl.input_shape is not usable: {exc}") from None
        if parsed is not None and not (isinstance(parsed, list) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in parsed)):
            raise InferenceError(f"the model's dfl.input_shape is not a list of integers: {shape[:80]!r}")
        self.input_shape: list[int] | None = parsed

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], threads: int = 1) -> OnnxModel:
        try:
            return cls(Path(path).read_bytes(), threads)
        except OSError as exc:
            raise InferenceError(f"cannot read model {path}: {exc.strerror}") from None

    def predict_logits(self, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Logits ``(N, K)`` float32 for windows ``x`` of ``(N, *input_shape)``.

        Raises:
            InferenceError: ``x`` has the wrong shape for the model.
        """
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.input_shape is not None and list(x.shape[1:]) != self.input_shape:
            raise InferenceError(f"windows have shape {list(x.shape[1:])}, the model wants {self.input_shape}")
        outs = [self.session.run(None, {self.input_name: x[i : i + batch_size]})[0]
                for i in range(0, len(x), batch_size)]
        if not outs:
            return np.zeros((0, 0), np.float32)
        return np.concatenate(outs).astype(np.float32)

    def predict(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """``{"label": (N,) int64, "probability": (N, K) float32 softmax, "logits": (N, K)}``."""
        logits = self.predict_logits(x)
        z = logits - logits.max(axis=1, keepdims=True) if len(logits) else logits
        p = np.exp(z)
        p = p / p.sum(axis=1, keepdims=True) if len(p) else p
        return {"label": logits.argmax(axis=1).astype(np.int64) if len(logits) else np.zeros(0, np.int64),
                "probability": p.astype(np.float32), "logits": logits}
