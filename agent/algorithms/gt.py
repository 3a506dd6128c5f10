"""``gt``: Gradient Thresholding, and its ``local-steps`` baselines (seed 003, thesis ch. 5).

Lock-step epochs over a fully connected group (every live peer).  Every actor i keeps
the reference parameters M_R (the last synchronized model) and, each epoch t:

1. trains one local epoch (``ctx.train``) and computes its accumulated gradient
   G_i^Σ = (M_R − M_i)/η (Alg. 1; :func:`dfl_agent.learning.thresholding.accumulated_gradient`);
2. decides whether the group synchronizes:

   * ``gt``: tests Eq. 5.2 with the weights of Eq. 5.3 (Alg. 2-3) against the forecast
     G̃ and ρ = (1 + 1/k)·θ_α^(k−1), k = epochs since the last synchronization, and
     publishes its one-bit *vote* (kind ``gt.vote``, ``meta = {"sync": bool}``, no
     tensors).  The group synchronizes when any vote of the epoch is true
     (ALGORITHMS.md: an actor cannot know another's test result without a message);
   * ``local-steps`` (BL1-BL4): every τ epochs, by the shared schedule (no votes);
   * both: always in the first and the last epoch (no vote is sent then);

3. synchronization (Alg. 4, kind ``gt.sync``, tensors = G_i^Σ as float32, one message
   broadcast to the group): Ḡ = mean of the group's G_j^Σ (unweighted, line 4),
   M_R ← M_R − ηḠ (line 5), every actor continues from M_R; ``gt`` updates G̃ with
   Eq. 5.1 (lines 6-10) and resets ρ (k = 0).

Waiting uses the update market (:mod:`dfl_agent.algorithms.market`, ``one_from_each`` with
a deadline): a peer whose vote (``vote_timeout``) or gradient (``sync_timeout``) has not
arrived by the deadline is *dropped* from the group for the rest of the run, so one
dead node cannot stall the others; a peer whose presence goes away is dropped at once.

Requirements (the thesis's Initiator provides both, Alg. 1 lines 2-9): every actor starts
from the same weights (``init = common``, the default), and the group is complete at the
first epoch: it is fixed to the peers live then (in the daemon, set
``discovery.min_peers`` to the group size − 1); later arrivals are rejected
(``not_in_group``), since their reference model would differ from the group's.

Communication: votes and synchronizations both count.  The round info and the status
report messages and bytes sent and received of each kind (``Message.wire_bytes``: the
encoded frame, envelope included; a broadcast counts once on the sending side).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.algorithms.base import Algorithm, Traits, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.market import UpdateMarket
from dfl_agent.learning import thresholding as th
from dfl_agent.learning.params import IncompatibleUpdate, check_compatible, load_numpy, model_to_numpy
from dfl_agent.learning.training import train_local

if TYPE_CHECKING:
    from torch import nn
else:
    from dfl_agent.learning.lazy import nn

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


@dataclasses.dataclass
class GTOptions(LockStepOptions):
    """Options of ``gt`` (defaults = ALGORITHMS.md "Gradient Thresholding").

    Attributes:
        theta_rho: θ_ρ, lateral sensitivity of the threshold region (Eq. 5.2; thesis: 2 on Iris).
        theta_beta: θ_β ∈ [0, 1], EMA weight of the newest synchronized direction (Eq. 5.1).
        theta_alpha: θ_α ∈ (0, 1], per-epoch threshold decay.
        zero_median: reading of Eq. 5.3 when a layer's median |G̃| is 0 (e.g. dead ReLU
            units): ``"floor"`` keeps the lateral test (strict), ``"skip_lateral"`` drops it
            for that test, as an unguarded float implementation of Alg. 2-3 does (NaN
            bound); see :mod:`dfl_agent.learning.thresholding`.
    """

    theta_rho: float = 2.0
    theta_beta: float = 0.5
    theta_alpha: float = 0.95
    zero_median: str = "floor"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.theta_rho > 0:
            raise ValueError(f"theta_rho must be > 0, got {self.theta_rho}")
        if not 0.0 <= self.theta_beta <= 1.0:
            raise ValueError(f"theta_beta must be in [0, 1], got {self.theta_beta}")
        if not 0.0 < self.theta_alpha <= 1.0:
            raise ValueError(f"theta_alpha must be in (0, 1], got {self.theta_alpha}")
        if self.zero_median not in th.ZERO_MEDIAN_MODES:
            raise ValueError(f"zero_median must be one of {', '.join(th.ZERO_MEDIAN_MODES)}, got {self.zero_median!r}")


@dataclasses.dataclass
class LocalStepsOptions(LockStepOptions):
    """Options of ``local-steps``.

    Attributes:
        tau: synchronize every τ epochs (BL1-BL4: 1, 2, 5, 10), and at the first and last.
    """

    tau: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau < 1:
            raise ValueError(f"tau must be >= 1, got {self.tau}")


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
        self.lr = float(self.ctx.train.lr)
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
        for p in self.group - live:  # presence went away
            self.dropped.add(p)
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
            peers=lambda: [p for p in self.members()], validate=validate,
            outsider_reason="not_in_group: sender is not in the synchronization group",
        )
        if res.missing:
            self._drop(res.missing)
        got = [m for ms in res.taken.values() for m in ms]
        self._count(kind.split(".")[-1], sent, got)
        return got

    async def round(self, t: int) -> dict[str, Any]:
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

    def deployable_model(self) -> nn.Module:
        return self.model

    def status(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "last_sync_epoch": self.last_sync, "group": sorted(self.group or ()),
                "dropped": sorted(self.dropped), **dict(self.comm)}


def _check_vote(msg: Message) -> str | None:
    if msg.tensors or not isinstance(msg.meta.get("sync"), bool):
        return "bad_vote: a vote carries meta.sync (bool) and no tensors"
    return None


@register
class GradientThresholding(LockStepAlgorithm):
    """Gradient Thresholding (seed 003 §5.3, Eq. 5.1-5.3, Alg. 1-4) with one-bit votes."""

    name = "gt"
    traits = Traits("lockstep")
    Options = GTOptions
    votes = True

    async def setup(self) -> None:
        await super().setup()
        self.forecast: dict[str, np.ndarray] | None = None  # G̃
        self.rho = 0.0
        self.last_test: dict[str, Any] = {}
        # verdicts of this actor's threshold tests: inside / projected / lateral, and how
        # many tests had the lateral test skipped (zero_median = "skip_lateral")
        self.test_counts: collections.Counter[str] = collections.Counter()
        # the test runs on floating tensors only: integer buffers (BatchNorm's
        # num_batches_tracked) are not parameters, and their always-zero "gradient" would
        # make a zero-median layer of its own under zero_median = "skip_lateral"
        self.tested = [k for k, v in self.reference.items() if np.asarray(v).dtype.kind == "f"]

    def wants_sync(self, t: int, grad: dict[str, np.ndarray]) -> tuple[bool, dict[str, Any]]:
        o = self.options
        if self.forecast is None or self.last_sync == 0:
            return True, {"rho": None}
        k = t - self.last_sync
        self.rho = th.threshold_extent(k, o.theta_alpha)
        res = th.threshold_test({k: self.forecast[k] for k in self.tested}, {k: grad[k] for k in self.tested},
                                self.rho, o.theta_rho, o.zero_median)
        self.test_counts[res.reason or "inside"] += 1
        self.test_counts["lateral_skipped"] += int(res.lateral_skipped)
        self.last_test = {"rho": self.rho, "vote": res.needs_sync, "vote_reason": res.reason,
                          "projected": res.projected, "projected_max": res.projected_max,
                          "lateral": None if res.lateral_skipped else res.lateral,
                          "lateral_max": None if res.lateral_skipped else res.lateral_max,
                          "lateral_skipped": res.lateral_skipped}
        return res.needs_sync, dict(self.last_test)

    def after_sync(self, mean_grad: dict[str, np.ndarray]) -> None:
        self.forecast = th.forecast_update(self.forecast, mean_grad, self.options.theta_beta)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "threshold": {k: v for k, v in self.last_test.items()},
                "threshold_tests": dict(self.test_counts)}


@register
class LocalSteps(LockStepAlgorithm):
    """Local computation baseline BL1-BL4 (seed 003 §5.4.2): synchronize every τ epochs."""

    name = "local-steps"
    traits = Traits("lockstep")
    Options = LocalStepsOptions

    def wants_sync(self, t: int, grad: dict[str, np.ndarray]) -> tuple[bool, dict[str, Any]]:
        return t % self.options.tau == 0, {}
