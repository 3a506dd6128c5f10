"""A lab scenario file (TOML): what ``dflctl lab run`` builds, runs and checks.

The format (every table and key is optional unless said otherwise)::

    [lab]       duration_s, seed, dataset ("har"), perfect,
                feed_interval_s, feed_chunk, initial_windows, max_windows   (the feeder)
    [[site]]    name                                      (at least one)
    [[class]]   name, cpu, memory_mb, rate, loss, profile, agent = {...}
    [[device]]  class, site, count, role ("train", or "inference": a dfl-infer member), start_s,
                release (a name of [releases]; "current" by default)
                (at most MAX_DEVICES devices in all)
    [releases]  name = "path": a wheel of dfl-agent or a folder holding its dfl_agent package,
                relative to the folder the lab is run from; "current" (the dfl-agent that
                runs the lab) is always defined
    [wan]       rate, loss                                (two or more sites only)
    [[run]]     at_s, algorithm, rounds, models, options = {...}, min_members, start_timeout
                (algorithm, options and models checked against the registry before anything is built)
    [[event]]   at_s, kind, target, duration_s, value, period_s, down_s,
                after_run (at_s counts from when that run's first round closed on every member);
                kind "upgrade": target a training device or "all" (one at a time, the next
                period_s after the one before is back), value the release to switch to
                ("current"), duration_s the time each agent is down (:func:`upgrade_steps`)
    [checks]    samples_lost, oom_kills, max_recovery_s, max_rounds_alone,
                all_runs_deployed, discovery_via, min_final_accuracy, inference_received,
                all_upgraded, runs_trained (on unless set false: every run trained a round on some device)
    [agent]     a node-configuration fragment for every agent

Device ids are ``<class>-<n>``, n counted from 0 per class across the whole file, in the
order of the ``[[device]]`` tables. A file that breaks the format raises
:class:`ScenarioError` naming the key (``dflctl lab run`` exits 2 with it); so does one that is
not UTF-8 or nests tables and arrays deeper than :data:`~dfl_agent.tomlcheck.MAX_DEPTH` levels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from dfl_agent.cli.lab.net import parse_rate
from dfl_agent.tomlcheck import TomlFileError, read_toml

EVENT_KINDS = ("partition", "flap", "wan_down", "broker_outage", "power_cut", "loss", "rate", "upgrade")
CHECKS = ("samples_lost", "oom_kills", "max_recovery_s", "max_rounds_alone", "all_runs_deployed",
          "discovery_via", "min_final_accuracy", "inference_received", "runs_trained", "all_upgraded")
#: the most devices a scenario may have (each is a network namespace with its own agent; a site's
#: /24 has room for 240 hosts)
MAX_DEVICES = 200
_NAME = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_RELEASE = re.compile(r"^[a-z][a-z0-9_.-]{0,31}$")
#: host names the lab uses for itself (a class may not be called so)
RESERVED = ("broker", "operator", "sw", "gw", "router", "probe", "check")


class ScenarioError(ValueError):
    """A scenario file that cannot be run: ``key`` names where (``event[2].kind``)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass
class DeviceClass:
    name: str
    cpu: float | None = None
    memory_mb: int | None = None
    rate: str | None = None
    loss: float = 0.0
    profile: str = "generic-x86"
    agent: dict[str, Any] = field(default_factory=dict)


@dataclass
class Device:
    id: str
    cls: DeviceClass
    site: str
    role: str = "train"
    start_s: float = 0.0
    #: the release its agent runs at the start (a name of :attr:`Scenario.releases`)
    release: str = "current"


@dataclass
class Run:
    at_s: float
    algorithm: str = "fedavg"
    rounds: int = 3
    models: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    min_members: int | None = None
    start_timeout: float = 120.0


@dataclass
class Event:
    at_s: float
    kind: str
    target: str
    duration_s: float = 0.0
    value: str = ""
    period_s: float = 0.0
    down_s: float = 0.0
    #: at_s counts from when this run (its index) trains on every member, not from the start
    after_run: int | None = None

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s


@dataclass
class Scenario:
    path: str
    duration_s: float = 600.0
    seed: int = 0
    dataset: str = "har"
    perfect: bool = False
    feed_interval_s: float = 2.0
    feed_chunk: int = 8
    initial_windows: int = 48
    max_windows: int | None = None
    sites: list[str] = field(default_factory=list)
    classes: dict[str, DeviceClass] = field(default_factory=dict)
    devices: list[Device] = field(default_factory=list)
    wan: dict[str, Any] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)
    #: release name -> its wheel or folder ("current", the lab's own dfl-agent: None)
    releases: dict[str, Path | None] = field(default_factory=lambda: {"current": None})

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def training(self) -> list[Device]:
        return [d for d in self.devices if d.role == "train"]


# ---- parsing ----------------------------------------------------------------------------
_TYPES: dict[str, tuple[type, ...]] = {}


def _take(table: dict[str, Any], where: str, spec: dict[str, tuple[type, ...]],
          required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ScenarioError(where, "must be a table")
    for k in table:
        if k not in spec:
            raise ScenarioError(f"{where}.{k}", f"unknown key (known: {', '.join(spec)})")
    for k in required:
        if k not in table:
            raise ScenarioError(f"{where}.{k}", "missing")
    out = {}
    for k, v in table.items():
        types = spec[k]
        if isinstance(v, bool) and bool not in types:
            raise ScenarioError(f"{where}.{k}", f"must be {' or '.join(t.__name__ for t in types)}, not {v!r}")
        if not isinstance(v, types):
            raise ScenarioError(f"{where}.{k}", f"must be {' or '.join(t.__name__ for t in types)}, not {v!r}")
        out[k] = v
    return out


NUM = (int, float)


def _nonneg(where: str, v: Any) -> None:
    if v is not None and v < 0:
        raise ScenarioError(where, f"must not be negative, not {v!r}")


def _rate(where: str, v: Any) -> str | None:
    if v is None or v == "":
        return None
    try:
        parse_rate(v)
    except ValueError as e:
        raise ScenarioError(where, str(e)) from None
    return str(v)


def _loss(where: str, v: Any) -> float:
    v = float(v or 0.0)
    if not 0.0 <= v < 1.0:
        raise ScenarioError(where, f"a probability in [0, 1), not {v}")
    return v


def _check_algorithm(where: str, name: str, options: dict[str, Any], models: str | None) -> None:
    """A run's algorithm and options as every device will check them when the run comes: the
    algorithm registry (:func:`~dfl_agent.algorithms.base.get_algorithm`,
    :func:`~dfl_agent.algorithms.base.parse_options`), and its model family.

    Raises:
        ScenarioError: ``run[i].algorithm``, ``run[i].options.KEY`` or ``run[i].models``.
    """
    from dfl_agent.algorithms.base import get_algorithm, parse_options
    from dfl_agent.models.families import FAMILIES

    try:
        cls = get_algorithm(name)
    except KeyError as e:
        raise ScenarioError(f"{where}.algorithm", str(e.args[0] if e.args else e)) from None
    try:
        parse_options(cls, options, prefix=f"{where}.options")
    except ValueError as e:
        key, _, why = str(e).partition(": ")
        raise ScenarioError(key, why) from None
    if models is not None and models not in FAMILIES:
        raise ScenarioError(f"{where}.models", f"a model family ({', '.join(FAMILIES)}), not {models!r}")


def load(path: str | Path, *, perfect: bool = False, releases: dict[str, str] | None = None) -> Scenario:
    """Read and check a scenario file; ``perfect``: as if its ``[lab]`` said ``perfect = true``
    (no limits, no loss, no events: the comparison run, ``dflctl lab run --perfect``);
    ``releases``: entries of ``[releases]`` given on the command line (``--release NAME=PATH``),
    which replace the file's.

    Raises:
        ScenarioError: the file cannot be read, is not TOML, or breaks the format (the
            message names the key).
    """
    p = Path(path)
    try:
        doc = read_toml(p)  # bounded in size and nesting; a byte that is not UTF-8 named by its key
    except OSError as e:
        raise ScenarioError(str(p), f"cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(str(p), f"not TOML: {e}") from None
    except TomlFileError as e:
        raise ScenarioError(e.key or str(p), e.reason) from None
    if perfect and isinstance(doc.get("lab"), dict):
        doc["lab"]["perfect"] = True
    if releases:
        if not isinstance(doc.get("releases", {}), dict):
            raise ScenarioError("scenario.releases", "must be a table")
        doc["releases"] = {**doc.get("releases", {}), **releases}
    return parse(doc, str(p))


def parse(doc: dict[str, Any], path: str = "scenario.toml") -> Scenario:
    """A scenario from a parsed TOML document (see :func:`load`)."""
    if not isinstance(doc, dict):
        raise ScenarioError("scenario", "must be a table")
    top = _take(doc, "scenario", {"lab": (dict,), "site": (list,), "class": (list,), "device": (list,),
                                  "wan": (dict,), "run": (list,), "event": (list,), "checks": (dict,),
                                  "agent": (dict,), "releases": (dict,)}, required=("site", "class", "device"))
    lab = _take(top.get("lab", {}), "lab", {
        "duration_s": NUM, "seed": (int,), "dataset": (str,), "perfect": (bool,), "feed_interval_s": NUM,
        "feed_chunk": (int,), "initial_windows": (int,), "max_windows": (int,)})
    s = Scenario(path=path, agent=dict(top.get("agent", {})))
    for k, v in lab.items():
        if k in ("duration_s", "feed_interval_s"):
            if v <= 0:
                raise ScenarioError(f"lab.{k}", f"must be positive, not {v!r}")
            v = float(v)
        if k in ("feed_chunk", "initial_windows", "max_windows") and v <= 0:
            raise ScenarioError(f"lab.{k}", f"must be positive, not {v!r}")
        setattr(s, k, v)
    if s.dataset != "har":
        raise ScenarioError("lab.dataset", f"only \"har\" is fed live, not {s.dataset!r}")

    for i, t in enumerate(top["site"]):
        site = _take(t, f"site[{i}]", {"name": (str,)}, required=("name",))
        if not _NAME.match(site["name"]) or site["name"] in s.sites:
            raise ScenarioError(f"site[{i}].name", f"a new short lower-case name, not {site['name']!r}")
        s.sites.append(site["name"])
    if not s.sites:
        raise ScenarioError("site", "at least one [[site]]")

    for i, t in enumerate(top["class"]):
        w = f"class[{i}]"
        c = _take(t, w, {"name": (str,), "cpu": NUM, "memory_mb": (int,), "rate": (str, int), "loss": NUM,
                         "profile": (str,), "agent": (dict,)}, required=("name",))
        name = c["name"]
        if not _NAME.match(name) or name in RESERVED or name in s.classes:
            raise ScenarioError(f"{w}.name", f"a new short lower-case name (not {', '.join(RESERVED)}), "
                                             f"not {name!r}")
        if "cpu" in c and not 0 < c["cpu"] <= 64:
            raise ScenarioError(f"{w}.cpu", f"a share of one core above 0, not {c['cpu']!r}")
        if "memory_mb" in c and c["memory_mb"] < 32:
            raise ScenarioError(f"{w}.memory_mb", f"at least 32, not {c['memory_mb']!r}")
        s.classes[name] = DeviceClass(name, cpu=float(c["cpu"]) if "cpu" in c else None,
                                      memory_mb=c.get("memory_mb"), rate=_rate(f"{w}.rate", c.get("rate")),
                                      loss=_loss(f"{w}.loss", c.get("loss")),
                                      profile=c.get("profile", "generic-x86"), agent=dict(c.get("agent", {})))

    _releases(s, top.get("releases", {}))
    counts: dict[str, int] = {}
    for i, t in enumerate(top["device"]):
        w = f"device[{i}]"
        d = _take(t, w, {"class": (str,), "site": (str,), "count": (int,), "role": (str,), "start_s": NUM,
                         "release": (str,)}, required=("class",))
        if d["class"] not in s.classes:
            raise ScenarioError(f"{w}.class", f"no [[class]] named {d['class']!r}")
        site = d.get("site", s.sites[0])
        if site not in s.sites:
            raise ScenarioError(f"{w}.site", f"no [[site]] named {site!r}")
        role = d.get("role", "train")
        if role not in ("train", "inference"):
            raise ScenarioError(f"{w}.role", f"\"train\" or \"inference\", not {role!r}")
        if d.get("count", 1) < 1:
            raise ScenarioError(f"{w}.count", f"at least 1, not {d['count']!r}")
        if len(s.devices) + d.get("count", 1) > MAX_DEVICES:
            raise ScenarioError(f"{w}.count", f"{d['count']!r} more device(s) after {len(s.devices)}: at most "
                                              f"{MAX_DEVICES} devices in a scenario")
        _nonneg(f"{w}.start_s", d.get("start_s"))
        release = d.get("release", "current")
        _known_release(s, f"{w}.release", release)
        if role == "inference" and release != "current":
            raise ScenarioError(f"{w}.release", "an inference member runs the lab's own dfl-infer (\"current\")")
        for _ in range(d.get("count", 1)):
            n = counts.get(d["class"], 0)
            counts[d["class"]] = n + 1
            s.devices.append(Device(f"{d['class']}-{n}", s.classes[d["class"]], site, role,
                                    float(d.get("start_s", 0.0)), release))
    if not s.training():
        raise ScenarioError("device", "at least one training device")
    wan = _take(top.get("wan", {}), "wan", {"rate": (str, int), "loss": NUM})
    if wan and len(s.sites) < 2:
        raise ScenarioError("wan", "a WAN joins two or more [[site]]s; this scenario has one")
    s.wan = {"rate": _rate("wan.rate", wan.get("rate")), "loss": _loss("wan.loss", wan.get("loss"))}

    for i, t in enumerate(top.get("run", [])):
        w = f"run[{i}]"
        r = _take(t, w, {"at_s": NUM, "algorithm": (str,), "rounds": (int,), "models": (str,),
                         "options": (dict,), "min_members": (int,), "start_timeout": NUM},
                  required=("at_s", "algorithm", "rounds"))
        _nonneg(f"{w}.at_s", r["at_s"])
        if r["rounds"] < 1:
            raise ScenarioError(f"{w}.rounds", f"at least 1, not {r['rounds']!r}")
        if "min_members" in r and not 1 <= r["min_members"] <= len(s.training()):
            raise ScenarioError(f"{w}.min_members", f"between 1 and the training devices, not {r['min_members']}")
        _check_algorithm(w, r["algorithm"], r.get("options", {}), r.get("models"))
        s.runs.append(Run(float(r["at_s"]), r["algorithm"], r["rounds"], r.get("models"), dict(r.get("options", {})),
                          r.get("min_members"), float(r.get("start_timeout", 120.0))))

    ids = {d.id for d in s.devices}
    for i, t in enumerate(top.get("event", [])):
        w = f"event[{i}]"
        e = _take(t, w, {"at_s": NUM, "kind": (str,), "target": (str,), "duration_s": NUM, "value": (str, int, float),
                         "period_s": NUM, "down_s": NUM, "after_run": (int,)}, required=("at_s", "kind"))
        kind = e["kind"]
        if kind not in EVENT_KINDS:
            raise ScenarioError(f"{w}.kind", f"one of {', '.join(EVENT_KINDS)}, not {kind!r}")
        for k in ("at_s", "duration_s", "period_s", "down_s"):
            _nonneg(f"{w}.{k}", e.get(k))
        target = e.get("target", "wan" if kind == "wan_down" else "")
        if kind == "upgrade":
            if target != "all" and target not in {d.id for d in s.training()}:
                raise ScenarioError(f"{w}.target", f"a training device ({', '.join(d.id for d in s.training())}) "
                                                   f"or \"all\" for upgrade, not {target!r}")
            _known_release(s, f"{w}.value", e.get("value", "current"))
        elif kind == "wan_down":
            if len(s.sites) < 2:
                raise ScenarioError(f"{w}.kind", "wan_down needs two or more [[site]]s (a WAN between them)")
            if target != "wan":
                raise ScenarioError(f"{w}.target", f"\"wan\" (or none) for wan_down, not {target!r}")
        elif kind == "broker_outage":
            if target not in s.sites:
                raise ScenarioError(f"{w}.target", f"a site for broker_outage, not {target!r}")
        elif target not in ids:
            raise ScenarioError(f"{w}.target", f"a device id ({', '.join(sorted(ids))}) for {kind}, not {target!r}")
        elif kind == "power_cut" and target not in {d.id for d in s.training()}:
            raise ScenarioError(f"{w}.target", f"a training device for power_cut, not the inference member {target!r}")
        if kind in ("partition", "flap", "wan_down", "broker_outage", "power_cut") and not e.get("duration_s"):
            raise ScenarioError(f"{w}.duration_s", f"{kind} needs a duration above 0")
        value = e.get("value", "current" if kind == "upgrade" else "")
        if kind == "loss":
            _loss(f"{w}.value", value)
        elif kind == "rate":
            _rate(f"{w}.value", value)
            if value in ("", None):
                raise ScenarioError(f"{w}.value", "rate needs a value (for example \"500kbit\")")
        if kind == "flap":
            if not e.get("period_s") or not e.get("down_s") or e["down_s"] >= e["period_s"]:
                raise ScenarioError(f"{w}.down_s", "flap needs period_s > down_s > 0")
        after = e.get("after_run")
        if after is not None and not 0 <= after < len(s.runs):
            raise ScenarioError(f"{w}.after_run", f"the index of a [[run]] (0 to {len(s.runs) - 1}), not {after}")
        s.events.append(Event(float(e["at_s"]), kind, target, float(e.get("duration_s", 0.0)), str(value),
                              float(e.get("period_s", 0.0)), float(e.get("down_s", 0.0)), after))
    _one_at_a_time(s)

    checks = _take(top.get("checks", {}), "checks", {
        "samples_lost": (int,), "oom_kills": (int,), "max_recovery_s": NUM, "max_rounds_alone": (int,),
        "all_runs_deployed": (bool,), "discovery_via": (str,), "min_final_accuracy": NUM,
        "inference_received": (bool,), "runs_trained": (bool,), "all_upgraded": (bool,)})
    if "discovery_via" in checks and checks["discovery_via"] not in ("mdns", "presence", "static"):
        raise ScenarioError("checks.discovery_via", f"\"mdns\", \"presence\" or \"static\", not "
                                                    f"{checks['discovery_via']!r}")
    s.checks = {"runs_trained": True, **checks}  # on unless the file turns it off
    if s.perfect:  # no limits, no loss, no events
        for c in s.classes.values():
            c.cpu = c.memory_mb = c.rate = None
            c.loss = 0.0
        s.wan = {"rate": None, "loss": 0.0}
        s.events = []
    return s


# ---- releases and upgrades ----------------------------------------------------------------
def _releases(s: Scenario, table: dict[str, Any]) -> None:
    """``[releases]``: each name's wheel or folder, checked now (a missing or wrong file is
    named by its key before anything is built)."""
    from dfl_agent.cli.lab.releases import CURRENT, ReleaseError, check_release

    for name, path in table.items():
        w = f"releases.{name}"
        if name == CURRENT:
            raise ScenarioError(w, "\"current\" is the dfl-agent that runs the lab; give the release another name")
        if not _RELEASE.match(name):
            raise ScenarioError(w, "a short lower-case name (letters, digits, . _ -)")
        if not isinstance(path, str) or not path:
            raise ScenarioError(w, f"the path of a wheel or a release folder, not {path!r}")
        p = Path(path).expanduser().absolute()
        try:
            check_release(p)
        except ReleaseError as e:
            raise ScenarioError(w, str(e)) from None
        s.releases[name] = p


def _known_release(s: Scenario, where: str, name: Any) -> None:
    if not isinstance(name, str) or name not in s.releases:
        raise ScenarioError(where, f"a release of [releases] ({', '.join(s.releases)}), not {name!r}")


@dataclass
class UpgradeStep:
    """One device's upgrade: its agent stopped ``delay_s`` after its moment, and started on
    ``release`` ``down_s`` after it stopped.  The moment: with ``after_device``, when that
    device, upgraded just before, closed its first round with a peer's update on its new
    release; else the scenario's start, or when run ``after_run`` trained on every device."""

    event: int
    device: str
    release: str
    delay_s: float
    down_s: float
    after_run: int | None = None
    after_device: str | None = None


def upgrade_steps(s: Scenario) -> list[UpgradeStep]:
    """Every device upgrade of the scenario's ``upgrade`` events, event by event.

    An event with ``target = "all"`` upgrades every training device, one at a time in the
    file's order: the first ``at_s`` after its moment (the start, or ``after_run``), each next
    one ``period_s`` after the one before it is back (closed a round with a peer's update on
    its new release); each agent is down ``duration_s``.  A device id target: that device,
    ``at_s`` after its moment.
    """
    steps = []
    for i, e in enumerate(s.events):
        if e.kind != "upgrade":
            continue
        targets = [d.id for d in s.training()] if e.target == "all" else [e.target]
        for k, dev in enumerate(targets):
            steps.append(UpgradeStep(i, dev, e.value or "current", e.at_s if k == 0 else e.period_s, e.duration_s,
                                     e.after_run if k == 0 else None, targets[k - 1] if k else None))
    return steps


def _one_at_a_time(s: Scenario) -> None:
    """Upgrades that start from the same moment may not overlap: a device is stopped only
    after the one before it has been started again.  (Those of one ``target = "all"`` event
    follow each other by construction.)"""
    fixed = sorted((st for st in upgrade_steps(s) if st.after_device is None),
                   key=lambda st: (st.after_run if st.after_run is not None else -1, st.delay_s))
    for a, b in zip(fixed, fixed[1:]):
        if a.after_run == b.after_run and b.delay_s <= a.delay_s + a.down_s:
            raise ScenarioError(f"event[{b.event}].at_s", f"upgrade of {b.device} at {b.delay_s:g} s while {a.device} "
                                                          f"is down ({a.delay_s:g}-{a.delay_s + a.down_s:g} s): one "
                                                          "device at a time")
