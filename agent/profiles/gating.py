"""Resource gating: train only when the device allows it.

A node trains while all of these hold (thresholds from the profile's ``[limits]``
and ``training.windows``):

- on external power, or battery charge >= ``min_battery_percent``;
- every temperature sensor below ``max_temperature_c``;
- 1-minute load average per core below ``max_load_per_core``;
- local time inside one of ``training.windows`` (none = always).

Sensors are read through a ``psutil``-like object (``sensors_battery``,
``sensors_temperatures``, ``getloadavg``, ``cpu_count``), injectable so tests fake
the readings at the psutil boundary only.  A missing sensor (no battery, no thermal
zone) never gates.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

from dfl_agent.profiles.detect import sensor_readings
from dfl_agent.profiles.schema import LimitsSection


def _minutes(hhmm: str) -> int:
    h, m = hhmm.split(":")
    return int(h) * 60 + int(m)


def in_windows(windows: Sequence[str], now: datetime.datetime) -> bool:
    """Whether local time ``now`` lies in one of ``"HH:MM-HH:MM"`` ``windows`` (start
    inclusive, end exclusive; a window whose end is before its start wraps midnight).
    An empty list allows every time."""
    if not windows:
        return True
    t = now.hour * 60 + now.minute
    spans = ((_minutes(x) for x in w.split("-")) for w in windows)
    return any((a <= t < b) if a <= b else (t >= a or t < b) for a, b in spans)


class ResourceGate:
    """Decides whether the node may train now.

    Args:
        limits: the profile's ``[limits]``.
        windows: the profile's ``training.windows``.
        psutil_mod: ``psutil`` or a stand-in (tests).
        now: returns the local time (``datetime.datetime.now`` by default).
    """

    def __init__(self, limits: LimitsSection, windows: Sequence[str] = (), *, psutil_mod: Any = None,
                 now: Callable[[], datetime.datetime] = datetime.datetime.now):
        if psutil_mod is None:
            import psutil

            psutil_mod = psutil
        self.limits = limits
        self.windows = list(windows)
        self.psutil = psutil_mod
        self.now = now

    @property
    def poll_interval(self) -> float:
        """Seconds between re-checks while gated."""
        return self.limits.poll_interval_s

    def check(self) -> str | None:
        """None when training is allowed, else the reason (one line, for status and logs)."""
        lim = self.limits
        battery, temps, load = sensor_readings(self.psutil)
        if lim.min_battery_percent > 0 and battery is not None and not battery["plugged"]:
            if battery["percent"] < lim.min_battery_percent:
                return (f"battery {battery['percent']:.0f}% < {lim.min_battery_percent:.0f}% "
                        "and not on external power")
        if lim.max_temperature_c > 0 and temps:
            name, hottest = max(temps.items(), key=lambda kv: kv[1])
            if hottest >= lim.max_temperature_c:
                return f"temperature {hottest:.1f}°C ({name}) >= {lim.max_temperature_c:.1f}°C"
        if lim.max_load_per_core > 0 and load is not None and load >= lim.max_load_per_core:
            return f"load {load:.2f} per core >= {lim.max_load_per_core:.2f}"
        if not in_windows(self.windows, self.now()):
            return f"outside training windows {', '.join(self.windows)} (local time {self.now():%H:%M})"
        return None

    __call__ = check
