"""Which device profile fits this machine, and why.

:func:`collect_facts` reads the machine: CPU architecture and count, memory,
``torch.cuda`` devices and their memory, ``/proc/device-tree/model`` (Raspberry Pi,
Jetson), ``/etc/nv_tegra_release`` (Jetson's L4T release), battery and temperatures
(psutil).  Every source is injectable (file paths, the ``psutil`` module, the
``torch.cuda`` module, ``platform.machine``), so tests use fixture files and fake
readings at those boundaries only.  :func:`detect` matches the facts against every
profile's ``[match]`` table and explains each criterion.

No torch import at module level: detection works where torch is not installed
(the inference-only member).
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dfl_agent.profiles.schema import DeviceProfile, list_profiles

DEVICE_TREE_MODEL = "/proc/device-tree/model"
TEGRA_RELEASE = "/etc/nv_tegra_release"
MIB = 1024 * 1024


@dataclasses.dataclass
class CudaDevice:
    """One CUDA device: ``name`` and total ``memory_mb`` (MiB)."""

    name: str
    memory_mb: int


@dataclasses.dataclass
class Facts:
    """What detection knows about the machine (all JSON-friendly).

    Attributes:
        arch: ``platform.machine()`` lower-cased (``x86_64``, ``aarch64``, ``amd64``).
        cpu_count: logical CPUs.
        memory_mb: total system memory (MiB).
        cuda: CUDA devices visible to torch (empty without torch or GPU).
        torch: whether torch could be imported.
        device_tree_model: ``/proc/device-tree/model`` (NUL stripped) or None.
        tegra_release: first line of ``/etc/nv_tegra_release`` or None.
        battery: ``{"percent": float, "plugged": bool}`` or None (no battery).
        temperatures: hottest reading per psutil sensor group (°C).
        load_per_core: 1-minute load average / cpu_count, or None.
    """

    arch: str
    cpu_count: int
    memory_mb: int
    cuda: list[CudaDevice] = dataclasses.field(default_factory=list)
    torch: bool = True
    device_tree_model: str | None = None
    tegra_release: str | None = None
    battery: dict[str, Any] | None = None
    temperatures: dict[str, float] = dataclasses.field(default_factory=dict)
    load_per_core: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _read_text(path: str | Path | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes().decode("utf-8", "replace").replace("\x00", "").strip()
    except OSError:
        return None


def cuda_devices(cuda: Any = None) -> tuple[bool, list[CudaDevice]]:
    """``(torch importable, CUDA devices)``; ``cuda`` replaces ``torch.cuda`` (tests).

    Never raises: a broken CUDA installation counts as no device."""
    if cuda is None:
        try:
            import torch
        except ImportError:
            return False, []
        cuda = torch.cuda
    try:
        if not cuda.is_available():
            return True, []
        out = []
        for i in range(int(cuda.device_count())):
            props = cuda.get_device_properties(i)
            out.append(CudaDevice(str(props.name), int(props.total_memory) // MIB))
        return True, out
    except Exception:  # noqa: BLE001 - a broken driver is "no GPU"
        return True, []


def sensor_readings(psutil_mod: Any) -> tuple[dict[str, Any] | None, dict[str, float], float | None]:
    """``(battery, temperatures, load_per_core)`` read through ``psutil_mod``.

    Missing sensors (no battery, no thermal zones, a platform without them) read as
    None / empty; never raises."""
    battery = None
    try:
        b = psutil_mod.sensors_battery() if hasattr(psutil_mod, "sensors_battery") else None
        if b is not None:
            battery = {"percent": float(b.percent), "plugged": bool(b.power_plugged)}
    except Exception:  # noqa: BLE001
        battery = None
    temps: dict[str, float] = {}
    try:
        groups = psutil_mod.sensors_temperatures() if hasattr(psutil_mod, "sensors_temperatures") else {}
        for name, entries in (groups or {}).items():
            values = [float(e.current) for e in entries if e.current is not None]
            if values:
                temps[name] = max(values)
    except Exception:  # noqa: BLE001
        temps = {}
    load = None
    try:
        cores = psutil_mod.cpu_count() or 1
        load = float(psutil_mod.getloadavg()[0]) / cores
    except Exception:  # noqa: BLE001
        load = None
    return battery, temps, load


def collect_facts(
    *,
    device_tree_model: str | Path | None = DEVICE_TREE_MODEL,
    tegra_release: str | Path | None = TEGRA_RELEASE,
    psutil_mod: Any = None,
    cuda: Any = None,
    machine: Any = platform.machine,
) -> Facts:
    """Read the machine.

    Args:
        device_tree_model, tegra_release: file paths (None = not present).
        psutil_mod: the ``psutil`` module or a stand-in (tests).
        cuda: ``torch.cuda`` or a stand-in with ``is_available``, ``device_count``,
            ``get_device_properties(i)`` (``.name``, ``.total_memory`` in bytes).
        machine: returns the CPU architecture string.
    """
    if psutil_mod is None:
        import psutil

        psutil_mod = psutil
    has_torch, devices = cuda_devices(cuda)
    battery, temps, load = sensor_readings(psutil_mod)
    tegra = _read_text(tegra_release)
    return Facts(
        arch=str(machine()).lower(),
        cpu_count=int(psutil_mod.cpu_count() or 1),
        memory_mb=int(psutil_mod.virtual_memory().total) // MIB,
        cuda=devices,
        torch=has_torch,
        device_tree_model=_read_text(device_tree_model) or None,
        tegra_release=tegra.splitlines()[0] if tegra else None,
        battery=battery,
        temperatures=temps,
        load_per_core=load,
    )


@dataclasses.dataclass
class Match:
    """How one profile fares against the facts.

    Attributes:
        profile: the profile.
        matched: every criterion holds (and the profile takes part in detection).
        score: number of criteria checked (specificity).
        reasons: one line per criterion, ``"ok: ..."`` or ``"no: ..."``.
    """

    profile: DeviceProfile
    matched: bool
    score: int
    reasons: list[str]


def _tegra_field(release: str | None) -> str:
    # "# R32 (release), REVISION: 7.1, ..." -> "R32"
    text = (release or "").lstrip("#").strip()
    return text.split()[0] if text else ""


def match_profile(profile: DeviceProfile, facts: Facts) -> Match:
    """Check ``profile``'s ``[match]`` criteria against ``facts``."""
    m = profile.match
    reasons: list[str] = []
    ok = True

    def crit(good: bool, text: str) -> None:
        nonlocal ok
        ok = ok and good
        reasons.append(("ok: " if good else "no: ") + text)

    if m.arch is not None:
        crit(facts.arch in [a.lower() for a in m.arch], f"CPU architecture {facts.arch} in {m.arch}")
    if m.device_tree_model is not None:
        dt = facts.device_tree_model
        hit = dt is not None and any(s in dt for s in m.device_tree_model)
        crit(hit, f"device-tree model {dt!r} contains one of {m.device_tree_model}")
    if m.tegra is not None:
        have = facts.tegra_release is not None
        crit(have == m.tegra, f"/etc/nv_tegra_release {'present' if have else 'absent'} (want "
                              f"{'present' if m.tegra else 'absent'})")
    if m.tegra_release is not None:
        rel = _tegra_field(facts.tegra_release)
        crit(any(rel.startswith(s) for s in m.tegra_release) if rel else False,
             f"L4T release {rel or 'none'} starts with one of {m.tegra_release}")
    if m.cuda is not None:
        n = len(facts.cuda)
        crit((n > 0) == m.cuda, f"{n} CUDA device(s) (want {'some' if m.cuda else 'none'})")
    if m.min_cuda_memory_mb is not None:
        best = max((d.memory_mb for d in facts.cuda), default=0)
        crit(best >= m.min_cuda_memory_mb, f"largest CUDA device {best} MiB >= {m.min_cuda_memory_mb} MiB")
    if m.min_memory_mb is not None:
        crit(facts.memory_mb >= m.min_memory_mb, f"memory {facts.memory_mb} MiB >= {m.min_memory_mb} MiB")
    if m.torch is not None:
        crit(facts.torch == m.torch, f"torch {'importable' if facts.torch else 'not importable'} (want "
                                     f"{'importable' if m.torch else 'absent'})")
    if not m.auto:
        ok = False
        reasons.append("no: detection disabled (match.auto = false): pin it by name")
    return Match(profile, ok, len(reasons), reasons)


@dataclasses.dataclass
class Detection:
    """Result of :func:`detect`: the chosen profile, the facts, every candidate."""

    profile: DeviceProfile
    facts: Facts
    candidates: list[Match]

    def explain(self) -> list[str]:
        """Human-readable lines: the choice, then every profile's criteria."""
        lines = [f"profile: {self.profile.name} ({self.profile.description})"]
        for c in self.candidates:
            mark = "*" if c.profile.name == self.profile.name else ("+" if c.matched else "-")
            lines.append(f"{mark} {c.profile.name} (score {c.score}, priority {c.profile.match.priority})")
            lines += [f"    {r}" for r in c.reasons]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.name,
            "facts": self.facts.to_dict(),
            "candidates": [
                {"profile": c.profile.name, "matched": c.matched, "score": c.score, "reasons": c.reasons}
                for c in self.candidates
            ],
        }


class NoProfileMatches(LookupError):
    """No profile's criteria hold for this machine."""


def detect(facts: Facts | None = None, profiles: Sequence[DeviceProfile] | None = None) -> Detection:
    """Pick the most specific matching profile (most criteria, then ``priority``, then name).

    Raises:
        NoProfileMatches: none matches (the message lists why each failed).
    """
    facts = facts if facts is not None else collect_facts()
    profiles = list(profiles) if profiles is not None else list_profiles()
    cands = [match_profile(p, facts) for p in profiles]
    ok = [c for c in cands if c.matched]
    if not ok:
        why = "; ".join(f"{c.profile.name}: {', '.join(r for r in c.reasons if r.startswith('no'))}" for c in cands)
        raise NoProfileMatches(f"no device profile matches this machine ({why})")
    best = max(ok, key=lambda c: (c.score, c.profile.match.priority, c.profile.name))
    cands.sort(key=lambda c: (not c.matched, -c.score, c.profile.name))
    return Detection(best.profile, facts, cands)
