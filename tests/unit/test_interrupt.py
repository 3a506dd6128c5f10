"""dfl_agent.interrupt: the start-up SIGINT handler is installed only in the program being run,
only over Python's default handler, and end_startup gives SIGINT back (the real processes:
tests/system/test_ctrl_c.py)."""

from __future__ import annotations

import signal
import sys

import pytest

from dfl_agent import interrupt


@pytest.fixture(autouse=True)
def _restore_sigint():
    old = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, old)
    interrupt._prog = None


def test_only_the_program_being_run_gets_the_start_up_handler(monkeypatch):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt.during_startup("dflctl", "dfl_agent.cli.dflctl")  # imported by another program (pytest)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/dflctl", "peers"])  # the console script
    interrupt.during_startup("dflctl", "dfl_agent.cli.dflctl")
    assert signal.getsignal(signal.SIGINT) is interrupt._exit_interrupted
    interrupt.end_startup()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    interrupt.during_startup("dfl-agent", "__main__")  # python -m dfl_agent.runtime.service.daemon
    assert signal.getsignal(signal.SIGINT) is interrupt._exit_interrupted


def test_an_ignored_sigint_stays_ignored(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dflctl"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job of a shell script, nohup
    interrupt.during_startup("dflctl", "__main__")
    interrupt.end_startup()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
