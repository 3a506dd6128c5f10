"""Static peer lists from configuration.

A static entry vouches for a peer for as long as the daemon runs (source
``"static"`` in the :class:`~dfl_agent.discovery.peers.PeerTable`).  Accepted forms::

    "node-b"                                  id only: its topics live on the default broker
    "node-b@192.168.1.20:1883"                id and the broker where its topics live
    "node-b@[fd00::1]:1883"                   IPv6 broker address in brackets
    {"id": "node-b", "broker": "host:1883",   dict form; broker, profile and algorithm
     "profile": "rpi4", "algorithm": "dfml"}  are optional

Ids follow :func:`dfl_agent.transport.wire.valid_id`; a broker endpoint is
``host:port`` with a non-empty host (name or IP address) and ``1 <= port <= 65535``.
"""

from __future__ import annotations

import re
from typing import Any

from dfl_agent.discovery.peers import PeerTable
from dfl_agent.transport.endpoint import parse_endpoint
from dfl_agent.transport.wire import valid_id

_DICT_KEYS = frozenset({"id", "broker", "profile", "algorithm"})
_TEXT_RE = re.compile(r"^[A-Za-z0-9_.:+\-]{0,64}$")


def parse_peer(entry: str | dict[str, Any]) -> dict[str, str]:
    """Validate one static peer entry (see the module docstring for the forms).

    Returns:
        ``{"node_id", "broker", "profile", "algorithm"}``, missing fields as ``""``.
    Raises:
        ValueError: invalid id, malformed endpoint, unknown dict key, wrong type;
            the message names the entry.
    """
    try:
        if isinstance(entry, str):
            node_id, sep, broker = entry.strip().partition("@")
            if sep and not broker:
                raise ValueError("empty broker endpoint after '@'")
            fields = {"node_id": node_id, "broker": broker, "profile": "", "algorithm": ""}
        elif isinstance(entry, dict):
            unknown = set(entry) - _DICT_KEYS
            if unknown:
                raise ValueError(f"unknown keys {sorted(map(str, unknown))} (allowed: {sorted(_DICT_KEYS)})")
            if "id" not in entry:
                raise ValueError("missing 'id'")
            fields = {"node_id": entry["id"]}
            for key in ("broker", "profile", "algorithm"):
                value = "" if entry.get(key) is None else entry[key]
                if not isinstance(value, str):
                    raise ValueError(f"{key!r} must be a string")
                fields[key] = value.strip()
            for key in ("profile", "algorithm"):
                if not _TEXT_RE.match(fields[key]):
                    raise ValueError(f"invalid {key} {fields[key]!r}")
        else:
            raise ValueError(f"expected a string or a table, got {type(entry).__name__}")
        if not valid_id(fields["node_id"]):
            raise ValueError(f"invalid node id {fields['node_id']!r} (allowed: [A-Za-z0-9_.-]{{1,64}})")
        if fields["broker"]:
            parse_endpoint(fields["broker"])
    except ValueError as exc:
        raise ValueError(f"static peer {entry!r}: {exc}") from None
    return fields


def load_static_peers(table: PeerTable, entries: list[str | dict[str, Any]], federation: str) -> list[str]:
    """Validate every entry, then vouch for each peer in ``table`` with source ``"static"``.

    Nothing is added unless every entry is valid.  An entry naming this node itself
    is accepted and skipped (one peer list can be shared by the whole federation).

    Returns:
        the ids added to the table, in entry order (this node's own id excluded).
    Raises:
        ValueError: an invalid entry, a duplicate id, or an invalid ``federation``.
    """
    if not valid_id(federation):
        raise ValueError(f"invalid federation id {federation!r}")
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"static peers must be a list, got {type(entries).__name__}")
    parsed = [parse_peer(e) for e in entries]
    seen: set[str] = set()
    for fields in parsed:
        if fields["node_id"] in seen:
            raise ValueError(f"static peer {fields['node_id']!r} is listed twice")
        seen.add(fields["node_id"])
    added: list[str] = []
    for fields in parsed:
        node_id = fields.pop("node_id")
        if table.upsert(node_id, "static", federation=federation, **fields) is not None:
            added.append(node_id)
    return added
