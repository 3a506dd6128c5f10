"""Algorithm base class and registry.

An algorithm is one node's behaviour, written against :class:`NodeContext` only.
Subclasses set ``name``, an ``Options`` dataclass (validated from the config's
``[algorithm.options]`` table) and implement :meth:`Algorithm.round` (and
:meth:`Algorithm.deployable_model` where it is not ``self.model``).  Register them with :func:`register`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import types
import typing
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dfl_agent.algorithms.context import NodeContext
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import PlainSGD, snapshot
from dfl_agent.privacy.plan import steps_per_round
from dfl_agent.privacy.policy import DPSupport

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn, torch

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type[Algorithm]] = {}


def architecture_mismatch(model: nn.Module, state: Mapping[str, np.ndarray]) -> str | None:
    """Why ``state`` (``state_dict`` names -> arrays) cannot be loaded into ``model``: names
    missing or extra, or the first tensor whose shape differs; None when it fits exactly."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        return (f"the tensors differ ({len(missing)} missing, e.g. {missing[:2]}; {len(extra)} extra, "
                f"e.g. {extra[:2]})")
    for k, shape in own.items():
        if tuple(np.shape(state[k])) != shape:
            return f"{k} is {tuple(np.shape(state[k]))} in the deployed model, {shape} in the run's"
    return None


def load_matching(model: nn.Module, state: Mapping[str, np.ndarray]) -> None:
    """Load ``state`` into ``model`` (a copy of every tensor, in the model's dtypes and device).

    Raises:
        ValueError: :func:`architecture_mismatch`'s reason; ``model`` is unchanged.
    """
    why = architecture_mismatch(model, state)
    if why is not None:
        raise ValueError(why)
    own = model.state_dict()
    model.load_state_dict({k: torch.as_tensor(np.array(state[k], copy=True)).to(own[k].device, own[k].dtype)
                           for k in own})


@dataclasses.dataclass
class GuardResult:
    """Outcome of one step run under :meth:`Algorithm.divergence_guard`.

    Attributes:
        step: the step's name (``"aggregation"``, ``"mutual learning"``, ``"transfer"``...).
        diverged: set on leaving the ``with`` block when the step left a non-finite
            parameter, buffer or guarded state (then restored to its value before the step).
        detail: the first non-finite entry found, e.g. ``"model.fc1.weight"``.
    """

    step: str
    diverged: bool = False
    detail: str = ""


def first_nonfinite(value: object) -> str | None:
    """Where ``value`` holds NaN or Inf: ``None`` when every floating entry is finite,
    else the path of the first non-finite tensor (``""`` for ``value`` itself).

    ``value`` may be an ``nn.Module`` (its ``state_dict``: parameters and buffers), a
    torch tensor, a numpy array, or a mapping / list / tuple of those (nested); anything
    else (ints, strings, ``None``) counts as finite.  Integer tensors are always finite.
    """
    if isinstance(value, nn.Module):
        value = value.state_dict()
    if torch.is_tensor(value):
        return "" if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()) \
            else None
    if isinstance(value, np.ndarray):
        return "" if value.dtype.kind in "fc" and not bool(np.isfinite(value).all()) else None
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = first_nonfinite(item)
        if where is not None:
            return f"{key}.{where}" if where else str(key)
    return None


@dataclasses.dataclass
class NoOptions:
    """An algorithm without options."""


#: Coordination families (:mod:`dfl_agent.algorithms.protocols`).
FAMILIES = ("rotating", "neighbourhood", "pairs", "lockstep", "local")
#: Default models: ``tier`` (the default model of the size tier), ``layered`` (the layered
#: ``convdense`` model), ``width-scaled`` (width-scaled members of one family, DFML's H1
#: in the simulator); the same names as :data:`dfl_agent.models.defaults.DEFAULT_MODELS`
#: (which imports torch: not imported here).
DEFAULT_MODELS = ("tier", "layered", "width-scaled")


@dataclasses.dataclass(frozen=True)
class Traits:
    """What the runtime and the device profiles need to know about an algorithm, declared
    on its class (``traits = Traits(...)``) and read from the registry
    (:func:`traits_of`).  Torch-free.

    Attributes:
        family: coordination family, one of :data:`FAMILIES`.
        mixes_architectures: members may train models of different architectures: a device
            trains its profile's size tier (DFML, DFedAvg, HeteroFL, ...).
        same_architecture: members average or swap parameters of one architecture: a peer
            advertising another model hash is excluded.  (Neither flag: the federation's
            common model, peers' hashes unchecked.)
        choco_gossip: its model gossip is compressed as CHOCO differences
            (:mod:`dfl_agent.algorithms.gossip_compression`): the federation's
            ``[compression]`` decides, never a device profile.
        required_roles: roles a node must take to run it (``receiver``: it holds neighbours'
            models, or a second model, while fusing them into its own).
        models_held: ``(own, per_neighbour)``: copies of the model's float32 parameter vector
            one node holds at once, :meth:`copies`.
        aggregator_holds_all: a rotating round's aggregator holds (and trains) every
            participant's model: the profile's ``aggregator`` role is kept only if the
            memory budget holds them.
        default_model: one of :data:`DEFAULT_MODELS`.
        dp: what it sends under differential privacy and how each value is protected
            (:class:`~dfl_agent.privacy.policy.DPSupport`); None: it never trains under DP.
    """

    family: str
    mixes_architectures: bool = False
    same_architecture: bool = False
    choco_gossip: bool = False
    required_roles: tuple[str, ...] = ("trainer", "sender", "receiver")
    models_held: tuple[float, float] = (3.0, 1.0)
    aggregator_holds_all: bool = False
    default_model: str = "tier"
    dp: DPSupport | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.default_model not in DEFAULT_MODELS:
            raise ValueError(f"default_model must be one of {DEFAULT_MODELS}, got {self.default_model!r}")
        if self.mixes_architectures and self.same_architecture:
            raise ValueError("an algorithm cannot both mix architectures and need one architecture")

    def copies(self, participants: int = 5) -> float:
        """Copies of the parameter vector held at once with ``participants`` models in a
        neighbourhood or rotating round (itself included): ``own + per_neighbour ×
        max(0, participants - 1)``.  Training one model costs 3 (weights, gradients, SGD
        momentum; Adam 4)."""
        own, per_neighbour = self.models_held
        return float(own + per_neighbour * max(0, participants - 1))


class Algorithm:
    """Base class of one node's learning behaviour.

    Lifecycle: ``alg = Cls(ctx, options)``; ``await alg.setup()``; ``await alg.run(rounds)``.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: declared by every registered algorithm (:class:`Traits`)
    traits: ClassVar[Traits]
    #: JSON-friendly attributes saved in checkpoints by the default :meth:`state_dict`
    #: (scalars, lists, dicts), e.g. DFML's ``alpha_n``.
    checkpoint_attrs: ClassVar[tuple[str, ...]] = ()
    #: False for the local baselines, which exchange nothing: a node running one never
    #: skips rounds to "rejoin" its peers (their progress says nothing about its model)
    communicates: ClassVar[bool] = True
    #: the node's model, where the algorithm keeps one (set in :meth:`setup`)
    model: nn.Module

    @classmethod
    def dp_steps_per_round(cls, options: object, *, n_samples: int, batch_size: int, epochs: int, steps: int) -> int:
        """The most DP steps one round takes on ``n_samples`` samples (a DP plan's
        ``steps_per_round``): its local step, ``training.steps`` when > 0, else
        ``epochs·⌈N / batch_size⌉`` (:func:`dfl_agent.privacy.plan.steps_per_round`).  An
        algorithm whose round trains otherwise says so (DFedAvg: one epoch; DFML: and its mutual
        learning; FedPer, local Adam: ``adam_epochs``; the pair protocols: the sender's ``M``).

        Args:
            options: its parsed ``Options`` (read by attribute; None: defaults).
        """
        return steps_per_round(n_samples, batch_size, epochs, steps)

    @classmethod
    def common_init_hint(cls, options: object, init: str, partition: str | None) -> str | None:
        """A one-line hint when this algorithm, with ``options``, a common initialisation
        (``init``) and ``partition``, is known to need tuning (``dflctl simulate`` prints it, the
        daemon logs it); None: nothing to say (DecHW says something)."""
        return None

    def __init__(self, ctx: NodeContext, options: Any = None):
        self.ctx = ctx
        self.options = options if options is not None else self.Options()
        #: :meth:`join_cold` was called: algorithms of the neighbourhood family then flag their
        #: first model as ``cold`` and adopt their warm neighbours' models in their first
        #: aggregation (:class:`~dfl_agent.algorithms.protocols.neighbourhood.NeighbourhoodAlgorithm`)
        self.joins_cold = False

    def join_cold(self) -> None:
        """The run was meant to start from the deployed model, but this node has none that fits
        (the warm start, :mod:`dfl_agent.runtime.run.warm_start`): it starts from fresh weights,
        and its neighbours, which may have started warm, should not average with them."""
        self.joins_cold = True

    # -- helpers -------------------------------------------------------------
    def new_model(self, seed: int | None = None, spec: Mapping[str, Any] | None = None) -> nn.Module:
        """Build a model from ``spec`` (default: the node's) with weights drawn from ``seed``
        (default: ``ctx.init_seed``), without touching torch's global RNG state."""
        from dfl_agent.models import build_model

        with torch.random.fork_rng(devices=[]):
            # the cpu generator only (the model is built on the cpu): torch.manual_seed would
            # also queue a seeding of every cuda device, which fork_rng does not undo
            torch.random.default_generator.manual_seed(self.ctx.init_seed if seed is None else seed)
            return build_model(spec or self.ctx.model_spec).to(self.ctx.device)

    #: names of non-module attributes (tensor dicts such as GT's reference model) that
    #: :meth:`divergence_guard` checks and restores together with the models
    guarded_state: ClassVar[tuple[str, ...]] = ()

    @contextlib.contextmanager
    def divergence_guard(self, step: str, *extra: nn.Module) -> Iterator[GuardResult]:
        """Run one aggregation, mutual-learning or transfer step (the body of the ``with``)
        so that it never leaves a non-finite model behind.

        Before the step: a copy of the state (parameters and buffers) of every
        ``nn.Module`` attribute of the algorithm, of each module in ``extra`` (e.g. the
        peers' models DFML's aggregator trains) and of the attributes named in
        :attr:`guarded_state`.  After it (also when it raised): if any of them (the
        attribute's *current* object: a step may replace ``self.model``) holds NaN or
        Inf, every one is put back as it was before the step (attributes point to their
        old objects again, with their old values), ``diverged`` is counted on the
        context (:meth:`NodeContext.note_diverged`: a WARNING at most once per round) and
        the yielded :class:`GuardResult` says so.  The caller then goes on with the round
        on the old model.  Cost: one copy of the guarded state per step, none per
        mini-batch.

        Yields:
            :class:`GuardResult`, filled in when the block ends.
        """
        modules = [(attr, m, snapshot(m)) for attr, m in vars(self).items() if isinstance(m, nn.Module)]
        extras = [(m, snapshot(m)) for m in extra]
        state = {a: copy.deepcopy(getattr(self, a)) for a in self.guarded_state if hasattr(self, a)}
        result = GuardResult(step)
        try:
            yield result
        finally:
            where = None
            now: list[tuple[str, Any]] = [(a, m) for a, m in vars(self).items() if isinstance(m, nn.Module)]
            now += [(f"extra{i}", m) for i, m in enumerate(extra)]
            now += [(a, getattr(self, a)) for a in self.guarded_state if hasattr(self, a)]
            for name, value in now:
                bad = first_nonfinite(value)
                if bad is not None:
                    where = f"{name}.{bad}" if bad else name
                    break
            if where is not None:
                for attr, m, sd in modules:
                    m.load_state_dict(sd)
                    setattr(self, attr, m)
                for m, sd in extras:
                    m.load_state_dict(sd)
                for a, v in state.items():
                    setattr(self, a, v)
                result.diverged, result.detail = True, where
                self.ctx.note_diverged(step, where)

    def private(self) -> bool:
        """Whether this node trains under differential privacy (``ctx.train.dp`` set):
        then it sends no value derived from its data that DP-SGD does not protect
        (:mod:`dfl_agent.privacy.policy`)."""
        train = self.ctx.train
        return train is not None and train.dp is not None  # a context without training settings: no DP

    def sample_count(self) -> int:
        """|D_i| as this node sends it and weighs its own model with: the size of its
        training split, or :data:`~dfl_agent.privacy.policy.SENT_SAMPLES` (1) under
        differential privacy, a data-independent weight (every model of a federation under
        DP then counts the same)."""
        return 1 if self.private() else int(len(self.ctx.data.train_y))

    # -- to implement ----------------------------------------------------------
    async def setup(self) -> None:
        """Create models and state. Called once before the first round."""

    async def round(self, t: int) -> dict[str, Any]:
        """Run round ``t`` (1-based). Returns info for metrics/status (JSON-friendly)."""
        raise NotImplementedError

    def deployable_model(self) -> nn.Module:
        """The model this node would deploy now (evaluated as 'global accuracy'); default:
        :attr:`model`."""
        return self.model

    def warm_start(self, state: Mapping[str, np.ndarray]) -> str:
        """Start the run from a deployed model's weights ``state`` (``state_dict`` names ->
        arrays; :mod:`dfl_agent.runtime.run.warm_start`): called after :meth:`setup`, before round 1,
        never on a resumed run.  The default loads them into :meth:`deployable_model`; an
        algorithm that trains another model, or derives state from its model in :meth:`setup`,
        overrides it.  Returns which model(s) it loaded, for the log.

        Raises:
            ValueError: the names or shapes of ``state`` are not those of the model (the
                caller then starts fresh and says why); nothing was loaded.
        """
        load_matching(self.deployable_model(), state)
        return "the deployable model"

    def evaluation_models(self) -> dict[str, nn.Module]:
        """Further models to evaluate each round besides the deployable one (e.g.
        DFML's regular model): ``{name: model}`` -> metrics ``{name}_global_accuracy``."""
        return {}

    def status(self) -> dict[str, Any]:
        """Algorithm-specific state for the status topic (e.g. α, threshold state).  Called
        only after :meth:`setup` (:meth:`dfl_agent.runtime.node.node.Node.status` leaves it out
        before), so it may read the state that :meth:`setup` creates."""
        return {}

    # -- checkpoints (dfl_agent.runtime.node.checkpoint) ---------------------------------------
    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """This node's learning state for a crash-safe checkpoint: ``(tensors, meta)``.

        The default covers every ``nn.Module`` attribute (``model``; DFML's ``regular``
        and ``peak``; ...) as ``"{attr}.{state_dict key}"`` arrays, every
        optimizer attribute (``torch.optim.Optimizer`` or
        :class:`~dfl_agent.learning.training.PlainSGD`; tensor state as ``"{attr}.state.{i}.{key}"``,
        the rest in ``meta``), and the attributes named in :attr:`checkpoint_attrs`
        (JSON values) in ``meta``.  Subclasses with richer state (schedules, Hessian
        accumulators, the token) extend both and call ``super()``.  Transient protocol
        state (buffered messages, a round in progress) is deliberately not saved: a
        restarted node re-joins at the next round.

        Returns:
            tensors: name -> contiguous numpy array (any shape/dtype safetensors takes).
            meta: JSON-serialisable dict.
        """
        tensors: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {}
        for attr, value in sorted(vars(self).items()):
            if isinstance(value, nn.Module):
                tensors.update({f"{attr}.{k}": v for k, v in model_to_numpy(value).items()})
            elif isinstance(value, (torch.optim.Optimizer, PlainSGD)):
                sd = value.state_dict()
                other: dict[str, Any] = {}
                for idx, st in sd["state"].items():
                    for key, v in st.items():
                        if torch.is_tensor(v):
                            tensors[f"{attr}.state.{idx}.{key}"] = np.ascontiguousarray(v.detach().cpu().numpy()).copy()
                        else:
                            other[f"{idx}.{key}"] = v
                meta[f"{attr}.optimizer"] = {"param_groups": sd["param_groups"], "other": other}
        for attr in self.checkpoint_attrs:
            if hasattr(self, attr):
                meta[attr] = getattr(self, attr)
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (bit-identical tensors).

        Raises:
            ValueError: names, shapes or optimizer layout that do not fit this node's
                models (a checkpoint of another model or algorithm).
        """
        used: set[str] = set()
        for attr, value in sorted(vars(self).items()):
            if isinstance(value, nn.Module):
                prefix = f"{attr}."
                sd = {k[len(prefix):]: torch.from_numpy(np.array(v)) for k, v in tensors.items() if k.startswith(prefix)}
                try:
                    value.load_state_dict(sd, strict=True)
                except RuntimeError as exc:
                    raise ValueError(f"checkpoint does not fit {attr}: {exc}") from None
                used.update(prefix + k for k in sd)
            elif isinstance(value, (torch.optim.Optimizer, PlainSGD)):
                saved = meta.get(f"{attr}.optimizer")
                if not isinstance(saved, Mapping):
                    raise ValueError(f"checkpoint has no state for optimizer {attr}")
                prefix = f"{attr}.state."
                state: dict[int, dict[str, Any]] = {}
                for k, v in tensors.items():
                    if k.startswith(prefix):
                        idx, key = k[len(prefix):].split(".", 1)
                        state.setdefault(int(idx), {})[key] = torch.from_numpy(np.array(v))
                        used.add(k)
                for k, v in dict(saved.get("other", {})).items():
                    idx, key = k.split(".", 1)
                    state.setdefault(int(idx), {})[key] = v
                try:
                    value.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
                except (RuntimeError, KeyError, TypeError) as exc:
                    raise ValueError(f"checkpoint does not fit optimizer {attr}: {exc}") from None
        for attr in self.checkpoint_attrs:
            if attr in meta:
                setattr(self, attr, meta[attr])
        unknown = sorted(set(tensors) - used)
        if unknown:  # a subclass pops the tensors it restores itself before calling this
            raise ValueError(f"checkpoint has tensors this node does not know: {unknown[:5]}")

    def catches_up(self) -> bool:
        """Whether a node that finds itself behind its neighbours may skip to their round
        (lock-step algorithms, where a lagging node's updates are useless to the others;
        see :meth:`NodeContext.catch_up_round`).  Default: no."""
        return False

    async def run(self, rounds: int, start_round: int = 1) -> None:
        """Run rounds ``start_round..rounds``, reporting each to the runtime.

        When :meth:`catches_up`, the round after each one comes from
        ``ctx.catch_up_round`` (the runtime's fault tolerance may skip ahead)."""
        t = start_round
        while t <= rounds:
            info = await self.round(t)
            await self.ctx.end_round(t, **info)
            t = self.ctx.catch_up_round(t + 1) if self.catches_up() else t + 1


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator adding ``cls`` to the registry under ``cls.name``.

    Raises:
        ValueError: empty or duplicate name, or the class declares no :class:`Traits`.
    """
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"algorithm name {cls.name!r} is empty or already registered")
    if not isinstance(cls.__dict__.get("traits"), Traits):
        raise ValueError(f"algorithm {cls.name!r} declares no traits (traits = Traits(...) on its class)")
    _REGISTRY[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    """The registered class for ``name``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def traits_of(name: str) -> Traits:
    """The :class:`Traits` of the registered algorithm ``name`` (torch-free).

    Raises:
        KeyError: unknown name.
    """
    return get_algorithm(name).traits


def check_dp_combination(algorithm: str, options: object = None) -> None:
    """Refuse the registered ``algorithm`` with ``options`` under DP unless its class declares
    how it sends what it sends (:func:`dfl_agent.privacy.policy.check_dp_combination` of its
    ``traits.dp``).

    Raises:
        ValueError: one line naming the algorithm and why (also for an unknown name).
    """
    from dfl_agent.privacy.policy import check_dp_combination as check

    try:
        support = get_algorithm(algorithm).traits.dp
    except KeyError:
        support = None
    check(algorithm, support, options)


def dp_steps_per_round(algorithm: str, options: object, *, n_samples: int, batch_size: int, epochs: int,
                       steps: int) -> int:
    """:meth:`Algorithm.dp_steps_per_round` of the registered ``algorithm`` (0 without samples).

    Raises:
        KeyError: an unknown algorithm.
    """
    if n_samples <= 0 or batch_size <= 0:
        return 0
    return get_algorithm(algorithm).dp_steps_per_round(options, n_samples=n_samples, batch_size=batch_size,
                                                       epochs=epochs, steps=steps)


def common_init_hint(algorithm: str, options: object, init: str, partition: str | None) -> str | None:
    """:meth:`Algorithm.common_init_hint` of the registered ``algorithm`` (None for an unknown one)."""
    try:
        cls = get_algorithm(algorithm)
    except KeyError:
        return None
    return cls.common_init_hint(options, init, partition)


def available() -> list[str]:
    """Names of all registered algorithms."""
    _load_builtin()
    return sorted(_REGISTRY)


_BUILTIN_LOADED = False
#: modules of the package that hold no algorithm (``protocols/``, a package, is skipped too)
_NOT_ALGORITHMS = {"base", "context", "topology", "gossip_compression"}


def _load_builtin() -> None:
    """Import every algorithm module of ``dfl_agent.algorithms`` once (importing registers
    them): every module but :data:`_NOT_ALGORITHMS` and the subpackages (the protocol
    families of ``protocols/``).

    Kept lazy so the registry has no import cycle; a new algorithm is one new module.
    """
    global _BUILTIN_LOADED
    if _BUILTIN_LOADED:
        return
    import importlib
    import pkgutil

    import dfl_agent.algorithms as pkg

    for mod in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.ispkg):
        if mod not in _NOT_ALGORITHMS and not mod.startswith("_"):
            importlib.import_module(f"dfl_agent.algorithms.{mod}")
    _BUILTIN_LOADED = True


def _optional_of(typ: Any) -> Any:
    """``X`` for an option typed ``X | None`` (unset: None); any other type as it is."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    return typ


def parse_options(cls: type[Algorithm], raw: Mapping[str, Any] | None, prefix: str = "algorithm.options") -> Any:
    """Build ``cls.Options`` from a config table, checking names and types.  An option
    renamed since (``Options.renamed``: old -> new name) is accepted under its old name
    with a deprecation warning.

    Raises:
        ValueError: unknown key or wrong type, naming ``prefix.key``.
    """
    raw = dict(raw or {})
    opts_cls = cls.Options
    for old, new in getattr(opts_cls, "renamed", {}).items():  # old option names: aliases
        if old in raw:
            if new in raw:
                raise ValueError(f"{prefix}.{old}: renamed {new!r}; give only {new!r}")
            log.warning("%s.%s is deprecated: it is now called %s.%s", prefix, old, prefix, new)
            raw[new] = raw.pop(old)
    hints = typing.get_type_hints(opts_cls)
    fields = {f.name for f in dataclasses.fields(opts_cls)}
    for key in raw:
        if key not in fields:
            raise ValueError(f"{prefix}.{key}: unknown option for algorithm {cls.name!r} (known: {sorted(fields)})")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        typ = _optional_of(hints[key])
        if typ is not hints[key] and value is None:  # an optional option given as None: unset
            kwargs[key] = value
            continue
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        base = typing.get_origin(typ) or typ
        if (isinstance(base, type) and not isinstance(value, base)) or (base is not bool and isinstance(value, bool)):
            raise ValueError(f"{prefix}.{key}: expected {getattr(typ, '__name__', typ)}, got {value!r}")
        kwargs[key] = value
    try:
        return opts_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        # an option's own check ("round_timeout must be > 0, got 0"): name the key
        head, _, rest = str(exc).partition(" ")
        if head in fields and rest:
            raise ValueError(f"{prefix}.{head}: {rest}") from None
        raise ValueError(f"{prefix}: {exc}") from None
