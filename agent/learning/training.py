"""The local training loop and evaluation (pure: no I/O, explicit randomness).

Losses are batch means (ALGORITHMS.md conventions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import numpy as np

from dfl_agent.learning.dp import DPTraining, private_loop
from dfl_agent.learning.lazy import no_grad

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.nn import functional as F
else:
    from dfl_agent.learning.lazy import F, nn, torch


class TrainingAborted(Exception):
    """Raised inside :func:`train_local` when the abort event of the calling thread
    (:func:`abortable`) is set: the run it trains for was cancelled or stopped, so the
    rest of the round's steps are not worth computing."""


_abort = threading.local()
_K = TypeVar("_K")


@contextlib.contextmanager
def abortable(event: threading.Event | None) -> Iterator[None]:
    """Within the block, :func:`train_local` in this thread stops with
    :class:`TrainingAborted` at its next mini-batch once ``event`` is set (None: never)."""
    previous = getattr(_abort, "event", None)
    _abort.event = event
    try:
        yield
    finally:
        _abort.event = previous


def _check_abort() -> None:
    event = getattr(_abort, "event", None)
    if event is not None and event.is_set():
        raise TrainingAborted("training aborted: the run was stopped")


#: The default SGD learning rate of local training (``training.lr``).
DEFAULT_LR = 0.05
#: The Adam algorithms' (``fedd2s``, ``fedper``, ``local_adam``) learning rate when neither
#: their ``adam_lr`` option nor ``training.lr`` is set: seed 002's baselines use 0.01.
DEFAULT_ADAM_LR = 0.01
#: The agent's ``training.divergence_factor``: a round of local training whose mini-batch
#: loss exceeds this multiple of its first batch's loss (at least ln K) has blown up
#: (:class:`TrainConfig`.divergence_factor, which is 0 by default: the papers' training,
#: as in the simulator and the benchmarks).
DEFAULT_DIVERGENCE_FACTOR = 10.0
#: Optimizers :func:`make_optimizer` builds.
OPTIMIZERS = ("sgd", "adam")


@overload
def make_optimizer(params: Iterable[torch.Tensor], kind: str = "sgd", *, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0, torch_api: Literal[False] = False) -> torch.optim.Optimizer | PlainSGD: ...


@overload
def make_optimizer(params: Iterable[torch.Tensor], kind: str = "sgd", *, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0, torch_api: Literal[True]) -> torch.optim.Optimizer: ...


@overload
def make_optimizer(params: Iterable[torch.Tensor], kind: str = "sgd", *, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0, torch_api: bool) -> torch.optim.Optimizer | PlainSGD: ...


def make_optimizer(params: Iterable[torch.Tensor], kind: str = "sgd", *, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0, torch_api: bool = False) -> torch.optim.Optimizer | PlainSGD:
    """The one place a fresh optimizer is built (local training, mutual learning, the
    Def-KT transfer, FedD2S's distillations, the Adam baselines, the warm start's probe).

    Args:
        params: the parameters to optimise.
        kind: ``sgd`` (``torch.optim.SGD``'s update, no dampening, no Nesterov: a
            :class:`PlainSGD`, or ``torch.optim.SGD`` itself with ``torch_api``) or ``adam``
            (``torch.optim.Adam`` with its default betas and eps, the seed 002 baselines').
        lr: learning rate (the settings are validated where they are configured:
            :class:`TrainConfig`, the algorithms' ``Options``).
        momentum: SGD momentum (``adam``: must be 0, Adam has its own moments).
        weight_decay: L2 penalty coefficient.
        torch_api: a ``torch.optim.Optimizer`` is needed (Opacus's DP optimizer and torch's
            AMP gradient scaler take only those): ``sgd`` is then ``torch.optim.SGD``.

    Raises:
        ValueError: unknown ``kind``, momentum given for ``adam``, or a negative learning
            rate, momentum or weight decay.
    """
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")
    if kind == "adam" and momentum:
        raise ValueError(f"adam takes no momentum, got {momentum!r}")
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if torch_api:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return PlainSGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


class PlainSGD:
    """``torch.optim.SGD``'s update (no dampening, no Nesterov), without ``torch.optim.Optimizer``.

    Each :meth:`step` is :func:`sgd_step` over the parameters that have a gradient:
    ``d = g + wd·p``; momentum buffer ``b = d`` on the first step, else ``b = m·b + d``;
    ``p -= lr·b`` (``p -= lr·d`` without momentum): the same operations, in the same order, as
    ``torch.optim.SGD``'s single-tensor step, so the parameters are bit for bit the same.

    Why not torch's own: every ``torch.optim.Optimizer`` imports TorchDynamo, and with it
    SymPy, when it is built or first steps (``torch._dynamo.graph_break()`` in ``step``, the
    ``_disable_dynamo`` wrappers), which adds about 75 MB to the resident memory of a process
    that never compiles anything (a device's run process: ``bench/operations/run_peak.md``).

    :meth:`state_dict` and :meth:`load_state_dict` use ``torch.optim.SGD``'s layout
    (``{"state": {i: {"momentum_buffer": tensor}}, "param_groups": [{...}]}``).

    Args:
        params: the parameters (tensors with ``requires_grad``); their order numbers the state.
        lr, momentum, weight_decay: as ``torch.optim.SGD``'s.

    Raises:
        ValueError: no parameters, or a negative learning rate, momentum or weight decay.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0):
        for name, v in (("learning rate", lr), ("momentum value", momentum), ("weight_decay value", weight_decay)):
            if not v >= 0.0:
                raise ValueError(f"Invalid {name}: {v}")
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        #: parameter index -> momentum buffer (from the first step with momentum)
        self.bufs: dict[int, torch.Tensor] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients (``set_to_none``), or zero them in place."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad = p.grad.detach()
                p.grad.zero_()

    def step(self) -> None:
        """One SGD step on every parameter that has a gradient (in place)."""
        live = {i: p for i, p in enumerate(self.params) if p.grad is not None}
        sgd_step(live, {i: p.grad for i, p in live.items() if p.grad is not None}, self.bufs,
                 lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)

    def state_dict(self) -> dict[str, Any]:
        """The momentum buffers and settings in ``torch.optim.SGD.state_dict()``'s layout."""
        return {"state": {i: {"momentum_buffer": b} for i, b in sorted(self.bufs.items())},
                "param_groups": [{"lr": self.lr, "momentum": self.momentum, "dampening": 0,
                                  "weight_decay": self.weight_decay, "nesterov": False, "maximize": False,
                                  "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` (or ``torch.optim.SGD.state_dict()``) returned.

        Raises:
            KeyError, ValueError: not one group over this optimizer's parameters, or Nesterov or dampening set.
        """
        (group,) = state["param_groups"]
        if len(group["params"]) != len(self.params):
            raise ValueError(f"the state has {len(group['params'])} parameters, the optimizer {len(self.params)}")
        if group.get("nesterov") or group.get("dampening"):
            raise ValueError("PlainSGD has no Nesterov momentum and no dampening")
        self.lr, self.momentum, self.weight_decay = float(group["lr"]), float(group["momentum"]), \
            float(group["weight_decay"])
        self.bufs = {int(i): st["momentum_buffer"].to(self.params[int(i)]).clone()
                     for i, st in state["state"].items() if st.get("momentum_buffer") is not None}


def sgd_step(params: Mapping[_K, torch.Tensor], grads: Mapping[_K, torch.Tensor], bufs: dict[_K, torch.Tensor],
             *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
    """One step of ``torch.optim.SGD`` (no dampening, no Nesterov) on plain tensors, in place.

    ``d = g + wd·p``; momentum buffer ``b = d`` on the first step (no entry in ``bufs``),
    else ``b = m·b + d``; ``p -= lr·b`` (``p -= lr·d`` without momentum).  Every operation
    is elementwise, so ``params`` may stack the parameters of G models along a leading
    axis (the simulator's batched training, :mod:`dfl_agent.runtime.node.batching`): one call
    steps all of them, each exactly as its own ``torch.optim.SGD`` would.

    Args:
        params: name -> parameter tensor, updated in place (any shape).
        grads: name -> gradient of the same shape (every name of ``params``).
        bufs: name -> momentum buffer, created on the first step and updated in place.
            The first step's buffer is the gradient tensor itself when there is no
            weight decay (no copy): the caller must not use ``grads`` after the call.
        lr, momentum, weight_decay: as :func:`make_optimizer`'s ``sgd``.
    """
    with torch.no_grad():
        for n, p in params.items():
            d = grads[n]
            if weight_decay:
                d = d.add(p, alpha=weight_decay)
            if momentum:
                if n not in bufs:
                    bufs[n] = d  # b = d: the gradient (or d, a new tensor) becomes the buffer
                else:
                    bufs[n].mul_(momentum).add_(d)
                d = bufs[n]
            p.add_(d, alpha=-lr)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Local training hyper-parameters.

    Attributes:
        epochs: passes over the local training split per round.
        steps: when > 0, each round runs exactly this many mini-batch steps instead of
            ``epochs`` passes (batches drawn from fresh seeded permutations, so a round
            may end mid-pass).  ``steps = 1`` is the one-SGD-step-per-gossip setting of
            CHOCO-SGD (Koloskova et al. 2019, Alg. 1), where sparsified gossip needs many
            cheap rounds rather than few long ones.
        batch_size: mini-batch size (samples).
        lr: SGD learning rate.
        momentum: SGD momentum (a fresh optimizer each call: no state travels).
        weight_decay: L2 penalty coefficient.
        mixed_precision: on a CUDA device, run forward passes under ``torch.autocast``
            (float16) with a gradient scaler; ignored on cpu (see :func:`autocast_for`).
        lr_is_set: whether the user chose ``lr`` (``training.lr`` in the configuration,
            ``dflctl simulate --lr``) rather than leaving the SGD default; the Adam
            algorithms follow ``lr`` only then (:func:`adam_lr`).
        dp: differentially private training (``privacy.dp``, :mod:`dfl_agent.learning.dp`):
            Poisson batches, per-sample clipping and Gaussian noise in every step of
            :func:`train_local` and :func:`train_adam`; None: plain training.
        clip_grad_norm: when > 0, every SGD step of :func:`train_local` first clips the
            mini-batch gradient to this global L2 norm (``torch.nn.utils.clip_grad_norm_``;
            Pascanu et al. 2013, section 3.2): one batch that the model fits badly cannot
            throw it far.  0: off (the papers' training).  Not under ``dp``, whose
            per-sample clipping bounds every step already.
        divergence_factor: :func:`train_local` stops and undoes a round whose mini-batch
            loss exceeds this multiple of the reference ``max(first batch's loss, ln K)``
            (K: the model's outputs; ln K is the cross-entropy of a uniform guess), and
            reports it ``diverged``, as it does a non-finite loss: a finite blow-up
            (losses of 10^1-10^3 where the round began below 1) is stopped before the
            model is sent.  0 (the default here, and the papers' training): only a
            non-finite loss or model counts; the agent's ``training.divergence_factor``
            defaults to :data:`DEFAULT_DIVERGENCE_FACTOR`.  Not under ``dp``.
        lr_scale: this round's factor on every learning rate, in (0, 1]: the learning-rate
            ramp of a run started from the deployed model (:func:`ramped`).  ``lr`` already
            includes it; the rates an algorithm chooses itself (Adam's, Def-KT's
            ``transfer_lr``) are multiplied by it where they are chosen.
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float = DEFAULT_LR
    steps: int = 0
    momentum: float = 0.9
    weight_decay: float = 0.0
    mixed_precision: bool = False
    lr_is_set: bool = False
    dp: DPTraining | None = None
    lr_scale: float = 1.0
    clip_grad_norm: float = 0.0
    divergence_factor: float = 0.0

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"training.{key} must be a positive integer, got {getattr(self, key)!r}")
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"training.steps must be an integer >= 0, got {self.steps!r}")
        if not self.lr > 0:
            raise ValueError(f"training.lr must be > 0, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"training.momentum must be in [0, 1), got {self.momentum!r}")
        if self.weight_decay < 0:
            raise ValueError(f"training.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.clip_grad_norm >= 0:
            raise ValueError(f"training.clip_grad_norm must be >= 0, got {self.clip_grad_norm!r}")
        if not (self.divergence_factor == 0 or self.divergence_factor > 1):
            raise ValueError(f"training.divergence_factor must be 0 (off) or > 1, got {self.divergence_factor!r}")
        if not 0 < self.lr_scale <= 1:
            raise ValueError(f"lr_scale must be in (0, 1], got {self.lr_scale!r}")


def ramped(base: TrainConfig, factor: float) -> TrainConfig:
    """``base`` with every learning rate multiplied by ``factor`` (``lr`` and
    ``lr_scale``; ``base.lr_scale`` must be 1): one round of a learning-rate warm-up
    (gradual warm-up, Goyal et al. 2017, section 2.2), which
    :mod:`dfl_agent.runtime.run.warm_start` applies to a run started from the deployed model.

    Raises:
        ValueError: ``factor`` is not in (0, 1].
    """
    if factor == 1.0:
        return base
    return dataclasses.replace(base, lr=base.lr * factor, lr_scale=factor)


@overload
def blow_up_limit(factor: float, first_loss: float, classes: int) -> float: ...
@overload
def blow_up_limit(factor: float, first_loss: torch.Tensor, classes: int) -> torch.Tensor: ...
def blow_up_limit(factor: float, first_loss: float | torch.Tensor, classes: int) -> float | torch.Tensor:
    """The loss above which a round of local training has blown up
    (:class:`TrainConfig`.divergence_factor): ``factor x max(first_loss, ln K)``, ``ln K``
    being a uniform guess's cross-entropy over ``classes`` = K classes (at least 2).

    Args:
        factor: ``divergence_factor`` (> 1; 0, the check off, is the caller's to skip).
        first_loss: the round's first mini-batch loss, a float or a ``(G,)`` tensor (one
            per member of a batched group; the limit is then ``(G,)`` too).
        classes: K, the model's output width.
    """
    floor = math.log(max(int(classes), 2))
    if isinstance(first_loss, float | int):
        return factor * max(float(first_loss), floor)
    return factor * first_loss.clamp(min=floor)


def autocast_for(device: str | torch.device, enabled: bool) -> tuple[bool, str, torch.dtype]:
    """``(use autocast, device type, dtype)`` for mixed precision on ``device``.

    Mixed precision runs on CUDA only (float16 autocast + ``torch.amp.GradScaler``); on
    cpu it is off, so a profile that asks for it trains in float32 there."""
    kind = torch.device(device).type
    return (bool(enabled) and kind == "cuda", kind, torch.float16)


def batches(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A seeded random permutation of ``range(n)`` cut into mini-batches (last may be short)."""
    perm = rng.permutation(n)
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]


def round_batches(n: int, cfg: TrainConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """The mini-batch index arrays of one round: ``cfg.epochs`` passes, or exactly
    ``cfg.steps`` batches when ``cfg.steps > 0`` (consecutive seeded permutations)."""
    if cfg.steps <= 0:
        return [idx for _ in range(cfg.epochs) for idx in batches(n, cfg.batch_size, rng)]
    out: list[np.ndarray] = []
    while len(out) < cfg.steps:
        out.extend(batches(n, cfg.batch_size, rng))
    return out[: cfg.steps]


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    cfg: TrainConfig,
    rng: np.random.Generator,
    device: str | torch.device = "cpu",
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    regularizer: Callable[[nn.Module], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Train ``model`` in place with SGD on a batch-mean loss (default cross-entropy).

    Args:
        model: maps ``(B, *input_shape)`` to logits ``(B, K)``.
        x: float32 inputs ``(N, *input_shape)``.
        y: int64 labels ``(N,)`` in ``[0, K)``.
        rng: draws the batch order (reproducible from the node's seed).
        loss_fn: ``loss_fn(logits (B, K), y (B,)) -> scalar``; default cross-entropy
            (e.g. DFML's WSM, ``dfl_agent.learning.losses.weighted_softmax_ce``).
        regularizer: ``regularizer(model) -> scalar`` added to every batch's loss
            (e.g. FedProx's proximal term).

    Under ``cfg.dp`` (differential privacy) the round is ``cfg.dp.steps_for(epochs, steps)``
    DP-SGD steps on Poisson batches of rate ``cfg.dp.sample_rate``, each sample's gradient
    clipped and the sum noised (:func:`dfl_agent.learning.dp.private_loop`; the
    ``regularizer``'s gradient, data-independent, is added after the noise; no mixed
    precision).

    Returns:
        ``{"loss": mean training loss over batches, "samples": samples seen (N * epochs),
        "diverged": 0.0 or 1.0}``, and under DP ``"dp_steps"``: the DP steps taken.  When
        training produced non-finite parameters, or a batch's loss was not finite (the
        training stops there: no step on its gradient), the model is restored to its state
        before the call, ``diverged`` is 1 and ``loss`` NaN in the second case.  So is a
        round whose mini-batch loss exceeded ``cfg.divergence_factor`` times
        ``max(first batch's loss, ln K)`` (a finite blow-up): it stops at that batch, no
        step on it, and the result has ``"exploded"``: that batch's loss.  After the last
        step the last batch's loss is computed once more (one forward pass), so that a
        last step that blew the model up is caught too.  The runtime counts a diverged
        call (``diverged`` in the round record and the status).

    Raises:
        ValueError: ``x`` and ``y`` lengths differ or the split is empty.
        TrainingAborted: the thread's abort event (:func:`abortable`) was set; checked
            before every mini-batch, the model is then left as it is.
    """
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"training data must be non-empty with matching lengths, got {len(x)} and {len(y)}")
    model.to(device).train()
    before = snapshot(model)
    amp, kind, dtype = autocast_for(device, getattr(cfg, "mixed_precision", False))
    if cfg.dp is not None:  # Opacus's DP optimizer takes only a torch.optim.Optimizer
        loss_of = loss_fn or F.cross_entropy
        dp_opt = make_optimizer(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                torch_api=True)
        stats = private_loop([model], dp_opt, cfg.dp, x, y, cfg.dp.steps_for(cfg.epochs, cfg.steps), rng,
                             lambda xb, yb: loss_of(model(xb), yb), device=device,
                             extra=None if regularizer is None else (lambda: regularizer(model)),
                             before_step=_check_abort)
        diverged = restore_if_diverged(model, before)
        return {"loss": stats["loss"], "samples": stats["samples"], "diverged": float(diverged),
                "dp_steps": stats["dp_steps"]}
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    # the AMP gradient scaler takes only a torch.optim.Optimizer
    opt = make_optimizer(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                         torch_api=amp)
    total, count, samples = 0.0, 0, 0
    scaler = torch.amp.GradScaler(kind) if amp else None
    non_finite = exploded = False
    limit = math.inf  # the blow-up limit, set by the first batch (TrainConfig.divergence_factor)
    for idx in round_batches(len(x), cfg, rng):
        _check_abort()
        bi = torch.from_numpy(idx)
        xb, yb = xt[bi].to(device), yt[bi].to(device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=kind, dtype=dtype, enabled=amp):
            logits = model(xb).float()
            loss = (loss_fn or F.cross_entropy)(logits, yb)
        if regularizer is not None:
            loss = loss + regularizer(model)
        value = float(loss.detach())
        if scaler is None and not math.isfinite(value):
            # the model blew up (overflowing logits): no step on a NaN gradient; the round's
            # training is undone below (the gradient scaler handles overflow under autocast)
            non_finite = True
            break
        if count == 0 and cfg.divergence_factor > 0 and math.isfinite(value):
            limit = blow_up_limit(cfg.divergence_factor, value, int(logits.shape[-1]))
        elif value > limit and math.isfinite(value):  # a finite blow-up: undone below, as a non-finite one
            exploded = True
            total, count = total + value, count + 1
            break
        if scaler is not None:
            assert isinstance(opt, torch.optim.Optimizer)  # torch_api=amp
            scaler.scale(loss).backward()
            if cfg.clip_grad_norm > 0:  # the true gradients' norm: unscaled first
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if cfg.clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
            opt.step()
        total += value
        count += 1
        samples += len(idx)
    if count and limit < math.inf and not (non_finite or exploded):  # did the last step blow it up?
        with torch.no_grad(), torch.autocast(device_type=kind, dtype=dtype, enabled=amp):
            kept = [(buf, buf.clone()) for buf in model.buffers()]  # the pass must not move BN statistics
            after = float((loss_fn or F.cross_entropy)(model(xb).float(), yb))
            for buf, saved in kept:
                buf.copy_(saved)
        if not after <= limit:  # above it, or not finite
            exploded, value = True, after
    diverged = restore_if_diverged(model, before, force=non_finite or exploded)
    stats = {"loss": total / max(count, 1) if not non_finite else math.nan, "samples": float(samples),
             "diverged": float(diverged)}
    if exploded:
        stats["exploded"] = value
    return stats


#: the runtime counts a call of these that returned ``diverged`` (they restore the model themselves)
train_local.restores_itself = True  # type: ignore[attr-defined]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s state dict (to undo a diverged update)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def is_finite(model: nn.Module) -> bool:
    """True when every floating tensor of ``model``'s state is finite."""
    return all(bool(torch.isfinite(v).all()) for v in model.state_dict().values() if v.is_floating_point())


def restore_if_diverged(model: nn.Module, before: dict[str, torch.Tensor], force: bool = False) -> bool:
    """Restore ``before`` into ``model`` if its state became non-finite (or ``force``: the
    training loss did); returns whether it did."""
    if not force and is_finite(model):
        return False
    model.load_state_dict(before)
    return True


@no_grad
def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 512, device: str | torch.device = "cpu"
) -> dict[str, float]:
    """Accuracy (fraction in 0..1) and mean cross-entropy of ``model`` on ``(x, y)``.

    Returns ``{"accuracy": nan, "loss": nan}`` for an empty set.
    """
    if len(x) == 0:
        return {"accuracy": float("nan"), "loss": float("nan")}
    was_training = model.training
    model.to(device).eval()
    correct, loss_sum = 0, 0.0
    for i in range(0, len(x), batch_size):
        xb = torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size], dtype=np.float32)).to(device)
        yb = torch.from_numpy(np.ascontiguousarray(y[i : i + batch_size], dtype=np.int64)).to(device)
        logits = model(xb)
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    model.train(was_training)
    return {"accuracy": correct / len(x), "loss": loss_sum / len(x)}


def warm_up(model: nn.Module, x: np.ndarray, y: np.ndarray, cfg: TrainConfig,
            device: str | torch.device = "cpu", samples: int = 8) -> float:
    """Run torch's one-time start-up work (lazy imports and initialisation of autograd,
    the optimizer and the kernels) on a throwaway copy of ``model``: one training pass
    and one evaluation over the first ``samples`` of ``(x, y)``.  ``model`` itself and
    every random generator of the caller are left untouched.

    Returns:
        the seconds it took.
    """
    import copy
    import time

    t0 = time.perf_counter()
    if len(x) and len(y):
        scratch = copy.deepcopy(model).requires_grad_(True)
        n = min(samples, len(x))
        # a throwaway copy: no DP (its steps would count against the run's plan)
        train_local(scratch, x[:n], y[:n], dataclasses.replace(cfg, epochs=1, dp=None), np.random.default_rng(0),
                    device)
        evaluate(scratch, x[:n], y[:n], device=device)
    return time.perf_counter() - t0


def adam_lr(option: float | None, train: TrainConfig | None) -> float:
    """The learning rate of an Adam algorithm (``fedd2s``, ``fedper``, ``local_adam``).

    The first of: the algorithm's ``adam_lr`` option when given; ``training.lr`` when the
    user set it (``train.lr_is_set``); else :data:`DEFAULT_ADAM_LR` (0.01, seed 002's
    baselines).  The SGD default of ``training.lr`` (0.05) never reaches Adam.  Each is
    multiplied by ``train.lr_scale`` (a warm-started run's ramp).

    Args:
        option: the algorithm's ``adam_lr`` option (None: not given).
        train: the node's :class:`TrainConfig` (None: none known).
    """
    scale = float(getattr(train, "lr_scale", 1.0))  # a warm-started run's ramp (TrainConfig.lr_scale)
    if option is not None:
        return float(option) * scale
    if train is not None and getattr(train, "lr_is_set", False):
        return float(train.lr)  # already ramped
    return DEFAULT_ADAM_LR * scale


def train_adam(model: nn.Module, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
               rng: np.random.Generator, device: str | torch.device = "cpu",
               dp: DPTraining | None = None) -> dict[str, float]:
    """Cross-entropy training with a fresh Adam (the seed 002 baselines' optimizer), seeded
    batch order; restores the model if it diverges.  Returns ``{"loss", "diverged"}``.

    Under ``dp`` (the node's ``TrainConfig.dp``): DP-Adam, Opacus's ``DPOptimizer`` around
    the Adam, ``dp.steps_for(epochs)`` steps on Poisson batches of rate ``dp.sample_rate``
    (``batch_size`` then plays no part); the result has ``"dp_steps"`` too.

    Raises:
        TrainingAborted: inside :func:`abortable` whose event is set (checked before every
            mini-batch, as :func:`train_local` does)."""
    model.to(device).train()
    before = snapshot(model)
    opt = make_optimizer(model.parameters(), "adam", lr=lr, torch_api=True)
    if dp is not None:
        stats = private_loop([model], opt, dp, x, y, dp.steps_for(epochs), rng,
                             lambda xb, yb: F.cross_entropy(model(xb), yb), device=device, before_step=_check_abort)
        return {"loss": stats["loss"], "diverged": float(restore_if_diverged(model, before)),
                "dp_steps": stats["dp_steps"]}
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    total, count = 0.0, 0
    for _ in range(epochs):
        for idx in batches(len(x), batch_size, rng):
            _check_abort()  # a stopped run ends mid-round, as in train_local
            bi = torch.from_numpy(idx)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xt[bi].to(device)), yt[bi].to(device))
            value = float(loss.detach())
            if not math.isfinite(value):  # as in train_local: undone below
                diverged = restore_if_diverged(model, before, force=True)
                return {"loss": math.nan, "diverged": float(diverged)}
            loss.backward()
            opt.step()
            total += value
            count += 1
    diverged = restore_if_diverged(model, before)
    return {"loss": total / max(count, 1), "diverged": float(diverged)}


train_adam.restores_itself = True  # type: ignore[attr-defined]


#: a warm-started run's learning rates in its first round, as a share of the full rates
RAMP_START = 0.1


def ramp_scale(ramp_rounds: int, t: int) -> float:
    """The ramp of :func:`~dfl_agent.runtime.run.warm_start.ramp_factor` for a run known to be warm-started: ``RAMP_START``
    in round 1, rising linearly to 1 in round ``ramp_rounds + 1`` (1 for ``ramp_rounds`` 0)."""
    if ramp_rounds <= 0:
        return 1.0
    return min(1.0, RAMP_START + (1.0 - RAMP_START) * max(0, t - 1) / ramp_rounds)
