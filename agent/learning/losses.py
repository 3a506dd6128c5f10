"""Losses shared by the algorithms (batch means, ALGORITHMS.md conventions).

- :func:`cross_entropy`: CE over logits.
- :func:`kl_divergence`: KL(p_teacher || p_student) with a detached teacher and
  temperature τ (scaled by τ², Hinton et al.); used by DFML (seed 000 Eq. 1),
  Def-KT (seed 004 Eq. 2-8) and FedD2S (seed 002 Eq. 8-13).
- :func:`weighted_softmax_ce`: DFML's weighted softmax cross-entropy (WSM, seed 000
  Eq. 2): classes absent from the data (β_c = 0) drop out of the log-sum-exp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.nn import functional as F
else:
    from dfl_agent.learning.lazy import F, torch


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy. ``logits`` (B, K) float, ``y`` (B,) int64 -> scalar."""
    return F.cross_entropy(logits, y)


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p ‖ q) = Σ_c p_c (log p_c − log q_c), batch mean, times τ².

    p = softmax(teacher/τ) is *detached* (no gradient reaches the teacher);
    q = softmax(student/τ).

    Args:
        teacher_logits, student_logits: (B, K).
        temperature: τ > 0.

    Raises:
        ValueError: shapes differ or τ <= 0.
    """
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(teacher_logits.shape)} vs {tuple(student_logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_p = F.log_softmax(teacher_logits.detach() / temperature, dim=1)
    log_q = F.log_softmax(student_logits / temperature, dim=1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    return kl * (temperature**2)


def weighted_softmax_ce(logits: torch.Tensor, y: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Weighted softmax cross-entropy, DFML seed 000 Eq. 2 (batch mean).

    ``L = −log( β_y e^{z_y} / Σ_c β_c e^{z_c} )`` with β the class proportions of the
    training split: classes the node never saw (β_c = 0) leave the normaliser, so the
    model is not pushed to suppress them.  A sample whose own class has β_y = 0 would
    give +∞; such rows fall back to plain CE (the guard ALGORITHMS.md asks for).

    Args:
        logits: (B, K). y: (B,) int64. beta: (K,) non-negative, sum > 0.

    Raises:
        ValueError: β has the wrong length, negative entries or an all-zero sum.
    """
    if beta.ndim != 1 or beta.shape[0] != logits.shape[1]:
        raise ValueError(f"beta must have shape ({logits.shape[1]},), got {tuple(beta.shape)}")
    if (beta < 0).any() or not beta.sum() > 0:
        raise ValueError("beta must be non-negative with a positive sum")
    beta = beta.to(logits.device, logits.dtype)
    log_beta = torch.where(beta > 0, beta.log(), torch.full_like(beta, float("-inf")))
    z = logits + log_beta  # log(β_c e^{z_c})
    own = beta[y] > 0
    if own.all():
        return F.cross_entropy(z, y)
    loss = torch.where(own, F.cross_entropy(torch.where(own[:, None], z, logits), y, reduction="none"),
                       F.cross_entropy(logits, y, reduction="none"))
    return loss.mean()
