"""Releases of dfl-agent in the field lab: a device that runs a given wheel, and its upgrade.

A scenario names releases in ``[releases]`` (``name = "path"``: a wheel of dfl-agent, or a
folder that holds its ``dfl_agent`` package, as an unpacked wheel does); ``current`` is always
the dfl-agent that runs the lab.  A device with ``release = "name"`` runs that release's agent:
the wheel is unpacked once into the lab's output folder (``releases/<name>/site``) and the
device's agent is the same Python interpreter with that folder first on ``PYTHONPATH`` (the
dependencies, torch included, are the lab's), started through the release's own ``dfl-agent``
entry point (its wheel's ``entry_points.txt``).  Its node configuration is written by the
release itself (:data:`CONFIG_WRITER`), leaving out the keys it does not know.

The ``upgrade`` event (:func:`upgrade_steps`) stops a device's agent (SIGTERM), switches it to
another release and starts it again, one device at a time.

The lab reads a device's run ledger without writing it (:func:`ledger_entries`), whatever
release wrote it: opening it with this release's :class:`~dfl_agent.runtime.service.ledger.RunLedger`
would take an earlier release's ledger over while that release still runs.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the release that runs the lab (always defined; a scenario cannot redefine it)
CURRENT = "current"
#: the entry point of the agent, where a release folder has no ``entry_points.txt``
_KNOWN_ENTRIES = ("dfl_agent.runtime.service.daemon:main", "dfl_agent.runtime.daemon:main")


class ReleaseError(ValueError):
    """A release that cannot be used (the message says why)."""


def check_release(path: Path) -> None:
    """Whether ``path`` is a wheel of dfl-agent or a folder holding its ``dfl_agent`` package.

    Raises:
        ReleaseError: no such file or folder, not a zip, or no ``dfl_agent/__init__.py`` in it.
    """
    if path.is_dir():
        if not (path / "dfl_agent" / "__init__.py").is_file():
            raise ReleaseError(f"{path}: a folder without dfl_agent/__init__.py (not an unpacked wheel of dfl-agent)")
        return
    if not path.is_file():
        raise ReleaseError(f"no such wheel or folder: {path}")
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
    except (zipfile.BadZipFile, OSError) as e:
        raise ReleaseError(f"{path}: not a wheel ({e})") from None
    if "dfl_agent/__init__.py" not in names:
        raise ReleaseError(f"{path}: not a wheel of dfl-agent (no dfl_agent/__init__.py in it)")


@dataclass
class Release:
    """A release as a device runs it: ``site`` goes first on ``PYTHONPATH`` (None: the lab's own)."""

    name: str
    source: Path | None = None
    site: Path | None = None
    entry: str = _KNOWN_ENTRIES[0]
    #: ``dfl-agent --version`` of the release (filled by :meth:`probe`)
    version_line: str = ""
    #: ``dfl_agent.__version__`` and where the package was imported from
    version: str = ""
    origin: str = ""

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the release first on ``PYTHONPATH`` (unchanged for ``current``)."""
        if self.site is None:
            return dict(base)
        rest = base.get("PYTHONPATH")
        return dict(base, PYTHONPATH=str(self.site) + (os.pathsep + rest if rest else ""), PYTHONDONTWRITEBYTECODE="1")

    def agent_argv(self, py: str, *args: str) -> list[str]:
        """The command line of the release's ``dfl-agent ARGS``."""
        if self.site is None:
            return [py, "-m", "dfl_agent.runtime.service.daemon", *args]
        module, _, func = self.entry.partition(":")
        return [py, "-c", f"import sys; from {module} import {func} as main; sys.argv[0] = 'dfl-agent'; "
                          "sys.exit(main())", *args]

    def probe(self, py: str, env: dict[str, str]) -> None:
        """Fill :attr:`version_line`, :attr:`version` and :attr:`origin`.

        Raises:
            ReleaseError: the release does not start, or ``dfl_agent`` came from elsewhere.
        """
        e = self.env(env)
        r = subprocess.run(self.agent_argv(py, "--version"), capture_output=True, text=True, env=e, timeout=120)
        if r.returncode != 0:
            raise ReleaseError(f"release {self.name}: dfl-agent --version exited {r.returncode}: "
                               f"{(r.stderr or r.stdout).strip()[-500:]}")
        self.version_line = r.stdout.strip()
        r = subprocess.run([py, "-c", "import json, dfl_agent; print(json.dumps([dfl_agent.__version__, "
                                      "dfl_agent.__file__]))"], capture_output=True, text=True, env=e, timeout=60)
        if r.returncode != 0:
            raise ReleaseError(f"release {self.name}: import dfl_agent failed: {r.stderr.strip()[-500:]}")
        self.version, self.origin = json.loads(r.stdout)
        if self.site is not None and not Path(self.origin).resolve().is_relative_to(self.site.resolve()):
            raise ReleaseError(f"release {self.name}: dfl_agent was imported from {self.origin}, not from {self.site}")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": str(self.source) if self.source else None,
                "version": self.version, "dfl_agent_version": self.version_line, "imported_from": self.origin}


def prepare(name: str, source: Path | None, dest: Path) -> Release:
    """A release ready to run: a wheel unpacked into ``dest/<name>/site``, a folder used as it
    is; its agent's entry point read from the wheel's ``entry_points.txt``."""
    if source is None:
        return Release(CURRENT)
    check_release(source)
    if source.is_dir():
        site = source
    else:
        site = dest / name / "site"
        if not site.exists():
            with zipfile.ZipFile(source) as z:
                z.extractall(site)
    return Release(name, source, site, _entry_point(site))


def _entry_point(site: Path) -> str:
    """``module:function`` of the ``dfl-agent`` console script in ``site``."""
    for ep in sorted(site.glob("dfl_agent-*.dist-info/entry_points.txt")):
        for line in ep.read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "dfl-agent" and value.strip():
                return value.strip()
    for entry in _KNOWN_ENTRIES:
        module = entry.partition(":")[0]
        if (site / (module.replace(".", "/") + ".py")).is_file():
            return entry
    raise ReleaseError(f"{site}: no dfl-agent entry point found")


#: run with a release on ``PYTHONPATH``: reads the lab's node configuration (JSON on stdin),
#: leaves out the keys the release does not know, and prints its own TOML of it
CONFIG_WRITER = r"""
import dataclasses, importlib, json, sys, typing
for name in ("dfl_agent.runtime.shared.config", "dfl_agent.runtime.config", "dfl_agent.config"):
    try:
        mod = importlib.import_module(name)
        break
    except ImportError:
        continue
else:
    sys.exit("no configuration module in this release")
dropped = []
def prune(cls, raw, prefix):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for k, v in raw.items():
        if k not in known:
            dropped.append(prefix + k)
        elif isinstance(v, dict) and dataclasses.is_dataclass(hints.get(k)):
            out[k] = prune(hints[k], v, prefix + k + ".")
        else:
            out[k] = v
    return out
raw = prune(mod.NodeConfig, json.load(sys.stdin), "")
try:
    text = mod.dump_toml(mod.config_from_dict(raw))
except Exception as e:
    sys.exit(f"{type(e).__name__}: {e}")
print(json.dumps({"toml": text, "dropped": dropped}))
"""


def write_config(release: Release, raw: dict[str, Any], py: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """The node configuration ``raw`` as ``release`` writes it (its TOML), and the keys it left
    out because that release does not know them.

    Raises:
        ReleaseError: the release refused the configuration (its message).
    """
    r = subprocess.run([py, "-c", CONFIG_WRITER], input=json.dumps(raw), capture_output=True, text=True,
                       env=release.env(env), timeout=120)
    if r.returncode != 0:
        raise ReleaseError(f"release {release.name} refused the lab's node configuration: "
                           f"{(r.stderr or r.stdout).strip()[-800:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return str(out["toml"]), list(out["dropped"])


def ledger_entries(state: Path) -> dict[str, dict[str, Any]]:
    """A device's run ledger, run id -> entry, read without writing anything: this release's
    ``runs/ledger.sqlite`` (opened read-only) or an earlier release's ``runs/ledger.json``; {}
    when there is neither, or it cannot be read now (the agent is writing it)."""
    db = state / "runs" / "ledger.sqlite"
    if db.exists():
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0)
            try:
                rows = con.execute("SELECT run_id, entry FROM runs").fetchall()
            finally:
                con.close()
        except sqlite3.Error:
            return {}
        out = {}
        for rid, text in rows:
            try:
                entry = json.loads(text)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out[str(rid)] = entry
        return out
    legacy = state / "runs" / "ledger.json"
    try:
        raw = json.loads(legacy.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in raw.items() if isinstance(v, dict)} if isinstance(raw, dict) else {}


def ledger_state(state: Path, run_id: str) -> str | None:
    """The state a device's ledger records for ``run_id`` (:func:`ledger_entries`), or None."""
    entry = ledger_entries(state).get(run_id)
    return entry.get("state") if entry else None
