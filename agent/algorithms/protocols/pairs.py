"""Sender → receiver pairs: the round structure of Def-KT and its baselines (seed 004).

Def-KT (Algorithm 1), FullAvg (Algorithm 2) and Combo (Algorithm 3) share one
round: Q senders and Q receivers, disjoint, drawn at random among the live nodes;
each sender trains M local epochs and sends to its receiver, which fuses.  Only the
fusion differs.  This module holds that shared structure; ``defkt``, ``fullavg`` and
``combo`` only say how a receiver fuses (and Combo how the pair exchanges segments).

Rounds mode: coordination without a coordinator
------------------------------------------------
The pairs of round t come from a *seeded schedule every node computes itself*
(:func:`pair_schedule`): the ids a node believes live (itself included) are ordered
by a hash of ``(schedule seed, t, id)`` (rendezvous hashing: each id's rank is
independent of who else is in the set), and consecutive ids form the pairs
``(order[0] → order[1]), (order[2] → order[3]), ...`` (the first of each pair is the
sender), Q pairs at most.  Nodes that agree on the live set agree on the pairs
without exchanging a message; a node missing from one view only shifts the pairs
ranked after it.  The schedule seed is the option ``schedule_seed``, by default the
federation's seed (``ctx.seed``, the same on every node whatever the initialisation).  Every model message
carries a fingerprint of the seed and a receiver rejects (and counts,
``schedule_mismatch``) a model drawn from another seed, so a misconfiguration shows
instead of silently never pairing.

Round t on one node (every wait has a deadline ``t0 + ...``, t0 = its round start):

1. compute the pairs from its current view of the live nodes;
2. sender: train M epochs, send the model to its receiver (and keep the trained
   model, ``sender_keeps = trained``, or the one it had, ``unchanged``);
3. receiver: wait for its sender's model until ``t0 + receive_timeout`` (earlier if
   the sender leaves the live set), fuse it, then *broadcast a small* ``done``
   (whether or not a model came);
4. everybody (non-participants, senders, receivers): wait until every receiver of
   its view that is still live has sent ``done`` for round t, or until
   ``t0 + round_timeout``; then the round is over.

Why ``done`` from receivers: the receiver is the last to finish a pair (it fuses
after its sender trained), so Q tiny messages per round tell everybody that the
round is over, with no coordinator and no global clock; rounds therefore start
nearly together on all nodes and every wait is bounded by one pair's work, not by
a chain of earlier rounds.  A dead node is dropped from the waits as soon as its
presence goes; a node that is alive but disagrees about the schedule (it does not
believe itself a receiver) costs its peers at most ``round_timeout`` and never a
deadlock.  A sender whose receiver is dead just goes on (its model is lost); a
receiver whose sender is dead or silent keeps its own model.

Gossip mode (no global rounds)
------------------------------
Each node loops on its own step counter (a "round" for the runtime = one step):
sleep ``gossip_interval`` (± 50 % jitter), fuse the models waiting in its inbox
queue (each with the algorithm's fusion), train M epochs and push the model to one
random live peer.  The peer's *inbox server* (a task running beside the loop)
answers ``queued`` when its bounded queue (``max_queue``) has room and ``declined``
otherwise; on ``declined``, no answer within ``reply_timeout``, or the peer
vanishing, the sender tries another peer (``max_attempts`` in all).  A node that
finishes broadcasts ``leave`` so nobody keeps pushing to it.  Gossip messages belong
to no round: they travel with round :data:`NO_ROUND`, so the runtime's per-round
buffering never discards them (the sender's step is in ``meta["step"]``).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dfl_agent.algorithms.base import Algorithm
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.neighbourhood import update_problem
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import train_local
from dfl_agent.privacy.plan import steps_per_round

if TYPE_CHECKING:
    from torch import nn

    from dfl_agent.learning.training import TrainConfig
else:
    from dfl_agent.learning.lazy import nn

log = logging.getLogger(__name__)

NO_ROUND = 2**31 - 1
"""Round tag of gossip messages: larger than any real round, so never 'stale'."""


#: rounds a sender that went silent (alive, but its model did not come within
#: ``receive_timeout``) is left out of the pairs, under ``runtime.straggler = "quorum"``
SILENT_ROUNDS = 5

# -- the schedule --------------------------------------------------------------------------


def _rank(seed: int, t: int, node_id: str) -> int:
    digest = hashlib.blake2b(f"{seed}|{t}|{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pair_schedule(ids: Sequence[str], seed: int, t: int, q: int) -> list[tuple[str, str]]:
    """The ``(sender, receiver)`` pairs of round ``t`` (seed 004 Algorithm 1, lines 2-3).

    ``ids`` are ordered by ``blake2b(f"{seed}|{t}|{id}")`` (ties by id), a uniformly
    random permutation that every node computes alike; pair j is
    ``(order[2j], order[2j+1])`` for ``j < min(q, len(ids) // 2)``.  Senders and
    receivers are therefore disjoint, and a node absent from ``ids`` only changes the
    pairs ranked after it.

    Args:
        ids: node ids believed live (duplicates ignored; order irrelevant).
        seed: the federation's schedule seed.
        t: round number.
        q: Q >= 1, the number of pairs wanted.

    Raises:
        ValueError: ``q < 1``.
    """
    if q < 1:
        raise ValueError(f"Q must be >= 1, got {q}")
    order = sorted(set(ids), key=lambda i: (_rank(seed, t, i), i))
    n = min(q, len(order) // 2)
    return [(order[2 * j], order[2 * j + 1]) for j in range(n)]


def seed_fingerprint(seed: int) -> str:
    """Short public tag of a schedule seed (sent with models to detect mismatches)."""
    return hashlib.blake2b(f"defkt-schedule|{seed}".encode(), digest_size=4).hexdigest()


# -- options -------------------------------------------------------------------------------


@dataclasses.dataclass
class PairOptions:
    """Options shared by every pair algorithm (seed 004 §III-A, §IV-C).

    Attributes:
        Q: pairs per round (Q senders and Q receivers, disjoint; the paper uses 1 with
            K = 10); capped at ⌊live nodes / 2⌋.
        M: local epochs of the sender (paper: 1 for MNIST/MLP and CIFAR-10, 10 for
            Fashion-MNIST); overrides ``training.epochs``.
        receive_timeout: seconds after its round start a receiver waits for its
            sender's model (it must cover the sender's M epochs).
        round_timeout: seconds after its round start a node waits for the round's
            ``done`` messages; must exceed ``receive_timeout``.
        poll_interval: seconds between re-checks of the live-peer set while waiting.
        schedule_seed: seed of the pair schedule, the same on every node; -1 = the
            federation's seed (``ctx.seed``).
    """

    Q: int = 1
    M: int = 1
    receive_timeout: float = 60.0
    round_timeout: float = 120.0
    poll_interval: float = 0.5
    schedule_seed: int = -1

    def __post_init__(self) -> None:
        if self.Q < 1:
            raise ValueError(f"Q must be >= 1, got {self.Q}")
        if self.M < 1:
            raise ValueError(f"M must be >= 1, got {self.M}")
        for key in ("receive_timeout", "round_timeout", "poll_interval"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if not self.round_timeout > self.receive_timeout:
            raise ValueError(
                f"round_timeout ({self.round_timeout}) must exceed receive_timeout ({self.receive_timeout})"
            )
        if self.schedule_seed < -1:
            raise ValueError(f"schedule_seed must be >= 0, or -1 for the federation seed; got {self.schedule_seed}")


@dataclasses.dataclass
class PushOptions(PairOptions):
    """Options of the one-way pair algorithms (a sender pushes its whole model).

    Attributes:
        sender_keeps: ``trained`` (the sender keeps its M-epoch model w̃, ALGORITHMS.md
            default) or ``unchanged`` (it keeps the model it had before training).
        mode: ``rounds`` (seeded pair schedule, see the module docstring) or
            ``gossip`` (no global rounds).
        gossip_interval: mean seconds between two gossip steps of a node (each drawn
            uniformly in [0.5, 1.5] times this).
        reply_timeout: seconds a gossip sender waits for ``queued``/``declined``.
        max_queue: models a gossip node accepts before it declines (>= 1).
        max_attempts: peers a gossip sender tries per step before giving up.
    """

    sender_keeps: str = "trained"
    mode: str = "rounds"
    gossip_interval: float = 1.0
    reply_timeout: float = 10.0
    max_queue: int = 2
    max_attempts: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sender_keeps not in ("trained", "unchanged"):
            raise ValueError(f"sender_keeps must be 'trained' or 'unchanged', got {self.sender_keeps!r}")
        if self.mode not in ("rounds", "gossip"):
            raise ValueError(f"mode must be 'rounds' or 'gossip', got {self.mode!r}")
        for key in ("gossip_interval", "reply_timeout"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.max_queue < 1 or self.max_attempts < 1:
            raise ValueError(f"max_queue and max_attempts must be >= 1, got {self.max_queue}, {self.max_attempts}")


# -- the algorithm skeleton ------------------------------------------------------------------


class PairAlgorithm(Algorithm):
    """Shared rounds-mode skeleton (see the module docstring).

    Subclasses implement :meth:`act_as_sender` / :meth:`act_as_receiver`, or, for the
    one-way push algorithms (:class:`PushAlgorithm`), only :meth:`PushAlgorithm.fuse`.
    Deployable model = the node's local model ``self.model``.
    """

    Options = PairOptions

    @classmethod
    def dp_steps_per_round(cls, options: object, *, n_samples: int, batch_size: int, epochs: int, steps: int) -> int:
        """The sender's ``M`` local epochs (``training.steps`` when > 0)."""
        m = getattr(options, "M", None)
        return steps_per_round(n_samples, batch_size, epochs if m is None else int(m), steps)

    # message kinds, prefixed with the algorithm's name ("defkt.model", ...)
    def kind(self, what: str) -> str:
        return f"{self.name}.{what}"

    async def setup(self) -> None:
        self.model: nn.Module = self.new_model()
        self.samples = self.sample_count()  # 1 under DP (dfl_agent.privacy.policy)
        seed = self.options.schedule_seed
        self.schedule_seed = int(self.ctx.seed if seed < 0 else seed)
        self.fingerprint = seed_fingerprint(self.schedule_seed)
        self.stats: collections.Counter[str] = collections.Counter()
        #: ``runtime.straggler = "quorum"``: re-pair away from a silent sender (:meth:`schedule`)
        self.repairs = self.ctx.quorum
        self.silent: dict[str, int] = {}  # sender -> the last round it is left out of the pairs

    @property
    def sender_train(self) -> TrainConfig:
        """The sender's local training (``training`` with ``M`` epochs), read every round:
        a warm-started run's learning-rate ramp changes ``ctx.train``."""
        return dataclasses.replace(self.ctx.train, epochs=self.options.M)

    def status(self) -> dict[str, Any]:
        return {"pair_stats": dict(self.stats)}

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The local model (base class: ``self.model``, whichever w̃ it now is) and the
        pair statistics."""
        tensors, meta = super().state_dict()
        meta["pair_stats"] = dict(self.stats)
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        super().load_state_dict(tensors, meta)
        self.stats = collections.Counter({str(k): int(v) for k, v in dict(meta.get("pair_stats", {})).items()})

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self, t: int) -> list[tuple[str, str]]:
        """Round ``t``'s pairs in this node's current view of the live nodes, without the
        senders that went silent in the last :data:`SILENT_ROUNDS` rounds (``quorum`` only:
        a receiver names its silent sender in its ``done``, which every node hears, so they
        all leave it out alike; the silent node too, which then sits those rounds out)."""
        view = set(self.ctx.live_peers()) | {self.ctx.node_id}
        view -= {p for p, until in self.silent.items() if t <= until}
        return pair_schedule(sorted(view), self.schedule_seed, t, self.options.Q)

    def _note_silent(self, t: int, sender: str) -> None:
        self.silent[sender] = t + SILENT_ROUNDS
        self.stats["silent"] += 1
        log.info("round %d: sender %s sent nothing within receive_timeout; left out of the pairs for rounds "
                 "%d-%d (runtime.straggler = quorum)", t, sender, t + 1, t + SILENT_ROUNDS)

    # -- rounds mode ------------------------------------------------------------------------
    async def round(self, t: int) -> dict[str, Any]:
        """Round ``t`` of seed 004 Algorithms 1–3 (rounds mode): compute the pairs, train and
        send (sender) or receive and fuse (receiver, :meth:`fuse`), then wait for the
        receivers' ``done``.  Returns the round's info."""
        ctx, me = self.ctx, self.ctx.node_id
        t0 = ctx.clock.now()
        pairs = self.schedule(t)
        info: dict[str, Any] = {"role": "idle", "partner": "", "fused": False, "neighbours": 0}
        for sender, receiver in pairs:
            if me == sender:
                info.update(role="sender", partner=receiver)
                info.update(await self.act_as_sender(t, receiver, t0 + self.options.receive_timeout))
            elif me == receiver:
                info.update(role="receiver", partner=sender)
                got = await self.act_as_receiver(t, sender, t0 + self.options.receive_timeout)
                info.update(got)
                done: dict[str, Any] = {"fused": bool(info["fused"])}
                if self.repairs and "neighbours" not in got and sender in ctx.live_peers():  # alive, silent
                    done["silent"] = sender
                    self._note_silent(t, sender)
                await ctx.broadcast(Message(self.kind("done"), t, meta=done))
        self.stats[info["role"]] += 1
        self.stats["fused"] += int(bool(info["fused"]))
        info["neighbour_ids"] = [info["partner"]] if info["fused"] else []  # whose model this node took
        others = [r for _, r in pairs if r != me]
        info["late"] = await self._await_done(t, others, t0 + self.options.round_timeout, dict((r, s) for s, r in pairs))
        if self.repairs and (left_out := sorted(p for p, until in self.silent.items() if t < until)):
            info["left_out"] = left_out
        return info

    async def _await_done(self, t: int, receivers: list[str], deadline: float,
                          senders: dict[str, str] | None = None) -> list[str]:
        """Wait for round ``t``'s ``done`` from each live receiver; returns those still missing.
        A ``done`` that names its receiver's silent sender (``senders``: receiver -> its sender
        in this node's pairs; any other name is ignored) leaves that sender out of the next
        rounds' pairs here too (:meth:`schedule`)."""
        ctx, waiting = self.ctx, set(receivers)

        def take(msg: Message) -> None:
            waiting.discard(msg.sender)
            named = msg.meta.get("silent")
            if self.repairs and isinstance(named, str) and senders and senders.get(msg.sender) == named:
                self._note_silent(t, named)

        while True:
            waiting &= set(ctx.live_peers())
            now = ctx.clock.now()
            if not waiting or now >= deadline:
                if self.repairs:  # a node late for its round (the silent one) still reads what came
                    while (msg := await ctx.receive(self.kind("done"), round=t, deadline=now)) is not None:
                        take(msg)
                return sorted(waiting)
            msg = await ctx.receive(self.kind("done"), round=t, deadline=min(deadline, now + self.options.poll_interval))
            if msg is not None:
                take(msg)

    async def await_from(self, kind: str, t: int, peer: str, deadline: float, check) -> Message | None:
        """Next valid round-``t`` message of ``kind`` from ``peer``, or ``None`` once the
        deadline passes or ``peer`` leaves the live set.  ``check(msg)`` returns an
        error string (the message is rejected and counted) or ``None``."""
        ctx = self.ctx
        while True:
            now = ctx.clock.now()
            if now >= deadline or peer not in ctx.live_peers():
                return None
            msg = await ctx.receive(kind, round=t, sender=peer, deadline=min(deadline, now + self.options.poll_interval))
            if msg is None:
                continue
            err = check(msg)
            if err is None:
                return msg
            ctx.reject(msg, err)

    def check_model_message(self, msg: Message, template: dict | None = None) -> str | None:
        """Validation of an incoming model: tensors fit ours, positive sample count,
        same schedule seed (rounds mode)."""
        return update_problem(msg, template if template is not None else model_to_numpy(self.model))

    def check_schedule(self, msg: Message) -> str | None:
        if msg.meta.get("schedule") != self.fingerprint:
            return f"schedule_mismatch: seed tag {msg.meta.get('schedule')!r} != {self.fingerprint!r}"
        return None

    async def train_copy(self) -> tuple[nn.Module, dict[str, float]]:
        """w̃ = SGD_{B,M}(w, D) on a copy of the local model (seed 004 Eq. 1)."""
        d = self.ctx.data
        w_tilde = copy.deepcopy(self.model)
        stats = await self.ctx.compute(train_local, w_tilde, d.train_x, d.train_y, self.sender_train, self.ctx.rng,
                                       self.ctx.device)
        return w_tilde, stats

    async def act_as_sender(self, t: int, receiver: str, deadline: float) -> dict[str, Any]:
        raise NotImplementedError

    async def act_as_receiver(self, t: int, sender: str, deadline: float) -> dict[str, Any]:
        raise NotImplementedError


class PushAlgorithm(PairAlgorithm):
    """A pair algorithm whose sender pushes its whole trained model and whose receiver
    fuses it (Def-KT, FullAvg); runs in ``rounds`` or ``gossip`` mode."""

    Options = PushOptions
    #: the name of :meth:`fuse` in divergence warnings (:meth:`Algorithm.divergence_guard`)
    fuse_step: ClassVar[str] = "fusion"

    def fuse(self, incoming: dict, samples: float) -> dict[str, Any]:
        """Fuse the received model (named numpy tensors, from a sender with ``samples``
        training samples) into ``self.model``; returns metrics. Runs in ``ctx.compute``,
        under :meth:`~dfl_agent.algorithms.base.Algorithm.divergence_guard` (a fusion that
        leaves a non-finite model is undone and counted)."""
        raise NotImplementedError

    async def setup(self) -> None:
        await super().setup()
        self._queue: collections.deque[Message] = collections.deque()
        self._gone: set[str] = set()
        self._server: asyncio.Task[None] | None = None

    # -- rounds mode ------------------------------------------------------------------------
    async def act_as_sender(self, t: int, receiver: str, deadline: float) -> dict[str, Any]:
        w_tilde, stats = await self.train_copy()
        meta = {"samples": self.samples, "schedule": self.fingerprint}
        await self.ctx.send(receiver, Message(self.kind("model"), t, model_to_numpy(w_tilde), meta=meta))
        if self.options.sender_keeps == "trained":
            self.model = w_tilde
        return {"train_loss": stats["loss"], "neighbours": 1}

    async def act_as_receiver(self, t: int, sender: str, deadline: float) -> dict[str, Any]:
        template = model_to_numpy(self.model)

        def check(msg: Message) -> str | None:
            return self.check_model_message(msg, template) or self.check_schedule(msg)

        msg = await self.await_from(self.kind("model"), t, sender, deadline, check)
        if msg is None:
            return {"fused": False}
        with self.divergence_guard(self.fuse_step) as guard:  # a non-finite fusion is undone
            out = await self.ctx.compute(self.fuse, msg.tensors, float(msg.meta["samples"]))
        return {"fused": not guard.diverged, "neighbours": 1, **out}

    # -- gossip mode ------------------------------------------------------------------------
    async def round(self, t: int) -> dict[str, Any]:
        """Round (rounds mode) or step (gossip mode) ``t`` of seed 004 Algorithms 1–2: the pairs
        round of :class:`PairAlgorithm`, or fuse the queued models, train M epochs and push the
        model to one random live peer.  Returns the round's info."""
        if self.options.mode == "gossip":
            return await self.gossip_step(t)
        return await super().round(t)

    async def run(self, rounds: int, start_round: int = 1) -> None:
        if self.options.mode != "gossip":
            return await super().run(rounds, start_round)
        self._server = asyncio.ensure_future(self._serve_inbox())
        try:
            await super().run(rounds, start_round)
            await self.ctx.broadcast(Message(self.kind("leave"), NO_ROUND))
        finally:
            server, self._server = self._server, None
            server.cancel()
            try:
                await server
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # the server's failure must not hide the loop's
                log.warning("gossip inbox server failed: %r", exc)

    async def _serve_inbox(self) -> None:
        """Answer every pushed model: ``queued`` while the queue has room, else ``declined``."""
        ctx = self.ctx
        while True:
            msg = await ctx.receive(self.kind("push"), round=NO_ROUND)
            assert msg is not None
            err = self.check_model_message(msg)
            if err is not None:
                ctx.reject(msg, err)
                status = "invalid"
            elif len(self._queue) < self.options.max_queue:
                self._queue.append(msg)
                status = "queued"
            else:
                status = "declined"
                self.stats["declined"] += 1
            reply = Message(self.kind("reply"), NO_ROUND, meta={"push": msg.meta.get("push", ""), "status": status})
            await ctx.send(msg.sender, reply)

    async def _drain_leaves(self) -> None:
        while True:
            msg = await self.ctx.receive(self.kind("leave"), round=NO_ROUND, deadline=self.ctx.clock.now())
            if msg is None:
                return
            self._gone.add(msg.sender)

    async def _await_reply(self, peer: str, push_id: str, deadline: float) -> str:
        ctx = self.ctx
        while True:
            await self._drain_leaves()
            now = ctx.clock.now()
            if peer not in ctx.live_peers() or peer in self._gone:
                return "gone"
            if now >= deadline:
                return "timeout"
            msg = await ctx.receive(self.kind("reply"), round=NO_ROUND, sender=peer,
                                    deadline=min(deadline, now + self.options.poll_interval))
            if msg is not None and msg.meta.get("push") == push_id:
                return str(msg.meta.get("status"))

    async def gossip_step(self, k: int) -> dict[str, Any]:
        """One gossip step of this node: wait, fuse the queued models, train, push."""
        ctx, o = self.ctx, self.options
        await ctx.clock.sleep(o.gossip_interval * float(ctx.rng.uniform(0.5, 1.5)))
        info: dict[str, Any] = {"role": "gossip", "fused": 0, "pushed_to": "", "attempts": 0, "neighbour_ids": []}
        while self._queue:
            msg = self._queue.popleft()  # checked by the inbox server
            with self.divergence_guard(self.fuse_step) as guard:  # a non-finite fusion is undone
                out = await ctx.compute(self.fuse, msg.tensors, float(msg.meta["samples"]))
            if guard.diverged:
                continue
            info["fused"] += 1
            info["neighbour_ids"] = sorted({*info["neighbour_ids"], msg.sender})
            info.update({f"last_{key}": v for key, v in out.items()})
        self.stats["fused"] += info["fused"]
        w_tilde, stats = await self.train_copy()
        info["train_loss"] = stats["loss"]
        tensors = model_to_numpy(w_tilde)
        tried: set[str] = set()
        await self._drain_leaves()
        while info["attempts"] < o.max_attempts:
            candidates = [p for p in ctx.live_peers() if p not in tried and p not in self._gone]
            if not candidates:
                break
            peer = candidates[int(ctx.rng.integers(len(candidates)))]
            tried.add(peer)
            info["attempts"] += 1
            push_id = f"{ctx.node_id}:{k}:{info['attempts']}"
            meta = {"samples": self.samples, "push": push_id, "step": k}
            await ctx.send(peer, Message(self.kind("push"), NO_ROUND, tensors, meta=meta))
            status = await self._await_reply(peer, push_id, ctx.clock.now() + o.reply_timeout)
            self.stats[f"push_{status}"] += 1
            if status == "queued":
                info["pushed_to"] = peer
                break
        if o.sender_keeps == "trained":
            self.model = w_tilde
        info["neighbours"] = int(bool(info["pushed_to"])) + info["fused"]
        return info
