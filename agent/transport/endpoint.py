"""Broker endpoints: ``host:port`` with a non-empty host (name or IP address) and
``1 <= port <= 65535``; an IPv6 address in brackets (``[fd00::1]:1883``).

The one parser every user of a broker address calls: the MQTT connection pool, static peer
lists, mDNS records, the configuration check and the command line.
"""

from __future__ import annotations

import ipaddress
import re

_HOST_RE = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*\.?$")
_PORT_RE = re.compile(r"^[0-9]{1,5}$")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split and validate a broker endpoint ``"host:port"`` (IPv6 as ``"[addr]:port"``).

    Returns:
        ``(host, port)``; an IPv6 host is returned without brackets.
    Raises:
        ValueError: not a string, empty host, malformed host, or port outside 1..65535.
    """
    if not isinstance(endpoint, str):
        raise ValueError(f"broker endpoint must be a string, got {type(endpoint).__name__}")
    if endpoint.startswith("["):
        host, sep, port_s = endpoint[1:].partition("]:")
        if not sep:
            raise ValueError(f"broker endpoint {endpoint!r}: expected '[ipv6]:port'")
        try:
            if ipaddress.ip_address(host).version != 6:
                raise ValueError
        except ValueError:
            raise ValueError(f"broker endpoint {endpoint!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_s = endpoint.rpartition(":")
        if not sep:
            raise ValueError(f"broker endpoint {endpoint!r}: expected 'host:port'")
        if not host:
            raise ValueError(f"broker endpoint {endpoint!r}: empty host")
        if not _HOST_RE.match(host) or len(host) > 253:
            raise ValueError(f"broker endpoint {endpoint!r}: invalid host {host!r}")
    if not _PORT_RE.match(port_s) or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"broker endpoint {endpoint!r}: port must be an integer in 1..65535")
    return host, int(port_s)


def valid_endpoint(endpoint: str) -> bool:
    """True when :func:`parse_endpoint` accepts ``endpoint``."""
    try:
        parse_endpoint(endpoint)
    except ValueError:
        return False
    return True
