"""``local-steps``: the local computation baselines BL1-BL4 of Gradient Thresholding
(seed 003 §5.4.2): the lock-step protocol (:mod:`dfl_agent.algorithms.protocols.lockstep`)
synchronizing every τ epochs, and at the first and the last.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.protocols.lockstep import LockStepAlgorithm, LockStepOptions
from dfl_agent.privacy import policy as dp_policy


@dataclasses.dataclass
class LocalStepsOptions(LockStepOptions):
    """Options of ``local-steps``.

    Attributes:
        tau: synchronize every τ epochs (BL1-BL4: 1, 2, 5, 10), and at the first and last.
    """

    tau: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau < 1:
            raise ValueError(f"tau must be >= 1, got {self.tau}")


@register
class LocalSteps(LockStepAlgorithm):
    """Local computation baseline BL1-BL4 (seed 003 §5.4.2): synchronize every τ epochs."""

    name = "local-steps"
    traits = Traits("lockstep", dp=dp_policy.DPSupport({
        "gt.sync": ("dp-sgd", "accumulated gradient (M_R - M_i)/η of DP-SGD steps")}))
    Options = LocalStepsOptions

    def wants_sync(self, t: int, grad: dict[str, np.ndarray]) -> tuple[bool, dict[str, Any]]:
        return t % self.options.tau == 0, {}
