"""An unsigned mDNS record decides nothing at start-up (real ``dfl-agent`` process, real
mosquitto, real zeroconf on 127.0.0.1): a responder that already answers for the node's
instance name ``{federation}--{node}._dfl._tcp.local.`` when the node starts does not stop
it; the node advertises itself under another name, logs one WARNING naming the
responder's address, and its peer finds it by its TXT id."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncZeroconf

from dfl_agent import WIRE_VERSION
from dfl_agent.cli.broker import start_broker
from dfl_agent.discovery.mdns import DEFAULT_SERVICE_TYPE, MdnsDiscovery
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.security.keys import enroll_local, public_key_b64
from tests.integration.test_mdns import register_raw
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration, needs_mosquitto, pytest.mark.timeout(180)]
LOOPBACK = ["127.0.0.1"]
SQUATTER = "127.0.0.77"  # the address the made-up record's A record gives


def _config(tmp: Path, fed: str, broker: str) -> Path:
    """Node s0 in the production configuration but TLS (signatures required, an enrolled key),
    mDNS on 127.0.0.1; it waits for one peer (start_timeout) after it has advertised itself."""
    fed_key = Ed25519PrivateKey.generate()
    enroll_local(fed_key, fed, "s0", tmp / "s0")
    raw = {"federation": fed, "node_id": "s0", "state_dir": str(tmp / "s0"),
           "algorithm": {"name": "fedavg", "rounds": 2},
           "data": {"dataset": "digits", "partition": "iid"}, "model": {"size": "small"},
           "training": {"steps": 1}, "mqtt": {"broker": broker, "heartbeat_interval": 0.5},
           "discovery": {"mdns": True, "interfaces": LOOPBACK, "min_peers": 1, "start_timeout": 120.0},
           "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)},
           "runtime": {"checkpoint": False}}
    path = tmp / "s0.toml"
    path.write_text(dump_toml(config_from_dict(raw)))
    return path


def test_a_squatted_instance_name_does_not_stop_the_agent_and_its_peer_finds_it(tmp_path):
    fed = f"sq{uuid.uuid4().hex[:8]}"
    log = tmp_path / "s0.log"

    async def main(broker: str) -> None:
        squatter = AsyncZeroconf(interfaces=LOOPBACK, ip_version=IPVersion.V4Only)
        peer = MdnsDiscovery(PeerTable("p1", fed, home_broker=broker), node_id="p1", federation=fed,
                             descriptor={"broker": broker}, interfaces=LOOPBACK)
        proc = None
        try:
            await register_raw(squatter, DEFAULT_SERVICE_TYPE, f"{fed}--s0",
                               {"id": "s0", "fed": fed, "wire": str(WIRE_VERSION)}, address=SQUATTER)
            proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config",
                                     str(_config(tmp_path, fed, broker))],
                                    stdout=open(log, "w"), stderr=subprocess.STDOUT)
            await peer.start()
            end = time.monotonic() + 120
            renamed = f"{fed}--s0-2.{DEFAULT_SERVICE_TYPE}".lower()
            # the agent advertised itself under its new name, and the peer resolved it as node s0
            while not ("mdns: advertising" in log.read_text() and peer._names.get(renamed) == "s0"):
                assert proc.poll() is None, f"the agent exited {proc.returncode}:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < end, f"not advertised and found within 120 s:\n{log.read_text()[-3000:]}"
                await asyncio.sleep(0.2)
            assert "s0" in peer.table.live_peers()
            await asyncio.sleep(1.0)
            assert proc.poll() is None, log.read_text()[-3000:]  # still running (waiting for its peers)
        finally:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            await peer.stop()
            await squatter.async_close()

    with start_broker("mosquitto") as broker:
        asyncio.run(main(broker.endpoint))
    text = log.read_text()
    mdns_warnings = [line for line in text.splitlines() if "WARNING" in line and "mdns" in line]
    assert len(mdns_warnings) == 1, mdns_warnings
    assert f"at {SQUATTER}:1" in mdns_warnings[0] and f"{fed}--s0-2" in mdns_warnings[0], mdns_warnings
    assert re.search(rf"mdns: advertising {fed}--s0-2\._dfl\._tcp\.local\.", text), text[-2000:]
    assert "Traceback" not in text and "MdnsNameConflict" not in text
