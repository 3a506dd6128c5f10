"""The live peer table that every discovery source feeds.

A peer is *live* while at least one source vouches for it: a static entry, an mDNS
record that has not said goodbye, or an MQTT presence "online"; and it has not been
declared offline by MQTT presence (clean stop or last will: a crashed peer sends no
mDNS goodbye, and its records linger in caches for minutes); and, when a heartbeat
timeout is set, it was heard from within that timeout.

The table logs each departure once, when the last source withdraws, at the level of what
happened (:data:`DEPARTURES`: the presence tells the table how a peer went offline,
:meth:`PeerTable.note_departure`, before it withdraws):

* a clean leave: INFO ``peer B left (goodbye)`` (its signed goodbye), ``peer B left
  (mdns withdrawn)`` (an mDNS goodbye, when no other source vouches for it);
* the end of the peer's run (a goodbye after its last round): DEBUG only - the peer did
  not leave the federation;
* its last will (the broker saw its connection die: crashed, or cut off): WARNING;
* a peer whose liveness expired (no sign of life for ``heartbeat_timeout``) at WARNING
  when the table next finds it expired (every query of :meth:`PeerTable.live_peers`,
  several times a round).

A peer that comes back is logged once more (``peer B is back``: INFO, DEBUG after the end of
its run).

Brokers learnt from mDNS: an mDNS record is unsigned, so the broker its TXT record names
becomes a peer's broker (where this node sends its frames, and which the transport connects
to) only when it is a trusted broker (:meth:`PeerTable.broker_trusted`): this node's own
(:attr:`PeerTable.home_broker`, ``mqtt.broker``), one a static peer names (configuration),
or one named in a presence signed by an enrolled member (:meth:`PeerTable.trust_broker`).
Any other is ignored, logged once per peer and broker, and counted in :attr:`PeerTable.dropped`
as ``mdns_broker_untrusted`` (the node's status ``errors``); the record still vouches for
the peer, as every mDNS record does (a hint: with signatures required only a trusted key makes
a member).  Nor does an mDNS record change what a presence said of a peer (its algorithm,
model hash, roles, compression, broker): it adds only its address.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dfl_agent.transport.versions import versions_of

SOURCES = ("static", "mdns", "presence")
#: how a peer was found (:meth:`PeerTable.found_via`): a source, or ``bridged-presence``, a
#: presence that crossed a bridge from a peer on another site's broker
#: (:class:`~dfl_agent.discovery.bridged.HomeRoutedPeerTable`)
FOUND_VIA = (*SOURCES, "bridged-presence")

#: how a peer's presence went offline (:meth:`PeerTable.note_departure`) -> the log level and
#: the words of its departure line: ``goodbye`` its verified goodbye, ``run_end`` a goodbye
#: that ends its run (its status said its rounds were finished, or the goodbye names the
#: run's end as its reason), ``will`` its last will, ``cleared`` its retained
#: presence was removed
DEPARTURES: dict[str, tuple[int, str]] = {
    "goodbye": (logging.INFO, "left (goodbye)"),
    "run_end": (logging.DEBUG, "ended its run"),
    "will": (logging.WARNING, "lost its connection (its last will: crashed or cut off)"),
    "cleared": (logging.INFO, "left (presence cleared)"),
}

log = logging.getLogger("dfl_agent.peers")


@dataclasses.dataclass(slots=True)
class PeerInfo:
    """What is known about one peer.

    Attributes:
        node_id: the peer's id.
        federation: federation id it belongs to.
        broker: ``"host:port"`` of the MQTT broker where its topics live ("" = unknown,
            use the default broker).
        profile, algorithm, model_hash, version: advertised descriptor fields (``version``:
            ``"PACKAGE/wN"``, its release and newest wire version).
        wires: the wire versions it announced it speaks, ascending (descriptor or TXT ``wires``;
            ``()``: none announced, see :meth:`wire_versions`).
        address: network address it was seen at (mDNS), informational.
        sources: which sources currently vouch for it (an immutable set: one shared
            object per combination, so that a thousand-node table stays small).
        last_seen: ``time.monotonic()`` of the last sign of life.
    """

    node_id: str
    federation: str = ""
    broker: str = ""
    profile: str = ""
    algorithm: str = ""
    model_hash: str = ""
    version: str = ""
    address: str = ""
    sources: frozenset[str] = frozenset()
    last_seen: float = 0.0
    offline: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    wires: tuple[int, ...] = ()

    def wire_versions(self) -> tuple[int, ...]:
        """The wire versions this peer speaks, ascending: those it announced (``wires``), else the
        one its ``version`` names (``"0.1.0/w5"``: an agent of 0.1.0), else ``()`` (unknown)."""
        return self.wires or versions_of(None, self.version)

    def descriptor(self) -> dict[str, Any]:
        """JSON-friendly view (for presence payloads, ``dflctl peers``)."""
        d = dataclasses.asdict(self)
        d["sources"] = sorted(self.sources)
        return d


Listener = Callable[[str, str, PeerInfo], None]  # (event: added|updated|removed, node_id, info)

_INTERNED: dict[frozenset[str], frozenset[str]] = {}


def _sources(sources: frozenset[str]) -> frozenset[str]:
    """The one shared frozenset equal to ``sources`` (there are at most 2**3 of them)."""
    return _INTERNED.setdefault(sources, sources)


_FIELDS = ("federation", "broker", "profile", "algorithm", "model_hash", "version", "address")


class PeerTable:
    """Thread-safe table of peers (self excluded), fed by discovery sources.

    Args:
        self_id: this node's id (never added).
        federation: only peers of this federation are accepted ("" accepts all).
        heartbeat_timeout: seconds without a sign of life (presence, heartbeat, any
            message, a discovery announcement) after which a peer counts as not live
            (``None`` = never).
        clock: monotonic time source (injectable for tests).
        record_findings: record how and when each peer was first found
            (:meth:`found_via`, :meth:`take_found`); False: nothing is recorded (the
            simulator, whose only source is its simulated presence at set-up), so the
            table holds nothing per peer beyond its entry.
    """

    def __init__(
        self,
        self_id: str,
        federation: str = "",
        heartbeat_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        home_broker: str = "",
        *,
        record_findings: bool = True,
    ):
        self.self_id = self_id
        #: ``host:port`` of this node's own broker (tells a bridged presence from a local one)
        self.home_broker = home_broker
        self.federation = federation
        self.heartbeat_timeout = heartbeat_timeout
        self._clock = clock
        self._peers: dict[str, PeerInfo] = {}
        self._lock = threading.RLock()
        self._listeners: list[Listener] = []
        #: bumped on every change that can alter :meth:`live_peers` (upsert, withdraw),
        #: so that callers may cache derived views while it stays the same
        self.changes = 0
        #: peers whose departure (leave or expiry) was logged; cleared when they come back
        self._gone: set[str] = set()
        #: those of them whose departure was logged below INFO (the end of their run)
        self._quiet: set[str] = set()
        #: how a known peer's presence went offline (a :data:`DEPARTURES` key), told by the
        #: presence before it withdraws the peer, read by that withdrawal
        self._departure: dict[str, str] = {}
        #: peers whose MQTT session broke (their last will came) while they stayed live:
        #: they may have missed messages (:meth:`note_session_lost`)
        self._session_lost: set[str] = set()
        #: peer -> {how (a FOUND_VIA word): (clock time, address) of its first finding that way}
        self._found: dict[str, dict[str, tuple[float, str]]] = {}
        #: (peer, how) found since :meth:`take_found` last ran
        self._found_new: list[tuple[str, str]] = []
        self.record_findings = record_findings
        #: dropped discovery input by reason (in the node's status ``errors``):
        #: ``mdns_broker_untrusted``, an mDNS record naming a broker that is not trusted
        self.dropped: collections.Counter[str] = collections.Counter()
        #: brokers that static peers or presences signed by enrolled members named
        self._trusted_brokers: set[str] = set()
        #: peer -> the untrusted broker its mDNS record named (ignored until it is trusted)
        self._mdns_broker: dict[str, str] = {}
        #: peers that a presence described (mDNS records no longer change their descriptor fields)
        self._described: set[str] = set()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event, node_id, info)`` on added/updated/removed."""
        self._listeners.append(listener)

    def _emit(self, event: str, info: PeerInfo) -> None:
        for listener in list(self._listeners):
            listener(event, info.node_id, info)

    def upsert(self, node_id: str, source: str, **fields: Any) -> PeerInfo | None:
        """Record that ``source`` vouches for ``node_id`` with descriptor ``fields``.

        Returns the updated entry, or ``None`` when ignored (self, other federation).
        Raises:
            ValueError: unknown ``source``.
        """
        if source not in SOURCES:
            raise ValueError(f"unknown discovery source {source!r}")
        fed = fields.get("federation", "")
        if node_id == self.self_id or (self.federation and fed and fed != self.federation):
            return None
        broker = str(fields.get("broker") or "")
        untrusted = False
        with self._lock:
            if source == "static" and broker:
                self._trusted_brokers.add(broker)  # configuration
            elif source == "mdns":
                if broker and not self.broker_trusted(broker):
                    fields = {k: v for k, v in fields.items() if k != "broker"}
                    self.dropped["mdns_broker_untrusted"] += 1
                    untrusted = self._mdns_broker.get(node_id) != broker  # logged once per peer and broker
                    self._mdns_broker[node_id] = broker
                else:
                    self._mdns_broker.pop(node_id, None)
            info = self._peers.get(node_id)
            was_live = info is not None and self._is_live(info)
            if info is None:
                info = PeerInfo(node_id=node_id)
                self._peers[node_id] = info
            # a peer that a presence (signed where signatures are required) described keeps that
            # description: an mDNS record adds its address and its vouching only
            keep = source == "mdns" and node_id in self._described
            for key, value in fields.items():
                if keep and key != "address":
                    continue
                if key == "wires":  # a list (presence) or "5,6" (mDNS): parsed once, here
                    info.wires = versions_of(value) or info.wires
                elif key in _FIELDS and value:
                    setattr(info, key, str(value))
                elif key not in _FIELDS and value is not None:
                    info.extra[key] = value
            if source == "presence":
                self._described.add(node_id)
                info.offline = False
            info.sources = _sources(info.sources | {source})
            info.last_seen = self._clock()
            if self.record_findings:
                how = self.found_how(source, info)
                found = self._found.setdefault(node_id, {})
                if how not in found:
                    found[how] = (info.last_seen, str(fields.get("address") or ""))
                    self._found_new.append((node_id, how))
            self.changes += 1
            back = self._back(info)
        if untrusted:
            log.warning("%s: ignored broker %s named by the mDNS record of %s: neither mqtt.broker, a static "
                        "peer's nor in a presence signed by an enrolled member (mdns_broker_untrusted)",
                        self.self_id, broker, node_id)
        if back is not None:
            log.log(back, "%s: peer %s is back", self.self_id, node_id)
        self._emit("updated" if was_live else "added", info)
        return info

    def broker_trusted(self, endpoint: str) -> bool:
        """Whether a broker (``"host:port"``) that an mDNS record names may be used: this
        node's own (:attr:`home_broker`), or one that a static peer or a presence signed by
        an enrolled member named (:meth:`trust_broker`).  Spellings are compared as they are
        (``localhost:1883`` is not ``127.0.0.1:1883``)."""
        with self._lock:
            return bool(endpoint) and (endpoint == self.home_broker or endpoint in self._trusted_brokers)

    def trust_broker(self, endpoint: str) -> None:
        """A presence signed by an enrolled member named broker ``endpoint``: mDNS records may
        name it from now on, and the peers whose record named it before, with no broker of
        their own yet, get it (an ``updated`` event each: the transport connects to it)."""
        if not endpoint:
            return
        with self._lock:
            if endpoint in self._trusted_brokers:
                return
            self._trusted_brokers.add(endpoint)
            promoted = []
            for node_id, named in list(self._mdns_broker.items()):
                if named != endpoint:
                    continue
                del self._mdns_broker[node_id]
                info = self._peers.get(node_id)
                if info is not None and not info.broker:
                    info.broker = endpoint
                    self.changes += 1
                    promoted.append(info)
        for info in promoted:
            self._emit("updated", info)

    def found_how(self, source: str, info: PeerInfo) -> str:
        """The :data:`FOUND_VIA` word for ``source`` vouching for ``info`` (here: the source)."""
        return source

    def found_via(self) -> dict[str, str]:
        """How each peer was found first: peer -> a :data:`FOUND_VIA` word."""
        with self._lock:
            return {n: min(ways, key=lambda w: ways[w][0]) for n, ways in self._found.items()}

    def found_counts(self) -> dict[str, int]:
        """How many peers each way found first (``{"mdns": 2, "bridged-presence": 3}``)."""
        return dict(collections.Counter(self.found_via().values()))

    def take_found(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The findings since the last call: peer -> {how: {"t": clock time, "address": the
        address the source gave ("" if none)}}, each (peer, how) once in the table's life."""
        with self._lock:
            new, self._found_new = self._found_new, []
            out: dict[str, dict[str, dict[str, Any]]] = {}
            for n, how in new:
                t, address = self._found[n][how]
                out.setdefault(n, {})[how] = {"t": round(t, 3), "address": address}
            return out

    def touch(self, node_id: str) -> None:
        """Record a sign of life (heartbeat, any message) from a known peer."""
        with self._lock:
            info = self._peers.get(node_id)
            if info is None:
                return
            info.last_seen = self._clock()
            back = self._back(info)
        if back is not None:
            log.log(back, "%s: peer %s is back", self.self_id, node_id)

    def _back(self, info: PeerInfo) -> int | None:
        """The log level of "is back" when ``info``, logged as gone, is live again (then no
        longer counted gone): DEBUG after a departure logged at DEBUG, else INFO; None when
        it was not gone or is not live."""
        if info.node_id in self._gone and self._is_live(info):
            self._gone.discard(info.node_id)
            quiet = info.node_id in self._quiet
            self._quiet.discard(info.node_id)
            return logging.DEBUG if quiet else logging.INFO
        return None

    def note_departure(self, node_id: str, how: str) -> None:
        """How ``node_id``'s presence is going offline (a :data:`DEPARTURES` key): the
        presence withdrawal that follows is logged accordingly.  Ignored for unknown peers.

        Raises:
            ValueError: ``how`` is not a :data:`DEPARTURES` key.
        """
        if how not in DEPARTURES:
            raise ValueError(f"unknown departure {how!r}")
        with self._lock:
            if node_id in self._peers:
                self._departure[node_id] = how

    def note_session_lost(self, node_id: str) -> None:
        """``node_id``'s last will came while it is still live (with signatures required a
        will is only a hint): its MQTT session broke, so it may have missed messages sent
        meanwhile.  :meth:`take_session_lost` tells it once, at its next sign of life."""
        with self._lock:
            self._session_lost.add(node_id)

    def take_session_lost(self, node_id: str) -> bool:
        """Whether ``node_id``'s session broke since the last call (see :meth:`note_session_lost`)."""
        with self._lock:
            lost = node_id in self._session_lost
            self._session_lost.discard(node_id)
            return lost

    def is_live(self, node_id: str) -> bool:
        """Whether ``node_id`` is a live peer now (no departure is logged by this query)."""
        with self._lock:
            info = self._peers.get(node_id)
            return info is not None and self._is_live(info)

    def withdraw(self, node_id: str, source: str) -> None:
        """``source`` no longer vouches for ``node_id`` (goodbye, offline, last will)."""
        with self._lock:
            how = self._departure.pop(node_id, None) if source == "presence" else None
            info = self._peers.get(node_id)
            if info is None or source not in info.sources:
                return
            was_live = self._is_live(info)
            info.sources = _sources(info.sources - {source})
            if source == "presence":
                info.offline = True
            now_live = self._is_live(info)
            self.changes += 1
            if how is not None:
                level, words = DEPARTURES[how]
            else:
                level, words = logging.INFO, "left (offline)" if source == "presence" else f"left ({source} withdrawn)"
            if was_live and not now_live:
                self._gone.add(node_id)
                if level < logging.INFO:
                    self._quiet.add(node_id)
        if was_live and not now_live:
            log.log(level, "%s: peer %s %s", self.self_id, node_id, words)
            self._emit("removed", info)

    def _is_live(self, info: PeerInfo) -> bool:
        if not info.sources or info.offline:
            return False
        return self.heartbeat_timeout is None or self._clock() - info.last_seen <= self.heartbeat_timeout

    def get(self, node_id: str) -> PeerInfo | None:
        with self._lock:
            return self._peers.get(node_id)

    def live_peers(self) -> list[str]:
        """Sorted ids of live peers.

        A peer found expired here for the first time (no sign of life for
        ``heartbeat_timeout``) is logged once, as a warning."""
        expired: list[tuple[str, float]] = []
        with self._lock:
            live = []
            for n, i in self._peers.items():
                if self._is_live(i):
                    live.append(n)
                elif n not in self._gone:
                    self._gone.add(n)
                    expired.append((n, self._clock() - i.last_seen))
        for n, silent in expired:
            log.warning("%s: peer %s not heard from for %.0fs (heartbeat timeout %ss): presumed dead",
                        self.self_id, n, silent, self.heartbeat_timeout)
        return sorted(live)

    def all(self) -> list[PeerInfo]:
        """Every peer ever seen (live or not), sorted by id."""
        with self._lock:
            return [self._peers[n] for n in sorted(self._peers)]

    def broker_of(self, node_id: str) -> str:
        """``"host:port"`` of the broker where ``node_id``'s topics live ("" = default)."""
        with self._lock:
            info = self._peers.get(node_id)
            return info.broker if info else ""
