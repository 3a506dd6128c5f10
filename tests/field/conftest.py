"""Fixtures for the field lab's tests: they run as root on Linux where the lab can run
(``dflctl lab check`` exits 0), and are skipped with the reason otherwise."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def lab_unavailable() -> str | None:
    """Why the lab cannot run here (the line ``dflctl lab check`` prints), or None."""
    from dfl_agent.cli.lab import check

    why = check.blocker()
    if why:
        return why
    lack = check.missing(check.probe())
    return f"missing {', '.join(lack)}" if lack else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/field/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.field)


@pytest.fixture(scope="session", autouse=True)
def _needs_lab() -> None:
    why = lab_unavailable()
    if why:
        pytest.skip(f"the field lab cannot run here: {why}")
