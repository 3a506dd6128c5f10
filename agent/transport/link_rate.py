"""Timeouts that follow the link: MQTT chunk size, keepalive and round deadline from a link rate.

The transport's fixed defaults (256 KiB chunks, a 10 s keepalive, 30 s round deadlines)
assume a fast local network.  On a slow link one chunk can take longer than the MQTT
client waits for an answer: nothing comes back while a chunk is written, so after one
keepalive paho sends a PINGREQ (queued behind the chunk) and after a second it closes the
connection ("Keep alive timeout"; the broker itself gives up after 1.5 x keepalive of
silence from a client).  The QoS 1 chunk is sent again from its start after the
reconnection and is cut again: no model ever arrives.  With the fixed defaults that
happens below about 105 kbit/s (256 KiB in 20 s).  ``mqtt.link_rate`` names the device's
slowest link (bits per second) and :func:`derive` turns it into defaults a field
engineer can check by hand:

1. **chunk size**: the bytes the link carries in :data:`CHUNK_SECONDS` (2 s), between
   :data:`MIN_CHUNK` (16 KiB) and the fast default :data:`FAST_CHUNK` (256 KiB);
2. **keepalive**: at least :data:`KEEPALIVE_CHUNKS` (4) times the time one chunk takes,
   never under the fast default :data:`FAST_KEEPALIVE` (10 s), so the client's limit
   (2 x keepalive) is eight chunk times or more and the broker's (1.5 x) six;
3. **reassembly timeout** (no new chunk of a transfer for this long: dropped) and
   **connect timeout**: at least 3 x and 1 x the keepalive;
4. **waits for models** (:data:`MODEL_WAITS`: the round deadline ``round_timeout``, a
   pair's ``receive_timeout``, a rotating round's ``invite_timeout``, ``update_timeout``
   and ``token_timeout``, a lock-step ``sync_timeout`` of 10 s or more): the default
   plus :data:`EXCHANGE_MARGIN` (2) times one model exchange with every neighbour at
   that rate, ``model bytes x neighbours x 8 / rate`` (the uncompressed float32 model:
   the bound of a whole-model message); the default itself stays the allowance for
   training;
5. **heartbeat timeout** (``discovery.heartbeat_timeout``): at least twice that exchange,
   since a peer's heartbeat waits at the broker behind the model chunks sent to this node.

Explicit settings always win: a configured ``mqtt.chunk_size``, ``mqtt.keepalive`` or
``algorithm.options`` wait is used as written; ``discovery.heartbeat_timeout`` is only raised.
Without a link rate every default is the fast one.

QoS 1 redelivery: paho (2.x) and mosquitto resend an unacknowledged QoS 1 message only
when the session reconnects, never on a timer, so there is no retry interval to widen:
keeping the connection up through a chunk (rules 1 and 2) is what keeps redelivery from
starting over.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

#: the fast-network defaults (bytes, seconds): what a node uses without ``mqtt.link_rate``
FAST_CHUNK = 256 * 1024
FAST_KEEPALIVE = 10
FAST_REASSEMBLY_TIMEOUT = 30.0
FAST_CONNECT_TIMEOUT = 10.0
#: seconds of link time one chunk is sized for
CHUNK_SECONDS = 2.0
#: smallest derived chunk (bytes): below, the chunk header and per-message overhead dominate
MIN_CHUNK = 16 * 1024
#: the keepalive covers at least this many chunk times
KEEPALIVE_CHUNKS = 4
#: a round deadline covers this many model exchanges with every neighbour
EXCHANGE_MARGIN = 2.0

#: the algorithm options that wait for models (seconds), widened with the exchange time
MODEL_WAITS = ("round_timeout", "receive_timeout", "invite_timeout", "update_timeout", "token_timeout",
               "sync_timeout")
#: a ``sync_timeout`` below this is a short market wait (the gossip algorithms' 2 s), not a model exchange
_SHORT_WAIT = 10.0

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(?:bit|bps|b)?(?:/s)?\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(value: str | int | float) -> float | None:
    """Bits per second of ``value``: a number (bits/s) or ``"500kbit"``, ``"0.5mbit"``,
    ``"2Mbit/s"``, ``"1gbit"`` (``tc``'s spelling; k = 1000); ``""`` or ``0``: None (no rate:
    the fast defaults).

    Raises:
        ValueError: anything else, or a negative rate.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a link rate: {value!r}")
    if isinstance(value, (int, float)):
        rate = float(value)
    else:
        if not value.strip():
            return None
        m = _RATE_RE.match(value)
        if m is None:
            raise ValueError(f"not a link rate: {value!r} (e.g. '500kbit', '0.5mbit', or bits per second)")
        rate = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if rate < 0 or not math.isfinite(rate):
        raise ValueError(f"a link rate must be >= 0 bits/s, got {value!r}")
    return rate or None


@dataclasses.dataclass(frozen=True)
class LinkTimings:
    """The transport settings for one link rate (see the module docstring).

    Attributes:
        rate_bps: the link rate (bits/s), None for the fast defaults.
        chunk_size: largest MQTT payload sent (bytes).
        keepalive: MQTT keepalive (s).
        reassembly_timeout: an incomplete chunked transfer with no new chunk for this
            long is dropped (s).
        connect_timeout: how long start-up waits for the broker (s).
        chunk_seconds: time one chunk takes on the link (s; 0 without a rate).
    """

    rate_bps: float | None
    chunk_size: int
    keepalive: int
    reassembly_timeout: float
    connect_timeout: float
    chunk_seconds: float

    def transport_args(self) -> dict[str, float | int]:
        """Keyword arguments of :class:`~dfl_agent.transport.mqtt.MqttTransport`."""
        return {"chunk_size": self.chunk_size, "keepalive": self.keepalive,
                "reassembly_timeout": self.reassembly_timeout, "connect_timeout": self.connect_timeout}

    def exchange_seconds(self, model_bytes: int, neighbours: int) -> float:
        """Seconds to move ``model_bytes`` to (or from) each of ``neighbours`` peers at the
        rate (0 without a rate): ``model_bytes x neighbours x 8 / rate``."""
        if self.rate_bps is None:
            return 0.0
        return model_bytes * max(1, neighbours) * 8 / self.rate_bps

    def round_timeout(self, default: float, model_bytes: int, neighbours: int) -> float:
        """A round deadline, or any wait for models (s): ``default`` (the training
        allowance) plus :data:`EXCHANGE_MARGIN` model exchanges with every neighbour."""
        return default + EXCHANGE_MARGIN * self.exchange_seconds(model_bytes, neighbours)

    def heartbeat_timeout(self, default: float, model_bytes: int, neighbours: int) -> float:
        """A peer's silence limit (s): ``default``, or twice a model exchange if longer."""
        return max(default, 2 * self.exchange_seconds(model_bytes, neighbours))


def model_waits(options: Any) -> dict[str, float]:
    """The options among :data:`MODEL_WAITS` that ``options`` (an algorithm's options
    dataclass) has, with their values (s); a ``sync_timeout`` under 10 s is left out."""
    out = {}
    for key in MODEL_WAITS:
        value = getattr(options, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if key != "sync_timeout" or value >= _SHORT_WAIT:
                out[key] = float(value)
    return out


def derive(rate: str | int | float | None, *, chunk_size: int | None = None,
           keepalive: int | None = None) -> LinkTimings:
    """The transport settings for link ``rate`` (see :func:`parse_rate`; None or ``""``: the
    fast defaults); an explicit ``chunk_size`` (bytes) or ``keepalive`` (s) is kept as given
    and the rest follows from it (a given chunk size sets the keepalive's floor).

    Raises:
        ValueError: an unreadable rate.
    """
    bps = parse_rate(rate) if rate is not None else None
    if bps is None:
        chunk = chunk_size or FAST_CHUNK
        ka = keepalive or FAST_KEEPALIVE
        return LinkTimings(None, chunk, ka, max(FAST_REASSEMBLY_TIMEOUT, 3.0 * ka),
                           max(FAST_CONNECT_TIMEOUT, float(ka)), 0.0)
    chunk = chunk_size or int(min(FAST_CHUNK, max(MIN_CHUNK, bps / 8 * CHUNK_SECONDS)))
    seconds = chunk * 8 / bps
    ka = keepalive or max(FAST_KEEPALIVE, math.ceil(KEEPALIVE_CHUNKS * seconds))
    return LinkTimings(bps, chunk, ka, max(FAST_REASSEMBLY_TIMEOUT, 3.0 * ka),
                       max(FAST_CONNECT_TIMEOUT, float(ka)), seconds)
