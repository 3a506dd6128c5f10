"""The run process: one admitted run of the always-on agent, in a child process.

The supervisor (:mod:`dfl_agent.runtime.supervisor`) starts it as::

    python -m dfl_agent.runtime.run_process --config RUN_DIR/run.toml --run-dir RUN_DIR

``run.toml`` is the run's effective configuration (node.toml with the descriptor's
settings, :func:`~dfl_agent.runtime.run_config.run_config_for`), ``RUN_DIR/descriptor.json``
the run's descriptor (saved at admission).  The child imports torch, trains the run's rounds
with a training :class:`~dfl_agent.runtime.agent.Agent` over its own data-plane MQTT session,
writes checkpoints, metrics and the candidate model (with its ONNX export), and exits.

It talks to the supervisor in JSON lines, one object per line:

* child -> supervisor, on the child's standard output (the child's own ``print`` output goes
  to standard error): ``{"type": "presence", "descriptor": {...}}`` and ``{"type": "status",
  "status": {...}, "counters": {...}, "checkpoint_round": n}`` (the supervisor signs and
  publishes them: the child publishes no presence, no status and no last will),
  ``{"type": "state", "state": S, "seq": n, ...}`` for the run's states after its rounds
  (``trained``, ``deploying``, ``deployed`` with ``version``, ``kept``; the child waits for
  the supervisor's ``ack``, which comes after the run ledger recorded the state - and after
  the supervisor switched ``current`` for ``deployed``), ``{"type": "error", "kind":
  "startup"|"crash", "message": ...}``, and last ``{"type": "end", ...}`` (outcome, round,
  data shape, snapshot's newest sample id, drop counters).
* supervisor -> child, on the child's standard input: ``{"type": "start", "members": [...],
  "may_join": n}`` first, then ``{"type": "ack", "seq": n}`` and ``{"type": "may_join", "n": n}``.
  End of input means the supervisor is gone: the child stops at once.

A stop (the supervisor stopping, or an operator's cancel) is SIGTERM: the run leaves cleanly
after the round in progress is abandoned; the supervisor sends SIGKILL after its grace period.

Exit codes: 0 the run ended (finished or stopped), 2 the run cannot start (bad configuration or
data), 3 the broker is unreachable, 1 a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import IO, Any

from dfl_agent.runtime.degraded import degraded_fields

log = logging.getLogger("dfl_agent.daemon")

#: seconds the child waits for the supervisor's acknowledgement of a state
ACK_TIMEOUT_S = 60.0


class SupervisorGone(RuntimeError):
    """The supervisor closed the pipe (it stopped or was killed): the run process stops."""


class RunChannel:
    """The child's end of the pipe to its supervisor (see the module docstring).

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
        self.may_join_n: int = sys.maxsize
        self.members: list[str] = []
        self.gone = threading.Event()
        #: called once when the supervisor is gone (the child sets its stop event)
        self.on_gone: Any = None
        #: the agent whose counters and checkpoint round go with every status
        self.agent: Any = None

    def send(self, doc: dict[str, Any]) -> None:
        """Write one message (thread-safe); a closed pipe marks the supervisor gone."""
        line = (json.dumps(doc, sort_keys=True, default=float) + "\n").encode()
        with self._write_lock:
            try:
                self.out.write(line)
                self.out.flush()
            except (BrokenPipeError, OSError, ValueError):
                self._set_gone()

    def read_start(self) -> dict[str, Any]:
        """The supervisor's first message (``start``), then read the rest on a thread.

        Raises:
            SupervisorGone: the input ended before it.
        """
        line = self.inp.readline()
        if not line:
            raise SupervisorGone("the supervisor closed the pipe before the start message")
        doc = json.loads(line)
        self.members = [str(m) for m in doc.get("members") or ()]
        self.may_join_n = int(doc.get("may_join", sys.maxsize))
        threading.Thread(target=self._reader, name="dfl-run-pipe", daemon=True).start()
        return dict(doc)

    def _reader(self) -> None:
        for line in self.inp:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("type") == "ack":
                with self._lock:
                    ev = self._acks.get(int(doc.get("seq", -1)))
                if ev is not None:
                    ev.set()
            elif doc.get("type") == "may_join":
                self.may_join_n = int(doc.get("n", sys.maxsize))
        self._set_gone()

    def _set_gone(self) -> None:
        if not self.gone.is_set():
            self.gone.set()
            with self._lock:
                for ev in self._acks.values():
                    ev.set()
            if self.on_gone is not None:
                self.on_gone()

    def may_join(self) -> int:
        """How many other nodes may still join the run (the supervisor's lobby tells)."""
        return self.may_join_n

    def relay(self, kind: str, doc: dict[str, Any]) -> None:
        """The presence's relay: the supervisor signs and publishes ``doc``."""
        if kind == "presence":
            self.send({"type": "presence", "descriptor": doc})
            return
        msg: dict[str, Any] = {"type": "status", "status": doc}
        agent = self.agent
        node = getattr(agent, "node", None)
        if node is not None and getattr(node, "ctx", None) is not None:
            try:
                counters = node.ctx.counters()
                msg["counters"] = {k: counters.get(k) for k in ("bytes_sent", "bytes_received", "dropped",
                                                                 "diverged")}
                msg["live_peers"] = list(node.ctx.live_peers())
            except Exception:  # noqa: BLE001 - the status goes without them
                pass
        msg["checkpoint_round"] = int(getattr(getattr(agent, "checkpointer", None), "last_saved", 0) or 0)
        self.send(msg)

    def state(self, state: str, **info: Any) -> None:
        """Tell the supervisor the run's state ``state`` and wait until its ledger recorded it.

        Raises:
            SupervisorGone: no acknowledgement (the supervisor is gone).
        """
        with self._lock:
            if self.gone.is_set():
                raise SupervisorGone(f"the supervisor is gone; the run's state {state} is not recorded")
            self._seq += 1
            seq = self._seq
            ev = self._acks[seq] = threading.Event()
        node = getattr(self.agent, "node", None)
        st = node.status() if node is not None else {}
        extra: dict[str, Any] = {"round": int(st.get("round", 0))}
        if "rounds_alone" in st:  # a degraded run: its ledger entry says so
            extra.update(degraded_fields(st))
        snap = getattr(self.agent, "snapshot", None)
        if snap is not None and len(snap):
            extra["snapshot_last_id"] = int(snap.max())
        self.send({"type": "state", "state": state, "seq": seq, **extra, **info})
        ok = ev.wait(ACK_TIMEOUT_S)
        with self._lock:
            self._acks.pop(seq, None)
        if not ok or self.gone.is_set():
            raise SupervisorGone(f"the supervisor did not record the run's state {state}")


def _end_doc(agent: Any) -> dict[str, Any]:
    """The ``end`` message: how the run ended here."""
    from dfl_agent.runtime.service_counters import run_drops

    node = agent.node
    snap = agent.snapshot
    return {"type": "end", "outcome": agent.outcome,
            "round": int(node.status().get("round", 0)) if node is not None else 0,
            "last_round": int(node.last_round()) if node is not None else 0,
            "data_shape": agent.data_shape,
            "snapshot_last_id": int(snap.max()) if snap is not None and len(snap) else None,
            "drops": run_drops(node) if node is not None else {}}


def run_child(config: str, run_dir: str, channel: RunChannel) -> int:
    """Train the run of ``run_dir`` with the configuration ``config``; returns the exit code."""
    from dfl_agent.jsonbound import loads as bounded_loads
    from dfl_agent.runtime.assembly import StartupError

    try:
        from dfl_agent.runtime.agent import Agent
    except ModuleNotFoundError as exc:  # the base wheel: no torch, so no run can train here
        from dfl_agent.extras import missing_torch

        channel.send({"type": "error", "kind": "startup", "message": missing_torch(exc) or str(exc)})
        return 2
    from dfl_agent.runtime.config import ConfigError, load_config
    from dfl_agent.runtime.descriptor import RunDescriptor

    try:
        cfg = load_config(config)
        raw = bounded_loads((Path(run_dir) / "descriptor.json").read_bytes(), "state")
        d = RunDescriptor.from_dict({k: v for k, v in raw.items() if k != "schema_version"})
    except (ConfigError, OSError, ValueError) as exc:
        channel.send({"type": "error", "kind": "startup", "message": str(exc)})
        return 2
    from dfl_agent.runtime.daemon import _setup_logging

    _setup_logging(cfg.runtime.log_level, cfg.runtime.log_format)
    agent = Agent(cfg, None, run=d, run_dir=Path(run_dir), serving=True, wanted_peers=channel.may_join,
                  members=channel.members, on_state=channel.state)
    agent.relay = channel
    channel.agent = agent

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        channel.on_gone = lambda: loop.call_soon_threadsafe(stop.set)
        if channel.gone.is_set():
            stop.set()
        return await agent.run(stop)

    try:
        rc = asyncio.run(main())
    except StartupError as exc:
        channel.send({"type": "error", "kind": "startup", "message": str(exc)})
        return 2
    except SupervisorGone as exc:
        log.error("run %s: %s; the run process stops", d.run_id, exc)
        return 1
    except Exception as exc:  # the algorithm crashed: the supervisor records it and may retry
        log.exception("run %s crashed", d.run_id)
        channel.send({"type": "error", "kind": "crash", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    channel.send(_end_doc(agent))
    return rc


def main(argv: list[str] | None = None) -> int:
    """Entry point of the run process (``python -m dfl_agent.runtime.run_process``)."""
    p = argparse.ArgumentParser(prog="dfl-agent-run", description="one run of the always-on agent "
                                "(started by the agent itself; not meant to be run by hand)")
    p.add_argument("--config", required=True, help="the run's configuration (TOML)")
    p.add_argument("--run-dir", required=True, help="the run's folder (descriptor.json, checkpoints)")
    args = p.parse_args(argv)
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # the pipe to the supervisor ...
    os.dup2(2, 1)  # ... and every other output of this process goes to standard error
    sys.stdout = sys.stderr
    channel = RunChannel(out, sys.stdin)
    try:
        channel.read_start()
    except (SupervisorGone, ValueError) as exc:
        print(f"dfl-agent run process: {exc}", file=sys.stderr)
        return 1
    return run_child(args.config, args.run_dir, channel)


if __name__ == "__main__":
    sys.exit(main())
