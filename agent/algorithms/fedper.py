"""``fedper``: FedPer (Arivazhagan et al. 2019; a baseline of seed 002 §IV-A) without a server.

Each node's model = a shared *base* + a personal *head* (the last ``head_layers`` layers
with parameters; seed 002: everything up to the flatten after C3 is shared, i.e. the
dense layers are personal — set ``head_layers = 3`` for that; default 1 = the classifier
only, the original FedPer).  Rounds use the same serverless coordination as ``fedd2s``
(:class:`dfl_agent.algorithms.protocols.rotating.GlobalModelRotation`): the token holder draws ⌈ρN⌉
participants, sends them the global base; each loads it under its own head, trains its
whole model for ``adam_epochs`` with Adam (lr 0.01, as the seed's baselines) and returns
its base; the holder averages the bases weighted by sample count (FedAvg) and sends the
average back, which each participant loads under its head.  ``head_layers = 0`` shares
everything: FedAvg with partial participation on the same protocol.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dfl_agent.algorithms.base import Traits, load_matching, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.rotating import GlobalModelRotation, RotationOptions, global_init_seed
from dfl_agent.learning.aggregation import weighted_average
from dfl_agent.learning.params import IncompatibleUpdate, check_compatible, model_to_numpy
from dfl_agent.learning.training import adam_lr, train_adam
from dfl_agent.privacy import policy as dp_policy

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn, torch

Tensors = dict[str, np.ndarray]


def personal_keys(model: nn.Module, head_layers: int) -> set[str]:
    """State-dict names of the last ``head_layers`` modules that own parameters
    (for a ``convdense`` model: the last ``head_layers`` layers of ``model.blocks``).

    Raises:
        ValueError: ``head_layers`` is negative or not smaller than the number of such modules.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is not None:
        owners = [f"blocks.{i}." for i in range(len(blocks))]
    else:
        owners = [f"{n}." for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    if not 0 <= head_layers < len(owners):
        raise ValueError(f"algorithm.options.head_layers must be in [0, {len(owners) - 1}], got {head_layers}")
    personal = owners[len(owners) - head_layers:] if head_layers else []
    return {k for k in model.state_dict() if any(k.startswith(p) for p in personal)}


@dataclasses.dataclass
class FedPerOptions(RotationOptions):
    """Options of ``fedper``.

    Attributes:
        sender_ratio: ρ, participation ratio over all live nodes (seed 002: 0.2).
        head_layers: personal layers at the end of the model (0 = share all: FedAvg).
        adam_epochs: local passes per participation; replaces ``training.epochs``
            (formerly ``local_epochs``).
        adam_lr: Adam learning rate; replaces ``training.lr`` (formerly ``lr``).  Unset
            (None): ``training.lr`` when the configuration sets it, else 0.01 (seed 002's
            rate for all baselines; :func:`dfl_agent.learning.training.adam_lr`).
        adam_batch_size: 0 = the training config's (formerly ``batch_size``).
    """

    sender_ratio: float = 0.2
    head_layers: int = 1
    adam_epochs: int = 1
    adam_lr: float | None = None
    adam_batch_size: int = 0
    #: old option names, still accepted with a deprecation warning
    renamed: ClassVar[dict[str, str]] = {"local_epochs": "adam_epochs", "lr": "adam_lr", "batch_size": "adam_batch_size"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_layers < 0 or self.adam_epochs < 1 or self.adam_batch_size < 0 or not (self.adam_lr is None or self.adam_lr > 0):
            raise ValueError("head_layers >= 0, adam_epochs >= 1, adam_batch_size >= 0 and adam_lr > 0 required")


@register
class FedPer(GlobalModelRotation):
    """One FedPer node: base shared through the rotating token holder, head kept local."""

    name = "fedper"
    traits = Traits("rotating", dp=dp_policy.DPSupport({
        "{alg}.model": ("dp-sgd", "base layers trained with DP-Adam"), "{alg}.model samples": dp_policy.SAMPLES,
        "{alg}.update": dp_policy.AVERAGE, **dp_policy.ROTATION}))
    Options = FedPerOptions

    @classmethod
    def dp_steps_per_round(cls, options: object, *, n_samples: int, batch_size: int, epochs: int, steps: int) -> int:
        """``adam_epochs`` epochs of DP-Adam."""
        return int(getattr(options, "adam_epochs", 1)) * math.ceil(n_samples / batch_size)

    async def setup(self) -> None:
        from dfl_agent.models import validate_spec

        self.spec = validate_spec(self.ctx.model_spec)
        self.model = self.new_model()
        self.personal = personal_keys(self.model, self.options.head_layers)
        self.batch_size = self.options.adam_batch_size or self.ctx.train.batch_size
        self._init_global()

    def _base(self, model: nn.Module) -> Tensors:
        return {k: v for k, v in model_to_numpy(model).items() if k not in self.personal}

    def initial_global(self) -> Tensors:
        return self._base(self.new_model(seed=global_init_seed(self.ctx.seed)))

    def warm_start(self, state: Mapping[str, np.ndarray]) -> str:
        """The local model (shared base and personal head) and the initial global base θ^g:
        the deployed model's base (the aggregator of round 1 sends its own)."""
        load_matching(self.model, state)
        self._initial = self._template = self._base(self.model)
        return "the local model and the initial global base"

    def _load_base(self, base: Tensors) -> None:
        check_compatible(base, self._template)
        self.model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in base.items()},
                                   strict=False)

    def _train(self) -> dict[str, float]:
        d, o = self.ctx.data, self.options
        return train_adam(self.model, d.train_x, d.train_y, epochs=o.adam_epochs, batch_size=self.batch_size,
                          lr=adam_lr(o.adam_lr, self.ctx.train), rng=self.ctx.rng, device=self.ctx.device,
                          dp=self.ctx.train.dp)  # DP-Adam under privacy.dp

    async def local_update(self, t: int) -> dict[str, Any]:
        assert self._theta_in is not None
        self._load_base(self._theta_in)
        stats = await self.ctx.compute(self._train)
        return {"train_loss": stats["loss"]}

    def contribution(self, t: int) -> tuple[Tensors, dict[str, Any]]:
        return self._base(self.model), {"samples": self.sample_count()}

    def check_contribution(self, msg: Message) -> None:
        super().check_contribution(msg)
        n = msg.meta.get("samples")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise IncompatibleUpdate(f"bad sample count {n!r}")

    async def aggregate(self, t: int, token: dict[str, Any], contributions: dict[str, Message]):
        """FedPer (Arivazhagan et al. 2019, Alg. 1): the sample-weighted mean (FedAvg) of the
        participants' bases.  Returns ``({participant: (tensors, meta)}, info)``."""
        me = self.ctx.node_id
        states = {s: (m.tensors, m.meta["samples"]) for s, m in contributions.items()}
        if t in self._participated:
            states[me] = (self._base(self.model), self.sample_count())
        if not states:
            self._theta_out = self._theta_in or self.current_global()
            return {}, {"aggregated": 0}
        order = sorted(states)
        avg = weighted_average([states[s][0] for s in order], [states[s][1] for s in order])
        self._theta_out = avg
        return {s: (avg, {}) for s in order}, {"aggregated": len(order)}

    def apply_update(self, t: int, tensors: Tensors, meta: dict[str, Any]) -> None:
        """FedPer (Arivazhagan et al. 2019): load the averaged base under the own personal head."""
        self._load_base(tensors)

    def deployable_model(self) -> nn.Module:
        """The personal model; with ``head_layers = 0`` (FedAvg) the newest *global* model this
        node knows (what FedAvg deploys), so that UA is the global model on each node's split."""
        if self.personal:
            return self.model
        g = self.current_global()
        if getattr(self, "_view_src", None) is not g:
            self._view = getattr(self, "_view", None) or self.new_model()
            self._view.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in g.items()})
            self._view_src = g
        return self._view

    def status(self) -> dict[str, Any]:
        return {**super().status(), "personal_tensors": len(self.personal), "model": self.spec}
