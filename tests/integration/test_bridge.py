"""Two sites: two mosquitto brokers on loopback joined by mosquitto's own bridging,
an agent on each (the daemon's ``Agent``, real MQTT, no mDNS).  With
``mqtt.bridged = true`` each agent talks to its home broker only and the bridge
carries presence, broadcasts and inbox frames; ``dflctl peers`` on either site sees
both nodes with their own site's broker; a node that leaves one site shows offline
on the other (the offline presence, like a last will, crosses the bridge)."""

import asyncio
from pathlib import Path

import pytest

from dfl_agent.cli.broker import BrokerHandle, free_port, mosquitto_path
from dfl_agent.cli.observer import Observer
from dfl_agent.cli.tables import peer_rows
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.run.agent import Agent
from dfl_agent.runtime.shared.config import config_from_dict
from tests.host import LobbyHost

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed")]


class BridgedMosquitto(BrokerHandle):
    """A mosquitto whose configuration adds a bridge to ``remote`` for ``dfl/#``
    (the configuration deploy/multi-site.md documents)."""

    def __init__(self, remote: str):
        super().__init__("mosquitto", "127.0.0.1", free_port(), None)
        self.remote = remote

    def _command(self):
        cmd = super()._command()
        conf = Path(cmd[-1])
        conf.write_text(conf.read_text() + "\n".join([
            "connection site-b-to-a",
            f"address {self.remote}",
            "topic dfl/# both 1",
            "bridge_protocol_version mqttv50",
            "cleansession true",
            "try_private true",
            "notifications false",
            "restart_timeout 1",
        ]) + "\n")
        return cmd


def _cfg(tmp_path, fed, nid, index, broker, rounds=3):
    return config_from_dict({
        "federation": fed, "node_id": nid, "state_dir": str(tmp_path / nid),
        "algorithm": {"name": "fedavg", "rounds": rounds, "options": {"round_timeout": 20.0}},
        "data": {"dataset": "digits", "partition": "iid", "num_nodes": 2, "node_index": index},
        "model": {"size": "small"},
        "mqtt": {"broker": broker, "bridged": True, "keepalive": 2, "heartbeat_interval": 1.0},
        "discovery": {"mdns": False, "min_peers": 1, "start_timeout": 30.0},
    })


def test_agents_on_two_bridged_brokers_learn_together(tmp_path, mosquitto_broker, federation):
    site_a = mosquitto_broker
    site_b = BridgedMosquitto(site_a.endpoint).start()
    try:
        cfgs = [_cfg(tmp_path, federation, "alpha", 0, site_a.endpoint), _cfg(tmp_path, federation, "bravo", 1,
                                                                         site_b.endpoint)]
        agents = [Agent(c, host=LobbyHost(c)) for c in cfgs]  # each with its service's session
        observers = {s.endpoint: Observer(s.endpoint, federation).start() for s in (site_a, site_b)}
        online: dict[str, list] = {}

        async def watch():  # what `dflctl peers` shows on each site while both run
            while len(online) < 2:
                for endpoint, obs in observers.items():
                    rows = peer_rows(*obs.snapshot())
                    if endpoint not in online and sum(r["state"] == "online" for r in rows) == 2:
                        online[endpoint] = rows
                await asyncio.sleep(0.1)

        async def main():
            stop = asyncio.Event()
            w = asyncio.ensure_future(watch())
            try:
                codes = await asyncio.wait_for(asyncio.gather(*(a.run(stop) for a in agents)), 180)
                await asyncio.sleep(1.0)  # the "offline" presences cross the bridge
            finally:
                for a in agents:
                    if a.host.lobby is not None:
                        a.host.lobby.stop()
            w.cancel()
            return codes

        codes = asyncio.run(main())
        assert codes == [0, 0], [site_b.log_tail()]
        seen = {endpoint: peer_rows(*obs.snapshot()) for endpoint, obs in observers.items()}
        for obs in observers.values():
            obs.stop()
    finally:
        site_b.stop()
    # both sites saw both nodes online, each with its own site's broker, and the device's own address
    assert set(online) == {site_a.endpoint, site_b.endpoint}
    for rows in online.values():
        by_id = {r["node_id"]: r for r in rows}
        assert by_id["alpha"]["broker"] == site_a.endpoint and by_id["bravo"]["broker"] == site_b.endpoint
        assert by_id["alpha"]["address"] == by_id["bravo"]["address"] == "127.0.0.1"  # discovery.interfaces
    for a in agents:
        hist = [r for r in a.node.history if "neighbours" in r]
        assert [r["round"] for r in hist] == [1, 2, 3]
        assert all(r["neighbours"] == 1 for r in hist), [(a.node_id, r["round"], r["neighbours"], r.get("missing"), r.get("round_seconds")) for r in hist]  # the other site's model arrived every round
        assert set(a.ctx.transport.connections()) == {a.cfg.mqtt.broker}  # home broker only
        other = "bravo" if a.node_id == "alpha" else "alpha"
        assert PeerTable.broker_of(a.peers, other) == (site_b.endpoint if other == "bravo" else site_a.endpoint)
        # how the other site's node was found: its presence, over the bridge (the first record says so)
        assert a.peers.found_via() == {other: "bridged-presence"}
        assert hist[0]["peers_found"] == {other: {"bridged-presence": {"t": pytest.approx(0, abs=1e6),
                                                                       "address": "127.0.0.1"}}}
        assert a.node.status()["peers_found_via"] == {"bridged-presence": 1}
    for endpoint, rows in seen.items():
        by_id = {r["node_id"]: r for r in rows}
        assert set(by_id) == {"alpha", "bravo"}, (endpoint, rows)
        assert by_id["alpha"]["broker"] == site_a.endpoint  # still known after it left
        assert by_id["alpha"]["round"] == 3 and by_id["bravo"]["round"] == 3
        assert all(r["state"] == "offline" for r in rows)  # both left: "offline" crossed the bridge
