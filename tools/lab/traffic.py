"""Traffic per link: the bytes every host's link carried, sampled about once a second.

Each site's switch namespace holds the switch end of every host's veth pair; one ``ip -n
<switch> -s -j link`` per site reads all of their counters at once (and one in the router
namespace reads the WAN links, where there is a WAN). A switch end *transmits* what goes
to the host and *receives* what comes from it; these are bytes on the wire (Ethernet
frames: MQTT, TLS, TCP/IP and mDNS included), after the link's shaping and loss.

``report.json``'s ``links``: ``{host: {"bytes_to_host", "bytes_from_host", "series":
[[t_s, to, from], ...]}}`` with the counts since the first sample, ``t_s`` in seconds since
the agents started, at most :data:`MAX_POINTS` points. A WAN link is the host
``wan-<site>`` (to = into the site).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dfl_agent.cli.lab.net import LabNet

#: a link's series in report.json has at most this many points
MAX_POINTS = 300


def parse_link_stats(text: str) -> dict[str, tuple[int, int]]:
    """``ip -s -j link`` output -> ``{ifname: (rx_bytes, tx_bytes)}`` (links without
    counters are left out)."""
    out = {}
    for link in json.loads(text or "[]"):
        st = link.get("stats64") or link.get("stats") or {}
        rx, tx = st.get("rx", {}).get("bytes"), st.get("tx", {}).get("bytes")
        if isinstance(rx, int) and isinstance(tx, int) and isinstance(link.get("ifname"), str):
            out[link["ifname"]] = (rx, tx)
    return out


def link_names(lab: LabNet) -> dict[str, tuple[str, str]]:
    """``{host: (namespace, link)}``: where each link's counters are read (a host's switch
    end in its site's switch; a site's WAN link, ``wan-<site>``, at the router's end)."""
    names = {n: (h.site.switch, h.link) for n, h in lab.hosts.items()}
    if getattr(lab, "router", None):
        for s in lab.sites.values():
            if getattr(s, "wan_link", None):
                names[f"wan-{s.name}"] = (lab.router, s.wan_link)
    return names


def downsample(series: Sequence[Sequence[float]], n: int = MAX_POINTS) -> list[list[float]]:
    """At most ``n`` points of ``series``, evenly spread by index, the first and the last
    kept (counts are cumulative, so what is left still adds up)."""
    pts = [list(p) for p in series]
    if len(pts) <= n:
        return pts
    if n <= 1:
        return pts[-1:]
    step = (len(pts) - 1) / (n - 1)
    return [pts[round(i * step)] for i in range(n)]


def summarize(samples: Sequence[Mapping[str, Any]], t0: float, n: int = MAX_POINTS) -> dict[str, dict[str, Any]]:
    """``report.json``'s ``links`` from the samples (``{"t": monotonic, "links": {host:
    [to, from]}}``, counters as read): the counts since each link's first sample. A counter
    that goes back (a link made again) continues from where it was."""
    out: dict[str, dict[str, Any]] = {}
    first: dict[str, tuple[int, int]] = {}
    prev: dict[str, tuple[int, int]] = {}
    offset: dict[str, list[int]] = {}
    series: dict[str, list[list[float]]] = {}
    for s in samples:
        for host, (to, frm) in s["links"].items():
            cur = (int(to), int(frm))
            if host not in first:
                first[host], prev[host], offset[host] = cur, cur, [0, 0]
            for i in (0, 1):
                if cur[i] < prev[host][i]:  # the counter restarted: go on from where it was
                    offset[host][i] += prev[host][i]
            prev[host] = cur
            series.setdefault(host, []).append([round(s["t"] - t0, 1), cur[0] + offset[host][0] - first[host][0],
                                                cur[1] + offset[host][1] - first[host][1]])
    for host, pts in series.items():
        out[host] = {"bytes_to_host": int(pts[-1][1]), "bytes_from_host": int(pts[-1][2]),
                     "series": downsample(pts, n)}
    return out


class TrafficSampler(threading.Thread):
    """Reads every link's counters every ``interval_s`` seconds until :meth:`stop`; keeps
    the samples (:attr:`samples`) and appends each one to ``path`` as a JSON line."""

    def __init__(self, lab: LabNet, path: Path | None = None, interval_s: float = 1.0):
        super().__init__(name="lab-traffic", daemon=True)
        self.lab, self.path, self.interval_s = lab, path, interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop_event = threading.Event()

    def sample(self) -> dict[str, Any]:
        """One sample of every link (a namespace that cannot be read is skipped)."""
        names = link_names(self.lab)
        read: dict[str, dict[str, tuple[int, int]]] = {}
        for ns in sorted({ns for ns, _ in names.values()}):
            r = subprocess.run(["ip", "-n", ns, "-s", "-j", "link"], capture_output=True, text=True,
                               check=False, timeout=10)
            if r.returncode == 0:
                try:
                    read[ns] = parse_link_stats(r.stdout)
                except ValueError:
                    continue
        links = {}
        for host, (ns, link) in names.items():
            if link in read.get(ns, {}):
                rx, tx = read[ns][link]
                links[host] = [tx, rx]  # the switch end sends to the host, receives from it
        return {"t": time.monotonic(), "links": links}

    def _take(self, f: IO[str] | None) -> None:
        try:
            s = self.sample()
        except (OSError, subprocess.SubprocessError):
            return
        if s["links"]:
            self.samples.append(s)
            if f:
                f.write(json.dumps(s) + "\n")
                f.flush()

    def run(self) -> None:
        f: IO[str] | None = open(self.path, "a") if self.path else None  # noqa: SIM115 - closed below
        try:
            self._take(f)
            while not self._stop_event.wait(self.interval_s):
                self._take(f)
            self._take(f)  # the counts at the end
        finally:
            if f:
                f.close()

    def stop(self) -> None:
        """Stop sampling, after one last sample, and wait for the thread."""
        self._stop_event.set()
        if self.is_alive():
            self.join(15)
