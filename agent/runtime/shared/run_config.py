"""What a run is made of besides its descriptor: its configuration (:func:`run_config_for`),
the hooks around runs (:class:`RunHooks`), and the node's persistent id.  Torch-free: the
always-on supervisor and the run process both use it."""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import atomic_write
from dfl_agent.runtime.shared.assembly import StartupError
from dfl_agent.runtime.shared.config import ConfigError, NodeConfig, _from_dict
from dfl_agent.runtime.shared.config_checks import validate

log = logging.getLogger("dfl_agent.daemon")

RunHook = Callable[[Any, Any], Any]


class RunHooks:
    """Callbacks around runs.  ``on_run_finished(run, progress)`` is called after a run ends on
    this node with state ``finished`` (``progress``: what the service knows of the node that
    trained it, :class:`~dfl_agent.runtime.service.supervisor.RunProgress`: its last status, counters and
    live peers; None when the run resumed after its model was deployed).  A hook that raises is
    logged; it never stops the agent."""

    def __init__(self) -> None:
        self.finished: list[RunHook] = []

    def on_run_finished(self, fn: RunHook) -> RunHook:
        """Register ``fn(run, node)``; usable as a decorator."""
        self.finished.append(fn)
        return fn

    def fire_finished(self, run: Any, node: Any) -> None:
        """Call every ``on_run_finished`` hook with ``(run, node)``; one that raises is logged."""
        for fn in list(self.finished):
            try:
                fn(run, node)
            except Exception:
                log.exception("on_run_finished hook %r failed", fn)


def run_config_for(cfg: NodeConfig, run: Any) -> NodeConfig:
    """The node configuration for a run: the descriptor's algorithm, rounds, options,
    model, training settings and compression override ``node.toml`` (the profile's
    limits still apply when the agent starts).  A descriptor's model (``spec``,
    ``family`` or ``size``) replaces node.toml's ``[model]`` as a whole; its ``init`` (when
    set) replaces ``runtime.run_init``.

    Raises:
        StartupError: the descriptor names a key that does not exist, gives a value of the
            wrong type, or one the configuration rules refuse (e.g. an unknown model family).
    """
    new = copy.deepcopy(cfg)
    new.algorithm.name, new.algorithm.rounds, new.algorithm.options = run.algorithm, run.rounds, dict(run.options)
    new.algorithm.every = None
    new.algorithm.every_samples = None
    if run.model:  # the descriptor's model replaces node.toml's [model] as a whole
        new.model = type(cfg.model)()
    try:
        for section, values in (("model", run.model), ("training", run.training),
                                ("compression", run.compression)):
            target = getattr(new, section)
            checked = _from_dict(type(target), values, section)  # unknown keys and wrong types: ConfigError
            for k in values:
                setattr(target, k, getattr(checked, k))
        validate(new)
    except ConfigError as exc:
        raise StartupError(f"run {run.run_id}: {exc}") from None
    new.runtime.rejoin = True
    if getattr(run, "init", None) is not None:  # the run's warm start choice over runtime.run_init
        new.runtime.run_init = run.init
    return new


def node_id_from_state(state_dir: Path, configured: str | None) -> str:
    """The node's persistent id: ``configured`` if given, else the one stored in
    ``state_dir/node_id``, else a new random one (``n-`` + 8 hex) written atomically."""
    if configured:
        return configured
    path = state_dir / "node_id"
    if path.exists():
        nid = path.read_text(encoding="utf-8").strip()
        if nid:
            return nid
    nid = "n-" + secrets.token_hex(4)
    atomic_write(path, nid + "\n")
    return nid


class _CancelWatch:
    """The lobby's cancel hook for the run in training: notes the round the cancel
    reached this node after and stops the round in progress (called on the lobby's MQTT
    thread; the round loop also checks before each round).

    A cancel that arrives once this node's training of the run ended (``ended()`` true:
    its last round done, the model being deployed) is refused here: the run is not stopped,
    the model is deployed as usual and the run is recorded finished, with the refusal
    (:data:`CANCEL_LATE`) as its reason; :attr:`late` holds the run id then."""

    def __init__(self, run_id: str, agent: Any, run_stop: asyncio.Event, loop: asyncio.AbstractEventLoop,
                 ended: Any = None):
        self.run_id, self.agent, self.run_stop, self.loop = run_id, agent, run_stop, loop
        self.ended = ended if ended is not None else (lambda: False)
        #: run id -> the last round this node had completed when the cancel reached it
        self.rounds: dict[str, int] = {}
        #: run ids whose cancel arrived after this node's training ended (refused)
        self.late: set[str] = set()

    def __call__(self, run_id: str) -> None:
        if run_id != self.run_id or run_id in self.late:
            return
        if run_id not in self.rounds and self.ended():
            self.late.add(run_id)
            log.info("run %s: the operator's cancel arrived after this node's last round; refused here: the "
                     "model is deployed and the run recorded finished", run_id)
            return
        self.rounds.setdefault(run_id, self.agent.progress.last_round() if self.agent.progress is not None else 0)
        self.loop.call_soon_threadsafe(self.run_stop.set)


#: the reason a run finished here records when the operator's cancel came after its last round
CANCEL_LATE = "cancel refused: it arrived after this node's last round"


async def _forward_stop(stop: asyncio.Event, run_stop: asyncio.Event) -> None:
    """Set ``run_stop`` once ``stop`` is set (the agent's stop also stops the run)."""
    await stop.wait()
    run_stop.set()
