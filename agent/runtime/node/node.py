"""``Node``: one algorithm instance wired to its context, with evaluation and metrics.

After every round (or every ``eval_every`` rounds) it evaluates the algorithm's
deployable model on the global test set ("global accuracy") and on the node's
validation split ("local accuracy"), optionally trains a local-only shadow model from
the same initial weights (the baseline the federation must beat), appends a metrics
record and publishes the node's status.  Used by the simulator and by the daemon alike.

With ``eval_background`` (the daemon's default) the evaluation never delays the
federation: at the end of a round the models to evaluate are copied, the next round
starts at once, and the copies are evaluated (and the baseline trained) in a worker
thread meanwhile.  Round records are still written, and the after-round hooks called,
in round order, each once its evaluation is done; the record's ``eval_s`` is then time
that overlapped the next round instead of time between rounds.  A round that ends while
the previous evaluation is still running is not evaluated (``eval_skipped`` in its
record; the last round always is), so evaluations never queue up.

A round's record is written only after the round's checkpoint is saved, and the records
not yet written are saved with each checkpoint (:meth:`Node.pending_records`).  A kill
between a checkpoint and its record therefore loses no record and writes none twice: on
resume, :meth:`Node.recover_records` writes the records the checkpoint holds that the
metrics file lacks (the checkpointed round's evaluated on the restored model).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.algorithms.base import Algorithm
from dfl_agent.learning.training import TrainConfig, TrainingAborted, evaluate, ramp_scale, ramped, train_local
from dfl_agent.privacy.policy import redact_status
from dfl_agent.runtime.node.context import TIMING_KEYS, RuntimeContext
from dfl_agent.runtime.node.node_hooks import FederationFinished, NodeHooks, NodeKilled, RunStopped
from dfl_agent.runtime.shared.degraded import degraded_fields, peer_updates_used, round_alone, warn_alone
from dfl_agent.transport.base import CONTROL_DROP_PREFIXES

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

MetricsSink = Callable[[dict[str, Any]], None]


def init_seed_for(seed: int, index: int, init: str) -> int:
    """Torch seed of a node's initial weights: shared by all (``common``) or per node."""
    return seed if init == "common" else seed * 100_003 + index + 1


class Node:
    """Runs one node's algorithm and reports on it.

    Args:
        ctx: the node's started-or-not :class:`RuntimeContext`.
        algorithm: an instance bound to ``ctx``.
        test_x, test_y: the global test set (float32 ``(N, *shape)``, int64 ``(N,)``).
        baseline_local: also train a local-only copy each round and report its accuracy.
        sink: called with each round's metrics record (JSON-friendly dict).
        rounds: planned number of rounds (for status display).
        eval_every: evaluate every this many rounds (and always round 1 and the last);
            records of other rounds carry no accuracy.
        eval_background: evaluate copies of the models in the background while the next
            round runs (needs a context that computes in a worker thread), instead of
            between rounds.
    """

    def __init__(
        self,
        ctx: RuntimeContext,
        algorithm: Algorithm,
        test_x: np.ndarray,
        test_y: np.ndarray,
        *,
        baseline_local: bool = False,
        sink: MetricsSink | None = None,
        rounds: int = 0,
        eval_every: int = 1,
        eval_background: bool = False,
        hooks: NodeHooks | None = None,
        accuracy_source: str | None = None,
        run_info: dict[str, Any] | None = None,
        lr_ramp: int = 0,
    ):
        self.ctx = ctx
        #: its owner's hooks (:class:`~dfl_agent.runtime.node.node_hooks.NodeHooks`)
        self.hooks = hooks if hooks is not None else NodeHooks()
        self.algorithm = algorithm
        self.test_x, self.test_y = test_x, test_y
        self.baseline_local = baseline_local
        self.sink = sink
        self.rounds = rounds
        self.eval_every = max(1, eval_every)
        self.eval_background = eval_background
        #: start-up work done before round 1 (e.g. ``warm_up_s``), added to round 1's record
        self.startup: dict[str, float] = {}
        #: the run's start (:mod:`dfl_agent.runtime.run.warm_start`: ``init``, ``started_from``, ``reason``),
        #: added to the first round record of this process as ``init``, ``started_from`` and ``init_reason``
        self.run_start: dict[str, Any] = {}
        self.lr_ramp = lr_ramp  #: ``training.warm_start_ramp`` (:func:`dfl_agent.runtime.run.warm_start.ramp_factor`)
        self._full_rate: TrainConfig | None = None  # a warm-started run's full-rate training, while it ramps
        #: the reporting of the latest round (evaluation, record, hooks) while it runs in the background
        self._report_task: asyncio.Task[None] | None = None
        #: the deployable model of the record being reported (a copy in background mode)
        self._reported_model: nn.Module | None = None
        self.history: list[dict[str, Any]] = []
        self.shadow: nn.Module | None = None
        self._shadow_rng: np.random.Generator | None = None
        self._round_started = 0.0
        self._round_started_wall = time.perf_counter()
        self._wall_started = time.time()
        ctx.set_hooks(round_hook=self._on_round, gate_hook=lambda reason: self.publish_status(),
                      status_hook=self.publish_status)
        self.state = "starting"
        self.set_up = False  #: whether :meth:`setup` ran: before, the status has no algorithm fields
        #: the run this node trains in (runs.py): ``{"id", "state", "reason"}``; None with ``--once``
        self.run_info = run_info
        self.checkpoint_errors = 0
        #: round -> its record while it is not yet written (evaluation running, or its
        #: checkpoint not yet saved); saved with every checkpoint (pending_records)
        self._pending: dict[int, dict[str, Any]] = {}
        #: what "global accuracy" measures when there is no global test set (the sample
        #: store: "local validation"); shown in the status as ``global_accuracy_source``
        self.accuracy_source = accuracy_source
        #: fault injection (:meth:`kill_at`): (round, called when the node crashes)
        self._kill: tuple[int, Callable[[], None]] | None = None
        #: rounds this node closed alone (:func:`round_alone`), status ``rounds_alone``, of
        #: the rounds meant to use a peer update (``exchange_rounds``): a degraded run
        self.rounds_alone = 0
        self.exchange_rounds = 0
        self._alone_warned: int | None = None

    def set_state(self, state: str) -> None:
        """The node's state as its owner sees it outside the round loop (``waiting_for_peers``,
        ``finished``, ``stopped``, ``killed``, ``adopting``: taking the run's model from a member
        after it missed the run's end): its status says so."""
        self.state = state

    def start_from(self, run_start: dict[str, Any]) -> None:
        """The run's start (:mod:`dfl_agent.runtime.run.warm_start`: ``init``, ``started_from``,
        ``reason``): added to this process's first round record."""
        self.run_start = dict(run_start)

    def note_startup(self, name: str, seconds: float) -> None:
        """Start-up work done before round 1 (e.g. ``warm_up_s``): added to round 1's record."""
        self.startup[name] = seconds

    def resumed_at(self, restored: int, rounds_alone: int, exchange_rounds: int) -> None:
        """After a restart from the checkpoint of round ``restored``: its history says so, and the
        rounds closed alone, of those meant to use a peer update, are the metrics file's (a
        degraded run stays degraded)."""
        self.history.append({"node": self.ctx.node_id, "round": restored, "time": self.ctx.clock.now(),
                             "resumed": True})
        self.rounds_alone, self.exchange_rounds = rounds_alone, exchange_rounds

    def kill_at(self, round: int, on_kill: Callable[[], None]) -> None:
        """Crash this node when it is about to start round ``round`` (or a later one):
        ``on_kill()`` runs (the simulator takes the node off its network), and
        :meth:`run` raises :class:`NodeKilled`.  The node reports rounds before ``round``."""
        self._kill = (round, on_kill)

    def _check_kill(self, next_round: int) -> None:
        if self._kill is not None and next_round >= self._kill[0]:
            self._kill[1]()
            raise NodeKilled(next_round)

    async def setup(self) -> None:
        await self.algorithm.setup()
        self.set_up = True
        if self.baseline_local:
            # same architecture and initial weights as the deployable model, but trainable
            # (a deployable model may be frozen, like DFML's peak model)
            self.shadow = copy.deepcopy(self.algorithm.deployable_model()).requires_grad_(True)
            self._shadow_rng = np.random.default_rng([self.ctx.init_seed, 0x5EED])

    async def run(self, rounds: int, start_round: int = 1) -> None:
        self.rounds = rounds
        self.state = "running"
        if self.lr_ramp > 0 and (self.run_start or {}).get("started_from") is not None:
            self._full_rate = self.ctx.train
            self._set_lr_ramp(start_round)
        self._round_started = self.ctx.clock.now()
        self._round_started_wall = time.perf_counter()
        await self.publish_status()
        try:
            if start_round <= rounds:
                self._check_kill(start_round)
            await self.algorithm.run(rounds, start_round)
        except FederationFinished as end:
            log.warning("%s; the run ends here with this node's model", end)
        except Exception:
            await self.drain()  # a stopped run still reports its last rounds
            raise
        except BaseException:
            if self._report_task is not None:
                self._report_task.cancel()
            raise
        await self.drain()
        self.state = "finished"
        await self.publish_status()

    def _set_lr_ramp(self, t: int) -> None:
        """Round ``t``'s learning rates (``ctx.train``): the full rates once past the ramp."""
        if self._full_rate is not None:
            self.ctx.use_train(ramped(self._full_rate, ramp_scale(self.lr_ramp, t)))

    async def drain(self) -> None:
        """Wait until every round's background evaluation and record are done."""
        task = self._report_task
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    def reported_model(self) -> nn.Module:
        """The deployable model of the round record being reported (after-round hooks,
        e.g. the ONNX publisher): the evaluated copy with ``eval_background``, else the
        live model."""
        return self._reported_model if self._reported_model is not None else self.algorithm.deployable_model()

    def _snapshot(self) -> dict[str, nn.Module]:
        """Copies of the models a round's evaluation reads (the algorithm moves on)."""
        models = {"": self.algorithm.deployable_model(), **self.algorithm.evaluation_models()}
        return {name: copy.deepcopy(m) for name, m in models.items()}

    def _eval_jobs(self, models: dict[str, nn.Module] | None,
                   baseline: bool) -> dict[str, tuple[nn.Module, np.ndarray, np.ndarray]]:
        """Record key -> (model, x, y) of a round's evaluation (``models``: the copies to
        evaluate, None = the live models); with ``baseline``, trains the shadow first."""
        d = self.ctx.data
        if models is None:
            models = {"": self.algorithm.deployable_model(), **self.algorithm.evaluation_models()}
        model = models[""]
        jobs = {"global_accuracy": (model, self.test_x, self.test_y), "local_accuracy": (model, d.val_x, d.val_y)}
        for name, extra in ((n, m) for n, m in models.items() if n):
            jobs[f"{name}_global_accuracy"] = (extra, self.test_x, self.test_y)
        if self.shadow is not None and baseline:
            self._train_shadow()
            jobs["local_only_global_accuracy"] = (self.shadow, self.test_x, self.test_y)
            jobs["local_only_local_accuracy"] = (self.shadow, d.val_x, d.val_y)
        return jobs

    def _evaluate(self, models: dict[str, nn.Module] | None = None, baseline: bool = True) -> dict[str, Any]:
        jobs = self._eval_jobs(models, baseline)
        return {k: evaluate(m, x, y, device=self.ctx.device)["accuracy"] for k, (m, x, y) in jobs.items()}

    async def _evaluate_now(self, models: dict[str, nn.Module] | None) -> dict[str, Any]:
        """:meth:`_evaluate` through the context; in the simulator with batching, each
        evaluation joins the batcher's vectorised pass over the nodes evaluating in the
        same instant (:meth:`~dfl_agent.runtime.node.batching.BatchTrainer.submit_eval`), and
        a model that does not qualify is evaluated on its own.  Same record either way."""
        batcher = getattr(self.ctx, "batcher", None)
        if batcher is None or getattr(self.ctx, "compute_in_thread", True) or not hasattr(batcher, "submit_eval"):
            return await self.ctx.compute_ungated(self._evaluate, models)
        dev = self.ctx.device
        jobs = self._eval_jobs(models, baseline=True)
        futures = {k: batcher.submit_eval(m, x, y, device=dev) for k, (m, x, y) in jobs.items()}
        out: dict[str, Any] = {}
        for k, (m, x, y) in jobs.items():
            fut = futures[k]
            out[k] = (await fut if fut is not None else evaluate(m, x, y, device=dev))["accuracy"]
        return out

    def _train_shadow(self) -> None:
        """One round of local-only training of the baseline copy."""
        assert self.shadow is not None and self._shadow_rng is not None
        d = self.ctx.data
        train_local(self.shadow, d.train_x, d.train_y, self.ctx.train, self._shadow_rng, self.ctx.device)

    async def _on_round(self, t: int, info: dict[str, Any]) -> None:
        now = self.ctx.clock.now()
        round_seconds = now - self._round_started
        due = t == 1 or t % self.eval_every == 0 or t >= self.rounds
        # where the round's real time went: train/encode/send/receive from the context,
        # wait = the rest of the federated round (peers, deadlines, aggregation); eval_s
        # comes after the round's messages are sent
        round_wall = time.perf_counter() - self._round_started_wall
        timing = {k: round(v, 6) for k, v in self.ctx.last_round_timing.items()}
        timing["round_wall_s"] = round(round_wall, 6)
        timing["wait_s"] = round(max(0.0, round_wall - sum(timing.get(k, 0.0) for k in TIMING_KEYS)), 6)
        counters = self.ctx.counters()
        talks = self.algorithm.communicates  # a deliberate `local` run is never alone
        needs = bool(self.hooks.needs_peers is not None and self.hooks.needs_peers())  # discovery.min_peers, run members
        record = {
            "node": self.ctx.node_id,
            "round": t,
            "time": now,
            "round_seconds": round_seconds,
            "wall": time.time() - self._wall_started,
            **{k: v for k, v in info.items() if isinstance(v, (int, float, str, list, bool))},
            "bytes_sent": counters["bytes_sent"],
            "bytes_received": counters["bytes_received"],
            "dropped": sum(counters["dropped"].values()),
            # steps whose non-finite result was restored (Algorithm.divergence_guard), so far
            "diverged": int(counters.get("diverged", 0)),
            "live_peers": self.ctx.live_peer_count(),
            # closed with no peer update although neighbours were expected or needed (a degraded run)
            "alone": talks and round_alone(info, self.ctx.last_round_expected, needs),
            # seconds the round was held because the broker was away (runtime.pause_when_disconnected)
            "paused_s": round(self.ctx.last_round_paused, 3),
            **timing,
        }
        self.exchange_rounds += talks and peer_updates_used(info) is not None
        if record["alone"]:  # a degraded run: a WARNING at most once every 10 rounds
            self.rounds_alone += 1
            self._alone_warned = warn_alone(t, self.rounds_alone, self.exchange_rounds, self.ctx.last_round_expected,
                                            self._alone_warned)
        record.update(self.ctx.byte_accounting())  # bytes by kind, this round's bytes, compression ratio (issue 8)
        data = self.ctx.data
        if data is not None and hasattr(data, "num_train"):  # what this run trains on (grows with the store)
            record["train_samples"], record["validation_samples"] = int(data.num_train), int(data.num_val)
        self._start_fields(record)
        if found := getattr(self.ctx.peers, "take_found", lambda: None)():  # how peers were found since
            record["peers_found"] = found
        self.history.append(record)
        self._pending[t] = record
        # a record is written only once its round's checkpoint is saved: a kill in between
        # never leaves a record whose round the resumed node runs again
        saved = asyncio.Event() if self.hooks.checkpoint is not None else None
        if self.eval_background:
            # evaluation never delays the federation: copies are evaluated while the next round
            # runs; at most one evaluation waits at a time (a round that ends while the previous
            # evaluation still runs is not evaluated, but the last round always is)
            busy = self._report_task is not None and not self._report_task.done()
            if due and busy and t < self.rounds:
                due = False
                record["eval_skipped"] = True
            models = self._snapshot() if due else None
            self._report_task = asyncio.create_task(self._report(t, record, due, models, self._report_task, saved))
            await self._checkpoint(t, saved)
        else:
            await self._checkpoint(t, saved)
            await self._report(t, record, due, None, None)
        await self.publish_status()
        if self.hooks.stop_check is not None and self.hooks.stop_check():
            raise RunStopped(t)
        if t < self.rounds and self.hooks.finish_check is not None and self.hooks.finish_check():
            raise FederationFinished(t)
        self._round_started = self.ctx.clock.now()
        self._round_started_wall = time.perf_counter()
        self._set_lr_ramp(t + 1)
        if t < self.rounds:
            self._check_kill(t + 1)  # fault injection: crash as the next round starts

    def _start_fields(self, record: dict[str, Any]) -> None:
        """Add what the run's start did to a round ``record``: the start-up work and the warm
        start (the first record of this process only), and the learning-rate ramp's factor."""
        if self.startup:  # the first record after start-up says what it cost
            record.update({f"startup_{k}": v for k, v in self.startup.items()})
            self.startup = {}
        if self.run_start:
            s = self.run_start
            record.update(init=s.get("init"), started_from=s.get("started_from"), init_reason=s.get("reason", ""))
            if "probe" in s:  # the warm start's fit of the output layer
                record["linear_probe"] = s["probe"]
            self.run_start = {}
        if (scale := getattr(self.ctx.train, "lr_scale", 1.0)) != 1.0:  # a warm start's learning-rate ramp
            record["lr_scale"] = round(scale, 4)

    async def _checkpoint(self, t: int, saved: asyncio.Event | None) -> None:
        """Save round ``t``'s checkpoint (operations: crash-safe state after every round),
        then set ``saved`` (also when saving failed or was cancelled)."""
        if self.hooks.checkpoint is None:
            return
        try:
            await self.hooks.checkpoint(t)
        except Exception as exc:  # a full disk must not stop the federation
            self.checkpoint_errors += 1
            log.error("checkpoint of round %d failed: %s", t, exc)
        finally:
            if saved is not None:
                saved.set()

    def pending_records(self) -> list[dict[str, Any]]:
        """Copies of the round records not yet written (their evaluation is running, or
        their checkpoint is being saved), oldest first.  Saved with each checkpoint, so
        that a node killed before writing them writes them when it resumes
        (:meth:`recover_records`)."""
        return [dict(r) for _, r in sorted(self._pending.items())]

    def recover_records(self, restored: int, pending: list[dict[str, Any]], written: set[int]) -> list[int]:
        """Write the records that a resumed node's checkpoint of round ``restored`` holds
        (``pending``, :meth:`pending_records` when it was saved) and that the metrics
        file lacks (``written``: rounds it has).  Round ``restored``'s record, when it was
        due for evaluation and not yet evaluated, is evaluated on the restored
        deployable model: the model it would have evaluated.  An older record's
        evaluation is lost (``eval_skipped``).  Each record written here carries
        ``written_at_resume: true``.  Call after the checkpoint was restored, before the
        first round.  Returns the rounds written, in order.
        """
        out = []
        for rec in sorted(pending, key=lambda r: int(r.get("round", 0))):
            t = int(rec.get("round", 0))
            if t < 1 or t > restored or t in written:
                continue
            rec = dict(rec)
            due = (t == 1 or t % self.eval_every == 0 or t >= self.rounds) and not rec.get("eval_skipped")
            if due and "global_accuracy" not in rec:
                if t == restored:
                    e0 = time.perf_counter()
                    rec.update(self._evaluate(baseline=False))
                    rec["eval_s"] = round(time.perf_counter() - e0, 6)
                else:
                    rec["eval_skipped"] = True
            rec["written_at_resume"] = True
            if self.sink is not None:
                self.sink(rec)
            self.history.append(rec)
            written.add(t)
            out.append(t)
        if out:
            log.info("wrote the records of rounds %s, saved with the checkpoint of round %d", out, restored)
        return out

    async def _report(self, t: int, record: dict[str, Any], due: bool, models: dict[str, nn.Module] | None,
                      previous: asyncio.Task[None] | None, saved: asyncio.Event | None = None) -> None:
        """Evaluate round ``t`` (when ``due``; ``models``: the copies to evaluate, None =
        the live models), complete ``record``, write it (once ``saved`` is set: the
        round's checkpoint is on disk) and call the after-round hooks.
        In background mode it first waits for ``previous`` (records stay in round order)
        and logs its own failures instead of raising them."""
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        try:
            e0 = time.perf_counter()
            if due:
                record.update(await self._evaluate_now(models))
            elif self.eval_background and self.shadow is not None:
                # an unevaluated round still trains the baseline: it sees as many rounds as the federation
                await self.ctx.compute_ungated(self._train_shadow)
            record["eval_s"] = round(time.perf_counter() - e0, 6)
            if due:
                if "participated" in record:  # rotating-aggregator rounds: a node takes part in some rounds only
                    who = (f"took part ({record.get('participants', '?')} participants)" if record["participated"]
                           else "did not take part (model unchanged this round)")
                else:
                    who = f"{record.get('neighbours', 0)} neighbours"
                log.info("round %d done in %.1fs: global acc %.3f, local acc %.3f, %s",
                         t, record["round_seconds"], record["global_accuracy"], record["local_accuracy"], who)
            if saved is not None:
                await saved.wait()
            if self.sink is not None:
                self.sink(record)
            self._pending.pop(t, None)
            self._reported_model = models[""] if models else None
            try:
                for hook in self.hooks.after_round:
                    try:
                        await hook(t, record)
                    except Exception as exc:  # a hook never stops the round loop
                        log.error("after-round hook failed: %s", exc)
            finally:
                self._reported_model = None
            if models is not None:
                await self.publish_status()  # the status carries the new accuracy
        except Exception as exc:
            self._pending.pop(t, None)
            if not self.eval_background:
                raise
            if isinstance(exc, TrainingAborted):  # the node is stopping: its evaluation was cut short
                log.debug("evaluation of round %d stopped: the node is stopping", t)
                return
            log.exception("evaluation of round %d failed", t)

    def last_round(self) -> int:
        """The last round this node completed (0 before the first)."""
        return int(self.history[-1].get("round", 0)) if self.history else 0

    def status(self) -> dict[str, Any]:
        """The status document published on ``dfl/{fed}/node/{id}/status``: under
        differential privacy without the accuracies and sample counts
        (:func:`~dfl_agent.privacy.policy.redact_status`); the algorithm's own once it was set up."""
        evaluated = [r for r in self.history if "global_accuracy" in r]
        last = {**(evaluated[-1] if evaluated else {}), **(self.history[-1] if self.history else {})}
        counters = self.ctx.counters()
        st = {
            "node_id": self.ctx.node_id,
            "state": self.state,
            "algorithm": self.algorithm.name,
            "round": last.get("round", 0),
            "rounds": self.rounds,
            "role": "peer",
            "global_accuracy": last.get("global_accuracy"),
            "local_accuracy": last.get("local_accuracy"),
            "local_only_global_accuracy": last.get("local_only_global_accuracy"),
            **({"global_accuracy_source": self.accuracy_source} if self.accuracy_source else {}),
            # wall-clock (Unix) time of the last completed round, so that dflctl shows an age
            "last_synchronization": round(self._wall_started + last["wall"], 3) if "wall" in last else None,
            "neighbours": last.get("neighbours"),
            # rotating-aggregator algorithms: whether the node took part in its last round
            **({"participated": last["participated"]} if "participated" in last else {}),
            "live_peers": self.ctx.live_peers(),
            "bytes_sent": counters["bytes_sent"],
            "bytes_received": counters["bytes_received"],
            "errors": counters["dropped"],
            "diverged": int(counters.get("diverged", 0)),  # restored non-finite steps
            "checkpoint_errors": self.checkpoint_errors,
            # the control plane's share of them: forged, unsigned, replayed presence/status
            "control_dropped": {k: v for k, v in counters["dropped"].items() if k.startswith(CONTROL_DROP_PREFIXES)},
            "rounds_skipped": self.ctx.caught_up,  # catching up with the neighbours (runtime.rejoin)
            "paused_disconnected_s": round(self.ctx.disconnected_seconds, 1),  # runtime.pause_when_disconnected
            # rounds closed with no peer update although peers were expected or needed, of those
            # meant to use one: the run is degraded (runtime.degraded)
            **degraded_fields({"rounds_alone": self.rounds_alone, "exchange_rounds": self.exchange_rounds}),
            # how many peers each discovery source found first ({"mdns": 2, "bridged-presence": 3})
            "peers_found_via": getattr(self.ctx.peers, "found_counts", dict)(),
            # the neighbours whose CHOCO stream this node lost: each sends a keyframe on seeing it
            "keyframe_wanted": getattr(getattr(self.ctx, "membership", None), "keyframe_wanted", list)(),
            **{k: v for k, v in self.ctx.byte_accounting().items()
               if k in ("bytes_sent_by_kind", "compression_ratio", "round_bytes_sent", "round_bytes_sent_by_kind")},
            **{k: v for k, v in last.items() if k.endswith("_global_accuracy")},  # e.g. DFML's regular model
            **(self.algorithm.status() if self.set_up else {}),
            **self._profile_status(),
            **({"run": {**self.run_info, "round": last.get("round", 0),
                        "state": {"running": "training", "finished": "finished", "adopting": "adopting"}.get(self.state,
                                                                                     self.run_info["state"])}}
               if self.run_info else {}),
        }
        return redact_status(st) if getattr(self.algorithm, "private", bool)() else st

    def _profile_status(self) -> dict[str, Any]:
        """Device-profile fields of the status: gating reason, behaviour, excluded peers."""
        ctx = self.ctx
        out: dict[str, Any] = {"gated": ctx.gated}
        if ctx.gated and self.state == "running":
            # paused: the broker is away (the round waits for it); gated: the device's limits
            out["state"] = "paused" if getattr(ctx, "paused", False) else "gated"
        out["excluded_peers"] = {p: r for p, r in ctx.excluded.items() if not r.startswith("inference-only")}
        if ctx.behaviour is not None:
            b = ctx.behaviour
            out.update(profile=b.profile, roles=b.roles, device=b.device, compression=b.compression)
        return out

    async def publish_status(self) -> None:
        try:
            await self.ctx.transport.publish_status(self.status())
        except Exception as exc:  # status is best effort
            log.warning("could not publish status: %s", exc)
