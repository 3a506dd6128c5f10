"""The lab's traffic per link, on real namespaces as root: the sampler reads each switch's
and the router's counters, maps them to hosts and to WAN links, and counts the right
direction. A host sends 1 MB to a host of its site and 400 kB to one of the other site;
each link must show those bytes where they went, and nothing much where they did not (~5 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from dfl_agent.cli.lab.net import LabNet
from dfl_agent.cli.lab.traffic import TrafficSampler, summarize

PY = sys.executable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab's namespaces need root")

# a TCP sink on port 7001 of argv[1]: reads and discards; prints "ready"
SINK = r"""
import socket, sys
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind((sys.argv[1], 7001)); t.listen(8)
print("ready", flush=True)
while True:
    c, _ = t.accept()
    with c:
        while c.recv(65536):
            pass
"""

# send argv[2] bytes to argv[1]:7001 and close
SEND = r"""
import socket, sys
with socket.create_connection((sys.argv[1], 7001), timeout=20) as c:
    c.sendall(b"z" * int(sys.argv[2]))
    c.shutdown(socket.SHUT_WR); c.recv(1)
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabNet]:
    with LabNet(state_dir=tmp_path_factory.mktemp("traffic-state")) as net:
        net.add_site("a")
        net.add_site("b")
        for name, site in (("a0", "a"), ("a1", "a"), ("b0", "b")):
            net.add_host(name, site)
        net.connect_sites()
        for h in ("a1", "b0"):
            p = net.popen(h, [PY, "-c", SINK, net.hosts[h].address], stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield net


def test_each_link_counts_the_bytes_to_and_from_its_host(lab: LabNet, tmp_path) -> None:
    sampler = TrafficSampler(lab, tmp_path / "traffic.jsonl", interval_s=0.5)
    t0 = time.monotonic()
    sampler.start()
    try:
        for dst, size in (("a1", 1_000_000), ("b0", 400_000)):
            r = lab.run("a0", [PY, "-c", SEND, lab.hosts[dst].address, str(size)], timeout=30)
            assert r.returncode == 0, r.stderr
        time.sleep(0.6)
    finally:
        sampler.stop()
    links = summarize(sampler.samples, t0)
    assert set(links) == {"a0", "a1", "b0", "wan-a", "wan-b"}, set(links)
    mb = {h: (v["bytes_to_host"] / 1e6, v["bytes_from_host"] / 1e6) for h, v in links.items()}
    print({h: (round(a, 3), round(b, 3)) for h, (a, b) in mb.items()})
    # the payload and its headers (a few per cent at most); the acks go the other way
    assert 1.4 <= mb["a0"][1] < 1.55 and mb["a0"][0] < 0.1
    assert 1.0 <= mb["a1"][0] < 1.1 and mb["a1"][1] < 0.1
    assert 0.4 <= mb["b0"][0] < 0.45 and mb["b0"][1] < 0.05
    # the WAN: out of site a, into site b
    assert 0.4 <= mb["wan-a"][1] < 0.45 and mb["wan-a"][0] < 0.05
    assert 0.4 <= mb["wan-b"][0] < 0.45 and mb["wan-b"][1] < 0.05
    series = links["a0"]["series"]
    assert len(series) >= 3 and series[0][1:] == [0, 0] and series == sorted(series)
    assert (tmp_path / "traffic.jsonl").read_text().count("\n") >= 3
