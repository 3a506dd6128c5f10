"""Fixtures for every test folder."""

from __future__ import annotations

import contextlib

import pytest

from dfl_agent.runtime.service import cgroup


@pytest.fixture(scope="session", autouse=True)
def _no_run_cgroups_left():
    """Remove, at the end of the session, the empty run cgroups that agents killed by tests
    (SIGKILL, with no later agent of the same node and state folder) left behind, as the
    next agent would when it starts.  Only cgroups made during the session, never one that
    holds a process."""
    found = cgroup._run_base(None)
    base = None if isinstance(found, str) else found[2]
    existed = base is not None and base.is_dir()
    before = set(base.glob("run-*")) if existed and base is not None else set()
    yield
    if base is None or not base.is_dir():
        return
    for leaf in set(base.glob("run-*")) - before:
        if not (leaf / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                leaf.rmdir()
    if not existed:
        with contextlib.suppress(OSError):
            base.rmdir()
