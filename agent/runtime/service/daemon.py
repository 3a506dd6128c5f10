"""``dfl-agent``: the per-device daemon - the process around the runs.

``dfl-agent run --config node.toml`` loads and validates the configuration and serves:
the run manager (:mod:`dfl_agent.runtime.service.run_manager`) trains the node's default run and
the runs operators publish, one at a time, each with a training agent
(:mod:`dfl_agent.runtime.run.agent`).  ``--once`` runs the configured run and exits.

This module holds the process only: signals (SIGTERM/SIGINT stop cleanly, SIGHUP
reloads), logging, systemd notification, the Prometheus endpoint of the always-on agent,
and :func:`main`.

The always-on agent is the torch-free supervisor: each run trains in a run process
(:mod:`dfl_agent.runtime.service.supervisor`, :mod:`dfl_agent.runtime.run.run_process`).

Exit codes: 0 finished, 2 bad configuration, 3 broker unreachable, 4 degraded (``--once``: more
than half the rounds closed alone, :mod:`dfl_agent.runtime.shared.degraded`), 130 interrupted
(SIGINT), 1 other error.
"""

from __future__ import annotations

from dfl_agent.interrupt import during_startup

# first: a Ctrl-C while the modules below load, or while the configuration is checked, is one
# line and exit 130; run_agent's event loop then takes SIGINT over (a clean stop)
during_startup("dfl-agent", __name__)

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent import WIRE_VERSION, WIRE_VERSIONS, __version__
from dfl_agent.runtime.service.liveness import Liveness, cancel_and_wait, paho_loop_alive, restart_paho_loop
from dfl_agent.runtime.shared.assembly import StartupError
from dfl_agent.runtime.shared.config import ConfigError, NodeConfig, load_config
from dfl_agent.runtime.shared.logs import setup_logging
from dfl_agent.runtime.shared.preflight import check_startup

if TYPE_CHECKING:  # imported where they run: check-config starts none of them
    from dfl_agent.runtime.service.run_manager import RunHooks, RunManager

log = logging.getLogger("dfl_agent.daemon")


def _start_service_prometheus(cfg: NodeConfig, node_id: str, manager: RunManager) -> Any:
    """The always-on agent's Prometheus endpoint (``runtime.prometheus_port``), up while
    idle and while training (:class:`~dfl_agent.runtime.service.prometheus.ServiceCollector`);
    None when off or unavailable (logged)."""
    port = cfg.runtime.prometheus_port
    if not port:
        return None
    from dfl_agent.runtime.service.prometheus import PrometheusExporter, ServiceCollector

    try:  # the run in training's node: the one the service counters read
        return PrometheusExporter(port, cfg.runtime.prometheus_address, ServiceCollector(
            node_id, cfg.federation, manager.counters.run_node, manager.service_status)).start()
    except (ImportError, OSError) as exc:
        log.error("Prometheus endpoint disabled: %s", exc)
        return None


async def serve(cfg: NodeConfig, config_path: str | None, stop: asyncio.Event,
                hooks: RunHooks | None = None, *, once: bool = False) -> int:
    """The agent: stay a member of the federation and train in runs.

    Builds the :class:`~dfl_agent.runtime.service.run_manager.RunManager`
    (:func:`~dfl_agent.runtime.service.run_manager.build_run_manager`) and lets it run the node's
    default run (``[algorithm]``; recurring with ``algorithm.every``) and the published
    runs, one at a time, in queue order, until ``stop`` is set, with the lobby connected
    and the Prometheus endpoint up; both are torn down in reverse order (an
    :class:`contextlib.AsyncExitStack`).  With ``once`` (``dfl-agent run --once``) it runs the
    ``[algorithm]`` run alone, the same way, and returns its exit code
    (:meth:`~dfl_agent.runtime.service.run_manager.RunManager.run_once`).  Its long-lived parts are
    watched (:class:`~dfl_agent.runtime.service.liveness.Liveness`: the run listener's thread, the run
    manager's loop with the status heartbeat and the spool ingestion): the systemd watchdog
    is fed only while all are alive, a dead listener is restarted (counted as
    ``task_restarts`` in the status), and a part that cannot be restarted stops the agent
    with exit code 1.  SIGHUP reloads (:meth:`~dfl_agent.runtime.service.run_manager.RunManager.reload`).
    Returns the exit code (0 when stopped, 1 when a part failed).

    Raises:
        StartupError: the default run cannot start (bad configuration: exit code 2).
    """
    from dfl_agent.runtime.service.cgroup import agent_stem, remove_leftovers
    from dfl_agent.runtime.service.run_manager import build_run_manager

    if once:  # --once trains now: without torch it cannot (one line naming the extra, exit code 2)
        from dfl_agent.extras import require_torch

        require_torch()
    manager = build_run_manager(cfg, config_path, hooks=hooks, once=once)
    remove_leftovers(agent_stem(manager.node_id, cfg.state_dir))  # the run cgroups of a supervisor killed before it removed them
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not in the main thread (tests): no SIGHUP
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, manager.reload)
    liveness = Liveness()
    manager.notifier.alive = liveness.alive  # the run processes' watchdog pings follow it
    manager.counters.fields["task_restarts"] = liveness.status  # in every status, idle and training
    async with contextlib.AsyncExitStack() as stack:
        manager.lobby.start()
        stack.callback(manager.lobby.stop)
        manager.counters.start_saving(cfg.mqtt.heartbeat_interval, liveness)  # counters.json, kept across restarts
        stack.push_async_callback(manager.counters.stop_saving)
        stack.callback(liveness.cancel)
        liveness.watch("run listener", lambda: paho_loop_alive(manager.lobby.client),
                       lambda: restart_paho_loop(manager.lobby.client))
        exporter = _start_service_prometheus(cfg, manager.node_id, manager)
        if exporter is not None:
            stack.callback(exporter.stop)
        # inference members get models/current (else the run's live model), also after a lost copy
        from dfl_agent.runtime.service.member_delivery import MemberDelivery

        stack.push_async_callback(cancel_and_wait, asyncio.ensure_future(MemberDelivery(cfg, manager.lobby).run(stop)))
        # members that missed a run's end get its model from this node's deployed versions
        from dfl_agent.runtime.service.model_handover import ModelHandover

        stack.push_async_callback(cancel_and_wait, asyncio.ensure_future(ModelHandover(cfg, manager.lobby).run(stop)))
        stack.callback(manager.notifier.stopping)
        log.info("node %s of federation %s serving: %s", manager.node_id, cfg.federation,
                 "its [algorithm] run, then exits" if once else
                 "default run + runs from operators" if manager.has_default else "waiting for runs")
        work = manager.run_once(stop) if once else manager.serve(stop)
        return await _serve_watched(work, liveness, stop)


async def _serve_watched(work: Coroutine[Any, Any, int], liveness: Liveness, stop: asyncio.Event) -> int:
    """``work`` (the run manager's loop) while ``liveness`` watches the agent's parts; when a
    part fails for good, stop the runs (as SIGTERM does) and return 1.  An exception of the run
    manager's loop (its status heartbeat, ingestion and runs) propagates: exit code 1."""
    serving = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(liveness.wait_failed())
    try:
        await asyncio.wait({serving, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not serving.done():  # a part failed: stop cleanly, exit 1 so that systemd restarts the agent
        stop.set()
        await serving
        return 1
    return serving.result()


def run_agent(cfg: NodeConfig, config_path: str | None = None, once: bool = True) -> int:
    """Run the agent until it finishes (``once``) or gets SIGTERM/SIGINT (SIGHUP reloads the
    configuration from ``config_path``).  Returns the exit code: 130 after SIGINT (Ctrl-C),
    else the agent's."""

    got: list[int] = []

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if not got:
                log.info("stopping (%s)", sig.name)
            got.append(sig)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        return await serve(cfg, config_path, stop, once=once)

    rc = asyncio.run(main())
    if got:
        log.info("stopped")
    if got and got[0] == signal.SIGINT:
        print("dfl-agent: interrupted", file=sys.stderr)
        return 130
    return rc


def build_parser() -> argparse.ArgumentParser:
    """The ``dfl-agent`` argument parser (also walked by ``dfl_agent.cli.gen_reference``)."""
    p = argparse.ArgumentParser(prog="dfl-agent", description="Decentralized federated learning agent")
    p.add_argument("--version", action="version", version=f"dfl-agent {__version__} (wire v{WIRE_VERSION}; "
                   f"reads and writes {', '.join(f'v{v}' for v in WIRE_VERSIONS)})")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the agent")
    r.add_argument("--config", required=True, help="node configuration (TOML)")
    r.add_argument("--once", action="store_true",
                   help="run the configured [algorithm] run, then exit (demo, tests, batch jobs; exit code 4: "
                        "trained alone in more than half its rounds); without it the agent serves until stopped "
                        "and trains in runs")
    c = sub.add_parser("check-config", help="validate a configuration file and exit: every check of run before it "
                                             "connects (algorithm and options, profile, data set and path, data "
                                             "files, static peers, key); writes nothing")
    c.add_argument("--config", required=True, help="node configuration (TOML)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dfl-agent`` console script."""
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config)
        # every check of the start before the network; check-config and run --once load the data too
        # (a run process loads it again as it starts)
        check_startup(cfg, load=args.cmd == "check-config" or (args.cmd == "run" and args.once))
    except ConfigError as exc:
        print(f"dfl-agent: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "check-config":
        print("configuration OK")
        return 0
    setup_logging(cfg.runtime.log_level, cfg.runtime.log_format)
    state_dir = Path(cfg.state_dir)
    existed = state_dir.exists()
    try:
        return run_agent(cfg, args.config, once=args.cmd == "run" and args.once)
    except ModuleNotFoundError as exc:
        from dfl_agent.extras import missing_torch

        if (msg := missing_torch(exc)) is None:
            raise
        print(f"dfl-agent: {msg}", file=sys.stderr)
        return 2
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        if not existed:  # a failed start leaves no half-made state directory (a new node id, key) behind
            try:
                shutil.rmtree(state_dir)
            except OSError as e:
                log.warning("could not remove the state directory %s of the failed start: %s", state_dir, e)
        return 2
    except Exception:
        log.exception("the agent stopped on an unexpected error")
        return 1


if __name__ == "__main__":
    sys.exit(main())
