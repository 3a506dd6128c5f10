"""Output helpers shared by every command of ``dflctl`` and ``dfl-infer``.

- :func:`json_doc`: every JSON document a command prints goes through it, so that each
  carries ``"schema_version": 1`` (bumped when a document's fields change incompatibly).
- :func:`console`: a rich Console that does not wrap or truncate lines when stdout is not
  a terminal (pipes, files, CI logs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: version of the JSON documents the command line prints
SCHEMA_VERSION = 1


def with_schema(obj: Any, key: str = "items") -> dict[str, Any]:
    """``obj`` as a JSON object carrying ``schema_version`` first.

    A mapping keeps its keys (``schema_version`` is put first, overriding any of the same
    name); a list or scalar is wrapped as ``{"schema_version": 1, key: obj}``.
    """
    if isinstance(obj, dict):
        return {"schema_version": SCHEMA_VERSION, **{k: v for k, v in obj.items() if k != "schema_version"}}
    return {"schema_version": SCHEMA_VERSION, key: obj}


def json_doc(obj: Any, *, key: str = "items", indent: int | None = 2, sort_keys: bool = False,
             default: Any = str) -> str:
    """The JSON text of ``obj`` with ``schema_version`` (see :func:`with_schema`; a list is
    wrapped under ``key``). Values JSON cannot encode are written with ``default`` (``str``:
    paths, enums)."""
    return json.dumps(with_schema(obj, key), indent=indent, sort_keys=sort_keys, default=default)


def console(file: Any = None) -> Any:
    """A ``rich.console.Console`` for tables and progress.

    On a terminal it takes the terminal's width; otherwise (stdout a pipe or a file) it
    never wraps or truncates: the width is unlimited in practice (100000 columns) and the
    output carries no colour codes."""
    from rich.console import Console

    out = sys.stdout if file is None else file
    if hasattr(out, "isatty") and out.isatty():
        return Console(file=out)
    return Console(file=out, width=100_000, no_color=True, highlight=False, soft_wrap=True)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse help that shows each option's default (when it has a meaningful one).

    Like ``ArgumentDefaultsHelpFormatter``, but leaves out ``None``/``False`` defaults
    and help texts that already name their default, and keeps descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower():
            return text
        if action.nargs == 0 or action.default in (None, False, argparse.SUPPRESS) or action.default == []:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text


def apply_formatter(parser: argparse.ArgumentParser, cls: type = HelpFormatter) -> None:
    """Set ``formatter_class`` on ``parser`` and every sub-parser under it (argparse does not
    pass it on to sub-parsers)."""
    parser.formatter_class = cls
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                apply_formatter(child, cls)
