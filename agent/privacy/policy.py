"""What a device sends under differential privacy, algorithm by algorithm.

DP-SGD (:mod:`dfl_agent.privacy.config`, the ``privacy.dp`` section) protects the models a
device trains: every value computed from them alone (the parameters, their differences,
an accumulated gradient, a vote on it, an average of them) is post-processing and keeps
the guarantee.  A device sends other values derived from its data too; under DP each one is

* ``dp-sgd``: post-processing of DP-trained models: protected;
* ``data-independent``: replaced by a value that does not depend on the data (sample
  counts become 1, so models are averaged with uniform weights; accuracy is left out of
  the status, the model announcement and the ONNX delivery);
* ``public``: depends on the configuration or a shared seed only (an architecture, a
  parameter count, a schedule);
* ``leak``: not protected, and said so in docs/explanation/privacy.md (the deploy gate's
  decision, a device's participation and timing);
* or the combination is refused: :func:`check_dp_combination` raises a one-line
  ``ValueError`` at configuration time (the node configuration, a run's descriptor and
  ``dflctl simulate``).

Each algorithm declares its :class:`DPSupport` on its class (its
:class:`~dfl_agent.algorithms.base.Traits`' ``dp``); an algorithm that declares none is refused.
Torch-free: the supervisor checks a configuration with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

#: How a sent value is handled under DP (see the module docstring).
TREATMENTS = ("dp-sgd", "data-independent", "public", "leak")

#: The sample count a device sends under DP (aggregation weight): the same for every device.
SENT_SAMPLES = 1

#: What every training device sends, whatever its algorithm: message -> (treatment, how).
COMMON: dict[str, tuple[str, str]] = {
    "status": ("data-independent", "no accuracy and no sample count (global_accuracy, local_accuracy, ... left out)"),
    "model announcement": ("data-independent", "the deployed version without its validation accuracy"),
    "onnx.model": ("dp-sgd", "the deployed model; its meta without the validation accuracy"),
    "deploy gate decision": ("leak", "whether a run's model was deployed or kept: at most one bit per run about "
                                     "the validation slice, which DP-SGD does not cover"),
    "presence, timing": ("leak", "that the device takes part, when, and how long its rounds take"),
}


@dataclasses.dataclass(frozen=True)
class DPSupport:
    """One algorithm under DP.

    Attributes:
        messages: what it sends besides :data:`COMMON`: message -> (treatment, how), the
            treatment one of :data:`TREATMENTS`.
        refused: the reason it never runs under DP (None: it may).
        refuse_when: ``options -> reason | None``: a reason to refuse these options
            (``algorithm.options``, a table or the parsed dataclass); None: every option
            is fine.
    """

    messages: dict[str, tuple[str, str]]
    refused: str | None = None
    refuse_when: Callable[[Any], str | None] | None = None

    def __post_init__(self) -> None:
        for what, (treatment, _how) in self.messages.items():
            if treatment not in TREATMENTS:
                raise ValueError(f"{what}: treatment must be one of {TREATMENTS}, got {treatment!r}")


#: treatments the algorithms' :class:`DPSupport` declarations share
SAMPLES = ("data-independent", "sample count sent as 1: uniform aggregation weights")
MODEL = ("dp-sgd", "parameters trained with DP-SGD")
SPEC = ("public", "architecture spec (configuration)")
AVERAGE = ("dp-sgd", "average of DP-trained models")
ROTATION = {"{alg}.invite, {alg}.decline, {alg}.done": ("public", "round, token and schedule; completion times "
                                                                    "(timing, see presence)")}


def rotating(**extra: tuple[str, str]) -> DPSupport:
    """The :class:`DPSupport` of a rotating-aggregator algorithm (its model, spec, samples,
    average and the rotation's messages), with ``extra`` messages."""
    return DPSupport({"{alg}.model": MODEL, "{alg}.model spec": SPEC, "{alg}.model samples": SAMPLES,
                      "{alg}.update": AVERAGE, **ROTATION, **extra})


def option(options: Any, key: str, default: Any) -> Any:
    """``options[key]`` of a config table, or ``options.key`` of parsed options (None: ``default``)."""
    if options is None:
        return default
    if isinstance(options, Mapping):
        return options.get(key, default)
    return getattr(options, key, default)


def dp_enabled(cfg: Any) -> bool:
    """Whether the node configuration ``cfg`` asks for DP: its ``privacy`` is a
    :class:`~dfl_agent.privacy.config.PrivacyConfig` with ``dp`` set, or a ``[privacy]``
    section whose ``dp`` table sets a key and is not ``enabled = false``."""
    from dfl_agent.privacy.config import PrivacyConfig, section_table

    p = getattr(cfg, "privacy", None)
    if p is None or isinstance(p, PrivacyConfig):
        return getattr(p, "dp", None) is not None
    dp = section_table(p).get("dp")
    return isinstance(dp, Mapping) and bool(section_table(dp)) and section_table(dp).get("enabled") is not False


def parse_checked(table: Any, algorithm: str, support: DPSupport | None, options: Any = None,
                  where: str = "privacy") -> Any:
    """:func:`~dfl_agent.privacy.config.parse_privacy` of ``table``, and under DP
    :func:`check_dp_combination` of the configured algorithm and :func:`check_lifetime`: the
    configuration's check.

    Returns:
        the :class:`~dfl_agent.privacy.config.PrivacyConfig`.

    Raises:
        ValueError: one line (a bad key, an algorithm that cannot run under DP, or a per-run
            target ε above the lifetime budget).
    """
    from dfl_agent.privacy.config import parse_privacy

    privacy = parse_privacy(table, where)
    if privacy.dp is not None:
        check_dp_combination(algorithm, support, options)
        check_lifetime(privacy, where)
    return privacy


def check_lifetime(privacy: Any, where: str = "privacy") -> None:
    """The privacy admission's static rule: a run planned for ``privacy.dp.target_epsilon``
    spends up to that ε on its own (:func:`~dfl_agent.privacy.plan.plan_run` picks the noise for
    it), so a target above ``privacy.lifetime_epsilon`` takes the device past its lifetime budget
    with its first run, and admission declines every run
    (:meth:`~dfl_agent.runtime.service.privacy_budget.PrivacyBudget.admit_config` applies this rule
    first).  With ``noise_multiplier`` given instead, a run's ε depends on the device's samples
    and the run's rounds: admission alone decides.

    Args:
        privacy: a :class:`~dfl_agent.privacy.config.PrivacyConfig` (``dp`` None: nothing to check).
        where: the section's dotted key, named in the error.

    Raises:
        ValueError: one line, ``privacy.dp.target_epsilon: 12 is above privacy.lifetime_epsilon 10 ...``.
    """
    dp = privacy.dp
    if dp is not None and dp.target_epsilon is not None and dp.target_epsilon > privacy.lifetime_epsilon:
        raise ValueError(f"{where}.dp.target_epsilon: {dp.target_epsilon:g} is above {where}.lifetime_epsilon "
                         f"{privacy.lifetime_epsilon:g}: every run would be declined (a run alone spends up to "
                         f"its target epsilon)")


def check_dp_combination(algorithm: str, support: DPSupport | None, options: Any = None) -> None:
    """Refuse ``algorithm`` with ``options`` under DP when it would send a value derived from
    the device's data that DP does not protect (``support``: what its class declares, its
    :class:`~dfl_agent.algorithms.base.Traits`' ``dp``; an algorithm that declares none is
    refused).  Call it only when ``privacy.dp`` is set.

    Args:
        algorithm: the registry name (``algorithm.name``), for the message.
        support: the algorithm's DP declaration (None: it declares none).
        options: ``algorithm.options`` (a mapping) or the parsed options; None: defaults.

    Raises:
        ValueError: one line, ``privacy.dp: algorithm X cannot run under differential
            privacy: <reason>``.
    """
    reason = ("it is not in the privacy policy (its class declares no Traits(dp=...))" if support is None
              else support.refused or (support.refuse_when(options) if support.refuse_when else None))
    if reason:
        raise ValueError(f"privacy.dp: algorithm {algorithm!r} cannot run under differential privacy: {reason}")


#: Status keys that carry a value computed on the device's data (exact names; and every key
#: ending in ``_accuracy``): accuracies, sample counts, and a run's DP plan, whose sampling rate
#: ``batch_size / N``, step count ``rounds · ⌈N / batch_size⌉`` and noise multiplier (chosen for
#: a target ε from both) reveal the size N of the training split.  The ε and δ stay.
REDACTED_STATUS_KEYS = frozenset({"accuracy", "train_samples", "validation_samples", "samples", "sample_rate",
                                  "steps", "noise_multiplier"})


def redact_status(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` (a status or announcement document) without the values derived from the
    device's data that DP does not protect: every ``*_accuracy`` and ``accuracy`` key, the
    sample counts and the DP plan's figures (:data:`REDACTED_STATUS_KEYS`), at the top level
    and in nested documents (the ``run`` entry, ``run_history``, ``privacy``).  A new dict;
    ``doc`` is unchanged."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if k in REDACTED_STATUS_KEYS or k.endswith("_accuracy"):
            continue
        out[k] = redact_status(v) if isinstance(v, Mapping) else v
    return out
