"""Device profiles: what a device is, how it is detected, what it does, when it trains.

- :mod:`dfl_agent.profiles.schema`: the typed, validated profile (``device_profiles/*.toml``).
- :mod:`dfl_agent.profiles.detect`: machine facts and profile matching (``dflctl profile detect``).
- :mod:`dfl_agent.profiles.behaviour`: the decision table (algorithm, roles, model, compression,
  device) and the peer compatibility check.
- :mod:`dfl_agent.profiles.gating`: resource gating (battery, temperature, load, time windows).

Nothing here imports torch at module level.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dfl_agent.profiles.behaviour import Behaviour, peer_incompatibility, resolve_device, select_behaviour
from dfl_agent.profiles.detect import Detection, Facts, NoProfileMatches, collect_facts, detect
from dfl_agent.profiles.gating import ResourceGate
from dfl_agent.profiles.schema import (
    DeviceProfile,
    ProfileError,
    get_profile,
    list_profiles,
    profile_from_dict,
    with_overrides,
)

AUTO = "auto"

__all__ = [
    "AUTO", "Behaviour", "Detection", "DeviceProfile", "Facts", "NoProfileMatches", "ProfileError", "ResourceGate",
    "collect_facts", "detect", "get_profile", "list_profiles", "peer_incompatibility", "profile_from_dict",
    "resolve_device", "resolve_profile", "select_behaviour", "with_overrides",
]


def resolve_profile(name: str, overrides: Mapping[str, Any] | None = None, *, facts: Facts | None = None,
                    directory: Any = None) -> tuple[DeviceProfile, Detection | None]:
    """The node's profile: ``name`` pinned (or ``"auto"``: detected), with ``overrides``.

    Returns ``(profile, detection or None when pinned)``.

    Raises:
        ProfileError: unknown profile or invalid override (naming the key).
        NoProfileMatches: ``auto`` and nothing matches.
    """
    if name == AUTO:
        det = detect(facts, list_profiles(directory))
        return with_overrides(det.profile, overrides), det
    return with_overrides(get_profile(name, directory), overrides), None
