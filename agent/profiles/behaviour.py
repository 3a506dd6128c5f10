"""The decision table: device profile + federation settings -> this node's behaviour.

================================  ==============================================================
input                             decision
================================  ==============================================================
profile is inference-only         behaviour ``inference``: no training, no algorithm; the node
                                  runs ``dfl-infer`` (ONNX) instead of ``dfl-agent``
federation algorithm not in       error (start-up stops, naming ``behaviour.algorithms``): the
``behaviour.algorithms``          algorithm is the federation's, all members must run it
algorithm mixes architectures     model = the profile's size tier (``model.size``), unless the
(trait ``mixes_architectures``:   node config gives ``model.size``/``model.spec``: a Pi trains a
dfml, dfedavg, local, ...)        small model, a Jetson Orin a large one, in one federation
otherwise                         model = the federation's common model (node config; the
                                  profile tier is ignored)
algorithm averages or swaps       every member must have the same architecture; a peer
parameters (trait                 advertising another model hash is reported and excluded
``same_architecture``: fedavg,    (:func:`peer_incompatibility`)
dechw, defkt, ...)
role ``aggregator`` (trait        kept only if the profile lists it and ``memory_budget_mb``
``aggregator_holds_all``)         holds the aggregator's working set (:func:`aggregator_need_mb`);
                                  otherwise dropped: the node never leads a rotating round
compression                       the profile's ``behaviour.compression`` (config may override)
device                            ``compute.device`` resolved by :func:`resolve_device`
                                  (``cuda`` without a GPU falls back to cpu, with the reason)
threads, batch size, epochs       node config if given, else the profile
mixed precision                   ``compute.mixed_precision`` and the device is CUDA
================================  ==============================================================

The algorithms' traits (:class:`dfl_agent.algorithms.base.Traits`, declared on each
algorithm's class) are read from the registry.  No torch import at module level.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from dfl_agent.algorithms.base import available, traits_of
from dfl_agent.profiles.schema import DeviceProfile, ProfileError

INFERENCE = "inference"


@dataclasses.dataclass
class Behaviour:
    """What this node does (advertised in presence/mDNS, shown in status).

    Attributes:
        profile: the profile's name.
        algorithm: algorithm name, or ``"inference"``.
        roles: roles it may take (subset of the profile's).
        model_size: size tier of the default model it trains; None = the federation's.
        compression: compression spec string (``none``, ``q8``, ``topk:0.01+q8``, ...; see
            :mod:`dfl_agent.learning.compression`).
        device: torch device string (``cpu``, ``cuda:0``).
        threads: torch intra-op threads (>= 1).
        batch_size, epochs: local training.
        mixed_precision: autocast on CUDA.
        reasons: one line per decision (``dflctl profile detect`` prints them).
    """

    profile: str
    algorithm: str
    roles: list[str]
    model_size: str | None
    compression: str
    device: str
    threads: int
    batch_size: int
    epochs: int
    mixed_precision: bool
    reasons: list[str] = dataclasses.field(default_factory=list)

    def descriptor(self) -> dict[str, str]:
        """Presence/mDNS fields advertising this behaviour (strings only, short)."""
        return {"roles": ",".join(self.roles), "compression": self.compression, "device": self.device.split(":")[0]}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def aggregator_need_mb(model_params: int, participants: int) -> float:
    """Memory (MiB) a DFML aggregator needs: every participant's model with gradients
    and SGD momentum (3 × 4 bytes per parameter each), twice for the peak/regular
    copies, plus a 64 MiB allowance for activations and the runtime."""
    return (participants * model_params * 4 * 3 * 2) / (1024 * 1024) + 64.0


def resolve_device(requested: str, cuda: Any = None) -> tuple[str, str]:
    """``(torch device, reason)`` for a profile's/config's device request.

    ``cpu`` -> cpu; ``cuda``/``cuda:N`` -> that device when torch sees it, else cpu;
    ``auto`` -> ``cuda:0`` when available else cpu.  ``cuda`` replaces ``torch.cuda``
    (tests fake it).  Never raises for a missing GPU: the node trains on cpu and says so.
    """
    if requested == "cpu":
        return "cpu", "device cpu (profile/config)"
    if cuda is None:
        try:
            import torch
        except ImportError:
            return "cpu", f"device {requested} requested but torch is not installed: cpu"
        cuda = torch.cuda
    try:
        n = int(cuda.device_count()) if cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver is "no GPU"
        n = 0
    if requested == "auto":
        return ("cuda:0", "device auto: CUDA available, cuda:0") if n else ("cpu", "device auto: no CUDA device, cpu")
    index = int(requested.split(":", 1)[1]) if ":" in requested else 0
    if index < n:
        return f"cuda:{index}", f"device cuda:{index} ({n} CUDA device(s) visible)"
    return "cpu", f"device {requested} requested but {n} CUDA device(s) visible: falling back to cpu"


def select_behaviour(
    profile: DeviceProfile,
    algorithm: str,
    *,
    config_model_size: str | None = None,
    config_model_spec: bool = False,
    config_threads: int | None = None,
    config_batch_size: int | None = None,
    config_device: str | None = None,
    config_compression: str | None = None,
    model_params: int | None = None,
    participants: int = 5,
    cuda: Any = None,
    cpu_count: int | None = None,
) -> Behaviour:
    """Apply the decision table (module docstring).

    Args:
        profile: the node's (pinned or detected, overridden) profile.
        algorithm: the federation's algorithm (``algorithm.name``).
        config_*: values the node configuration sets explicitly (None = unset).
        model_params: Φ of the largest model the aggregator may hold (for the
            aggregator memory check); None skips the check.
        participants: models an aggregator holds at once (itself included).
        cuda: stand-in for ``torch.cuda`` (tests).
        cpu_count: for ``threads = 0`` (default ``os.cpu_count()``).

    Raises:
        ProfileError: the profile cannot run ``algorithm`` (names ``behaviour.algorithms``).
    """
    reasons: list[str] = []
    b = profile.behaviour
    if profile.inference_only:
        return Behaviour(profile.name, INFERENCE, ["inference"], None, "none", "cpu", 1, 1, 1, False,
                         ["inference-only profile: serves predictions with the federation's ONNX model, no training"])
    if algorithm not in b.algorithms:
        raise ProfileError(f"behaviour.algorithms: profile {profile.name!r} cannot run {algorithm!r} "
                           f"(it runs {', '.join(b.algorithms)})")
    reasons.append(f"algorithm {algorithm}: the federation's, listed by the profile")
    traits = traits_of(algorithm)
    if config_model_spec:
        size, why = None, "model: the configured model.spec"
    elif config_model_size is not None:
        size, why = config_model_size, f"model: size {config_model_size} from the node config"
    elif traits.mixes_architectures:
        size, why = profile.model.size, f"model: size {profile.model.size} from the profile ({algorithm} mixes sizes)"
    else:
        size, why = "medium", f"model: the federation's common model (medium; {algorithm} averages parameters)"
    reasons.append(why)
    roles = list(b.roles)
    if "aggregator" in roles and traits.aggregator_holds_all and model_params is not None:
        need = aggregator_need_mb(model_params, participants)
        if need > profile.compute.memory_budget_mb:
            roles.remove("aggregator")
            reasons.append(f"role aggregator dropped: needs ~{need:.0f} MiB for {participants} models, "
                           f"budget {profile.compute.memory_budget_mb} MiB")
    if "aggregator" not in roles and traits.aggregator_holds_all:
        reasons.append("never leads a rotating round (no aggregator role)")
    reasons.append(f"roles: {', '.join(roles)}")
    compression = config_compression or b.compression
    reasons.append(f"compression: {compression}" + (" (node config)" if config_compression else " (profile)"))
    device, why = resolve_device(config_device or profile.compute.device, cuda)
    reasons.append(why)
    threads = config_threads if config_threads is not None else profile.compute.threads
    if threads == 0:
        threads = cpu_count or os.cpu_count() or 1
    reasons.append(f"threads: {threads}")
    batch = config_batch_size if config_batch_size is not None else profile.training.batch_size
    mixed = profile.compute.mixed_precision and device.startswith("cuda")
    if profile.compute.mixed_precision and not mixed:
        reasons.append("mixed precision off: only on CUDA")
    return Behaviour(profile.name, algorithm, roles, size, compression, device, int(threads), int(batch),
                     profile.training.epochs, mixed, reasons)


PeerCheck = Callable[[Any], "str | None"]


def peer_incompatibility(algorithm: str, model_hash: str) -> PeerCheck:
    """A check ``fn(peer_info) -> reason or None`` for :class:`RuntimeContext`.

    A peer is incompatible when it advertises another algorithm, or — for algorithms
    that average or swap parameters (trait ``same_architecture``) — another model hash,
    or when it is an inference-only member (it never trains).  Unknown (empty) fields
    are given the benefit of the doubt; the message-level checks still apply.
    """

    same_architecture = algorithm in available() and traits_of(algorithm).same_architecture

    def check(info: Any) -> str | None:
        peer_alg = getattr(info, "algorithm", "") or ""
        if peer_alg == INFERENCE:
            return "inference-only member (does not train)"
        if peer_alg and peer_alg != algorithm:
            return f"runs {peer_alg}, this federation runs {algorithm}"
        peer_hash = getattr(info, "model_hash", "") or ""
        if same_architecture and peer_hash and model_hash and peer_hash != model_hash:
            return (f"model {peer_hash} differs from ours ({model_hash}); {algorithm} averages parameters "
                    "of one architecture")
        return None

    return check


def profile_compression_policy(behaviour: Behaviour | None, algorithm: str, *, error_feedback: bool = True) -> Any:
    """The :class:`~dfl_agent.learning.compression.CompressionPolicy` a profile asks for, or None.

    Used when the node (or simulation) configures no compression of its own.  None when
    the profile says ``none`` or the algorithm's model gossip is compressed as CHOCO
    differences (trait ``choco_gossip``: every neighbour must share one stream encoding,
    so its federation-wide ``[compression]`` section decides).

    Raises:
        dfl_agent.learning.compression.CompressionError: the profile's spec is invalid.
    """
    if behaviour is None or (algorithm in available() and traits_of(algorithm).choco_gossip):
        return None
    from dfl_agent.learning.compression import CompressionPolicy

    policy = CompressionPolicy.from_config(behaviour.compression, error_feedback=error_feedback)
    return policy if policy.active else None


# -- which algorithms a profile allows (the profile rule) --------------------------------
#: Trainable parameters Φ of the default model (:func:`dfl_agent.models.default_spec`) of each
#: size tier for HAR windows (3 × 128, 6 classes), the reference data set of the rule.
#: tests/unit/test_profiles.py checks these against the built models.
REFERENCE_MODEL_PARAMS = {"small": 3574, "medium": 13542, "large": 52678}

def models_held(algorithm: str, participants: int = 5) -> float:
    """Copies of the model's parameter vector (float32) ``algorithm`` holds at once on one node
    (its trait ``models_held``, :meth:`~dfl_agent.algorithms.base.Traits.copies`).

    Training one model costs 3 copies (weights, gradients, SGD momentum; Adam 4).  Gossip
    algorithms add one copy per neighbour (``participants - 1``); DecHW a Hessian diagonal
    per model too, and while it estimates its own, a float64 accumulator (2 copies;
    ``size_weighting`` scales tensor by tensor and adds none); Def-KT's receiver trains two
    models; a rotating round's aggregator holds every participant's model with gradients and
    momentum, twice (:func:`aggregator_need_mb`).

    Raises:
        KeyError: unknown algorithm.
    """
    return traits_of(algorithm).copies(participants)


def model_tier(profile: DeviceProfile, algorithm: str) -> str:
    """The size tier of ``algorithm``'s default model on ``profile`` (decision table)."""
    return profile.model.size if traits_of(algorithm).mixes_architectures else "medium"


def algorithm_need_mb(algorithm: str, model_params: int, participants: int = 5) -> float:
    """Memory (MiB) ``algorithm`` needs: :func:`models_held` × Φ × 4 bytes + 64 MiB for
    activations and the runtime."""
    return models_held(algorithm, participants) * model_params * 4 / (1024 * 1024) + 64.0


def algorithm_fit(profile: DeviceProfile, algorithm: str, *, model_params: int | None = None,
                  participants: int = 5) -> str | None:
    """Why ``profile`` cannot run ``algorithm`` (one line), or None when it can.

    The rule: a profile allows an algorithm when the algorithm's default model for the
    profile's tier (Φ from :data:`REFERENCE_MODEL_PARAMS` unless ``model_params``) fits
    ``compute.memory_budget_mb``, counting every model it holds at once
    (:func:`models_held`, ``participants`` models in a neighbourhood or rotating round),
    and the profile gives every role in the algorithm's trait ``required_roles``.

    Raises:
        KeyError: unknown algorithm.
    """
    if profile.inference_only:
        return "inference-only: never trains"
    tier = model_tier(profile, algorithm)
    phi = model_params if model_params is not None else REFERENCE_MODEL_PARAMS[tier]
    need = algorithm_need_mb(algorithm, phi, participants)
    if need > profile.compute.memory_budget_mb:
        return (f"needs ~{need:.0f} MiB ({models_held(algorithm, participants):g} copies of the {tier} model), "
                f"budget {profile.compute.memory_budget_mb} MiB")
    missing = [r for r in traits_of(algorithm).required_roles if r not in profile.behaviour.roles]
    if missing:
        return (f"needs the role(s) {', '.join(missing)} (it holds neighbours' models); "
                f"the profile gives {', '.join(profile.behaviour.roles)}")
    return None


def allowed_algorithms(profile: DeviceProfile, participants: int = 5) -> dict[str, str | None]:
    """``{algorithm: None if allowed else the one-line reason}`` for every known algorithm."""
    return {a: algorithm_fit(profile, a, participants=participants) for a in available()}


#: In ``behaviour.algorithms``: every registered algorithm the profile rule allows.
EVERY_ALLOWED = "*"


def expand_algorithms(profile: DeviceProfile, participants: int = 5) -> DeviceProfile:
    """``profile`` with ``"*"`` in ``behaviour.algorithms`` replaced by every registered
    algorithm the profile rule (:func:`allowed_algorithms`) allows, so that a new algorithm
    module reaches the profiles without editing them.

    Names listed beside ``"*"`` keep their place (the order is the profile's preference);
    ``"*"`` adds the others the rule allows, in the registry's (alphabetical) order.  With
    ``"*"``, every registered algorithm the profile does not run gets a ``left_out`` line:
    the profile's own when it has one, else the rule's reason.  A profile without ``"*"``
    is returned unchanged.
    """
    b = profile.behaviour
    if EVERY_ALLOWED not in b.algorithms:
        return profile
    rule = allowed_algorithms(profile, participants)
    named = {a for a in b.algorithms if a != EVERY_ALLOWED}
    algorithms: list[str] = []
    for a in b.algorithms:
        if a != EVERY_ALLOWED:
            algorithms.append(a)
            continue
        algorithms.extend(x for x, why in rule.items() if why is None and x not in named and x not in algorithms)
    explained = {line.split(":", 1)[0].strip() for line in b.left_out}
    left_out = list(b.left_out)
    if not profile.inference_only:
        left_out += [f"{a}: {why or 'not listed by the profile'}" for a, why in rule.items()
                     if a not in algorithms and a not in explained]
    return dataclasses.replace(profile, behaviour=dataclasses.replace(b, algorithms=algorithms, left_out=left_out))
