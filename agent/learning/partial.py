"""Partial-training aggregation of width-scaled models (seed 000 App. A.3.3, Eq. 6, 8, 9).

Models of one family that differ only in width (DFML's H1 mode) are sub-models of the
largest one, W_g.  Along every dimension where a sub-model is narrower (j < J), it
holds the indices X of W_g's dimension:

- HeteroFL (Eq. 8): ``X = {0, …, j−1}``;
- FedRolex (Eq. 9): ``X = {t̃, …, t̃+j−1} mod J`` with ``t̃ = t mod J`` (a window rolling
  one index per round).

The index set depends only on (scheme, t, J, j), so the output channels of layer i and
the input channels of layer i+1 (both of size J_i) always get the same indices.
Aggregation (Eq. 6) averages, at every position of W_g, the participants that hold it,
with equal client weights d_n = 1/|P|; each participant then gets its slice back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

SCHEMES = ("heterofl", "fedrolex")


def sub_indices(scheme: str, t: int, J: int, j: int) -> np.ndarray:
    """Indices of a width-``j`` sub-dimension inside a width-``J`` dimension (Eq. 8 / 9).

    Raises:
        ValueError: unknown scheme or ``not 1 <= j <= J``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partial-training scheme {scheme!r}; known: {SCHEMES}")
    if not 1 <= j <= J:
        raise ValueError(f"sub-dimension {j} does not fit in {J}")
    if scheme == "heterofl" or j == J:
        return np.arange(j)
    start = t % J
    return (start + np.arange(j)) % J


def check_sub_model(sub: Mapping[str, np.ndarray], full: Mapping[str, np.ndarray]) -> None:
    """Raise ``ValueError`` unless ``sub`` is a width-scaled version of ``full``
    (same tensor names and ranks, every dimension no larger)."""
    if set(sub) != set(full):
        raise ValueError("partial training needs models of one family differing only in width (same layers)")
    for k, a in sub.items():
        g = full[k]
        if a.ndim != g.ndim or any(x > y for x, y in zip(a.shape, g.shape)):
            raise ValueError(f"{k}: {list(a.shape)} is not a width-scaled slice of {list(g.shape)}")


def _ix(scheme: str, t: int, sub_shape: Sequence[int], full_shape: Sequence[int]) -> tuple[np.ndarray, ...]:
    return np.ix_(*[sub_indices(scheme, t, J, j) for j, J in zip(sub_shape, full_shape)])


def aggregate_partial(
    models: Sequence[Mapping[str, np.ndarray]], scheme: str, t: int
) -> list[dict[str, np.ndarray]]:
    """Eq. 6: average width-scaled models position by position; return each one's new slice.

    Args:
        models: participants' state dicts (name -> array); the largest (by total size)
            defines W_g and must contain every other one as a slice.
        scheme: ``heterofl`` or ``fedrolex``; t: the round (FedRolex's rolling offset).

    Returns:
        One state dict per input model, same shapes as that input.

    Raises:
        ValueError: models that are not width-scaled versions of the largest.
    """
    if not models:
        raise ValueError("nothing to aggregate")
    full = max(models, key=lambda m: sum(a.size for a in m.values()))
    for m in models:
        check_sub_model(m, full)
    out_g: dict[str, np.ndarray] = {}
    for k, g in full.items():
        if g.dtype.kind != "f":
            out_g[k] = g.copy()
            continue
        acc = np.zeros(g.shape, np.float64)
        cnt = np.zeros(g.shape, np.float64)
        for m in models:
            ix = _ix(scheme, t, m[k].shape, g.shape)
            acc[ix] += m[k]
            cnt[ix] += 1.0
        out_g[k] = np.where(cnt > 0, acc / np.maximum(cnt, 1.0), g).astype(g.dtype)
    return [{k: out_g[k][_ix(scheme, t, m[k].shape, full[k].shape)].astype(m[k].dtype) for k in m} for m in models]
