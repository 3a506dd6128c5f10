"""onnxruntime inference on sensor windows (no torch).

Window files:

- ``.npz``: key ``x`` of shape ``(N, *input_shape)`` (float32-convertible, finite),
  optional ``y`` ``(N,)`` labels (``agent/data/FORMAT.md``); read with
  ``allow_pickle=False``.
- ``.csv``: one window per row, the flattened ``input_shape`` values (channels first);
  a first row that is not numeric is a header and skipped; with ``label_column`` the
  last column is an integer label.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.jsonbound import JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads


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
        outs = []
        for i in range(0, len(x), batch_size):
            outs.append(self.session.run(None, {self.input_name: x[i : i + batch_size]})[0])
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


def load_windows(path: str | os.PathLike[str], input_shape: Sequence[int] | None = None,
                 label_column: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Read windows ``(x, y or None)`` from a ``.npz`` or ``.csv`` file (module docstring).

    Raises:
        InferenceError: unreadable file, missing ``x``, non-finite values, a CSV row
            length that does not fit ``input_shape``.
    """
    p = Path(path)
    try:
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                if "x" not in z:
                    raise InferenceError(f"{p}: no 'x' array (see agent/data/FORMAT.md)")
                x = np.asarray(z["x"], dtype=np.float32)
                y = np.asarray(z["y"], dtype=np.int64) if "y" in z else None
        elif p.suffix == ".csv":
            rows: list[list[float]] = []
            with open(p, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        rows.append([float(v) for v in line.split(",")])
                    except ValueError:
                        if i == 0:
                            continue  # header
                        raise InferenceError(f"{p}: line {i + 1} is not numeric") from None
            arr = np.asarray(rows, dtype=np.float64)
            y = None
            if label_column:
                y, arr = arr[:, -1].astype(np.int64), arr[:, :-1]
            if input_shape is not None:
                n = int(np.prod(input_shape))
                if arr.ndim != 2 or arr.shape[1] != n:
                    raise InferenceError(f"{p}: rows have {arr.shape[-1] if arr.ndim == 2 else 0} values, "
                                         f"want {n} = {'x'.join(map(str, input_shape))}")
                arr = arr.reshape((len(arr), *input_shape))
            x = arr.astype(np.float32)
        else:
            raise InferenceError(f"{p}: windows must be a .npz or .csv file")
    except OSError as exc:
        raise InferenceError(f"cannot read {p}: {exc.strerror}") from None
    except (ValueError, KeyError) as exc:
        if isinstance(exc, InferenceError):
            raise
        raise InferenceError(f"{p}: {exc}") from None
    if not np.isfinite(x).all():
        raise InferenceError(f"{p}: windows contain NaN or Inf")
    return x, y


def predictions_document(model: OnnxModel, x: np.ndarray, y: np.ndarray | None, extra: dict[str, Any] | None = None
                         ) -> dict[str, Any]:
    """JSON-friendly predictions (labels, probabilities, accuracy when ``y`` is given)."""
    out = model.predict(x)
    doc: dict[str, Any] = {
        "n": int(len(x)), "labels": out["label"].tolist(),
        "probabilities": np.round(out["probability"], 6).tolist(),
        "logits": out["logits"].astype(float).tolist(),
        **(extra or {}),
    }
    if y is not None and len(y) == len(x) and len(x):
        doc["accuracy"] = float((out["label"] == y).mean())
    return doc
