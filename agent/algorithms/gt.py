"""``gt``: Gradient Thresholding (seed 003, thesis ch. 5); its ``local-steps`` baselines are
:mod:`dfl_agent.algorithms.local_steps`.  The lock-step protocol lives in
:mod:`dfl_agent.algorithms.protocols.lockstep`.

Lock-step epochs over a fully connected group (every live peer).  Every actor i keeps
the reference parameters M_R (the last synchronized model) and, each epoch t:

1. trains one local epoch (``ctx.train``) and computes its accumulated gradient
   G_i^Σ = (M_R − M_i)/η (Alg. 1; :func:`dfl_agent.learning.thresholding.accumulated_gradient`);
2. decides whether the group synchronizes:

   * ``gt``: tests Eq. 5.2 with the weights of Eq. 5.3 (Alg. 2-3) against the forecast
     G̃ and ρ = (1 + 1/k)·θ_α^(k−1), k = epochs since the last synchronization, and
     publishes its one-bit *vote* (kind ``gt.vote``, ``meta = {"sync": bool}``, no
     tensors).  The group synchronizes when any vote of the epoch is true
     (ALGORITHMS.md: an actor cannot know another's test result without a message);
   * ``local-steps`` (BL1-BL4): every τ epochs, by the shared schedule (no votes);
   * both: always in the first and the last epoch (no vote is sent then);

3. synchronization (Alg. 4, kind ``gt.sync``, tensors = G_i^Σ as float32, one message
   broadcast to the group): Ḡ = mean of the group's G_j^Σ (unweighted, line 4),
   M_R ← M_R − ηḠ (line 5), every actor continues from M_R; ``gt`` updates G̃ with
   Eq. 5.1 (lines 6-10) and resets ρ (k = 0).

Waiting uses the update market (:mod:`dfl_agent.algorithms.protocols.synchronization`, ``one_from_each`` with
a deadline): a peer whose vote (``vote_timeout``) or gradient (``sync_timeout``) has not
arrived by the deadline is *dropped* from the group for the rest of the run, so one
dead node cannot stall the others; a peer whose presence goes away is dropped at once.

Requirements (the thesis's Initiator provides both, Alg. 1 lines 2-9): every actor starts
from the same weights (``init = common``, the default), and the group is complete at the
first epoch: it is fixed to the peers live then (in the daemon, set
``discovery.min_peers`` to the group size − 1); later arrivals are rejected
(``not_in_group``), since their reference model would differ from the group's.

Communication: votes and synchronizations both count.  The round info and the status
report messages and bytes sent and received of each kind (``Message.wire_bytes``: the
encoded frame, envelope included; a broadcast counts once on the sending side).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.protocols.lockstep import LockStepAlgorithm, LockStepOptions
from dfl_agent.learning import thresholding as th
from dfl_agent.privacy import policy as dp_policy


@dataclasses.dataclass
class GTOptions(LockStepOptions):
    """Options of ``gt`` (defaults = ALGORITHMS.md "Gradient Thresholding").

    Attributes:
        theta_rho: θ_ρ, lateral sensitivity of the threshold region (Eq. 5.2; thesis: 2 on Iris).
        theta_beta: θ_β ∈ [0, 1], EMA weight of the newest synchronized direction (Eq. 5.1).
        theta_alpha: θ_α ∈ (0, 1], per-epoch threshold decay.
        zero_median: reading of Eq. 5.3 when a layer's median |G̃| is 0 (e.g. dead ReLU
            units): ``"floor"`` keeps the lateral test (strict), ``"skip_lateral"`` drops it
            for that test, as an unguarded float implementation of Alg. 2-3 does (NaN
            bound); see :mod:`dfl_agent.learning.thresholding`.
    """

    theta_rho: float = 2.0
    theta_beta: float = 0.5
    theta_alpha: float = 0.95
    zero_median: str = "floor"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.theta_rho > 0:
            raise ValueError(f"theta_rho must be > 0, got {self.theta_rho}")
        if not 0.0 <= self.theta_beta <= 1.0:
            raise ValueError(f"theta_beta must be in [0, 1], got {self.theta_beta}")
        if not 0.0 < self.theta_alpha <= 1.0:
            raise ValueError(f"theta_alpha must be in (0, 1], got {self.theta_alpha}")
        if self.zero_median not in th.ZERO_MEDIAN_MODES:
            raise ValueError(f"zero_median must be one of {', '.join(th.ZERO_MEDIAN_MODES)}, got {self.zero_median!r}")


@register
class GradientThresholding(LockStepAlgorithm):
    """Gradient Thresholding (seed 003 §5.3, Eq. 5.1-5.3, Alg. 1-4) with one-bit votes."""

    name = "gt"
    traits = Traits("lockstep", dp=dp_policy.DPSupport({
        "gt.vote": ("dp-sgd", "one bit computed from the accumulated gradient of DP-SGD steps"),
        "gt.sync": ("dp-sgd", "accumulated gradient (M_R - M_i)/η of DP-SGD steps")}))
    Options = GTOptions
    votes = True

    async def setup(self) -> None:
        await super().setup()
        self.forecast: dict[str, np.ndarray] | None = None  # G̃
        self.rho = 0.0
        self.last_test: dict[str, Any] = {}
        # verdicts of this actor's threshold tests: inside / projected / lateral, and how
        # many tests had the lateral test skipped (zero_median = "skip_lateral")
        self.test_counts: collections.Counter[str] = collections.Counter()
        # the test runs on floating tensors only: integer buffers (BatchNorm's
        # num_batches_tracked) are not parameters, and their always-zero "gradient" would
        # make a zero-median layer of its own under zero_median = "skip_lateral"
        self.tested = [k for k, v in self.reference.items() if np.asarray(v).dtype.kind == "f"]

    def wants_sync(self, t: int, grad: dict[str, np.ndarray]) -> tuple[bool, dict[str, Any]]:
        o = self.options
        if self.forecast is None or self.last_sync == 0:
            return True, {"rho": None}
        k = t - self.last_sync
        self.rho = th.threshold_extent(k, o.theta_alpha)
        res = th.threshold_test({k: self.forecast[k] for k in self.tested}, {k: grad[k] for k in self.tested},
                                self.rho, o.theta_rho, o.zero_median)
        self.test_counts[res.reason or "inside"] += 1
        self.test_counts["lateral_skipped"] += int(res.lateral_skipped)
        self.last_test = {"rho": self.rho, "vote": res.needs_sync, "vote_reason": res.reason,
                          "projected": res.projected, "projected_max": res.projected_max,
                          "lateral": None if res.lateral_skipped else res.lateral,
                          "lateral_max": None if res.lateral_skipped else res.lateral_max,
                          "lateral_skipped": res.lateral_skipped}
        return res.needs_sync, dict(self.last_test)

    def after_sync(self, mean_grad: dict[str, np.ndarray]) -> None:
        self.forecast = th.forecast_update(self.forecast, mean_grad, self.options.theta_beta)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "threshold": {k: v for k, v in self.last_test.items()},
                "threshold_tests": dict(self.test_counts)}


