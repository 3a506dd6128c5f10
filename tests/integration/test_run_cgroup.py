"""A run process's memory cgroup on the real kernel (cgroup v1 or v2, as root): a plain
Python child (no torch) that allocates past its limit is OOM-killed and classified "oom";
one under its limit ends "ok"; every cgroup made here is removed, also when a test fails.
The layouts the kernel here does not have are in tests/unit/test_cgroup.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dfl_agent.runtime.service.cgroup import RunCgroup, agent_stem, classify_exit, remove_leftovers

#: touch every page, so that the memory is really used (a fresh bytearray may be lazily zeroed)
ALLOC = "import sys; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096]); print('done')"


def _probe() -> str | None:
    """Why no real run cgroup can be made here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (outside a systemd service with Delegate=yes)"
    cg = RunCgroup.create(f"probe-{os.getpid()}", 64)
    if cg is None:
        return "no memory cgroup can be made here (see the WARNING of dfl_agent.runtime.service.cgroup)"
    cg.remove()
    return None


WHY = _probe()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.fixture
def cgroups():
    """``make(name, limit_mb)``: a real RunCgroup, removed (and checked gone) at the end."""
    made: list[RunCgroup] = []

    def make(name: str, limit_mb: int | None) -> RunCgroup:
        cg = RunCgroup.create(f"test-{os.getpid()}-{name}", limit_mb)
        assert cg is not None
        made.append(cg)
        return cg

    yield make
    for cg in made:
        cg.remove()
    assert not [cg.path for cg in made if cg.path.exists()]


def _run(cg: RunCgroup, mb: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ALLOC, str(mb)], preexec_fn=cg.enter,
                          capture_output=True, text=True, timeout=60)


def test_a_run_past_its_limit_is_oom_killed_and_the_cgroup_goes(cgroups):
    cg = cgroups("over", 64)
    r = _run(cg, 200)
    assert r.returncode == -9, (r.returncode, r.stdout, r.stderr)
    assert "done" not in r.stdout
    assert cg.oom_killed()
    assert classify_exit(r.returncode, cg) == "oom"
    peak = cg.peak_mb()
    assert peak is None or peak <= 64.5, peak  # never above the limit
    cg.remove()
    assert not cg.path.exists()


def test_a_run_under_its_limit_ends_ok(cgroups):
    cg = cgroups("under", 64)
    r = _run(cg, 16)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert not cg.oom_killed()
    assert classify_exit(r.returncode, cg) == "ok"
    peak = cg.peak_mb()
    assert peak is None or 16 <= peak <= 64.5, peak  # the child was charged here, not outside
    cg.remove()
    assert not cg.path.exists()


def test_remove_kills_what_is_left_and_a_leftover_is_emptied_on_create(cgroups):
    cg = cgroups("left", None)
    child = subprocess.Popen(["sleep", "60"], preexec_fn=cg.enter)
    child2 = None
    try:
        # a new process for the same run (the supervisor restarted): the old one is killed
        again = cgroups("left", 64)
        assert again.path == cg.path and child.wait(timeout=5) == -9
        child2 = subprocess.Popen(["sleep", "60"], preexec_fn=again.enter)
        t0 = time.monotonic()
        again.remove()
        assert child2.wait(timeout=5) == -9 and time.monotonic() - t0 < 3
        assert not again.path.exists()
    finally:
        for p in (child, child2):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_supervisor_removes_the_empty_run_cgroups_an_earlier_one_left(cgroups, tmp_path):
    """A supervisor killed with SIGKILL leaves its run's cgroup behind (its run process died
    with it).  The next one with the same node id and state folder removes its empty
    cgroups when it starts; a cgroup that still holds a process, and another node's, are
    left alone."""
    stem = agent_stem(f"test-{os.getpid()}-n1", tmp_path)
    left = RunCgroup.create(f"{stem}-r-abc-1", None)
    other = RunCgroup.create(f"{agent_stem(f'test-{os.getpid()}-n10', tmp_path)}-r-abc-1", None)  # alike id
    busy = RunCgroup.create(f"{stem}-r-def-1", None)
    assert left and other and busy
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=busy.enter)
    try:
        assert remove_leftovers(stem) == [left.path.name]
        assert not left.path.exists() and other.path.exists() and busy.path.exists()
        assert proc.poll() is None  # nothing killed
    finally:
        proc.kill()
        proc.wait()
        for cg in (left, other, busy):
            cg.remove()


def test_two_agents_with_one_node_id_never_kill_each_others_runs(tmp_path):
    """Two agents on one host with the same node id, in other federations and state
    folders, each start a ``--once`` run in the same second, so the run ids match.  Each
    run process still has a cgroup of its own: the end of one run (its cgroup removed, its
    processes killed) leaves the other's run process alive, and a starting agent's clean-up
    of its leftovers leaves the other agent's empty cgroups alone."""
    node, run = f"test-{os.getpid()}-solo", "20261203T040000Z-1"
    stem_a, stem_b = agent_stem(node, tmp_path / "a"), agent_stem(node, tmp_path / "b")
    assert stem_a != stem_b and stem_a == agent_stem(node, tmp_path / "x" / ".." / "a")
    a, b = RunCgroup.create(f"{stem_a}-{run}", None), RunCgroup.create(f"{stem_b}-{run}", None)
    assert a and b and a.path != b.path
    pa = subprocess.Popen(["sleep", "60"], preexec_fn=a.enter)
    pb = subprocess.Popen(["sleep", "60"], preexec_fn=b.enter)
    waiting = RunCgroup.create(f"{stem_b}-{run}-2", None)  # made, its process not yet started
    try:
        a.remove()
        assert pa.wait(timeout=5) == -9 and not a.path.exists()
        assert pb.poll() is None and b.path.exists()  # the other agent's run goes on
        assert waiting and remove_leftovers(stem_a) == [] and waiting.path.exists()
    finally:
        for p in (pa, pb):
            if p.poll() is None:
                p.kill()
                p.wait()
        for cg in (a, b, waiting):
            if cg:
                cg.remove()
