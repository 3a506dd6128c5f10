"""Peer directory for sites whose MQTT brokers are joined by bridging.

With several sites, each running its own broker, and the brokers joined by
mosquitto's bridging (``topic dfl/<fed>/# both 1``; see ``deploy/multi-site.md``),
every node's topics are reachable through *any* site broker: the bridge carries
presence, status, broadcasts and inbox frames between sites.  A node then talks to
its home broker only, even though each peer's presence still advertises the broker
of its own site (shown by ``dflctl peers`` as the node's address).  This is the
``mqtt.bridged = true`` setting; without it a node connects to each peer's advertised
broker directly (one connection per broker), which needs every site broker to be
reachable from every site.
"""

from __future__ import annotations

from dfl_agent.discovery.peers import PeerInfo, PeerTable


class HomeRoutedPeerTable(PeerTable):
    """A :class:`PeerTable` whose :meth:`broker_of` maps every peer to the home broker
    (``""``), so the MQTT transport routes everything through it."""

    def broker_of(self, node_id: str) -> str:
        return ""

    def found_how(self, source: str, info: PeerInfo) -> str:
        """``bridged-presence`` for a presence from a peer that advertises another broker
        than :attr:`home_broker` (it crossed the bridge), else the source."""
        if source == "presence" and self.home_broker and info.broker and info.broker != self.home_broker:
            return "bridged-presence"
        return source
