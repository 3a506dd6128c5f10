"""Alone is a state, not a success: a run in which this node closed rounds with no peer
update is *degraded*.

A round is closed alone (:func:`round_alone`) when it was meant to
use peer updates and used none although the node expected peers: verified neighbours were
live in it, or the node needs peers at all (``discovery.min_peers`` >= 1, or a run with
other members).  A deliberate ``local`` algorithm never trains alone in this sense.

The node counts them (``rounds_alone``) against the rounds meant to use a peer update
(``exchange_rounds``); the status, the run's ledger entry and ``dflctl`` carry
:func:`degraded_fields`.  A WARNING says so at most once every :data:`WARN_EVERY` rounds.
``dfl-agent run --once`` exits :data:`EXIT_DEGRADED` when more than half of the exchange
rounds were closed alone (:func:`once_exit_code`), unless ``runtime.allow_alone``; the
always-on agent keeps serving (the run is recorded, flagged).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("dfl_agent.daemon")

#: a WARNING about rounds closed alone at most once every this many rounds
WARN_EVERY = 10
#: ``dfl-agent run --once``'s exit code for a run closed alone in more than half its rounds
EXIT_DEGRADED = 4
#: the fields of a status or ledger entry that say whether, and how much, a run was degraded
FIELDS = ("degraded", "rounds_alone", "exchange_rounds")


def peer_updates_used(info: dict[str, Any]) -> int | None:
    """How many peer updates a round's ``info`` says went into the node's model; None
    for a round that was not meant to use any: a lock-step epoch without a
    synchronization, a rotating round the node took no part in, an idle pairs round."""
    if info.get("role") == "idle" or info.get("participated") is False:
        return None
    if "synchronized" in info:  # lock-step (GT, local steps): only synchronizing epochs exchange
        return len(info.get("neighbour_ids") or ()) if info["synchronized"] else None
    if isinstance(info.get("neighbours"), int):  # models left out for being cold were heard all the same
        return int(info["neighbours"]) + len(info.get("cold_excluded") or ())
    if isinstance(info.get("participants"), int):  # a rotating round: the others' contributions
        return max(0, int(info["participants"]) - 1)
    return None


def round_alone(info: dict[str, Any], expected: list[str], needs_peers: bool = False) -> bool:
    """Whether a round was closed *alone*: it used no peer update although the node
    expected verified neighbours in it (``expected``: live while the node was connected
    to its broker: at the round's start, while it waited, or as it closed) or needs peers
    at all (``needs_peers``: ``discovery.min_peers`` >= 1 or a run with other members, and
    an algorithm that communicates; see this module).  A node that
    genuinely runs alone (nobody else in the federation, ``min_peers = 0``) expected
    nobody, and its rounds are not alone in this sense; neither are rounds that were not
    meant to use a peer update (:func:`peer_updates_used`)."""
    return (bool(expected) or needs_peers) and peer_updates_used(info) == 0


def degraded_fields(status: Mapping[str, Any]) -> dict[str, Any]:
    """``degraded`` (bool), ``rounds_alone`` and ``exchange_rounds`` of a node's status
    (missing or malformed counts are 0)."""
    alone, rounds = _count(status.get("rounds_alone")), _count(status.get("exchange_rounds"))
    return {"degraded": alone > 0, "rounds_alone": alone, "exchange_rounds": rounds}


def _count(v: Any) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0


def alone_text(fields: Mapping[str, Any]) -> str:
    """``"12/20 alone"`` for a degraded run, ``""`` otherwise (``dflctl`` tables)."""
    if not fields.get("degraded"):
        return ""
    return f"{_count(fields.get('rounds_alone'))}/{_count(fields.get('exchange_rounds')) or '?'} alone"


def warn_alone(t: int, alone: int, rounds: int, expected: list[str], last_warned: int | None) -> int | None:
    """Log round ``t``'s WARNING about a round closed alone unless one was logged fewer than
    :data:`WARN_EVERY` rounds ago (``last_warned``); returns the round last warned about."""
    if last_warned is not None and t - last_warned < WARN_EVERY:
        return last_warned
    who = f"{', '.join(expected)} were expected" if expected else "no peer is live but the node needs peers"
    log.warning("round %d closed alone (no peer update; %s): the run is degraded, %d of %d rounds alone so far "
                "(logged at most once every %d rounds)", t, who, alone, rounds, WARN_EVERY)
    return t


def once_exit_code(fields: Mapping[str, Any], allow_alone: bool) -> int:
    """``dfl-agent run --once``'s exit code for its finished run, from the run's ledger entry
    (``fields``: :func:`degraded_fields`): :data:`EXIT_DEGRADED` when it was closed alone in more
    than half its exchange rounds and ``runtime.allow_alone`` is off, else 0."""
    fields = degraded_fields(fields)
    if not fields["degraded"]:
        return 0
    if allow_alone or 2 * fields["rounds_alone"] <= fields["exchange_rounds"]:  # alone in at most half
        log.warning("the run was degraded: %d of %d rounds closed alone", fields["rounds_alone"],
                    fields["exchange_rounds"])
        return 0
    log.error("the run was degraded: %d of %d rounds closed alone (no peer update); exit code %d "
              "(runtime.allow_alone = true accepts it)", fields["rounds_alone"], fields["exchange_rounds"],
              EXIT_DEGRADED)
    return EXIT_DEGRADED
