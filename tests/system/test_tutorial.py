"""The tutorials, followed word by word as a new user runs them: their code blocks run in order,
the install block included.

The blocks run as bash scripts with ``set -euo pipefail`` in a copy of the source tree outside
the repository, with ``HOME`` a fresh temporary folder (the tutorial's ``~/dfl-venv`` lies there)
and ``PATH`` without the interpreter that runs the tests, so every ``dfl-agent``, ``dflctl`` and
``python3`` the blocks call is the one the install block installed. pip keeps this machine's
configuration (its index, find-links and cache: ``XDG_CONFIG_HOME`` and ``XDG_CACHE_HOME`` stay
the user's), so torch resolves from wherever this machine's pip finds it. The first tutorial's
install block (building the wheel, torch, ``WHEEL[train,har]``) runs once per test run, and the
shell's ``PATH`` after it (its ``export PATH=...``) is what the later blocks of both tutorials run
with, as in the reader's shell. A block that fails stops the script there, and the test shows its
error.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorials" / "first-federation.md"
LIVE = ROOT / "docs" / "tutorials" / "live-data.md"
INSTALL = "# tutorial: install"


def tutorial_blocks(page: Path = TUTORIAL) -> list[str]:
    """The ``bash`` code blocks of a tutorial page, in order."""
    return re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def copy_source_tree(dest: Path) -> Path:
    """The source tree as a clone has it (tracked and untracked files that git does not ignore),
    copied to ``dest``: the tutorials build the wheel from ``.``."""
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "-co", "--exclude-standard"],
                               capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "__pycache__"))
        return dest
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def user_env(home: Path) -> dict[str, str]:
    """A reader's shell environment: ``HOME`` is ``home``, pip's configuration and cache are the
    user's, and neither the tests' virtual environment nor its interpreter is on ``PATH``."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    real_home = Path.home()
    env["XDG_CONFIG_HOME"] = os.environ.get("XDG_CONFIG_HOME") or str(real_home / ".config")
    env["XDG_CACHE_HOME"] = os.environ.get("XDG_CACHE_HOME") or str(real_home / ".cache")
    env["HOME"] = str(home)
    skip = {str(Path(sys.executable).parent), str(Path(sys.prefix) / "bin")}
    if os.environ.get("VIRTUAL_ENV"):
        skip.add(str(Path(os.environ["VIRTUAL_ENV"]) / "bin"))
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p not in skip]
    path += [p for p in ("/usr/sbin", "/usr/bin", "/bin") if p not in path]  # mosquitto lies in /usr/sbin
    env["PATH"] = os.pathsep.join(path)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_blocks(blocks: list[str], cwd: Path, env: dict[str, str], path_out: Path | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the blocks as one bash script (``set -euo pipefail``) in ``cwd`` with ``env``; with
    ``path_out``, the shell's ``PATH`` after the last block is written there."""
    script = "set -euo pipefail\n" + "\n".join(blocks)
    if path_out is not None:
        script += f'\nprintf "%s" "$PATH" > {str(path_out)!r}\n'
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:  # a block that failed leaves its broker and agents behind: stop the script's process group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@dataclass
class Installed:
    """The first tutorial's install block, run once: the source copy it ran in, the reader's
    environment after it (``PATH`` as its ``export`` left it) and its result."""

    src: Path
    home: Path
    env: dict[str, str]
    result: subprocess.CompletedProcess[str]

    def check(self) -> None:
        """Fail with the block's error when the install block failed."""
        r = self.result
        assert r.returncode == 0, (f"the install block failed (exit {r.returncode}):\n"
                                   f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The first tutorial's install block, verbatim, in a copy of the source tree with a fresh
    ``HOME``: builds the wheel, creates ``~/dfl-venv`` and installs torch and the wheel."""
    base = tmp_path_factory.mktemp("newcomer")
    src, home = copy_source_tree(base / "src"), base / "home"
    home.mkdir()
    env = user_env(home)
    install = [b for b in tutorial_blocks() if b.startswith(INSTALL)]
    assert len(install) == 1
    result = run_blocks(install, src, env, path_out=base / "path")
    if result.returncode == 0:
        env = {**env, "PATH": (base / "path").read_text()}
    return Installed(src, home, env, result)


def _logs(folder: Path) -> str:
    return "".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(folder.glob("node*.log")))


def test_tutorial_blocks_are_found() -> None:
    blocks = tutorial_blocks()
    assert len(blocks) >= 5
    assert blocks[0].startswith(INSTALL)
    assert [b for b in tutorial_blocks(LIVE) if b.startswith(INSTALL)]


@needs_mosquitto
@pytest.mark.timeout(900)
def test_first_federation_tutorial(installed: Installed) -> None:
    """Install block, then every other block: three agents of the fresh install train five
    rounds and finish; the commands are the fresh virtual environment's."""
    installed.check()
    assert re.search(r"^dflctl \d+\.\d+", installed.result.stdout, re.M), installed.result.stdout[-2000:]
    which = subprocess.run(["bash", "-c", "command -v dfl-agent dflctl python3"], env=installed.env,
                           capture_output=True, text=True, check=True).stdout.split()
    venv = str(installed.home / "dfl-venv" / "bin")
    assert all(w.startswith(venv) for w in which), which
    proc = run_blocks([b for b in tutorial_blocks() if not b.startswith(INSTALL)], installed.src, installed.env)
    fed = installed.src / "fed-tutorial"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + _logs(fed)
    assert proc.stdout.count("configuration OK") == 3
    assert "all three agents finished" in proc.stdout
    finals = re.findall(r"node(\d): round (\d+), federated ([0-9.]+), alone ([0-9.]+)", proc.stdout)
    assert [f[0] for f in finals] == ["0", "1", "2"], proc.stdout
    assert all(int(f[1]) == 5 for f in finals)
    assert all(0.0 < float(f[2]) <= 1.0 for f in finals)


@needs_mosquitto
@pytest.mark.timeout(900)
def test_live_data_tutorial(installed: Installed) -> None:
    """Always-on agents of the fresh install (its own install block adds the onnx extra): samples
    fed with dflctl data add, a submitted run, a deployed model used by onnxruntime and torch."""
    installed.check()
    proc = run_blocks(tutorial_blocks(LIVE), installed.src, installed.env)
    fed = installed.src / "live-tutorial"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + _logs(fed)
    assert proc.stdout.count("configuration OK") == 3
    for i in range(3):  # step 3: peers lists the three always-on agents, idle between runs
        assert re.search(rf"node{i}\b[^\n]*\bidle\b", proc.stdout), proc.stdout[-3000:]
    for i in range(3):
        assert (fed / f"node{i}" / "models" / "current" / "manifest.json").exists()
    # step 6: onnxruntime on model.onnx and torch via load_deployed predict the same classes
    onnx_pred = re.search(r"^onnxruntime: (\[.*\])$", proc.stdout, re.M)
    torch_pred = re.search(r"^torch: (\[.*\])$", proc.stdout, re.M)
    assert onnx_pred and torch_pred and onnx_pred.group(1) == torch_pred.group(1), proc.stdout[-3000:]
    assert re.search(r"deployed version \S+ of run \S+ accuracy [0-9.]+", proc.stdout), proc.stdout[-2000:]
