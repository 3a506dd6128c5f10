"""A release of dfl-agent installed from its wheel, for the compatibility tests and the
generators of ``tests/fixtures/compat/``.

:func:`install_release` builds a commit's wheel (``bench/lab/release_wheel.py``: ``git archive``
of the commit, ``pip wheel --no-deps --no-build-isolation``, offline) and installs it as pip does
a pure wheel, by extracting it into a folder that goes first on ``PYTHONPATH``: its modules run on
this test environment's dependencies (torch, numpy, paho, ...), so no second torch is installed.
:func:`release_env` is that environment; :data:`CHECK_ORIGIN` makes a child fail unless
``dfl_agent`` came from the release's folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the landed release 0.1.0 (tag ``v0.1.0``)
RELEASE_0_1_0 = "75535c2"


class ReleaseUnavailable(RuntimeError):
    """The commit is not in this checkout (a shallow clone, or no git): the message says what to fetch."""


def install_release(commit: str, dest: Path) -> Path:
    """Build commit ``commit``'s wheel under ``dest/dist`` and install it into ``dest/site``;
    returns that folder (to put first on ``PYTHONPATH``).

    Raises:
        ReleaseUnavailable: git cannot read ``commit`` here, or its wheel does not build.
    """
    sys.path.insert(0, str(ROOT / "bench" / "lab"))
    try:
        from release_wheel import build_wheel
    finally:
        sys.path.remove(str(ROOT / "bench" / "lab"))
    try:
        wheel = build_wheel(commit, dest / "dist")
    except RuntimeError as exc:
        raise ReleaseUnavailable(str(exc)) from None
    site = dest / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
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


def run_release(commit: str, code: str, *args: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code ARGS... SITE`` on commit ``commit``'s release, installed under
    ``workdir`` (:func:`install_release`; ``SITE``, the last argument, is its folder, for the
    child to check where ``dfl_agent`` came from).

    Raises:
        ReleaseUnavailable: see :func:`install_release`.
    """
    site = install_release(commit, workdir / "release")
    return subprocess.run([sys.executable, "-c", code, *args, str(site.resolve())], env=release_env(site),
                          capture_output=True, text=True, cwd=workdir)


def write_from_release(commit: str, code: str, outputs: dict[str, Path], what: str) -> int:
    """A fixture generator's work: run ``code`` on commit ``commit``'s release
    (:func:`run_release`, a fresh state folder as its first argument), then copy each of
    ``outputs`` (path in that state folder -> destination; a SQLite file must have no journal
    left).  Prints what it did; returns the exit code (1: the child failed, its stderr printed)."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        state = t / "state"
        r = run_release(commit, code, str(state), workdir=t)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        print(f"{commit}'s {what}: {r.stdout.strip()}")
        for rel, dest in outputs.items():
            src = state / rel
            assert not src.with_name(src.name + "-wal").exists(), f"{rel}: its journal was not checkpointed"
            shutil.copyfile(src, dest)
            print(f"wrote {dest}")
    return 0
