"""The seed's decentralized FedAvg and FedProx (seed 000 App. A.3.1–A.3.2, Algorithm 2).

Same coordination and the same communication per round as DFML
(:mod:`dfl_agent.algorithms.protocols.rotating`): the senders send their locally trained
models to the round's aggregator, which averages *models of the same architecture
only* (clusters keyed by the spec hash), weighted by sample count (Eq. 5), and sends
each sender its cluster's average.  As in the seed, local training uses WSM unless
``supervision = "ce"``.

``dfedprox`` adds the proximal term μ/2 ‖w − w_start‖² to local training, with
w_start the node's own model at the start of the round (the seed's decentralized
form: each client treats its current model as the global one).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.dfml import check_model_message, class_proportions
from dfl_agent.algorithms.protocols.rotating import RotatingAggregator, RotationOptions
from dfl_agent.learning.aggregation import weighted_average
from dfl_agent.learning.losses import weighted_softmax_ce
from dfl_agent.learning.params import IncompatibleUpdate, load_numpy, model_to_numpy
from dfl_agent.learning.training import train_local
from dfl_agent.privacy import policy as dp_policy
from dfl_agent.privacy.plan import steps_per_round

if TYPE_CHECKING:
    import torch
else:
    from dfl_agent.learning.lazy import torch


@dataclasses.dataclass
class DFedAvgOptions(RotationOptions):
    """Options of ``dfedavg``: ``supervision`` = ``wsm`` (seed default) or ``ce``."""

    supervision: str = "wsm"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.supervision not in ("wsm", "ce"):
            raise ValueError(f"supervision must be 'wsm' or 'ce', got {self.supervision!r}")


@register
class DFedAvg(RotatingAggregator):
    """Cluster-wise decentralized FedAvg (seed 000 Alg. 2)."""

    name = "dfedavg"
    traits = Traits("rotating", mixes_architectures=True, required_roles=("trainer", "sender"),
                    models_held=(6.0, 6.0), aggregator_holds_all=True, dp=dp_policy.rotating())
    Options = DFedAvgOptions

    @classmethod
    def dp_steps_per_round(cls, options: object, *, n_samples: int, batch_size: int, epochs: int, steps: int) -> int:
        """Its local step trains one epoch (:meth:`local_step`), whatever ``training.epochs``."""
        return steps_per_round(n_samples, batch_size, 1, steps)

    async def setup(self) -> None:
        from dfl_agent.models import spec_hash, validate_spec

        self.spec = validate_spec(self.ctx.model_spec)
        self.hash = spec_hash(self.spec)
        self.model = self.new_model()
        self.beta = class_proportions(self.ctx.data.train_y, self.ctx.data.num_classes, uniform=self.private())

    def _regularizer(self):
        return None

    async def local_update(self, t: int) -> dict[str, Any]:
        ctx, d = self.ctx, self.ctx.data
        b = torch.as_tensor(self.beta)
        loss_fn = None if self.options.supervision == "ce" else (lambda z, y: weighted_softmax_ce(z, y, b))
        tc = dataclasses.replace(ctx.train, epochs=1)
        stats = await ctx.compute(train_local, self.model, d.train_x, d.train_y, tc, ctx.rng, ctx.device,
                                  loss_fn=loss_fn, regularizer=self._regularizer())
        return {"train_loss": stats["loss"]}

    def contribution(self, t: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return model_to_numpy(self.model), {"spec": self.spec, "samples": self.sample_count()}

    def check_contribution(self, msg: Message) -> None:
        check_model_message(msg.tensors, msg.meta.get("spec"))
        samples = msg.meta.get("samples")
        if not isinstance(samples, int) or isinstance(samples, bool) or samples <= 0:
            raise IncompatibleUpdate(f"bad sample count {samples!r}")

    async def aggregate(self, t: int, token: dict[str, Any], contributions: dict[str, Message]):
        """Seed 000 Algorithm 2 (App. A.3.1), the aggregator's step: the sample-weighted
        mean (FedAvg, McMahan et al. 2017) of the participants' models, per architecture
        (models of different specs are averaged separately).  Returns ``({participant:
        (tensors, meta)}, info)``."""
        from dfl_agent.models import spec_hash

        me = self.ctx.node_id
        members: dict[str, list[tuple[str, dict[str, np.ndarray], int]]] = {}
        members.setdefault(self.hash, []).append((me, model_to_numpy(self.model), self.sample_count()))
        for s in sorted(contributions):
            m = contributions[s]
            members.setdefault(spec_hash(m.meta["spec"]), []).append((s, m.tensors, m.meta["samples"]))
        updates: dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}
        for group in members.values():  # Eq. 5 within each architecture cluster
            avg = weighted_average([g[1] for g in group], [g[2] for g in group])
            for node, _, _ in group:
                updates[node] = (avg, {})
        return updates, {"clusters": len(members)}

    def apply_update(self, t: int, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Seed 000 Algorithm 2: replace the model by the aggregate of round ``t`` sent by
        the aggregator."""
        load_numpy(self.model, tensors)
