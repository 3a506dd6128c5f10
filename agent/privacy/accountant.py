"""The privacy accountant: Rényi DP of the sampled Gaussian mechanism, in numpy and scipy.

One DP-SGD step samples every example with probability ``q`` (Poisson sampling), clips each
per-example gradient to norm ``C`` and adds Gaussian noise of standard deviation ``σ·C``: the
sampled Gaussian mechanism (SGM) with noise multiplier ``σ``.  Its Rényi divergence of order
``α`` is computed as in Mironov, Talwar and Zhang, "Rényi Differential Privacy of the Sampled
Gaussian Mechanism" (2019), section 3.3: a finite binomial sum for integer orders, a convergent
series with the complementary error function for fractional ones.  RDP composes by addition, over
the steps of a run and over every run of the device's life; the total converts to (ε, δ)-DP with
the bound of Balle et al., "Hypothesis Testing Interpretations and Rényi Differential Privacy"
(2020, theorem 21), minimised over the orders.  The orders and the conversion are those of
Opacus's ``RDPAccountant``, so both give the same ε for the same history.

Importing this module imports numpy only (never torch): admission runs in the torch-free
supervisor.  SciPy's special functions are imported when a history with noise is first
accounted, so a device without DP (and an idle supervisor) never loads SciPy; it comes with the
``privacy`` extra.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np

#: The Rényi orders searched for the best conversion (Opacus's RDPAccountant uses the same).
ORDERS: tuple[float, ...] = tuple([1.0 + k / 10.0 for k in range(1, 100)] + [float(a) for a in range(12, 64)])

#: The largest noise multiplier :func:`noise_for_epsilon` considers.
MAX_NOISE = 1000.0

_TAIL = -30.0  # a fractional order's series stops once both terms fall below e^-30


def _special() -> ModuleType:
    """``scipy.special``, imported on first use (only DP accounting needs it).

    Raises:
        ModuleNotFoundError: SciPy is not installed; one line naming the ``privacy`` extra.
    """
    try:
        from scipy import special
    except ModuleNotFoundError as exc:
        from dfl_agent.extras import extra_hint

        raise ModuleNotFoundError(f"the privacy accountant needs SciPy, which is not installed: "
                                  f"{extra_hint('privacy')}", name="scipy") from exc
    return special


def _log_terms_int(q: float, sigma: float, alpha: int) -> float:
    """log A_α for an integer order: log Σ_k C(α,k) q^k (1-q)^(α-k) exp((k²-k)/(2σ²))."""
    special = _special()
    k = np.arange(alpha + 1, dtype=float)
    log_binom = special.gammaln(alpha + 1.0) - special.gammaln(k + 1.0) - special.gammaln(alpha - k + 1.0)
    terms = log_binom + k * math.log(q) + (alpha - k) * math.log1p(-q) + (k * k - k) / (2.0 * sigma * sigma)
    return float(special.logsumexp(terms))


def _log_terms_frac(q: float, sigma: float, alpha: float) -> float:
    """log A_α for a fractional order: the two-sided series with erfc, summed until it converges.

    The generalised binomial coefficients change sign past ``k > α``; the sum is taken in log
    space with signs (``scipy.special.logsumexp`` with ``b``)."""
    special = _special()
    z0 = sigma * sigma * math.log(1.0 / q - 1.0) + 0.5
    log_q, log_1q = math.log(q), math.log1p(-q)
    two_s2 = 2.0 * sigma * sigma
    scale = math.sqrt(2.0) * sigma
    logs: list[np.ndarray] = []
    signs: list[np.ndarray] = []
    start, chunk = 0, 64
    while True:
        k = np.arange(start, start + chunk, dtype=float)
        coef = special.binom(alpha, k)
        log_coef = np.log(np.abs(coef))
        j = alpha - k
        # log(erfc(x) / 2) = log Φ(-x·√2)
        log_e0 = special.log_ndtr(-(k - z0) / scale * math.sqrt(2.0))
        log_e1 = special.log_ndtr(-(z0 - j) / scale * math.sqrt(2.0))
        s0 = log_coef + k * log_q + j * log_1q + (k * k - k) / two_s2 + log_e0
        s1 = log_coef + j * log_q + k * log_1q + (j * j - j) / two_s2 + log_e1
        sign = np.where(coef > 0, 1.0, -1.0)
        small = np.maximum(s0, s1) < _TAIL
        if small.any():
            stop = int(np.argmax(small)) + 1  # the first term below the tail is the last one counted
            logs += [s0[:stop], s1[:stop]]
            signs += [sign[:stop], sign[:stop]]
            break
        logs += [s0, s1]
        signs += [sign, sign]
        start += chunk
    value, sgn = special.logsumexp(np.concatenate(logs), b=np.concatenate(signs), return_sign=True)
    if sgn <= 0:  # pragma: no cover - the series is positive; rounding only
        return -math.inf
    return float(value)


def _rdp_one_step(q: float, sigma: float, alpha: float) -> float:
    """RDP of order ``alpha`` of one step of the SGM with sampling rate ``q`` and noise ``sigma``."""
    if q == 0.0:
        return 0.0
    if sigma == 0.0:
        return math.inf
    if q == 1.0:
        return alpha / (2.0 * sigma * sigma)
    if float(alpha).is_integer():
        log_a = _log_terms_int(q, sigma, int(alpha))
    else:
        log_a = _log_terms_frac(q, sigma, alpha)
    return log_a / (alpha - 1.0)


def rdp_curve(noise_multiplier: float, sample_rate: float, steps: int) -> np.ndarray:
    """RDP at every order of :data:`ORDERS` of ``steps`` steps of the SGM (composition: a sum).

    Raises:
        ValueError: a negative noise multiplier or steps, a sampling rate outside [0, 1].
    """
    sigma, q, n = float(noise_multiplier), float(sample_rate), int(steps)
    if not sigma >= 0.0 or not math.isfinite(sigma):
        raise ValueError(f"noise multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling rate must be in [0, 1], got {sample_rate!r}")
    if n < 0:
        raise ValueError(f"steps must be >= 0, got {steps!r}")
    if n == 0 or q == 0.0:
        return np.zeros(len(ORDERS))
    return np.array(_step_curve(q, sigma)) * n


@functools.lru_cache(maxsize=256)
def _step_curve(q: float, sigma: float) -> tuple[float, ...]:
    """One step's RDP at every order (cached: a device's runs repeat the same σ and q)."""
    return tuple(_rdp_one_step(q, sigma, a) for a in ORDERS)


def orders_id() -> str:
    """A short fingerprint of :data:`ORDERS` (an RDP curve stored as numbers is only valid for
    the orders it was computed at)."""
    return hashlib.sha256(repr(ORDERS).encode("ascii")).hexdigest()[:16]


def epsilon_from_rdp(rdp: np.ndarray, delta: float) -> float:
    """ε at ``delta`` of a composed RDP curve (over :data:`ORDERS`), the best order's.

    ε(α) = RDP(α) + log((α-1)/α) - (log δ + log α)/(α-1)  (Balle et al. 2020, theorem 21).
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    orders = np.asarray(ORDERS)
    with np.errstate(invalid="ignore"):
        eps = rdp + np.log((orders - 1.0) / orders) - (math.log(delta) + np.log(orders)) / (orders - 1.0)
    if np.isnan(eps).all():
        return math.inf
    return max(0.0, float(np.nanmin(eps)))


def rdp_epsilon(history: Sequence[tuple[float, float, int]], delta: float,
                base: Sequence[float] | None = None) -> float:
    """The composed ε at ``delta`` of a device's whole DP history.

    Args:
        history: one ``(noise_multiplier, sampling_rate, steps)`` per run (or per part of a run).
        delta: the δ of the guarantee.
        base: an RDP curve already composed (over :data:`ORDERS`, one value per order: older
            runs folded by the privacy ledger), added to the history's.

    Returns:
        ε (0.0 for an empty history, ``inf`` where a step had no noise).
    """
    if not history and base is None:
        return 0.0
    total = np.zeros(len(ORDERS)) if base is None else np.asarray(base, dtype=np.float64)
    for sigma, q, steps in history:
        total = total + rdp_curve(sigma, q, steps)
    if (total == 0.0).all():
        return 0.0
    return epsilon_from_rdp(total, delta)


def noise_for_epsilon(target_epsilon: float, q: float, steps: int, delta: float,
                      history: Sequence[tuple[float, float, int]] = ()) -> float:
    """The smallest noise multiplier whose run of ``steps`` steps at rate ``q`` spends at most
    ``target_epsilon`` at ``delta``, the run alone (the target is per run; ``history``, the
    device's earlier runs, does not change it: the lifetime budget is checked at admission).

    Found by bisection to a relative precision of 1e-4, rounded up: the σ returned always keeps
    the run's ε at or below the target.

    Raises:
        ValueError: a target that is not > 0, or one that no σ up to :data:`MAX_NOISE` reaches.
    """
    del history  # the target is this run's spend alone
    if not (target_epsilon > 0.0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")

    def spend(sigma: float) -> float:
        return rdp_epsilon([(sigma, q, steps)], delta)

    if spend(MAX_NOISE) > target_epsilon:
        raise ValueError(f"no noise multiplier up to {MAX_NOISE:g} keeps the run's epsilon at or below "
                         f"{target_epsilon:g} ({steps} steps at sampling rate {q:.4g}, delta {delta:g})")
    lo, hi = 0.0, 1.0
    while spend(hi) > target_epsilon:
        lo, hi = hi, min(hi * 2.0, MAX_NOISE)
    while hi - lo > 1e-4 * hi:
        mid = 0.5 * (lo + hi)
        if spend(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi
