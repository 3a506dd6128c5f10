"""Never wait for the slowest: the ``runtime.straggler`` policy.

``paper`` (the simulator's default) runs every algorithm as its paper describes: a
round waits for every expected neighbour until the algorithm's own deadline.
``quorum`` (``runtime.straggler = "quorum"``) departs from that in three ways, all built on
the update market of :mod:`dfl_agent.algorithms.protocols.synchronization`:

- **Quorum.** The averaging gossip family (``fedavg``, ``dechw``, ``dechetero``,
  ``cfa``) synchronizes with ``one_from_min_percent`` (p = :data:`QUORUM_PERCENT`: a
  round closes once ⌈p·n⌉ of its n live neighbours sent their update) and keeps updates
  up to :data:`QUORUM_STALENESS` rounds old (``max_staleness``); an explicit
  ``algorithm.options`` key (``sync``, ``sync_percent``, ``max_staleness``) wins.  The
  rotating-aggregator family closes a round with the contributions it has at its
  deadline (as it always did), now an adaptive one.
- **Adaptive deadlines.** A round's deadline is the 90th percentile of the last 10 peer
  completion times (seconds from the start of the wait to a peer's update) × 1.5,
  clamped to [``runtime.min_round_timeout``, upper]; upper is the algorithm's own
  ``round_timeout`` (gossip family; ``mqtt.link_rate`` widens it on a slow link), else
  ``runtime.max_round_timeout`` (capped by the rotating family's ``invite_timeout``).
  Before any completion time is known the deadline is the upper bound.  Completion
  times include the transfer, so a slow link lengthens the deadline by itself.
- **Late updates.** An update from an earlier round, within ``max_staleness`` rounds, is
  used with FedAsync's polynomial staleness weight s(τ) = (τ + 1)^−a (Xie et al. 2019),
  a = :data:`STALENESS_EXPONENT`, which scales its sample count in the aggregation;
  older ones are dropped and counted (``stale``), as before.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

from dfl_agent.algorithms.context import Message, NodeContext
from dfl_agent.algorithms.protocols.synchronization import SyncOptions

#: an algorithm's parsed ``Options`` (any dataclass)
O = TypeVar("O")

MODES = ("paper", "quorum")
#: the mode of the reproduction tools (the simulator, ``dflctl demo``, ``demo --feed``, the chaos
#: tool): the papers' lock step, so that their committed figures reproduce (the always-on
#: agent's ``runtime.straggler`` defaults to ``quorum``)
REPRODUCTION_MODE = "paper"
#: p of ``one_from_min_percent`` under ``quorum``: half of the live neighbours (rounded up)
QUORUM_PERCENT = 0.5
#: ``max_staleness`` under ``quorum``.  Measured in the field lab
#: (``bench/lab/scenarios/stragglers-quorum.toml``): a device with a fifth of its neighbours'
#: CPU spends most of it decoding their updates, trains a round while they close 10-15, and
#: sends updates 35-78 of their rounds old; 64 keeps some of them (at FedAsync weight 1/8 or
#: more) where 8 dropped every one
QUORUM_STALENESS = 64
#: FedAsync's a of s(τ) = (τ + 1)^−a
STALENESS_EXPONENT = 0.5
MIN_ROUND_TIMEOUT = 2.0
MAX_ROUND_TIMEOUT = 120.0
WINDOW, QUANTILE, FACTOR = 10, 0.9, 1.5


@dataclasses.dataclass(frozen=True)
class StragglerPolicy:
    """The node's (or simulation's) ``runtime.straggler`` settings.

    Raises:
        ValueError: naming the ``runtime.`` key that is out of range.
    """

    mode: str = "paper"
    min_round_timeout: float = MIN_ROUND_TIMEOUT
    max_round_timeout: float = MAX_ROUND_TIMEOUT

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"runtime.straggler: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.min_round_timeout > 0:
            raise ValueError(f"runtime.min_round_timeout: must be > 0, got {self.min_round_timeout}")
        if not self.max_round_timeout >= self.min_round_timeout:
            raise ValueError(f"runtime.max_round_timeout: must be >= runtime.min_round_timeout "
                             f"({self.min_round_timeout:g}), got {self.max_round_timeout}")

    @property
    def quorum(self) -> bool:
        return self.mode == "quorum"


def staleness_weight(tau: int, a: float = STALENESS_EXPONENT) -> float:
    """FedAsync's polynomial staleness function s(τ) = (τ + 1)^−a (1 for a current update)."""
    return float((max(0, int(tau)) + 1) ** -a)


def weigh_late(got: Mapping[str, Message], t: int, a: float = STALENESS_EXPONENT) -> dict[str, Message]:
    """``got`` (sender -> the update a round of target ``t`` takes) with every late update
    (``round < t``, τ = t − round) weighted: its ``samples`` scaled by s(τ), the weight in
    ``meta["staleness_weight"]``.  Current updates are returned as they are."""
    out = dict(got)
    for sender, msg in got.items():
        if msg.round < t:
            w = staleness_weight(t - msg.round, a)
            out[sender] = dataclasses.replace(
                msg, meta={**msg.meta, "samples": msg.meta["samples"] * w, "staleness_weight": w})
    return out


def quorum_options(options: O, policy: StragglerPolicy | None, explicit: Collection[str] = ()) -> O:
    """``options`` as the policy runs them: under ``quorum``, the averaging gossip family's
    :class:`SyncOptions` get ``one_from_min_percent`` with p = :data:`QUORUM_PERCENT` and
    ``max_staleness`` = :data:`QUORUM_STALENESS`, each unless ``explicit`` (the keys of
    ``algorithm.options``) names it.  Other options and ``paper``: unchanged."""
    if policy is None or not policy.quorum or not isinstance(options, SyncOptions):
        return options
    quorum: dict[str, Any] = {"sync": "one_from_min_percent", "sync_percent": QUORUM_PERCENT, "max_staleness": QUORUM_STALENESS}
    changes = {k: v for k, v in quorum.items() if k not in explicit}
    return dataclasses.replace(options, **changes) if changes else options


class AdaptiveDeadline:
    """The adaptive round deadline: :data:`QUANTILE` of the last :data:`WINDOW` peer
    completion times × :data:`FACTOR`, clamped to [``low``, upper]."""

    def __init__(self, low: float, high: float):
        self.low, self.high = float(low), float(high)
        self.times: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def observe(self, seconds: Collection[float]) -> None:
        """Record the completion times (seconds) of the peers whose updates a round took."""
        self.times.extend(max(0.0, float(s)) for s in seconds)

    def timeout(self, upper: float | None = None) -> float:
        """This round's deadline in seconds; ``upper``: the algorithm's own bound (else
        ``high``).  The upper bound until a completion time is known."""
        hi = float(upper) if upper is not None else self.high
        if not self.times:
            return hi
        ordered = sorted(self.times)
        p90 = ordered[min(len(ordered) - 1, math.ceil(QUANTILE * len(ordered)) - 1)]
        return min(hi, max(min(self.low, hi), p90 * FACTOR))


def adaptive_deadline(ctx: NodeContext) -> AdaptiveDeadline | None:
    """The node's adaptive deadline under ``quorum`` (``ctx.straggler``), else None (the
    algorithm's own fixed deadline, as in its paper)."""
    policy = ctx.straggler
    if policy is None or not policy.quorum:
        return None
    return AdaptiveDeadline(policy.min_round_timeout, policy.max_round_timeout)
