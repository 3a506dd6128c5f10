"""A run's differential privacy in the training process (``privacy.dp``).

A run the service admitted trains under the plan admission reserved in the privacy ledger
(:mod:`dfl_agent.runtime.service.privacy_budget`): its noise multiplier σ, sampling rate q, clipping
bound C and DP steps.  A run without a reservation (``dfl-agent run --once``) plans itself
(:func:`dfl_agent.privacy.plan.plan_run`) on the data it trains on: σ (given, or the smallest
that keeps the whole run's spend within ``target_epsilon``), ``q = batch_size / N`` and
``rounds`` times the most DP steps one round of the algorithm takes
(:meth:`dfl_agent.algorithms.base.Algorithm.dp_steps_per_round`), and reserves it when it is a run of the
service.  The training configuration then carries the plan (``TrainConfig.dp``): every training step of the run is a DP-SGD step with that σ, C and
q, and the run never takes more steps than the plan (a resumed run: less those its round
records already count).  Each round record carries ``dp_steps``, the steps taken since the
record before: the privacy ledger settles the run with their sum.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dfl_agent.algorithms.base import check_dp_combination, dp_steps_per_round
from dfl_agent.learning.dp import DPSteps, require_opacus, training_for
from dfl_agent.learning.training import TrainConfig
from dfl_agent.privacy.config import merge_privacy, parse_privacy
from dfl_agent.privacy.plan import RunPlan, plan_run

log = logging.getLogger("dfl_agent.daemon")


def recorded_dp_steps(run_dir: Path | None) -> int:
    """The DP steps the round records of ``run_dir/metrics.jsonl`` count (0: none, no file)."""
    if run_dir is None:
        return 0
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    total = 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line
        v = rec.get("dp_steps") if isinstance(rec, dict) else None
        if isinstance(v, int) and not isinstance(v, bool):
            total += v
    return total


def with_privacy(cfg: Any, profile: Any, algorithm: str, options: Any, n_samples: int, train: TrainConfig,
                 run_dir: Path | None = None) -> TrainConfig:
    """``train`` with the run's DP plan (``train`` itself without ``privacy.dp``).

    Args:
        cfg: the node (or run) configuration: its ``[privacy]``, rounds and ``runtime``.
        profile: the device profile (its ``[privacy]``, under the node's).
        n_samples: N, the training samples the run trains on.
        run_dir: the run's directory (a resumed run's round records count its steps taken).

    Raises:
        StartupError: one line: a bad ``[privacy]``, an algorithm that cannot train under DP,
            an impossible plan (δ not below 1/N, an unreachable ε), ``baseline_local`` on, or
            Opacus not installed (naming the ``privacy`` extra).
    """
    from dfl_agent.runtime.shared.assembly import StartupError

    try:
        privacy = parse_privacy(merge_privacy(getattr(profile, "privacy", None), cfg.privacy), "privacy")
        if privacy.dp is None:
            return train
        check_dp_combination(algorithm, options)
        if cfg.runtime.baseline_local:
            raise ValueError("privacy.dp: runtime.baseline_local cannot run under DP (its local-only copy would "
                             "train on the same data outside the run's privacy plan)")
        require_opacus()
        from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger

        rounds = int(cfg.algorithm.rounds)
        ledger = PrivacyLedger(cfg.state_dir) if run_dir is not None else None
        row = ledger.get(Path(run_dir).name) if ledger is not None and run_dir is not None else None
        if row is not None:  # admitted: the plan reserved in the privacy ledger
            plan = RunPlan(noise_multiplier=float(row["noise_multiplier"]), sample_rate=float(row["sample_rate"]),
                           steps=int(row["planned_steps"]), epsilon=float(row["epsilon"]), delta=float(row["delta"]),
                           max_grad_norm=float(row["max_grad_norm"]))
            per_round = int(row["steps_per_round"])
        else:
            per_round = dp_steps_per_round(algorithm, options, n_samples=n_samples, batch_size=train.batch_size,
                                           epochs=train.epochs, steps=train.steps)
            plan = plan_run(privacy.dp, n_samples=n_samples, batch_size=train.batch_size, steps_per_round=per_round,
                            rounds=rounds)
            if ledger is not None and run_dir is not None:  # a run of the service: counted from now on
                ledger.reserve(Path(run_dir).name, plan, rounds)
        taken = recorded_dp_steps(run_dir)
        dp = dataclasses.replace(training_for(plan), counter=DPSteps(limit=max(0, plan.steps - taken)))
        log.info("differential privacy: noise multiplier %.4g, max_grad_norm %g, sampling rate %.4g, %d DP steps "
                 "(%d a round, %d taken before), epsilon %.4g at delta %g for the run%s", plan.noise_multiplier,
                 plan.max_grad_norm, plan.sample_rate, plan.steps, per_round, taken, plan.epsilon, plan.delta,
                 " (reserved at admission)" if row is not None else "")
        return dataclasses.replace(train, dp=dp)
    except (ValueError, ImportError) as exc:
        raise StartupError(str(exc)) from None


def dp_sink(sink: Callable[[dict[str, Any]], None], train: Any) -> Callable[[dict[str, Any]], None]:
    """``sink`` adding ``dp_steps`` to every round record under DP: the DP steps taken since
    the record before (their sum is the run's steps).  ``sink`` itself without DP."""
    dp = getattr(train, "dp", None)
    if dp is None:
        return sink
    last = [dp.counter.taken]

    def wrapped(record: dict[str, Any]) -> None:
        if "round" in record:
            now = dp.counter.taken
            record = {**record, "dp_steps": now - last[0]}
            last[0] = now
        sink(record)

    return wrapped
