"""The run process: one admitted run of the always-on agent, in a child process.

The supervisor (:mod:`dfl_agent.runtime.service.supervisor`) starts it as::

    python -m dfl_agent.runtime.run.run_process --config RUN_DIR/run.toml --run-dir RUN_DIR

``run.toml`` is the run's effective configuration (node.toml with the descriptor's
settings, :func:`~dfl_agent.runtime.shared.run_config.run_config_for`), ``RUN_DIR/descriptor.json``
the run's descriptor (saved at admission).  The child imports torch, trains the run's rounds
with a training :class:`~dfl_agent.runtime.run.agent.Agent` over its own data-plane MQTT session,
writes checkpoints, metrics and the candidate model (with its ONNX export), and exits.  Its
states and its end carry its peak resident memory (:func:`peak_rss_mb`), which the supervisor
records in the run's ledger entry.

It talks to the supervisor only through :class:`RunChannel`, its
:class:`~dfl_agent.runtime.shared.run_host.RunHost`: typed messages over a pipe
(:mod:`dfl_agent.runtime.shared.pipe`), on the child's original standard output (the child's own
``print`` output goes to standard error) and its standard input.  It publishes no presence,
no status and no last will: the supervisor signs and publishes them.  Each state after the
run's rounds waits until the supervisor recorded it in the run ledger.  End of input means
the supervisor is gone: the child stops at once.

A stop (the supervisor stopping, or an operator's cancel) is SIGTERM: the run leaves cleanly
after the round in progress is abandoned; the supervisor sends SIGKILL after its grace period.

Exit codes: 0 the run ended (finished or stopped), 2 the run cannot start (bad configuration or
data), 3 the broker is unreachable, 1 a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from dfl_agent.runtime.shared import pipe
from dfl_agent.runtime.shared.run_host import HostGone

log = logging.getLogger("dfl_agent.daemon")

#: seconds the child waits for the supervisor's acknowledgement of a state
ACK_TIMEOUT_S = 60.0


def peak_rss_mb() -> float | None:
    """This process's peak resident set size so far, in MiB (``getrusage``'s ``ru_maxrss``:
    KiB on Linux, bytes on macOS), rounded to 0.1; None where the platform has no ``getrusage``.
    The run reports it with its states and its end (the ledger entry's ``peak_rss_mb``)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not a Unix
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


class RunChannel:
    """The run process's :class:`~dfl_agent.runtime.shared.run_host.RunHost`: its end of the typed
    pipe (:mod:`dfl_agent.runtime.shared.pipe`) to its supervisor.

    Args:
        out: the binary stream of messages to the supervisor (the child's original stdout).
        inp: the text stream of the supervisor's messages (the child's stdin).
    """

    def __init__(self, out: IO[bytes], inp: IO[str]):
        self.out, self.inp = out, inp
        self._write_lock = threading.Lock()
        self._acks: dict[int, threading.Event] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._may_join: int = pipe.UNBOUNDED
        self._members: tuple[str, ...] = ()
        self.gone = threading.Event()
        #: called once when the supervisor is gone (the child sets its stop event)
        self.on_gone: Callable[[], object] | None = None
        #: called (on the pipe's thread) when the supervisor says reload (SIGHUP)
        self.on_reload: Callable[[], object] | None = None
        #: lines of the supervisor that were not pipe messages (dropped)
        self.dropped = 0

    def send(self, msg: pipe.FromRun) -> None:
        """Write one message (thread-safe); a closed pipe marks the supervisor gone."""
        line = pipe.to_line(msg)
        with self._write_lock:
            try:
                self.out.write(line)
                self.out.flush()
            except (BrokenPipeError, OSError, ValueError):
                self._set_gone()

    def read_start(self) -> pipe.Start:
        """The supervisor's first message (:class:`~dfl_agent.runtime.shared.pipe.Start`), then read
        the rest on a thread.

        Raises:
            HostGone: the input ended before it.
            PipeError: the first line is not a start message.
        """
        line = self.inp.readline()
        if not line:
            raise HostGone("the supervisor closed the pipe before the start message")
        start = pipe.from_line(line)
        if not isinstance(start, pipe.Start):
            raise pipe.PipeError(f"the first message is {start.type}, not start")
        self._members, self._may_join = start.members, start.may_join
        threading.Thread(target=self._reader, name="dfl-run-pipe", daemon=True).start()
        return start

    def _reader(self) -> None:
        for line in self.inp:
            try:
                msg = pipe.from_line(line)
            except pipe.PipeError as exc:
                self.dropped += 1
                log.warning("run process: dropped a line from the supervisor: %s", exc)
                continue
            if isinstance(msg, pipe.Ack):
                with self._lock:
                    ev = self._acks.get(msg.seq)
                if ev is not None:
                    ev.set()
            elif isinstance(msg, pipe.MayJoin):
                self._may_join = msg.n
            elif isinstance(msg, pipe.Reload) and self.on_reload is not None:
                self.on_reload()
        self._set_gone()

    def _set_gone(self) -> None:
        if not self.gone.is_set():
            self.gone.set()
            with self._lock:
                for ev in self._acks.values():
                    ev.set()
            if self.on_gone is not None:
                self.on_gone()

    # -- the RunHost interface ------------------------------------------------------------------
    def members(self) -> tuple[str, ...]:
        return self._members

    def may_join(self) -> int:
        return self._may_join

    def publish_presence(self, descriptor: Mapping[str, Any]) -> None:
        self.send(pipe.Presence(dict(descriptor)))

    def leave(self) -> None:
        self.send(pipe.Goodbye())

    def publish_status(self, report: pipe.StatusReport) -> None:
        self.send(report)

    def record_state(self, report: pipe.StateReport) -> None:
        with self._lock:
            if self.gone.is_set():
                raise HostGone(f"the supervisor is gone; the run's state {report.state} is not recorded")
            self._seq += 1
            seq = self._seq
            ev = self._acks[seq] = threading.Event()
        self.send(dataclasses.replace(report, seq=seq, peak_rss_mb=peak_rss_mb()))
        ok = ev.wait(ACK_TIMEOUT_S)
        with self._lock:
            self._acks.pop(seq, None)
        if not ok or self.gone.is_set():
            raise HostGone(f"the supervisor did not record the run's state {report.state}")


def run_child(config: str, run_dir: str, channel: RunChannel, *, once: bool = False,
              node_config: str | None = None) -> int:
    """Train the run of ``run_dir`` with the configuration ``config``; returns the exit code.
    ``once``: ``dfl-agent run --once``'s run, whose checkpoints and metrics stay in the state
    directory; ``node_config``: node.toml, re-read on the supervisor's :class:`~dfl_agent.runtime.shared.pipe.Reload`."""
    from dfl_agent.jsonbound import loads as bounded_loads
    from dfl_agent.runtime.shared.assembly import StartupError

    try:
        from dfl_agent.runtime.run.agent import Agent
    except ModuleNotFoundError as exc:  # the base wheel: no torch, so no run can train here
        from dfl_agent.extras import missing_torch

        channel.send(pipe.Failure("startup", missing_torch(exc) or str(exc)))
        return 2
    from dfl_agent.runtime.shared.config import ConfigError, load_config
    from dfl_agent.runtime.shared.descriptor import RunDescriptor

    try:
        cfg = load_config(config)
        raw = bounded_loads((Path(run_dir) / "descriptor.json").read_bytes(), "state")
        d = RunDescriptor.from_dict({k: v for k, v in raw.items() if k != "schema_version"})
    except (ConfigError, OSError, ValueError) as exc:
        channel.send(pipe.Failure("startup", str(exc)))
        return 2
    from dfl_agent.runtime.shared.logs import setup_logging

    setup_logging(cfg.runtime.log_level, cfg.runtime.log_format)
    agent = Agent(cfg, node_config, host=channel, run=None if once else d, run_id=d.run_id,
                  run_dir=None if once else Path(run_dir))

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        channel.on_gone = lambda: loop.call_soon_threadsafe(stop.set)
        channel.on_reload = lambda: loop.call_soon_threadsafe(agent.reload)
        if channel.gone.is_set():
            stop.set()
        return await agent.run(stop)

    try:
        rc = asyncio.run(main())
    except StartupError as exc:
        channel.send(pipe.Failure("startup", str(exc)))
        return 2
    except HostGone as exc:
        log.error("run %s: %s; the run process stops", d.run_id, exc)
        return 1
    except Exception as exc:  # the algorithm crashed: the supervisor records it and may retry
        log.exception("run %s crashed", d.run_id)
        channel.send(pipe.Failure("crash", f"{type(exc).__name__}: {exc}"))
        return 1
    channel.send(dataclasses.replace(agent.end_report(), peak_rss_mb=peak_rss_mb()))
    return rc


def main(argv: list[str] | None = None) -> int:
    """Entry point of the run process (``python -m dfl_agent.runtime.run.run_process``)."""
    p = argparse.ArgumentParser(prog="dfl-agent-run", description="one run of the always-on agent "
                                "(started by the agent itself; not meant to be run by hand)")
    p.add_argument("--config", required=True, help="the run's configuration (TOML)")
    p.add_argument("--run-dir", required=True, help="the run's folder (descriptor.json, checkpoints)")
    p.add_argument("--once", action="store_true", help="dfl-agent run --once's run: its checkpoints and metrics "
                   "stay in the state directory")
    p.add_argument("--node-config", help="node.toml, re-read on SIGHUP (what can change while the run trains)")
    args = p.parse_args(argv)
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # the pipe to the supervisor ...
    os.dup2(2, 1)  # ... and every other output of this process goes to standard error
    sys.stdout = sys.stderr
    channel = RunChannel(out, sys.stdin)
    try:
        channel.read_start()
    except (HostGone, pipe.PipeError) as exc:
        print(f"dfl-agent run process: {exc}", file=sys.stderr)
        return 1
    rc = run_child(args.config, args.run_dir, channel, once=args.once, node_config=args.node_config)
    # the run's files are written and closed, its end reported: leave without the interpreter's
    # teardown (torch's and zeroconf's threads took 10-20 s under load before the process ended)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
