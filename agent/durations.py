"""Durations in configuration and run descriptors: one grammar for every setting.

A duration is a number of seconds (an int or float, or its text) or a number with one
unit: ``s`` (seconds), ``m`` (minutes), ``h`` (hours), ``d`` (days), ``w`` (weeks),
case-insensitive, spaces allowed around it: ``"90s"``, ``"15m"``, ``"6h"``, ``"1.5d"``,
``"2w"``.  Only the standard library is imported here.
"""

from __future__ import annotations

import re

#: seconds per unit
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")


def _seconds(text: str | float | int, examples: str) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = _DURATION.fullmatch(str(text).lower())
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. {examples})")
    return float(m.group(1)) * UNITS[m.group(2)]


def parse_duration(text: str | float | int) -> float:
    """Seconds in a positive duration (module docstring), e.g. a recurring run's period.

    Raises:
        ValueError: not a duration, or not > 0.
    """
    value = _seconds(text, "'90s', '15m', '6h', '2d'")
    if not value > 0:
        raise ValueError(f"duration must be > 0: {text!r}")
    return value


def parse_optional_duration(text: str | float | int | None) -> float | None:
    """Seconds in a duration that may be switched off, e.g. the sample store's maximum age:
    ``None``, ``""`` or ``"none"`` -> None; otherwise a duration >= 0 (module docstring).

    Raises:
        ValueError: any other text, or a negative number.
    """
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "none")):
        return None
    value = _seconds(text, "'30d', '12h', '90s' or 'none'")
    if value < 0:
        raise ValueError(f"duration must be >= 0: {text!r}")
    return value
