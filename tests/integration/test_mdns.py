"""MdnsDiscovery against real zeroconf on 127.0.0.1 (several instances, one process).

Every test uses its own service type and federation id, so concurrent test runs on
the same machine cannot see or conflict with each other.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from dfl_agent import WIRE_VERSION
from dfl_agent.discovery.mdns import MdnsDiscovery
from dfl_agent.discovery.peers import PeerTable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LOOPBACK = ["127.0.0.1"]


async def eventually(cond: Callable[[], bool], timeout: float = 6.0, what: str = "") -> float:
    """Poll ``cond`` until true; return the seconds it took. Fails after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture
def stype() -> str:
    return f"_t{uuid.uuid4().hex[:10]}._tcp.local."


@pytest.fixture
def fed() -> str:
    return f"fed{uuid.uuid4().hex[:8]}"


#: the federation's broker (every table's ``home_broker``, as the agent sets it from mqtt.broker):
#: a broker that an mDNS record names is used only when it is trusted (test_mdns_brokers.py)
HOME = "127.0.0.1:1883"


def descriptor(node_id: str, **over: str) -> dict[str, str]:
    d = {
        "broker": HOME,
        "profile": "rpi4",
        "model_hash": f"hash-{node_id}",
        "algorithm": "dfml",
        "version": "0.1.0",
    }
    d.update(over)
    return d


def make(node_id: str, federation: str, stype: str, port: int = 0) -> MdnsDiscovery:
    table = PeerTable(node_id, federation=federation, home_broker=HOME)
    return MdnsDiscovery(
        table,
        node_id=node_id,
        federation=federation,
        descriptor=descriptor(node_id),
        interfaces=LOOPBACK,
        port=port,
        service_type=stype,
    )


async def register_raw(zc: AsyncZeroconf, stype: str, instance: str, props: dict[str, str],
                       address: str = "127.0.0.1") -> None:
    """Register a made-up record (no probe for conflicts: a responder that answers for
    whatever it likes); its A record gives ``address``."""
    info = AsyncServiceInfo(
        stype, f"{instance}.{stype}", port=1, properties=props,
        server=f"{instance}.local.", parsed_addresses=[address],
    )
    await (await zc.async_register_service(info, cooperating_responders=True))


async def test_discover_update_goodbye(stype, fed):
    a = make("node-a", fed, stype, port=7001)
    b = make("node-b", fed, stype, port=7002)
    other = make("node-x", "otherfed" + fed[-4:], stype)
    # A raw responder advertising records of our federation that must be rejected.
    raw = AsyncZeroconf(interfaces=LOOPBACK, ip_version=IPVersion.V4Only)
    events_a: list[tuple[str, str]] = []
    a.table.add_listener(lambda ev, nid, info: events_a.append((ev, nid)))
    try:
        t0 = time.monotonic()
        await asyncio.gather(
            a.start(),
            b.start(),
            other.start(),
            register_raw(raw, stype, f"{fed}--node-m", {"id": "not-m", "fed": fed, "wire": "1"}),
            register_raw(raw, stype, f"{fed}--node-w", {"id": "node-w", "fed": fed, "wire": "99"}),
        )
        await eventually(
            lambda: a.table.live_peers() == ["node-b"] and b.table.live_peers() == ["node-a"],
            what="A and B discover each other",
        )
        print(f"two nodes discovered each other {time.monotonic() - t0:.2f} s after start")

        pb = a.table.get("node-b")
        assert pb.federation == fed
        assert pb.broker == descriptor("node-b")["broker"]
        assert (pb.profile, pb.algorithm, pb.version) == ("rpi4", "dfml", "0.1.0")
        assert pb.model_hash == "hash-node-b"
        assert pb.address == "127.0.0.1:7002"
        assert pb.sources == {"mdns"}
        assert b.table.get("node-a").address == "127.0.0.1:7001"
        assert a.table.broker_of("node-b") == descriptor("node-b")["broker"]

        # the other federation sees neither of us, and we never see it
        await eventually(lambda: a.errors["wire_version"] >= 1 and a.errors["malformed_txt"] >= 1,
                         what="A rejects the malformed records")
        assert other.table.all() == []
        assert [p.node_id for p in a.table.all()] == ["node-b"]

        # a third node joins
        c = make("node.c", fed, stype, port=7003)  # a dot in the id: two DNS labels
        t1 = time.monotonic()
        await c.start()
        await eventually(
            lambda: all(
                d.table.live_peers() == sorted({"node-a", "node-b", "node.c"} - {d.node_id}) for d in (a, b, c)
            ),
            what="three nodes discover each other",
        )
        print(f"third node discovered/discovering {time.monotonic() - t1:.2f} s after its start()")
        assert c.table.get("node-a").model_hash == "hash-node-a"

        # update() propagates
        t2 = time.monotonic()
        await b.update(descriptor("node-b", model_hash="hash-b2", algorithm="dechw"))
        await eventually(
            lambda: all(d.table.get("node-b").model_hash == "hash-b2" for d in (a, c)),
            what="update reaches A and C",
        )
        print(f"update propagated within {time.monotonic() - t2:.2f} s")
        assert a.table.get("node-b").algorithm == "dechw"
        assert ("updated", "node-b") in events_a

        # stop() says goodbye: C leaves the others' live peers
        t3 = time.monotonic()
        await c.stop()
        stop_s = time.monotonic() - t3
        await eventually(
            lambda: a.table.live_peers() == ["node-b"] and b.table.live_peers() == ["node-a"],
            what="goodbye of C reaches A and B",
        )
        print(f"stop() took {stop_s:.2f} s, goodbye seen {time.monotonic() - t3:.2f} s after stop()")
        assert stop_s < 5
        assert events_a.count(("removed", "node.c")) == 1
        assert c.table.live_peers() == []  # its own mdns-vouched peers are withdrawn
        await c.stop()  # idempotent

        assert a.errors["resolve_error"] == 0 and a.errors["handler_error"] == 0
        assert b.errors["resolve_error"] == 0 and b.errors["handler_error"] == 0
        assert other.table.all() == []
    finally:
        t4 = time.monotonic()
        await asyncio.gather(a.stop(), b.stop(), other.stop())
        await raw.async_close()
        assert time.monotonic() - t4 < 8


async def test_a_name_conflict_renames_the_node_and_its_peer_still_finds_it(stype, fed, caplog):
    """A responder that answers for the node's instance name before it starts (a made-up
    record: the node's id, another address): the node starts anyway, advertised as
    ``{fed}--node-a-2``, with one WARNING naming the responder's address, and its peer
    finds it by its TXT id (the same with a real agent: tests/system/test_mdns_squatter.py)."""
    raw = AsyncZeroconf(interfaces=LOOPBACK, ip_version=IPVersion.V4Only)
    a = make("node-a", fed, stype, port=7001)
    b = make("node-b", fed, stype)
    try:
        await register_raw(raw, stype, f"{fed}--node-a", {"id": "node-a", "fed": fed, "wire": str(WIRE_VERSION)},
                           address="127.0.0.77")
        with caplog.at_level(logging.INFO, logger="dfl_agent.discovery.mdns"):
            await asyncio.gather(a.start(), b.start())
            await eventually(lambda: b._names.get(a.name.lower()) == "node-a" and "node-a" in b.table.live_peers(),
                             what="B finds A under its new name")
        assert a.instance == f"{fed}--node-a-2" and a.conflicts == {f"{fed}--node-a.{stype}".lower()}
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "127.0.0.77:1" in warnings[0] and a.instance in warnings[0], warnings
        assert a.errors["name_conflict"] == 1 and a.errors["handler_error"] == 0
    finally:
        await asyncio.gather(a.stop(), b.stop())
        await raw.async_close()


async def test_stop_without_start_is_a_noop(stype, fed):
    d = make("node-a", fed, stype)
    await d.stop()
    await d.stop()
    with pytest.raises(RuntimeError):
        await d.start()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"interfaces": []}, "interfaces"),
        ({"interfaces": ["0.0.0.0"]}, "0.0.0.0"),
        ({"interfaces": ["eth0"]}, "not an IP address"),
        ({"interfaces": ["::1"]}, "not IPv4"),
        ({"node_id": "bad id"}, "node id"),
        ({"federation": ""}, "federation"),
        ({"descriptor": {"color": "red"}}, "unknown descriptor keys"),
        ({"descriptor": {"profile": "x" * 250}}, "255"),
        ({"descriptor": {"broker": "nohostport"}}, "host:port"),
        ({"node_id": "n" * 60}, "63 bytes"),
        ({"host_address": "localhost"}, "not an IP address"),
        ({"port": 70000}, "port"),
    ],
)
def test_constructor_validation(kwargs, match):
    args = dict(node_id="node-a", federation="fed", descriptor={}, interfaces=LOOPBACK)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MdnsDiscovery(PeerTable("node-a", "fed"), **args)


async def test_update_validates_before_changing_anything(stype, fed):
    d = make("node-a", fed, stype)
    with pytest.raises(ValueError):
        await d.update({"model_hash": "y" * 300})
    await d.update({"model_hash": "short"})  # before start: just stored
    assert d._properties["model"] == "short"


def test_handlers_never_raise_and_goodbye_maps_to_node_id(stype, fed):
    """No network: zeroconf callbacks with odd input, and a goodbye for a known peer."""
    from zeroconf import ServiceStateChange

    d = make("node-a", fed, stype)
    d.table.upsert("node-b", "mdns", federation=fed)
    d.table.upsert("node-b", "static", federation=fed)
    d.table.upsert("node-c", "mdns", federation=fed)
    for name in ("garbage", f"{fed}--bad id.{stype}", f"otherfed--node-c.{stype}", d.name):
        d._on_service_state_change(zeroconf=None, service_type=stype, name=name,
                                   state_change=ServiceStateChange.Removed)
    assert d.table.live_peers() == ["node-b", "node-c"]
    d._on_service_state_change(zeroconf=None, service_type=stype, name=f"{fed}--node-b.{stype}",
                               state_change=ServiceStateChange.Removed)
    d._on_service_state_change(zeroconf=None, service_type=stype, name=f"{fed.upper()}--node-c.{stype}",
                               state_change=ServiceStateChange.Removed)
    assert d.table.get("node-b").sources == {"static"}  # only mdns withdrawn
    assert d.table.live_peers() == ["node-b"]
    assert d.errors["handler_error"] == 0


def _accepted(listener: socket.socket) -> int:
    """How many connections ``listener`` (non-blocking) has taken since the last call."""
    n = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


async def test_an_mdns_record_naming_another_broker_makes_no_connection(stype, fed, mosquitto_broker):
    """A made-up node's mDNS record names a broker that is neither ``mqtt.broker`` nor named in
    a presence signed by an enrolled member (a TCP listener standing in for an attacker's
    broker): the node's MQTT transport never connects to it, the peer table keeps no broker
    for that node (its frames would go to the home broker) and the drop is counted as
    ``mdns_broker_untrusted`` in the node's status ``errors``.  A record naming the
    configured broker is used; once a signed presence names the other broker it is used too
    (the listener then sees the connection: the test can tell)."""
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.transport.mqtt import MqttTransport

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    other = f"127.0.0.1:{listener.getsockname()[1]}"
    home = mosquitto_broker.endpoint
    table = PeerTable("node-a", federation=fed, home_broker=home)
    transport = MqttTransport("node-a", fed, broker=home, peers=table)
    ctx = RuntimeContext(node_id="node-a", federation=fed, transport=transport, peers=table, data=None,
                         model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0))
    a = MdnsDiscovery(table, node_id="node-a", federation=fed, descriptor=descriptor("node-a", broker=home),
                      interfaces=LOOPBACK, service_type=stype)
    raw = AsyncZeroconf(interfaces=LOOPBACK, ip_version=IPVersion.V4Only)
    txt = {"fed": fed, "wire": str(WIRE_VERSION)}
    try:
        await ctx.start()
        await a.start()
        await asyncio.gather(register_raw(raw, stype, f"{fed}--ghost", {**txt, "id": "ghost", "broker": other}),
                             register_raw(raw, stype, f"{fed}--good", {**txt, "id": "good", "broker": home}))
        await eventually(lambda: {"ghost", "good"} <= set(table.live_peers()), what="A resolves both records")
        await asyncio.sleep(1.0)  # time for a connection to the named broker (a loopback connect takes ms)
        assert _accepted(listener) == 0, f"the node connected to {other}, named by an unsigned mDNS record"
        assert table.broker_of("ghost") == "" and table.broker_of("good") == home
        assert ctx.counters()["dropped"].get("mdns_broker_untrusted", 0) >= 1, ctx.counters()["dropped"]
        # a presence signed by an enrolled member names it (MqttPresence calls trust_broker): now used
        table.trust_broker(other)
        assert table.broker_of("ghost") == other
        await eventually(lambda: _accepted(listener) > 0, what="the transport connects to the trusted broker")
    finally:
        await a.stop()
        await raw.async_close()
        await ctx.stop()
        listener.close()
