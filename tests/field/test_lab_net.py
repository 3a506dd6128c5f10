"""The field lab's network (dfl_agent.cli.lab): real namespaces, bridges, veth pairs, tbf,
iptables and cgroups, as root. Every packet stays inside the lab's namespaces
(198.18.0.0/15). One site with three hosts and a broker host, shared by the tests in
order; the teardown tests build labs of their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dfl_agent.cli.lab.net import LabNet
from dfl_agent.cli.lab.state import alive

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]

# a UDP and TCP echo server on port 7000 of the host's lab address; prints "ready"
ECHO = r"""
import socket, sys, threading
addr = sys.argv[1]
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((addr, 7000))
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind((addr, 7000)); t.listen(8)
def udp():
    while True:
        data, peer = u.recvfrom(65535); u.sendto(data, peer)
def tcp():
    while True:
        c, _ = t.accept()
        with c:
            while (data := c.recv(65536)):
                c.sendall(data)
threading.Thread(target=udp, daemon=True).start()
print("ready", flush=True)
tcp()
"""

# one TCP and one UDP round trip to argv[1]:7000; prints "tcp udp" or fails
PING = r"""
import socket, sys
dst = (sys.argv[1], 7000)
with socket.create_connection(dst, timeout=1.5) as c:
    c.sendall(b"hello-tcp"); assert c.recv(64) == b"hello-tcp"
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(1.5)
for attempt in range(4):  # a link with random loss may drop one datagram: ask again
    u.sendto(b"hello-udp", dst)
    try:
        assert u.recvfrom(64)[0] == b"hello-udp"
        break
    except TimeoutError:
        if attempt == 3:
            raise
print("tcp udp")
"""

# receive UDP on port argv[2]: count datagrams for argv[3] s; prints the count
COUNT = r"""
import socket, sys, time
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((sys.argv[1], int(sys.argv[2]))); u.settimeout(0.2)
print("ready", flush=True)
n, end = 0, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        u.recv(2048); n += 1
    except TimeoutError:
        pass
print(n, flush=True)
"""

# send argv[3] UDP datagrams to argv[1]:argv[2], 2 ms apart
BLAST = r"""
import socket, sys, time
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    u.sendto(b"x" * 200, (sys.argv[1], int(sys.argv[2]))); time.sleep(0.002)
"""

# join the mDNS group 224.0.0.251:5353 on the lab interface; print the first datagram
MCAST_RECV = r"""
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("", 5353))
s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, struct.pack("4s4s", socket.inet_aton("224.0.0.251"), socket.inet_aton(sys.argv[1])))
s.settimeout(5); print("ready", flush=True)
data, peer = s.recvfrom(2048); print(data.decode(), peer[0], flush=True)
"""

MCAST_SEND = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(sys.argv[1]))
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
for _ in range(5):
    s.sendto(b"mdns-from-" + sys.argv[1].encode(), ("224.0.0.251", 5353)); time.sleep(0.1)
"""

# send argv[2] bytes over TCP to argv[1]:7000 and read them back; prints the seconds
BULK = r"""
import socket, sys, time, threading
n = int(sys.argv[2]); t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], 7000), timeout=30)
got = [0]
def rd():
    while got[0] < n:
        b = c.recv(65536)
        if not b: break
        got[0] += len(b)
r = threading.Thread(target=rd); r.start(); c.sendall(b"z" * n); r.join(); c.close()
assert got[0] == n, got[0]
print(f"{time.monotonic() - t0:.3f}")
"""


def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")


def _pipe() -> dict:
    return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabNet]:
    with LabNet(state_dir=tmp_path_factory.mktemp("state")) as net:
        net.add_site("a")
        for name in ("h0", "h1"):
            net.add_host(name, "a", cpu=0.25, memory_mb=256)
        net.add_host("h2", "a", memory_mb=64)
        net.add_host("broker", "a")
        echo = net.popen("h1", [PY, "-c", ECHO, net.hosts["h1"].address], **_pipe())
        _ready(echo)
        yield net


def _ping(lab: LabNet, src: str = "h0", dst: str = "h1") -> subprocess.CompletedProcess[str]:
    return lab.run(src, [PY, "-c", PING, lab.hosts[dst].address], timeout=10)


def test_hosts_reach_each_other_over_their_lab_addresses(lab: LabNet) -> None:
    r = _ping(lab)
    assert r.returncode == 0 and r.stdout.strip() == "tcp udp", r.stderr
    assert [h.address for h in lab.hosts.values()] == ["198.18.0.10", "198.18.0.11", "198.18.0.12", "198.18.0.13"]
    routes = lab.run("h0", ["ip", "route", "show"]).stdout
    assert "default" not in routes and "198.18.0.0/15 via 198.18.0.1" in routes, routes


def test_multicast_reaches_every_host_on_the_site_bridge(lab: LabNet) -> None:
    receivers = [lab.popen(h, [PY, "-c", MCAST_RECV, lab.hosts[h].address], **_pipe()) for h in ("h1", "broker")]
    for r in receivers:
        _ready(r)
    sent = lab.run("h0", [PY, "-c", MCAST_SEND, lab.hosts["h0"].address])
    assert sent.returncode == 0, sent.stderr
    for r in receivers:
        out, err = r.communicate(timeout=10)
        assert r.returncode == 0 and out.split() == ["mdns-from-198.18.0.10", "198.18.0.10"], err
        lab.stop(r)


def test_tbf_limits_the_rate_of_a_link(lab: LabNet) -> None:
    size = 1_000_000
    fast = lab.run("h0", [PY, "-c", BULK, lab.hosts["h1"].address, str(size)], timeout=30)
    assert fast.returncode == 0, fast.stderr
    lab.shape("h1", rate="2mbit")
    try:
        slow = lab.run("h0", [PY, "-c", BULK, lab.hosts["h1"].address, str(size)], timeout=30)
    finally:
        lab.shape("h1")
    assert slow.returncode == 0, slow.stderr
    # 1 MB each way at 2 Mbit/s: 4 s of transfer (both directions shaped, in parallel)
    print(f"1 MB echoed: {float(fast.stdout):.2f} s unlimited, {float(slow.stdout):.2f} s at 2mbit")
    assert float(slow.stdout) >= 3.0 and float(fast.stdout) < 1.5


def test_random_loss_drops_about_p_of_the_packets(lab: LabNet) -> None:
    lab.shape("h1", loss=0.5)
    try:
        counter = lab.popen("h1", [PY, "-c", COUNT, lab.hosts["h1"].address, "7001", "2.5"], **_pipe())
        _ready(counter)
        assert lab.run("h0", [PY, "-c", BLAST, lab.hosts["h1"].address, "7001", "400"]).returncode == 0
        out, _ = counter.communicate(timeout=10)
        lab.stop(counter)
    finally:
        lab.shape("h1")
    rules = lab.run("h1", ["iptables", "-S"]).stdout
    assert "statistic" not in rules  # unshaped again
    print(f"received {out.strip()} of 400 at loss 0.5 ({lab.mechanisms.loss})")
    assert 120 <= int(out) <= 280


def test_a_link_down_cuts_the_host_off_and_up_restores_it(lab: LabNet) -> None:
    lab.set_link("h1", up=False)
    try:
        down = _ping(lab)
    finally:
        lab.set_link("h1", up=True)
    assert down.returncode != 0
    deadline = time.monotonic() + 5
    while (up := _ping(lab)).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert up.returncode == 0, up.stderr


def test_cpu_quota_holds_a_busy_host_to_its_share(lab: LabNet) -> None:
    busy = "import time, os\nend = time.monotonic() + 1.2\nwhile time.monotonic() < end: pass\nprint(os.times().user + os.times().system)"
    r = lab.run("h0", [PY, "-c", busy], timeout=10)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) < 0.55, r.stdout  # 0.25 of a core for 1.2 s (+ the start-up)
    assert lab.hosts["h0"].cgroup.throttled_s() > 0  # type: ignore[union-attr]


def test_a_host_over_its_memory_limit_is_oom_killed_and_reported(lab: LabNet) -> None:
    assert lab.oom_kills()["h2"] == 0
    hog = lab.run("h2", [PY, "-c", "b = bytearray(200 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); print('alive')"],
                  timeout=20)
    assert hog.returncode == -signal.SIGKILL and "alive" not in hog.stdout
    assert lab.oom_kills() == {"h0": 0, "h1": 0, "h2": 1, "broker": 0}
    assert 50 <= lab.hosts["h2"].cgroup.peak_mb() <= 65  # type: ignore[union-attr,operator]


def _leftovers(run_id: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [f"netns {line.split()[0]}" for line in out.splitlines() if run_id in line]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [f"link {line}" for line in links.splitlines() if f"dl{run_id[:4]}" in line]
    for ctl in ("memory", "cpu", "unified", ""):
        base = Path("/sys/fs/cgroup", ctl, "dfl-lab", run_id)
        if base.exists():
            found.append(f"cgroup {base}")
    return found


def _state_objects(doc: dict) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for o in doc["objects"]:
        kinds[o["kind"]] = kinds.get(o["kind"], 0) + 1
    return kinds


def test_the_state_file_lists_every_object_and_teardown_leaves_nothing(tmp_path: Path, caplog) -> None:
    with LabNet(state_dir=tmp_path) as net:
        net.add_site("a")
        net.add_site("b")
        net.add_host("x", "a", cpu=(os.cpu_count() or 1) + 0.5, memory_mb=128, rate="10mbit", loss=0.01)
        assert "CPU quotas add up to" in caplog.text  # more than the machine's cores: a warning
        net.add_host("y", "b", memory_mb=128)
        net.connect_sites(rate="5mbit")
        sleeper = net.popen("x", ["sleep", "60"])
        doc = json.loads(net.state.path.read_text())
        kinds = _state_objects(doc)
        # 2 switches, 2 hosts, 2 gateways, the router; host links, gateway lan and wan links
        assert kinds["netns"] == 7 and kinds["link"] == 6 and kinds["process"] == 1
        assert {o["pid"] for o in doc["objects"] if o["kind"] == "process"} == {sleeper.pid}
        listed = {o["name"] for o in doc["objects"] if o["kind"] == "netns"}
        present = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        assert listed <= present
        assert all(len(o["name"]) <= 15 for o in doc["objects"] if o["kind"] == "link")
        assert all(Path(o["path"]).is_dir() for o in doc["objects"] if o["kind"] == "cgroup")
        # the two sites reach each other through the router, and not when the WAN is down
        net.popen("y", [PY, "-c", ECHO, net.hosts["y"].address], **_pipe()).stdout.readline()  # type: ignore[union-attr]
        assert net.run("x", [PY, "-c", PING, net.hosts["y"].address], timeout=10).returncode == 0
        net.set_wan(False)
        assert net.run("x", [PY, "-c", PING, net.hosts["y"].address], timeout=10).returncode != 0
        run_id = net.run_id
    assert sleeper.poll() is not None
    assert _leftovers(run_id) == []
    assert not net.state.path.exists()


INTERRUPTED = r"""
import sys, time
from pathlib import Path
from dfl_agent.cli.lab.net import LabNet
with LabNet(state_dir=Path(sys.argv[1])) as net:
    net.add_site("a")
    net.add_host("p", "a", cpu=0.5, memory_mb=64, rate="2mbit", loss=0.1)
    net.popen("p", ["sleep", "300"])
    print(net.run_id, flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_builder_tears_its_lab_down(tmp_path: Path, sig: int) -> None:
    # SIGINT as a terminal sends it: a test run started in the background (a shell's `&`
    # without job control) ignores SIGINT, and the builder would inherit that
    builder = subprocess.Popen([PY, "-c", INTERRUPTED, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert builder.stdout is not None
    try:
        run_id = builder.stdout.readline().strip()
        assert len(_leftovers(run_id)) == 4  # two namespaces, the run's memory and CPU cgroup folders
        builder.send_signal(sig)
        builder.wait(timeout=20)
    finally:
        if builder.poll() is None:
            builder.terminate()
            builder.wait(timeout=20)
    assert _leftovers(run_id) == [] and list(tmp_path.iterdir()) == []


BUILDER = r"""
import sys
from pathlib import Path
from dfl_agent.cli.lab.net import LabNet
from dfl_agent.cli.lab.state import alive
net = LabNet(state_dir=Path(sys.argv[1]))
net.add_site("a")
net.add_host("p", "a", cpu=0.5, memory_mb=64, rate="2mbit", loss=0.1)
net.add_host("q", "a")
net.popen("p", ["sleep", "300"])
print(net.run_id, flush=True)
import time; time.sleep(300)
"""


def test_lab_down_removes_what_a_killed_builder_left(tmp_path: Path) -> None:
    env = {**os.environ, "DFL_LAB_STATE_DIR": str(tmp_path)}
    builder = subprocess.Popen([PY, "-c", BUILDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    assert builder.stdout is not None
    run_id = builder.stdout.readline().strip()
    doc = json.loads((tmp_path / f"{run_id}.json").read_text())
    sleeper = next(o["pid"] for o in doc["objects"] if o["kind"] == "process")
    down = [PY, "-m", "dfl_agent.cli.dflctl", "lab", "down"]
    live = subprocess.run(down, capture_output=True, text=True, env=env, cwd=ROOT)
    assert "still running" in live.stdout and _leftovers(run_id)  # a live lab is left alone
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    assert len(_leftovers(run_id)) == 5 and alive(sleeper, None)
    r = subprocess.run(down, capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"lab {run_id}: removed" in r.stdout and f"process {sleeper} (p)" in r.stdout, r.stdout
    assert _leftovers(run_id) == [] and not alive(sleeper, None)  # gone (or a zombie of init's)
    assert list(tmp_path.iterdir()) == []
    again = subprocess.run(down, capture_output=True, text=True, env=env, cwd=ROOT)
    assert "nothing to remove" in again.stdout


def test_lab_check_names_each_capability() -> None:
    r = subprocess.run([PY, "-m", "dfl_agent.cli.dflctl", "lab", "check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    names = [line.split("  ")[0] for line in r.stdout.splitlines()[:-1]]
    assert names == ["network namespaces", "veth and bridge", "tc tbf (rate)", "sch_netem (loss, delay)",
                     "iptables statistic (loss)", "cgroup memory", "cgroup cpu"]
    assert r.stdout.splitlines()[-1].startswith("the lab can run here")
    assert "dfl-lab-check" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# ---- two sites: the WAN through the router -------------------------------------------------
@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabNet]:
    """Site a with a0 and a1, site b with b0 (an echo server), joined by the WAN."""
    with LabNet(state_dir=tmp_path_factory.mktemp("wan-state")) as net:
        net.add_site("a")
        net.add_site("b")
        net.add_host("a0", "a")
        net.add_host("a1", "a")
        net.add_host("b0", "b")
        net.connect_sites()
        for h in ("a1", "b0"):
            _ready(net.popen(h, [PY, "-c", ECHO, net.hosts[h].address], **_pipe()))
        yield net


def _routes(lab: LabNet, name: str) -> str:
    return subprocess.run(["ip", "-n", lab.ns(name), "route", "show"], capture_output=True, text=True).stdout


def test_a_host_of_one_site_reaches_the_other_site_through_the_router(sites: LabNet) -> None:
    assert sites.hosts["b0"].address == "198.18.1.10"
    r = _ping(sites, "a0", "b0")
    assert r.returncode == 0 and r.stdout.strip() == "tcp udp", r.stderr
    # the path: a's gateway, then the router's end towards b, then b's gateway, then b0
    hops = sites.run("a0", ["ip", "route", "get", "198.18.1.10"]).stdout
    assert "via 198.18.0.1" in hops, hops
    assert "198.18.1.0/24 via 198.19.0.1" in _routes(sites, "gw-a")
    assert "198.18.1.0/24 via 198.19.0.6" in _routes(sites, "router")


def test_the_wan_rate_limits_traffic_between_sites(sites: LabNet) -> None:
    size = 500_000
    fast = sites.run("a0", [PY, "-c", BULK, sites.hosts["b0"].address, str(size)], timeout=30)
    assert fast.returncode == 0, fast.stderr
    sites.shape_wan(rate="2mbit")
    try:
        slow = sites.run("a0", [PY, "-c", BULK, sites.hosts["b0"].address, str(size)], timeout=30)
    finally:
        sites.shape_wan()
    assert slow.returncode == 0, slow.stderr
    # 500 kB each way at 2 Mbit/s: 2 s of transfer
    print(f"500 kB echoed across the WAN: {float(fast.stdout):.2f} s unlimited, {float(slow.stdout):.2f} s at 2mbit")
    assert float(slow.stdout) >= 1.5 and float(fast.stdout) < 1.0


def test_the_wan_down_cuts_the_sites_apart_and_up_joins_them_again(sites: LabNet) -> None:
    sites.set_wan(False)
    try:
        down = _ping(sites, "a0", "b0")
        inside = _ping(sites, "a0", "a1")
    finally:
        sites.set_wan(True)
    assert down.returncode != 0
    assert inside.returncode == 0, inside.stderr  # a site keeps working on its own
    deadline = time.monotonic() + 5
    while (up := _ping(sites, "a0", "b0")).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert up.returncode == 0, up.stderr


def test_multicast_stays_on_its_site(sites: LabNet) -> None:
    """mDNS is link-local: a0's datagrams reach a1 on its site's bridge, never b0."""
    near = sites.popen("a1", [PY, "-c", MCAST_RECV, sites.hosts["a1"].address], **_pipe())
    far = sites.popen("b0", [PY, "-c", MCAST_RECV, sites.hosts["b0"].address], **_pipe())
    for r in (near, far):
        _ready(r)
    assert sites.run("a0", [PY, "-c", MCAST_SEND, sites.hosts["a0"].address]).returncode == 0
    out, err = near.communicate(timeout=10)
    assert near.returncode == 0 and out.split() == ["mdns-from-198.18.0.10", "198.18.0.10"], err
    _, err = far.communicate(timeout=10)
    assert far.returncode != 0 and "timed out" in err, err  # its 5 s receive timeout ran out
    for r in (near, far):
        sites.stop(r)
