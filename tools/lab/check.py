"""``dflctl lab check``: which of the host's capabilities the lab can use.

Each probe makes throw-away objects (a namespace ``dfl-lab-check-<pid>``, a cgroup folder
``dfl-lab-check-<pid>``) and removes them. The lab can run when it is root on Linux and
network namespaces, veth pairs and bridges, ``tbf``, one loss mechanism (``netem`` or
``iptables -m statistic``) and the memory and CPU cgroup controllers all work.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dfl_agent.cli.lab.cgroups import hierarchy
from dfl_agent.cli.lab.net import sh


@dataclass
class Capability:
    name: str
    ok: bool
    detail: str
    required: bool = True


def blocker() -> str | None:
    """Why the lab cannot run here at all (not Linux, not root, no ``ip``), or None."""
    if not sys.platform.startswith("linux"):
        return f"the lab needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, qdiscs and cgroups): run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the lab needs the {tool} command (apt install iproute2)"
    return None


def _cgroup(controller: str) -> Capability:
    found = hierarchy(controller)
    name = f"cgroup {controller}"
    if isinstance(found, str):
        return Capability(name, False, found)
    version, mount = found
    probe = mount / f"dfl-lab-check-{os.getpid()}"
    try:
        probe.mkdir()
        knob = ("memory.max" if version == 2 else "memory.limit_in_bytes") if controller == "memory" else (
            "cpu.max" if version == 2 else "cpu.cfs_quota_us")
        if not (probe / knob).exists():
            return Capability(name, False, f"cgroup v{version} at {mount} has no {knob}")
    except OSError as e:
        return Capability(name, False, f"cannot make a cgroup under {mount}: {e.strerror or e}")
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return Capability(name, True, f"cgroup v{version} at {mount}")


def probe() -> list[Capability]:
    """Probe every capability (as root on Linux; see :func:`blocker`)."""
    caps: list[Capability] = []
    ns = f"dfl-lab-check-{os.getpid()}"
    r = sh("ip", "netns", "add", ns, check=False)
    if r.returncode != 0:
        caps.append(Capability("network namespaces", False, (r.stderr or r.stdout).strip() or "ip netns add failed"))
        caps += [_cgroup("memory"), _cgroup("cpu")]
        return caps
    try:
        caps.append(Capability("network namespaces", True, "ip netns add/del"))

        def run(*argv: str) -> str | None:
            res = sh("ip", "netns", "exec", ns, *argv, check=False)
            return None if res.returncode == 0 else (res.stderr or res.stdout).strip() or f"exit {res.returncode}"

        err = (run("ip", "link", "add", "br0", "type", "bridge")
               or run("ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1")
               or run("ip", "link", "set", "v0", "master", "br0")
               or run("ip", "link", "set", "v0", "up") or run("ip", "link", "set", "br0", "up"))
        caps.append(Capability("veth and bridge", err is None, err or "veth pair on a bridge"))
        err = run("tc", "qdisc", "add", "dev", "v1", "root", "tbf", "rate", "2mbit", "burst", "16kb", "latency", "400ms")
        caps.append(Capability("tc tbf (rate)", err is None, err or "rate limits"))
        err = run("tc", "qdisc", "replace", "dev", "v1", "root", "netem", "loss", "1%")
        caps.append(Capability("sch_netem (loss, delay)", err is None,
                               "loss and delay" if err is None else f"absent ({err}); loss uses iptables statistic",
                               required=False))
        if shutil.which("iptables") is None:
            err = "iptables is not installed (apt install iptables)"
        else:
            err = run("iptables", "-w", "-A", "OUTPUT", "-o", "v1", "-m", "statistic", "--mode", "random",
                      "--probability", "0.5", "-j", "DROP")
        caps.append(Capability("iptables statistic (loss)", err is None, err or "random drop", required=False))
    finally:
        sh("ip", "netns", "del", ns, check=False)
    caps += [_cgroup("memory"), _cgroup("cpu")]
    return caps


def missing(caps: list[Capability]) -> list[str]:
    """What the lab lacks to run, from the probes (empty: it can run)."""
    out = [c.name for c in caps if c.required and not c.ok]
    by = {c.name: c for c in caps}
    loss = [by.get("sch_netem (loss, delay)"), by.get("iptables statistic (loss)")]
    if not any(c and c.ok for c in loss):
        out.append("a loss mechanism (sch_netem or iptables statistic)")
    return out


def main() -> int:
    """Print one line per capability; 0 when the lab can run, 2 (one line) when not."""
    why = blocker()
    if why:
        print(f"dflctl lab: cannot run here: {why}", file=sys.stderr)
        return 2
    caps = probe()
    width = max(len(c.name) for c in caps)
    for c in caps:
        mark = "ok" if c.ok else ("missing" if c.required else "absent")
        print(f"{c.name:<{width}}  {mark:<7}  {c.detail}")
    lack = missing(caps)
    if lack:
        print(f"dflctl lab: cannot run here: missing {', '.join(lack)}", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    print(f"the lab can run here ({cores} cores; state files in {Path(os.environ.get('DFL_LAB_STATE_DIR') or '/run/dfl-lab')})")
    return 0
