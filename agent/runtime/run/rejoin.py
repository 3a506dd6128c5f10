"""The run's members and what their statuses say: whether the run is already finished,
and the round to (re)join it at.

A decision that affects this node's run is never taken from one device: a run is
finished here by the say of a majority of its members (:func:`finished_by_members`), and
a node skips ahead only when most of its live verified neighbours are ahead
(:meth:`RunMembers._rejoin_round`).  The members are recorded in the run's folder
(:data:`MEMBERS_FILE`), so a restart knows them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from dfl_agent.algorithms.protocols.synchronization import majority
from dfl_agent.fsutil import atomic_write
from dfl_agent.runtime.node.membership import catch_up_target

log = logging.getLogger("dfl_agent.daemon")


#: the run's members, recorded in the run's folder (:meth:`RunMembers._save_members`)
MEMBERS_FILE = "members.json"


def finished_by_members(statuses: Mapping[str, Any], members: Collection[str]) -> bool:
    """Whether the run is finished by its members' say: more than half of ``members``
    (node ids besides this node) and at least two distinct ones have a status (a dict
    in ``statuses``, node id -> status) whose ``state`` is ``"finished"``.  Statuses of
    non-members count for nothing; with fewer than two other members it is never true.
    """
    done = sum(1 for m in set(members) if isinstance(st := statuses.get(m), Mapping) and st.get("state") == "finished")
    return majority(done, len(set(members)), lone=False)  # the one majority rule: never one member's say


def _as_round(value: Any) -> int:
    """A peer status's round (0 when missing or malformed: statuses are untrusted)."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


def _as_float(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


class RunMembers:
    """The members side of the training agent (:class:`~dfl_agent.runtime.run.agent.Agent`
    mixes it in): it reads ``cfg``, ``ctx``, ``node_id``, ``members``, ``run_desc``,
    ``run_dir`` and ``state_dir`` of the agent, and sets its ``wanted``."""

    cfg: Any
    ctx: Any
    node_id: str
    members: set[str]
    run_desc: Any
    run_dir: Path | None
    state_dir: Path
    wanted: dict[str, Any] | None

    def want_model(self, request: dict[str, Any] | None) -> None:
        """Carry ``request`` for the run's model in this node's statuses (``model_wanted``, while
        :mod:`~dfl_agent.runtime.run.adoption` asks a member for it; None: ask no more)."""
        self.wanted = request

    def _rejoin_round(self, start_round: int = 1) -> int:
        """Fault tolerance (``runtime.rejoin``): the round to start at when (re)joining a
        running federation.  Evidence: the rounds that live verified neighbours' fresh
        ``running`` statuses report as completed; the node skips from ``start_round`` only
        when more than half of its live neighbours (at least two distinct ones when two or
        more are live) are ahead, by at most ``runtime.max_catch_up_rounds`` rounds, and
        never past the run's last round (a status never says that the run is finished:
        :meth:`_federation_finished` does).  The model starts from its checkpoint or its
        initialisation: the next aggregation brings it close to its neighbours'."""
        live = self.ctx.neighbours()
        # the peer table's: discovery.heartbeat_timeout, raised on a slow mqtt.link_rate
        limit = getattr(self.ctx.peers, "heartbeat_timeout", None) or self.cfg.discovery.heartbeat_timeout
        statuses = self._run_statuses()
        shown = {  # statuses are untrusted JSON: malformed values count as 0
            nid: _as_round(s.get("round")) for nid in live if isinstance(s := statuses.get(nid), dict)
            and s.get("state") == "running" and time.time() - _as_float(s.get("time")) <= limit
        }
        start = catch_up_target(start_round, shown, len(live), self.cfg.runtime.max_catch_up_rounds)
        start = max(start_round, min(start, self.cfg.algorithm.rounds))
        # still behind after a capped skip: the first round takes the neighbours' newest updates
        # (as after a capped catch-up in the run) instead of waiting round_timeout for updates of
        # a round they have left and closing it alone
        self.ctx.membership.note_rejoin(start, shown, len(live), self.cfg.algorithm.rounds)
        if start > start_round:
            log.info("rejoining the federation at round %d", start)
        return start

    def _members(self) -> set[str]:
        """The run's members besides this node (:attr:`members`, else, when none is
        known, the live verified neighbours), without the peers this node excluded as
        incompatible: they never exchange with it, so their say ends nothing here."""
        members = set(self.members)
        if not members and self.ctx is not None:
            members = set(self.ctx.neighbours())
        if self.ctx is not None:
            members -= set(getattr(getattr(self.ctx, "membership", None), "excluded", None) or ())
        members.discard(self.node_id)
        return members

    def _federation_finished(self) -> bool:
        """Whether a majority of the run's members (:meth:`_members`) report the run
        finished in their (verified, when signatures are required) statuses - more than
        half of them and at least two distinct devices, so one device's status, however
        signed, never ends another node's run.  The operator's say is the signed run
        descriptor (a cancel), checked before every round."""
        return finished_by_members(self._run_statuses(), self._members())

    def _alone_waits(self) -> bool:
        """Whether this node's rounds wait for their deadline when no neighbour is live
        (:func:`~dfl_agent.algorithms.protocols.synchronization.waits_alone`): the run has
        other members (:meth:`_members`) and they have not finished it."""
        return bool(self._members()) and not self._federation_finished()

    def _members_path(self) -> Path:
        return (self.run_dir or self.state_dir) / MEMBERS_FILE

    def _load_members(self, resumed: bool) -> set[str]:
        """The members recorded in the run's folder (runs: ``runs/{id}/members.json``;
        ``--once``: ``state_dir/members.json``, read only when resuming a checkpoint, since
        the folder outlives the run).  A missing or unreadable file: none."""
        if self.run_dir is None and not resumed:
            return set()
        try:
            raw = json.loads(self._members_path().read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return set()
        ids = raw.get("members") if isinstance(raw, dict) else None
        return {m for m in ids if isinstance(m, str)} if isinstance(ids, list) else set()

    def _save_members(self) -> None:
        """Record the run's members as the rounds start: the known ones plus the live
        verified neighbours (written atomically; a failure is logged, never fatal)."""
        if self.ctx is None:
            return
        members = (self.members | set(self.ctx.neighbours())) - {self.node_id}
        if not members or (members == self.members and self._members_path().exists()):
            return
        self.members = members
        try:
            self._members_path().parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self._members_path(), json.dumps({"members": sorted(members)}))
        except OSError as exc:
            log.warning("could not record the run's members in %s: %s", self._members_path(), exc)

    def _run_statuses(self) -> dict[str, dict[str, Any]]:
        """Peers' statuses that speak of this node's run (all of them with ``--once``):
        any decision about "finished" or rejoin is per run id.  An idle node's status speaks of
        its last run (``run``) and of the runs it ended before (``run_history``: there only a
        ``finished`` entry counts); ``model`` says how the node ended the run's model
        (``deployed``, ``adopted``, ``kept``; None: not said)."""
        statuses = dict(self.ctx.transport.statuses)
        if self.run_desc is None:
            return statuses
        rid, out = self.run_desc.run_id, {}
        for n, s in statuses.items():
            r, hist = s.get("run"), s.get("run_history")
            e = hist.get(rid) if isinstance(hist, dict) else None
            e = e if isinstance(e, dict) and e.get("state") == "finished" else {}
            if not (isinstance(r, dict) and r.get("id") == rid):
                r = {**e, "id": rid} if e else None
            if isinstance(r, dict) and r.get("id") == rid:  # the run's view (an idle node's status too)
                state = "running" if r.get("state") == "training" else r.get("state")
                out[n] = {**s, "state": state, "round": r.get("round", 0), "model": e.get("model")}
        return out
