"""Consensus-based federated averaging (CFA; Savazzi, Nicoli, Rampa 2019, cited as [18]
in DecHW seed 001 §V-A4; rule fixed by ALGORITHMS.md "DecHW", baselines).

Pure numpy; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def consensus_step(
    own: Mapping[str, np.ndarray],
    neighbours: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    epsilon: float,
) -> dict[str, np.ndarray]:
    """One CFA consensus step: ``w_i ← w_i + ε Σ_{j∈N_i} τ_j (w_j − w_i)``.

    Args:
        own: the node's tensors ``{name: array}`` (any shapes).
        neighbours: the received neighbour models, same names/shapes/dtypes as ``own``
            (may be empty: ``own`` is returned unchanged, copied).
        weights: one τ_j >= 0 per neighbour (the caller normalises them; ALGORITHMS.md:
            τ_j = |D_j| / Σ_{k∈N_i∪{i}} |D_k|).
        epsilon: step size ε >= 0 (ALGORITHMS.md default 1/|N_i|).

    Returns:
        New arrays, each cast back to its dtype; non-floating tensors are copied from ``own``.
        Arithmetic in float64.

    Raises:
        ValueError: length mismatch, negative/non-finite weights or ε, differing names
            or shapes.
    """
    if len(neighbours) != len(weights):
        raise ValueError(f"need one weight per neighbour (got {len(neighbours)} models, {len(weights)} weights)")
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not np.isfinite(w).all():
        raise ValueError(f"weights must be finite and non-negative: {list(weights)}")
    if not (epsilon >= 0 and np.isfinite(epsilon)):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    for m in neighbours:
        if set(m) != set(own):
            raise ValueError("neighbour model has different tensor names")
    out: dict[str, np.ndarray] = {}
    for name, mine in own.items():
        if any(m[name].shape != mine.shape for m in neighbours):
            raise ValueError(f"neighbour model disagrees on the shape of {name!r}")
        if mine.dtype.kind != "f":
            out[name] = np.array(mine, copy=True)
            continue
        base = np.asarray(mine, dtype=np.float64)
        delta = np.zeros_like(base)
        for wj, m in zip(w, neighbours):
            delta += wj * (np.asarray(m[name], dtype=np.float64) - base)
        out[name] = (base + epsilon * delta).astype(mine.dtype)
    return out
