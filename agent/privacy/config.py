"""The ``[privacy]`` section: DP-SGD on the device and the device's lifetime privacy budget.

The section may appear in the node configuration and in the device profile; the node
configuration wins key by key (:func:`merge_privacy`).  ``[privacy.dp]`` turns DP-SGD on: every
gradient of a sample is clipped to ``max_grad_norm`` and Gaussian noise is added, with the noise
multiplier either given (``noise_multiplier``) or found for a per-run ``target_epsilon``
(exactly one of the two).  ``lifetime_epsilon`` is the device's budget over its whole life: a run
whose spend would take the composed ε past it is declined at admission.

The sections (:class:`PrivacySection`, :class:`DPSection`) are the typed TOML tables, every key
unset by default so that a profile's value shows through; :func:`parse_privacy` validates the
merged table into :class:`PrivacyConfig` with one-line errors that name the key.  Only the
standard library is imported here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Mapping
from typing import Any

DEFAULT_DELTA = 1e-5
DEFAULT_LIFETIME_EPSILON = 10.0
_DP_KEYS = ("enabled", "max_grad_norm", "delta", "target_epsilon", "noise_multiplier")
_KEYS = ("dp", "lifetime_epsilon")
_NOISE_KEYS = ("target_epsilon", "noise_multiplier")


def _key(default: Any = None, *, help: str, default_text: str | None = None) -> Any:
    """A described field, as the configuration reference expects (``metadata["help"]``)."""
    meta: dict[str, Any] = {"help": help}
    if default_text is not None:
        meta["default_text"] = default_text
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class DPSection:
    """``[privacy.dp]``: DP-SGD in local training (per-sample clipping, Gaussian noise, Poisson batches).

    Setting any key turns DP on; set ``max_grad_norm`` and exactly one of ``target_epsilon`` and
    ``noise_multiplier``. Needs the `privacy` extra. A key left unset here comes from the device
    profile's `[privacy.dp]`."""

    enabled: bool | None = _key(
        help="false turns off the DP that the device profile sets; unset: on when any key of this table is set",
        default_text="unset")
    max_grad_norm: float | None = _key(help="clipping bound C of each sample's gradient (L2 norm), > 0",
                                       default_text="unset")
    delta: float | None = _key(help="the δ of the (ε, δ) guarantee; must be below 1/N for the sample store's "
                                    "N samples (checked when a run is admitted)", default_text="`1e-05`")
    target_epsilon: float | None = _key(
        help="the ε one run may spend: the noise multiplier is the smallest that keeps the run's ε at or below it",
        default_text="unset")
    noise_multiplier: float | None = _key(
        help="the noise's standard deviation over `max_grad_norm` (σ), > 0; instead of `target_epsilon`",
        default_text="unset")


@dataclasses.dataclass
class PrivacySection:
    """``[privacy]``: differential privacy of the device's own data and its lifetime budget.

    The device profile may set the same keys; the node configuration wins key by key."""

    lifetime_epsilon: float | None = _key(
        help="the device's privacy budget over its whole life: a run whose spend would take the composed ε "
             "(RDP, over every run in the privacy ledger) past it is declined", default_text="`10.0`")
    dp: DPSection = dataclasses.field(default_factory=DPSection, metadata={"help": "`[privacy.dp]` section"})


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """DP-SGD's settings of a device: exactly one of ``target_epsilon`` and ``noise_multiplier``."""

    max_grad_norm: float
    delta: float = DEFAULT_DELTA
    target_epsilon: float | None = None
    noise_multiplier: float | None = None


@dataclasses.dataclass(frozen=True)
class PrivacyConfig:
    """A device's privacy settings: ``dp`` None means no DP."""

    dp: DPConfig | None = None
    lifetime_epsilon: float = DEFAULT_LIFETIME_EPSILON


def section_table(section: Any) -> dict[str, Any]:
    """The keys set (not None) of a section dataclass, nested tables included (empty ones left out)."""
    if section is None:
        return {}
    if isinstance(section, Mapping):
        return dict(section)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if dataclasses.is_dataclass(v):
            v = section_table(v)
            if v:
                out[f.name] = v
        elif v is not None:
            out[f.name] = v
    return out


def merge_privacy(profile: Mapping[str, Any] | PrivacySection | None,
                  node: Mapping[str, Any] | PrivacySection | None) -> dict[str, Any]:
    """The node's ``[privacy]`` table over the profile's, key by key (``dp`` merged key by key too);
    either may be a parsed table or a :class:`PrivacySection`.

    ``target_epsilon`` and ``noise_multiplier`` are one choice: a node that sets either replaces
    the profile's choice (otherwise the merged table would hold both)."""
    p = section_table(profile)
    n = section_table(node)
    out: dict[str, Any] = {**p, **{k: v for k, v in n.items() if k != "dp"}}
    pdp, ndp = p.get("dp"), n.get("dp")
    if isinstance(pdp, Mapping) and isinstance(ndp, Mapping):
        dp = dict(pdp)
        if any(k in ndp for k in _NOISE_KEYS):
            for k in _NOISE_KEYS:
                dp.pop(k, None)
        dp.update(ndp)
        out["dp"] = dp
    elif ndp is not None:
        out["dp"] = ndp
    return out


def _number(table: Mapping[str, Any], key: str, where: str, *, positive: bool = True) -> float | None:
    """``table[key]`` as a finite float (> 0 when ``positive``), None when unset."""
    v = table.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}.{key}: expected a number, got {v!r}")
    x = float(v)
    if not math.isfinite(x) or (positive and x <= 0):
        raise ValueError(f"{where}.{key}: must be > 0, got {v!r}")
    return x


def _unknown(table: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for k in table:
        if k not in known:
            raise ValueError(f"{where}.{k}: unknown key (known: {', '.join(known)})")


def parse_privacy(table: Mapping[str, Any] | PrivacySection | None, where: str = "privacy", *,
                  complete: bool = True) -> PrivacyConfig:
    """Validate a ``[privacy]`` table (or a :class:`PrivacySection`) into a :class:`PrivacyConfig`.

    Args:
        table: the parsed table, merged (:func:`merge_privacy`) or not; None: no privacy settings.
        where: the table's dotted key, named in errors (``privacy``, ``profile_overrides.privacy``).
        complete: False checks each value set but not that DP's required keys are there (a device
            profile, which the node configuration completes); the result's ``dp`` is then None.

    Raises:
        ValueError: one line naming the key, e.g. ``privacy.dp.max_grad_norm: must be > 0, got -1``.
    """
    t = section_table(table)
    _unknown(t, _KEYS, where)
    life = _number(t, "lifetime_epsilon", where)
    lifetime = DEFAULT_LIFETIME_EPSILON if life is None else life
    raw_dp = t.get("dp")
    if raw_dp is None:
        return PrivacyConfig(None, lifetime)
    w = f"{where}.dp"
    if not isinstance(raw_dp, Mapping):
        raise ValueError(f"{w}: must be a table")
    dp = section_table(raw_dp)
    _unknown(dp, _DP_KEYS, w)
    enabled = dp.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"{w}.enabled: expected a boolean, got {enabled!r}")
    if enabled is False or not any(dp.get(k) is not None for k in _DP_KEYS):
        return PrivacyConfig(None, lifetime)
    clip = _number(dp, "max_grad_norm", w)
    delta = _number(dp, "delta", w)
    if delta is not None and delta >= 1.0:
        raise ValueError(f"{w}.delta: must be in (0, 1), got {dp['delta']!r}")
    target = _number(dp, "target_epsilon", w)
    sigma = _number(dp, "noise_multiplier", w)
    if not complete:
        return PrivacyConfig(None, lifetime)
    if clip is None:
        raise ValueError(f"{w}.max_grad_norm: required when DP is on (the clipping bound, e.g. 1.0)")
    if (target is None) == (sigma is None):
        raise ValueError(f"{w}: set exactly one of target_epsilon and noise_multiplier"
                         + (" (both are set)" if target is not None else ""))
    if importlib.util.find_spec("opacus") is None:  # found, not imported: the supervisor stays torch-free
        from dfl_agent.extras import extra_hint

        raise ValueError(f"{w}: DP training needs Opacus, which is not installed: {extra_hint('privacy')}")
    return PrivacyConfig(DPConfig(max_grad_norm=clip, delta=DEFAULT_DELTA if delta is None else delta,
                                  target_epsilon=target, noise_multiplier=sigma), lifetime)
