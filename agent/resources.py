"""Files that ship inside the package: device profiles, systemd units, broker configuration.

In the wheel they live under ``dfl_agent/share/`` (mapped from the repository's
``device_profiles/``, ``systemd/`` and ``deploy/mosquitto/`` folders, see ``pyproject.toml``)
and are read with :mod:`importlib.resources`, so an installed package never looks next to a
git checkout.  In a checkout (editable install or ``PYTHONPATH``) the same names resolve to
those repository folders.

Device profiles are resolved file by file (:func:`profile_dirs`): ``$DFL_PROFILES_DIR`` first,
then ``/etc/dfl-agent/profiles``, then the shipped profiles.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
from pathlib import Path

#: resource name -> (package under ``dfl_agent.share``, repository folder)
_RESOURCES = {
    "device_profiles": ("dfl_agent.share.device_profiles", "device_profiles"),
    "systemd": ("dfl_agent.share.systemd", "systemd"),
    "mosquitto": ("dfl_agent.share.mosquitto", "deploy/mosquitto"),
}

#: system-wide profile folder; a file there replaces the shipped profile of the same name
ETC_PROFILES_DIR = Path("/etc/dfl-agent/profiles")


def resource_dir(name: str) -> Path:
    """The folder of shipped resource ``name`` (``device_profiles``, ``systemd``, ``mosquitto``).

    Raises:
        KeyError: unknown resource name.
        FileNotFoundError: the installation lacks the folder (a broken install).
    """
    package, repo_folder = _RESOURCES[name]
    try:
        # the share folders carry no __init__.py: they are namespace packages, whose
        # importlib.resources.files() is a MultiplexedPath, not a path; their spec names
        # the folder(s)
        spec = importlib.util.find_spec(package)
        for loc in (spec.submodule_search_locations or []) if spec is not None else []:
            if Path(loc).is_dir():
                return Path(loc)
        path = Path(str(importlib.resources.files(package)))
        if path.is_dir():
            return path
    except (ModuleNotFoundError, TypeError, ValueError):
        pass
    # a checkout: the package folder agent/ sits next to the repository's folders
    here = Path(__file__).resolve().parent.parent / repo_folder
    if here.is_dir():
        return here
    raise FileNotFoundError(f"dfl-agent installation has no {repo_folder}/ resources (reinstall the package)")


def profile_dirs() -> list[Path]:
    """Folders searched for device profiles, highest priority first.

    ``$DFL_PROFILES_DIR`` (when set), ``/etc/dfl-agent/profiles`` (when it exists), then the
    profiles shipped in the package. A profile file in an earlier folder overrides the
    file of the same name in a later one.
    """
    out: list[Path] = []
    env = os.environ.get("DFL_PROFILES_DIR")
    if env:
        out.append(Path(env))
    if ETC_PROFILES_DIR.is_dir():
        out.append(ETC_PROFILES_DIR)
    out.append(resource_dir("device_profiles"))
    return out
