"""Batched local training for the simulator: many nodes, one vectorised step.

In the simulator every node's ``ctx.compute(train_local, model, x, y, cfg, rng, device)``
runs inline and takes no virtual time, so at the start of a round N nodes train one
after the other in the same virtual instant.  :class:`BatchTrainer` collects those
calls instead, and when nothing else can run at that instant it trains each group of
nodes that qualify together: their parameters are stacked on a leading node axis and
one ``torch.func.vmap`` of ``grad`` over ``functional_call`` computes every node's
mini-batch gradient in one pass; the SGD update (momentum, weight decay) is applied to
the stacked tensors.  No algorithm changes: the algorithms still call
``ctx.compute(train_local, ...)``, which the simulator's contexts route here.

A group qualifies when its nodes share

- the function (:func:`~dfl_agent.learning.training.train_local` with the default loss
  and no regularizer) and the device (``cpu``, or one CUDA device without mixed
  precision, which the vectorised step does not do), and no differential privacy
  (``TrainConfig.dp``: DP-SGD's Poisson batches, per-sample clipping and noise run in the
  per-node loop, through Opacus),
- the architecture (module structure and parameter shapes; no buffers such as batch
  norm statistics, no dropout, every parameter trainable),
- the optimizer settings (the whole :class:`~dfl_agent.learning.training.TrainConfig`),
- the step count (batch sizes may differ: shorter batches are padded and the padding
  is masked out of the loss, so each node's loss stays the mean over its own batch).

Everything else (and a group of one) runs the ordinary per-node loop.  Each node still
draws its batch order from its own generator, in the same order as the per-node loop,
so batched and per-node training agree within float tolerance (summation order of the
batched matrix products differs).

Evaluation is batched the same way (:meth:`BatchTrainer.submit_eval`): the nodes'
``evaluate(model, x, y)`` calls of one instant are grouped by architecture and data
shape, and one ``vmap`` of ``functional_call`` over the stacked parameters computes every
node's logits at once.  When the nodes evaluate on the same array (the simulator's
shared global test set) it is passed once, not stacked; otherwise (each node's own
validation split) the groups' arrays are stacked.  Accuracy and mean loss equal
:func:`~dfl_agent.learning.training.evaluate`'s within float tolerance.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.learning.training import TrainConfig, blow_up_limit, evaluate, round_batches, sgd_step, train_local

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dfl_agent.runtime.node.context import RuntimeContext

#: one node's part of a batched training: ``(model, x, y, its mini-batch index arrays)``
Member = tuple["nn.Module", np.ndarray, np.ndarray, list[np.ndarray]]
#: a model's architecture identity (:meth:`BatchTrainer._arch_key`), a grouping key
ArchKey = tuple[object, ...]

log = logging.getLogger(__name__)

#: modules that make a model ineligible (randomness or running statistics per call)
_UNBATCHABLE = ("Dropout", "BatchNorm", "InstanceNorm", "GroupNorm")


class _Request:
    __slots__ = ("batches", "cfg", "ctx", "device", "future", "model", "x", "y")

    def __init__(self, ctx: RuntimeContext, model: nn.Module, x: np.ndarray, y: np.ndarray, cfg: TrainConfig,
                 batches: list[np.ndarray], future: asyncio.Future[dict[str, float]], device: str = "cpu"):
        self.ctx, self.model, self.x, self.y, self.cfg = ctx, model, x, y, cfg
        self.batches, self.future, self.device = batches, future, device


class _EvalRequest:
    __slots__ = ("batch_size", "device", "future", "model", "x", "y")

    def __init__(self, model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int,
                 future: asyncio.Future[dict[str, float]], device: str = "cpu"):
        self.model, self.x, self.y, self.batch_size, self.future = model, x, y, batch_size, future
        self.device = device


def _batch_device(device: str | torch.device) -> str | None:
    """``device`` as a string when the vectorised paths run there (``cpu``, ``cuda``,
    ``cuda:N``), else None."""
    text = str(device)
    return text if text == "cpu" or text == "cuda" or text.startswith("cuda:") else None


#: most nodes evaluated in one vectorised pass (bounds the memory of the stacked activations)
EVAL_GROUP_MAX = 128


class BatchTrainer:
    """Collects qualifying ``train_local`` calls of one virtual instant and trains them
    in vectorised groups (see the module docstring).

    Args:
        min_group: smallest group trained batched; smaller groups use the per-node loop.

    Attributes:
        stats: ``batched_nodes`` (node trainings done in a group), ``groups`` (vectorised
            groups run), ``single`` (qualifying trainings left alone in their group, run
            as a group of one).
    """

    def __init__(self, min_group: int = 2):
        self.min_group = max(2, min_group)
        self._pending: list[_Request] = []
        self._scheduled = False
        # model -> (training key, evaluation key); weak, so temporary models go
        self._arch_keys: weakref.WeakKeyDictionary[nn.Module, tuple[ArchKey | None, ArchKey | None]] = \
            weakref.WeakKeyDictionary()
        self.stats = {"batched_nodes": 0, "groups": 0, "single": 0}
        self._pending_eval: list[_EvalRequest] = []
        #: ``evaluated_batched`` (evaluations done in a vectorised group), ``eval_groups``
        #: (vectorised evaluation passes), ``eval_single`` (qualifying evaluations alone in
        #: their group, run per node)
        self.eval_stats = {"evaluated_batched": 0, "eval_groups": 0, "eval_single": 0}

    # -- qualification -------------------------------------------------------------
    def _arch_key(self, model: nn.Module, for_eval: bool = False) -> ArchKey | None:
        """Architecture identity of ``model``, or None when it cannot be batched.  For
        evaluation (``for_eval``) frozen parameters are allowed: only training needs
        every parameter trainable."""
        try:
            keys = self._arch_keys[model]
        except KeyError:
            keys = (None, None)
            if not any(True for _ in model.buffers()) and not any(
                    any(name in type(m).__name__ for name in _UNBATCHABLE) for m in model.modules()):
                params = list(model.named_parameters())
                if params and all(p.dtype.is_floating_point for _, p in params):
                    arch = (type(model), repr(model), tuple((n, tuple(p.shape), p.dtype) for n, p in params))
                    keys = (arch if all(p.requires_grad for _, p in params) else None, arch)
            self._arch_keys[model] = keys
        return keys[1] if for_eval else keys[0]

    def submit(self, ctx: RuntimeContext, fn: Callable[..., object], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> asyncio.Future[dict[str, float]] | None:
        """Queue ``fn(*args, **kwargs)`` for batching; None when the call does not qualify
        (the caller then runs it itself).  Draws the node's batch order now, from its own
        generator, exactly as ``train_local`` would."""
        if fn is not train_local or len(args) != 6 or any(
                k not in ("loss_fn", "regularizer") or v is not None for k, v in kwargs.items()):
            return None  # another function, or a custom loss / regularizer
        model, x, y, cfg, rng, device = args
        dev = _batch_device(device)
        if dev is None or not isinstance(cfg, TrainConfig) or len(x) != len(y) or len(x) == 0:
            return None
        if dev != "cpu" and cfg.mixed_precision:
            return None  # autocast + gradient scaling: train_local's per-node loop does it
        if getattr(cfg, "dp", None) is not None or cfg.clip_grad_norm > 0:
            return None  # DP-SGD (Poisson batches, per-sample clipping, noise), gradient clipping: the per-node loop
        if self._arch_key(model) is None:
            return None
        if dev != "cpu":
            model.to(dev)  # as train_local does
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, float]] = loop.create_future()
        self._pending.append(_Request(ctx, model, x, y, cfg, round_batches(len(x), cfg, rng), fut, dev))
        self._schedule(loop)
        return fut

    def submit_eval(self, model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 512,
                    device: str | torch.device = "cpu") -> asyncio.Future[dict[str, float]] | None:
        """Queue ``evaluate(model, x, y, batch_size, device)`` for a batched pass; None when
        it does not qualify (another device, an empty set, a model that cannot be batched:
        the caller then evaluates it itself).  The future's result is ``evaluate``'s
        ``{"accuracy", "loss"}``."""
        dev = _batch_device(device)
        if dev is None or len(x) == 0 or len(x) != len(y) or self._arch_key(model, for_eval=True) is None:
            return None
        if dev != "cpu":
            model.to(dev)  # as evaluate does
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, float]] = loop.create_future()
        self._pending_eval.append(_EvalRequest(model, x, y, batch_size, fut, dev))
        self._schedule(loop)
        return fut

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush_when_idle, loop, 0)

    # -- flushing --------------------------------------------------------------------
    def _flush_when_idle(self, loop: asyncio.AbstractEventLoop, spins: int) -> None:
        """Train the pending requests once nothing else can run at this instant (no
        ready callbacks, no timer due now); otherwise look again after them."""
        ready: Any = getattr(loop, "_ready", ())
        scheduled: Any = getattr(loop, "_scheduled", ())
        due = bool(scheduled) and scheduled[0]._when <= loop.time()
        if (ready or due) and spins < 100_000:
            loop.call_soon(self._flush_when_idle, loop, spins + 1)
            return
        self._scheduled = False
        pending, self._pending = self._pending, []
        evals, self._pending_eval = self._pending_eval, []
        if evals:
            self.run_eval(evals)
        if pending:
            self.run(pending)

    def run_eval(self, requests: list[_EvalRequest]) -> None:
        """Evaluate ``requests`` (grouped by architecture, data shape and data identity;
        groups of one per node) and resolve their futures."""
        groups: dict[tuple[object, ...], list[_EvalRequest]] = {}
        for r in requests:
            key = (self._arch_key(r.model, for_eval=True), r.batch_size, r.x.shape, r.x.dtype, r.y.shape, r.device)
            groups.setdefault(key, []).append(r)
        for group in groups.values():
            # the same arrays for every member (the shared test set): one input for all
            by_data: dict[tuple[int, int], list[_EvalRequest]] = {}
            for r in group:
                by_data.setdefault((id(r.x), id(r.y)), []).append(r)
            # members on arrays of their own (validation splits) are stacked together
            parts = [p for p in by_data.values() if len(p) >= self.min_group]
            rest = [r for p in by_data.values() if len(p) < self.min_group for r in p]
            if rest:
                parts.append(rest)
            for part in parts:
                for start in range(0, len(part), EVAL_GROUP_MAX):
                    chunk = part[start:start + EVAL_GROUP_MAX]
                    try:
                        if len(chunk) >= self.min_group:
                            results = evaluate_group([r.model for r in chunk], [r.x for r in chunk],
                                                     [r.y for r in chunk], chunk[0].batch_size)
                            self.eval_stats["eval_groups"] += 1
                            self.eval_stats["evaluated_batched"] += len(chunk)
                        else:
                            results = [evaluate(r.model, r.x, r.y, batch_size=r.batch_size, device=r.device)
                                       for r in chunk]
                            self.eval_stats["eval_single"] += len(chunk)
                    except Exception as exc:  # hand the error to every waiting node
                        for r in chunk:
                            if not r.future.done():
                                r.future.set_exception(exc)
                        continue
                    for r, res in zip(chunk, results):
                        if not r.future.done():
                            r.future.set_result(res)

    def run(self, requests: list[_Request]) -> None:
        """Train ``requests`` (grouped; small groups per node) and resolve their futures."""
        groups: dict[tuple[object, ...], list[_Request]] = {}
        for r in requests:
            key = (self._arch_key(r.model), r.cfg, len(r.batches), r.device)
            groups.setdefault(key, []).append(r)
        for group in groups.values():
            t0 = time.perf_counter()
            try:
                if len(group) >= self.min_group:
                    results = train_group([(r.model, r.x, r.y, r.batches) for r in group], group[0].cfg)
                    self.stats["groups"] += 1
                    self.stats["batched_nodes"] += len(group)
                else:
                    results = [train_group([(r.model, r.x, r.y, r.batches)], r.cfg)[0] for r in group]
                    self.stats["single"] += len(group)
            except Exception as exc:  # hand the error to every waiting node
                for r in group:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            share = (time.perf_counter() - t0) / len(group)
            for r, res in zip(group, results):
                r.ctx.timing["train_s"] += share
                if not r.future.done():
                    r.future.set_result(res)


def train_group(members: list[Member],
                cfg: TrainConfig) -> list[dict[str, float]]:
    """Train G models of one architecture together with SGD, in place.

    Args:
        members: ``(model, x (n_i, *shape) float32, y (n_i,) int64, batches)`` per node;
            ``batches`` are the node's mini-batch index arrays, the same count for every
            member (sizes may differ).  Every model's parameters are on one device (cpu
            or one CUDA device); the step runs there, the data is copied there once.
        cfg: the shared optimizer settings (``lr``, ``momentum``, ``weight_decay``).

    Returns:
        per member, ``train_local``'s result: ``{"loss": mean batch loss, "samples",
        "diverged"}``; a member whose parameters became non-finite keeps its old ones
        (``diverged`` = 1), as in ``train_local``, and so does a member whose mini-batch
        loss exceeded ``cfg.divergence_factor`` times ``max(its first batch's loss, ln K)``
        (its result then has ``"exploded"`` and counts the batches up to that one, as
        ``train_local``'s, which stops there; here the group's step goes on, and the member's
        later steps are discarded), or whose last batch's loss after the last step did.

    The update is :func:`dfl_agent.learning.training.sgd_step` on the stacked parameters,
    which equals ``torch.optim.SGD`` (no dampening, no Nesterov) for each member.
    """
    import torch
    from torch.func import functional_call, grad_and_value, vmap
    from torch.nn import functional as F

    base = members[0][0]
    names = [n for n, _ in base.named_parameters()]
    dev = next(base.parameters()).device
    for m, *_ in members:
        m.train()
    with torch.no_grad():
        member_params = [dict(m.named_parameters()) for m, *_ in members]
        stacked = {n: torch.stack([p[n].detach() for p in member_params]) for n in names}  # a new tensor

    def loss_of(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(base, params, (xb,)), yb)

    def masked_loss_of(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        # batches padded to the group's largest: the padding rows weigh 0, the mean is
        # over the member's own batch
        per_sample = F.cross_entropy(functional_call(base, params, (xb,)), yb, reduction="none")
        return (per_sample * mask).sum() / mask.sum()

    step = vmap(grad_and_value(loss_of))
    masked_step = vmap(grad_and_value(masked_loss_of))
    last: tuple[Any, ...] = ()
    g = len(members)
    xs, ys = _stack_data(members, dev)
    rows = torch.arange(g, device=dev).unsqueeze(1)
    n_steps = len(members[0][3])
    bufs: dict[str, torch.Tensor] = {}
    losses = torch.zeros(g, dtype=torch.float64, device=dev)
    watch = _BlowUpWatch(cfg.divergence_factor, base, xs, n_steps)
    for s in range(n_steps):
        idx = [b[3][s] for b in members]
        width = max(len(i) for i in idx)
        if all(len(i) == width for i in idx):
            cols = torch.from_numpy(np.stack(idx).astype(np.int64, copy=False)).to(dev)
            last = (loss_of, xs[rows, cols], ys[rows, cols])
            grads, loss = step(stacked, *last[1:])
        else:  # pad every member's batch with its first sample, masked out of the loss
            cols = torch.from_numpy(np.stack([np.concatenate([i, np.full(width - len(i), i[0])])
                                              for i in idx]).astype(np.int64, copy=False)).to(dev)
            lengths = torch.tensor([len(i) for i in idx], device=dev).unsqueeze(1)
            mask = (torch.arange(width, device=dev).unsqueeze(0) < lengths).float()
            last = (masked_loss_of, xs[rows, cols], ys[rows, cols], mask)
            grads, loss = masked_step(stacked, *last[1:])
        losses += watch.step(s, loss.detach().double())
        sgd_step(stacked, grads, bufs, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        del grads  # (or the momentum buffer now): not held while the next step's gradients are computed
    if last and watch.factor > 0:  # the last batch once more: did the last step blow a model up?
        with torch.no_grad():
            watch.after(vmap(last[0])(stacked, *last[1:]).double())
    return _write_back(members, member_params, stacked, names, losses, watch)


class _BlowUpWatch:
    """:func:`train_group`'s check of ``TrainConfig.divergence_factor``, as ``train_local``
    does it per node: the first step sets each member's limit (the factor times ``max(first
    batch's loss, ln K)``); a member whose loss exceeds it has blown up at that step."""

    def __init__(self, factor: float, base: nn.Module, xs: torch.Tensor, n_steps: int):
        import torch

        g = xs.shape[0]
        self.factor, self.dev = factor, xs.device
        self.blown = torch.zeros(g, dtype=torch.bool, device=self.dev)
        self.value = torch.zeros(g, dtype=torch.float64, device=self.dev)  # the loss that blew up
        self.steps = torch.full((g,), n_steps, dtype=torch.float64, device=self.dev)  # the losses counted
        self.trained = self.steps.clone()  # the batches trained on (``samples``)
        self.limit = torch.full((g,), math.inf, dtype=torch.float64, device=self.dev)
        if factor > 0:
            with torch.no_grad():
                self.classes = int(base(xs[0, :1]).shape[-1])  # K (the logits of one window)

    def step(self, s: int, loss: torch.Tensor) -> torch.Tensor:
        """Record step ``s``'s ``(G,)`` losses; returns the part to add to each member's sum
        (0 for a member that blew up before this step)."""
        import torch

        if self.factor <= 0:
            return loss
        if s == 0:
            self.limit = blow_up_limit(self.factor, loss, self.classes)
            return loss
        counted = torch.where(self.blown, torch.zeros_like(loss), loss)
        now = ~self.blown & torch.isfinite(loss) & (loss > self.limit)
        self.value = torch.where(now, loss, self.value)
        self.steps = torch.where(now, torch.full_like(loss, s + 1), self.steps)
        self.trained = torch.where(now, torch.full_like(loss, s), self.trained)
        self.blown |= now
        return counted

    def after(self, loss: torch.Tensor) -> None:
        """The ``(G,)`` losses of the last batch after the last step: a member above its
        limit (or not finite) blew up in that step."""
        import torch

        now = ~self.blown & ~(loss <= self.limit)
        self.value = torch.where(now, loss, self.value)
        self.blown |= now


def _stack_data(members: list[Member], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every member's data in one ``(G, n_max, *shape)`` block on the device (shorter splits
    zero-padded; the padding is never indexed): each step of :func:`train_group` gathers
    the G mini-batches in one indexing operation, not G (the same samples, so the same
    values).  Returns ``(xs float32, ys int64)`` tensors on ``dev``."""
    import torch

    g = len(members)
    n_max = max(len(x) for _, x, _, _ in members)
    x_all = np.zeros((g, n_max, *members[0][1].shape[1:]), dtype=np.float32)
    y_all = np.zeros((g, n_max), dtype=np.int64)
    for j, (_, x, y, _) in enumerate(members):
        x_all[j, :len(x)] = x
        y_all[j, :len(y)] = y
    return torch.from_numpy(x_all).to(dev), torch.from_numpy(y_all).to(dev)


def _write_back(members: list[Member], member_params: list[dict[str, nn.Parameter]],
                stacked: dict[str, torch.Tensor], names: list[str], losses: torch.Tensor, watch: _BlowUpWatch) -> list[dict[str, float]]:
    """Copy each member's trained parameters (row i of ``stacked``) back into its model,
    unless they are non-finite or its loss blew up (then the model keeps its old ones,
    ``diverged`` = 1), and return :func:`train_group`'s per-member results."""
    import torch

    out = []
    with torch.no_grad():
        dev = losses.device
        finite = torch.ones(len(members), dtype=torch.bool, device=dev)
        for n in names:
            finite &= torch.isfinite(stacked[n].reshape(len(members), -1)).all(dim=1)
        # one transfer each, not G
        finite_l, losses_l, blown_l = finite.cpu().tolist(), losses.cpu().tolist(), watch.blown.cpu().tolist()
        steps_l, value_l, trained_l = watch.steps.cpu().tolist(), watch.value.cpu().tolist(), watch.trained.cpu().tolist()
        for i, (_m, _x, _, batches) in enumerate(members):
            ok = bool(finite_l[i]) and not blown_l[i]
            if ok:
                params = member_params[i]
                for n in names:
                    params[n].copy_(stacked[n][i])
            steps = int(steps_l[i])
            samples = sum(len(b) for b in batches[:int(trained_l[i])])
            result = {"loss": float(losses_l[i]) / max(steps, 1), "samples": float(samples),
                      "diverged": 0.0 if ok else 1.0}
            if blown_l[i]:
                result["exploded"] = float(value_l[i])
            out.append(result)
    return out


def evaluate_group(models: list[nn.Module], xs: list[np.ndarray], ys: list[np.ndarray],
                   batch_size: int = 512) -> list[dict[str, float]]:
    """Evaluate G models of one architecture in one vectorised pass per chunk.

    Args:
        models: G >= 1 models with the same architecture (no buffers, see
            :class:`BatchTrainer`), their parameters on one device (cpu or one CUDA
            device: the pass runs there); left unchanged (their train/eval mode included).
        xs, ys: per model, inputs ``(n, *shape)`` float32 and labels ``(n,)`` int64 of the
            same shapes for every model.  When every ``xs[i]`` is the same array (and every
            ``ys[i]``), it is read once and shared by all models; otherwise the arrays are
            stacked ``(G, n, *shape)``.
        batch_size: samples per chunk, as in ``evaluate``.

    Returns:
        per model, :func:`~dfl_agent.learning.training.evaluate`'s ``{"accuracy": fraction
        in 0..1, "loss": mean cross-entropy}``, equal to it within float tolerance (the
        batched matrix products sum in another order).
    """
    import torch
    from torch.func import functional_call, vmap
    from torch.nn import functional as F

    g, n = len(models), len(xs[0])
    base = models[0]
    shared = all(x is xs[0] for x in xs) and all(y is ys[0] for y in ys)
    names = [name for name, _ in base.named_parameters()]
    dev = next(base.parameters()).device
    was_training = base.training
    correct = torch.zeros(g, dtype=torch.int64, device=dev)
    loss_sum = torch.zeros(g, dtype=torch.float64, device=dev)
    try:
        base.eval()
        with torch.no_grad():
            model_params = [dict(m.named_parameters()) for m in models]
            stacked = {name: torch.stack([p[name].detach() for p in model_params]) for name in names}
            fwd = vmap(lambda params, xb: functional_call(base, params, (xb,)),  # the logits of every model
                       in_dims=(0, None) if shared else (0, 0))
            for i in range(0, n, batch_size):
                if shared:
                    xb = torch.from_numpy(np.ascontiguousarray(xs[0][i:i + batch_size], dtype=np.float32)).to(dev)
                    yb = torch.from_numpy(np.ascontiguousarray(ys[0][i:i + batch_size], dtype=np.int64)).to(dev)
                    yb = yb.unsqueeze(0).expand(g, -1)
                else:
                    xb = torch.from_numpy(np.stack([np.ascontiguousarray(x[i:i + batch_size], dtype=np.float32)
                                                    for x in xs])).to(dev)
                    yb = torch.from_numpy(np.stack([np.ascontiguousarray(y[i:i + batch_size], dtype=np.int64)
                                                    for y in ys])).to(dev)
                logits = fwd(stacked, xb)  # (G, B, classes)
                b = logits.shape[1]
                per_sample = F.cross_entropy(logits.reshape(g * b, -1), yb.reshape(-1), reduction="none")
                loss_sum += per_sample.reshape(g, b).sum(1).double()
                correct += (logits.argmax(2) == yb).sum(1)
    finally:
        base.train(was_training)
    correct_l, loss_l = correct.cpu().tolist(), loss_sum.cpu().tolist()
    return [{"accuracy": int(correct_l[j]) / n, "loss": float(loss_l[j]) / n} for j in range(g)]
