"""Sensor windows for inference (no torch): reading them, and the predictions document.

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

from dfl_agent.onnx_model import InferenceError, OnnxModel


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
