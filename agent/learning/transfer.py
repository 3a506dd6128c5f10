"""Def-KT's mutual knowledge transfer (seed 004, Eq. 2-8) and Combo's two-segment split.

- :func:`mutual_transfer`: the receiver-side model fusion of Def-KT (Algorithm 1,
  inner loops): two models teach each other on the receiver's data.
- :func:`split_point`, :func:`flatten_segment`, :func:`average_segment`: the
  parameter-vector segments Combo (seed 004 Algorithm 3; Hu et al. 2019) exchanges
  and averages.

Pure functions: no I/O, randomness only from the ``rng`` passed in.  Losses are batch
means and teachers are detached (ALGORITHMS.md conventions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from dfl_agent.learning.losses import cross_entropy, kl_divergence
from dfl_agent.learning.training import TrainConfig, batches, make_optimizer

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn, torch


def mutual_transfer(
    incoming: nn.Module,
    local: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    cfg: TrainConfig,
    rng: np.random.Generator,
    *,
    epochs: int = 1,
    temperature: float = 1.0,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Two-way mutual knowledge transfer, Def-KT seed 004 Algorithm 1 / Eq. 2-8.

    ``E = epochs`` passes over the receiver's data ``(x, y)`` cut into mini-batches
    ``B_l`` of ``cfg.batch_size`` (seeded order from ``rng``).  Per batch, *both*
    models' outputs are computed first, from the parameters at the start of the
    batch (Eq. 4): ``P1 = model(B_l; w̃)`` from ``incoming`` and
    ``P2 = model(B_l; w)`` from ``local``.  Then, with teachers detached,

    - ``w̃ ← w̃ − η ∂/∂w̃ [CE(P1, Y) + KL(P2 ‖ P1)]``  (Eq. 2, 5, 7, 8)
    - ``w  ← w  − η ∂/∂w  [CE(P2, Y) + KL(P1 ‖ P2)]``  (Eq. 3, 6, 7, 8)

    one SGD step each (``cfg.lr``, ``cfg.momentum``, ``cfg.weight_decay``; a fresh
    optimizer per model and per call: no optimizer state travels).  Losses are batch
    means; with temperature τ ≠ 1 the KL terms are on softened outputs and scaled by
    τ² (:func:`dfl_agent.learning.losses.kl_divergence`).  ``cfg.epochs`` is ignored.

    Both models are updated in place.  The caller decides what to keep: Def-KT's
    receiver stores ``incoming`` (w̃ after transfer) as its local model.

    Args:
        incoming: the sender's model w̃; maps ``(B, *input_shape)`` to logits ``(B, C)``.
        local: the receiver's own model w, same architecture family and ``C``.
        x: float32 ``(N, *input_shape)``, the receiver's training split.
        y: int64 ``(N,)`` labels in ``[0, C)``.
        cfg: batch size ``B_2`` and SGD hyper-parameters (η1 = η2 = ``cfg.lr``).
        rng: draws the batch order.
        epochs: E >= 1, passes over the data.
        temperature: τ > 0 of the KL terms (1 = the paper).
        device: torch device for the computation.

    Returns:
        Means over all batches: ``{"ce_incoming", "kl_incoming", "ce_local",
        "kl_local"}`` (nats per sample, before each batch's step), and
        ``"batches"`` (count).

    Raises:
        ValueError: empty data, ``x``/``y`` length mismatch, ``epochs < 1``, τ <= 0,
            or the models' outputs differ in shape.
    """
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"transfer data must be non-empty with matching lengths, got {len(x)} and {len(y)}")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    incoming.to(device).train()
    local.to(device).train()
    opt1 = make_optimizer(incoming.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    opt2 = make_optimizer(local.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    sums = {"ce_incoming": 0.0, "kl_incoming": 0.0, "ce_local": 0.0, "kl_local": 0.0}
    count = 0
    for _ in range(epochs):
        for idx in batches(len(x), cfg.batch_size, rng):
            bi = torch.from_numpy(idx)
            xb, yb = xt[bi].to(device), yt[bi].to(device)
            logits1 = incoming(xb)  # P1 (Eq. 4), from w̃ at the start of the batch
            logits2 = local(xb)  # P2 (Eq. 4), from w at the start of the batch
            ce1, ce2 = cross_entropy(logits1, yb), cross_entropy(logits2, yb)
            kl1 = kl_divergence(logits2, logits1, temperature)  # KL(P2 ‖ P1), P2 detached
            kl2 = kl_divergence(logits1, logits2, temperature)  # KL(P1 ‖ P2), P1 detached
            opt1.zero_grad(set_to_none=True)
            opt2.zero_grad(set_to_none=True)
            # Teachers are detached, so Loss1 only reaches w̃ and Loss2 only w: one
            # backward pass of the sum gives both gradients of Eq. 2 and Eq. 3.
            (ce1 + kl1 + ce2 + kl2).backward()
            opt1.step()
            opt2.step()
            sums["ce_incoming"] += float(ce1.detach())
            sums["kl_incoming"] += float(kl1.detach())
            sums["ce_local"] += float(ce2.detach())
            sums["kl_local"] += float(kl2.detach())
            count += 1
    out = {k: v / max(count, 1) for k, v in sums.items()}
    out["batches"] = float(count)
    return out


# -- Combo: two segments of the flattened parameter vector -------------------------------


def _float_names(tensors: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k, v in tensors.items() if v.dtype.kind == "f"]


def split_point(tensors: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """``(split, total)``: the flattened parameter vector has ``total`` floating
    entries; segment 1 is ``[0, split)``, segment 2 ``[split, total)``, ``split = total // 2``.

    The vector concatenates the floating tensors of ``tensors`` in their mapping
    order (a model's ``state_dict`` order, identical on every node with the same
    architecture), each flattened in C order.  Non-floating tensors (counters) belong
    to no segment.
    """
    total = int(sum(tensors[k].size for k in _float_names(tensors)))
    return total // 2, total


def flatten_segment(tensors: Mapping[str, np.ndarray], segment: int) -> np.ndarray:
    """Segment ``1`` (first half) or ``2`` (second half) of the flattened parameter
    vector (see :func:`split_point`), as float32 ``(len,)``; the paper's
    ``w_{t,1}`` / ``w_{t,2}`` (seed 004 Algorithm 3).

    Raises:
        ValueError: ``segment`` not 1 or 2.
    """
    if segment not in (1, 2):
        raise ValueError(f"segment must be 1 or 2, got {segment!r}")
    names = _float_names(tensors)
    flat = np.concatenate([np.asarray(tensors[k], dtype=np.float32).ravel() for k in names]) if names \
        else np.zeros(0, np.float32)
    split, _ = split_point(tensors)
    return np.ascontiguousarray(flat[:split] if segment == 1 else flat[split:])


def average_segment(
    own: Mapping[str, np.ndarray], segment: int, received: np.ndarray, n_own: float, n_received: float
) -> dict[str, np.ndarray]:
    """Combo's fusion (seed 004 Algorithm 3, the segment form of Eq. 9).

    Replaces segment ``segment`` of ``own`` by
    ``n_received/(n_own+n_received) · received + n_own/(n_own+n_received) · own_segment``
    (computed in float64, cast back to each tensor's dtype) and leaves the other
    segment and non-floating tensors unchanged.

    Args:
        own: the node's named tensors (not modified; a new dict is returned).
        segment: 1 or 2.
        received: ``(len,)`` the peer's same segment (:func:`flatten_segment`).
        n_own, n_received: sample counts (weights), non-negative with a positive sum.

    Raises:
        ValueError: bad segment, length mismatch or bad weights.
    """
    mine = flatten_segment(own, segment)
    received = np.asarray(received)
    if received.ndim != 1 or received.shape != mine.shape:
        raise ValueError(f"segment {segment} has {mine.shape[0]} entries, received {tuple(received.shape)}")
    if not (n_own >= 0 and n_received >= 0 and n_own + n_received > 0) or not np.isfinite([n_own, n_received]).all():
        raise ValueError(f"sample-count weights must be finite, non-negative, with a positive sum: {n_own}, {n_received}")
    a = n_received / (n_own + n_received)
    mixed = a * received.astype(np.float64) + (1.0 - a) * mine.astype(np.float64)
    split, _ = split_point(own)
    offset = 0 if segment == 1 else split
    out: dict[str, np.ndarray] = {}
    pos = 0  # position in the full flattened vector
    for k, v in own.items():
        if v.dtype.kind != "f":
            out[k] = np.array(v, copy=True)
            continue
        flat = np.array(v, dtype=np.float64).ravel()
        lo, hi = max(pos, offset), min(pos + v.size, offset + mixed.shape[0])
        if lo < hi:
            flat[lo - pos : hi - pos] = mixed[lo - offset : hi - offset]
        out[k] = flat.reshape(v.shape).astype(v.dtype)
        pos += v.size
    return out
