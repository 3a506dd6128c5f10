"""The lab's state file: every object a lab made, written as it is made.

``/run/dfl-lab/<run id>.json`` (the folder is :data:`STATE_DIR`; ``DFL_LAB_STATE_DIR``
overrides it) holds::

    {"run_id": "3fa2c81d", "pid": 1234, "pid_start": 987654, "created": 1764134400.0,
     "objects": [{"kind": "netns", "name": "dfl-lab-3fa2c81d-pi-0"},
                 {"kind": "link", "netns": "dfl-lab-3fa2c81d-sw-a", "name": "dl3fa20"},
                 {"kind": "cgroup", "path": "/sys/fs/cgroup/memory/dfl-lab/3fa2c81d/pi-0"},
                 {"kind": "process", "pid": 4321, "start": 998877, "host": "pi-0"}]}

The file is replaced atomically (a temporary file, fsync, rename) after each object, so
that a builder killed at any moment leaves a file that lists everything it made.
:func:`teardown` removes exactly the listed objects, processes first, then cgroups, then
links and namespaces (a namespace takes its links, addresses, qdiscs and firewall rules
with it), and deletes the file. Nothing that is not listed is touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

#: where the state files live
STATE_DIR = "/run/dfl-lab"


def state_dir() -> Path:
    return Path(os.environ.get("DFL_LAB_STATE_DIR") or STATE_DIR)


def proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat``
    field 22), or None when it does not exist: a PID is only ours while this matches."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` still runs and is the one recorded (same start time)."""
    now = proc_start(pid)
    return now is not None and (start is None or now == start) and not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[:1] == ["Z"]


class LabState:
    """The state file of one lab; :meth:`add` records an object and rewrites the file."""

    def __init__(self, run_id: str, folder: Path | None = None):
        self.run_id = run_id
        self.path = (folder or state_dir()) / f"{run_id}.json"
        self.doc: dict[str, Any] = {"run_id": run_id, "pid": os.getpid(),
                                    "pid_start": proc_start(os.getpid()),
                                    "created": time.time(), "objects": []}

    @property
    def objects(self) -> list[dict[str, Any]]:
        return self.doc["objects"]

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        obj = {"kind": kind, **fields}
        self.objects.append(obj)
        self.write()
        return obj

    def drop(self, obj: dict[str, Any]) -> None:
        """Forget an object that is gone (a stopped process)."""
        if obj in self.objects:
            self.objects.remove(obj)
            self.write()

    def write(self) -> None:
        from dfl_agent.fsutil import atomic_write

        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(self.doc, indent=1), mode=0o600)

    def remove_file(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def read_states(folder: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Every state file in the folder, with its document (unreadable files are skipped)."""
    out = []
    for path in sorted((folder or state_dir()).glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("objects"), list):
            out.append((path, doc))
    return out


def stop_process(pid: int, start: int | None, grace_s: float = 3.0) -> bool:
    """SIGTERM, then SIGKILL after ``grace_s``, the recorded process (never another one
    that got its PID). True when it was running."""
    if not alive(pid, start):
        return False
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:  # reap it when it is our child
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return True
            except ChildProcessError:
                pass
            if not alive(pid, start):
                return True
            time.sleep(0.02)
    return True


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def remove_object(obj: dict[str, Any]) -> bool:
    """Remove one listed object; True when something was there to remove."""
    kind = obj.get("kind")
    if kind == "process":
        return stop_process(int(obj["pid"]), obj.get("start"))
    if kind == "cgroup":
        from dfl_agent.cli.lab.cgroups import remove_dir

        return remove_dir(Path(obj["path"]))
    if kind == "link":
        ns = obj.get("netns")
        args = ["-n", ns] if ns else []
        if ns and not Path("/run/netns", ns).exists():
            return False
        return _ip(*args, "link", "del", obj["name"]).returncode == 0
    if kind == "netns":
        if not Path("/run/netns", obj["name"]).exists():
            return False
        return _ip("netns", "del", obj["name"]).returncode == 0
    return False


#: the order of removal: processes, then cgroups (empty once their processes are gone),
#: then links, then namespaces
_ORDER = {"process": 0, "cgroup": 1, "link": 2, "netns": 3}


def teardown(doc: dict[str, Any]) -> list[str]:
    """Remove every object the document lists, in a safe order; the list of what was
    there and is gone now (``"netns dfl-lab-..."``)."""
    removed = []
    objs = [o for o in doc.get("objects", []) if isinstance(o, dict)]
    for obj in sorted(reversed(objs), key=lambda o: _ORDER.get(str(o.get("kind")), 9)):
        try:
            gone = remove_object(obj)
        except (OSError, KeyError, ValueError, TypeError):
            gone = False
        if gone:
            removed.append(describe(obj))
    return removed


def describe(obj: dict[str, Any]) -> str:
    kind = obj.get("kind")
    if kind == "process":
        return f"process {obj.get('pid')}" + (f" ({obj['host']})" if obj.get("host") else "")
    if kind == "cgroup":
        return f"cgroup {obj.get('path')}"
    if kind == "link":
        return f"link {obj.get('name')}" + (f" in {obj['netns']}" if obj.get("netns") else "")
    return f"{kind} {obj.get('name')}"
