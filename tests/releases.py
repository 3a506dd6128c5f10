"""An earlier release of dfl-agent, laid out as pip installs its wheel, for the compatibility tests
and the generators of ``tests/fixtures/compat/``.

:func:`install_release` extracts a commit's tree (``git archive``) and lays it out as the wheel
installs it (``agent/`` -> ``dfl_agent``, ``tools/`` -> ``dfl_agent.cli``, the share folders
beside; the mapping of ``pyproject.toml``'s ``[tool.setuptools.package-dir]``) in a folder that
goes first on ``PYTHONPATH``: its modules run on this test environment's dependencies (torch,
numpy, paho, ...), so no second torch is installed.  :func:`release_env` is that environment;
:data:`CHECK_ORIGIN` makes a child fail unless ``dfl_agent`` came from the release's folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the landed release 0.1.0 (tag ``v0.1.0``)
RELEASE_0_1_0 = "75535c2"
#: the wheel's folder mapping (pyproject.toml, [tool.setuptools.package-dir])
LAYOUT = {"agent": "dfl_agent", "tools": "dfl_agent/cli", "device_profiles": "dfl_agent/share/device_profiles",
          "systemd": "dfl_agent/share/systemd", "deploy/mosquitto": "dfl_agent/share/mosquitto"}


class ReleaseUnavailable(RuntimeError):
    """The commit is not in this checkout (a shallow clone, or no git): the message says what to fetch."""


def install_release(commit: str, dest: Path) -> Path:
    """Lay commit ``commit``'s package out under ``dest`` as its wheel installs it; returns the
    folder to put first on ``PYTHONPATH`` (``dest/site``).

    Raises:
        ReleaseUnavailable: git cannot read ``commit`` here.
    """
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, *LAYOUT],
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.decode(errors="replace").strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        raise ReleaseUnavailable(f"cannot read commit {commit} of {ROOT} (a shallow clone? `git fetch --tags "
                                 f"--unshallow`): {detail}") from None
    src = dest / "src"
    src.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(src, filter="data") if sys.version_info >= (3, 12) else t.extractall(src)  # noqa: S202
    site = dest / "site"
    for folder, package in LAYOUT.items():
        if (src / folder).is_dir():
            shutil.copytree(src / folder, site / package, dirs_exist_ok=True)
    return site


def release_env(site: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process that runs the release laid out at ``site``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


#: a ``python -c`` prelude: exit 3 unless ``dfl_agent`` is imported from ``sys.argv[1]``'s folder
CHECK_ORIGIN = ("import sys, dfl_agent, pathlib; "
                "sys.exit(0 if pathlib.Path(dfl_agent.__file__).resolve().is_relative_to("
                "pathlib.Path(sys.argv[1]).resolve()) else 3)")
