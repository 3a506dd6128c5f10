"""A peer that opens many chunked transfers and never completes them cannot make a
node hold more than ``max_transfers`` of them (all topics together)."""

import asyncio
import os
import time

import paho.mqtt.client as mqtt
import pytest

from dfl_agent.discovery.peers import PeerTable
from dfl_agent.discovery.presence import node_transport
from dfl_agent.transport.chunking import split
from dfl_agent.transport.mqtt import topic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_chunks_in_flight_are_bounded(mosquitto_broker, federation):
    t = node_transport("victim", federation, broker=mosquitto_broker.endpoint, peers=PeerTable("victim", federation),
                       descriptor={}, max_transfers=4, chunk_size=4096, max_frame_bytes=1 << 20)
    got = []
    await t.start(lambda f, w: got.append(f), lambda n, d: None)
    try:
        flood = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="flood")
        flood.connect(mosquitto_broker.host, mosquitto_broker.port)
        flood.loop_start()
        for i in range(40):  # 40 transfers over 10 sender topics, only their first chunk each
            first = split(b"DFL" + os.urandom(20000), 4096)[0]
            flood.publish(topic(federation, f"s{i % 10}", "out"), first, qos=1).wait_for_publish(5)
        deadline = time.monotonic() + 5
        while t.stats.dropped.get("too_many_transfers", 0) < 36 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        flood.loop_stop()
        flood.disconnect()
        conn = t._conns[t.broker]
        with conn.reasm_lock:
            pending = sum(r.pending for r in conn.reassemblers.values())
        assert pending <= 4
        assert t.stats.dropped["too_many_transfers"] >= 36
    finally:
        await t.stop()
