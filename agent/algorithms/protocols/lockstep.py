"""Lock-step epochs: every node of a fully connected group trains one epoch, the group
decides whether to synchronize, and a synchronization averages the accumulated gradients
into the shared reference model (seed 003, thesis ch. 5, Alg. 1 and 4).  The round
structure of ``gt`` and ``local-steps`` (:mod:`dfl_agent.algorithms.gt` describes the
protocol); they differ only in when they want to synchronize.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from dfl_agent.algorithms.base import Algorithm
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.synchronization import UpdateMarket
from dfl_agent.learning import thresholding as th
from dfl_agent.learning.params import IncompatibleUpdate, check_compatible, load_numpy, model_to_numpy
from dfl_agent.learning.training import train_local

VOTE_KIND = "gt.vote"
SYNC_KIND = "gt.sync"


@dataclasses.dataclass
class LockStepOptions:
    """Options shared by ``gt`` and ``local-steps``.

    Attributes:
        vote_timeout: seconds an epoch waits for the group's votes (``gt`` only).
        sync_timeout: seconds a synchronization waits for the group's accumulated gradients.
        poll_interval: seconds between re-checks of the live-peer set while waiting.
    """

    vote_timeout: float = 30.0
    sync_timeout: float = 30.0
    poll_interval: float = 0.5

    def __post_init__(self) -> None:
        for key in ("vote_timeout", "sync_timeout", "poll_interval"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")


class LockStepAlgorithm(Algorithm):
    """Lock-step epochs with synchronization of accumulated gradients (Alg. 1 and 4).

    Subclasses implement :meth:`wants_sync` (this actor's opinion, after training) and
    set ``votes`` (whether opinions must be exchanged).
    """

    votes: bool = False
    #: checked and restored with the model by the divergence guard of a synchronization
    guarded_state = ("reference", "forecast")

    async def setup(self) -> None:
        self.model = self.new_model()
        self.reference = model_to_numpy(self.model)  # M_R
        self.last_sync = 0  # epoch of the last synchronization (k_s)
        self.syncs = 0
        self.dropped: set[str] = set()
        self.group: set[str] | None = None
        self.last_round = 0
        self._markets = {kind: UpdateMarket("one_from_each", max_staleness=0) for kind in (VOTE_KIND, SYNC_KIND)}
        self.comm: collections.Counter[str] = collections.Counter()

    async def run(self, rounds: int, start_round: int = 1) -> None:
        self.last_round = rounds
        await super().run(rounds, start_round)

    # -- hooks --------------------------------------------------------------------
    def wants_sync(self, t: int, grad: dict[str, np.ndarray]) -> tuple[bool, dict[str, Any]]:
        """This actor's wish to synchronize after epoch ``t`` and info for the metrics."""
        raise NotImplementedError

    def after_sync(self, mean_grad: dict[str, np.ndarray]) -> None:
        """Called with Ḡ after each synchronization (GT updates its forecast)."""

    # -- group membership ----------------------------------------------------------------
    def members(self) -> list[str]:
        """Peers this actor synchronizes with: live peers seen at the start, minus the dropped."""
        live = set(self.ctx.live_peers())
        if self.group is None:
            self.group = set(live)
        self.dropped |= self.group - live  # presence went away
        self.group &= live
        self.group -= self.dropped
        return sorted(self.group)

    def _drop(self, peers: list[str]) -> None:
        self.dropped.update(peers)
        if self.group is not None:
            self.group -= set(peers)

    def _count(self, prefix: str, sent: int, got: list[Message]) -> None:
        self.comm[f"{prefix}_messages_sent"] += int(sent > 0)
        self.comm[f"{prefix}_bytes_sent"] += int(sent)
        self.comm[f"{prefix}_messages_received"] += len(got)
        self.comm[f"{prefix}_bytes_received"] += sum(int(m.wire_bytes) for m in got)

    # -- protocol ------------------------------------------------------------------
    async def _exchange(self, kind: str, t: int, msg: Message, timeout: float, validate=None) -> list[Message]:
        ctx = self.ctx
        peers = self.members()
        sent = await ctx.broadcast(msg) if peers else 0
        res = await self._markets[kind].collect(
            ctx, kind, t, deadline=ctx.clock.now() + timeout, poll=self.options.poll_interval,
            peers=self.members, validate=validate,
            outsider_reason="not_in_group: sender is not in the synchronization group",
        )
        if res.missing:
            self._drop(res.missing)
        got = [m for ms in res.taken.values() for m in ms]
        self._count(kind.split(".")[-1], sent, got)
        return got

    async def round(self, t: int) -> dict[str, Any]:
        """Epoch ``t`` of seed 003 Alg. 1 and 4: train one epoch, compute G_i^Σ = (M_R − M_i)/η,
        decide (votes, :meth:`wants_sync`) and synchronize: Ḡ = mean of the group's G^Σ,
        M_R ← M_R − ηḠ.  Returns the round's info."""
        ctx, d = self.ctx, self.ctx.data
        stats = await ctx.compute(train_local, self.model, d.train_x, d.train_y, ctx.train, ctx.rng, ctx.device)
        grad = th.accumulated_gradient(self.reference, model_to_numpy(self.model), self.lr)
        forced = t == 1 or t >= self.last_round or self.last_sync == 0
        wish, info = self.wants_sync(t, grad)
        sync = forced or wish
        if self.votes and not forced:
            votes = await self._exchange(VOTE_KIND, t, Message(VOTE_KIND, t, meta={"sync": bool(wish)}),
                                         self.options.vote_timeout, validate=_check_vote)
            sync = wish or any(m.meta["sync"] is True for m in votes)
        used: list[str] = []
        if sync:
            used = await self._synchronize(t, grad)
        return {
            "train_loss": stats["loss"], "synchronized": bool(sync), "syncs": self.syncs, "neighbour_ids": used,
            "group": len(self.members()), "dropped": sorted(self.dropped), **info, **dict(self.comm),
        }

    async def _synchronize(self, t: int, grad: dict[str, np.ndarray]) -> list[str]:
        """Alg. 4: exchange G^Σ, average, apply to M_R, continue from M_R.

        Returns the ids of the peers whose G^Σ went into the average."""
        own = {k: v.astype(np.float32) for k, v in grad.items()}

        def validate(msg: Message) -> str | None:
            try:
                check_compatible(msg.tensors, own)
            except IncompatibleUpdate as exc:
                return f"incompatible: {exc}"
            return None

        got = await self._exchange(SYNC_KIND, t, Message(SYNC_KIND, t, own), self.options.sync_timeout, validate)
        # own contribution in the same float32 precision as the received ones, so every
        # actor averages bit-identical inputs (in sorted sender order)
        by_sender = {self.ctx.node_id: own, **{m.sender: m.tensors for m in got}}
        with self.divergence_guard("synchronization") as guard:  # a non-finite M_R is undone
            mean = th.mean_gradient([by_sender[s] for s in sorted(by_sender)])
            self.reference = th.apply_gradient(self.reference, mean, self.lr)
            load_numpy(self.model, self.reference)
            self.after_sync(mean)
        if guard.diverged:  # model, M_R and the forecast are as before: no synchronization
            return []
        self.last_sync = t
        self.syncs += 1
        return sorted(m.sender for m in got)

    @property
    def lr(self) -> float:
        """η of the accumulated gradient (``training.lr``), read every round: a warm-started
        run's learning-rate ramp changes it, and a round's gradient and update use the same η."""
        return float(self.ctx.train.lr)

    def warm_start(self, state: Mapping[str, np.ndarray]) -> str:
        """The model, and the reference M_R the thresholds compare against (set to it)."""
        what = super().warm_start(state)
        self.reference = model_to_numpy(self.model)
        return what

    def status(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "last_sync_epoch": self.last_sync, "group": sorted(self.group or ()),
                "dropped": sorted(self.dropped), **dict(self.comm)}


def _check_vote(msg: Message) -> str | None:
    if msg.tensors or not isinstance(msg.meta.get("sync"), bool):
        return "bad_vote: a vote carries meta.sync (bool) and no tensors"
    return None


