"""Gradient Thresholding geometry (seed 003, MoDeFL thesis ch. 5, §5.3.1, Alg. 2-4).

Pure numpy over *named tensors* (``{layer name: array}``, one entry per model tensor,
as :func:`dfl_agent.learning.params.model_to_numpy` returns).  Every gradient here is an
*accumulated* gradient G_i^Σ: the sum of the gradient steps an actor applied since the
last synchronization, in gradient units (parameters / learning rate), i.e.
``G = (M_R − M_i) / η`` with M_R the reference (last synchronized) parameters.

* :func:`forecast_update`   — the forecast G̃ of the next synchronized gradient (Eq. 5.1,
  Alg. 4 lines 6-10): an exponential moving average of *directions*, scaled to the
  length of the newest synchronized gradient Ḡ.
* :func:`distance_weights`  — the weights W of the weighted euclidean distance (Eq. 5.3,
  Alg. 3): W = 1 / max(|G̃|, layer-median(|G̃|)).
* :func:`threshold_extent`  — ρ after k epochs without synchronization,
  ρ = (1 + 1/k) · θ_α^(k−1) (Eq. 5.2's factor with the decay θ_α; ALGORITHMS.md).
* :func:`threshold_test`    — the cylindrical threshold region (Eq. 5.2, Alg. 2):
  projected distance ‖proj(G) − G̃‖₂ ≤ ρ‖G̃‖₂ and projection (lateral) distance
  ‖G − proj(G)‖_W ≤ θ_ρ ρ ‖G̃‖_W.

Conventions fixed here (the thesis leaves them open):

* ``‖x‖_W = sqrt(Σ_j W_j x_j²)`` (the usual weighted euclidean norm);
* a layer whose median |G̃| is 0 (at least half of its entries have a zero forecast, e.g.
  the rows of dead ReLU units) makes Eq. 5.3 undefined: W = 1/|G̃| is infinite on the zero
  entries and the median cap does not act on the others.  Two readings, chosen with
  ``zero_median`` (:data:`ZERO_MEDIAN_MODES`):

  - ``"floor"`` (default): the cap is floored at ``eps_rel · max|G̃|`` (default 1e-12
    relative; 1e-30 absolute when G̃ = 0), so the weights stay finite and the lateral test
    stays on, at its strictest (W = 1/|G̃_j| uncapped on the live entries);
  - ``"skip_lateral"``: what an unguarded floating-point implementation of Alg. 2-3 does:
    1/0 = inf, inf·0 = NaN, so ‖G̃‖_W and ‖G − proj(G)‖_W are NaN and the comparison
    ``d_L > d_L^max`` (Alg. 2 line 11) is false: only the projected test (and the decay)
    can call for a synchronization.  For reproducing the thesis's numbers (bench/gt);
* a zero forecast (no synchronization yet) cannot define a region: the test answers
  "needs synchronization".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

Tensors = Mapping[str, np.ndarray]

#: readings of Eq. 5.3 when a layer's median |G̃| is 0 (see the module docstring)
ZERO_MEDIAN_MODES = ("floor", "skip_lateral")


def _f64(tensors: Tensors) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}


def dot(a: Tensors, b: Tensors) -> float:
    """Inner product Σ_layers Σ_j a_j b_j of two same-layout named tensors (float64).

    Raises:
        KeyError: a name of ``a`` is missing in ``b``.  ValueError: shapes differ.
    """
    return float(sum(np.vdot(np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)) for k in a))


def norm(a: Tensors) -> float:
    """Euclidean norm ‖a‖₂ over all layers."""
    return math.sqrt(max(dot(a, a), 0.0))


def weighted_norm(a: Tensors, w: Tensors) -> float:
    """Weighted euclidean norm ‖a‖_W = sqrt(Σ_j W_j a_j²) (Eq. 5.2, Alg. 2 lines 9-10)."""
    return math.sqrt(float(sum((np.asarray(w[k], np.float64) * np.asarray(a[k], np.float64) ** 2).sum() for k in a)))


def distance_weights(forecast: Tensors, eps_rel: float = 1e-12) -> dict[str, np.ndarray]:
    """Weights W of the weighted distance (Eq. 5.3, Alg. 3).

    ``W = max∘(|G̃|, med(|G̃|))^∘−1`` per layer: small forecast changes get large weights
    (sensitive dimensions), capped at the inverse of the layer's median |G̃|.

    Args:
        forecast: G̃, named float arrays of any shapes.
        eps_rel: floor of the cap, relative to max|G̃| over all layers (guards a zero median).

    Returns:
        float64 arrays of the forecast's names and shapes, all > 0 and finite.
    """
    f = _f64(forecast)
    peak = max((float(np.abs(v).max()) for v in f.values() if v.size), default=0.0)
    floor = max(eps_rel * peak, 1e-30)
    out = {}
    for k, v in f.items():
        a = np.abs(v)
        med = float(np.median(a)) if a.size else 0.0
        out[k] = 1.0 / np.maximum(np.maximum(a, med), floor)
    return out


def threshold_extent(k: int, theta_alpha: float) -> float:
    """ρ after ``k >= 1`` epochs without synchronization: (1 + 1/k) · θ_α^(k−1).

    The factor 1 + 1/(k − k_s) of Eq. 5.2 times the threshold decay θ_α ∈ (0, 1] (§5.3.1,
    "Threshold Decay"), applied to both thresholds.

    Raises:
        ValueError: ``k < 1`` or θ_α outside (0, 1].
    """
    if k < 1:
        raise ValueError(f"epochs since the last synchronization must be >= 1, got {k}")
    if not 0.0 < theta_alpha <= 1.0:
        raise ValueError(f"theta_alpha must be in (0, 1], got {theta_alpha}")
    return (1.0 + 1.0 / k) * theta_alpha ** (k - 1)


@dataclasses.dataclass(frozen=True)
class ThresholdResult:
    """Outcome of :func:`threshold_test` (distances in gradient units).

    Attributes:
        needs_sync: the accumulated gradient left the threshold region (the vote).
        reason: ``"projected"``, ``"lateral"``, ``"no_forecast"`` or ``""`` (inside).
        projected: ‖proj(G) − G̃‖₂ (Alg. 2 line 4).
        projected_max: ρ‖G̃‖₂ (line 3).
        lateral: ‖G − proj(G)‖_W (line 10).
        lateral_max: θ_ρ ρ ‖G̃‖_W (line 9).
        lateral_skipped: the lateral test was not applied (``zero_median = "skip_lateral"``
            and some layer's median |G̃| is 0); ``lateral`` and ``lateral_max`` are NaN then.
    """

    needs_sync: bool
    reason: str
    projected: float
    projected_max: float
    lateral: float
    lateral_max: float
    lateral_skipped: bool = False


def zero_median_layers(forecast: Tensors) -> list[str]:
    """Names of the layers whose median |G̃| is 0, where Eq. 5.3 is undefined (module docstring)."""
    return [k for k, v in forecast.items() if np.size(v) and float(np.median(np.abs(np.asarray(v, np.float64)))) == 0.0]


def threshold_test(forecast: Tensors, accumulated: Tensors, rho: float, theta_rho: float,
                   zero_median: str = "floor") -> ThresholdResult:
    """``RequiresSynchronization`` (Alg. 2; region of Eq. 5.2, weights of Eq. 5.3).

    The test is invariant to a common scale of G and G̃ (both thresholds scale with them:
    ‖·‖₂ linearly, ‖·‖_W with the square root), so the unit of the gradients (divided by
    the learning rate or not) does not change any verdict.

    Args:
        forecast: G̃ (named tensors).
        accumulated: G_i^Σ, same names and shapes.
        rho: threshold extent ρ > 0 (see :func:`threshold_extent`).
        theta_rho: lateral sensitivity θ_ρ > 0.
        zero_median: reading of Eq. 5.3 for a layer with median |G̃| = 0, one of
            :data:`ZERO_MEDIAN_MODES` (module docstring).

    Returns:
        :class:`ThresholdResult`; both distances are computed even when the first
        already fails (for the status and the thesis's Fig. 5.5/5.6 style plots).

    Raises:
        ValueError: ρ or θ_ρ not positive, unknown ``zero_median``.  KeyError/ValueError:
            layouts differ.
    """
    if not rho > 0 or not theta_rho > 0:
        raise ValueError(f"rho and theta_rho must be > 0, got {rho}, {theta_rho}")
    if zero_median not in ZERO_MEDIAN_MODES:
        raise ValueError(f"zero_median must be one of {ZERO_MEDIAN_MODES}, got {zero_median!r}")
    f, g = _f64(forecast), _f64(accumulated)
    ff = dot(f, f)
    if not ff > 0:
        return ThresholdResult(True, "no_forecast", math.inf, 0.0, math.inf, 0.0)
    c = dot(g, f) / ff  # proj(G) = c G̃
    f_norm = math.sqrt(ff)
    projected = abs(c - 1.0) * f_norm  # ‖c G̃ − G̃‖₂
    projected_max = rho * f_norm
    if zero_median == "skip_lateral" and zero_median_layers(f):
        reason = "projected" if projected > projected_max else ""
        return ThresholdResult(bool(reason), reason, projected, projected_max, math.nan, math.nan, True)
    w = distance_weights(f)
    lateral = weighted_norm({k: g[k] - c * f[k] for k in f}, w)
    lateral_max = theta_rho * rho * weighted_norm(f, w)
    reason = "projected" if projected > projected_max else "lateral" if lateral > lateral_max else ""
    return ThresholdResult(bool(reason), reason, projected, projected_max, lateral, lateral_max)


def forecast_update(forecast: Tensors | None, synced: Tensors, theta_beta: float) -> dict[str, np.ndarray]:
    """The new forecast G̃_(k) from the newest synchronized gradient Ḡ_(k) (Eq. 5.1; Alg. 4 l. 6-10).

    ``G̃ = Ḡ`` when there is no (or a zero) previous forecast; otherwise
    ``v = θ_β Ḡ/‖Ḡ‖ + (1−θ_β) G̃/‖G̃‖`` and ``G̃_new = ‖Ḡ‖ · v/‖v‖``.
    A zero Ḡ or a zero v (exactly opposite directions with θ_β = ½) keeps the previous
    direction scaled to ‖Ḡ‖ (= 0 for a zero Ḡ).

    Args:
        forecast: previous G̃_(k−1) or ``None``.
        synced: Ḡ_(k), the averaged accumulated gradient.
        theta_beta: EMA coefficient θ_β ∈ [0, 1].

    Returns:
        float64 named tensors.

    Raises:
        ValueError: θ_β outside [0, 1].
    """
    if not 0.0 <= theta_beta <= 1.0:
        raise ValueError(f"theta_beta must be in [0, 1], got {theta_beta}")
    s = _f64(synced)
    s_norm = norm(s)
    if forecast is None or not norm(forecast) > 0:
        return s
    p = _f64(forecast)
    p_norm = norm(p)
    if not s_norm > 0:
        return {k: 0.0 * v for k, v in p.items()}
    v = {k: theta_beta * s[k] / s_norm + (1.0 - theta_beta) * p[k] / p_norm for k in s}
    v_norm = norm(v)
    if not v_norm > 0:
        return {k: s_norm * p[k] / p_norm for k in p}
    return {k: s_norm * v[k] / v_norm for k in v}


def accumulated_gradient(reference: Tensors, current: Tensors, lr: float) -> dict[str, np.ndarray]:
    """G^Σ = (M_R − M) / η: the summed gradient steps applied since the reference (float64).

    Non-floating tensors (counters) get zeros.

    Raises:
        ValueError: η not positive.
    """
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    out = {}
    for k, r in reference.items():
        r = np.asarray(r)
        if r.dtype.kind != "f":
            out[k] = np.zeros(r.shape, np.float64)
        else:
            out[k] = (r.astype(np.float64) - np.asarray(current[k], np.float64)) / lr
    return out


def mean_gradient(gradients: list[Tensors]) -> dict[str, np.ndarray]:
    """Ḡ = (1/|N|) Σ_j G_j (Alg. 4 line 4), float64.

    Raises:
        ValueError: empty list.
    """
    if not gradients:
        raise ValueError("need at least one gradient to average")
    return {k: np.asarray(sum(np.asarray(g[k], np.float64) for g in gradients) / len(gradients)) for k in gradients[0]}


def apply_gradient(reference: Tensors, gradient: Tensors, lr: float) -> dict[str, np.ndarray]:
    """``ApplyGradient`` (Alg. 4 line 5): M_R − η Ḡ, cast back to each tensor's dtype.

    Non-floating tensors are copied from ``reference``.
    """
    out = {}
    for k, r in reference.items():
        r = np.asarray(r)
        if r.dtype.kind != "f":
            out[k] = np.array(r, copy=True)
        else:
            out[k] = np.ascontiguousarray((r.astype(np.float64) - lr * np.asarray(gradient[k], np.float64)).astype(r.dtype))
    return out
