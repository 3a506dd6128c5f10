"""Aggregation rules over named parameter tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

#: float64 elements of the block buffer weighted_average fills (1 MiB: stays in cache)
_BLOCK_ELEMENTS = 1 << 17


def check_same_layout(models: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Raise ``ValueError`` unless all models have the same tensor names and shapes."""
    names = models[0].keys()
    for m in models[1:]:
        if m.keys() != names:
            raise ValueError("models to average have different tensor names")
    for name, first in models[0].items():
        shape = first.shape
        if any(m[name].shape != shape for m in models):
            raise ValueError(f"models to average disagree on the shape of {name!r}")


def weighted_average(
    models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]
) -> dict[str, np.ndarray]:
    """Weighted average of models, parameter by parameter.

    FedAvg's rule (McMahan et al. 2017; Def-KT seed 004 Eq. 9 "FullAvg"):
    ``w = Σ_k (n_k / Σ_j n_j) · w_k`` with ``n_k`` the weights (sample counts).
    Floating tensors are averaged in float64 and cast back to their dtype;
    non-floating tensors (counters) are taken from the first model.

    Args:
        models: K >= 1 mappings with identical names, shapes and dtypes.
        weights: K non-negative numbers with a positive sum.

    Raises:
        ValueError: empty input, length mismatch, negative or all-zero weights,
            or models whose names/shapes differ.
    """
    if not models or len(models) != len(weights):
        raise ValueError(f"need as many weights as models (got {len(models)} models, {len(weights)} weights)")
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative, with a positive sum: {weights}")
    w = w / w.sum()
    check_same_layout(models)
    out: dict[str, np.ndarray] = {}
    for name, first in models[0].items():
        shape = first.shape
        column = [m[name] for m in models]
        if first.dtype.kind != "f":
            out[name] = np.array(first, copy=True)
            continue
        # Σ_k w_k · float64(m_k): blocks of models copied (cast) into one float64 buffer,
        # then one matrix-vector product per block (no per-model temporaries, BLAS speed:
        # a node averaging a thousand neighbours stays cheap)
        flat = first.size
        rows = max(1, min(len(models), _BLOCK_ELEMENTS // max(flat, 1)))
        buf = np.empty((rows, flat), dtype=np.float64)
        acc = np.zeros(flat, dtype=np.float64)
        for start in range(0, len(models), rows):
            part = column[start:start + rows]
            block = buf[: len(part)]
            for j, a in enumerate(part):
                block[j].reshape(shape)[...] = a
            acc += w[start:start + len(part)] @ block
        out[name] = acc.reshape(first.shape).astype(first.dtype)
    return out
