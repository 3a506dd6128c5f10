"""The device profile: a typed, validated description of one device class.

A profile is a TOML file in ``device_profiles/`` (documented field by field in
``device_profiles/README.md``).  It is read once into :class:`DeviceProfile`; an
unknown key, a wrong type or an out-of-range value raises :class:`ProfileError`
whose message starts with the dotted key (``limits.min_battery_percent: must be in
[0, 100]``).  A node configuration may pin a profile by name and override single
fields (``profile_overrides``); overrides are validated exactly like the file.

Only the standard library is imported here (no torch), so the inference-only
member can read profiles too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dfl_agent.privacy.config import PrivacySection, parse_privacy
from dfl_agent.tomlcheck import TomlFileError, build, read_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROLES = ("trainer", "sender", "receiver", "aggregator", "inference")
"""What a node may do: ``trainer`` trains its own model each round; ``sender`` sends
its model for others to fuse (DFML sender, Def-KT sender); ``receiver`` holds a second
model while fusing (Def-KT receiver: two models); ``aggregator`` leads a rotating
round (DFML: holds every participant's model and runs K epochs of mutual learning);
``inference`` only serves predictions with the federation's model (ONNX)."""

SIZES = ("small", "medium", "large")
DEVICES = ("cpu", "cuda", "auto")
_WINDOW = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-4]):([0-5]\d)$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_SIZE = re.compile(r"^([1-9][0-9]*)([KMGT]?)$")
_DEVICE = re.compile(r"^(/dev/[A-Za-z0-9_./+-]+|(char|block)-[A-Za-z0-9_.*?/+-]+) [rwm]{1,3}$")
_GROUP = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


class ProfileError(ValueError):
    """An invalid profile or override; the message starts with the offending key."""


@dataclasses.dataclass
class MatchSection:
    """``[match]``: when :func:`dfl_agent.profiles.detect.detect` picks this profile.

    Every criterion that is set must hold; among the matching profiles the one with
    the most criteria (the most specific) wins, ties broken by ``priority``.

    Attributes:
        auto: take part in detection at all (false: only by pinning the name).
        arch: CPU architectures (``platform.machine()``, lower case), any of.
        device_tree_model: substrings of ``/proc/device-tree/model``, any of.
        tegra: ``/etc/nv_tegra_release`` must exist (true) or must not (false).
        tegra_release: prefixes of its first field (``R32`` = L4T 32, Jetson Nano).
        cuda: a CUDA device visible to torch (true) or none (false).
        min_cuda_memory_mb: total memory of the largest CUDA device, MiB.
        min_memory_mb: system memory, MiB.
        torch: torch importable (false: the inference-only member).
        priority: tie-breaker (higher wins).
    """

    auto: bool = True
    arch: list[str] | None = None
    device_tree_model: list[str] | None = None
    tegra: bool | None = None
    tegra_release: list[str] | None = None
    cuda: bool | None = None
    min_cuda_memory_mb: int | None = None
    min_memory_mb: int | None = None
    torch: bool | None = None
    priority: int = 0


@dataclasses.dataclass
class ComputeSection:
    """``[compute]``: where and how hard this device computes.

    Attributes:
        device: ``cpu``, ``cuda`` (the first CUDA device; falls back to cpu with a
            warning when none is visible) or ``auto`` (cuda when available).
        threads: torch intra-op threads; 0 = every CPU core.
        memory_budget_mb: memory the agent may use for models and training (MiB);
            decides whether the device may aggregate (see the decision table), and
            limits each run's process (its memory cgroup, :mod:`dfl_agent.runtime.service.cgroup`).
        mixed_precision: train with ``torch.autocast`` (float16 on CUDA; ignored on cpu).
    """

    device: str = "cpu"
    threads: int = 1
    memory_budget_mb: int = 1024
    mixed_precision: bool = False


@dataclasses.dataclass
class ModelSection:
    """``[model]``: the size tier this device trains (``small``, ``medium``, ``large``).

    Federations that mix architectures (DFML) use it; parameter-averaging federations
    use the federation's common model (see the decision table)."""

    size: str = "medium"


@dataclasses.dataclass
class BehaviourSection:
    """``[behaviour]``: what this device may do in a federation.

    Attributes:
        algorithms: algorithms it can run, in order of preference.  ``"*"`` stands for
            every registered algorithm the profile rule allows, expanded when the profile
            is read (:func:`dfl_agent.profiles.behaviour.expand_algorithms`).
        roles: subset of :data:`ROLES`.
        compression: update compression spec, ``none`` or ``op[:arg](+op[:arg])*``
            (e.g. ``topk:0.01+q8``, grammar of :mod:`dfl_agent.learning.compression`).
        left_out: one ``"algorithm: reason"`` line per known algorithm the profile does not
            list (the reason the profile rule of :func:`dfl_agent.profiles.behaviour.algorithm_fit`
            gives); shown by ``dflctl profile show``.  With ``"*"`` in ``algorithms``, the
            rule's reason fills in for every algorithm without a line.
    """

    algorithms: list[str] = dataclasses.field(default_factory=lambda: ["dfml", "dechw", "defkt", "fedavg"])
    roles: list[str] = dataclasses.field(default_factory=lambda: ["trainer", "sender", "receiver", "aggregator"])
    compression: str = "none"
    left_out: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TrainingSection:
    """``[training]``: the local training defaults and schedule.

    Attributes:
        batch_size: mini-batch size.
        epochs: local epochs per round.
        windows: local-time windows ``"HH:MM-HH:MM"`` in which training is allowed
            (a window may wrap midnight, ``"22:00-06:00"``); empty = always.
    """

    batch_size: int = 32
    epochs: int = 1
    windows: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LimitsSection:
    """``[limits]``: resource gating; a node trains only while all hold.

    Attributes:
        min_battery_percent: on battery (no external power) train only at or above
            this charge (percent); 0 = no battery limit.
        max_temperature_c: train only while every temperature sensor reads below
            this (°C); 0 = no limit.
        max_load_per_core: train only while the 1-minute load average divided by the
            CPU count is below this; 0 = no limit.
        poll_interval_s: how often a gated node re-checks (seconds).
    """

    min_battery_percent: float = 20.0
    max_temperature_c: float = 85.0
    max_load_per_core: float = 0.0
    poll_interval_s: float = 5.0


@dataclasses.dataclass
class ResourcesSection:
    """``[resources]``: the systemd limits ``dflctl install-service --profile`` writes
    into the drop-in ``<unit>.d/50-resources.conf`` (an unset field keeps the unit's value).

    These bound the whole service (cgroup), the agent and its runs together; each run's
    process is held to ``compute.memory_budget_mb``, which must fit under ``memory_max``.

    Attributes:
        memory_max: ``MemoryMax=``, a systemd size (``"1536M"``, ``"3G"``; K/M/G/T are
            powers of 1024) or ``"infinity"``; ``""`` keeps the unit's ``2G``.
        cpu_quota: ``CPUQuota=`` in percent of one core (``300`` = three cores);
            0 keeps the unit's ``200%``.
        nice: ``Nice=``, -20 (first) to 19 (last); None keeps the default (0).
        io_weight: ``IOWeight=``, 1 to 10000 (default 100); 0 keeps the default.
        private_devices: ``PrivateDevices=``; false shows the host's ``/dev`` to the
            service (GPUs); None keeps the unit's ``yes``.
        device_allow: ``DeviceAllow=`` lines, ``"<node or char-/block-group> <rwm>"``
            (``"/dev/nvmap rw"``, ``"char-nvidia* rw"``); when set, only these nodes and
            ``/dev/null``, ``/dev/zero``, ``/dev/full``, ``/dev/random``, ``/dev/urandom``
            may be opened. Needs ``private_devices = false``.
        supplementary_groups: ``SupplementaryGroups=``, e.g. ``["video"]`` for the
            Jetson GPU nodes (mode 0660, group video).
    """

    memory_max: str = ""
    cpu_quota: int = 0
    nice: int | None = None
    io_weight: int = 0
    private_devices: bool | None = None
    device_allow: list[str] = dataclasses.field(default_factory=list)
    supplementary_groups: list[str] = dataclasses.field(default_factory=list)

    def systemd_directives(self) -> list[tuple[str, str]]:
        """The ``(directive, value)`` pairs of the set fields, in drop-in order
        (``DeviceAllow`` may repeat); [] when the profile sets none."""
        out: list[tuple[str, str]] = []
        if self.memory_max:
            out.append(("MemoryMax", self.memory_max))
        if self.cpu_quota:
            out.append(("CPUQuota", f"{self.cpu_quota}%"))
        if self.nice is not None:
            out.append(("Nice", str(self.nice)))
        if self.io_weight:
            out.append(("IOWeight", str(self.io_weight)))
        if self.private_devices is not None:
            out.append(("PrivateDevices", "yes" if self.private_devices else "no"))
        out.extend(("DeviceAllow", d) for d in self.device_allow)
        if self.supplementary_groups:
            out.append(("SupplementaryGroups", " ".join(self.supplementary_groups)))
        return out


def memory_max_mib(value: str) -> float | None:
    """A systemd size (``"1536M"``, ``"3G"``, ``"524288K"``, plain bytes) in MiB;
    None for ``"infinity"`` or ``""``.

    Raises:
        ValueError: not a size systemd's ``MemoryMax=`` takes (percentages are refused:
            they depend on the machine).
    """
    if value in ("", "infinity"):
        return None
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"must be a size such as '1536M' or '3G' (K/M/G/T) or 'infinity', got {value!r}")
    return int(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ") / 1024 ** 2


@dataclasses.dataclass
class DeviceProfile:
    """One device class (a ``device_profiles/*.toml`` file).

    Attributes:
        name: profile name (``[a-z0-9-]``), the file's stem.
        description: one line for humans.
        aliases: further names that pin this profile (``x86-cpu`` for ``generic-x86``).
    """

    name: str
    description: str = ""
    aliases: list[str] = dataclasses.field(default_factory=list)
    match: MatchSection = dataclasses.field(default_factory=MatchSection)
    compute: ComputeSection = dataclasses.field(default_factory=ComputeSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    behaviour: BehaviourSection = dataclasses.field(default_factory=BehaviourSection)
    training: TrainingSection = dataclasses.field(default_factory=TrainingSection)
    limits: LimitsSection = dataclasses.field(default_factory=LimitsSection)
    resources: ResourcesSection = dataclasses.field(default_factory=ResourcesSection)
    #: ``[privacy]``: DP-SGD and the lifetime budget of the devices of this class (the node config wins key by key)
    privacy: PrivacySection = dataclasses.field(default_factory=PrivacySection)

    @property
    def inference_only(self) -> bool:
        """True when the profile only serves predictions (roles == ["inference"])."""
        return self.behaviour.roles == ["inference"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (``dflctl profile show --json``)."""
        return dataclasses.asdict(self)


# -- validation -------------------------------------------------------------------------
def validate(p: DeviceProfile) -> DeviceProfile:
    """Check ranges and vocabularies of a built profile; returns it.

    Raises:
        ProfileError: naming the first offending key.
    """

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ProfileError(f"{key}: {why}")

    need(bool(_NAME.match(p.name)), "name", "must match [a-z0-9][a-z0-9-]{0,63}")
    for i, a in enumerate(p.aliases):
        need(bool(_NAME.match(a)), f"aliases[{i}]", "must match [a-z0-9][a-z0-9-]{0,63}")
    c = p.compute
    need(c.device in DEVICES, "compute.device", f"must be one of {', '.join(DEVICES)}")
    need(0 <= c.threads <= 1024, "compute.threads", "must be in [0, 1024] (0 = every core)")
    need(c.memory_budget_mb >= 16, "compute.memory_budget_mb", "must be >= 16")
    need(p.model.size in SIZES, "model.size", f"must be one of {', '.join(SIZES)}")
    b = p.behaviour
    need(bool(b.roles), "behaviour.roles", "must list at least one role")
    for i, r in enumerate(b.roles):
        need(r in ROLES, f"behaviour.roles[{i}]", f"unknown role {r!r} (known: {', '.join(ROLES)})")
    need("inference" not in b.roles or b.roles == ["inference"], "behaviour.roles",
         "'inference' cannot be combined with training roles")
    need(bool(b.algorithms) or b.roles == ["inference"], "behaviour.algorithms", "must list at least one algorithm")
    for i, line in enumerate(b.left_out):
        need(":" in line and bool(line.split(":", 1)[0].strip()), f"behaviour.left_out[{i}]",
             f"must be 'algorithm: reason', got {line!r}")
    from dfl_agent.learning.compression import CompressionError, parse_spec

    try:
        parse_spec(b.compression)
    except CompressionError as exc:
        raise ProfileError("behaviour.compression: must be a compression spec such as 'none', 'q8', "
                           f"'topk:0.01+q8' ({exc})") from None
    t = p.training
    need(1 <= t.batch_size <= 65536, "training.batch_size", "must be in [1, 65536]")
    need(1 <= t.epochs <= 1000, "training.epochs", "must be in [1, 1000]")
    for i, w in enumerate(t.windows):
        need(bool(_WINDOW.match(w)), f"training.windows[{i}]", f"must be 'HH:MM-HH:MM', got {w!r}")
    lim = p.limits
    need(0 <= lim.min_battery_percent <= 100, "limits.min_battery_percent", "must be in [0, 100]")
    need(0 <= lim.max_temperature_c <= 150, "limits.max_temperature_c", "must be in [0, 150] (0 = no limit)")
    need(lim.max_load_per_core >= 0, "limits.max_load_per_core", "must be >= 0 (0 = no limit)")
    need(lim.poll_interval_s > 0, "limits.poll_interval_s", "must be > 0")
    res = p.resources
    try:
        mib = memory_max_mib(res.memory_max)
    except ValueError as exc:
        raise ProfileError(f"resources.memory_max: {exc}") from None
    need(mib is None or mib >= c.memory_budget_mb, "resources.memory_max",
         f"{res.memory_max} is below compute.memory_budget_mb ({c.memory_budget_mb} MiB): "
         "the service's limit must hold the agent's budget")
    need(0 <= res.cpu_quota <= 102400, "resources.cpu_quota", "must be in [0, 102400] percent (0 = the unit's)")
    need(res.nice is None or -20 <= res.nice <= 19, "resources.nice", "must be in [-20, 19]")
    need(0 <= res.io_weight <= 10000, "resources.io_weight", "must be in [1, 10000] (0 = the default)")
    for i, d in enumerate(res.device_allow):
        need(bool(_DEVICE.match(d)), f"resources.device_allow[{i}]",
             f"must be '<node or char-GROUP or block-GROUP> <rwm>' such as '/dev/nvmap rw', got {d!r}")
    need(not res.device_allow or res.private_devices is False, "resources.device_allow",
         "needs resources.private_devices = false (PrivateDevices=yes hides every device node)")
    for i, g in enumerate(res.supplementary_groups):
        need(bool(_GROUP.match(g)), f"resources.supplementary_groups[{i}]", f"not a group name: {g!r}")
    m = p.match
    need(m.min_memory_mb is None or m.min_memory_mb >= 0, "match.min_memory_mb", "must be >= 0")
    need(m.min_cuda_memory_mb is None or m.min_cuda_memory_mb >= 0, "match.min_cuda_memory_mb", "must be >= 0")
    try:
        parse_privacy(p.privacy, "privacy", complete=False)  # the node configuration may complete it
    except ValueError as exc:
        raise ProfileError(str(exc)) from None
    return p


def profile_from_dict(raw: Mapping[str, Any], prefix: str = "") -> DeviceProfile:
    """Build and validate a profile from a parsed TOML table.

    Raises:
        ProfileError: naming the offending key (prefixed with ``prefix``).
    """
    if "name" not in raw:
        raise ProfileError(f"{prefix}name: required")
    from dfl_agent.profiles.behaviour import expand_algorithms

    try:
        return expand_algorithms(validate(build(DeviceProfile, raw, "", error=ProfileError)))
    except ProfileError as exc:
        raise ProfileError(f"{prefix}{exc}") from None


def with_overrides(profile: DeviceProfile, overrides: Mapping[str, Any] | None,
                   prefix: str = "profile_overrides.") -> DeviceProfile:
    """``profile`` with single fields replaced, e.g. ``{"limits": {"min_battery_percent": 50}}``.

    Raises:
        ProfileError: an unknown or invalid field, named as ``prefix`` + dotted key.
    """
    if not overrides:
        return profile
    merged = profile.to_dict()
    for section, table in overrides.items():
        if section in ("name", "match") or section not in merged:
            known = [k for k in merged if k not in ("name", "match")]
            raise ProfileError(f"{prefix}{section}: cannot be overridden (known: {', '.join(known)})")
        if isinstance(merged[section], dict):
            if not isinstance(table, Mapping):
                raise ProfileError(f"{prefix}{section}: must be a table")
            merged[section] = {**merged[section], **table}
        else:
            merged[section] = table
    return profile_from_dict(merged, prefix)


# -- files ------------------------------------------------------------------------------
def profile_files(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """The profile files to read, sorted by name.

    With ``directory``, that folder's ``*.toml``. Otherwise the union over
    :func:`dfl_agent.resources.profile_dirs` (``$DFL_PROFILES_DIR``,
    ``/etc/dfl-agent/profiles``, the shipped profiles), where a file overrides the file of
    the same name in a later folder."""
    if directory is not None:
        return sorted(Path(directory).glob("*.toml"))
    from dfl_agent.resources import profile_dirs

    chosen: dict[str, Path] = {}
    for d in profile_dirs():
        for f in sorted(Path(d).glob("*.toml")):
            chosen.setdefault(f.name, f)
    return [chosen[k] for k in sorted(chosen)]


def load_profile_file(path: str | os.PathLike[str]) -> DeviceProfile:
    """Read one profile file.

    Raises:
        ProfileError: unreadable, TOML syntax error, invalid field, or a ``name`` that
            differs from the file's stem.
    """
    p = Path(path)
    try:
        raw = read_toml(p)  # bounded in size and nesting; a byte that is not UTF-8 named by its key
    except OSError as exc:
        raise ProfileError(f"cannot read profile {p}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{p}: TOML syntax error: {exc}") from None
    except TomlFileError as exc:
        raise ProfileError(str(exc)) from None
    prof = profile_from_dict(raw, prefix=f"{p.name}: ")
    if prof.name != p.stem:
        raise ProfileError(f"{p.name}: name: {prof.name!r} must equal the file name {p.stem!r}")
    return prof


def list_profiles(directory: str | os.PathLike[str] | None = None) -> list[DeviceProfile]:
    """Every profile in ``directory`` (default: see :func:`profile_files`), sorted by name.

    Raises:
        ProfileError: an invalid file, or a name/alias used twice.
    """
    out = [load_profile_file(f) for f in profile_files(directory)]
    seen: dict[str, str] = {}
    for prof in out:
        for n in [prof.name, *prof.aliases]:
            if n in seen:
                raise ProfileError(f"{prof.name}.toml: name {n!r} is also used by {seen[n]}")
            seen[n] = prof.name
    return out


def get_profile(name: str, directory: str | os.PathLike[str] | None = None) -> DeviceProfile:
    """The profile called ``name`` (or with ``name`` among its aliases).

    Raises:
        ProfileError: no such profile (the message lists the known ones).
    """
    profiles = list_profiles(directory)
    for prof in profiles:
        if name == prof.name or name in prof.aliases:
            return prof
    raise ProfileError(f"unknown device profile {name!r}; known: {', '.join(p.name for p in profiles)}")
