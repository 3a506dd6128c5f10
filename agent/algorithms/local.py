"""``local``: every node trains alone, no communication — the floor every algorithm must beat."""

from __future__ import annotations

from typing import Any

from dfl_agent.algorithms.base import Algorithm, Traits, register
from dfl_agent.learning.training import train_local
from dfl_agent.privacy import policy as dp_policy


@register
class Local(Algorithm):
    """Train the node's model on its own data each round; never send anything."""

    name = "local"
    traits = Traits("local", mixes_architectures=True, required_roles=("trainer",), models_held=(3.0, 0.0),
                    dp=dp_policy.DPSupport({}))
    communicates = False

    async def setup(self) -> None:
        self.model = self.new_model()

    async def round(self, t: int) -> dict[str, Any]:
        """Round ``t`` of the local baseline (no paper equation: the floor of every
        comparison): train the model on the node's own data."""
        d = self.ctx.data
        stats = await self.ctx.compute(
            train_local, self.model, d.train_x, d.train_y, self.ctx.train, self.ctx.rng, self.ctx.device
        )
        return {"train_loss": stats["loss"], "neighbours": 0}
