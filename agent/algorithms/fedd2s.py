"""``fedd2s``: FedD2S without a server (seed 002, Alg. 1, Eq. 6, 8–13; ALGORITHMS.md "FedD2S, serverless").

Every node keeps its own *personal* model θ^n (its deployable model).  Knowledge is
shared through a global model θ^g that travels with the token of the rotating-aggregator
protocol (:mod:`dfl_agent.algorithms.protocols.rotating`, the same coordination and failover as
DFML).  Round t, led by the token holder h:

1. h draws the participants U^ρ (⌈ρN⌉ of the live nodes, itself included in the draw)
   and the next holder from a generator seeded with (federation seed, t) — the token's
   "rng state" is the round number, so a failover holder draws the same set — and sends
   θ^g to each participant (``invite``).
2. Participant n: Z_n ← Z_n + 1; l_n = max(l_min, L − ⌊(Z_n − 1)/Z_0⌋) (Eq. 6, clamped to
   the shallowest layer of the dropping set); computes (H_1, H_{l_n}, Y) from its personal
   model on its own data (eval mode, fixed batch order); runs client-to-server
   distillation on a fresh copy θ^{g,n} of θ^g (Eq. 8–10, :func:`dfl_agent.learning.d2s.c2s_distill`)
   and returns the copy (``model``).  No activation or label leaves the node: this is
   the "parameter" variant of ALGORITHMS.md, which computes what the seed's server
   computes from the features.
3. h: θ^g ← unweighted mean of the copies (Eq. 11 over the participants, in node-id
   order), sends θ^g to every participant (``update``); each runs server-to-client
   distillation locally (Eq. 12–13, :func:`dfl_agent.learning.d2s.s2c_distill`) with
   t^n = F(H_1^n; θ^g_{+1}) from the H_1 it computed in step 2.
4. h broadcasts ``done`` with θ^g: whoever leads next (or takes over after a failure)
   starts from it.

Non-participants do nothing in a round (Algorithm 1: only the drawn clients U^ρ update their
models), so a node's personal model trains only when it is drawn: with ρ = 0.2 about one
round in five, and on a small federation (4 nodes: one node a round) unevenly.  The
centralized reference (server fed the
features, ``bench/fedd2s/reference.py``) gives the same personal models for the
same seed — a unit test checks it.

Options beyond ALGORITHMS.md (defaults = the seed's values): ``z0`` (3/5/7 for Dirichlet
α = 0.1/0.5/1), ``dropping_set``, ``lr`` (Adam, 0.01), ``c2s_epochs``/``s2c_epochs``
(passes per distillation phase, 4: the seed's E = 4 of §IV-A, with which its Table 2 UA
figures were measured; its Fig. 3 convergence curves use 1), ``temperature`` (1),
``distill_batch_size`` (0 = the training config's).  With one pass per phase the personal model
gets a quarter of the training and stays below training alone: on label-skewed HAR
(4 nodes, Dirichlet 0.5, 20 rounds, seeds 0–2) own-data accuracy 0.738/0.689/0.817 with
E = 1 against 0.878/0.870/0.888 for ``local``, and 0.907/0.918/0.923 with E = 4
(``bench/fedd2s/beat_local.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from dfl_agent.algorithms.base import Traits, load_matching, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.rotating import GlobalModelRotation, RotationOptions, global_init_seed
from dfl_agent.learning import d2s
from dfl_agent.learning.params import IncompatibleUpdate, check_compatible, load_numpy, model_to_numpy
from dfl_agent.learning.training import adam_lr
from dfl_agent.privacy import policy as dp_policy

if TYPE_CHECKING:
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn

log = logging.getLogger(__name__)

Tensors = dict[str, np.ndarray]


@dataclasses.dataclass
class FedD2SOptions(RotationOptions):
    """Options of ``fedd2s`` (defaults: ALGORITHMS.md / seed 002 §IV-A).

    Attributes:
        sender_ratio: ρ, the participation ratio over all live nodes (seed: 0.2).
        z0: Z_0, rounds of participation a layer serves as distillation layer (Eq. 6);
            the seed uses 3/5/7 for Dirichlet α = 0.1/0.5/1.
        dropping_set: layer names (a suffix of the model's layers, e.g. C3, F1, F2, F3);
            its shallowest layer is l_min, the floor of Eq. 6.
        adam_lr: Adam learning rate of both distillation phases (fresh state per phase);
            replaces ``training.lr`` (formerly ``lr``).  Unset (None): ``training.lr`` when
            the configuration sets it, else 0.01 (:func:`dfl_agent.learning.training.adam_lr`).
        c2s_epochs, s2c_epochs: passes over the local data per distillation phase (seed §IV-A:
            E = 4, the setting of its Table 2; 1 trains the personal model too little to
            beat local training, see the module docstring).
        temperature: τ of the soft labels (KL × τ²).
        distill_batch_size: mini-batch size of all phases; 0 = the training config's
            (formerly ``batch_size``).
    """

    sender_ratio: float = 0.2
    z0: int = 3
    dropping_set: list = dataclasses.field(default_factory=lambda: ["C3", "F1", "F2", "F3"])
    adam_lr: float | None = None
    c2s_epochs: int = 4
    s2c_epochs: int = 4
    temperature: float = 1.0
    distill_batch_size: int = 0
    #: old option names, still accepted with a deprecation warning
    renamed: ClassVar[dict[str, str]] = {"lr": "adam_lr", "batch_size": "distill_batch_size"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.z0 < 1:
            raise ValueError(f"z0 must be >= 1, got {self.z0}")
        if not self.dropping_set or not all(isinstance(x, str) for x in self.dropping_set):
            raise ValueError(f"dropping_set must be a non-empty list of layer names, got {self.dropping_set!r}")
        if (self.adam_lr is not None and not self.adam_lr > 0) or not self.temperature > 0:
            raise ValueError("adam_lr and temperature must be > 0")
        if self.c2s_epochs < 1 or self.s2c_epochs < 1 or self.distill_batch_size < 0:
            raise ValueError("c2s_epochs and s2c_epochs must be >= 1, distill_batch_size >= 0")


def resolve_l_min(layer_names: list[str], dropping_set: list[str]) -> int:
    """l_min (1-based) = the shallowest layer of ``dropping_set``, which must be a suffix of
    ``layer_names`` (the seed's sets [F1,F2,F3], [F2,F3], [C3,F1,F2,F3], [C2,…,F3] all are).

    Raises:
        ValueError: unknown names or not a suffix (message names ``dropping_set``).
    """
    unknown = [n for n in dropping_set if n not in layer_names]
    if unknown:
        raise ValueError(f"algorithm.options.dropping_set: unknown layers {unknown}; the model has {layer_names}")
    l_min = min(layer_names.index(n) for n in dropping_set) + 1
    if sorted(set(dropping_set), key=layer_names.index) != layer_names[l_min - 1:]:
        raise ValueError(f"algorithm.options.dropping_set must be a suffix of the layers {layer_names}, "
                         f"got {dropping_set}")
    return l_min


@register
class FedD2S(GlobalModelRotation):
    """One FedD2S node: a personal model, a participation count Z_n; token holder in turn."""

    name = "fedd2s"
    traits = Traits("rotating", default_model="layered",
                    dp=dp_policy.DPSupport({}, refused="its distillation steps are not covered by DP-SGD"))
    Options = FedD2SOptions
    checkpoint_attrs = ("z", "l", "distillations")  # Z_n, l_n and the S2C count survive a restart

    #: θ^g produced as holder and the C2S copy Θ̂ to send: checked and restored with the
    #: personal model by the divergence guard
    guarded_state = ("_theta_out", "_copy")

    async def setup(self) -> None:
        from dfl_agent.models import validate_spec

        ctx, o = self.ctx, self.options
        self.spec = validate_spec(ctx.model_spec)
        self.personal = self.new_model()
        self.L = d2s.num_layers(self.personal)
        self.l_min = resolve_l_min(list(cast("list[str]", self.personal.layer_names)), list(o.dropping_set))
        self.z = 0  # Z_n
        self.l = self.L  # l_n of the last participation
        self.distillations = 0  # S2C distillations from an aggregated global model (Eq. 12-13) applied
        self.batch_size = o.distill_batch_size or ctx.train.batch_size
        self._triplets: list = []
        self._copy: Tensors = {}
        self._init_global()

    def initial_global(self) -> Tensors:
        return model_to_numpy(self.new_model(seed=global_init_seed(self.ctx.seed)))

    def _global_model(self, tensors: Tensors) -> nn.Module:
        m = self.new_model(seed=0)
        load_numpy(m, tensors)
        return m

    # -- participant: Eq. 6, local knowledge extraction, C2S (Eq. 8-10) ------------------
    def _c2s(self, theta_g: Tensors) -> dict[str, Any]:
        o, d = self.options, self.ctx.data
        self.z += 1
        self.l = d2s.distillation_layer(self.z, self.L, o.z0, self.l_min)
        self._triplets = d2s.extract_features(self.personal, d.train_x, d.train_y, self.l, self.batch_size,
                                              self.ctx.device)
        g = self._global_model(theta_g).to(self.ctx.device)
        stats = d2s.c2s_distill(g, self._triplets, self.l, lr=adam_lr(o.adam_lr, self.ctx.train),
                                epochs=o.c2s_epochs, temperature=o.temperature)
        self._copy = model_to_numpy(g)
        return {"c2s_kl": stats["kl"], "c2s_ce": stats["ce"], "l": self.l, "z": self.z}

    async def local_update(self, t: int) -> dict[str, Any]:
        assert self._theta_in is not None
        # C2S distils into the received θ^g: under the divergence guard, so that a non-finite
        # copy is never sent (it is undone; the holder then finds no usable contribution)
        with self.divergence_guard("transfer"):
            return await self.ctx.compute(self._c2s, self._theta_in)

    def contribution(self, t: int) -> tuple[Tensors, dict[str, Any]]:
        return self._copy, {"l": self.l, "z": self.z, "samples": self.sample_count()}

    # -- holder: Eq. 11 ----------------------------------------------------------------
    async def aggregate(self, t: int, token: dict[str, Any], contributions: dict[str, Message]):
        """Seed 002 Eq. 11 (serverless): θ^g ← the unweighted mean of the participants'
        distilled copies θ^{g,n} (Eq. 8–10), in node-id order.  Returns ``({participant:
        (tensors, meta)}, info)``."""
        me = self.ctx.node_id
        own = t in self._participated and bool(self._copy)
        states = {s: m.tensors for s, m in contributions.items()}
        if own:
            states[me] = self._copy
        if not states:  # nobody answered: θ^g stays as it was
            self._theta_out = self._theta_in or self.current_global()
            return {}, {"aggregated": 0}
        theta = d2s.average_states([states[s] for s in sorted(states)])
        self._theta_out = theta
        updates: dict[str, tuple[Tensors, dict[str, Any]]] = {s: (theta, {}) for s in states}
        ls: list[int] = [m.meta["l"] for m in contributions.values() if isinstance(m.meta.get("l"), int)]
        if own:
            ls.append(self.l)
        return updates, {"aggregated": len(states), "mean_l": float(np.mean(ls)) if ls else float("nan")}

    # -- participant: S2C (Eq. 12-13) ----------------------------------------------------
    def _s2c(self, theta_g: Tensors) -> dict[str, Any]:
        o, d = self.options, self.ctx.data
        g = self._global_model(theta_g).to(self.ctx.device)
        targets = d2s.global_soft_targets(g, [h1 for h1, _, _ in self._triplets])
        stats = d2s.s2c_distill(self.personal, g, d.train_x, d.train_y, targets, self.l, self.batch_size,
                                lr=adam_lr(o.adam_lr, self.ctx.train), epochs=o.s2c_epochs,
                                temperature=o.temperature, device=self.ctx.device)
        self._triplets, self._copy = [], {}
        return stats

    async def apply_update(self, t: int, tensors: Tensors, meta: dict[str, Any]) -> None:
        """Seed 002 Eq. 12–13: server-to-client distillation of the personal model from the
        new θ^g (:func:`dfl_agent.learning.d2s.s2c_distill`)."""
        check_compatible(tensors, self._template)
        if not self._triplets:
            raise IncompatibleUpdate(f"update for round {t} without features of that round")
        await self.ctx.compute(self._s2c, tensors)
        self.distillations += 1

    def round_evidence(self) -> dict[str, Any]:
        """Participations Z_n, S2C distillations applied and the last distillation layer l_n."""
        return {"participations": self.z, "distillations": self.distillations, "distillation_layer": self.l}

    # -- reporting -------------------------------------------------------------------
    def deployable_model(self) -> nn.Module:
        return self.personal

    def warm_start(self, state: Mapping[str, np.ndarray]) -> str:
        """The personal model and the initial global model θ^g (the aggregator of round 1
        sends its own)."""
        load_matching(self.personal, state)
        self._initial = self._template = model_to_numpy(self.personal)
        return "the personal model and the initial global model"

    def status(self) -> dict[str, Any]:
        return {**super().status(), "participations": self.z, "distillations": self.distillations,
                "distillation_layer": self.l,
                "layer_name": cast("list[str]", self.personal.layer_names)[self.l - 1], "model": self.spec}

