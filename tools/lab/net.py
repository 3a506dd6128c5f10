"""The lab's network: a namespace per host on a site bridge, a router between sites,
shaped links, a cgroup per host, and processes inside them.

Layout (``R`` is the lab's run id, 8 hex digits; ``s`` a site's index from 0)::

    dfl-lab-R-sw-<site>   the site's switch: bridge br0 (multicast flooded, no snooping)
    dfl-lab-R-<host>      one per host: eth0 = 198.18.s.(10+i)/24, lo up
    dfl-lab-R-gw-<site>   with two or more sites: lan0 = 198.18.s.1/24 on the bridge,
                          wan0 = 198.19.0.(4s+2)/30 to the router
    dfl-lab-R-router      wan ends 198.19.0.(4s+1)/30, one per site

Every link is a veth pair made directly between two lab namespaces, so nothing appears
in the host's own namespace; the switch end (and the router's end) is named
``dl<first 4 hex of R><n>`` (at most 15 characters), the other end ``eth0``, ``lan0`` or
``wan0``. Routes cover only 198.18.0.0/15 (each host's via its site's gateway) and
224.0.0.0/4 (multicast, on eth0): there is no default route and no NAT, so no traffic
leaves the lab.

Shaping, in both directions of a host's link: rate with ``tbf`` (on eth0 and on the
switch end); random loss with ``netem`` where the kernel has it, else ``iptables -m
statistic --mode random`` DROP rules on the host's INPUT and OUTPUT (the WAN's on the
gateway's FORWARD chain); a link is taken down and up on its switch end.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from dfl_agent.cli.lab.cgroups import HostCgroup
from dfl_agent.cli.lab.state import LabState, describe, proc_start, stop_process, teardown

log = logging.getLogger(__name__)

#: namespace names start with this
PREFIX = "dfl-lab-"
#: 198.18.0.0/15: sites are 198.18.<s>.0/24, the WAN /30s are in 198.19.0.0/24
LAB_NET = "198.18.0.0/15"
MCAST_NET = "224.0.0.0/4"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


class LabError(RuntimeError):
    """A lab command failed (its command line and stderr are in the message)."""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {(r.stderr or r.stdout).strip()}")
    return r


def parse_rate(rate: str | int | float) -> int:
    """``"2mbit"``, ``"500kbit"``, ``"1gbit"`` or bits/s -> bits per second."""
    if isinstance(rate, (int, float)):
        return int(rate)
    m = re.fullmatch(r"\s*([0-9.]+)\s*(|k|m|g)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"not a rate: {rate!r} (for example 2mbit, 500kbit)")
    scale = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}[m.group(2)]
    bits = float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)
    if bits <= 0:
        raise ValueError(f"rate must be positive: {rate!r}")
    return int(bits)


def netem_available() -> bool:
    """Whether the kernel has ``sch_netem`` (probed once in a throw-away namespace)."""
    global _NETEM
    if _NETEM is None:
        ns = f"{PREFIX}probe-{os.getpid()}"
        if sh("ip", "netns", "add", ns, check=False).returncode != 0:
            _NETEM = False
            return False
        try:
            _NETEM = sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root",
                        "netem", "loss", "1%", check=False).returncode == 0
        finally:
            sh("ip", "netns", "del", ns, check=False)
    return _NETEM


_NETEM: bool | None = None


@dataclass
class Site:
    name: str
    index: int
    switch: str  # the switch namespace
    hosts: list[Host] = field(default_factory=list)
    gateway: str | None = None  # the gateway namespace (two or more sites)
    wan_link: str | None = None  # the router's end of the WAN link

    @property
    def subnet(self) -> str:
        return f"198.18.{self.index}.0/24"

    @property
    def gateway_address(self) -> str:
        return f"198.18.{self.index}.1"


@dataclass
class Host:
    name: str
    site: Site
    netns: str
    address: str
    link: str  # the switch end of its veth pair
    cgroup: HostCgroup | None = None
    rate: str | None = None
    loss: float = 0.0
    up: bool = True


@dataclass
class Mechanisms:
    rate: str = "tbf"
    loss: str = "iptables"
    memory: str = ""
    cpu: str = ""

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in self.__dict__.items() if v}


class LabNet:
    """A lab network; use it as a context manager so that everything it made is removed
    on leaving, on an error or on Ctrl-C. Every object is recorded in the state file
    (:class:`~dfl_agent.cli.lab.state.LabState`) as it is made."""

    def __init__(self, run_id: str | None = None, *, state_dir: Path | None = None,
                 cgroup_root: str | None = None):
        self.run_id = run_id or secrets.token_hex(4)
        if not re.fullmatch(r"[0-9a-f]{4,16}", self.run_id):
            raise ValueError(f"a lab's run id is 4 to 16 hex digits, not {self.run_id!r}")
        self.state = LabState(self.run_id, state_dir)
        self.sites: dict[str, Site] = {}
        self.hosts: dict[str, Host] = {}
        self.router: str | None = None
        self.mechanisms = Mechanisms(loss="netem" if netem_available() else "iptables")
        self._cgroup_root = cgroup_root
        self._links = 0
        self._procs: dict[int, tuple[subprocess.Popen[Any], dict[str, Any]]] = {}
        self._wan: dict[str, Any] = {"rate": None, "loss": 0.0}
        self._oversubscribed = False
        self.state.write()

    # ---- naming -------------------------------------------------------------------
    def ns(self, name: str) -> str:
        return f"{PREFIX}{self.run_id}-{name}"

    def _link_name(self) -> str:
        name = f"dl{self.run_id[:4]}{self._links}"
        self._links += 1
        assert len(name) <= 15
        return name

    def _add_ns(self, name: str) -> str:
        ns = self.ns(name)
        sh("ip", "netns", "add", ns)
        self.state.add("netns", name=ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _veth(self, ns_a: str, ns_b: str, name_b: str) -> str:
        """A veth pair from ``ns_a`` (end named dl...) to ``ns_b`` (end ``name_b``)."""
        name_a = self._link_name()
        sh("ip", "link", "add", name_a, "netns", ns_a, "type", "veth", "peer", "name", name_b, "netns", ns_b)
        self.state.add("link", netns=ns_a, name=name_a)
        return name_a

    # ---- building -----------------------------------------------------------------
    def add_site(self, name: str) -> Site:
        if not _NAME.match(name) or name in self.sites:
            raise ValueError(f"bad or repeated site name {name!r}")
        if len(self.sites) >= 250:
            raise ValueError("at most 250 sites")
        sw = self._add_ns(f"sw-{name}")
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        site = Site(name, len(self.sites), sw)
        self.sites[name] = site
        return site

    def _plug(self, site: Site, ns: str, name: str) -> str:
        link = self._veth(site.switch, ns, name)
        sh("ip", "-n", site.switch, "link", "set", link, "master", "br0")
        sh("ip", "-n", site.switch, "link", "set", link, "up")
        sh("ip", "-n", ns, "link", "set", name, "up")
        return link

    def add_host(self, name: str, site: str, *, cpu: float | None = None, memory_mb: int | None = None,
                 rate: str | None = None, loss: float = 0.0) -> Host:
        """A host namespace on the site's bridge, with its cgroup (a CPU quota of ``cpu``
        cores, a memory limit of ``memory_mb`` MiB; neither: accounting only) and its
        link's rate and loss."""
        if not _NAME.match(name) or name in self.hosts or name.startswith(("sw-", "gw-")) or name == "router":
            raise ValueError(f"bad or repeated host name {name!r}")
        s = self.sites[site]
        if len(s.hosts) >= 240:
            raise ValueError(f"site {site}: at most 240 hosts")
        ns = self._add_ns(name)
        link = self._plug(s, ns, "eth0")
        address = f"198.18.{s.index}.{10 + len(s.hosts)}"
        sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        sh("ip", "-n", ns, "route", "add", LAB_NET, "via", s.gateway_address, "dev", "eth0", "onlink")
        sh("ip", "-n", ns, "route", "add", MCAST_NET, "dev", "eth0")
        cg = HostCgroup(self.run_id, name, cpu=cpu, memory_mb=memory_mb,
                        record=lambda p: self.state.add("cgroup", path=str(p)), root=self._cgroup_root)
        self.mechanisms.memory = f"cgroup-v{cg.version}"
        if cpu:
            self.mechanisms.cpu = f"cgroup-v{cg.version}"
        host = Host(name, s, ns, address, link, cg)
        cores = os.cpu_count() or 1
        if cpu and not self._oversubscribed and self.cpu_total() + cpu > cores:
            self._oversubscribed = True
            log.warning("the hosts' CPU quotas add up to %.2f cores, more than this machine's %d: "
                        "devices will get less than their share", self.cpu_total() + cpu, cores)
        s.hosts.append(host)
        self.hosts[name] = host
        if rate or loss:
            self.shape(name, rate=rate, loss=loss)
        return host

    def cpu_total(self) -> float:
        """The hosts' CPU quotas added up (in cores)."""
        return sum(h.cgroup.cpu or 0.0 for h in self.hosts.values() if h.cgroup)

    def connect_sites(self, *, rate: str | None = None, loss: float = 0.0) -> str:
        """The router namespace and a gateway per site (the WAN link, shaped like a host's
        link); every site reaches every other one through it."""
        if self.router:
            raise LabError("the sites are already connected")
        self.router = self._add_ns("router")
        _forward(self.router)
        for s in self.sites.values():
            gw = self._add_ns(f"gw-{s.name}")
            s.gateway = gw
            _forward(gw)
            self._plug(s, gw, "lan0")
            sh("ip", "-n", gw, "addr", "add", f"{s.gateway_address}/24", "dev", "lan0")
            s.wan_link = self._veth(self.router, gw, "wan0")
            r_addr, g_addr = f"198.19.0.{4 * s.index + 1}", f"198.19.0.{4 * s.index + 2}"
            sh("ip", "-n", self.router, "addr", "add", f"{r_addr}/30", "dev", s.wan_link)
            sh("ip", "-n", gw, "addr", "add", f"{g_addr}/30", "dev", "wan0")
            sh("ip", "-n", self.router, "link", "set", s.wan_link, "up")
            sh("ip", "-n", gw, "link", "set", "wan0", "up")
            sh("ip", "-n", self.router, "route", "add", s.subnet, "via", g_addr)
        for s in self.sites.values():
            for t in self.sites.values():
                if t is not s:
                    assert s.gateway is not None
                    sh("ip", "-n", s.gateway, "route", "add", t.subnet, "via", f"198.19.0.{4 * s.index + 1}")
        self.shape_wan(rate=rate, loss=loss)
        return self.router

    # ---- shaping ------------------------------------------------------------------
    def _qdisc(self, ns: str, dev: str, rate: str | None, loss: float) -> None:
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        netem_loss = loss > 0 and self.mechanisms.loss == "netem"
        tc = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev)
        if rate:
            bps = parse_rate(rate)
            burst = max(16 * 1024, bps // 8 // 50)
            sh(*tc, "root", "handle", "1:", "tbf", "rate", str(bps), "burst", str(burst), "latency", "400ms")
            if netem_loss:
                sh(*tc, "parent", "1:1", "handle", "10:", "netem", "loss", f"{loss * 100:.4f}%")
        elif netem_loss:
            sh(*tc, "root", "netem", "loss", f"{loss * 100:.4f}%")

    @staticmethod
    def _drop_rules(ns: str, chain_in: str, chain_out: str, dev: str, loss: float) -> None:
        for chain in {chain_in, chain_out}:
            sh("ip", "netns", "exec", ns, "iptables", "-w", "-F", chain)
        if loss <= 0:
            return
        rule = ("-m", "statistic", "--mode", "random", "--probability", f"{loss:.6f}", "-j", "DROP")
        sh("ip", "netns", "exec", ns, "iptables", "-w", "-A", chain_in, "-i", dev, *rule)
        sh("ip", "netns", "exec", ns, "iptables", "-w", "-A", chain_out, "-o", dev, *rule)

    def shape(self, host: str, *, rate: str | None = None, loss: float = 0.0) -> None:
        """Set a host link's rate (``None``: unlimited) and random loss (0 to 1), in both
        directions, replacing what was set before."""
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss is a probability below 1, not {loss}")
        h = self.hosts[host]
        self._qdisc(h.netns, "eth0", rate, loss)
        self._qdisc(h.site.switch, h.link, rate, loss)
        if self.mechanisms.loss == "iptables":
            self._drop_rules(h.netns, "INPUT", "OUTPUT", "eth0", loss)
        h.rate, h.loss = rate, loss

    def shape_wan(self, *, rate: str | None = None, loss: float = 0.0) -> None:
        """Set the WAN links' rate and loss (each site's link to the router, both directions)."""
        if not self.router:
            raise LabError("no WAN: connect_sites() first")
        for s in self.sites.values():
            assert s.gateway and s.wan_link
            self._qdisc(s.gateway, "wan0", rate, loss)
            self._qdisc(self.router, s.wan_link, rate, loss)
            if self.mechanisms.loss == "iptables":
                self._drop_rules(s.gateway, "FORWARD", "FORWARD", "wan0", 0.0)
                if loss > 0:
                    rule = ("-m", "statistic", "--mode", "random", "--probability", f"{loss:.6f}", "-j", "DROP")
                    for d in ("-i", "-o"):
                        sh("ip", "netns", "exec", s.gateway, "iptables", "-w", "-A", "FORWARD", d, "wan0", *rule)
        self._wan = {"rate": rate, "loss": loss}

    def set_link(self, host: str, up: bool) -> None:
        """Take a host's link down (a partition: nothing passes either way) or up again."""
        h = self.hosts[host]
        sh("ip", "-n", h.site.switch, "link", "set", h.link, "up" if up else "down")
        h.up = up

    def set_wan(self, up: bool) -> None:
        """Take the whole WAN down or up (the router's end of every site's link)."""
        if not self.router:
            raise LabError("no WAN: connect_sites() first")
        for s in self.sites.values():
            assert s.wan_link
            sh("ip", "-n", self.router, "link", "set", s.wan_link, "up" if up else "down")
            if up:  # the kernel dropped the routes through a link that went down: back again
                sh("ip", "-n", self.router, "route", "replace", s.subnet, "via", f"198.19.0.{4 * s.index + 2}")

    # ---- processes ----------------------------------------------------------------
    def popen(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host's namespace and cgroups (``ip netns exec``; the
        cgroups are entered between fork and exec). The PID is recorded in the state file;
        :meth:`stop` or the teardown stops it."""
        h = self.hosts[host]
        enter = h.cgroup.enter if h.cgroup else None
        proc = subprocess.Popen(["ip", "netns", "exec", h.netns, *argv], preexec_fn=enter, **kwargs)
        obj = self.state.add("process", pid=proc.pid, start=proc_start(proc.pid), host=host)
        self._procs[proc.pid] = (proc, obj)
        return proc

    def run(self, host: str, argv: list[str], timeout: float = 30.0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the host to its end (text output captured)."""
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            self.stop(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def stop(self, proc: subprocess.Popen[Any], grace_s: float = 3.0) -> int | None:
        """Stop a process started by :meth:`popen` (SIGTERM, then SIGKILL) by its PID."""
        _, obj = self._procs.pop(proc.pid, (proc, None))
        if proc.poll() is None:
            stop_process(proc.pid, obj.get("start") if obj else None, grace_s)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if obj is not None:
            self.state.drop(obj)
        return proc.returncode

    def oom_kills(self) -> dict[str, int]:
        """OOM kills per host since its cgroup was made."""
        return {n: h.cgroup.oom_kills() for n, h in self.hosts.items() if h.cgroup}

    # ---- teardown -----------------------------------------------------------------
    def down(self) -> list[str]:
        """Stop every process and remove every object this lab made (exactly those of its
        state file), then the state file; what was removed."""
        for proc, _obj in list(self._procs.values()):
            self.stop(proc, grace_s=1.0)
        removed = teardown(self.state.doc)
        self.state.remove_file()
        return removed

    def __enter__(self) -> LabNet:
        """In the main thread, SIGTERM and SIGHUP raise :class:`SystemExit` (as Ctrl-C
        raises KeyboardInterrupt), so that a stopped builder still tears the lab down."""
        if threading.current_thread() is threading.main_thread():
            def _exit(signum: int, _frame: Any) -> None:
                raise SystemExit(128 + signum)

            self._old_handlers = {sig: signal.signal(sig, _exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.down()
        finally:
            for sig, old in getattr(self, "_old_handlers", {}).items():
                signal.signal(sig, old)

    def describe(self) -> list[str]:
        return [describe(o) for o in self.state.objects]


def _forward(ns: str) -> None:
    sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
