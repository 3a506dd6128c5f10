"""Linear probing: fit a model's output layer to a data set on its frozen features.

A warm-started run (:mod:`dfl_agent.runtime.run.warm_start`) whose store holds a class the
deployed model predicts for none of its windows fits that model's output layer to the store
before round 1, then trains the whole model as usual: linear
probing then fine-tuning (LP-FT; Kumar et al. 2022, "Fine-Tuning can Distort Pretrained
Features and Underperform Out-of-Distribution", section 4).  When the store gained classes
the deployed model never saw, their rows of the output layer are far below the others; the
first full training steps then lower the score of a known class that resembles them (HAR:
walking, when walking upstairs and downstairs appear) before the model predicts the new
ones, and the first round loses accuracy.  Fitted first, the output layer already scores the
new classes from the features the model has, and the first round starts from there.

The fit is multinomial logistic regression on the features, a convex problem: full-batch
gradient descent with momentum (:data:`STEPS` steps) from the deployed rows, at :data:`LR` and
at the step of :func:`step_size`, which cannot diverge; the fit with the lower cross-entropy
on the store is kept, and only when it is lower than the deployed layer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from dfl_agent.learning.training import make_optimizer

#: full-batch gradient steps of the fit
STEPS = 200
#: the fit's step size and momentum (features of the models here are O(1))
LR, MOMENTUM = 0.05, 0.9
#: windows per forward pass when computing the features
BATCH = 256
#: most windows the fit uses (a seeded sample of a larger store): bounds its memory, N x F floats
MAX_SAMPLES = 4096


@dataclass
class ProbeResult:
    """What :func:`linear_probe` did.

    Attributes:
        state: the fitted output layer, ``state_dict`` name -> float32 array (``{name}.weight``
            ``(K, F)`` and ``{name}.bias`` ``(K,)``); empty when nothing was fitted.
        record: JSON-friendly: ``{"layer", "samples", "unlearned", "loss_before",
            "loss_after", "step"}`` when fitted (``unlearned``: those class indices), ``{"skipped": why}`` otherwise (with the layer and losses when the
            fit ran but did not lower the cross-entropy).
    """

    state: dict[str, np.ndarray] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


def output_layer(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The model's last ``nn.Linear`` in module order, as ``(name, module)`` (None: none)."""
    found = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            found = (name, mod)
    return found


def _features(model: nn.Module, layer: nn.Linear, x: np.ndarray) -> tuple[torch.Tensor, np.ndarray | None]:
    """The inputs of ``layer`` for every window of ``x`` ``(N, F)``, and the model's
    predicted classes ``(N,)``; ``(empty, None)`` when the model's output is not that layer's
    output (its logits do not come straight from it)."""
    seen: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def hook(_mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen.append(args[0].detach().float().cpu())
        outs.append(out.detach().float().cpu())

    device = next(model.parameters()).device
    handle = layer.register_forward_hook(hook)
    same, preds = True, []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, len(x), BATCH):
                n = len(seen)
                logits = model(torch.from_numpy(np.ascontiguousarray(x[i:i + BATCH])).to(device)).float().cpu()
                same = same and len(seen) == n + 1 and seen[-1].dim() == 2 and torch.equal(outs[-1], logits)
                preds.append(logits.argmax(dim=1).numpy())
    finally:
        handle.remove()
        model.train(was_training)
    if not (seen and same):
        return torch.empty(0), None
    return torch.cat(seen), np.concatenate(preds)


def step_size(h: torch.Tensor) -> float:
    """A step size at which the fit on features ``h`` ``(N, F)`` cannot diverge: ``1 / L``
    with ``L = λ_max(E[h̃ h̃ᵀ]) / 2`` (``h̃ = [h, 1]``), a bound on the curvature of the
    softmax cross-entropy in the layer's weights (the Hessian of ``log Σ exp`` has norm at
    most 1/2); at most :data:`LR`.  The bound is loose where the model is confident, so the
    fit also tries :data:`LR`."""
    ht = torch.cat([h.double(), torch.ones(len(h), 1, dtype=torch.float64)], dim=1)
    curvature = float(torch.linalg.eigvalsh(ht.T @ ht / len(h))[-1]) / 2
    return min(LR, 1.0 / curvature) if curvature > 0 else LR


def linear_probe(model: nn.Module, x: np.ndarray, y: np.ndarray, always: bool = False) -> ProbeResult:
    """Fit ``model``'s output layer (:func:`output_layer`) to ``(x, y)`` on the frozen
    features when ``(x, y)`` hold a class the model predicts for none of its windows (an
    *unlearned* class), or ``always``; ``model`` itself is left unchanged (the caller loads
    :attr:`ProbeResult.state`).

    Only for unlearned classes, because each device fits the layer to its own data: the fitted
    layers of a federation's devices differ, and their first average can cost a device
    accuracy where the common deployed layer was already right.

    Args:
        model: a classifier whose logits ``(N, K)`` are its last ``nn.Linear``'s output.
        x: inputs ``(N, *input_shape)`` float32 (the device's training split); of more
            than :data:`MAX_SAMPLES` windows, a seeded sample of that many is used.
        y: integer labels ``(N,)`` in ``[0, K)``.
        always: fit even when the model predicts every class of the data.

    Returns:
        The fitted layer and what was done; skipped (with why) when the model's output is
        not its last linear layer's, the labels are not class indices of that layer, the
        data hold fewer than two classes or no unlearned class, or the fit did not lower the
        cross-entropy.
    """
    found = output_layer(model)
    if found is None:
        return ProbeResult(record={"skipped": "the model has no linear output layer"})
    name, layer = found
    y = np.asarray(y)
    if len(y) == 0 or y.dtype.kind not in "iu" or int(y.min()) < 0 or int(y.max()) >= layer.out_features:
        return ProbeResult(record={"skipped": "the labels are not class indices of the output layer"})
    if len(np.unique(y)) < 2:
        return ProbeResult(record={"skipped": "the data hold fewer than two classes"})
    if len(y) > MAX_SAMPLES:
        keep = np.sort(np.random.default_rng(0).choice(len(y), MAX_SAMPLES, replace=False))
        x, y = x[keep], y[keep]
    h, preds = _features(model, layer, x)
    if preds is None:
        return ProbeResult(record={"skipped": "the model's output is not its last linear layer's"})
    unlearned = sorted(int(c) for c in set(np.unique(y).tolist()) - set(np.unique(preds).tolist()))
    if not unlearned and not always:
        return ProbeResult(record={"skipped": "the model already predicts every class of the data"})
    target = torch.from_numpy(y.astype(np.int64))
    w0 = layer.weight.detach().float().cpu()
    b0 = layer.bias.detach().float().cpu() if layer.bias is not None else None
    before = _loss(h, target, w0, b0)
    record: dict[str, Any] = {"layer": name, "samples": int(len(y)), "unlearned": unlearned,
                              "loss_before": round(before, 4)}
    safe = step_size(h)
    fits = []
    for lr in (LR, safe) if safe < LR else (LR,):  # the usual step, and the one that cannot diverge
        w, b = _fit(h, target, w0, b0, lr)
        fits.append((_loss(h, target, w, b), lr, w, b))
    after, lr, w, b = min(fits, key=lambda f: f[0] if np.isfinite(f[0]) else np.inf)
    if not (np.isfinite(after) and after < before):
        return ProbeResult(record={**record, "loss_after": round(after, 4),
                                   "skipped": "the fit did not lower the cross-entropy"})
    state = {f"{name}.weight": w.numpy().astype(np.float32)}
    if b is not None:
        state[f"{name}.bias"] = b.numpy().astype(np.float32)
    return ProbeResult(state=state, record={**record, "loss_after": round(after, 4), "step": lr})


def _loss(h: torch.Tensor, target: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """The mean cross-entropy of the logits ``h wᵀ + b``."""
    with torch.no_grad():
        return float(nn.functional.cross_entropy(h @ w.T + (0 if b is None else b), target))


def _fit(h: torch.Tensor, target: torch.Tensor, w0: torch.Tensor, b0: torch.Tensor | None,
         lr: float, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:data:`STEPS` full-batch gradient steps with momentum on the cross-entropy of
    ``h wᵀ + b`` in ``(w, b)`` from ``(w0, b0)``; the new ``(w, b)``, detached.  ``rows``, a
    ``(K,)`` bool mask, fits only those classes' rows (the others keep ``w0``'s, ``b0``'s)."""
    w = w0.clone().requires_grad_(True)
    b = None if b0 is None else b0.clone().requires_grad_(True)
    params = [w] if b is None else [w, b]
    opt = make_optimizer(params, lr=lr, momentum=MOMENTUM)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(h @ w.T + (0 if b is None else b), target).backward()
        if rows is not None:
            for p in params:
                p.grad[~rows] = 0  # type: ignore[index]
        opt.step()
    return w.detach(), None if b is None else b.detach()
