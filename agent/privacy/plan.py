"""A run's DP plan: noise multiplier, sampling rate, steps and the run's ε, before it trains.

The plan is made at admission (the torch-free supervisor: this module imports the accountant and
numpy, and SciPy once a plan is computed) and is what the run's local training then follows: Poisson batches with
rate ``q = batch_size / N``, ``steps`` DP steps over the whole run, noise ``σ·max_grad_norm``.
The privacy ledger reserves the plan's spend before the run trains.
"""

from __future__ import annotations

import dataclasses
import math

from dfl_agent.privacy.accountant import noise_for_epsilon, rdp_epsilon
from dfl_agent.privacy.config import DPConfig


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One run's DP-SGD: ``steps`` steps of the sampled Gaussian mechanism, spending ``epsilon`` alone."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    epsilon: float
    delta: float
    max_grad_norm: float


def steps_per_round(n_samples: int, batch_size: int, epochs: int, steps: int) -> int:
    """DP steps of one round: ``steps`` when > 0 (``training.steps``), else ``epochs·⌈N / batch_size⌉``."""
    if steps > 0:
        return int(steps)
    if n_samples <= 0 or batch_size <= 0:
        return 0
    return int(epochs) * math.ceil(n_samples / batch_size)


def plan_run(dp: DPConfig, *, n_samples: int, batch_size: int, steps_per_round: int, rounds: int) -> RunPlan:
    """The plan of a run of ``rounds`` rounds of ``steps_per_round`` DP steps on ``n_samples`` samples.

    Raises:
        ValueError: one line: no samples, ``delta`` not below 1/N, a batch size < 1, or a
            ``target_epsilon`` no noise multiplier up to 1000 reaches.
    """
    n = int(n_samples)
    if n <= 0:
        raise ValueError("privacy.dp: the device has no samples to train on (N = 0)")
    if batch_size < 1:
        raise ValueError(f"training.batch_size: must be >= 1 under DP, got {batch_size!r}")
    if not dp.delta < 1.0 / n:
        raise ValueError(f"privacy.dp.delta: {dp.delta:g} is not below 1/N = {1.0 / n:.3g} "
                         f"for the {n} samples of this device")
    q = min(1.0, batch_size / n)
    total = max(0, int(steps_per_round)) * max(0, int(rounds))
    if dp.noise_multiplier is not None:
        sigma = float(dp.noise_multiplier)
    else:
        assert dp.target_epsilon is not None
        try:
            sigma = noise_for_epsilon(dp.target_epsilon, q, total, dp.delta)
        except ValueError as exc:
            raise ValueError(f"privacy.dp.target_epsilon: {exc}") from None
    eps = rdp_epsilon([(sigma, q, total)], dp.delta)
    return RunPlan(noise_multiplier=sigma, sample_rate=q, steps=total, epsilon=eps, delta=dp.delta,
                   max_grad_norm=dp.max_grad_norm)
