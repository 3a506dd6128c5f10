"""The first-federation tutorial, followed word by word: its code blocks run in order.

The block marked ``# tutorial: install`` (building and installing the wheel into a fresh
virtual environment, which needs the network) is replaced by this test's own environment:
the console scripts of the interpreter running the tests are put first on ``PATH``. That
install path is proved elsewhere: ``scripts/check_install.sh`` (run by CI) builds the wheel and
installs the same CPU torch and ``WHEEL[train,har]`` into a fresh virtual environment outside
the repository, and ``tests/unit/test_docs_commands.py`` checks that the block pins the torch
version those scripts install and that every command the tutorials show parses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorials" / "first-federation.md"
LIVE = ROOT / "docs" / "tutorials" / "live-data.md"


def tutorial_blocks(page: Path = TUTORIAL) -> list[str]:
    """The ``bash`` code blocks of a tutorial page, in order."""
    return re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def run_blocks(blocks: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the blocks as one bash script with this interpreter's console scripts first on PATH."""
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), "/usr/sbin", env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:  # a block that failed leaves its broker and agents behind: stop the script's process group
        import signal

        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_tutorial_blocks_are_found() -> None:
    blocks = tutorial_blocks()
    assert len(blocks) >= 5
    assert blocks[0].startswith("# tutorial: install")


@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                    reason="needs mosquitto")
def test_first_federation_tutorial(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    blocks = [b for b in tutorial_blocks() if not b.startswith("# tutorial: install")]
    proc = run_blocks(blocks, tmp_path)
    fed = tmp_path / "fed-tutorial"
    logs = "".join((fed / f"node{i}.log").read_text() for i in range(3) if (fed / f"node{i}.log").exists())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[-3000:]
    assert proc.stdout.count("configuration OK") == 3
    assert "all three agents finished" in proc.stdout
    finals = re.findall(r"node(\d): round (\d+), federated ([0-9.]+), alone ([0-9.]+)", proc.stdout)
    assert [f[0] for f in finals] == ["0", "1", "2"], proc.stdout
    assert all(int(f[1]) == 5 for f in finals)
    assert all(0.0 < float(f[2]) <= 1.0 for f in finals)


@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                    reason="needs mosquitto")
def test_live_data_tutorial(tmp_path: Path) -> None:
    """Always-on agents: samples fed with dflctl data add, a submitted run, a deployed model."""
    pytest.importorskip("torch")
    proc = run_blocks([b for b in tutorial_blocks(LIVE) if not b.startswith("# tutorial: install")], tmp_path)
    fed = tmp_path / "live-tutorial"
    logs = "".join((fed / f"node{i}.log").read_text() for i in range(3) if (fed / f"node{i}.log").exists())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[-4000:]
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
