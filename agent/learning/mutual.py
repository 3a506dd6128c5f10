"""Weighted mutual learning at the DFML aggregator (seed 000 Eq. 1–3, Algorithm 1).

For every mini-batch X_a of the aggregator's data, the logits z_n of *all*
participants' models are computed first; then every model n takes one step on

    L_n = (1 − α) · L_sup(z_n, y) + α · Σ_{q≠n} Φ_q / Σ_{u≠n} Φ_u · KL(p_q ‖ p_n)     (Eq. 1, 3)

with p = softmax(z / τ), teachers p_q detached (ALGORITHMS.md), Φ the trainable
parameter counts, and L_sup the WSM loss of Eq. 2 with β = the aggregator's class
proportions (or plain CE for the ablation).  Because every teacher term is detached,
L_n depends only on model n's parameters, so one backward pass over Σ_n L_n gives
each model exactly the gradient of its own L_n.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dfl_agent.learning.dp import DPTraining, private_loop
from dfl_agent.learning.losses import cross_entropy, kl_divergence, weighted_softmax_ce
from dfl_agent.learning.training import autocast_for, batches, is_finite, make_optimizer

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn, torch


def kl_weights(phis: Sequence[int]) -> np.ndarray:
    """``W[n, q] = Φ_q / Σ_{u≠n} Φ_u`` for q ≠ n, 0 on the diagonal (Eq. 3).

    Raises:
        ValueError: a non-positive Φ.
    """
    phi = np.asarray(phis, dtype=np.float64)
    if (phi <= 0).any():
        raise ValueError(f"parameter counts must be positive, got {list(phis)}")
    w = np.tile(phi, (len(phi), 1))
    np.fill_diagonal(w, 0.0)
    denom = w.sum(axis=1, keepdims=True)
    return np.divide(w, denom, out=np.zeros_like(w), where=denom > 0)


def mutual_learning(
    models: Sequence[nn.Module],
    phis: Sequence[int],
    x: np.ndarray,
    y: np.ndarray,
    *,
    alpha: float,
    epochs: int,
    batch_size: int,
    lr: float,
    rng: np.random.Generator,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    beta: np.ndarray | None = None,
    temperature: float = 1.0,
    device: str | torch.device = "cpu",
    mixed_precision: bool = False,
    dp: DPTraining | None = None,
) -> dict[str, float]:
    """Run ``epochs`` (K) epochs of weighted mutual learning, updating every model in place.

    Args:
        models: the participants' models (the aggregator's own included), each mapping
            ``(B, *input_shape)`` to logits ``(B, C)`` with the same C.
        phis: Φ_n, trainable parameter counts, one per model.
        x, y: the aggregator's training data, float32 ``(N, *input_shape)``, int64 ``(N,)``.
        alpha: α⁽ᵗ⁾ in [0, 1] (Eq. 1).
        beta: class proportions ``(C,)`` of the aggregator's data for WSM (Eq. 2);
            ``None`` = plain cross-entropy.
        rng: draws the batch order.
        mixed_precision: float16 autocast + gradient scaling on CUDA (off on cpu).
        dp: differential privacy (the node's ``TrainConfig.dp``): ``dp.steps_for(epochs)``
            DP-SGD steps on Poisson batches of the aggregator's data instead of the epochs.
            One optimizer holds every model's parameters, so a sample's gradient is clipped
            to ``dp.max_grad_norm`` over all the models together (its whole influence on the
            step), and the noise is added to every model; teachers are detached, so each
            sample's term depends on that sample alone.  ``beta`` must then not come from the
            data (DFML passes uniform proportions under DP).  No mixed precision.

    Returns:
        ``{"loss": mean total loss per batch, "batches": count, "diverged": 0.0 | 1.0}``
        (under DP also ``"dp_steps"``);
        ``diverged`` is 1 when a model's parameters ended non-finite.  The models are
        left as they are: the caller restores them (DFML's aggregator runs this under
        :meth:`dfl_agent.algorithms.base.Algorithm.divergence_guard`, which restores
        every model and counts the step; the round is then skipped).

    Raises:
        ValueError: empty model list, length mismatch, α outside [0, 1].
    """
    if not models or len(models) != len(phis):
        raise ValueError("need one Φ per model and at least one model")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    w = torch.as_tensor(kl_weights(phis), dtype=torch.float32)
    if dp is not None:
        return _private(models, w, x, y, alpha=alpha, epochs=epochs, lr=lr, rng=rng, momentum=momentum,
                        weight_decay=weight_decay, beta=beta, temperature=temperature, device=device, dp=dp)
    amp, kind, dtype = autocast_for(device, mixed_precision)
    opts = [make_optimizer(m.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, torch_api=amp)
            for m in models]  # the AMP gradient scaler takes only a torch.optim.Optimizer
    for m in models:
        m.to(device).train()
    beta_t = None if beta is None else torch.as_tensor(beta, dtype=torch.float32, device=device)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    total, count = 0.0, 0
    scaler = torch.amp.GradScaler(kind) if amp else None
    for _ in range(epochs):
        for idx in batches(len(x), batch_size, rng):
            bi = torch.from_numpy(idx)
            xb, yb = xt[bi].to(device), yt[bi].to(device)
            with torch.autocast(device_type=kind, dtype=dtype, enabled=amp):
                logits = [m(xb).float() for m in models]  # all logits before any update
            loss = _mutual_loss(logits, yb, w, alpha, beta_t, temperature)
            for o in opts:
                o.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                for o in opts:
                    assert isinstance(o, torch.optim.Optimizer)  # torch_api=amp
                    scaler.step(o)
                scaler.update()
            else:
                loss.backward()
                for o in opts:
                    o.step()
            total += float(loss.detach())
            count += 1
    diverged = not all(is_finite(m) for m in models)
    return {"loss": total / max(count, 1), "batches": float(count), "diverged": float(diverged)}


def _mutual_loss(logits: Sequence[torch.Tensor], yb: torch.Tensor, w: torch.Tensor, alpha: float,
                 beta_t: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Σ_n L_n (Eq. 1) for one batch, from every model's logits (teachers detached)."""
    loss = torch.zeros((), device=yb.device)
    for n, zn in enumerate(logits):
        sup = cross_entropy(zn, yb) if beta_t is None else weighted_softmax_ce(zn, yb, beta_t)
        dist = torch.zeros((), device=yb.device)
        if alpha > 0:
            for q, zq in enumerate(logits):
                if q != n and w[n, q] > 0:
                    dist = dist + w[n, q] * kl_divergence(zq, zn, temperature)
        loss = loss + (1 - alpha) * sup + alpha * dist
    return loss


def _private(models: Sequence[nn.Module], w: torch.Tensor, x: np.ndarray, y: np.ndarray, *, alpha: float,
             epochs: int, lr: float, rng: np.random.Generator, momentum: float, weight_decay: float,
             beta: np.ndarray | None, temperature: float, device: str | torch.device,
             dp: DPTraining) -> dict[str, float]:
    """Mutual learning under DP: one optimizer over every model, Poisson batches, joint
    per-sample clipping and noise (:func:`dfl_agent.learning.dp.private_loop`)."""
    for m in models:
        m.to(device).train()
    params = [p for m in models for p in m.parameters()]
    opt = make_optimizer(params, lr=lr, momentum=momentum, weight_decay=weight_decay, torch_api=True)  # Opacus's
    beta_t = None if beta is None else torch.as_tensor(beta, dtype=torch.float32, device=device)

    def batch_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return _mutual_loss([m(xb) for m in models], yb, w, alpha, beta_t, temperature)

    stats = private_loop(models, opt, dp, x, y, dp.steps_for(epochs), rng, batch_loss, device=device)
    diverged = not all(is_finite(m) for m in models)
    return {"loss": stats["loss"], "batches": stats["batches"], "diverged": float(diverged),
            "dp_steps": stats["dp_steps"]}
