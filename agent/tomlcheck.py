"""Typed reading of parsed TOML tables into dataclasses: the one type checker.

Both the node configuration (:mod:`dfl_agent.runtime.config`) and the device profiles
(:mod:`dfl_agent.profiles.schema`) describe their files as nested dataclasses and read a
parsed TOML table into them with :func:`build`.  Every error is one line that starts with
the dotted key (``mqtt.chunk_size: expected int, got 'big'``); the caller chooses the
exception class, so a configuration raises ``ConfigError`` and a profile ``ProfileError``.

Supported field types: ``bool``, ``int``, ``float`` (an integer is accepted and
converted), ``str``, ``X | None``, ``list[X]``, ``dict[str, X]`` (a table, values not
checked), ``Any`` and nested dataclasses (TOML tables).  ``bool`` is never accepted
where a number is expected.  Only the standard library is imported.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, Union

T = TypeVar("T")


def check_value(value: Any, typ: Any, key: str, error: type[Exception] = ValueError,
                sort_known: bool = False) -> Any:
    """``value`` checked against the type annotation ``typ``, converted where TOML is looser.

    Args:
        value: a value from a parsed TOML table.
        typ: the field's resolved type annotation.
        key: the dotted key named in an error message.
        error: exception class raised on a mismatch (called with the one-line message).
        sort_known: list the known keys of nested tables alphabetically (else in field order).

    Returns:
        the value (an int widened to float for ``float`` fields, tables built into dataclasses).

    Raises:
        error: ``"<key>: expected int, got 'x'"``, ``"<key>: must be a table"``, ...
    """
    origin = typing.get_origin(typ)
    if origin in (Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return check_value(value, inner[0], key, error, sort_known)
    if isinstance(typ, type) and dataclasses.is_dataclass(typ):
        if not isinstance(value, Mapping):
            raise error(f"{key}: must be a table")
        return build(typ, value, key, error=error, sort_known=sort_known)
    if origin is list:
        if not isinstance(value, list):
            raise error(f"{key}: must be a list, got {value!r}")
        (item,) = typing.get_args(typ)
        return [check_value(v, item, f"{key}[{i}]", error, sort_known) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise error(f"{key}: must be a table, got {value!r}")
        return dict(value)
    if typ is Any:
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
        raise error(f"{key}: expected {typ.__name__}, got {value!r}")
    return value


def build(cls: type[T], raw: Mapping[str, Any], prefix: str = "", *, error: type[Exception] = ValueError,
          sort_known: bool = False) -> T:
    """An instance of the dataclass ``cls`` from the parsed table ``raw``; missing keys take defaults.

    Args:
        cls: a dataclass whose fields carry resolvable type annotations.
        raw: the parsed TOML table.
        prefix: dotted key of ``raw`` itself ("" at the top level).
        error: exception class raised (see :func:`check_value`).
        sort_known: list known keys alphabetically in the unknown-key message.

    Raises:
        error: ``"<prefix>.<key>: unknown key (known: a, b, c)"`` or a type mismatch.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for k in raw:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else k
            known = sorted(names) if sort_known else names
            raise error(f"{where}: unknown key (known: {', '.join(known)})")
    kwargs = {k: check_value(v, hints[k], f"{prefix}.{k}" if prefix else k, error, sort_known)
              for k, v in raw.items()}
    return cls(**kwargs)
