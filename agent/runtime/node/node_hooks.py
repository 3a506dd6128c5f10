"""What a :class:`~dfl_agent.runtime.node.node.Node`'s owner tells it, given at construction
(:class:`NodeHooks`), and how its round loop ends early (:class:`RunStopped`,
:class:`FederationFinished`, :class:`NodeKilled`).

The daemon's training agent and the simulator build a node with every hook it will call;
nothing is assigned to a node afterwards.  A hook may close over its owner's state that
exists only later (the agent's checkpointer, the stop event of its run): it is called, not
read, when the round loop needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

#: an after-round hook: ``await hook(round, record)`` once the round's record is written
AfterRound = Callable[[int, dict[str, Any]], Awaitable[None]]


@dataclasses.dataclass
class NodeHooks:
    """A node's hooks (each optional).

    Attributes:
        needs_peers: ``() -> bool``: whether the node needs peers at all (``discovery.min_peers``
            >= 1, or a run with other members): a round that used no peer update then counts as
            closed alone (:func:`~dfl_agent.runtime.shared.degraded.round_alone`); None: only the neighbours
            expected in a round count (the simulator).
        stop_check: ``() -> bool``, checked after every round: True ends the round loop with
            :class:`RunStopped` (a stop, a cancel).
        finish_check: ``() -> bool``, checked after every round but the last: True (most of the
            run's members report it finished) ends the round loop as finished
            (:class:`FederationFinished`).
        checkpoint: ``await checkpoint(round)`` after each round's record is made, before the
            record is written (the daemon's crash-safe checkpoint).
        after_round: ``await hook(round, record)`` for each round, in order, once its record is
            written (e.g. the live model export); the owner may append to this list.
    """

    needs_peers: Callable[[], bool] | None = None
    stop_check: Callable[[], bool] | None = None
    finish_check: Callable[[], bool] | None = None
    checkpoint: Callable[[int], Awaitable[None]] | None = None
    after_round: list[AfterRound] = dataclasses.field(default_factory=list)


class RunStopped(Exception):
    """Raised out of the round loop when :attr:`NodeHooks.stop_check` says stop after round
    ``round`` (a cancelled run, a stop request): the next round never starts."""

    def __init__(self, round: int):
        super().__init__(f"stopped after round {round}")
        self.round = round


class FederationFinished(Exception):
    """Raised out of the round loop when :attr:`NodeHooks.finish_check` says that most of the
    run's members finished it after round ``round``: a node left behind (it was cut off,
    or slow) ends its run there instead of closing the remaining rounds alone."""

    def __init__(self, round: int):
        super().__init__(f"most of the run's members finished it; this node stopped after round {round}")
        self.round = round


class NodeKilled(Exception):
    """Raised out of the round loop when a node reaches the round of its
    :meth:`~dfl_agent.runtime.node.node.Node.kill_at` (the simulator's fault injection): it crashes there."""

    def __init__(self, round: int):
        super().__init__(f"killed at the start of round {round}")
        self.round = round
