"""Run admission: does a run fit this device's profile and memory budget?

:func:`admit` is the check a node makes when it picks a run from its queue: the
algorithm must be known and allowed by the profile, and the model it would train
(:func:`run_model_params`) times the copies the algorithm holds must fit
``compute.memory_budget_mb``.  Torch is imported only to count the parameters of a
spec whose count its fields do not give (on the ``meta`` device).  Under ``privacy.dp`` the run
manager also checks the run against the device's privacy budget
(:meth:`dfl_agent.runtime.service.privacy_budget.PrivacyBudget.admit`, torch-free), after this check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dfl_agent.models import param_count
from dfl_agent.runtime.shared.descriptor import RunDescriptor


def run_model_params(d: RunDescriptor, profile: Any, *, input_shape: Any = None, num_classes: int | None = None,
                     node_model: Mapping[str, Any] | None = None) -> tuple[int, str]:
    """Φ of the model this device would train in run ``d``, and where the figure comes from.

    The descriptor's model wins over the node's ``[model]`` (``node_model``): a ``spec`` is
    counted as it is; a ``family`` member or a ``size`` tier (else the algorithm's default
    model for the profile's tier) is built for the data's ``input_shape`` and
    ``num_classes`` when they are known (after a first run), else Φ is the reference
    model of the tier (:data:`dfl_agent.profiles.behaviour.REFERENCE_MODEL_PARAMS`).

    Raises:
        ValueError: an invalid spec or family.
    """
    from dfl_agent.profiles.behaviour import REFERENCE_MODEL_PARAMS, model_tier

    model = dict(d.model) if d.model else {k: v for k, v in (node_model or {}).items() if v is not None}
    if model.get("spec"):
        return param_count(model["spec"]), "the run's model spec" if d.model else "model.spec"
    try:
        tier = str(model.get("size") or (profile.model.size if model.get("family") else model_tier(profile, d.algorithm)))
    except KeyError:
        tier = "medium"
    if input_shape is None or num_classes is None:
        return REFERENCE_MODEL_PARAMS.get(tier, REFERENCE_MODEL_PARAMS["medium"]), f"reference {tier} model"
    if model.get("family"):
        from dfl_agent.models.families import family_member

        return param_count(family_member(str(model["family"]), input_shape, num_classes, tier)), \
            f"{model['family']} member for {tier}"
    from dfl_agent.algorithms.base import traits_of
    from dfl_agent.models.defaults import default_model_spec

    return param_count(default_model_spec(traits_of(d.algorithm).default_model, input_shape, num_classes, tier)), f"default {tier} model"


def admit(d: RunDescriptor, profile: Any, *, node_id: str, model_params: int | None = None,
          input_shape: Any = None, num_classes: int | None = None,
          node_model: Mapping[str, Any] | None = None) -> str | None:
    """Check a run against this device's profile and resources.

    Returns ``None`` to accept, else the decline reason, e.g. ``"algorithm dechw not
    allowed by profile pi-zero"`` or ``"model too large for memory_budget_mb: ..."``.
    Gating (battery, windows) is not a decline: a gated device accepts and pauses.

    Memory: the model's parameter count Φ (``model_params``, else
    :func:`run_model_params` from the descriptor's model, the node's ``[model]``, or the
    default model for the profile's tier) times the copies the algorithm holds at once
    (:func:`dfl_agent.profiles.behaviour.algorithm_need_mb`: weights, gradients, optimiser
    state, neighbours' models) plus 64 MiB must fit ``compute.memory_budget_mb``.
    """
    from dfl_agent.algorithms.base import get_algorithm
    from dfl_agent.profiles.behaviour import algorithm_need_mb, models_held

    try:
        get_algorithm(d.algorithm)
    except (KeyError, ValueError) as exc:
        return f"unknown algorithm {d.algorithm!r}: {exc}"
    if getattr(profile, "inference_only", False):
        return f"profile {profile.name} is inference-only"
    allowed = getattr(getattr(profile, "behaviour", None), "algorithms", None)
    if allowed and d.algorithm not in allowed:
        return f"algorithm {d.algorithm} not allowed by profile {profile.name}"
    source = "given"
    if model_params is None:
        try:
            model_params, source = run_model_params(d, profile, input_shape=input_shape, num_classes=num_classes,
                                                    node_model=node_model)
        except (ValueError, TypeError, KeyError) as exc:
            return f"invalid model: {exc}"
    budget = getattr(getattr(profile, "compute", None), "memory_budget_mb", None)
    try:
        need = algorithm_need_mb(d.algorithm, model_params)
        copies = f"{models_held(d.algorithm):g} copies"
    except KeyError:  # an algorithm the decision table does not know: weights, gradients, momentum, 5 peers
        need, copies = 8 * model_params * 4 / 2**20 + 64.0, "8 copies"
    if budget and need > budget:
        return (f"model too large for memory_budget_mb: {model_params} parameters ({source}), "
                f"~{need:.0f} MiB for {copies} of it, budget {budget} MiB")
    return None
