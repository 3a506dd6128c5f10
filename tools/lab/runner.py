"""``dflctl lab run``: build a scenario's network, run the real product in it, apply the
timeline's events, write the report, and tear everything down.

Per site a broker host runs mosquitto with TLS on its lab address (``allow_anonymous
false``, the password file and ACL that ``dflctl keys enroll`` writes); with two or more
sites the WAN joins them through a router, every other site's broker is bridged to the
first site's (the hub) with a ``keys enroll --role bridge`` user, and the agents set
``mqtt.bridged``; an ``operator``
host submits runs with ``dflctl run submit --config`` and browses mDNS; each training
device runs ``dfl-agent run --config`` in its namespace and cgroup, in the production
configuration (signatures required, TLS with its own credentials, ``topk:0.01+q8``
compression with error feedback, multicast mDNS on its lab address, the on-device sample
store fed with its HAR user's windows by a feeder thread). See docs/how-to/field-lab.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tomllib

from dfl_agent.cli.lab.members import received
from dfl_agent.cli.lab.net import LabNet
from dfl_agent.cli.lab.releases import CURRENT, Release, ledger_entries, ledger_state, prepare, write_config
from dfl_agent.cli.lab.scenario import Device, Event, Scenario, upgrade_steps

if TYPE_CHECKING:
    from dfl_agent.cli.lab.traffic import TrafficSampler

PY = sys.executable
PORT = 8883
#: the compression agents run with while the agent's shipped default is no compression
COMPRESSION = "topk:0.01+q8"


def lab_compression() -> str:
    """The agent's shipped default compression spec, or :data:`COMPRESSION` where that
    default is ``none`` (the lab runs the production configuration: compressed updates)."""
    from dfl_agent.runtime.shared.config import CompressionSection

    spec = CompressionSection().spec
    return spec if spec != "none" else COMPRESSION

# the lab's mDNS browser (run in the operator's namespace): one JSON line per service
# seen, with the monotonic time (the agents' metrics use the same clock)
BROWSE = r"""
import json, sys, time
from zeroconf import ServiceBrowser, Zeroconf, ServiceStateChange
zc = Zeroconf(interfaces=[sys.argv[1]])
def seen(zeroconf, service_type, name, state_change):
    if state_change is ServiceStateChange.Added:
        info = zeroconf.get_service_info(service_type, name, 3000)
        addrs = info.parsed_addresses() if info else []
        print(json.dumps({"t": time.monotonic(), "name": name, "addresses": addrs}), flush=True)
ServiceBrowser(zc, "_dfl._tcp.local.", handlers=[seen])
print(json.dumps({"ready": time.monotonic()}), flush=True)
while True:
    time.sleep(1)
"""


def broker_conf(address: str, cafile: Path, crt: Path, key: Path, fed_dir: Path, persist: Path) -> str:
    """The shipped ``mosquitto.conf`` (TLS, logins, ACL, persistence), with the lab's
    files, bound to the broker's lab address, staying root (the files are root's)."""
    from dfl_agent.resources import resource_dir

    persist.mkdir(parents=True, exist_ok=True)
    subst = {"persistence_location": f"{persist}/", "listener": f"{PORT} {address}", "cafile": str(cafile),
             "certfile": str(crt), "keyfile": str(key), "password_file": str(fed_dir / "mosquitto.passwd"),
             "acl_file": str(fed_dir / "dfl.acl")}
    lines = []
    for line in (resource_dir("mosquitto") / "mosquitto.conf").read_text().splitlines():
        word = line.split()[0] if line.strip() and not line.startswith("#") else ""
        lines.append(f"{word} {subst[word]}" if word in subst else line)
    lines += ["", "# the lab's", "user root", "log_dest stderr", "log_type error", "log_type warning",
              "log_type notice", "log_type information", ""]
    return "\n".join(lines)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _rss_tree_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (MiB)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total / 1024


@dataclass
class Agent:
    device: Device
    state: Path
    config: Path
    log: Path
    proc: subprocess.Popen[Any] | None = None
    starts: list[float] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    #: the release its agent runs (a name of the scenario's [releases])
    release: str = CURRENT
    #: the node configuration the lab made for it, before a release wrote it (make_agent)
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class Happened:
    """An event as it happened (monotonic times)."""

    event: Event
    start: float = 0.0
    end: float | None = None


class LabRun:
    """One ``dflctl lab run``: :meth:`run` returns the report (also written to ``out``)."""

    def __init__(self, scenario: Scenario, out: Path, *, say: Callable[[str], None] | None = None):
        self.sc = scenario
        self.out = out
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.fed = "lab"
        self.agents: dict[str, Agent] = {}
        #: inference members (``role = "inference"``): dfl-infer processes
        self.members: dict[str, Agent] = {}
        self.brokers: dict[str, subprocess.Popen[Any]] = {}
        self.run_ids: list[str | None] = []
        self.run_submitted: list[float] = []
        self.happened: list[Happened] = []
        self.t0 = 0.0
        self.run_training: dict[int, float] = {}
        self.run_failed: set[int] = set()
        #: device id -> the compression spec it runs with
        self.compression: dict[str, str] = {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.notes: list[str] = []
        #: site -> its bridge user's login lines (every site but the first, the hub)
        self.bridges: dict[str, str] = {}
        #: the links' byte counters, sampled about once a second (traffic.TrafficSampler)
        self.traffic: TrafficSampler | None = None
        #: release name -> how its agents run (prepared and probed at the start of run())
        self.releases: dict[str, Release] = {CURRENT: Release(CURRENT)}
        #: every device upgrade as it happened (the report's ``upgrades``)
        self.upgrades: list[dict[str, Any]] = []

    # ---- helpers ------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def dflctl(self, *argv: str, host: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [PY, "-m", "dfl_agent.cli.dflctl", *argv]
        if host is None:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env)
        else:
            r = self.lab.run(host, cmd, timeout=timeout, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"dflctl {' '.join(argv)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()}")
        return r

    def enroll(self, name: str, state: Path, role: str = "device") -> dict[str, Any]:
        self.dflctl("keys", "enroll", name, "--federation", self.fed, "--dir", str(self.fed_dir),
                    "--state-dir", str(state), *(["--role", role] if role != "device" else []))
        return tomllib.loads((self.fed_dir / "credentials" / f"{name}.toml").read_text())

    # ---- brokers ------------------------------------------------------------------
    def start_broker(self, site: str) -> None:
        from dfl_agent.cli.broker import mosquitto_path

        host = self.lab.hosts[f"broker-{site}"]
        d = self.out / "brokers" / site
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "mosquitto.conf"
        if not conf.exists():
            crt, key = self.ca.server(f"broker-{site}", host.address)
            conf.write_text(broker_conf(host.address, self.ca.cafile, crt, key, self.fed_dir, d / "persist")
                            + self.bridge_conf(site))
        log = d / "broker.log"
        mark = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as f:
            self.brokers[site] = self.lab.popen(host.name, [str(mosquitto_path()), "-c", str(conf)],
                                                stdout=subprocess.DEVNULL, stderr=f)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text = log.read_bytes()[mark:].decode(errors="replace")
            if f"listen socket on port {PORT}" in text:
                return
            if self.brokers[site].poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"mosquitto of site {site} did not start: {log.read_text()[-2000:]}")

    def enroll_bridge(self, site: str) -> str:
        """Site ``site``'s bridge user on the hub (``dflctl keys enroll --role bridge``): the
        login lines it wrote for the site's broker."""
        name = f"bridge-{site}"
        self.dflctl("keys", "enroll", name, "--role", "bridge", "--federation", self.fed, "--dir", str(self.fed_dir))
        return (self.fed_dir / "credentials" / f"{name}.conf").read_text()

    def bridge_conf(self, site: str) -> str:
        """The bridge from a site's broker to the hub (the first site's), as deploy/multi-site.md
        configures it: TLS with the lab's CA, the bridge user's login, ``dfl/<fed>/#`` both
        ways at QoS 1; a lost bridge is noticed within 15 s and retried every 2 s. Nothing for
        the hub."""
        hub = self.sc.sites[0]
        if site == hub:
            return ""
        login = [ln for ln in self.bridges[site].splitlines() if ln.strip() and not ln.startswith("#")]
        return "\n".join(["# the bridge to the hub", f"connection lab-{site}-to-{hub}",
                          f"address {self.lab.hosts[f'broker-{hub}'].address}:{PORT}",
                          f"bridge_cafile {self.ca.cafile}", "bridge_insecure false", *login,
                          "bridge_protocol_version mqttv50", "cleansession true", "try_private true",
                          "notifications false", "keepalive_interval 10", "restart_timeout 2", ""])

    def stop_broker(self, site: str) -> None:
        self.lab.stop(self.brokers.pop(site), grace_s=2.0)

    def reload_brokers(self) -> None:
        """New credentials (a late joiner): mosquitto rereads its password file and ACL on SIGHUP."""
        for p in self.brokers.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGHUP)

    # ---- agents -------------------------------------------------------------------
    def make_agent(self, d: Device, creds: dict[str, Any], store_meta: dict[str, Any]) -> Agent:
        from dfl_agent.cli.lab.accuracy import checkpoints_to_keep

        state = self.out / "devices" / d.id / "state"
        host = self.lab.hosts[d.id]
        broker = self.lab.hosts[f"broker-{d.site}"].address
        raw: dict[str, Any] = {
            "federation": self.fed, "node_id": d.id, "state_dir": str(state), "seed": self.sc.seed,
            "profile": d.cls.profile,
            "profile_overrides": {"limits": {"max_load_per_core": 0}, "training": {"windows": []}},
            "model": {"size": "small"}, "training": {"epochs": 1, "threads": 1},
            "data": {"dataset": "store", "spool_interval": 1.0, **store_meta},
            "deploy": {"keep": 3, "min_validation": 5},
            "mqtt": {"broker": f"{broker}:{PORT}", "tls_ca": str(self.ca.cafile), "heartbeat_interval": 2.0,
                     "bridged": len(self.sc.sites) > 1,  # two sites: every peer through the home broker
                     # as a field engineer sets it (docs: slow links): the class's link rate
                     **({"link_rate": d.cls.rate} if d.cls.rate else {}),
                     **creds.get("mqtt", {})},
            "discovery": {"mdns": True, "interfaces": [host.address], "heartbeat_timeout": 30.0},
            "compression": {"spec": lab_compression(), "error_feedback": True},
            "security": dict(creds.get("security", {}), require_signatures=True),
            "runtime": {"pause_when_disconnected": True,  # every round's checkpoint: the report measures them
                        "checkpoint_keep": checkpoints_to_keep(r.rounds for r in self.sc.runs),
                        # and they stay after the run, with every run's folder and plain round records
                        "keep_run_files": True, "keep_runs": max(20, len(self.sc.runs) + 1)},
        }
        raw = _merge(_merge(raw, self.sc.agent), d.cls.agent)
        self.compression[d.id] = str(raw.get("compression", {}).get("spec", ""))
        a = Agent(d, state, self.out / "devices" / d.id / "node.toml", self.out / "logs" / f"{d.id}.log",
                  release=d.release, raw=raw)
        self.write_agent_config(a)
        return a

    def write_agent_config(self, a: Agent) -> None:
        """The agent's ``node.toml`` as its release writes it: this one in-process, another one
        by itself (:func:`~dfl_agent.cli.lab.releases.write_config`), leaving out the keys it
        does not know (a note of the report names them)."""
        from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

        if a.release == CURRENT:
            text = dump_toml(config_from_dict(a.raw))
        else:
            text, dropped = write_config(self.releases[a.release], a.raw, PY, self.env)
            if dropped:
                self.notes.append(f"{a.device.id}: release {a.release} does not know {', '.join(dropped)}: "
                                  "left out of its configuration")
        if "algorithm" not in self.sc.agent and "algorithm" not in a.device.cls.agent:
            text = re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n|\n)*", "", text)  # always-on: runs come from the operator
        a.config.write_text(text)
        a.config.chmod(0o600)

    # ---- inference members ----------------------------------------------------------
    def make_member(self, d: Device, creds: dict[str, Any]) -> Agent:
        """An inference member's node configuration (``dfl-infer run --config``): its enrolled
        credentials and key, TLS to its site's broker, signatures required, mDNS on its lab
        address."""
        from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

        state = self.out / "devices" / d.id / "state"
        broker = self.lab.hosts[f"broker-{d.site}"].address
        raw = {"federation": self.fed, "node_id": d.id, "state_dir": str(state),
               "mqtt": {"broker": f"{broker}:{PORT}", "tls_ca": str(self.ca.cafile), "heartbeat_interval": 2.0,
                        **creds.get("mqtt", {})},
               "discovery": {"mdns": True, "interfaces": [self.lab.hosts[d.id].address], "heartbeat_timeout": 30.0},
               "security": dict(creds.get("security", {}), require_signatures=True)}
        path = self.out / "devices" / d.id / "node.toml"
        path.write_text(dump_toml(config_from_dict(raw)))
        path.chmod(0o600)
        return Agent(d, state, path, self.out / "logs" / f"{d.id}.log")

    def start_member(self, a: Agent) -> None:
        with open(a.log, "a") as f:
            a.proc = self.lab.popen(a.device.id, [PY, "-m", "dfl_agent.cli.infer", "run", "--config", str(a.config)],
                                    stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        a.starts.append(time.monotonic())

    def start_agent(self, a: Agent) -> None:
        """``dfl-agent run --config`` of the agent's release, in its namespace and cgroup."""
        rel = self.releases[a.release]
        with open(a.log, "a") as f:
            a.proc = self.lab.popen(a.device.id, rel.agent_argv(PY, "run", "--config", str(a.config)), stdout=f,
                                    stderr=subprocess.STDOUT, env=rel.env(self.env), start_new_session=True)
        a.starts.append(time.monotonic())

    def kill_agent(self, a: Agent) -> None:
        """A power cut: SIGKILL to the agent's whole process group (its run processes too)."""
        if a.proc is None:
            return
        try:
            os.killpg(a.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.lab.stop(a.proc, grace_s=0.5)
        a.proc = None

    def stop_agent(self, a: Agent, grace_s: float = 20.0) -> None:
        if a.proc is not None:
            self.lab.stop(a.proc, grace_s=grace_s)
            try:
                os.killpg(a.proc.pid, signal.SIGKILL)  # anything of its group that outlived it
            except (ProcessLookupError, PermissionError):
                pass
            a.proc = None

    # ---- the timeline -------------------------------------------------------------
    def _actions(self) -> list[tuple[float, Any, str, Callable[[], None]]]:
        """The timeline: ``(at_s, after, what, do)`` (``after``: None, at_s counts from the
        start; a run's index, from when that run trains on every device; a function, from the
        monotonic time it returns once it returns one)."""
        acts: list[tuple[float, Any, str, Callable[[], None]]] = []
        for d in self.sc.devices:
            if d.start_s > 0:
                acts.append((d.start_s, None, f"late joiner {d.id} enrolled and started", lambda d=d: self._late(d)))
        for i, r in enumerate(self.sc.runs):
            acts.append((r.at_s, None, f"run {i} submitted", lambda i=i: self._submit(i)))
        for e in self.sc.events:
            h = Happened(e)
            self.happened.append(h)
            if e.kind == "upgrade":  # steps that wait for a device, or for the one before
                acts += self._upgrade_actions(h)
                continue
            acts += [(at, e.after_run, what, fn) for at, what, fn in self._event_actions(h)]
        return sorted(acts, key=lambda a: a[0])

    def _event_actions(self, h: Happened) -> list[tuple[float, str, Callable[[], None]]]:
        e, lab = h.event, self.lab

        def begin(fn: Callable[[], object]) -> Callable[[], None]:
            def go() -> None:
                h.start = time.monotonic()
                fn()
            return go

        def finish(fn: Callable[[], object]) -> Callable[[], None]:
            def go() -> None:
                fn()
                h.end = time.monotonic()
            return go

        what = f"{e.kind} {e.target}"
        if e.kind == "partition":
            return [(e.at_s, f"{what}: link down", begin(lambda: lab.set_link(e.target, False))),
                    (e.end_s, f"{what}: link up", finish(lambda: lab.set_link(e.target, True)))]
        if e.kind == "flap":
            acts = []
            t, first = e.at_s, True

            def down() -> None:
                lab.set_link(e.target, False)

            while t < e.end_s:
                acts.append((t, f"{what}: down", begin(down) if first else down))
                up_at = min(t + e.down_s, e.end_s)
                acts.append((up_at, f"{what}: up", lambda: lab.set_link(e.target, True)))
                t, first = t + e.period_s, False
            acts.append((e.end_s, f"{what}: ends", finish(lambda: lab.set_link(e.target, True))))
            return acts
        if e.kind == "wan_down":
            return [(e.at_s, f"{e.kind}: WAN down", begin(lambda: lab.set_wan(False))),
                    (e.end_s, f"{e.kind}: WAN up", finish(lambda: lab.set_wan(True)))]
        if e.kind == "broker_outage":
            return [(e.at_s, f"{what}: mosquitto stopped", begin(lambda: self.stop_broker(e.target))),
                    (e.end_s, f"{what}: mosquitto restarted", finish(lambda: self.start_broker(e.target)))]
        if e.kind == "power_cut":
            return [(e.at_s, f"{what}: SIGKILL", begin(lambda: self.kill_agent(self.agents[e.target]))),
                    (e.end_s, f"{what}: agent restarted", finish(lambda: self.start_agent(self.agents[e.target])))]
        host = lab.hosts[e.target]
        before = {"rate": host.rate, "loss": host.loss}

        def change() -> None:
            if e.kind == "loss":
                lab.shape(e.target, rate=host.rate, loss=float(e.value or 0))
            else:
                lab.shape(e.target, rate=e.value, loss=host.loss)

        acts = [(e.at_s, f"{what} = {e.value}", begin(change))]
        if e.duration_s > 0:
            acts.append((e.end_s, f"{what} restored", finish(lambda: lab.shape(e.target, **before))))
        else:
            acts.append((e.at_s, f"{what} set", finish(lambda: None)))
        return acts

    def _upgrade_actions(self, h: Happened) -> list[tuple[float, Any, str, Callable[[], None]]]:
        """An upgrade event's steps (:func:`~dfl_agent.cli.lab.scenario.upgrade_steps`) as
        timeline actions ``(at_s, after, what, do)``: each device's agent stopped (SIGTERM, as
        ``systemctl stop`` does), switched to the new release (its configuration written by that
        release) and started again ``down_s`` after it stopped; a step that waits for the device
        before it counts from when that one is back (:meth:`_back_since`)."""
        index = self.sc.events.index(h.event)
        steps = [st for st in upgrade_steps(self.sc) if st.event == index]
        acts: list[tuple[float, Any, str, Callable[[], None]]] = []
        for k, st in enumerate(steps):
            rec: dict[str, Any] = {"device": st.device, "to": st.release, "event": index}
            self.upgrades.append(rec)

            def stop(st: Any = st, rec: dict[str, Any] = rec, first: bool = k == 0) -> None:
                if first:
                    h.start = time.monotonic()
                a = self.agents.get(st.device)
                rec.update({"from": a.release if a else None, "stopped": time.monotonic(),
                            "version_before": self.releases[a.release].version_line if a else None,
                            "running_before": bool(a and a.proc is not None and a.proc.poll() is None)})
                if a is not None:
                    self.stop_agent(a)
                    rec["stop_took_s"] = round(time.monotonic() - rec["stopped"], 1)

            def start(st: Any = st, rec: dict[str, Any] = rec, last: bool = k == len(steps) - 1) -> None:
                a = self.agents.get(st.device)
                if a is not None:
                    a.release = st.release
                    self.write_agent_config(a)
                    self.start_agent(a)
                    rec.update({"started": time.monotonic(), "version_after": self.releases[st.release].version_line})
                if last:
                    h.end = time.monotonic()

            what = f"upgrade {st.device}"
            after: Any = st.after_run if st.after_device is None else partial(self._back_since, st.after_device)
            acts += [(st.delay_s, after, f"{what}: agent stopped (SIGTERM)", stop),
                     (st.down_s, partial(rec.get, "stopped"), f"{what}: agent started on release {st.release}", start)]
        return acts

    def _back_since(self, device: str) -> float | None:
        """When ``device``, upgraded last, closed its first round with a peer's update on its
        new release (monotonic), or None (not yet, or not upgraded yet)."""
        rec = next((u for u in reversed(self.upgrades) if u["device"] == device and u.get("started")), None)
        a = self.agents.get(device)
        if rec is None or a is None:
            return None
        if rec.get("back") is None:
            from dfl_agent.cli.lab.report import _records, _used_peers

            found = [r["time"] for rs in _records(a.state).values() for r in rs
                     if r.get("time", 0) > rec["started"] and _used_peers(r) > 0]
            rec["back"] = min(found) if found else None
        return rec.get("back")

    def _late(self, d: Device) -> None:
        creds = self.enroll(d.id, self.out / "devices" / d.id / "state")
        if d.role == "inference":
            m = self.members[d.id] = self.make_member(d, creds)
            self.reload_brokers()
            time.sleep(0.5)
            self.start_member(m)
            return
        a = self.agents[d.id] = self.make_agent(d, creds, self.store_meta)
        self.reload_brokers()
        time.sleep(0.5)
        self.start_agent(a)

    def _submit(self, i: int) -> None:
        r = self.sc.runs[i]
        members = r.min_members or len([d for d in self.sc.training() if d.start_s <= r.at_s])
        argv = ["run", "submit", "--config", str(self.op_config), "--operator-dir", str(self.op_dir),
                "--algorithm", r.algorithm, "--rounds", str(r.rounds), "--min-members", str(members),
                "--start-timeout", str(r.start_timeout), "--name", f"{self.sc.name} run {i}",
                "--no-wait"]  # the schedule goes on at once; the report follows each device's run
        if r.models:
            argv += ["--models", r.models]
        for k, v in r.options.items():
            argv += ["--option", f"{k}={json.dumps(v)}"]
        try:
            out = self.dflctl(*argv, host="operator", timeout=60)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # the run is reported "not submitted"
            self.notes.append(f"run {i} was not submitted: {e}")
            self.say(f"[{self.now():6.1f} s] run {i} was not submitted: {e}")
            self.run_failed.add(i)
            return
        self.run_ids[i] = out.stdout.strip()
        self.run_submitted[i] = time.monotonic()

    # ---- run ----------------------------------------------------------------------
    # the devices' ledgers are read without writing them (releases.ledger_entries): an earlier
    # release's ledger must not be taken over by this one while that release runs
    def _run_ended(self, i: int) -> bool:
        from dfl_agent.runtime.shared.descriptor import TERMINAL

        rid = self.run_ids[i]
        if i in self.run_failed:
            return True
        return bool(rid) and all(ledger_state(a.state, rid) in TERMINAL for a in self.agents.values() if a.proc)

    def _runs_done(self) -> bool:
        from dfl_agent.runtime.shared.descriptor import TERMINAL

        if any(r is None and i not in self.run_failed for i, r in enumerate(self.run_ids)):
            return False
        for a in self.agents.values():
            if a.proc is None and not a.starts:
                continue
            entries = ledger_entries(a.state)
            if any((entries.get(rid) or {}).get("state") not in TERMINAL for rid in self.run_ids if rid):
                return False
        return True

    def prepare_releases(self) -> None:
        """Every release the scenario's devices start on or are upgraded to: unpacked into
        ``OUT/releases/<name>/site`` and probed (``dfl-agent --version``, where ``dfl_agent`` is
        imported from).

        Raises:
            ReleaseError: a release that does not start, or is shadowed by another install.
        """
        names = {d.release for d in self.sc.training()} | {st.release for st in upgrade_steps(self.sc)}
        for name in sorted(names):
            rel = prepare(name, self.sc.releases.get(name), self.out / "releases")
            rel.probe(PY, self.env)
            self.releases[name] = rel
            self.say(f"release {name}: {rel.version_line} ({rel.source or 'this installation'})")

    def run(self) -> dict[str, Any]:
        from dfl_agent.cli.demo_feed import Feeder, drop_into_spool
        from dfl_agent.cli.lab.tls import LabCA
        from dfl_agent.data import load_dataset

        sc, out = self.sc, self.out
        out.mkdir(parents=True, exist_ok=True)
        out.chmod(0o755)
        for sub in ("logs", "devices", "metrics"):
            (out / sub).mkdir(exist_ok=True)
        bundle = load_dataset("har")
        pool = bundle.pool
        users = sorted({int(u) for u in pool.groups})
        train = sc.training()
        if len(train) > len(users):
            raise ValueError(f"{len(train)} training devices: HAR has only {len(users)} users to feed them")
        data: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for d, u in zip(train, users):
            m = pool.groups == u
            x, y = pool.x[m], pool.y[m]
            if sc.max_windows:
                x, y = x[:sc.max_windows], y[:sc.max_windows]
            data[d.id] = (x, y)
        store_meta = {"input_shape": list(pool.input_shape), "num_classes": pool.num_classes,
                      "class_names": list(pool.class_names)}
        self.prepare_releases()
        self.fed_dir = out / "federation"
        self.dflctl("keys", "federation-init", "--dir", str(self.fed_dir))
        self.ca = LabCA(out / "tls")
        self.run_ids = [None] * len(sc.runs)
        self.run_submitted = [0.0] * len(sc.runs)
        started = time.time()
        with LabNet() as lab:
            self.lab = lab
            self.say(f"lab {lab.run_id}: building {len(sc.devices)} device(s) on {len(sc.sites)} site(s)")
            for s in sc.sites:
                lab.add_site(s)
                lab.add_host(f"broker-{s}", s)
            lab.add_host("operator", sc.sites[0])
            for d in sc.devices:
                lab.add_host(d.id, d.site, cpu=d.cls.cpu, memory_mb=d.cls.memory_mb, rate=d.cls.rate,
                             loss=d.cls.loss)
            if len(sc.sites) > 1:  # the WAN: each site's gateway to the router
                lab.connect_sites(rate=sc.wan.get("rate"), loss=sc.wan.get("loss", 0.0))
            self.mechanisms = lab.mechanisms.as_dict()
            self._warn_overcommit(lab.cpu_total())
            self.lab_hosts = {n: h.address for n, h in lab.hosts.items()}
            self.op_dir = out / "operator"
            op = self.enroll("operator", self.op_dir, role="operator")
            op_mqtt = dict(op["mqtt"], broker=f"{lab.hosts['broker-' + sc.sites[0]].address}:{PORT}",
                           tls_ca=str(self.ca.cafile))
            from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

            self.op_config = self.op_dir / "operator.toml"
            self.op_config.write_text(dump_toml(config_from_dict(
                {"federation": self.fed, "node_id": "operator", "state_dir": str(self.op_dir), "mqtt": op_mqtt,
                 "security": op["security"]})))
            given: dict[str, int] = {}
            self.store_meta = store_meta
            for d in train:
                state = out / "devices" / d.id / "state"
                if d.start_s <= 0:
                    self.agents[d.id] = self.make_agent(d, self.enroll(d.id, state), store_meta)
                x, y = data[d.id]
                given[d.id] = min(len(y), sc.initial_windows)
                drop_into_spool(state / "spool", "initial.npz", x[:given[d.id]], y[:given[d.id]])
            for d in sc.devices:
                if d.role == "inference" and d.start_s <= 0:
                    self.members[d.id] = self.make_member(d, self.enroll(d.id, out / "devices" / d.id / "state"))
            self.bridges = {s: self.enroll_bridge(s) for s in sc.sites[1:]}  # to the hub, the first site
            for s in sc.sites:
                self.start_broker(s)
            browse_log = out / "logs" / "mdns-browse.jsonl"
            with open(browse_log, "w") as f:
                lab.popen("operator", [PY, "-c", BROWSE, lab.hosts["operator"].address], stdout=f,
                          stderr=subprocess.STDOUT, env=self.env)
            self.t0 = time.monotonic()
            from dfl_agent.cli.lab.traffic import TrafficSampler

            self.traffic = TrafficSampler(lab, out / "logs" / "traffic.jsonl")
            self.traffic.start()
            for a in self.agents.values():
                if a.device.start_s <= 0:
                    self.start_agent(a)
            for m in self.members.values():
                self.start_member(m)
            feeder = Feeder({n: out / "devices" / n / "state" / "spool" for n in data}, data, given, sc.feed_chunk,
                            sc.feed_interval_s, out / "feed.jsonl")
            feeder.limit = {n: len(data[n][1]) for n in data}
            feeder.start()
            try:
                self._timeline()
            finally:
                feeder.stop()
                feeder.join(5)
                self._settle_spools()
                self._settle_deliveries()
                for a in [*self.agents.values(), *self.members.values()]:
                    self.stop_agent(a)
                self.cgroups = {n: {"peak_mb": h.cgroup.peak_mb(), "oom_kills": h.cgroup.oom_kills(),
                                    "limit_mb": h.cgroup.memory_mb}
                                for n, h in lab.hosts.items() if h.cgroup}
                self.traffic.stop()
                self.lab_id = lab.run_id
        from dfl_agent.cli.lab.report import build_report

        return build_report(self, feeder, bundle, started)

    def _warn_overcommit(self, quotas: float) -> None:
        """A note in the report when the devices' CPU quotas add up to more than this host's
        cores (:class:`LabNet` has warned on the console): the devices then compete for the
        cores, and their times are longer than on real devices of the same class."""
        cores = os.cpu_count() or 1
        if quotas > cores:
            self.notes.append(f"the devices' CPU quotas add up to {quotas:g} cores, more than this host's {cores}: "
                              "they compete for the cores, so times are longer than on real devices")

    def _training_since(self, i: int) -> float | None:
        """When run ``i`` had closed its first round on every device running (monotonic)."""
        if i in self.run_training:
            return self.run_training[i]
        rid = self.run_ids[i] if i < len(self.run_ids) else None
        if not rid:
            return None
        for a in self.agents.values():
            if a.proc is None:
                continue
            m = a.state / "runs" / rid / "metrics.jsonl"
            if not m.exists() or m.stat().st_size == 0:
                return None
        self.run_training[i] = time.monotonic()
        self.say(f"[{self.now():6.1f} s] run {i} trains on every device")
        return self.run_training[i]

    def _timeline(self) -> None:
        acts = self._actions()
        done = [False] * len(acts)
        while True:
            t = self.now()
            for k, (at, after, what, fn) in enumerate(acts):
                if done[k]:
                    continue
                base = 0.0
                if callable(after):  # a moment that comes when it comes (an upgraded device is back)
                    moment = after()
                    if moment is None:
                        continue
                    base = moment - self.t0
                elif after is not None:
                    since = self._training_since(after)
                    if since is None:
                        if self._run_ended(after):  # it never trained: this step can never come
                            self.notes.append(f"not done: {what} (run {after} ended before it trained)")
                            self.say(f"[{t:6.1f} s] skipped: {what} (run {after} ended before it trained)")
                            done[k] = True
                        continue
                    base = since - self.t0
                if base + at <= t:
                    self.say(f"[{t:6.1f} s] {what}")
                    fn()
                    done[k] = True
            for a in [*self.agents.values(), *self.members.values()]:
                if a.proc is not None:
                    if a.proc.poll() is not None:
                        self.notes.append(f"{a.device.id}: the agent exited with {a.proc.returncode} at {t:.0f} s")
                        self.say(f"[{t:6.1f} s] {a.device.id}: agent exited ({a.proc.returncode})")
                        self.lab.stop(a.proc)
                        a.proc = None
                    else:
                        a.peak_rss_mb = max(a.peak_rss_mb, _rss_tree_mb(a.proc.pid))
            if t >= self.sc.duration_s:
                self.notes.append(f"the scenario's duration ({self.sc.duration_s:.0f} s) ran out"
                                  + ("" if all(done) else f" with {done.count(False)} timeline step(s) not done"))
                self.say(f"[{t:6.1f} s] the scenario's duration ran out")
                return
            if all(done) and self._runs_done():
                self.say(f"[{t:6.1f} s] every run has ended on every device")
                return
            time.sleep(0.5)

    def _settle_deliveries(self, timeout: float = 30.0) -> None:
        """Give the devices' services a moment to send each deployed run's model to the
        inference members still running (they send it from the service, every few seconds,
        after the run process has ended): until every member's ``models.jsonl`` names every run
        deployed on some device, or ``timeout`` seconds.  What is still missing then is what the
        ``inference_received`` check reports."""
        members = [m for m in self.members.values() if m.proc is not None and m.proc.poll() is None]
        if not members:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            deployed = {rid for a in self.agents.values() for rid in _deployed_runs(a.state)}
            if all(deployed <= {g.get("run_id") for g in received(m.state)} for m in members):
                return
            time.sleep(0.5)

    def _settle_spools(self, timeout: float = 10.0) -> None:
        """Give the agents a moment to ingest what was fed last."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(not [p for p in (a.state / "spool").glob("*.npz")] for a in self.agents.values() if a.proc):
                return
            time.sleep(0.5)


def _deployed_runs(state: Path) -> set[str]:
    """The runs whose model a device deployed (its versions' manifests' ``run_id``)."""
    from dfl_agent.deploy.versions import DeployError, ModelStore

    store, out = ModelStore(state), set()
    for v in store.versions():
        try:
            rid = store.manifest(v).get("run_id")
        except (DeployError, AttributeError):
            continue
        if isinstance(rid, str):
            out.add(rid)
    return out
