"""Hessian diagonal: estimators, normalisation, accumulation and DecHW's weighted
aggregation (seed 001, Eq. 4-8; ALGORITHMS.md "DecHW").

A *Hessian diagonal* here is a mapping ``{parameter name: array}`` holding one
non-negative number per entry of each trainable parameter (same names and shapes as
``model.named_parameters()``).  Estimators return float64 numpy arrays; the
algorithm casts them to float32 for the wire.

Estimators (the paper's "Gauss-Newton JᵀJ", §IV-A, as ALGORITHMS.md fixes it):

- :func:`batch_sq_grad` (default): ``H = Σ_B (∇_w mean-loss_B)²`` over the mini-batches
  ``B`` of the local training split (fixed order, batch size 100), eval mode.
- :func:`per_sample_sq_grad`: the empirical Fisher ``H = Σ_k (∇_w ℓ_k)²`` over samples,
  with per-sample gradients from ``torch.func`` (``functional_call`` + ``vmap`` + ``grad``).

Both are sums (not means): the scale cancels in the ℓ2 normalisation of Eq. 4.  With
batch size 1, ``batch_sq_grad`` equals ``per_sample_sq_grad``.

Pure functions: no I/O, no global state, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dfl_agent.learning.aggregation import check_same_layout
from dfl_agent.learning.losses import cross_entropy

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn, torch

HessianDiag = dict[str, np.ndarray]
LossFn = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]

NORMS = ("l2", "none", "per_layer_l2")
ACCUMULATIONS = ("sum", "ema")


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _check_data(x: np.ndarray, y: np.ndarray, batch_size: int) -> None:
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"Hessian estimation needs non-empty data with matching lengths, got {len(x)} and {len(y)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


def batch_sq_grad(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int = 100,
    loss_fn: LossFn = cross_entropy,
    device: str | torch.device = "cpu",
) -> HessianDiag:
    """Squared mini-batch gradients summed over batches (ALGORITHMS.md default estimator).

    ``H_n = Σ_B (∂ mean_{k∈B} ℓ(h(x_k; w), y_k) / ∂w_n)²`` with the batches ``B`` taken in
    data order (``x[0:bs], x[bs:2bs], ...``; the last may be short).  The model is put
    in eval mode (dropout/batch-norm frozen) and restored afterwards; its parameters and
    ``.grad`` fields are left untouched.

    Args:
        model: maps ``(B, *input_shape)`` to outputs accepted by ``loss_fn``.
        x: inputs ``(N, *input_shape)`` (cast to float32).
        y: targets ``(N,)`` (int64 labels for the default cross-entropy; float32
            otherwise).
        batch_size: samples per mini-batch (paper: 100).
        loss_fn: ``loss_fn(outputs (B, ...), targets (B,)) -> scalar`` batch mean.

    Returns:
        ``{name: float64 array of the parameter's shape}`` for every trainable
        parameter, all entries >= 0.

    Raises:
        ValueError: empty or mismatched data, or a bad ``batch_size``.
    """
    _check_data(x, y, batch_size)
    params = _trainable(model)
    was_training = model.training
    model.to(device).eval()
    xt, yt = _tensors(x, y)
    acc = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    names, plist = list(params), list(params.values())
    try:
        for i in range(0, len(x), batch_size):
            loss = loss_fn(model(xt[i : i + batch_size].to(device)), yt[i : i + batch_size].to(device))
            grads = torch.autograd.grad(loss, plist, allow_unused=True)
            for k, g in zip(names, grads):
                if g is not None:
                    acc[k] += g.detach().to(torch.float64) ** 2
    finally:
        model.train(was_training)
    return {k: v.cpu().numpy() for k, v in acc.items()}


def per_sample_sq_grad(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int = 100,
    loss_fn: LossFn = cross_entropy,
    device: str | torch.device = "cpu",
) -> HessianDiag:
    """Empirical Fisher diagonal: squared per-sample gradients summed over samples.

    ``H_n = Σ_k (∂ ℓ(h(x_k; w), y_k) / ∂w_n)²`` — per-sample gradients with
    ``torch.func.vmap(grad(...))`` over ``functional_call`` (``batch_size`` samples per
    vectorised chunk; the result does not depend on it).  Eval mode, restored afterwards.
    For a model whose labels follow its own predictive distribution the expectation of
    this sum is N times the Hessian diagonal of the mean loss (the Fisher identity),
    which the unit tests check on softmax regression.

    Args, Returns, Raises: as :func:`batch_sq_grad` (``loss_fn`` is called on one sample
    at a time, shapes ``(1, ...)`` and ``(1,)``).
    """
    from torch.func import functional_call, grad, vmap

    _check_data(x, y, batch_size)
    params = {k: p.detach() for k, p in _trainable(model).items()}
    buffers = {k: b.detach() for k, b in model.named_buffers()}
    was_training = model.training
    model.to(device).eval()
    xt, yt = _tensors(x, y)

    def sample_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, {**buffers, **p}, (xi.unsqueeze(0),), strict=False)
        return loss_fn(out, yi.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    acc = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    try:
        for i in range(0, len(x), batch_size):
            g = per_sample(params, xt[i : i + batch_size].to(device), yt[i : i + batch_size].to(device))
            for k in acc:
                acc[k] += (g[k].detach().to(torch.float64) ** 2).sum(dim=0)
    finally:
        model.train(was_training)
    return {k: v.cpu().numpy() for k, v in acc.items()}


ESTIMATORS: dict[str, Callable[..., HessianDiag]] = {
    "batch_sq_grad": batch_sq_grad,
    "per_sample_sq_grad": per_sample_sq_grad,
}


def estimate(name: str, model: nn.Module, x: np.ndarray, y: np.ndarray, **kwargs) -> HessianDiag:
    """Run the estimator called ``name`` (a key of :data:`ESTIMATORS`).

    Raises:
        ValueError: unknown estimator name (the message lists the known ones), or as
            the estimator.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown Hessian estimator {name!r}; known: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name](model, x, y, **kwargs)


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    ya = np.asarray(y)
    yt = torch.from_numpy(np.ascontiguousarray(ya, dtype=np.int64 if ya.dtype.kind in "iub" else np.float32))
    return xt, yt


def global_l2_norm(h: Mapping[str, np.ndarray]) -> float:
    """‖H‖₂ over all entries of all tensors (Eq. 4's denominator)."""
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in h.values()))


def normalise(h: Mapping[str, np.ndarray], norm: str = "l2") -> HessianDiag:
    """Eq. 4: ``Ĥ = H / ‖H‖₂``.

    Args:
        h: Hessian diagonal ``{name: array}`` (any shapes, entries >= 0).
        norm: ``"l2"`` (paper, default): one global ℓ2 norm over all parameters;
            ``"per_layer_l2"``: each tensor divided by its own ℓ2 norm;
            ``"none"``: unchanged.  A zero norm leaves the (all-zero) tensors at zero,
            so Eq. 8's data-size fallback takes over for them.

    Returns:
        New float64 arrays, same names and shapes.

    Raises:
        ValueError: unknown ``norm``.
    """
    if norm not in NORMS:
        raise ValueError(f"unknown Hessian normalisation {norm!r}; known: {', '.join(NORMS)}")
    out = {k: np.asarray(v, dtype=np.float64).copy() for k, v in h.items()}
    if norm == "none":
        return out
    if norm == "l2":
        z = global_l2_norm(out)
        return {k: (v / z if z > 0 else v) for k, v in out.items()}
    for k, v in out.items():
        z = float(np.linalg.norm(v.ravel()))
        if z > 0:
            out[k] = v / z
    return out


def accumulate(
    acc: Mapping[str, np.ndarray] | None,
    h_normalised: Mapping[str, np.ndarray],
    *,
    beta: float = 1.0,
    mode: str = "sum",
) -> HessianDiag:
    """Eq. 5: ``Ĥ⁽ᵗ⁾ = Ĥ⁽ᵗ⁻¹⁾ + β·H⁽ᵗ⁾/‖H⁽ᵗ⁾‖₂`` (``mode="sum"``, paper, β = 1).

    ``mode="ema"`` (option): ``Ĥ⁽ᵗ⁾ = (1 − β)·Ĥ⁽ᵗ⁻¹⁾ + β·H⁽ᵗ⁾/‖H⁽ᵗ⁾‖₂``; with β = 1 it keeps
    only the current round (the no-accumulation ablation of App. D).  With no previous
    accumulator (``acc=None``, Algorithm 1 line 3) the result is ``h_normalised``
    itself, in both modes.

    Args:
        acc: previous accumulator ``Ĥ⁽ᵗ⁻¹⁾`` or None.
        h_normalised: this round's normalised diagonal (same names/shapes as ``acc``).
        beta: β in [0, 1].

    Returns:
        New float64 arrays.

    Raises:
        ValueError: β outside [0, 1], unknown mode, or names/shapes that differ.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if mode not in ACCUMULATIONS:
        raise ValueError(f"unknown Hessian accumulation {mode!r}; known: {', '.join(ACCUMULATIONS)}")
    new = {k: np.asarray(v, dtype=np.float64) for k, v in h_normalised.items()}
    if acc is None:
        return {k: v.copy() for k, v in new.items()}
    if set(acc) != set(new) or any(np.shape(acc[k]) != new[k].shape for k in new):
        raise ValueError("Hessian accumulator and new diagonal have different names or shapes")
    keep = 1.0 if mode == "sum" else 1.0 - beta
    return {k: keep * np.asarray(acc[k], dtype=np.float64) + beta * new[k] for k in new}


def diagonal_problem(h: np.ndarray) -> str | None:
    """What is wrong with Hessian-diagonal entries ``h`` (any shape): ``"negative"`` (an
    entry < 0; Ĥ estimates squared gradients, Eq. 4-5 of the DecHW paper), ``"non-finite"``
    (NaN or inf), or None when every entry is a finite value >= 0.  The one check of a
    received diagonal (:class:`dfl_agent.algorithms.dechw.DecHW`) and of the aggregation's
    inputs (:func:`hessian_weighted_average`)."""
    if (h < 0).any():
        return "negative"
    if not np.isfinite(h).all():
        return "non-finite"
    return None


def data_size_weights(samples: Sequence[float]) -> np.ndarray:
    """τ_j = |D_j| / Σ_k |D_k| over the neighbourhood N_i ∪ {i} (Eq. 3), float64 ``(N,)``.

    Raises:
        ValueError: empty, negative, non-finite, or all-zero sample counts.
    """
    s = np.asarray(samples, dtype=np.float64)
    if s.ndim != 1 or len(s) == 0 or (s < 0).any() or not np.isfinite(s).all() or s.sum() <= 0:
        raise ValueError(f"sample counts must be finite, non-negative, with a positive sum: {list(samples)}")
    return s / s.sum()


def hessian_weighted_average(
    models: Sequence[Mapping[str, np.ndarray]],
    hessians: Sequence[Mapping[str, np.ndarray]],
    samples: Sequence[float],
    *,
    eps: float = 1e-12,
    size_weighting: bool = False,
) -> tuple[dict[str, np.ndarray], float]:
    """DecHW aggregation over the neighbourhood N_i ∪ {i}, parameter by parameter (Eq. 6-8).

    For every entry n of every tensor that has a Hessian diagonal in *all* ``hessians``:

    - ``S_n = Σ_j Ĥ_{j,n}``;
    - if ``S_n >= eps``: ``p_{j,n} = Ĥ_{j,n} / S_n`` (Eq. 6) and ``w_n = Σ_j p_{j,n} w_{j,n}`` (Eq. 7);
    - otherwise the data-size fallback ``w_n = Σ_j τ_j w_{j,n}`` (Eq. 8, τ of Eq. 3).

    Tensors without a Hessian diagonal (buffers) are averaged with τ when floating,
    and copied from ``models[0]`` otherwise (integer counters).  Arithmetic in float64,
    results cast back to each tensor's dtype.

    Args:
        models: N >= 1 mappings ``{name: array}`` with identical names/shapes/dtypes;
            by convention ``models[0]`` is the aggregating node's own model.
        hessians: N mappings ``{name: array}`` (accumulated, normalised Ĥ of each
            model, entries >= 0, same shapes as the matching tensors).  Names absent
            from any one of them are treated as "no Hessian" for that tensor.
        samples: N local training-set sizes |D_j|.
        eps: threshold on ``S_n`` below which Eq. 8's fallback applies
            (ALGORITHMS.md: 1e-12).
        size_weighting: scale each ``Ĥ_j`` by τ_j (its data-set share) first, so that
            ``p_{j,n} ∝ τ_j Ĥ_{j,n}``.  Eq. 4's normalisation removes |D_j| from the
            paper's weights (a node with 50 samples weighs as much as one with 1500);
            this puts it back (see bench/dechw/README.md, common initialisation).

    Returns:
        ``(aggregated tensors, fallback fraction)``: the fraction (0..1) of
        Hessian-covered entries that used the data-size fallback (0 when none is covered).

    Raises:
        ValueError: length mismatch, differing names/shapes, a Hessian of the wrong
            shape, negative or non-finite Hessian entries, or bad sample counts.
    """
    n = len(models)
    if n == 0 or len(hessians) != n or len(samples) != n:
        raise ValueError(f"need as many Hessians and sample counts as models "
                         f"(got {n} models, {len(hessians)} Hessians, {len(samples)} sample counts)")
    tau = data_size_weights(samples)
    check_same_layout(models)
    names = set(models[0])
    covered = set(names)
    for hh in hessians:
        covered &= set(hh)
    out: dict[str, np.ndarray] = {}
    fallback, total = 0, 0
    for name, first in models[0].items():
        if first.dtype.kind != "f":
            out[name] = np.array(first, copy=True)
            continue
        w = np.stack([np.asarray(m[name], dtype=np.float64) for m in models])  # (N, *shape)
        fallback_avg = np.tensordot(tau, w, axes=1)
        if name not in covered:
            out[name] = fallback_avg.astype(first.dtype)
            continue
        if any(np.shape(hh[name]) != first.shape for hh in hessians):
            raise ValueError(f"a Hessian diagonal for {name!r} does not have the parameter's shape {first.shape}")
        h = np.stack([np.asarray(hh[name], dtype=np.float64) for hh in hessians])  # (N, *shape)
        if diagonal_problem(h) is not None:
            raise ValueError(f"Hessian diagonal for {name!r} has negative or non-finite entries")
        if size_weighting:
            h = h * tau.reshape((n,) + (1,) * (h.ndim - 1))
        s = h.sum(axis=0)  # (*shape)
        ok = s >= eps
        p = h / np.where(ok, s, 1.0)  # Eq. 6 (where ok)
        out[name] = np.where(ok, (p * w).sum(axis=0), fallback_avg).astype(first.dtype)  # Eq. 7 / 8
        fallback += int((~ok).sum())
        total += int(ok.size)
    return out, (fallback / total if total else 0.0)
