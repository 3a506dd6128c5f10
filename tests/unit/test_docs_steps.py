"""Steps of the install page and the live-data tutorial that the tutorial tests do not cover.

* The live-data tutorial's stop block works from a shell that did not start the agents: it
  returns only once every agent has exited (the agents here are real processes started by
  this test, so they are not children of the shell that runs the block, as in a second
  terminal), and it stops the broker after them.
* The install page installs the torch version that ``scripts/setup.sh`` installs, pinned as in
  the first-federation tutorial, never an unpinned build from an index URL.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIVE = ROOT / "docs" / "tutorials" / "live-data.md"

#: a process that, like an agent, takes a while to leave after SIGTERM, then notes its exit
_SLOW_STOPPER = """
import signal, sys, time
from pathlib import Path
def stop(*_):
    time.sleep(float(sys.argv[2]))
    Path(sys.argv[1]).write_text("exited")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
Path(sys.argv[1] + ".ready").write_text("")
while True:
    time.sleep(0.05)
"""


def stop_block() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", LIVE.read_text(encoding="utf-8"), flags=re.S)
    return next(b for b in blocks if "broker.pid" in b and "kill" in b and "mosquitto" not in b)


def test_live_data_stop_block_waits_for_agents_it_did_not_start(tmp_path: Path) -> None:
    work = tmp_path / "live-tutorial"
    work.mkdir()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    names = ["node0", "node1", "node2", "broker"]
    for name in names:
        delay = "0" if name == "broker" else "1.5"
        procs[name] = subprocess.Popen([sys.executable, "-c", _SLOW_STOPPER, str(work / f"{name}.exited"), delay])
        (work / f"{name}.pid").write_text(f"{procs[name].pid}\n")
    # reap each as soon as it exits (as an interactive shell reaps its jobs), so a gone PID is gone
    reapers = [threading.Thread(target=p.wait, daemon=True) for p in procs.values()]
    for t in reapers:
        t.start()
    try:
        for name in names:
            for _ in range(200):
                if (work / f"{name}.exited.ready").exists():
                    break
                threading.Event().wait(0.05)
        proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + stop_block()], cwd=work,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        exited = {n: (work / f"{n}.exited").exists() for n in names[:3]}
        assert exited == {n: True for n in names[:3]}, f"the block returned while agents still ran: {proc.stderr}"
        assert procs["broker"].wait(timeout=10) == 0
        assert "not a child" not in proc.stderr
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_install_page_pins_the_tested_torch() -> None:
    version = re.search(r'TORCH_VERSION="\$\{TORCH_VERSION:-([0-9.]+)\}"', (ROOT / "scripts" / "setup.sh").read_text())
    assert version
    pinned = f"torch=={version.group(1)}"
    tutorial = (ROOT / "docs" / "tutorials" / "first-federation.md").read_text(encoding="utf-8")
    assert f"{pinned} --index-url https://download.pytorch.org/whl/cpu" in tutorial
    page = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    installs = [line for line in page.splitlines() if re.search(r"pip install\b.*\btorch\b", line)]
    assert installs, "install.md shows no torch install"
    for line in installs:
        assert re.search(r"\btorch==\d", line), f"install.md installs torch unpinned: {line}"
        assert version.group(1) in line, f"install.md pins another torch than scripts/setup.sh: {line}"
    assert f"{pinned} --index-url https://download.pytorch.org/whl/cpu" in page
