"""Membership of a node: who takes part now.

Live peers (the peer table, fed by presence, mDNS and static peers) minus the peers
whose model cannot take part (excluded, with the reason, the first time they are seen),
minus the peers that report themselves gated, minus (with security) the peers without a
trusted key; the neighbours are those of them in the communication graph.  Catch-up
(fault tolerance) decides here, from the neighbours' evidence, which round to run next.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dfl_agent.algorithms.protocols.synchronization import quorum_shown

if TYPE_CHECKING:
    from dfl_agent.learning.error_feedback import ChocoGossip
    from dfl_agent.runtime.node.context import RuntimeContext

log = logging.getLogger("dfl_agent.runtime.node.context")


def catch_up_target(next_round: int, shown: Mapping[str, int], live: int, cap: int) -> int:
    """The round to run next when neighbours show later rounds (fault tolerance).

    Args:
        next_round: the round this node would run next (>= 1).
        shown: live verified neighbour -> the highest round it showed it completed
            (one entry per distinct sender; entries of other peers must be left out).
        live: how many verified neighbours are live (the quorum's base, >= len(shown)
            is expected; a smaller value is raised to ``len(shown)``).
        cap: ``runtime.max_catch_up_rounds``, the most rounds skipped at once (0 = never).

    Returns:
        ``next_round`` unless :func:`evidence_quorum` of the live neighbours showed a
        round >= ``next_round``; then one past the highest round that a quorum showed,
        but at most ``next_round + cap``.  One insider's claim (a signed frame or status
        with round + 1000) is never enough where two or more neighbours are live, and no
        claim moves a node more than ``cap`` rounds per event.
    """
    ahead = quorum_shown(shown, live)
    if ahead is None or cap <= 0 or ahead < next_round:
        return next_round
    return min(ahead + 1, next_round + cap)


class Membership:
    """Live peers, neighbours, exclusions and peers' gating for one node.

    Args:
        ctx: the node's context (peer table, security, compatibility rule, graph).
    """

    def __init__(self, ctx: RuntimeContext):
        self.ctx = ctx
        self.excluded: dict[str, str] = {}  # peer -> why it is excluded (incompatible)
        self.peer_gated: dict[str, str] = {}  # peer -> its gating reason (from its status)
        self.caught_up = 0  # rounds skipped to catch up with the neighbours
        #: the last catch-up (in the run, or at a restart) was capped and left the node behind
        #: most of its live neighbours: its next round takes their newest updates as soon as a
        #: quorum of them is there, instead of waiting its deadline for updates of a round they
        #: have left (:meth:`RuntimeContext.catching_up`), and then skips again
        self.behind = False
        #: the round its neighbours' statuses showed the federation at when this node (re)joined
        #: (:meth:`note_rejoin`): until it gets there it is behind, whatever the updates it has
        #: received so far show (after a restart the first ones can be a broker's backlog of old rounds)
        self.rejoin_ahead = 0
        #: after a rejoin: live peer -> the round its newest status showed completed; the round
        #: the node must reach moves on with them (:meth:`catch_up_round`), since a federation of
        #: fast rounds goes on while the node works through its capped skips
        self.status_rounds: dict[str, int] = {}
        #: peers that came (back) into this node's presence view: a first sighting, or a return
        #: after "offline" (a restart, a power cut, a partition healed).  A CHOCO stream sends
        #: its next message as a keyframe when it grows (:mod:`dfl_agent.algorithms.gossip_compression`),
        #: so a peer that lost its copy of this node's stream is not left out until the
        #: periodic keyframe
        self.rejoins = 0
        #: peers that came back since this node last sent them its recent messages again,
        #: peer -> whether it may have restarted (lost its copies of this node's streams);
        #: the node's next wait for its peers sends them (:meth:`ComputeGate.resend_to_returned`)
        self.returned: dict[str, bool] = {}
        #: this node's CHOCO streams (:func:`~dfl_agent.algorithms.gossip_compression.choco_for`):
        #: a neighbour without a copy in one of them is asked for a keyframe (:meth:`keyframe_wanted`)
        self.streams: list[ChocoGossip] = []
        self._heartbeats: dict[str, int] = {}  # peer -> the last status heartbeat counter seen
        #: live_peers() memo: (key, result); valid while the peer table, the exclusions and
        #: the gated peers are unchanged (only without heartbeat expiry or security)
        self._live_cache: tuple[tuple[object, int, int], list[str]] | None = None
        self._gated_changes = 0
        self._graph_src: list[str] | None = None  # the list _graph_set was made from
        self._graph_set: frozenset[str] = frozenset()
        self._graph_len = 0
        #: the last :meth:`keyframe_wanted` the status asked for, and when (RuntimeContext.request_keyframes)
        self.keyframes_asked: tuple[list[str], float] = ([], float("-inf"))

    def on_presence(self, node_id: str, descriptor: dict[str, Any] | None) -> None:
        """A peer's presence arrived (``None``: it went offline)."""
        ctx = self.ctx
        if descriptor is None:
            ctx.peers.withdraw(node_id, "presence")
        else:
            if ctx.security is not None and isinstance(descriptor.get("cert"), dict):
                ctx.security.learn(node_id, descriptor["cert"])  # a hint; trust needs a valid certificate
            fields = {k: v for k, v in descriptor.items() if k != "node_id" and isinstance(v, (str, int, float))}
            if "wires" in descriptor:  # the wire versions it speaks (a list): what this node writes to it
                fields["wires"] = descriptor["wires"]
            is_live = getattr(ctx.peers, "is_live", None)
            offline = is_live is not None and not is_live(node_id)
            if node_id != ctx.node_id and (offline or self._lost(node_id)):
                self.rejoins += 1
                self._note_return(node_id, restarted=offline)
            ctx.peers.upsert(node_id, "presence", **fields)
            if node_id != ctx.node_id:
                self.compatible(node_id)  # exclude an incompatible peer as soon as it is seen

    def keyframe_wanted(self) -> list[str]:
        """The live neighbours whose CHOCO stream this node cannot follow (no copy: never
        received, or dropped at a gap - a message lost in a partition, or one of a round this
        node skipped to catch up).  The status carries the list; each of them sends a
        keyframe when it sees itself in it (:meth:`note_status`), so a broken stream heals
        within a status heartbeat whatever broke it."""
        if not self.streams:
            return []
        return sorted(p for p in self.neighbours() if any(p not in g.copies for g in self.streams))

    def _note_return(self, peer: str, *, restarted: bool) -> None:
        """Remember that ``peer`` came back (:attr:`returned`): after a broken session
        (``restarted`` False: it kept what it had received) or from offline or a restart
        (True: it may have lost its copies of this node's streams)."""
        self.returned[peer] = self.returned.get(peer, False) or restarted

    def _lost(self, peer: str) -> bool:
        """Whether ``peer``'s MQTT session broke since its last sign of life (its last will
        came while it stayed live: a partition shorter than the heartbeat timeout); it may
        have missed this node's messages, so it counts as a return."""
        take = getattr(self.ctx.peers, "take_session_lost", None)
        return bool(take is not None and take(peer))

    def live_peers(self) -> list[str]:
        """Live peers that take part: incompatible peers (``compatibility``) and peers that
        report themselves gated are left out (and, with security, peers without a trusted key).

        Without heartbeat expiry and without security (the simulator), the answer only
        changes with the peer table, the exclusions or the gated peers, and is memoised
        on those: a thousand nodes asking several times a round stay O(N) each."""
        ctx = self.ctx
        peers = ctx.peers
        changes = getattr(peers, "changes", None)
        cacheable = (ctx.security is None and changes is not None
                     and getattr(peers, "heartbeat_timeout", 0) is None)
        key = (changes, len(self.excluded), self._gated_changes) if cacheable else None
        if key is not None and self._live_cache is not None and self._live_cache[0] == key:
            return list(self._live_cache[1])
        live = [p for p in peers.live_peers() if not self.peer_gated.get(p) and self.compatible(p)]
        if ctx.security is not None:  # discovery is a hint: members need a trusted key
            live = [p for p in live if ctx.security.is_member(p)]
        if key is not None:  # compatible() may have excluded peers: key on the state after
            self._live_cache = ((changes, len(self.excluded), self._gated_changes), list(live))
        return live

    def live_count(self) -> int:
        """``len(live_peers())``; where the transport says how many members are online
        because this node hears the presence of its graph neighbours only
        (``members_online()``: the simulator's memory network with a presence graph), that
        count.  The simulator scopes presence only when no peer can be excluded, gated or
        untrusted (same algorithm and model everywhere, no security, no status), so both
        count the same peers."""
        members = getattr(self.ctx.transport, "members_online", None)
        n = members() if members is not None else None
        return len(self.live_peers()) if n is None else n

    def compatible(self, peer: str) -> bool:
        """Whether ``peer``'s advertised model can take part (the context's
        ``compatibility``); an incompatible peer is excluded (and counted) the first
        time it is seen."""
        ctx = self.ctx
        if ctx.compatibility is None:
            return True
        if peer in self.excluded:
            return False
        info = ctx.peers.get(peer)
        reason = ctx.compatibility(info) if info is not None else None
        if reason is None:
            return True
        if info is not None and info.sources == {"mdns"}:  # an unsigned record's word only: not
            return False  # excluded for good (the peer's presence, when it comes, describes it)
        self.excluded[peer] = reason
        if not reason.startswith("inference-only"):
            ctx.rejected["incompatible_peer"] += 1
            log.warning("excluding peer %s: %s", peer, reason)
        return False

    def note_status(self, peer: str, status: object) -> None:
        """A peer's status document arrived (heartbeat): remember whether it is gated, and
        count a restart of the peer (its ``heartbeat`` counter went back) in :attr:`rejoins`:
        a peer killed and restarted within the heartbeat timeout never looked offline (with
        signatures required its last will is only a hint), yet it lost its copies;
        and a peer whose session broke meanwhile (:meth:`_lost`), which may have missed them."""
        if isinstance(status, dict):
            beat = status.get("heartbeat")
            if isinstance(beat, int) and not isinstance(beat, bool):
                last = self._heartbeats.get(peer)
                restarted = last is not None and beat < last
                if restarted or self._lost(peer):
                    self.rejoins += 1
                    self._note_return(peer, restarted=restarted)
                self._heartbeats[peer] = beat
            shown = status.get("round")
            if self.rejoin_ahead and status.get("state") == "running" and isinstance(shown, int) \
                    and not isinstance(shown, bool):
                self.status_rounds[peer] = shown
            wanted = status.get("keyframe_wanted")
            if isinstance(wanted, list) and self.ctx.node_id in wanted:
                self.rejoins += 1  # the peer lost this node's stream: its next message is a keyframe
            gated = status.get("gated")
            before = self.peer_gated.get(peer)
            if isinstance(gated, str) and gated:
                self.peer_gated[peer] = gated
            else:
                self.peer_gated.pop(peer, None)
            if self.peer_gated.get(peer) != before:
                self._gated_changes += 1

    def may_aggregate(self, peer: str) -> bool:
        """Whether ``peer`` (or this node) may lead a rotating round."""
        ctx = self.ctx
        if peer == ctx.node_id:
            return ctx.behaviour is None or "aggregator" in ctx.behaviour.roles
        info = ctx.peers.get(peer)
        roles = str(info.extra.get("roles", "")) if info is not None else ""
        return not roles or "aggregator" in roles.split(",")

    def neighbours(self) -> list[str]:
        """The live peers that are neighbours in the communication graph."""
        live = self.ctx.live_peers()
        allowed = self.graph_allowed()
        if allowed is None:
            return live
        return [p for p in live if p in allowed]

    def graph_allowed(self) -> frozenset[str] | None:
        """The context's ``graph_neighbours`` as a set (rebuilt when the list is replaced
        or resized); None without a graph."""
        g = self.ctx.graph_neighbours
        if g is None:
            return None
        if self._graph_src is not g or len(g) != self._graph_len:
            self._graph_src, self._graph_set, self._graph_len = g, frozenset(g), len(g)
        return self._graph_set

    def is_neighbour(self, peer: str) -> bool:
        """Whether ``peer`` is a known, compatible, graph neighbour (and a member, with security)."""
        ctx = self.ctx
        if peer == ctx.node_id or ctx.peers.get(peer) is None or not self.compatible(peer):
            return False
        allowed = self.graph_allowed()
        if allowed is not None and peer not in allowed:
            return False
        return ctx.security is None or ctx.security.is_member(peer)

    def note_rejoin(self, target: int, shown: Mapping[str, int], live: int, final_round: int) -> None:
        """A (re)start that rejoins a running federation at round ``target`` (from its live
        neighbours' statuses ``shown``, neighbour -> completed round, as for
        :func:`catch_up_target`): still behind most of them after that capped skip, the node
        is :attr:`behind`, as after a capped catch-up in the run, so that its first round takes
        their newest updates instead of waiting its deadline for a round they have left.  It stays
        behind until it reaches the round those statuses showed, or the round a quorum of the
        statuses that came since show (:attr:`status_rounds`, :meth:`catch_up_round`): with rounds
        of a tenth of a second the federation goes on while the node works through its skips."""
        ahead = quorum_shown(shown, live)
        self.rejoin_ahead = 0 if ahead is None else min(ahead + 1, final_round)
        self.behind = target < self.rejoin_ahead

    def catch_up_round(self, next_round: int, latest_round: Mapping[str, int]) -> int:
        """The round to run after ``next_round - 1`` (see :meth:`RuntimeContext.catch_up_round`)."""
        ctx = self.ctx
        if not ctx.catch_up:
            self.behind = False
            return next_round
        live = ctx.neighbours()
        shown = {p: latest_round[p] - 1 for p in live if p in latest_round}
        # the cap holds under every runtime.straggler policy: no evidence moves a node more than
        # max_catch_up_rounds at once.  A node left behind by a capped skip (under "quorum" the
        # federation does not wait for it) closes its next round as soon as a quorum of its
        # neighbours' newest updates is there (behind: UpdateMarket.ahead_round) and skips again
        target = catch_up_target(next_round, shown, len(live), ctx.max_catch_up_rounds)
        if ctx.final_round is not None:
            target = max(next_round, min(target, ctx.final_round))
        if self.rejoin_ahead:  # the round to reach moves on with the peers' statuses (a quorum of them)
            moved = quorum_shown({p: self.status_rounds[p] for p in live if p in self.status_rounds}, len(live))
            if moved is not None:
                self.rejoin_ahead = max(self.rejoin_ahead, moved + 1 if ctx.final_round is None
                                        else min(moved + 1, ctx.final_round))
        # still behind what a quorum of them showed (the skip was capped), or the rejoin's round
        ahead = quorum_shown(shown, len(live))
        self.behind = target < (ctx.final_round or target + 1) and (
            (ahead is not None and ahead + 1 > target) or target < self.rejoin_ahead)
        if target == next_round:
            return next_round
        self.caught_up += target - next_round
        log.warning("%s: most live neighbours completed later rounds without this node; skipping rounds %d-%d "
                    "to rejoin them (at most runtime.max_catch_up_rounds = %d at once; a node further behind "
                    "skips again after its next round)", ctx.node_id, next_round, target - 1, ctx.max_catch_up_rounds)
        return target
