"""A lab host's cgroups: a CPU quota (a share of one core) and a memory limit, on cgroup
v1 (a folder in the ``cpu`` and one in the ``memory`` hierarchy) or v2 (one folder).

Folders: ``<hierarchy>/dfl-lab/<run id>/<host>``. The memory side is the agent's own
:class:`dfl_agent.runtime.service.cgroup.RunCgroup` (limit with swap closed, OOM-kill counter,
peak), so the lab detects an OOM kill exactly as the agent does.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from dfl_agent.runtime.service import cgroup as runcg

#: the lab's folder below each hierarchy's root
BASE = "dfl-lab"
#: the CPU quota's period (µs)
CPU_PERIOD_US = 100_000
_MIB = 1024 * 1024


def _mounts() -> list[tuple[str, str, list[str]]]:
    out = []
    try:
        text = Path("/proc/self/mounts").read_text(encoding="ascii", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4:
            out.append((f[1], f[2], f[3].split(",")))
    return out


def hierarchy(controller: str, root: str | None = None) -> tuple[int, Path] | str:
    """``(version, folder)`` of the hierarchy that has ``controller`` (``memory``,
    ``cpu``), or why there is none."""
    base = Path(root or runcg.CGROUP_ROOT)
    controllers = runcg._read(base / "cgroup.controllers")
    if controllers is not None:
        if controller in controllers.split():
            return 2, base
        return f"the {controller} controller is not enabled in {base} (cgroup v2)"
    for mount, fstype, opts in _mounts():
        if fstype == "cgroup" and controller in opts and mount.startswith(str(base)):
            return 1, Path(mount)
    if fstype_v2 := [m for m, t, _ in _mounts() if t == "cgroup2" and m.startswith(str(base))]:
        ctl = runcg._read(Path(fstype_v2[0]) / "cgroup.controllers") or ""
        if controller in ctl.split():
            return 2, Path(fstype_v2[0])
    return f"no {controller} controller under {base}"


def remove_dir(path: Path, wait_s: float = 3.0) -> bool:
    """Kill every process in the cgroup folder and remove it; True when it existed. The
    lab's shared folder (:data:`BASE`) goes too once it is empty."""
    if not path.is_dir():
        return False
    if path.parent.name == BASE:
        try:
            return _remove(path)
        finally:
            try:
                path.parent.rmdir()
            except OSError:
                pass  # another lab's folder is in it
    return _remove(path, wait_s)


def _remove(path: Path, wait_s: float = 3.0) -> bool:
    if any(c.is_dir() for c in path.iterdir()):
        return False  # a parent still in use (another lab's, or a child not listed)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pids = [int(p) for p in (runcg._read(path / "cgroup.procs") or "").split() if p.isdigit()]
        pids = [p for p in pids if p > 0 and p != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise
        time.sleep(0.02)
    return True


class HostCgroup:
    """One host's cgroups. ``record`` is called with each folder made (the state file),
    parents before children."""

    def __init__(self, run_id: str, host: str, *, cpu: float | None, memory_mb: int | None,
                 record: Callable[[Path], None], root: str | None = None):
        self.host = host
        self.cpu = cpu
        self.memory_mb = memory_mb
        self.dirs: list[Path] = []
        mem = hierarchy("memory", root)
        if isinstance(mem, str):
            raise OSError(f"no memory cgroup for {host}: {mem}")
        self.version, mount = mem
        self.memory_dir = self._make(mount, run_id, host, record)
        if self.version == 2:
            self._enable(mount, run_id, "memory")
        self._set_memory(memory_mb)
        self.memory = runcg.RunCgroup(self.memory_dir, self.version, memory_mb or None)
        self.cpu_dir: Path | None = None
        if cpu:
            found = hierarchy("cpu", root)
            if isinstance(found, str):
                raise OSError(f"no CPU cgroup for {host}: {found}")
            if found[0] == 2:
                self._enable(found[1], run_id, "cpu")
                self.cpu_dir = self._make(found[1], run_id, host, record)
            else:
                self.cpu_dir = self._make(found[1], run_id, host, record)
            self._set_cpu(cpu)

    def _make(self, mount: Path, run_id: str, host: str, record: Callable[[Path], None]) -> Path:
        path = mount
        for part in (BASE, run_id, host):
            path = path / part
            if part == BASE:  # shared by every lab: made when missing, removed once empty
                path.mkdir(exist_ok=True)
                continue
            try:
                path.mkdir()
            except FileExistsError:
                if part != host:  # the run's folder, listed when it was made
                    continue
            self.dirs.append(path)
            record(path)
        return path

    @staticmethod
    def _enable(mount: Path, run_id: str, controller: str) -> None:
        for parent in (mount, mount / BASE, mount / BASE / run_id):
            if parent.is_dir() and controller not in (runcg._read(parent / "cgroup.subtree_control") or "").split():
                runcg._write(parent / "cgroup.subtree_control", f"+{controller}")

    def _set_memory(self, limit_mb: int | None) -> None:
        p = self.memory_dir
        if self.version == 2:
            runcg._write(p / "memory.max", str(limit_mb * _MIB) if limit_mb else "max")
            if (p / "memory.swap.max").exists():
                runcg._write(p / "memory.swap.max", "0" if limit_mb else "max")
            if (p / "memory.oom.group").exists():
                runcg._write(p / "memory.oom.group", "1")
            return
        memsw = p / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            runcg._write(memsw, "-1")
        runcg._write(p / "memory.limit_in_bytes", str(limit_mb * _MIB) if limit_mb else "-1")
        if memsw.exists() and limit_mb:
            runcg._write(memsw, str(limit_mb * _MIB))

    def _set_cpu(self, share: float) -> None:
        assert self.cpu_dir is not None
        quota = max(1000, int(share * CPU_PERIOD_US))
        if (self.cpu_dir / "cpu.max").exists():
            runcg._write(self.cpu_dir / "cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            runcg._write(self.cpu_dir / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            runcg._write(self.cpu_dir / "cpu.cfs_quota_us", str(quota))

    def enter(self) -> None:
        """Move the calling process into the host's cgroups (a ``preexec_fn``)."""
        for d in (self.memory_dir, self.cpu_dir):
            if d is not None:
                fd = os.open(d / "cgroup.procs", os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)

    def oom_killed(self) -> bool:
        return self.memory.oom_killed()

    def oom_kills(self) -> int:
        return max(0, self.memory._oom_count()[0] - self.memory._oom_base)

    def peak_mb(self) -> float | None:
        return self.memory.peak_mb()

    def throttled_s(self) -> float | None:
        """Seconds the host's processes waited for their CPU quota (``cpu.stat``)."""
        if self.cpu_dir is None:
            return None
        text = runcg._read(self.cpu_dir / "cpu.stat")
        usec = runcg._keyed(text, "throttled_usec")
        if usec is not None:
            return usec / 1e6
        ns = runcg._keyed(text, "throttled_time")
        return None if ns is None else ns / 1e9
