"""DFML's cyclic α schedule (seed 000 §3.2.1, Eq. 4, App. A.2 / Fig. 11).

Eq. 4 as printed is a single cosine decay, not a cycle.  ALGORITHMS.md fixes the
warm-restart form: cycle k lasts ``P_k`` rounds after its start round ``s_k`` (the
phase ``t_c = t − s_k`` runs over ``0..P_k``), ``P_0 = 10`` and ``P_{k+1} = P_k + 10``
(additive, default) or ``P_k · factor`` (multiplicative).  Within a cycle, shape
``rise`` (default) goes from α_min up to α_max::

    α(t) = α_min + (α_max − α_min) · ½ (1 − cos(π t_c / P_k))

and shape ``full`` rises and falls back: ``½ (1 − cos(2π t_c / P_k))``.  The next
cycle starts at ``s_{k+1} = s_k + P_k + 1``.  ``fixed`` keeps α constant (ablation).

The state ``(cycle, cycle_start, period)`` travels with DFML's token so the next
aggregator continues the schedule (seed App. A.2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class AlphaState:
    """Schedule position: cycle index k, its start round s_k (1-based), its period P_k (rounds)."""

    cycle: int = 0
    cycle_start: int = 1
    period: int = 10

    def as_meta(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_meta(meta: Any) -> AlphaState:
        """Parse the token's schedule state.

        Raises:
            ValueError: missing keys or non-positive values.
        """
        try:
            st = AlphaState(int(meta["cycle"]), int(meta["cycle_start"]), int(meta["period"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"bad alpha schedule state {meta!r}") from None
        if st.cycle < 0 or st.cycle_start < 1 or st.period < 1:
            raise ValueError(f"bad alpha schedule state {meta!r}")
        return st


@dataclasses.dataclass(frozen=True)
class CyclicAlpha:
    """The α scheduler. ``mode`` in {cyclic, fixed}; ``shape`` in {rise, full};
    ``growth`` in {additive, multiplicative}."""

    alpha_min: float = 0.0
    alpha_max: float = 0.9
    mode: str = "cyclic"
    shape: str = "rise"
    period0: int = 10
    growth: str = "additive"
    step: int = 10
    factor: float = 2.0
    alpha_fixed: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha_min <= self.alpha_max <= 1.0:
            raise ValueError(f"need 0 <= alpha_min <= alpha_max <= 1, got {self.alpha_min}, {self.alpha_max}")
        if self.mode not in ("cyclic", "fixed"):
            raise ValueError(f"alpha mode must be 'cyclic' or 'fixed', got {self.mode!r}")
        if self.shape not in ("rise", "full"):
            raise ValueError(f"alpha shape must be 'rise' or 'full', got {self.shape!r}")
        if self.growth not in ("additive", "multiplicative"):
            raise ValueError(f"period growth must be 'additive' or 'multiplicative', got {self.growth!r}")
        if self.period0 < 1 or self.step < 0 or self.factor < 1.0:
            raise ValueError("period0 must be >= 1, step >= 0, factor >= 1")
        if not 0.0 <= self.alpha_fixed <= 1.0:
            raise ValueError(f"alpha_fixed must be in [0, 1], got {self.alpha_fixed}")

    def initial(self) -> AlphaState:
        return AlphaState(0, 1, self.period0)

    def advance(self, state: AlphaState, t: int) -> AlphaState:
        """The state that covers round ``t`` (>= state.cycle_start), starting new cycles as needed."""
        while t - state.cycle_start > state.period:
            nxt = state.period + self.step if self.growth == "additive" else int(math.ceil(state.period * self.factor))
            state = AlphaState(state.cycle + 1, state.cycle_start + state.period + 1, max(1, nxt))
        return state

    def alpha(self, state: AlphaState, t: int) -> float:
        """α⁽ᵗ⁾ for round ``t`` given the state covering it (see :meth:`advance`)."""
        if self.mode == "fixed":
            return self.alpha_fixed
        tc = t - state.cycle_start
        frac = tc / state.period
        wave = 0.5 * (1 - math.cos(math.pi * frac)) if self.shape == "rise" else 0.5 * (1 - math.cos(2 * math.pi * frac))
        return self.alpha_min + (self.alpha_max - self.alpha_min) * wave
