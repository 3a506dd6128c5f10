"""The one TOML type checker (dfl_agent.tomlcheck), shared by the configuration and the profiles."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dfl_agent.profiles import ProfileError, profile_from_dict
from dfl_agent.runtime.config import ConfigError, config_from_dict
from dfl_agent.tomlcheck import build

REPO = Path(__file__).resolve().parents[2]


class Bad(ValueError):
    pass


@dataclasses.dataclass
class Inner:
    rate: float = 1.0
    names: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Outer:
    count: int = 0
    flag: bool = False
    label: str | None = None
    table: dict[str, Any] = dataclasses.field(default_factory=dict)
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_build_converts_and_defaults():
    o = build(Outer, {"count": 3, "inner": {"rate": 2, "names": ["a"]}, "table": {"x": 1}}, error=Bad)
    assert o == Outer(count=3, inner=Inner(rate=2.0, names=["a"]), table={"x": 1})
    assert isinstance(o.inner.rate, float)


@pytest.mark.parametrize(("raw", "message"), [
    ({"count": "3"}, "count: expected int, got '3'"),
    ({"count": True}, "count: expected int, got True"),
    ({"flag": 1}, "flag: expected bool, got 1"),
    ({"inner": 5}, "inner: must be a table"),
    ({"inner": {"names": "a"}}, "inner.names: must be a list, got 'a'"),
    ({"inner": {"names": ["a", 2]}}, "inner.names[1]: expected str, got 2"),
    ({"inner": {"bogus": 1}}, "inner.bogus: unknown key (known: rate, names)"),
    ({"table": [1]}, "table: must be a table, got [1]"),
])
def test_errors_are_one_line_naming_the_key(raw, message):
    with pytest.raises(Bad) as info:
        build(Outer, raw, error=Bad)
    assert str(info.value) == message


def test_sorted_known_keys():
    with pytest.raises(Bad, match=r"^zz: unknown key \(known: count, flag, inner, label, table\)$"):
        build(Outer, {"zz": 1}, error=Bad, sort_known=True)


def test_config_and_profiles_use_the_shared_checker():
    with pytest.raises(ConfigError, match=r"^mqtt\.chunk_size: expected int, got 'big'$"):
        config_from_dict({"mqtt": {"chunk_size": "big"}})
    with pytest.raises(ProfileError, match=r"^training\.epochs: expected int, got 'x'$"):
        profile_from_dict({"name": "p", "training": {"epochs": "x"}})
    # no second copy of the checker: neither module inspects type annotations itself
    for rel in ("agent/runtime/config.py", "agent/profiles/schema.py"):
        text = (REPO / rel).read_text(encoding="utf-8")
        assert "get_type_hints" not in text and "get_origin" not in text, rel
