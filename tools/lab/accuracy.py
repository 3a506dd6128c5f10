"""The held-out accuracy of every round's model, and the time a run takes to reach a target.

The lab's agents keep every round's checkpoint of a run (``runtime.checkpoint_keep``, an
option of the agent, set by the lab to the run's rounds and more); after the run the report
rebuilds each device's deployable model of round ``t`` from its checkpoint and measures it
on HAR's held-out test users, as it does for the deployed models. Nothing is measured on
the devices during the run, so their CPU quota goes to training alone. The round's time is
the one of the device's round record (``metrics.jsonl``); the checkpoints are pruned back
to the agent's default two afterwards.

Pure helpers (:func:`rounds_to_measure`, :func:`accuracy_curve`, :func:`time_to_accuracy`)
take and return the report's JSON lists: a device's series is ``[[t_s, round, acc], ...]``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dfl_agent.cli.lab.runner import LabRun

log = logging.getLogger(__name__)

#: the accuracy a run's time-to-accuracy is counted to (its devices' mean)
TARGET = 0.65
#: at most this many rounds of a run are measured (evenly spread, the first and last always)
MAX_ROUNDS = 60
#: checkpoints left in a run's folder after the measurement (the agent's default)
KEEP_AFTER = 2


def rounds_to_measure(rounds: Iterable[int], cap: int = MAX_ROUNDS) -> list[int]:
    """The rounds of a run to measure: all of them when at most ``cap``, else ``cap`` of
    them evenly spread over the sorted rounds, the first and the last included."""
    have = sorted(set(int(r) for r in rounds))
    if len(have) <= cap:
        return have
    if cap <= 1:
        return have[-1:]
    step = (len(have) - 1) / (cap - 1)
    return sorted({have[round(i * step)] for i in range(cap)})


def accuracy_curve(series: Mapping[str, Sequence[Sequence[float]]]) -> list[list[float]]:
    """The devices' mean accuracy per round: ``[[t_s, round, mean], ...]`` by round, from
    each device's ``[[t_s, round, acc], ...]``. A round's mean is over the devices that have
    a model of it; its time is the latest of theirs (when every one of them had it)."""
    per: dict[int, list[tuple[float, float]]] = {}
    for pts in series.values():
        for t, r, acc in pts:
            per.setdefault(int(r), []).append((float(t), float(acc)))
    return [[round(max(t for t, _ in v), 1), r, round(sum(a for _, a in v) / len(v), 4)]
            for r, v in sorted(per.items())]


def time_to_accuracy(curve: Sequence[Sequence[float]], since_s: float | None,
                     target: float = TARGET) -> dict[str, Any]:
    """When a run's mean accuracy (:func:`accuracy_curve`) first reached ``target``:
    ``{"target", "seconds" (from ``since_s``, the run's submission; None when never),
    "round" (None when never), "best" (the highest mean, None without a measurement)}``."""
    out: dict[str, Any] = {"target": target, "seconds": None, "round": None,
                           "best": max((float(p[2]) for p in curve), default=None)}
    for t, r, acc in curve:
        if acc >= target:
            out["round"] = int(r)
            out["seconds"] = round(float(t) - since_s, 1) if since_s is not None else None
            break
    return out


def _spec(run_dir: Path) -> dict[str, Any]:
    """The model spec the device trained in this run, by the agent's own rule
    (:func:`dfl_agent.runtime.shared.assembly.model_spec_for` on the run's ``run.toml``)."""
    from dfl_agent.runtime.shared.assembly import apply_profile, model_spec_for, resolve_algorithm
    from dfl_agent.runtime.shared.config import load_config

    cfg = load_config(run_dir / "run.toml")
    algo_cls, _ = resolve_algorithm(cfg)
    profile, behaviour = apply_profile(cfg, algo_cls.name)
    if cfg.data.input_shape is None or cfg.data.num_classes is None:
        raise ValueError("run.toml names no data shape (the lab's agents train on their sample store)")
    return model_spec_for(cfg, algo_cls.name, cfg.data.input_shape, cfg.data.num_classes,
                          profile_size=profile.model.size, tier=behaviour.model_size)


#: the attribute holding the deployable model, where it is not ``model``
_DEPLOYED_ATTR = {"dfml": "peak", "fedd2s": "personal"}


def _weights(tensors: Mapping[str, Any], keys: set[str], algorithm: str) -> dict[str, Any] | None:
    """The deployable model's tensors in a checkpoint's algorithm state (``{attr}.{key}``):
    the algorithm's deployable attribute, else the first attribute whose keys fit."""
    attrs = sorted({name.split(".", 1)[0] for name in tensors if "." in name})
    first = _DEPLOYED_ATTR.get(algorithm, "model")
    for attr in [first] + [a for a in attrs if a != first]:
        sub = {k[len(attr) + 1:]: v for k, v in tensors.items() if k.startswith(attr + ".")}
        if set(sub) == keys:
            return sub
    return None


def measure_run(run_dir: Path, times: Mapping[int, float], test: Any, *, cap: int = MAX_ROUNDS,
                keep_after: int | None = KEEP_AFTER) -> list[list[float]]:
    """The held-out accuracy of the device's model after each measured round of one run:
    ``[[time, round, acc], ...]`` (``time`` = the round record's, from ``times``; rounds
    without a record or a usable checkpoint are left out). With ``keep_after``, the run's
    checkpoints are pruned to that many afterwards."""
    import numpy as np
    import torch

    from dfl_agent.models import build_model, spec_hash
    from dfl_agent.runtime.node.checkpoint import CheckpointError, CheckpointStore

    store = CheckpointStore(run_dir / "checkpoints")
    have = [r for r in store.rounds() if r in times]
    if not have:
        return []
    try:
        spec = _spec(run_dir)
    except Exception as exc:  # noqa: BLE001 - an unreadable run.toml: no round figures, said why
        log.warning("%s: no round accuracy (%s)", run_dir, exc)
        return []
    torch.set_num_threads(1)
    model = build_model(spec).eval()
    keys = set(model.state_dict())
    x = torch.from_numpy(np.asarray(test.x, dtype=np.float32))
    y = np.asarray(test.y)
    out = []
    for r in rounds_to_measure(have, cap):
        try:
            ck = store.load(r)
        except CheckpointError:
            continue
        if ck.manifest.get("model_hash") not in (None, "", spec_hash(spec)):
            log.warning("%s: round %d's checkpoint is of another model; skipped", run_dir, r)
            continue
        w = _weights(ck.tensors, keys, str(ck.manifest.get("algorithm", "")))
        if w is None:
            continue
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in w.items()})
        with torch.no_grad():
            pred = np.concatenate([model(x[i:i + 1024]).argmax(1).numpy() for i in range(0, len(x), 1024)])
        out.append([float(times[r]), r, round(float((pred == y).mean()), 4)])
    if keep_after:
        store.keep = keep_after
        store.prune()
    return out


def measure_lab(run: LabRun, recs: Mapping[str, Mapping[str, list[dict[str, Any]]]], test: Any,
                cap: int = MAX_ROUNDS) -> dict[str, dict[str, list[list[float]]]]:
    """Every device's round accuracy per run: ``{device: {run_id: [[t_s, round, acc], ...]}}``
    with ``t_s`` in seconds since the lab's agents started (``run.t0``)."""
    out: dict[str, dict[str, list[list[float]]]] = {}
    try:
        import torch  # noqa: F401 - the lab's agents train with it; the report may lack it
    except ImportError:
        return out
    for n, a in run.agents.items():
        for rid, rs in recs.get(n, {}).items():
            times = {int(r["round"]): float(r["time"]) - run.t0 for r in rs
                     if isinstance(r.get("round"), int) and isinstance(r.get("time"), (int, float))
                     and not r.get("resumed")}
            series = measure_run(a.state / "runs" / rid, times, test, cap=cap)
            out.setdefault(n, {})[rid] = [[round(t, 1), r, acc] for t, r, acc in series]
    return out


def checkpoints_to_keep(rounds: Iterable[int]) -> int:
    """``runtime.checkpoint_keep`` for the lab's agents: every round of the longest run
    (and a spare), so that each round's model can be measured afterwards."""
    return max([KEEP_AFTER, *(int(r) + 2 for r in rounds)])
