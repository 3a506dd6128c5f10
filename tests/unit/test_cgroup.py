"""``dfl_agent.runtime.service.cgroup``: where a run process's memory cgroup goes and what is
written into it, on cgroup v2 and v1 layouts laid out in a temporary folder with the
files the kernel would show (the real kernel's behaviour: tests/integration/test_run_cgroup.py).
No process is signalled here: the fake cgroups hold no process ids."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dfl_agent.runtime.service import cgroup
from dfl_agent.runtime.service.cgroup import RunCgroup, classify_exit

MIB = 1024 * 1024


def prepare(root: str | None = None) -> bool:
    """Under systemd on cgroup v2, move the service's processes into their leaf now
    (``<service>/supervisor``), as the first :meth:`RunCgroup.create` does.  Returns True when
    the service's cgroup is ready for run cgroups; never raises."""
    found = cgroup._hierarchy(root)
    if isinstance(found, str) or found[0] != 2:
        return False
    service = cgroup._service_dir(2, found[1])
    if service is None:
        return False
    try:
        cgroup._prepare_service(service)
    except OSError as e:
        cgroup.log.debug("could not prepare %s for run cgroups: %s", service, e)
        return False
    return True


@pytest.fixture(autouse=True)
def _fresh_module_state(monkeypatch, tmp_path):
    """Each test starts as a new process would: no warning given, no service prepared,
    and a /proc/self/cgroup of its own (outside any service unless the test says so)."""
    monkeypatch.setattr(cgroup, "_warned", False)
    monkeypatch.setattr(cgroup, "_prepared", set())
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/user.slice/user-0.slice/session-1.scope\n")
    monkeypatch.setattr(cgroup, "PROC_CGROUP", str(proc))
    return proc


def v2_root(tmp_path: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("cpu memory\n")
    (root / "cgroup.procs").write_text("")
    return root


def v2_files(d: Path) -> Path:
    """What the kernel shows in a new v2 cgroup whose parent enabled the memory controller."""
    d.mkdir(parents=True, exist_ok=True)
    for name, text in {"cgroup.procs": "", "cgroup.subtree_control": "", "memory.max": "max\n",
                       "memory.swap.max": "max\n", "memory.oom.group": "0\n", "memory.peak": "0\n",
                       "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"}.items():
        (d / name).write_text(text)
    return d


def v1_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    return root


def v1_files(d: Path, oom_counter: bool = True) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    unlimited = "9223372036854771712\n"
    oom = "oom_kill_disable 0\nunder_oom 0\n" + ("oom_kill 0\n" if oom_counter else "")
    for name, text in {"cgroup.procs": "", "tasks": "", "memory.limit_in_bytes": unlimited,
                       "memory.memsw.limit_in_bytes": unlimited, "memory.oom_control": oom,
                       "memory.failcnt": "0\n", "memory.memsw.failcnt": "0\n",
                       "memory.max_usage_in_bytes": "0\n"}.items():
        (d / name).write_text(text)
    return d


def text(p: Path) -> str:
    return p.read_text().strip()


def test_v2_outside_systemd_limits_the_run_and_closes_swap(tmp_path):
    root = v2_root(tmp_path)
    run = v2_files(root / "dfl-agent" / "run-node-a_run_1")
    cg = RunCgroup.create("node-a/run 1", 64, root=str(root))
    assert cg is not None and cg.path == run and cg.version == 2 and cg.limit_mb == 64
    assert text(run / "memory.max") == str(64 * MIB)
    assert text(run / "memory.swap.max") == "0"  # the limit is not stretched by swapping
    assert text(run / "memory.oom.group") == "1"  # the run's processes go together
    assert "+memory" in text(root / "dfl-agent" / "cgroup.subtree_control")
    cg.enter()  # what Popen(preexec_fn=cg.enter) runs in the child
    assert text(run / "cgroup.procs") == "0"
    (run / "cgroup.procs").write_text("")

    assert not cg.oom_killed() and classify_exit(-9, cg) == "killed"
    (run / "memory.peak").write_text(f"{100 * MIB}\n")
    (run / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 1\n")
    assert cg.oom_killed() and cg.peak_mb() == 100.0
    assert classify_exit(-9, cg) == "oom"
    assert classify_exit(1, cg) == "oom"  # a worker of the run was OOM-killed and the run failed
    assert classify_exit(0, cg) == "ok"
    cg.remove()  # never raises (this fake folder cannot be removed)


def test_v2_without_a_limit_still_makes_a_cgroup(tmp_path, caplog):
    root = v2_root(tmp_path)
    run = v2_files(root / "dfl-agent" / "run-r")
    run.joinpath("memory.swap.max").write_text("0\n")  # a leftover with old settings
    cg = RunCgroup.create("r", 0, root=str(root))
    assert cg is not None and cg.limit_mb is None
    assert text(run / "memory.max") == "max" and text(run / "memory.swap.max") == "max"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_v2_under_systemd_moves_the_service_into_a_leaf_first(tmp_path, _fresh_module_state):
    root = v2_root(tmp_path)
    service = root / "system.slice" / "dfl-agent.service"
    service.mkdir(parents=True)
    (service / "cgroup.procs").write_text("4242\n")
    (service / "cgroup.subtree_control").write_text("")
    _fresh_module_state.write_text("0::/system.slice/dfl-agent.service\n")
    run = v2_files(service / "run-r1")
    cg = RunCgroup.create("r1", 128, root=str(root))
    assert cg is not None and cg.path == run
    assert text(service / "supervisor" / "cgroup.procs") == "4242"  # out of the inner cgroup
    assert text(service / "cgroup.subtree_control") == "+memory"
    assert text(run / "memory.max") == str(128 * MIB)
    assert not (root / "dfl-agent").exists()  # nothing outside the service's own cgroup

    # the next run: the process now lives in <service>/supervisor; no second move
    _fresh_module_state.write_text("0::/system.slice/dfl-agent.service/supervisor\n")
    (service / "cgroup.procs").write_text("999\n")
    run2 = v2_files(service / "run-r2")
    cg2 = RunCgroup.create("run-r2", 256, root=str(root))
    assert cg2 is not None and cg2.path == run2
    assert text(service / "supervisor" / "cgroup.procs") == "4242"
    assert prepare(root=str(root)) is True


def test_without_a_memory_controller_the_run_is_unlimited_and_says_so_once(tmp_path, caplog):
    root = v2_root(tmp_path, controllers="cpu io pids")
    caplog.set_level(logging.DEBUG, logger="dfl_agent.runtime.service.cgroup")
    assert RunCgroup.create("a", 64, root=str(root)) is None
    assert RunCgroup.create("b", 64, root=str(root)) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"run processes run without a memory limit: the memory controller is not enabled "
                        f"in {root} (cgroup v2)"]
    assert prepare(root=str(root)) is False


def test_no_cgroup_file_system(tmp_path, caplog):
    assert RunCgroup.create("a", 64, root=str(tmp_path / "absent")) is None
    assert "run processes run without a memory limit: no cgroup file system at" in caplog.text


def test_a_cgroup_without_memory_files_is_not_used_and_not_left_behind(tmp_path, caplog):
    root = v2_root(tmp_path)  # mkdir makes an empty folder here: no memory.max, as with the controller off
    assert RunCgroup.create("a", 64, root=str(root)) is None
    assert "cannot set the memory limit of" in caplog.text and "no memory.max" in caplog.text
    assert not (root / "dfl-agent" / "run-a").exists()  # the half-made cgroup is gone


def test_v1_sets_the_limit_and_the_memory_plus_swap_limit(tmp_path):
    root = v1_root(tmp_path)
    run = v1_files(root / "memory" / "dfl-agent" / "run-r")
    cg = RunCgroup.create("r", 64, root=str(root))
    assert cg is not None and cg.version == 1 and cg.path == run
    assert text(run / "memory.limit_in_bytes") == str(64 * MIB)
    assert text(run / "memory.memsw.limit_in_bytes") == str(64 * MIB)
    (run / "memory.max_usage_in_bytes").write_text(f"{64 * MIB}\n")
    assert cg.peak_mb() == 64.0 and not cg.oom_killed()
    (run / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cg.oom_killed() and classify_exit(-9, cg) == "oom"
    assert classify_exit(-15, cg) == "killed"  # stopped by another signal: not the OOM killer's doing


def test_v1_kernel_without_an_oom_counter_needs_sigkill_and_a_hit_limit(tmp_path):
    root = v1_root(tmp_path)
    run = v1_files(root / "memory" / "dfl-agent" / "run-r", oom_counter=False)
    cg = RunCgroup.create("r", 64, root=str(root))
    assert cg is not None and not cg.oom_killed()
    (run / "memory.memsw.failcnt").write_text("3\n")
    assert cg.oom_killed()
    assert classify_exit(-9, cg) == "oom"
    assert classify_exit(1, cg) == "failed"  # a hit limit alone proves no OOM kill


def test_classify_exit_without_a_cgroup():
    assert classify_exit(0, None) == "ok"
    assert classify_exit(-9, None) == "killed"
    assert classify_exit(-15, None) == "killed"
    assert classify_exit(2, None) == "failed"
