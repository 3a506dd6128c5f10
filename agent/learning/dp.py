"""DP-SGD for local training (Abadi et al. 2016, "Deep Learning with Differential Privacy"),
through Opacus.

Under ``privacy.dp`` every training step on the device's own data is a step of the sampled
Gaussian mechanism, which is what the privacy accountant composes:

- **Poisson sampling**: each sample joins a step's batch independently with probability
  ``q`` (the plan's ``sample_rate = batch_size / N``; Opacus's
  ``UniformWithReplacementSampler``), so batch sizes vary and a batch may be empty;
- **per-sample clipping**: Opacus's ``GradSampleModule`` computes each sample's gradient and
  its ``DPOptimizer`` scales it to an L2 norm of at most ``max_grad_norm`` (C);
- **Gaussian noise** of standard deviation ``noise_multiplier · C`` added to the sum of the
  clipped gradients, which is then divided by the expected batch size ``q·N``.

The wrapped optimizer is the one the algorithm uses anyway: SGD (with momentum and weight
decay) for :func:`~dfl_agent.learning.training.train_local`, Adam for
:func:`~dfl_agent.learning.training.train_adam` (DP-Adam). Where several models learn from
one batch at once (DFML's mutual learning), one optimizer holds all their parameters, so a
sample's gradient is clipped over all of them together: its whole influence on the step is
bounded by C.

Data-independent terms (FedProx's proximal term, weight decay) are added after the noise:
they need no clipping.  Models with BatchNorm mix the samples of a batch and cannot train
under DP (the project's models use LayerNorm and GroupNorm).

Only the standard library is imported here at module level: the supervisor and the
admission read :func:`dp_steps_per_round` without torch.  Which algorithms may train under
DP, and what they send, is :mod:`dfl_agent.privacy.policy`'s table: Def-KT (its receiver's
mutual transfer) and FedD2S (its distillation phases run fixed-order batches over features
of the device's data) are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.extras import extra_hint

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn, torch

class DPBudgetExceeded(RuntimeError):
    """Training asked for more DP steps than the run's plan reserved."""


@dataclasses.dataclass
class DPSteps:
    """The DP steps a run has taken, against the ``limit`` its plan reserved (None: none)."""

    limit: int | None = None
    taken: int = 0

    def take(self) -> None:
        """Count one step.

        Raises:
            DPBudgetExceeded: the step would go past ``limit``; it is not taken.
        """
        if self.limit is not None and self.taken >= self.limit:
            raise DPBudgetExceeded(f"privacy.dp: the run's plan reserved {self.limit} DP steps and all "
                                   f"were taken; training more would spend beyond its plan")
        self.taken += 1


@dataclasses.dataclass(frozen=True)
class DPTraining:
    """How local training runs under DP (``TrainConfig.dp``): the run plan's figures.

    Attributes:
        noise_multiplier: σ; the noise added to a step's clipped sum has std ``σ·max_grad_norm``.
        max_grad_norm: C, the bound on each sample's gradient norm.
        sample_rate: q, the Poisson sampling rate of a step's batch (``batch_size / N``).
        counter: the run's steps taken so far and its plan's limit; shared by every copy of
            the training configuration (``dataclasses.replace`` keeps it).
    """

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    counter: DPSteps = dataclasses.field(default_factory=DPSteps, compare=False)

    def __post_init__(self) -> None:
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"privacy.dp: noise multiplier must be >= 0, got {self.noise_multiplier!r}")
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"privacy.dp.max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"privacy.dp: sample rate must be in (0, 1], got {self.sample_rate!r}")

    def steps_for(self, epochs: int, steps: int = 0) -> int:
        """The DP steps of one training call: ``steps`` when > 0, else ``epochs·⌈1/q⌉`` (``⌈1/q⌉`` =
        ``⌈N / batch_size⌉`` stands for one pass over the data)."""
        return int(steps) if steps > 0 else int(epochs) * max(1, math.ceil(1.0 / self.sample_rate - 1e-9))


def require_opacus() -> None:
    """Raise when Opacus is not installed (checked without importing it or torch).

    Raises:
        ModuleNotFoundError: one line naming the ``privacy`` extra.
    """
    if importlib.util.find_spec("opacus") is None:
        raise ModuleNotFoundError(f"privacy.dp needs Opacus, which is not installed: {extra_hint('privacy')}",
                                  name="opacus")


def check_model(model: nn.Module) -> None:
    """Raise when Opacus cannot compute per-sample gradients for ``model``.

    Raises:
        ValueError: one line naming the first offending layer (BatchNorm: replace it by
            LayerNorm or GroupNorm).
    """
    require_opacus()
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        first = str(errors[0]).splitlines()[0]
        raise ValueError(f"privacy.dp: {type(model).__name__} cannot train under DP ({first}); "
                         "use a model without BatchNorm (LayerNorm or GroupNorm)")


def _generator(rng: np.random.Generator) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(0, 2**62)))


class PrivateSteps:
    """DP steps over one or more models that learn from the same batches.

    ``optimizer`` holds the parameters of every model in ``models``; each :meth:`step`
    draws nothing itself: :meth:`batches` gives the Poisson batches, the caller computes the
    batch-mean loss (per-sample terms only), and :meth:`step` clips, noises and steps.
    Use as a context manager: the per-sample hooks are removed on exit.

    Args:
        models: the models whose parameters ``optimizer`` holds.
        optimizer: the plain optimizer (SGD or Adam), wrapped in Opacus's ``DPOptimizer``.
        dp: σ, C, q and the run's step counter.
        n: samples of the training data.
        rng: the node's generator; seeds the sampler and the noise (reproducible runs).
    """

    def __init__(self, models: Sequence[nn.Module], optimizer: torch.optim.Optimizer, dp: DPTraining, n: int,
                 rng: np.random.Generator) -> None:
        for m in models:
            check_model(m)
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        # Opacus's hooks on a first layer whose input needs no gradient: harmless, said every step
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)

        self.dp, self.n = dp, int(n)
        self.modules = [GradSampleModule(m, batch_first=True, loss_reduction="mean") for m in models]
        self.optimizer = DPOptimizer(optimizer, noise_multiplier=dp.noise_multiplier,
                                     max_grad_norm=dp.max_grad_norm,
                                     expected_batch_size=max(1, round(dp.sample_rate * self.n)),
                                     loss_reduction="mean", generator=_generator(rng))
        self._sampler_gen = _generator(rng)
        self.steps = 0

    def __enter__(self) -> PrivateSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the per-sample hooks and attributes: the models are plain modules again."""
        for p in self.optimizer.params:
            for attr in ("grad_sample", "summed_grad"):
                if hasattr(p, attr):
                    setattr(p, attr, None)
        for g in self.modules:
            g._close()
        self.modules = []

    def batches(self, steps: int) -> Iterator[np.ndarray]:
        """``steps`` Poisson batches of indices into the data (each may be empty)."""
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        sampler = UniformWithReplacementSampler(num_samples=self.n, sample_rate=self.dp.sample_rate,
                                                generator=self._sampler_gen, steps=int(steps))
        for idx in sampler:
            yield np.asarray(idx, dtype=np.int64)

    def step(self, loss: Callable[[], torch.Tensor] | None,
             extra: Callable[[], torch.Tensor] | None = None) -> float | None:
        """One DP step: count it, back-propagate ``loss()`` (a batch mean of per-sample terms;
        None for an empty batch: the step adds noise only), clip, noise, add the gradient of
        the data-independent ``extra()`` (e.g. a proximal term), and step the optimizer.

        Returns:
            the loss's value (None for an empty batch).

        Raises:
            DPBudgetExceeded: the run's plan has no step left.
        """
        self.dp.counter.take()
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        value: float | None = None
        if loss is None:
            for p in opt.params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        else:
            out = loss()
            out.backward()
            value = float(out.detach())
        opt.pre_step()
        if extra is not None:
            params = [p for p in opt.params]
            grads = torch.autograd.grad(extra(), params, allow_unused=True)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if g is not None:
                        p.grad.add_(g)
        opt.original_optimizer.step()
        self.steps += 1
        return value


def private_loop(models: Sequence[nn.Module], optimizer: torch.optim.Optimizer, dp: DPTraining,
                 x: np.ndarray, y: np.ndarray, steps: int, rng: np.random.Generator,
                 batch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                 device: str | torch.device = "cpu", extra: Callable[[], torch.Tensor] | None = None,
                 before_step: Callable[[], None] | None = None) -> dict[str, float]:
    """``steps`` DP steps on Poisson batches of ``(x, y)``: the loop every DP training shares.

    Args:
        batch_loss: ``batch_loss(xb, yb) -> scalar``, a batch mean of per-sample terms.
        extra: a data-independent term whose gradient is added after the noise.
        before_step: called before every step (the abort check of a stopped run).

    Returns:
        ``{"loss": mean over non-empty batches, "samples": samples drawn, "batches": non-empty
        batches, "dp_steps": steps taken}``.
    """
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    total, count, samples = 0.0, 0, 0
    with PrivateSteps(models, optimizer, dp, len(x), rng) as ps:
        for idx in ps.batches(steps):
            if before_step is not None:
                before_step()
            if len(idx) == 0:
                ps.step(None, extra)
                continue
            bi = torch.from_numpy(idx)
            xb, yb = xt[bi].to(device), yt[bi].to(device)
            value = ps.step(functools.partial(batch_loss, xb, yb), extra)
            total += float(value or 0.0)
            count += 1
            samples += len(idx)
        taken = ps.steps
    return {"loss": total / max(count, 1), "samples": float(samples), "batches": float(count),
            "dp_steps": float(taken)}


def training_for(plan: Any) -> DPTraining:
    """The :class:`DPTraining` of a run's plan (:class:`dfl_agent.privacy.plan.RunPlan`): its
    σ, C and q, and a step counter capped at the plan's steps."""
    return DPTraining(noise_multiplier=float(plan.noise_multiplier), max_grad_norm=float(plan.max_grad_norm),
                      sample_rate=float(plan.sample_rate), counter=DPSteps(limit=int(plan.steps)))
