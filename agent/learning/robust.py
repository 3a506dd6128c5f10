"""Robust aggregation rules against poisoned (Byzantine) model updates.

A node that averages its neighbours' models trusts each of them with a share of its
own model; one malicious or broken neighbour can then move the average anywhere.
These rules bound that influence.  All work on models as ``{name: ndarray}`` with
identical names and shapes (checked; ``ValueError`` otherwise); floating tensors
are computed in float64 and cast back, non-floating tensors (counters) are taken
from the first model (the node's own).

* :func:`clip_updates` - norm clipping (Sun et al. 2019, "Can you really backdoor
  federated learning?", §4: ``Δ_k ← Δ_k / max(1, ‖Δ_k‖₂ / M)``), here applied to a
  neighbour's *deviation from our own model* ``Δ_k = w_k − w_own`` with ``M`` given or,
  when 0, the median of the neighbours' deviation norms (adaptive).
* :func:`coordinate_median` - coordinate-wise median (Yin et al. 2018, "Byzantine-
  robust distributed learning", Option I "median"), unweighted.
* :func:`trimmed_mean` - coordinate-wise β-trimmed mean (Yin et al. 2018, Option II):
  per coordinate drop the ⌊βK⌋ largest and ⌊βK⌋ smallest values, average the rest.
* :func:`robust_aggregate` - the dispatcher behind the algorithms' ``aggregation``
  option (``mean`` = the plain sample-weighted average, ``clip``, ``median``,
  ``trimmed_mean``).

Shapes: K models, each tensor of any shape; the result has the shapes of the inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dfl_agent.learning.aggregation import check_same_layout, weighted_average

AGGREGATIONS = ("mean", "clip", "median", "trimmed_mean")

Model = Mapping[str, np.ndarray]


def check_options(aggregation: str, clip_norm: float, trim_ratio: float) -> None:
    """Validate the ``aggregation``/``clip_norm``/``trim_ratio`` algorithm options.

    Raises:
        ValueError: unknown rule, negative ``clip_norm``, ``trim_ratio`` outside [0, 0.5).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if not clip_norm >= 0:
        raise ValueError(f"clip_norm must be >= 0 (0 = median of the deviation norms), got {clip_norm}")
    if not 0 <= trim_ratio < 0.5:
        raise ValueError(f"trim_ratio must be in [0, 0.5), got {trim_ratio}")


def _float_names(model: Model) -> list[str]:
    return [n for n, a in model.items() if np.asarray(a).dtype.kind == "f"]


def deviation_norm(model: Model, reference: Model) -> float:
    """L2 norm of ``model − reference`` over all floating tensors (one flat vector)."""
    total = 0.0
    for name in _float_names(reference):
        d = model[name].astype(np.float64) - reference[name].astype(np.float64)
        total += float(np.dot(d.ravel(), d.ravel()))
    return float(np.sqrt(total))


def clip_updates(models: Sequence[Model], reference: Model, max_norm: float = 0.0) -> tuple[list[dict[str, np.ndarray]], float]:
    """Clip each model's deviation from ``reference`` to L2 norm ``max_norm``.

    ``w_k ← reference + (w_k − reference) · min(1, M / ‖w_k − reference‖₂)``.

    Args:
        models: K models (e.g. the neighbours'), same layout as ``reference``.
        reference: the node's own model.
        max_norm: M; 0 means the median of the K deviation norms.

    Returns:
        ``(clipped models, M used)``.

    Raises:
        ValueError: layouts differ, or ``max_norm < 0``.
    """
    if max_norm < 0:
        raise ValueError("max_norm must be >= 0")
    if not models:
        return [], float(max_norm)
    check_same_layout([reference, *models])
    norms = [deviation_norm(m, reference) for m in models]
    bound = float(max_norm) if max_norm > 0 else float(np.median(norms))
    out = []
    for m, n in zip(models, norms):
        scale = 1.0 if n <= bound or n == 0 else bound / n
        clipped = {}
        for name, a in m.items():
            if a.dtype.kind != "f" or scale == 1.0:
                clipped[name] = np.array(a, copy=True)
            else:
                r = reference[name].astype(np.float64)
                clipped[name] = (r + (a.astype(np.float64) - r) * scale).astype(a.dtype)
        out.append(clipped)
    return out, bound


def _coordinatewise(models: Sequence[Model], fn) -> dict[str, np.ndarray]:
    if not models:
        raise ValueError("need at least one model")
    check_same_layout(models)
    out: dict[str, np.ndarray] = {}
    for name, first in models[0].items():
        if first.dtype.kind != "f":
            out[name] = np.array(first, copy=True)
            continue
        stack = np.stack([m[name].astype(np.float64) for m in models])  # (K, *shape)
        out[name] = fn(stack).astype(first.dtype)
    return out


def coordinate_median(models: Sequence[Model]) -> dict[str, np.ndarray]:
    """Coordinate-wise median of K models (unweighted; K even: mean of the middle two).

    Tolerates up to ⌈K/2⌉−1 arbitrary models per coordinate.

    Raises:
        ValueError: no models, or layouts differ.
    """
    return _coordinatewise(models, lambda s: np.median(s, axis=0))


def trimmed_mean(models: Sequence[Model], trim_ratio: float = 0.2) -> dict[str, np.ndarray]:
    """Coordinate-wise trimmed mean: per coordinate drop ``b = ⌊β·K⌋`` lowest and ``b``
    highest of the K values and average the remaining ``K − 2b`` (unweighted).

    Args:
        trim_ratio: β in [0, 0.5); 0 is the plain mean.

    Raises:
        ValueError: no models, layouts differ, or β outside [0, 0.5).
    """
    if not 0 <= trim_ratio < 0.5:
        raise ValueError(f"trim_ratio must be in [0, 0.5), got {trim_ratio}")
    k = len(models)
    b = int(np.floor(trim_ratio * k))

    def fn(stack: np.ndarray) -> np.ndarray:
        if b == 0:
            return stack.mean(axis=0)
        return np.sort(stack, axis=0)[b : k - b].mean(axis=0)

    return _coordinatewise(models, fn)


def robust_aggregate(
    own: Model, others: Sequence[Model], weights: Sequence[float], rule: str = "mean",
    *, clip_norm: float = 0.0, trim_ratio: float = 0.2,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Aggregate the node's own model with its neighbours' by ``rule``.

    Args:
        own: this node's model (first; the clipping reference).
        others: the neighbours' models.
        weights: 1 + len(others) non-negative weights (sample counts), own first;
            used by ``mean`` and ``clip``; ``median`` and ``trimmed_mean`` are unweighted.
        rule: ``mean`` (:func:`~dfl_agent.learning.aggregation.weighted_average`), ``clip``
            (:func:`clip_updates` on ``others``, then the weighted average), ``median``
            (:func:`coordinate_median`), ``trimmed_mean`` (:func:`trimmed_mean`).

    Returns:
        ``(model, info)``; ``info`` has ``clip_norm`` for ``clip``.

    Raises:
        ValueError: unknown rule, or errors of the underlying rule.
    """
    check_options(rule, clip_norm, trim_ratio)
    models = [own, *others]
    if rule == "mean":
        return weighted_average(models, weights), {}
    if rule == "clip":
        clipped, bound = clip_updates(others, own, clip_norm)
        return weighted_average([own, *clipped], weights), {"clip_norm": bound}
    if rule == "median":
        return coordinate_median(models), {}
    return trimmed_mean(models, trim_ratio), {}
