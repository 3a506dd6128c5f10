"""Wire versions: which ones this release speaks, what a node announced, and which one to write.

This release reads and writes every version in :data:`SPOKEN` (:data:`dfl_agent.WIRE_VERSIONS`,
oldest first): the newest version of the previous release and its own.  Agents announce the
versions they speak - the presence descriptor's and the status's ``wires`` (a list), the mDNS TXT
record's ``wires`` (``"5,6"``) - and an agent of 0.1.0 only its ``version`` (``"0.1.0/w5"``) and
TXT ``wire`` (``"5"``); :func:`versions_of` reads each.  A sender writes each frame in the highest
version its receivers all speak (:func:`negotiate`).  Adding a wire version is one more entry in
:data:`dfl_agent.WIRE_VERSIONS` (and the format change in :mod:`dfl_agent.transport.wire`).
Standard library only: the discovery and the torch-free service import it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from dfl_agent import WIRE_VERSIONS, __version__

#: the wire versions this release reads and writes, oldest first; the frame's version byte and
#: the envelope's ``"v"`` name one of them
SPOKEN: tuple[int, ...] = WIRE_VERSIONS
#: announced versions parsed at most (a longer list is cut)
MAX_ANNOUNCED_VERSIONS = 16
_VERSION_SUFFIX = re.compile(r"/w([0-9]{1,3})$")


def versions_of(announced: Any = None, version: Any = None) -> tuple[int, ...]:
    """The wire versions a node announced, ascending; ``()`` when it announced none (unknown).

    Args:
        announced: the node's ``wires``: a list of integers (presence descriptor, status) or a
            comma-separated string (mDNS TXT), or one integer or digit string (the TXT ``wire`` of
            an agent of 0.1.0); anything else counts as not announced.
        version: the node's ``version`` string, ``"PACKAGE/wN"`` (every release's presence
            descriptor): wire version ``N`` when ``announced`` says nothing usable.

    Never raises: an announcement is a hint received from the network.
    """
    items: list[Any]
    if isinstance(announced, str):
        items = announced.split(",")
    elif isinstance(announced, (list, tuple)):
        items = list(announced)
    elif isinstance(announced, int) and not isinstance(announced, bool):
        items = [announced]
    else:
        items = []
    out: set[int] = set()
    for item in items[:MAX_ANNOUNCED_VERSIONS]:
        if isinstance(item, str) and item.strip().isdigit() and len(item.strip()) <= 3:
            item = int(item.strip())
        if isinstance(item, int) and not isinstance(item, bool) and 0 < item < 128:
            out.add(item)
    if not out and isinstance(version, str):
        m = _VERSION_SUFFIX.search(version)
        if m:
            out.add(int(m.group(1)))
    return tuple(sorted(out))


def negotiate(receivers: Iterable[tuple[int, ...]]) -> int:
    """The wire version to write a frame in for ``receivers``: the highest version that every
    receiver and this release speak (:data:`SPOKEN`).

    Args:
        receivers: an iterable of each receiver's announced versions (:func:`versions_of`; the
            recipient alone for a message to one node, the live members for a broadcast).  A
            receiver that announced none (``()``: not described yet) is taken to speak only the
            oldest version of :data:`SPOKEN`, which every release since the previous one reads; a
            receiver that speaks none of :data:`SPOKEN` cannot read this node and is left out.

    Returns:
        the lowest of the receivers' highest common versions (for versions that are ranges, the
        highest version they all speak); the newest of :data:`SPOKEN` when there is no receiver.
    """
    spoken = SPOKEN
    best = spoken[-1]
    for announced in receivers:
        common = [v for v in announced if v in spoken] if announced else [spoken[0]]
        if common:
            best = min(best, max(common))
            if best == spoken[0]:
                break
    return best


def descriptor_versions() -> dict[str, Any]:
    """This node's versions as its presence descriptor carries them: ``version``
    (``"0.2.0/w5"``: the package and its newest wire version, as every release wrote it) and
    ``wires`` (every wire version it speaks)."""
    return {"version": f"{__version__}/w{SPOKEN[-1]}", "wires": list(SPOKEN)}


def status_versions() -> dict[str, Any]:
    """This node's versions as its statuses carry them (an always-on agent between runs publishes
    no presence): ``agent_version`` (the package) and ``wires``."""
    return {"agent_version": __version__, "wires": list(SPOKEN)}
