"""Typed reading of parsed TOML tables into dataclasses: the one type checker.

Both the node configuration (:mod:`dfl_agent.runtime.shared.config`) and the device profiles
(:mod:`dfl_agent.profiles.schema`) describe their files as nested dataclasses and read a
parsed TOML table into them with :func:`build`.  Every error is one line that starts with
the dotted key (``mqtt.chunk_size: expected int, got 'big'``); the caller chooses the
exception class, so a configuration raises ``ConfigError`` and a profile ``ProfileError``.

Supported field types: ``bool``, ``int``, ``float`` (an integer is accepted and
converted), ``str``, ``X | None``, ``list[X]``, ``dict[str, X]`` (a table, values not
checked), ``Any`` and nested dataclasses (TOML tables).  ``bool`` is never accepted
where a number is expected.  Only the standard library is imported.

:func:`read_toml` reads a TOML file bounded in size and nesting depth, and names the file and
the key of a file that is not UTF-8 or nests too deeply (:class:`TomlFileError`): Python's
``tomllib`` recurses once per level of inline arrays and tables, so a file of a few hundred
``[`` raises a :class:`RecursionError` (not a ``ValueError``) thousands of lines long.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")
#: the TOML syntax error :func:`read_toml` raises (``tomllib``'s; ``tomli``'s before Python 3.11)
TOMLDecodeError = tomllib.TOMLDecodeError

#: deepest nesting of tables and arrays a TOML file may have (its top-level table is depth 1; a
#: ``[[run]]`` entry is 3, its ``options = {...}`` 4): the bound of :mod:`dfl_agent.jsonbound`
MAX_DEPTH = 32
#: largest TOML file :func:`read_toml` reads, in bytes
MAX_BYTES = 1 << 20


class TomlFileError(ValueError):
    """A TOML file :func:`read_toml` refuses: ``"<path>: <key>: <reason>"`` (the key left out
    where none is known).

    Attributes:
        path: the file.
        key: the dotted key (``run[0].options``), else ``line N``, else None.
        reason: what is wrong, one line.
    """

    def __init__(self, path: str, key: str | None, reason: str):
        super().__init__(f"{path}: {key}: {reason}" if key else f"{path}: {reason}")
        self.path, self.key, self.reason = path, key, reason


def read_toml(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The parsed TOML file ``path``, bounded in size and nesting depth.

    Args:
        path: the file.
        max_bytes: its largest accepted size in bytes.
        max_depth: the deepest nesting of tables and arrays accepted (see :data:`MAX_DEPTH`).

    Returns:
        the document (a dict).

    Raises:
        OSError: the file cannot be read.
        TOMLDecodeError: a TOML syntax error.
        TomlFileError: larger than ``max_bytes``; not UTF-8 (the line and column, and the key
            whose value holds the byte); nested deeper than ``max_depth`` (the key).
    """
    name = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TomlFileError(name, None, f"larger than {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[:exc.start].decode("utf-8")
        line = before.count("\n") + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        _, key = _scan(before)
        raise TomlFileError(name, key or f"line {line}", f"not UTF-8 text: byte 0x{data[exc.start]:02x} "
                                                         f"at line {line}, column {col}") from None
    at, key = _scan(text, max_depth)
    if at is not None:  # found before parsing: tomllib would recurse once per level
        line = text.count("\n", 0, at) + 1
        raise TomlFileError(name, key or f"line {line}", f"nested deeper than {max_depth} levels (line {line})")
    doc = tomllib.loads(text)
    deep = _too_deep(doc, max_depth)
    if deep is not None:
        raise TomlFileError(name, deep, f"nested deeper than {max_depth} levels")
    return doc


_HEADER = re.compile(r"\[\[\s*([^\]]*?)\s*\]\]|\[\s*([^\]]*?)\s*\]")


def _skip_string(text: str, i: int) -> int:
    """The index after the TOML string that starts at ``text[i]`` (a quote); ``len(text)`` if
    it does not end."""
    q = text[i]
    if text.startswith(q * 3, i):
        end = text.find(q * 3, i + 3) if q == "'" else _basic_end(text, i + 3, q * 3)
        if end < 0:
            return len(text)
        end += 3
        while end < len(text) and text[end] == q and end - i < 8:  # up to two quotes before the closing three
            end += 1
        return end
    end = text.find(q, i + 1) if q == "'" else _basic_end(text, i + 1, q)
    return len(text) if end < 0 else end + 1


def _basic_end(text: str, i: int, close: str) -> int:
    """Where ``close`` ends a basic string whose content starts at ``i`` (escapes skipped); -1: never."""
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text.startswith(close, i):
            return i
        else:
            i += 1
    return -1


def _scan(text: str, max_depth: int | None = None) -> tuple[int | None, str | None]:
    """Scan TOML ``text`` without parsing it (and without recursion).

    Returns:
        (the offset where inline arrays and tables nest deeper than ``max_depth``, else None;
        the dotted key whose value the scan is in there, or at the end of ``text``: None
        outside a value). Keys are named as written, an array of tables by its index
        (``run[1].options``).
    """
    header, key, key_start, in_value, depth = "", None, 0, False, 0
    tables: dict[str, int] = {}
    i, n, line_start = 0, len(text), True
    while i < n:
        c = text[i]
        if c == "\n":
            line_start, i = True, i + 1
            in_value = in_value and depth > 0
            continue
        if c in " \t\r":
            i += 1
            continue
        if c == "#":  # a comment: to the end of the line
            end = text.find("\n", i)
            if end < 0:
                return None, None
            i = end
            continue
        if line_start and depth == 0:
            line_start, in_value, key_start = False, False, i
            if c == "[":  # a table header: [name] or [[name]] (the next entry of an array of tables)
                end = text.find("\n", i)
                end = n if end < 0 else end
                m = _HEADER.match(text, i, end)
                if m and m.group(1) is not None:
                    tables[m.group(1)] = tables.get(m.group(1), -1) + 1
                    header = f"{m.group(1)}[{tables[m.group(1)]}]"
                elif m:
                    header = m.group(2)
                key, i = None, end
                continue
        line_start = False
        if c in "\"'":
            i = _skip_string(text, i)
            continue
        if depth == 0 and not in_value:
            if c == "=":
                k = text[key_start:i].strip()
                key, in_value = f"{header}.{k}" if header else k, True
        elif c in "[{":
            depth += 1
            if max_depth is not None and depth > max_depth:
                return i, key
        elif c in "]}":
            depth = max(0, depth - 1)
        i += 1
    return None, key if in_value else None


def _too_deep(doc: Any, max_depth: int) -> str | None:
    """The dotted key whose value nests deeper than ``max_depth`` (the top-level table is
    depth 1; the arrays within the value are not named), found without recursion; None: no
    value does."""
    stack: list[tuple[Any, str, int]] = [(doc, "", 1)]
    while stack:
        value, key, depth = stack.pop()
        if depth > max_depth:
            return re.sub(r"(\[\d+\])+$", "", key) or key
        if isinstance(value, Mapping):
            stack.extend((v, f"{key}.{k}" if key else str(k), depth + 1) for k, v in value.items()
                         if isinstance(v, (Mapping, list)))
        elif isinstance(value, list):
            stack.extend((v, f"{key}[{j}]", depth + 1) for j, v in enumerate(value) if isinstance(v, (Mapping, list)))
    return None


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
