"""Peer discovery: mDNS (zeroconf), static peer lists, MQTT presence -> a live :class:`PeerTable`."""

from dfl_agent.discovery.peers import PeerInfo, PeerTable

__all__ = ["PeerInfo", "PeerTable"]
