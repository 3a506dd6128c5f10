"""FedD2S distillation math (seed 002, Eq. 6 and Eq. 8–13), pure: no I/O, no messaging.

Both the serverless algorithm (:mod:`dfl_agent.algorithms.fedd2s`) and the centralized
reference (``bench/fedd2s/reference.py``) call exactly these functions, so the
two differ only in *where* each one runs and what travels between the parties.

Models are layered: ``model.blocks`` is a list of the L layers (see
:mod:`dfl_agent.models.convdense`).  Layer indices are 1-based as in the seed:

- H_l = F(X; θ_{-l}) = output of layers 1..l  (:func:`features`);
- the *head* of layer l = layers l+1..L (:func:`head`).  The seed writes
  θ_{+l} = [θ_l … θ_L], an off-by-one (ALGORITHMS.md): with l = L the head is empty and
  p = softmax(H_L) is the model's own prediction.

Conventions (ALGORITHMS.md): losses are batch means; teachers are detached; KL(p‖q) with
p the teacher; temperature τ with KL × τ²; Adam with a fresh optimizer state per phase.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dfl_agent.learning.lazy import no_grad
from dfl_agent.learning.losses import kl_divergence
from dfl_agent.learning.training import make_optimizer

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.nn import functional as F
else:
    from dfl_agent.learning.lazy import F, nn, torch

Batch = tuple["torch.Tensor", "torch.Tensor"]


def _blocks(model: nn.Module) -> Sequence[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"{type(model).__name__} is not a layered model (needs .blocks); "
                        "use the 'convdense' model type with fedd2s")
    return blocks


def num_layers(model: nn.Module) -> int:
    """L, the number of layers of a layered model.  Raises TypeError if it has no ``blocks``."""
    return len(_blocks(model))


def distillation_layer(z: int, num_layers: int, z0: int, l_min: int) -> int:
    """The distillation layer l_n = max(l_min, L − ⌊(Z_n − 1)/Z_0⌋) (seed 002 Eq. 6, clamped).

    Args:
        z: Z_n, the number of rounds the node has participated in, this one included (>= 1).
        num_layers: L.
        z0: Z_0, rounds a layer serves as distillation layer (the "dropping rate", >= 1).
        l_min: the shallowest layer of the dropping set (1 <= l_min <= L).

    Raises:
        ValueError: any argument out of range.
    """
    if z < 1 or z0 < 1 or not 1 <= l_min <= num_layers:
        raise ValueError(f"bad schedule arguments Z={z}, Z0={z0}, l_min={l_min}, L={num_layers}")
    return max(l_min, num_layers - (z - 1) // z0)


def features(model: nn.Module, x: torch.Tensor, l: int) -> torch.Tensor:
    """H_l = output of layers 1..l of ``model`` for input ``x`` ``(B, *input_shape)``."""
    for b in _blocks(model)[:l]:
        x = b(x)
    return x


def head(model: nn.Module, h: torch.Tensor, l: int) -> torch.Tensor:
    """Layers l+1..L of ``model`` applied to a layer-l output ``h``; returns logits ``(B, K)``.

    E.g. ``head(m, H_1, 1)`` = F(H_1; θ_{+1}), layers 2..L; ``head(m, H_L, L)`` = H_L.
    """
    for b in _blocks(model)[l:]:
        h = b(h)
    return h


def fixed_batches(n: int, batch_size: int) -> list[np.ndarray]:
    """Positions ``0..n-1`` cut in order into mini-batches (the "fixed order" of ALGORITHMS.md)."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"need n >= 1 and batch_size >= 1, got {n}, {batch_size}")
    return [np.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


@no_grad
def extract_features(model: nn.Module, x: np.ndarray, y: np.ndarray, l: int, batch_size: int,
                     device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Local knowledge extraction (seed 002 §III-A1, Alg. 1 lines 6–9): per fixed-order batch,
    the triplet (H_1, H_l, Y) of the node's *personal* model in eval mode.

    Args:
        x: float32 ``(N, *input_shape)``; y: int64 ``(N,)``; l: the distillation layer.

    Returns:
        ``[(H1 (B, …), Hl (B, …), Y (B,))]`` detached tensors on ``device``.
    """
    was = model.training
    model.to(device).eval()
    out = []
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    for idx in fixed_batches(len(x), batch_size):
        bi = torch.from_numpy(idx)
        xb = xt[bi].to(device)
        h1 = features(model, xb, 1)
        hl = features(model, xb, l)
        out.append((h1.detach().clone(), hl.detach().clone(), yt[bi].to(device)))
    model.train(was)
    return out


def c2s_distill(global_copy: nn.Module, triplets: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], l: int,
                *, lr: float = 0.01, epochs: int = 1, temperature: float = 1.0) -> dict[str, float]:
    """Client-to-server distillation of one client's knowledge into a copy θ^{g,n} of the
    global model, in place (seed 002 Eq. 8–10, Alg. 1 lines 11–17).

    Per triplet (H_1, H_l, Y), with a fresh Adam (lr) for the whole phase:

    1. p = softmax(F(H_l; θ^{g,n}_{+l}) / τ), detached (Eq. 8);  q = F(H_1; θ^{g,n}_{+1});
       one step on J_C2S = KL(p ‖ q) (Eq. 9);
    2. one step on Q_C2S = CE(F(H_1; θ^{g,n}_{+1}), Y) (Eq. 10).

    The teacher head is the copy being trained (the seed writes θ^g for both p and q),
    evaluated before each KL step and detached.  Layer 1 of the copy is never used.

    Returns ``{"kl": mean KL, "ce": mean CE}`` over steps.
    """
    if not triplets:
        raise ValueError("c2s_distill needs at least one batch")
    global_copy.train()
    opt = make_optimizer(global_copy.parameters(), "adam", lr=lr)
    kl_sum = ce_sum = 0.0
    steps = 0
    for _ in range(epochs):
        for h1, hl, yb in triplets:
            with torch.no_grad():
                p_logits = head(global_copy, hl, l)
            opt.zero_grad(set_to_none=True)
            kl = kl_divergence(p_logits, head(global_copy, h1, 1), temperature)
            kl.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ce = F.cross_entropy(head(global_copy, h1, 1), yb)
            ce.backward()
            opt.step()
            kl_sum += float(kl.detach())
            ce_sum += float(ce.detach())
            steps += 1
    return {"kl": kl_sum / steps, "ce": ce_sum / steps}


@no_grad
def global_soft_targets(global_model: nn.Module, h1s: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Global knowledge extraction t^n = F(H_1^n; θ^g_{+1}) per batch (seed 002 §III-B1),
    as logits ``(B, K)`` (the softmax with τ is applied inside the KL)."""
    was = global_model.training
    global_model.eval()
    out = [head(global_model, h1, 1).detach().clone() for h1 in h1s]
    global_model.train(was)
    return out


def s2c_distill(personal: nn.Module, global_head: nn.Module, x: np.ndarray, y: np.ndarray,
                targets: Sequence[torch.Tensor], l: int, batch_size: int, *, lr: float = 0.01, epochs: int = 1,
                temperature: float = 1.0, device: str | torch.device = "cpu") -> dict[str, float]:
    """Server-to-client distillation into the personal model θ^n, in place
    (seed 002 Eq. 12–13, Alg. 1 lines 24–27).

    Per fixed-order batch b (the same batches as :func:`extract_features`), with a fresh Adam
    (lr) over θ^n for the whole phase:

    1. one step on J_S2C = KL(t_b ‖ F(F(X_b; θ^n_{-l}); θ^g_{+l})) (Eq. 12): the student is the
       personal layers 1..l followed by the *frozen* global head (layers l+1..L of
       ``global_head``); only θ^n's layers 1..l receive gradients;
    2. one step on Q = CE(F(X_b; θ^n), Y_b) (Eq. 13) over the whole personal model.

    Args:
        targets: t per batch, logits ``(B, K)`` from :func:`global_soft_targets`.

    Returns ``{"kl": …, "ce": …}`` means over steps.
    """
    bats = fixed_batches(len(x), batch_size)
    if len(bats) != len(targets):
        raise ValueError(f"{len(targets)} soft-target batches for {len(bats)} data batches")
    global_head.requires_grad_(False)
    personal.to(device).train()
    opt = make_optimizer(personal.parameters(), "adam", lr=lr)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    kl_sum = ce_sum = 0.0
    steps = 0
    for _ in range(epochs):
        for idx, tb in zip(bats, targets):
            bi = torch.from_numpy(idx)
            xb, yb = xt[bi].to(device), yt[bi].to(device)
            opt.zero_grad(set_to_none=True)
            kl = kl_divergence(tb, head(global_head, features(personal, xb, l), l), temperature)
            kl.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ce = F.cross_entropy(personal(xb), yb)
            ce.backward()
            opt.step()
            kl_sum += float(kl.detach())
            ce_sum += float(ce.detach())
            steps += 1
    return {"kl": kl_sum / steps, "ce": ce_sum / steps}


def average_states(states: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Unweighted mean of model states, in the given order (seed 002 Eq. 11 over the
    participants).  Accumulates in float64 and casts back to each tensor's dtype.

    Raises:
        ValueError: no states, or names/shapes differ.
    """
    if not states:
        raise ValueError("nothing to average")
    keys = list(states[0])
    out: dict[str, np.ndarray] = {}
    for k in keys:
        arrs = [s[k] for s in states]
        if any(a.shape != arrs[0].shape for a in arrs) or any(set(s) != set(keys) for s in states):
            raise ValueError(f"states differ at {k!r}")
        acc = np.zeros(arrs[0].shape, dtype=np.float64)
        for a in arrs:
            acc += a
        out[k] = np.ascontiguousarray((acc / len(arrs)).astype(arrs[0].dtype))
    return out


def ceil_count(ratio: float, n: int) -> int:
    """⌈ρ·N⌉ (at least 1, at most N), robust to float error (0.2·20 = 4, not 5)."""
    return max(1, min(n, math.ceil(ratio * n - 1e-9)))
