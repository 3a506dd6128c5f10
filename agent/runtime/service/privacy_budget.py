"""The device's privacy budget: the privacy ledger, admission against ``privacy.lifetime_epsilon``,
and what the status, the run's record and the deployment manifest say about it.  Torch-free.

**The privacy ledger** (:class:`~dfl_agent.runtime.shared.privacy_ledger.PrivacyLedger`,
``STATE_DIR/privacy/ledger.sqlite``) holds one row per run that trained under DP: its noise
multiplier, sampling rate and DP steps (with the run id, the time, the δ, the clipping bound, the ε
of the run alone and a state, ``reserved``, ``spent`` or ``released``).  Every change is appended to
a hash chain in one SQLite transaction, and the ledger is checked at start and at every admission:
a ledger that cannot be trusted (0 bytes, truncated, edited, removed) declines every DP run with one
line naming the file and the recovery command (``dflctl privacy recover``); see that module.  The
device's composed ε is :func:`~dfl_agent.privacy.accountant.rdp_epsilon` of every reserved and spent
row (plus an amount a recovery carried over).

**Reserve, then settle.**  Admission (:meth:`PrivacyBudget.admit`) plans the run
(:func:`~dfl_agent.privacy.plan.plan_run`: σ, ``q = batch_size / N``, ``rounds`` times the most DP steps
a round of the algorithm takes, :meth:`~dfl_agent.algorithms.base.Algorithm.dp_steps_per_round`, as the run process plans it)
and declines it when the plan would take the composed ε past ``privacy.lifetime_epsilon``;
otherwise it RESERVES the plan's spend before the run is admitted, so a crash during the run never
under-counts.  When the run ends (:meth:`PrivacyBudget.on_state`, called for every state the run
ledger records) the row is settled with the DP steps the run actually took: the sum of ``dp_steps``
over the run's round records (``RUN_DIR/metrics.jsonl``).  A run that ended early (failed,
cancelled) also counts one more round's steps for a round that may have been sent but not
recorded, at most the plan; a run whose records carry no ``dp_steps`` keeps the plan's steps; a run
that never started training releases its reservation.
``dfl-agent run --once`` goes through the same run manager, with its one run.
A decline reason is published in the status: it names no figure that reveals N (:func:`public_reason`).

**A budget that goes down** is what a reset ledger looks like from outside: :class:`PrivacyWatch`
keeps, per device, the highest ε it saw in a status with no reservation outstanding (that value can
only grow: settled runs stay counted), and flags a device whose reported ``epsilon_spent`` falls
below it.  The run lobby watches its peers' statuses (the flags go out in this node's status, in
``privacy.peers_decreased``) and so does ``dflctl``'s observer.

**N**, the number of training samples: the sample store's snapshot less its validation slice
(``data.dataset = "store"``), else the node's partition of ``data.dataset`` (loaded without torch,
once per data section).  ``privacy.dp.delta`` must be below ``1/N``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sqlite3
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from dfl_agent.privacy.config import DEFAULT_DELTA
from dfl_agent.privacy.plan import RunPlan, plan_run
from dfl_agent.runtime.shared.descriptor import TERMINAL
from dfl_agent.runtime.shared.privacy_ledger import LedgerDamaged, PrivacyLedger, device_privacy

if TYPE_CHECKING:
    from dfl_agent.profiles.schema import DeviceProfile
    from dfl_agent.runtime.service.service_counters import ServiceCounters
    from dfl_agent.runtime.shared.config import NodeConfig
    from dfl_agent.runtime.shared.descriptor import RunDescriptor
    from dfl_agent.store.sqlite import SampleStore

log = logging.getLogger("dfl_agent.daemon")


def _round_dp_steps(metrics: Path, offset: int = 0) -> list[int] | None:
    """The ``dp_steps`` of each round record in the metrics file ``metrics`` (from byte ``offset``:
    the records a ``--once`` run appended); None when no record carries one, or there is no
    metrics file (an empty list: no round recorded)."""
    steps: list[int] = []
    seen = False
    try:
        with open(metrics, "rb") as f:
            f.seek(offset)
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(rec, dict) and "round" in rec:
            v = rec.get("dp_steps")
            if isinstance(v, int) and not isinstance(v, bool):
                seen = True
                steps.append(v)
    return steps if seen or not lines else None


def public_reason(message: str) -> str:
    """A plan's refusal (:func:`~dfl_agent.privacy.plan.plan_run`) without the figures that
    reveal the device's N (its sample count, the sampling rate, the steps): the decline reason is
    published in the status."""
    message = re.sub(r" = [0-9.e+-]+ for the \d+ samples of this device", " for this device's training samples",
                     message)
    return re.sub(r" \(\d+ steps at sampling rate [^)]*\)", "", message)


def row_view(row: dict[str, Any]) -> dict[str, Any]:
    """A ledger row as the run's record shows it."""
    return {"epsilon": round(float(row["epsilon"]), 4), "state": row["state"],
            "noise_multiplier": round(float(row["noise_multiplier"]), 4),
            "sample_rate": round(float(row["sample_rate"]), 6), "steps": int(row["steps"]),
            "delta": row["delta"]}


class PrivacyBudget:
    """The run manager's privacy side: admission, the ledger's reservations and settlements, the
    status field (see the module docstring).

    Args:
        cfg: the node configuration.
        profile: the device profile (its ``[privacy]``).
        store: the sample store, or None (``data.dataset`` is another data set).
        counters: the service counters; the status field ``privacy`` is added to them.

    Raises:
        StartupError: an invalid ``[privacy]`` (one line naming the key).
    """

    def __init__(self, cfg: NodeConfig, profile: DeviceProfile, store: SampleStore | None = None,
                 counters: ServiceCounters | None = None):
        self.cfg, self.profile, self.store = cfg, profile, store
        from dfl_agent.runtime.shared.assembly import StartupError

        try:
            self.config = device_privacy(cfg, profile)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self.ledger = PrivacyLedger(cfg.state_dir)
        #: the run lobby's watch of its peers' reported budgets (``peers_decreased`` in :meth:`status`)
        self.watch: PrivacyWatch | None = None
        self.ledger.at_start()  # chains an older release's ledger; a damaged one is logged (ERROR, one line)
        self._lock = threading.Lock()
        self._view: tuple[object, dict[str, Any]] | None = None
        self._n_cache: tuple[object, int] | None = None
        if counters is not None:
            counters.fields["privacy"] = self.status
            watch = getattr(getattr(counters, "lobby", None), "privacy_watch", None)
            if isinstance(watch, PrivacyWatch):  # peers whose reported budget went down
                self.watch = watch

    @property
    def delta(self) -> float:
        return self.config.dp.delta if self.config.dp is not None else DEFAULT_DELTA

    def n_samples(self, run_cfg: NodeConfig) -> int:
        """N: the training samples the run would train on now (see the module docstring)."""
        d = run_cfg.data
        if self.store is not None:
            from dfl_agent.store.sqlite import validation_mask

            ids = self.store.snapshot()
            return int((~validation_mask(ids, d.validation_share)).sum()) if len(ids) else 0
        key = (d, run_cfg.seed)
        if self._n_cache is None or self._n_cache[0] != key:
            from dfl_agent.data.loading import node_data_for
            from dfl_agent.runtime.shared.preflight import load_data

            data = node_data_for(load_data(run_cfg), d.num_nodes, d.node_index, d.partition, seed=run_cfg.seed,
                                 beta=d.beta, zeta=d.zeta)
            self._n_cache = (key, int(data.num_train))
        return self._n_cache[1]

    def plan(self, run_cfg: NodeConfig) -> RunPlan:
        """The DP plan of a run with the effective configuration ``run_cfg`` (DP on).

        Raises:
            ValueError: one line (delta not below 1/N, no samples, an unreachable target ε).
        """
        from dfl_agent.algorithms.base import dp_steps_per_round  # torch-free: the run process's own count

        assert self.config.dp is not None
        t, a = run_cfg.training, run_cfg.algorithm
        n = self.n_samples(run_cfg)
        batch = t.batch_size if t.batch_size is not None else self.profile.training.batch_size
        per_round = dp_steps_per_round(a.name, SimpleNamespace(**a.options), n_samples=n, batch_size=batch,
                                       epochs=t.epochs, steps=t.steps)
        return plan_run(self.config.dp, n_samples=n, batch_size=batch, steps_per_round=per_round,
                        rounds=run_cfg.algorithm.rounds)

    def admit(self, d: RunDescriptor) -> str | None:
        """None to admit run ``d`` (its plan's spend reserved in the ledger), else the decline
        reason: the plan is impossible, or it would take the composed ε past the lifetime budget."""
        if self.config.dp is None:
            return None
        from dfl_agent.algorithms.base import check_dp_combination
        from dfl_agent.runtime.shared.assembly import StartupError
        from dfl_agent.runtime.shared.run_config import run_config_for

        try:  # an algorithm that would send what DP does not protect (dfl_agent.privacy.policy)
            check_dp_combination(d.algorithm, d.options)
        except ValueError as exc:
            return str(exc)
        try:
            run_cfg = run_config_for(self.cfg, d)
        except StartupError:
            return None  # the run's settings fail it when it starts, with their own reason
        return self.admit_config(d.run_id, run_cfg)

    def admit_config(self, run_id: str, run_cfg: NodeConfig) -> str | None:
        """:meth:`admit` of run ``run_id`` with the effective configuration ``run_cfg``."""
        if self.config.dp is None:
            return None
        from dfl_agent.privacy.policy import check_lifetime

        try:  # the static rule, which the configuration's checks apply too
            check_lifetime(self.config)
        except ValueError as exc:
            return f"privacy budget: {exc}"
        try:  # the ledger checked: a damaged one declines the run with its one line
            ledger = self.ledger.state(fresh=True)
        except LedgerDamaged as exc:  # the run manager logs the decline with it
            return str(exc)
        except (sqlite3.Error, OSError) as exc:
            log.error("run %s: privacy ledger %s: %s", run_id, self.ledger.path, exc)
            return f"privacy ledger {self.ledger.path}: cannot be read now ({exc}); the run is declined"
        try:
            plan = self.plan(run_cfg)
        except (ValueError, OSError) as exc:
            log.warning("run %s: %s", run_id, exc)  # the details stay in the device's log
            return f"privacy: {public_reason(str(exc))}"
        life = self.config.lifetime_epsilon
        before = ledger.epsilon(plan.delta, exclude=run_id)
        after = ledger.epsilon(plan.delta, exclude=run_id,
                               plus=[(plan.noise_multiplier, plan.sample_rate, plan.steps)])
        if after > life:  # the reason is published: no figure of the plan that reveals N (q, steps)
            log.info("run %s: its plan: %d DP steps, noise multiplier %.4g, sampling rate %.4g", run_id, plan.steps,
                     plan.noise_multiplier, plan.sample_rate)
            return (f"privacy budget: the run would spend epsilon {plan.epsilon:.3g} and take this device's "
                    f"lifetime epsilon from {before:.3g} to {after:.3g}, past privacy.lifetime_epsilon {life:g} "
                    f"(delta {plan.delta:g})")
        try:
            self.ledger.reserve(run_id, plan, run_cfg.algorithm.rounds)
        except (LedgerDamaged, sqlite3.Error, OSError) as exc:  # nothing reserved: the run does not start
            log.error("run %s: %s", run_id, exc)
            return str(exc) if isinstance(exc, LedgerDamaged) else \
                f"privacy ledger {self.ledger.path}: cannot be written ({exc}); the run is declined"
        log.info("run %s: privacy budget reserved: epsilon %.3g for %d DP steps (lifetime %.3g of %g)",
                 run_id, plan.epsilon, plan.steps, after, life)
        return None

    def on_state(self, run_id: str, state: str, run_dir: Path, *, metrics: Path | None = None,
                 offset: int = 0) -> dict[str, Any]:
        """The run ledger records ``state`` for ``run_id``: mark training, settle a run that
        ended (from its round records: ``run_dir/metrics.jsonl``, else ``metrics`` from byte
        ``offset``).  Returns the fields for the run's ledger entry (``{"privacy": {...}}``, or
        ``{}`` for a run without a reservation)."""
        try:
            row = self.ledger.get(run_id)
            if row is None:
                return {}
            if state == "training" and not row["trained"]:
                self.ledger.mark_trained(run_id)
            elif state in TERMINAL and row["state"] == "reserved":
                rounds = _round_dp_steps(metrics or run_dir / "metrics.jsonl", offset)
                row = self.ledger.settle(run_id, self._steps_taken(row, state, rounds)) or row
                log.info("run %s: privacy ledger settled: %d DP steps, epsilon %.3g", run_id, row["steps"],
                         row["epsilon"])
                self._fold()
            return {"privacy": row_view(row)}
        except LedgerDamaged as exc:  # logged at start and with every declined run; a reservation stays counted
            log.debug("run %s: privacy ledger not read for %s: %s", run_id, state, exc.what)
            return {}
        except (sqlite3.Error, OSError) as exc:  # the reservation stands; the next state settles it
            log.error("run %s: privacy ledger not settled for %s: %s", run_id, state, exc)
            return {}

    def _fold(self) -> None:
        """Fold the runs older than the newest ``runtime.keep_runs`` (the ledger stays bounded; a
        failure is logged and the ledger left as it is)."""
        try:
            self.ledger.fold(self.cfg.runtime.keep_runs)
        except (LedgerDamaged, sqlite3.Error, OSError) as exc:
            log.warning("privacy ledger %s: older runs not folded: %s", self.ledger.path, exc)

    @staticmethod
    def _steps_taken(row: dict[str, Any], state: str, rounds: list[int] | None) -> int:
        """The DP steps a run that ended in ``state`` took, by the ``dp_steps`` of its round records
        (see the module docstring)."""
        planned = int(row["planned_steps"])
        if not row["trained"] and not rounds:
            return 0  # never trained here: the reservation is released
        if rounds is None:
            return planned  # no round reported its steps: the plan stands
        taken = sum(rounds)
        if state != "finished":  # a round may have been sent and not recorded
            taken = min(planned, taken + int(row["steps_per_round"]))
        return taken

    def status(self) -> dict[str, Any]:
        """The status field ``privacy``: ``{"dp": false}`` without DP and without a history, else the
        composed ε spent (reservations included), what remains of ``lifetime_epsilon``, and δ;
        ``{"ledger": "damaged", "error": ...}`` when the ledger fails its check; with
        ``peers_decreased`` (:class:`PrivacyWatch`) when a peer's reported ε went down."""
        view = self._status()
        down = self.watch.view() if self.watch is not None else None
        return {**view, "peers_decreased": down} if down else view

    def _status(self) -> dict[str, Any]:
        try:
            ledger = self.ledger.state()
            entries = self.ledger.entries()
        except LedgerDamaged as exc:  # no figures: the device cannot say what it spent
            return {"dp": self.config.dp is not None, "ledger": "damaged", "error": exc.what}
        except (sqlite3.Error, OSError) as exc:
            return {"dp": self.config.dp is not None, "error": str(exc)}
        key = (tuple((e["run_id"], e["state"], e["steps"]) for e in entries), len(ledger.carried))
        with self._lock:
            if self._view is not None and self._view[0] == key:
                return self._view[1]
        if self.config.dp is None and not entries and not ledger.carried:
            view: dict[str, Any] = {"dp": False}
        else:
            spent = ledger.epsilon(self.delta)
            life = self.config.lifetime_epsilon
            view = {"dp": self.config.dp is not None, "epsilon_spent": round(spent, 4),
                    "epsilon_remaining": round(max(0.0, life - spent), 4) if math.isfinite(spent) else 0.0,
                    "lifetime_epsilon": life, "delta": self.delta,
                    "runs": ledger.runs_spent(),
                    "reserved": sum(1 for e in entries if e["state"] == "reserved")}
            if ledger.carried:  # a recovery: the amount an operator stated as spent before it
                view["epsilon_carried"] = round(sum(float(c["epsilon"]) for c in ledger.carried), 4)
        with self._lock:
            self._view = (key, view)
        return view


class PrivacyWatch:
    """The highest ε each device reported, and the devices whose reported ε went down since
    (see the module docstring).  Thread-safe.

    A device's floor is the largest ``epsilon_spent`` of its statuses with ``reserved == 0`` (no
    reservation that a release could take back: the settled runs alone, which never go away);
    a later status at the same δ whose ``epsilon_spent`` is below the floor (by more than the
    status's rounding) flags the device until it reports the floor again.
    """

    #: the reported figures are rounded to 4 decimals
    TOLERANCE = 1e-3

    def __init__(self) -> None:
        self._floor: dict[str, tuple[float, object, float]] = {}  # node -> (epsilon, delta, time)
        self._down: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def observe(self, node: str, privacy: object, now: float | None = None) -> dict[str, Any] | None:
        """Take one status's ``privacy`` field of ``node``; returns the flag when this status puts
        (or keeps, with another figure) ``node`` below its floor (``{"was": ε, "now": ε, "since":
        unix time}``), else None (:meth:`view` has every flag)."""
        if not isinstance(privacy, Mapping):
            return None
        spent, delta = privacy.get("epsilon_spent"), privacy.get("delta")
        if not isinstance(spent, (int, float)) or isinstance(spent, bool) or not math.isfinite(spent):
            return None
        now = time.time() if now is None else now
        with self._lock:
            floor = self._floor.get(node)
            if floor is not None and floor[1] == delta and spent < floor[0] - self.TOLERANCE:
                flag = self._down.get(node)
                if flag is not None and flag["now"] == spent:
                    return None
                self._down[node] = flag = {"was": floor[0], "now": float(spent),
                                           "since": flag["since"] if flag else now}
                return dict(flag)
            self._down.pop(node, None)
            if privacy.get("reserved") == 0 and (floor is None or floor[1] != delta or spent > floor[0]):
                self._floor[node] = (float(spent), delta, now)
        return None

    def view(self) -> dict[str, dict[str, Any]]:
        """The flagged devices: node id -> ``{"was", "now", "since"}``."""
        with self._lock:
            return {k: dict(v) for k, v in sorted(self._down.items())}
