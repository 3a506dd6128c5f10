"""``local_adam``: local training only, with the optimizer of seed 002's baselines (Adam):
the local floor for FedD2S/FedPer comparisons.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from dfl_agent.algorithms.base import Algorithm, Traits, register
from dfl_agent.algorithms.protocols.rotating import draw_round
from dfl_agent.learning.training import adam_lr, train_adam
from dfl_agent.privacy import policy as dp_policy


@dataclasses.dataclass
class LocalAdamOptions:
    """Options of ``local_adam``: ``adam_epochs`` per round, Adam ``adam_lr``, ``adam_batch_size``
    (0 = config's; they replace ``training.epochs``, ``training.lr`` and ``training.batch_size``,
    formerly ``local_epochs``, ``lr`` and ``batch_size``; ``adam_lr`` unset (None) is
    ``training.lr`` when the configuration sets it, else 0.01:
    :func:`dfl_agent.learning.training.adam_lr`),
    ``participation``: train only in the rounds ``fedd2s``/``fedper`` would draw this node
    (:func:`dfl_agent.algorithms.protocols.rotating.draw_round` with this ratio; 1.0 = every round) — local
    training at the same compute as the federated methods."""

    adam_epochs: int = 1
    adam_lr: float | None = None
    adam_batch_size: int = 0
    participation: float = 1.0
    #: old option names, still accepted with a deprecation warning
    renamed: ClassVar[dict[str, str]] = {"local_epochs": "adam_epochs", "lr": "adam_lr", "batch_size": "adam_batch_size"}

    def __post_init__(self) -> None:
        if self.adam_epochs < 1 or self.adam_batch_size < 0 or not (self.adam_lr is None or self.adam_lr > 0):
            raise ValueError("adam_epochs >= 1, adam_batch_size >= 0 and adam_lr > 0 required")
        if not 0 < self.participation <= 1:
            raise ValueError(f"participation must be in (0, 1], got {self.participation}")


@register
class LocalAdam(Algorithm):
    """``local_adam``: local training only, every round, with the optimizer of seed 002's
    baselines (Adam, lr 0.01) — the local floor for FedD2S/FedPer comparisons."""

    name = "local_adam"
    traits = Traits("local", required_roles=("trainer",), models_held=(4.0, 0.0),  # Adam: 2 moments
                    dp=dp_policy.DPSupport({}))
    communicates = False
    Options = LocalAdamOptions

    @classmethod
    def dp_steps_per_round(cls, options: object, *, n_samples: int, batch_size: int, epochs: int, steps: int) -> int:
        """``adam_epochs`` epochs of DP-Adam."""
        return int(getattr(options, "adam_epochs", 1)) * math.ceil(n_samples / batch_size)

    async def setup(self) -> None:
        self.model = self.new_model()

    def _train(self) -> dict[str, float]:
        d, o = self.ctx.data, self.options
        return train_adam(self.model, d.train_x, d.train_y, epochs=o.adam_epochs,
                          batch_size=o.adam_batch_size or self.ctx.train.batch_size,
                          lr=adam_lr(o.adam_lr, self.ctx.train), rng=self.ctx.rng, device=self.ctx.device,
                          dp=self.ctx.train.dp)  # DP-Adam under privacy.dp

    async def round(self, t: int) -> dict[str, Any]:
        """Round ``t`` of the local Adam baseline of seed 002 §IV-A: train with Adam, in the
        rounds this node would be drawn (seed 002 Alg. 1 line 2) when ``participation < 1``."""
        me = self.ctx.node_id
        if self.options.participation < 1:
            drawn, _ = draw_round(self.ctx.seed, t, [me, *self.ctx.live_peers()], self.options.participation)
            if me not in drawn:
                return {"neighbours": 0, "trained": False}
        stats = await self.ctx.compute(self._train)
        return {"train_loss": stats["loss"], "neighbours": 0}
