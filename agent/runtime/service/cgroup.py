"""A memory cgroup for each run process (cgroup v1 or v2), so that a run that outgrows
the device profile's ``compute.memory_budget_mb`` is OOM-killed alone and the service
goes on serving.

Where the cgroup goes:

- **Under systemd** (the process's own cgroup is a ``*.service``; the shipped units set
  ``Delegate=yes``): below the service's own cgroup, ``<service>/run-<name>``. On cgroup
  v2 a cgroup with children may hold no processes, so the first :meth:`RunCgroup.create`
  moves the service's processes into the leaf
  ``<service>/supervisor`` and turns the memory controller on for the service's children.
  On cgroup v1 systemd delegates the memory hierarchy only to a service running as root;
  a service running as an unprivileged user (the shipped units) gets no memory cgroup
  there, and the unit's ``MemoryMax=`` bounds the whole service as before.
- **Outside systemd, as root:** ``<memory hierarchy>/dfl-agent/run-<name>``
  (``/sys/fs/cgroup/dfl-agent`` on v2, ``/sys/fs/cgroup/memory/dfl-agent`` on v1).
- **Otherwise** (not root and no delegated service cgroup, no memory controller, a
  read-only cgroup file system): no cgroup; :meth:`RunCgroup.create` returns None and
  the process logs once, at WARNING, ``run processes run without a memory limit: <why>``.

The limit is ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1), with swap closed
(``memory.swap.max = 0``, ``memory.memsw.limit_in_bytes`` = the limit) where the kernel
has those files, so that the limit is not stretched by swapping; on v2 ``memory.oom.group``
makes the OOM killer take the run's processes together. ``limit_mb`` 0 or None still makes
a cgroup, without a limit: the run is still counted (peak memory, OOM kills) and its
leftover processes are still killed at :meth:`RunCgroup.remove`.

The address-space limit (``RLIMIT_AS``) is not used: torch reserves far more address space
than it touches. Nothing here imports torch.

Use::

    cg = RunCgroup.create(f"{agent_stem(node_id, state_dir)}-{run_id}", profile.compute.memory_budget_mb)
    child = subprocess.Popen(argv, preexec_fn=cg.enter if cg else None)
    rc = child.wait()
    outcome = classify_exit(rc, cg)          # "ok", "oom", "killed" or "failed"
    peak = cg.peak_mb() if cg else None
    if cg:
        cg.remove()
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: where the cgroup file systems are mounted
CGROUP_ROOT = "/sys/fs/cgroup"
#: this process's cgroups (one ``hierarchy-id:controllers:path`` line per hierarchy)
PROC_CGROUP = "/proc/self/cgroup"
#: the folder of the run cgroups outside systemd, below the memory hierarchy's root
BASE_NAME = "dfl-agent"
#: the leaf the service's own processes move into on cgroup v2 (no processes in inner cgroups)
SUPERVISOR_LEAF = "supervisor"

_MIB = 1024 * 1024
_state_lock = threading.Lock()
_warned = False
#: services whose processes were moved into their leaf in this process (cgroup v2)
_prepared: set[str] = set()


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def _write(path: Path, value: str) -> None:
    """Write one value to a cgroup file (one write, as the kernel's files want it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, value.encode("ascii"))
    finally:
        os.close(fd)


def _keyed(text: str | None, key: str) -> int | None:
    """The value of ``key N`` in a flat keyed file (``memory.events``, ``memory.oom_control``)."""
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return None


def _number(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _hierarchy(root: str | None) -> tuple[int, Path] | str:
    """``(version, mount)`` of the memory controller's hierarchy, or why there is none."""
    base = Path(root or CGROUP_ROOT)
    controllers = _read(base / "cgroup.controllers")
    if controllers is not None:
        if "memory" in controllers.split():
            return 2, base
        return f"the memory controller is not enabled in {base} (cgroup v2)"
    if (base / "memory" / "memory.limit_in_bytes").exists():
        return 1, base / "memory"
    if root is None:  # mounted elsewhere: /proc/self/mounts names it
        for line in (_read(Path("/proc/self/mounts")) or "").splitlines():
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "cgroup" and "memory" in fields[3].split(","):
                return 1, Path(fields[1])
    if not base.exists():
        return f"no cgroup file system at {base}"
    return f"no memory controller under {base}"


def _own_path(version: int) -> str | None:
    """This process's cgroup in the memory hierarchy (``/system.slice/x.service``)."""
    for line in (_read(Path(PROC_CGROUP)) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if (version == 2 and parts[0] == "0" and parts[1] == "") or (
                version == 1 and "memory" in parts[1].split(",")):
            return parts[2].strip()
    return None


def _service_dir(version: int, mount: Path) -> Path | None:
    """The systemd service's own cgroup when this process runs in one, else None (also
    when already moved into ``<service>/supervisor``)."""
    own = _own_path(version)
    if not own:
        return None
    parts = [p for p in own.split("/") if p]
    if len(parts) >= 2 and parts[-1] == SUPERVISOR_LEAF and parts[-2].endswith(".service"):
        parts = parts[:-1]
    if not parts or not parts[-1].endswith(".service"):
        return None
    return mount.joinpath(*parts)


def _run_base(root: str | None) -> tuple[int, Path | None, Path] | str:
    """Where run cgroups go: ``(version, service, base)`` (``service``: the systemd service's
    delegated cgroup or None; ``base``: the folder of the ``run-*`` cgroups), or why none."""
    found = _hierarchy(root)
    if isinstance(found, str):
        return found
    version, mount = found
    service = _service_dir(version, mount)
    return version, service, (service if service is not None else mount / BASE_NAME)


def _enable_memory(cgroup: Path) -> None:
    """Turn the memory controller on for the children of ``cgroup`` (cgroup v2)."""
    if "memory" not in (_read(cgroup / "cgroup.subtree_control") or "").split():
        _write(cgroup / "cgroup.subtree_control", "+memory")


def _prepare_service(service: Path) -> None:
    """Move the service's processes into ``<service>/supervisor`` and turn the memory
    controller on for its children (cgroup v2; once per process and service)."""
    key = str(service)
    with _state_lock:
        if key in _prepared:
            return
        leaf = service / SUPERVISOR_LEAF
        leaf.mkdir(exist_ok=True)
        for pid in (_read(service / "cgroup.procs") or "").split():
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                _write(leaf / "cgroup.procs", pid)
        _enable_memory(service)
        _prepared.add(key)
    log.info("moved the service's processes into %s; run cgroups go beside it", leaf)


def agent_stem(node_id: str, state_dir: str | os.PathLike[str]) -> str:
    """The stem of one agent's run cgroup names: ``<node_id>-<tag>``, where ``tag`` is the
    first 8 hex digits of the SHA-256 of the agent's resolved state folder.  Two agents on
    one host with the same node id (in different federations or state folders) so never
    share a run cgroup, whose removal at one run's end would kill the other's run process."""
    tag = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]
    return f"{node_id}-{tag}"


def _leaf_name(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:200] or "run"
    return safe if safe.startswith("run-") else f"run-{safe}"


def _kill_members(path: Path, version: int, wait_s: float = 2.0) -> bool:
    """SIGKILL every process in the cgroup and wait until it is empty (True) or
    ``wait_s`` has passed (False)."""
    deadline = time.monotonic() + wait_s
    killed = False
    while True:
        pids = [int(p) for p in (_read(path / "cgroup.procs") or "").split() if p.isdigit()]
        pids = [p for p in pids if p > 0 and p != os.getpid()]  # never 0: kill(0) is our group
        if not pids:
            return True
        if time.monotonic() >= deadline:
            return False
        if not killed and version == 2 and (path / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(path / "cgroup.kill", "1")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed = True
        time.sleep(0.02)


class RunCgroup:
    """The memory cgroup of one run process; see the module's docstring.

    Attributes:
        path: the cgroup's folder.
        version: 1 or 2.
        limit_mb: the limit in MiB, or None (no limit: accounting only).
    """

    def __init__(self, path: Path, version: int, limit_mb: int | None, *, tidy_base: Path | None = None):
        self.path = path
        self.version = version
        self.limit_mb = limit_mb
        self._procs = str(path / "cgroup.procs")
        self._tidy_base = tidy_base
        self._oom_base, self._precise = self._oom_count()

    @classmethod
    def create(cls, name: str, limit_mb: int | None, *, root: str | None = None) -> RunCgroup | None:
        """A memory cgroup for one run process, limited to ``limit_mb`` MiB (0 or None:
        no limit, the cgroup only counts). ``name`` names the cgroup (``run-<name>``); it
        should tell the node and the run apart, as a leftover cgroup of the same name is
        emptied (its processes killed) and reused. ``root`` is the cgroup file systems'
        mount (default ``/sys/fs/cgroup``).

        Returns None, and logs once per process at WARNING why, when no cgroup can be
        made; never raises."""
        limited = bool(limit_mb)
        found = _run_base(root)
        if isinstance(found, str):
            return cls._none(found, limited)
        version, service, base = found
        if service is None and os.geteuid() != 0:
            return cls._none("not running as root and not in a systemd service with Delegate=yes", limited)
        path = base / _leaf_name(name)
        try:
            if service is not None and version == 2:
                _prepare_service(service)
            for attempt in range(2):  # a run ending meanwhile may remove an empty dfl-agent folder
                try:
                    if service is None:
                        base.mkdir(exist_ok=True)
                        if version == 2:
                            _enable_memory(base)
                    if path.exists():  # a leftover of an earlier process: empty it, start afresh
                        _kill_members(path, version)
                        try:
                            path.rmdir()
                        except OSError as e:
                            log.debug("reusing the leftover run cgroup %s (%s)", path, e)
                    path.mkdir(exist_ok=True)
                    break
                except FileNotFoundError:
                    if attempt or service is not None:
                        raise
        except OSError as e:
            hint = ""
            if service is not None:
                hint = (" (does the unit set Delegate=yes?)" if version == 2 or os.geteuid() == 0 else
                        " (on cgroup v1 systemd delegates the memory controller only to services running as root)")
            return cls._none(f"cannot create a cgroup under {base}: {e.strerror or e}{hint}", limited)
        cg = cls(path, version, limit_mb or None, tidy_base=base if service is None else None)
        try:
            cg._apply_limit()
        except OSError as e:
            cg.remove()
            return cls._none(f"cannot set the memory limit of {path}: {e.strerror or e}", limited)
        log.debug("run cgroup %s (cgroup v%d), memory limit %s", path, version,
                  f"{limit_mb} MiB" if limited else "none")
        return cg

    @staticmethod
    def _none(why: str, limited: bool) -> None:
        """No run cgroup, because ``why``: at WARNING the first time in the process that a cgroup
        with a limit (``limited``) could not be made, else at DEBUG."""
        global _warned
        with _state_lock:
            first, _warned = limited and not _warned, _warned or limited
        if first:
            log.warning("run processes run without a memory limit: %s", why)
        else:
            log.debug("no run cgroup: %s", why)
        return None

    def _apply_limit(self) -> None:
        p = self.path
        if self.version == 2:
            if not (p / "memory.max").exists():
                raise OSError(errno.ENOENT, "the memory controller is not enabled for it (no memory.max)")
            _write(p / "memory.max", str(self.limit_mb * _MIB) if self.limit_mb else "max")
            if (p / "memory.swap.max").exists():
                _write(p / "memory.swap.max", "0" if self.limit_mb else "max")
            if (p / "memory.oom.group").exists():
                _write(p / "memory.oom.group", "1")
            return
        memsw = p / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # memsw >= limit at every step: open it, set the limit, close it
            _write(memsw, "-1")
        _write(p / "memory.limit_in_bytes", str(self.limit_mb * _MIB) if self.limit_mb else "-1")
        if memsw.exists() and self.limit_mb:
            _write(memsw, str(self.limit_mb * _MIB))

    def _oom_count(self) -> tuple[int, bool]:
        """(count, precise): the OOM kills in the cgroup so far; where the kernel does not
        count them (v1 before Linux 4.13), the times the limit was hit (not precise)."""
        if self.version == 2:
            n = _keyed(_read(self.path / "memory.events"), "oom_kill")
            return (n or 0), True
        n = _keyed(_read(self.path / "memory.oom_control"), "oom_kill")
        if n is not None:
            return n, True
        fails = [_number(_read(self.path / f)) for f in ("memory.failcnt", "memory.memsw.failcnt")]
        return max((f for f in fails if f is not None), default=0), False

    def enter(self) -> None:
        """Move the calling process into the cgroup: ``Popen(..., preexec_fn=cg.enter)``
        runs it in the child between fork and exec, so the run's program allocates
        nothing outside the cgroup. Only ``os.open``/``os.write`` (no logging, no locks).

        Raises:
            OSError: the cgroup is gone or not writable (``Popen`` then fails with
                ``SubprocessError``, and the child never runs unbounded).
        """
        fd = os.open(self._procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer killed a process in the cgroup since it was
        made (``memory.events`` ``oom_kill`` on v2, ``memory.oom_control`` ``oom_kill``
        on v1; on v1 kernels without that counter: the limit was hit)."""
        return self._oom_count()[0] > self._oom_base

    def peak_mb(self) -> float | None:
        """The cgroup's peak memory in MiB (``memory.peak`` on v2, Linux 5.19 and later;
        ``memory.max_usage_in_bytes`` on v1); None where the kernel does not tell."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        n = _number(_read(self.path / name))
        return None if n is None else n / _MIB

    def remove(self) -> None:
        """Kill what is left in the cgroup and remove it (outside systemd also the
        ``dfl-agent`` folder, when no other run's cgroup is in it). Never raises; problems go to DEBUG."""
        try:
            if not _kill_members(self.path, self.version):
                log.debug("run cgroup %s still has processes after SIGKILL", self.path)
            for _ in range(50):
                try:
                    self.path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.02)
            else:
                log.debug("run cgroup %s stayed busy; left in place", self.path)
            if self._tidy_base is not None:
                with contextlib.suppress(OSError):  # another run's cgroup is in it
                    self._tidy_base.rmdir()
        except Exception as e:  # noqa: BLE001 - cleanup never raises
            log.debug("could not remove run cgroup %s: %s", self.path, e)

    def __repr__(self) -> str:
        return f"RunCgroup({str(self.path)!r}, v{self.version}, limit_mb={self.limit_mb})"


def remove_leftovers(stem: str, *, root: str | None = None) -> list[str]:
    """Remove the empty run cgroups an earlier supervisor of this agent left behind (it was
    killed, SIGKILL or the OOM killer, before its run process's cgroup was removed):
    folders ``run-<stem>-*`` beside the ones :meth:`RunCgroup.create` makes, where ``stem``
    is :func:`agent_stem`.  A cgroup that still holds a process is left alone (no process is
    killed here).  Call it when the supervisor starts, before its first run.  Never raises;
    returns the names removed."""
    removed: list[str] = []
    try:
        found = _run_base(root)
        if isinstance(found, str):
            return removed
        _, service, base = found
        prefix = _leaf_name(f"{stem}-")
        for leaf in sorted(base.glob(f"{glob.escape(prefix)}*")) if base.is_dir() else ():
            if not leaf.is_dir() or (_read(leaf / "cgroup.procs") or "").split():
                continue
            try:
                leaf.rmdir()
                removed.append(leaf.name)
            except OSError as e:
                log.debug("could not remove the leftover run cgroup %s: %s", leaf, e)
        if service is None and removed:
            with contextlib.suppress(OSError):  # another run's cgroup is in it
                base.rmdir()
    except OSError as e:
        log.debug("could not look for leftover run cgroups: %s", e)
    if removed:
        log.info("removed %d leftover run cgroup(s) of an earlier supervisor: %s", len(removed), ", ".join(removed))
    return removed


def classify_exit(returncode: int, cgroup: RunCgroup | None) -> str:
    """How a run process ended, from ``Popen.returncode`` and its cgroup:

    - ``"ok"``: exit code 0;
    - ``"oom"``: the cgroup's OOM-kill counter rose and the process was SIGKILLed, or
      exited non-zero because the OOM killer took one of its processes (on v1 kernels
      without that counter: SIGKILL after the limit was hit);
    - ``"killed"``: any other signal;
    - ``"failed"``: a non-zero exit code.
    """
    if returncode == 0:
        return "ok"
    if (returncode == -signal.SIGKILL or (returncode > 0 and cgroup is not None and cgroup._precise)) \
            and cgroup is not None and cgroup.oom_killed():
        return "oom"
    return "killed" if returncode < 0 else "failed"
