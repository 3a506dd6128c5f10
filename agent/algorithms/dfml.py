"""``dfml``: Decentralized Federated Mutual Learning (seed 000, Algorithm 1, Eq. 1–4).

Every node holds a regular model W_n, a frozen peak model Ŵ_n and α_n (initially 0);
its deployable model is the peak model.  Rounds are led by a rotating aggregator
(:mod:`dfl_agent.algorithms.protocols.rotating`):

- every participant first trains W_n for one epoch on its own data with WSM (Eq. 2,
  β = class proportions of its whole training split);
- the senders send W_n with its architecture spec (a dict, never code); the aggregator
  rebuilds each model from its spec and runs K epochs (default 10) of weighted mutual
  learning over *its* data (Eq. 1 and 3, β = its class proportions): Φ-weighted KL,
  teachers detached, all logits of a batch before any update, its own model included;
- α⁽ᵗ⁾ comes from the cyclic warm-restart schedule (:mod:`dfl_agent.learning.schedules`),
  whose state travels with the token;
- each participant replaces W_n by W_n⁺ and applies the peak rule: if α⁽ᵗ⁾ ≥ α_n − 1e-9
  then Ŵ_n ← W_n⁺ and α_n ← α⁽ᵗ⁾.

Models of any architecture mix: a model travels with its spec; the aggregator checks
the received tensors against the spec's shapes on the ``meta`` device before it
allocates anything.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.algorithms.base import Traits, load_matching, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.rotating import RotatingAggregator, RotationOptions
from dfl_agent.learning.losses import weighted_softmax_ce
from dfl_agent.learning.mutual import mutual_learning
from dfl_agent.learning.params import IncompatibleUpdate, check_compatible, load_numpy, model_to_numpy
from dfl_agent.learning.schedules import AlphaState, CyclicAlpha
from dfl_agent.learning.training import train_local
from dfl_agent.privacy import policy as dp_policy
from dfl_agent.privacy.plan import steps_per_round

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn, torch

PEAK_EPS = 1e-9


def class_proportions(y: np.ndarray, num_classes: int, uniform: bool = False) -> np.ndarray:
    """β: ``(C,)`` float32 fraction of each class in ``y`` (int labels in [0, C)).

    ``uniform`` (a node under differential privacy): ``1/C`` for every class, whatever ``y``:
    the class proportions of the device's data would make every sample's WSM loss depend on
    the other samples, which DP-SGD's per-sample clipping does not bound; with uniform β the
    WSM loss is plain cross-entropy (:mod:`dfl_agent.privacy.policy`)."""
    if uniform:
        return np.full(num_classes, 1.0 / num_classes, dtype=np.float32)
    counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=num_classes).astype(np.float32)
    return counts / max(1.0, float(counts.sum()))


def check_model_message(tensors: dict[str, np.ndarray], spec: Any) -> dict[str, Any]:
    """Validate a model that travels as (spec, tensors) without allocating it.

    The spec is validated, the model is built on torch's ``meta`` device (shapes only)
    and the tensors must match its state dict in names, shapes and dtypes.

    Returns the normalised spec.  Raises:
        IncompatibleUpdate: invalid spec or tensors that do not fit it.
    """
    from dfl_agent.models import SpecError, build_model, validate_spec

    try:
        spec = validate_spec(spec)
        with torch.device("meta"):
            shapes = build_model(spec).state_dict()
    except (SpecError, TypeError) as exc:
        raise IncompatibleUpdate(f"bad architecture spec: {exc}") from None
    template = {k: np.empty(tuple(v.shape), dtype=np.float32) for k, v in shapes.items()}
    check_compatible(tensors, template)
    return spec


@dataclasses.dataclass
class DFMLOptions(RotationOptions):
    """Options of ``dfml`` (defaults from ALGORITHMS.md / seed 000 App. A.2).

    Attributes:
        mutual_epochs: K, mutual-learning epochs at the aggregator.
        supervision: ``wsm`` (Eq. 2) or ``ce`` (ablation, Table 9).
        alpha_mode: ``cyclic`` or ``fixed`` (ablation); ``alpha_fixed`` for the latter.
        alpha_min, alpha_max, alpha_shape (``rise``|``full``), period0, period_growth
            (``additive``|``multiplicative``), period_step, period_factor: the schedule.
        temperature: KD temperature τ.
        weight_decay: SGD weight decay in local training and mutual learning (seed: 5e-4).
        peak_top_k: also update the peak model in the last ``peak_top_k`` rounds of each
            α cycle (the top-k α values), whatever α_n is.  1 = the strict peak rule of
            Alg. 1 (default); the seed's appendix uses N/|S| under low participation,
            so that nodes which were not drawn at the single α maximum still refresh.
    """

    mutual_epochs: int = 10
    supervision: str = "wsm"
    alpha_mode: str = "cyclic"
    alpha_fixed: float = 0.5
    alpha_min: float = 0.0
    alpha_max: float = 0.9
    alpha_shape: str = "rise"
    period0: int = 10
    period_growth: str = "additive"
    period_step: int = 10
    period_factor: float = 2.0
    temperature: float = 1.0
    weight_decay: float = 5e-4
    peak_top_k: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.peak_top_k < 1:
            raise ValueError(f"peak_top_k must be >= 1, got {self.peak_top_k}")
        if self.mutual_epochs < 1:
            raise ValueError(f"mutual_epochs must be >= 1, got {self.mutual_epochs}")
        if self.supervision not in ("wsm", "ce"):
            raise ValueError(f"supervision must be 'wsm' or 'ce', got {self.supervision!r}")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")
        self.schedule()  # validates the schedule fields

    def schedule(self) -> CyclicAlpha:
        return CyclicAlpha(
            alpha_min=self.alpha_min, alpha_max=self.alpha_max, mode=self.alpha_mode, shape=self.alpha_shape,
            period0=self.period0, growth=self.period_growth, step=self.period_step, factor=self.period_factor,
            alpha_fixed=self.alpha_fixed,
        )


@register
class DFML(RotatingAggregator):
    """One DFML node: regular model, peak model, α_n; aggregator when it holds the token."""

    name = "dfml"
    traits = Traits("rotating", mixes_architectures=True, required_roles=("trainer", "sender"),
                    models_held=(6.0, 6.0), aggregator_holds_all=True, dp=dp_policy.rotating(**{
                        "{alg}.model phi": ("public", "the model's parameter count (architecture)"),
                        "{alg}.update": ("dp-sgd", "peers' models after mutual learning on the aggregator's data, "
                                                   "clipped and noised per sample like the local step; α from the "
                                                   "schedule"),
                        "class proportions (WSM loss)": ("data-independent", "uniform under DP: the supervised loss is "
                                                                             "plain cross-entropy")}))
    Options = DFMLOptions

    @classmethod
    def dp_steps_per_round(cls, options: object, *, n_samples: int, batch_size: int, epochs: int, steps: int) -> int:
        """One local epoch, and, in a round it aggregates, ``mutual_epochs`` epochs of mutual learning."""
        return steps_per_round(n_samples, batch_size, 1, steps) + \
            int(getattr(options, "mutual_epochs", 10)) * math.ceil(n_samples / batch_size)
    #: checkpointed besides the regular and peak models and the rotation/token state
    checkpoint_attrs = ("alpha_n", "last_alpha")

    async def setup(self) -> None:
        from dfl_agent.models import count_trainable, validate_spec

        d = self.ctx.data
        self.spec = validate_spec(self.ctx.model_spec)
        self.regular = self.new_model()
        self.peak = copy.deepcopy(self.regular).requires_grad_(False)
        self.alpha_n = 0.0
        self.last_alpha: float | None = None
        self.schedule = self.options.schedule()
        self.beta = class_proportions(d.train_y, d.num_classes, uniform=self.private())
        self.phi = count_trainable(self.regular)

    # -- coordination hooks ---------------------------------------------------------
    def initial_token(self) -> dict[str, Any]:
        return {"alpha": self.schedule.initial().as_meta()}

    def _state(self, t: int, token: dict[str, Any]) -> AlphaState:
        try:
            state = AlphaState.from_meta(token.get("alpha"))
        except ValueError:
            state = self.schedule.initial()
        return self.schedule.advance(state, t)

    def next_token(self, t: int, token: dict[str, Any]) -> dict[str, Any]:
        return {"alpha": self._state(t, token).as_meta()}

    def _sup_loss(self, beta: np.ndarray):
        if self.options.supervision == "ce":
            return None
        b = torch.as_tensor(beta)
        return lambda logits, y: weighted_softmax_ce(logits, y, b)

    async def local_update(self, t: int) -> dict[str, Any]:
        ctx, d, o = self.ctx, self.ctx.data, self.options
        tc = dataclasses.replace(ctx.train, epochs=1, weight_decay=o.weight_decay)
        stats = await ctx.compute(train_local, self.regular, d.train_x, d.train_y, tc, ctx.rng, ctx.device,
                                  loss_fn=self._sup_loss(self.beta))
        return {"train_loss": stats["loss"]}

    def contribution(self, t: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return model_to_numpy(self.regular), {
            "spec": self.spec, "phi": self.phi, "samples": self.sample_count(),
        }

    def check_contribution(self, msg: Message) -> None:
        spec = check_model_message(msg.tensors, msg.meta.get("spec"))
        if spec["num_classes"] != self.spec["num_classes"]:
            raise IncompatibleUpdate(f"{spec['num_classes']} classes, this federation has {self.spec['num_classes']}")

    async def aggregate(self, t: int, token: dict[str, Any], contributions: dict[str, Message]):
        """Seed 000 Algorithm 1, the aggregator's step: K epochs of weighted mutual learning
        over its data (Eq. 1 and 3: Φ-weighted KL, WSM with its class proportions, Eq. 2) with
        α⁽ᵗ⁾ from the cyclic schedule (Eq. 4).  Returns ``({participant: (tensors, meta)}, info)``."""
        from dfl_agent.models import build_model, count_trainable, spec_hash

        ctx, d, o = self.ctx, self.ctx.data, self.options
        state = self._state(t, token)
        alpha = self.schedule.alpha(state, t)
        # the last peak_top_k rounds of a cycle carry its top-k alpha values
        top = o.alpha_mode == "cyclic" and (t - state.cycle_start) > state.period - o.peak_top_k
        senders = sorted(contributions)
        models: list[nn.Module] = [self.regular]
        for s in senders:
            m = build_model(contributions[s].meta["spec"]).to(ctx.device)
            load_numpy(m, contributions[s].tensors)
            models.append(m)
        phis = [count_trainable(m) for m in models]
        tc = ctx.train
        # the shared divergence guard: if any model (own or a sender's) ends non-finite,
        # every one is restored and counted
        with self.divergence_guard("mutual learning", *models[1:]) as guard:
            stats = await ctx.compute(
                mutual_learning, models, phis, d.train_x, d.train_y, alpha=alpha, epochs=o.mutual_epochs,
                batch_size=tc.batch_size, lr=tc.lr, rng=ctx.rng, momentum=tc.momentum, weight_decay=o.weight_decay,
                beta=None if o.supervision == "ce" else self.beta, temperature=o.temperature, device=ctx.device,
                mixed_precision=getattr(tc, "mixed_precision", False),
                dp=getattr(tc, "dp", None),  # under privacy.dp: joint per-sample clipping and noise
            )
        if guard.diverged:
            # participants keep their models, no peak update; the round is skipped
            skip = {"alpha": alpha, "skipped": True}
            return {n: ({}, skip) for n in [*senders, ctx.node_id]}, {"alpha": alpha, "skipped": True}
        meta = {"alpha": alpha, "top": bool(top and o.peak_top_k > 1)}
        updates = {s: (model_to_numpy(m), meta) for s, m in zip(senders, models[1:])}
        updates[ctx.node_id] = ({}, meta)  # own model was updated in place
        archs = len({spec_hash(contributions[s].meta["spec"]) for s in senders} | {spec_hash(self.spec)})
        return updates, {"alpha": alpha, "mutual_loss": stats["loss"], "architectures": archs}

    def apply_update(self, t: int, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Seed 000 Algorithm 1: W_n ← W_n⁺, then the peak rule: if α⁽ᵗ⁾ ≥ α_n − 1e-9,
        Ŵ_n ← W_n⁺ and α_n ← α⁽ᵗ⁾."""
        alpha = meta.get("alpha")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0.0 <= alpha <= 1.0:
            raise IncompatibleUpdate(f"bad alpha {alpha!r}")
        if meta.get("skipped"):
            return  # the aggregator's mutual learning diverged: keep the model as it is
        if tensors:
            load_numpy(self.regular, tensors)
        self.last_alpha = float(alpha)
        if alpha >= self.alpha_n - PEAK_EPS or meta.get("top") is True:  # peak rule (Alg. 1)
            self.peak.load_state_dict(self.regular.state_dict())
            self.alpha_n = float(alpha)

    # -- reporting -------------------------------------------------------------------
    def deployable_model(self) -> nn.Module:
        return self.peak

    def warm_start(self, state: Mapping[str, np.ndarray]) -> str:
        """The deployed model is a peak model: both the peak and the regular model start from it
        (a regular model started fresh would pull the peak back towards random weights)."""
        load_matching(self.peak, state)
        load_matching(self.regular, state)
        return "the peak and the regular model"

    def evaluation_models(self) -> dict[str, nn.Module]:
        return {"regular": self.regular}

    def status(self) -> dict[str, Any]:
        return {**super().status(), "alpha_n": self.alpha_n, "alpha_last": self.last_alpha,
                "model": self.spec, "phi": self.phi}
