"""Operator commands of ``dflctl`` (issue 10: operations).

- ``install-service``: install the systemd units, the sysusers.d user, the node
  configuration and the resource limits of the device profile (``--dry-run`` shows the
  plan and writes nothing; ``--root DIR`` installs into a staging tree).
- ``watch``: a live table of a federation's nodes (presence + status).
- ``doctor``: checks a device can run the agent — configuration, broker reachable,
  mDNS on the chosen interface, clock, disk, permissions, checkpoint readable.

Each takes ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent.cli.output import json_doc
from dfl_agent.extras import extra_hint

if TYPE_CHECKING:
    from dfl_agent.cli.dflctl import DflctlParser

UNIT_DIR = "etc/systemd/system"
SYSUSERS_DIR = "etc/sysusers.d"
CONFIG_DIR = "etc/dfl-agent"
SERVICE_USER = "dfl-agent"


def _source_dir() -> Path:
    """The shipped ``systemd/`` folder (installed package or repository checkout)."""
    from dfl_agent.resources import resource_dir

    return resource_dir("systemd")


def default_exec() -> str:
    """The ``dfl-agent`` executable of this installation (next to the Python running us)."""
    cand = Path(sys.executable).parent / "dfl-agent"
    if cand.exists():
        return str(cand)
    found = shutil.which("dfl-agent")
    return found or "/usr/local/bin/dfl-agent"


#: folders the shipped unit hides from the service (ProtectHome=yes, PrivateTmp=yes)
HIDDEN_PREFIXES = ("/home", "/root", "/run/user", "/tmp", "/var/tmp")


def hidden_from_service(exe: str) -> str | None:
    """The folder among :data:`HIDDEN_PREFIXES` that holds ``exe`` (after resolving links),
    or None when the service can see it."""
    for path in {exe, str(Path(exe).resolve())}:
        for prefix in HIDDEN_PREFIXES:
            if path == prefix or path.startswith(prefix + "/"):
                return prefix
    return None


def profile_resources(profile: str | None) -> tuple[str, list[tuple[str, str]]]:
    """The profile's name and its ``[resources]`` as systemd ``(directive, value)`` pairs.

    Args:
        profile: a profile name (``raspberry-pi-4``, an alias) or the path of a profile
            TOML; None: no profile.

    Returns:
        ``("", [])`` without a profile; else the name and
        :meth:`dfl_agent.profiles.schema.ResourcesSection.systemd_directives`.

    Raises:
        ValueError: unknown profile, unreadable or invalid file (one line, the key named).
    """
    if not profile:
        return "", []
    from dfl_agent.profiles.schema import ProfileError, get_profile, load_profile_file

    try:
        prof = load_profile_file(profile) if Path(profile).is_file() else get_profile(profile)
    except ProfileError as exc:
        raise ValueError(f"--profile {profile}: {exc}") from None
    return prof.name, prof.resources.systemd_directives()


def unit_directives(unit_text: str, section: str = "Service") -> dict[str, list[str]]:
    """The ``Key=value`` lines of one section of a unit file (comments skipped; a key that
    repeats keeps every value in order)."""
    out: dict[str, list[str]] = {}
    current = ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif current == section and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def resource_changes(unit_text: str, directives: list[tuple[str, str]]) -> list[dict[str, str]]:
    """What the drop-in changes: one ``{"directive", "unit", "profile"}`` per directive
    (``unit`` is the shipped unit's value, ``"(unset)"`` when it sets none)."""
    base = unit_directives(unit_text)
    merged: dict[str, list[str]] = {}
    for key, value in directives:
        merged.setdefault(key, []).append(value)
    return [{"directive": key, "unit": " ".join(base.get(key, [])) or "(unset)", "profile": ", ".join(values)}
            for key, values in merged.items()]


@dataclasses.dataclass
class Plan:
    """What ``install-service`` does: files (path -> (content, mode)) then commands.
    A content in bytes (the node configuration) is written exactly as it is."""

    files: dict[str, tuple[str | bytes, int]] = dataclasses.field(default_factory=dict)
    commands: list[list[str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    #: what the profile's drop-in changes against the unit (see :func:`resource_changes`)
    resources: list[dict[str, str]] = dataclasses.field(default_factory=list)


def build_plan(a: argparse.Namespace) -> Plan:
    """Render every file ``install-service`` writes (no side effects).

    Raises:
        ValueError: bad instance name, config or profile.
    """
    from dfl_agent.runtime.shared.config import ConfigError, load_config
    from dfl_agent.transport.wire import valid_id

    src = _source_dir()
    root = Path(a.root or "/")
    inst = a.instance
    if inst is not None and not valid_id(inst):
        raise ValueError(f"--instance {inst!r}: must match [A-Za-z0-9_.-]{{1,64}}")
    unit_name = f"dfl-agent@{inst}.service" if inst else "dfl-agent.service"
    template = "dfl-agent@.service" if inst else "dfl-agent.service"
    unit_text = (src / template).read_text(encoding="utf-8")
    exe = a.exec_path or default_exec()
    unit_text = unit_text.replace("/usr/local/bin/dfl-agent", exe)
    plan = Plan()
    hidden = hidden_from_service(exe)
    if hidden:
        plan.warnings.append(
            f"ExecStart {exe} lies under {hidden}, which the unit hides from the service "
            f"({'ProtectHome=yes' if hidden != '/tmp' else 'PrivateTmp=yes'}): it will not start. Install "
            "dfl-agent system-wide as docs/install.md shows (python3 -m venv /opt/dfl-agent, then "
            "/opt/dfl-agent/bin/pip install torch==2.13.0 with the CPU index URL on a machine without an "
            f"NVIDIA GPU, then /opt/dfl-agent/bin/{extra_hint('train')}) and pass --exec /opt/dfl-agent/bin/dfl-agent")
    plan.files[str(root / UNIT_DIR / template)] = (unit_text, 0o644)
    plan.files[str(root / SYSUSERS_DIR / "dfl-agent.conf")] = (
        (src / "sysusers.d" / "dfl-agent.conf").read_text(encoding="utf-8"), 0o644)
    prof_name, res = profile_resources(a.profile)
    if res:
        dropin = "[Service]\n" + "".join(f"{k}={v}\n" for k, v in res)
        plan.files[str(root / UNIT_DIR / f"{template}.d" / "50-resources.conf")] = (
            f"# resources of device profile {prof_name} (dflctl install-service --profile)\n" + dropin, 0o644)
        plan.resources = resource_changes(unit_text, res)
    elif prof_name:
        plan.notes.append(f"profile {prof_name} has no [resources]: the unit's limits apply")
    state = f"/var/lib/dfl-agent/{inst}" if inst else "/var/lib/dfl-agent"
    cfg_path = root / CONFIG_DIR / (f"{inst}.toml" if inst else "node.toml")
    if a.config:
        try:
            cfg = load_config(a.config)
            text = Path(a.config).read_bytes()  # installed as written: the validated file's bytes
        except ConfigError as exc:
            raise ValueError(f"--config: {exc}") from None
        except OSError as exc:
            raise ValueError(f"--config: cannot read {a.config}: {exc.strerror}") from None
        if os.path.normpath(cfg.state_dir) != state:
            plan.warnings.append(
                f"--config: state_dir = {cfg.state_dir!r}, but the service keeps its state in {state} "
                f"(StateDirectory=); the file is installed as written: set state_dir = \"{state}\" in it")
        if inst and cfg.federation != inst:
            plan.notes.append(f"instance {inst!r} runs federation {cfg.federation!r} (the config's federation)")
        if cfg_path.exists() and not a.force:
            plan.notes.append(f"{cfg_path} exists; kept (--force replaces it)")
        else:
            plan.files[str(cfg_path)] = (text, 0o640)
    elif not cfg_path.exists():
        plan.notes.append(f"no --config: write {cfg_path} yourself before starting the service")
    if a.root in (None, "/"):
        plan.commands.append(["systemd-sysusers", str(root / SYSUSERS_DIR / "dfl-agent.conf")])
        if a.config:
            plan.commands.append(["chown", f"root:{SERVICE_USER}", str(cfg_path)])
        plan.commands.append(["systemctl", "daemon-reload"])
        if not a.no_start:
            plan.commands.append(["systemctl", "enable", "--now", unit_name])
    else:
        plan.notes.append("--root given: files staged only, no systemctl/systemd-sysusers")
    return plan


def _text(content: str | bytes) -> str:
    return content.decode("utf-8", errors="replace") if isinstance(content, bytes) else content


def cmd_install_service(a: argparse.Namespace) -> int:
    plan = build_plan(a)
    if a.json:
        print(json_doc({"dry_run": a.dry_run, "files": {p: {"mode": oct(m), "content": _text(c)}
                                                         for p, (c, m) in plan.files.items()},
                          "commands": plan.commands, "resources": plan.resources, "notes": plan.notes,
                          "warnings": plan.warnings}, indent=2))
    else:
        for path, (content, mode) in plan.files.items():
            print(f"{'would write' if a.dry_run else 'write'} {path} (mode {oct(mode)})")
            if a.dry_run and a.verbose:
                print("    " + _text(content).replace("\n", "\n    "))
        if plan.resources:
            print("resources (unit -> device profile):")
            for ch in plan.resources:
                print(f"    {ch['directive']}: {ch['unit']} -> {ch['profile']}")
        for cmd in plan.commands:
            print(f"{'would run' if a.dry_run else 'run'}: {' '.join(cmd)}")
        for note in plan.notes:
            print(f"note: {note}")
    for warning in plan.warnings:
        print(f"dflctl: warning: {warning}", file=sys.stderr)
    if a.dry_run:
        return 0
    from dfl_agent.fsutil import atomic_write

    for path, (content, mode) in plan.files.items():
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(p, content, mode=mode)
        except OSError as exc:
            print(f"dflctl: cannot write {p}: {exc.strerror} (run as root, or stage with --root DIR)",
                  file=sys.stderr)
            return 1
    for cmd in plan.commands:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"dflctl: {' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}", file=sys.stderr)
            return 1
    return 0


# -- watch -----------------------------------------------------------------------------

def _observer(a: argparse.Namespace):
    """The connected observer of the fleet options' federation (``--config``'s trust material
    verifies signatures where the federation is signed)."""
    from dfl_agent.cli import fleet
    from dfl_agent.cli.observer import Observer

    t = fleet.target(a)
    obs = Observer(t)
    obs.guard = fleet.trust_guard(t)
    return obs.start(timeout=a.timeout)


def cmd_watch(a: argparse.Namespace) -> int:
    from dfl_agent.cli import fleet
    from dfl_agent.cli.cli_runs import RUN_COLUMNS, observed_runs, run_rows
    from dfl_agent.cli.tables import PEER_COLUMNS, STATUS_COLUMNS, peer_rows, render_table, status_rows

    obs = _observer(a)
    obs.settle()
    if not obs.seen_anything():  # a live view waits for nodes, but says why it is empty
        print(f"dflctl watch: {fleet.absent(obs.target)}; watching", file=sys.stderr)
    n = 0
    try:
        if a.json:
            while a.count is None or n < a.count:
                statuses, presence = obs.snapshot()
                seen = obs.privacy_watch.view()  # devices whose reported epsilon went down while watched
                print(json_doc({"time": time.time(), "peers": peer_rows(statuses, presence, privacy_seen=seen),
                                "status": status_rows(statuses, presence=presence, privacy_seen=seen),
                                "runs": run_rows(observed_runs(obs, obs.target)[0], statuses)}, indent=None),
                      flush=True)
                n += 1
                if a.count is None or n < a.count:
                    time.sleep(a.interval)
            return 0
        from rich.console import Group
        from rich.live import Live

        def view():
            statuses, presence = obs.snapshot()
            seen = obs.privacy_watch.view()
            return Group(render_table(f"peers ({time.strftime('%H:%M:%S')})",
                                      peer_rows(statuses, presence, privacy_seen=seen), PEER_COLUMNS),
                         render_table("status", status_rows(statuses, presence=presence, privacy_seen=seen),
                                      STATUS_COLUMNS),
                         render_table("runs", run_rows(observed_runs(obs, obs.target)[0], statuses), RUN_COLUMNS))

        if not sys.stdout.isatty():  # no terminal: one printed frame per refresh (Live would print the last only)
            from dfl_agent.cli.output import console

            con = console()
            while a.count is None or n < a.count:
                con.print(view())
                n += 1
                if a.count is None or n < a.count:
                    time.sleep(a.interval)
            return 0
        with Live(view(), refresh_per_second=4) as live:
            while a.count is None or n < a.count:
                live.update(view())
                n += 1
                if a.count is None or n < a.count:
                    time.sleep(a.interval)
        return 0
    finally:  # Ctrl-C goes on to dflctl's main: "interrupted", exit 130
        obs.stop()


# -- doctor ----------------------------------------------------------------------------

def _check(name: str, status: str, detail: str) -> dict[str, str]:
    return {"check": name, "status": status, "detail": detail}


def check_broker(endpoint: Any, timeout: float = 5.0) -> dict[str, str]:
    """MQTT CONNECT/CONNACK with the broker (a TCP port alone is not enough), with the
    credentials and TLS of ``endpoint`` (a :class:`~dfl_agent.cli.fleet.FleetTarget`, or a
    ``host:port`` without them); a failure says why (refused, unknown host, TLS, not authorised)."""
    from dfl_agent.cli import fleet

    t = fleet.as_target(endpoint)
    t0 = time.monotonic()
    try:
        fleet.close(t.open("dflctl-doctor", timeout))
    except (ConnectionError, ValueError) as exc:
        return _check("broker", "fail", str(exc))
    who = f" as {t.username}" if t.username else ""
    tls = " over TLS" if t.tls_ca else ""
    return _check("broker", "ok", f"{t.broker} accepted{who}{tls} in {1000 * (time.monotonic() - t0):.0f} ms")


def check_mdns(interface: str, timeout: float = 3.0) -> dict[str, str]:
    """Announce a test service on ``interface`` with one zeroconf instance and resolve
    it with a second one: multicast must go out and come back on that interface."""
    import uuid

    from zeroconf import ServiceInfo, Zeroconf

    stype = "_dfl-doctor._tcp.local."
    name = f"doctor-{uuid.uuid4().hex[:8]}.{stype}"
    try:
        addr = socket.inet_aton(interface)
    except OSError:
        return _check("mdns", "fail", f"interface {interface!r} must be an IPv4 address")
    a = b = None
    try:
        a = Zeroconf(interfaces=[interface])
        b = Zeroconf(interfaces=[interface])
        a.register_service(ServiceInfo(stype, name, addresses=[addr], port=9, properties={"doctor": "1"}))
        info = b.get_service_info(stype, name, timeout=int(timeout * 1000))
    except OSError as exc:
        return _check("mdns", "fail", f"on {interface}: {exc}")
    finally:
        for zc in (a, b):
            if zc is not None:
                zc.close()
    if info is None:
        return _check("mdns", "fail", f"a service announced on {interface} was not resolved within {timeout:.0f}s "
                                      "(multicast blocked? firewall on UDP 5353?)")
    return _check("mdns", "ok", f"announce + resolve on {interface}")


def check_clock() -> dict[str, str]:
    """NTP synchronisation (timedatectl or systemd-timesyncd's flag); message
    timestamps and certificate checks need a sane clock."""
    if time.time() < 1_704_067_200:  # 2024-01-01
        return _check("clock", "fail", f"system time {time.ctime()} is in the past: no RTC/NTP?")
    if shutil.which("timedatectl"):
        r = subprocess.run(["timedatectl", "show", "-p", "NTPSynchronized", "--value"], capture_output=True,
                           text=True, timeout=5)
        if r.returncode == 0 and r.stdout.strip() in ("yes", "no"):
            return _check("clock", "ok" if r.stdout.strip() == "yes" else "warn",
                          "NTP synchronized" if r.stdout.strip() == "yes" else "NTP not synchronized")
    if Path("/run/systemd/timesync/synchronized").exists():
        return _check("clock", "ok", "systemd-timesyncd synchronized")
    return _check("clock", "warn", f"cannot tell whether the clock is synchronized (now {time.ctime()})")


def check_certificate(cfg: Any, state_dir: str, now: float | None = None) -> list[dict[str, str]]:
    """The node's certificate (``security.certificate``, else ``STATE_DIR/node_cert.json``;
    none: no check): verified with ``security.federation_key`` when set; ``fail`` when it
    expired (the node and the date named) or the node's saved revocation list revokes it,
    ``warn`` within :data:`~dfl_agent.security.keys.EXPIRY_WARNING_DAYS` days of its expiry.  A
    certificate not yet valid by this device's clock is a clock problem (a device without a
    real-time clock), reported as a failed ``clock`` check, not as a bad certificate."""
    from dfl_agent.security.keys import (
        CERT_FILE,
        EXPIRY_WARNING_DAYS,
        CertificateExpired,
        CertificateNotYetValid,
        SecurityError,
        load_certificate,
        parse_public_key,
        utc_date,
        verify_certificate,
    )
    from dfl_agent.security.revocation import REVOCATIONS_FILE, Revocations

    sec = cfg.security
    path = Path(sec.certificate) if sec.certificate else Path(state_dir) / CERT_FILE
    if not path.exists():
        return []
    now = time.time() if now is None else now
    try:
        cert = load_certificate(path)
        node = str(cert.get("node_id"))
        if sec.federation_key:
            fed_pub = parse_public_key(sec.federation_key)
            verify_certificate(cert, fed_pub, cfg.federation, now)
            rev = Revocations(cfg.federation, fed_pub, Path(state_dir) / REVOCATIONS_FILE, persist=False)
            hit = rev.revoked(node, cert.get("public_key"))
            if hit is not None:
                return [_check("certificate", "fail", f"node {node} is revoked by the federation's revocation list "
                                                      f"{rev.number}: {hit.reason}")]
    except CertificateNotYetValid as exc:
        return [_check("clock", "fail", f"{exc} (a clock problem, not an attack: peers' certificates and messages "
                                        "look wrong to this device too)"),
                _check("certificate", "warn", f"node {exc.node_id}: not yet valid by this device's clock (see clock)")]
    except CertificateExpired as exc:
        return [_check("certificate", "fail", f"{exc}: renew it with dflctl keys renew {exc.node_id}")]
    except SecurityError as exc:
        return [_check("certificate", "fail", f"{path}: {exc}")]
    exp = cert.get("expires")
    if not isinstance(exp, (int, float)):
        return [_check("certificate", "ok", f"node {node}: never expires")]
    left = (exp - now) / 86400.0
    if left <= EXPIRY_WARNING_DAYS:
        return [_check("certificate", "warn", f"the certificate of node {node} expires on {utc_date(exp)} "
                                              f"(in {left:.0f} days): renew it with dflctl keys renew {node}")]
    return [_check("certificate", "ok", f"node {node}: valid until {utc_date(exp)}")]


def check_disk(state_dir: str, warn_bytes: int = 1 << 30, fail_bytes: int = 200 << 20) -> dict[str, str]:
    """The state directory's size (its parts: store, models, runs, privacy, other) and the free
    space under it: ``warn`` below ``warn_bytes`` (``runtime.disk_warn_mb``), ``fail`` below
    ``fail_bytes``."""
    from dfl_agent.runtime.service.retention import free_space, usage

    free, total, p = free_space(state_dir)
    text = f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB at {p}"
    if Path(state_dir).is_dir():
        use = usage(state_dir)
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in use.items() if k != "total" and v)
        text = f"state dir {use['total'] / 2**20:.1f} MiB{f' ({parts})' if parts else ''}; {text}"
    if warn_bytes and free < warn_bytes:
        text += f" (below {warn_bytes / 2**20:.0f} MiB: runtime.disk_warn_mb)"
    return _check("disk", "fail" if free < fail_bytes else "warn" if warn_bytes and free < warn_bytes else "ok", text)


def check_permissions(state_dir: str, config: str | None, has_secret: bool) -> dict[str, str]:
    p = Path(state_dir)
    problems = []
    if p.exists():
        if not os.access(p, os.W_OK | os.X_OK):
            problems.append(f"{p} is not writable by uid {os.getuid()}")
    else:
        parent = p.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not os.access(parent, os.W_OK):
            problems.append(f"{p} does not exist and {parent} is not writable (systemd's StateDirectory= creates it)")
    if config and has_secret and Path(config).stat().st_mode & 0o004:
        problems.append(f"{config} holds an MQTT password and is world-readable (chmod 640)")
    ok = f"{p} writable" if p.exists() else f"{p} can be created"
    return _check("permissions", "fail" if problems else "ok", "; ".join(problems) or ok)


def check_checkpoint(state_dir: str) -> dict[str, str]:
    from dfl_agent.runtime.node.checkpoint import CheckpointStore

    store = CheckpointStore(Path(state_dir) / "checkpoints")
    rounds = store.rounds()
    if not rounds:
        return _check("checkpoint", "ok", "none yet (the node starts at round 1)")
    ck = store.load_latest()
    if ck is None:
        return _check("checkpoint", "fail", f"no readable checkpoint among rounds {rounds}")
    status = "ok" if ck.round == rounds[0] else "warn"
    return _check("checkpoint", status, f"resumes after round {ck.round}"
                  + ("" if status == "ok" else f" (round {rounds[0]} is unusable)"))


def cmd_doctor(a: argparse.Namespace) -> int:
    from dfl_agent.cli import fleet
    from dfl_agent.runtime.shared.config import ConfigError, NodeConfig, load_config

    results = []
    cfg = NodeConfig()
    config_ok = False
    if a.config:
        try:
            cfg = load_config(a.config)
            config_ok = True
            results.append(_check("config", "ok", f"{a.config} is valid"))
        except ConfigError as exc:
            results.append(_check("config", "fail", str(exc)))
    # the broker as the node reaches it: --config's broker, credentials and TLS (a config that
    # failed its check gives none), each connection option overriding
    t = fleet.target(argparse.Namespace(**{**vars(a), "config": a.config if config_ok else None}))
    state_dir = a.state_dir or cfg.state_dir
    results.append(check_broker(t, a.timeout))
    if cfg.discovery.mdns or a.interface:
        for iface in ([a.interface] if a.interface else cfg.discovery.interfaces):
            results.append(check_mdns(iface, a.timeout))
    results.append(check_clock())
    cert_checks = check_certificate(cfg, state_dir)
    if any(r["check"] == "clock" for r in cert_checks):  # the clock is behind the certificate: say it once
        results = [r for r in results if r["check"] != "clock"]
    results.extend(cert_checks)
    results.append(check_disk(state_dir, warn_bytes=cfg.runtime.disk_warn_mb * 2**20))
    results.append(check_permissions(state_dir, a.config, bool(cfg.mqtt.password)))
    results.append(check_checkpoint(state_dir))
    if a.json:
        print(json_doc(results, key="checks"))
    else:
        mark = {"ok": "✓", "warn": "!", "fail": "✗"}
        for r in results:
            print(f"{mark[r['status']]} {r['check']:<12} {r['detail']}")
    return 1 if any(r["status"] == "fail" for r in results) else 0


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``install-service``, ``watch`` and ``doctor`` to dflctl's sub-parsers."""
    i = sub.add_parser("install-service", help="install the systemd units, user, config and limits")
    i.add_argument("--config", default=None, help="node configuration to install (validated)")
    i.add_argument("--instance", default=None, metavar="FED",
                   help="install dfl-agent@FED (one of several federations on this device)")
    i.add_argument("--profile", default=None, help="device profile (name or TOML file) whose [resources] go into a drop-in "
                        "(MemoryMax, CPUQuota, Nice, IOWeight, device access)")
    i.add_argument("--exec", dest="exec_path", default=None, help="dfl-agent executable (default: this one)")
    i.add_argument("--root", default=None, help="install into this staging root instead of /")
    i.add_argument("--no-start", action="store_true", help="do not enable and start the unit")
    i.add_argument("--force", action="store_true", help="replace an existing node configuration")
    i.add_argument("--dry-run", action="store_true", help="show what would be done, change nothing")
    i.add_argument("--verbose", "-v", action="store_true", help="with --dry-run: print the files")
    i.add_argument("--json", action="store_true", help="the plan as one JSON document (schema_version 1)")
    i.set_defaults(func=cmd_install_service)

    from dfl_agent.cli.fleet import add_options as fleet_options

    for name, fn, helptext in (("watch", cmd_watch, "live view of a federation's nodes"),
                               ("doctor", cmd_doctor, "check broker, mDNS, clock, certificate, disk, permissions")):
        c = sub.add_parser(name, help=helptext)
        fleet_options(c)
        c.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
        if name == "watch":
            c.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
            c.add_argument("--count", type=int, default=None, help="stop after this many refreshes")
        else:
            c.add_argument("--interface", default=None, help="IPv4 address of the interface mDNS uses")
            c.add_argument("--state-dir", default=None, help="the node's state directory (default: from --config, else /var/lib/dfl-agent)")
        c.set_defaults(func=fn)
