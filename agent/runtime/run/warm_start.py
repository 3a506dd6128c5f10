"""Warm start: a run starts from the device's deployed model, so learning accumulates.

With ``init = "deployed"`` (the run descriptor's ``init``, else ``runtime.run_init``) a new
run loads ``models/current`` (:mod:`dfl_agent.deploy.versions`) into its algorithm's
model(s) after set-up and before round 1 (:meth:`~dfl_agent.algorithms.base.Algorithm.warm_start`:
which model each algorithm loads is stated on its page).  The deployed model must have the
run's architecture: the same ``state_dict`` names and shapes; otherwise, or when nothing is
deployed or it cannot be read, the run starts fresh and the INFO line says why.

What happened is the run's *start*: ``{"init", "started_from", "reason"}`` (``started_from``
the deployed version loaded, None when fresh), kept in ``RUN_DIR/start.json`` so that a
resumed or retried run, which restores its checkpoint instead, reports the same start.  It
goes into the first round record, the run's ledger entry and the deployed version's
manifest.

A run that started from a deployed model ramps its learning rates up over its first
``training.warm_start_ramp`` rounds (:func:`ramp_factor`; a gradual warm-up, Goyal et al.
2017, section 2.2): its first local steps, on data the deployed model may never have seen,
do not throw away what that model knew.  Round records show the factor as ``lr_scale``.

When the store holds a class the deployed model predicts for none of its windows (one it
never learnt), the run first fits the deployed model's output layer to the store on the
model's frozen features (``training.warm_start_probe``; :func:`probe_output_layer`, linear
probing then fine-tuning, Kumar et al. 2022), so that the new class costs the first round
less accuracy (``bench/warm_start/results/ramp.md``).  What the fit did is the start's
``probe`` and the first round record's ``linear_probe``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import atomic_write
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.learning.training import ramp_scale

log = logging.getLogger("dfl_agent.daemon")

START_FILE = "start.json"
#: why a warm start without the ramp does not fit the output layer
RAMPLESS = "training.warm_start_ramp = 0: the fit needs the ramp"


def ramp_factor(start: dict[str, Any], ramp_rounds: int, t: int) -> float:
    """Round ``t``'s factor on the learning rates (``TrainConfig.lr_scale``): in a run that
    started from a deployed model (``start["started_from"]`` set), ``RAMP_START`` in round 1
    rising linearly to 1 in round ``ramp_rounds + 1``; 1 otherwise (a fresh start, or
    ``ramp_rounds`` 0).  A round past the ramp, or a resumed run's round, gets the same
    factor as it would have had without the restart.
    """
    if start.get("started_from") is None:
        return 1.0
    return ramp_scale(ramp_rounds, t)


def deployed_state(state_dir: str | Path) -> tuple[int | None, dict[str, Any] | None, str]:
    """``(version, state, why)``: the current deployed version's number and weights
    (``model.safetensors``, name -> array), or ``(version or None, None, why not)``."""
    from dfl_agent.deploy.versions import DeployError, ModelStore, verify_folder

    models = ModelStore(state_dir)
    v = models.current_version()
    if v is None:
        return None, None, "no model is deployed on this device yet"
    try:
        verify_folder(models.folder(v))  # the SHA-256 of every file: never start from a corrupt version
    except (DeployError, OSError, ValueError) as exc:
        return v, None, f"the deployed model v{v} cannot be read ({exc})"
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return v, dict(load_file(str(models.folder(v) / "model.safetensors"))), ""
    except (SafetensorError, OSError, ValueError) as exc:  # as models.deployed reads a version
        return v, None, f"the deployed model v{v} cannot be read ({type(exc).__name__}: {exc})"


def probe_output_layer(algorithm: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Fit the output layer of ``algorithm``'s deployable model, just loaded from ``state``,
    to the device's training split (:func:`dfl_agent.learning.probe.linear_probe`) and load
    ``state`` with the fitted layer into every model the warm start loads
    (``algorithm.warm_start``).  Skipped under ``privacy.dp``: the fit would use the data
    outside DP-SGD's accountant.

    Returns:
        The probe's record (:attr:`dfl_agent.learning.probe.ProbeResult.record`):
        ``{"layer", "samples", "unlearned", "loss_before", "loss_after", "step"}``, or
        ``{"skipped": why}``.
    """
    from dfl_agent.learning.probe import linear_probe

    if algorithm.private():
        return {"skipped": "privacy.dp: the fit would use the data outside the privacy accountant"}
    data = algorithm.ctx.data
    try:
        result = linear_probe(algorithm.deployable_model(), data.train_x, data.train_y)
        if result.state and not set(result.state) <= set(state):
            return {"skipped": "the output layer is not among the deployed model's tensors"}
        if result.state:
            algorithm.warm_start({**state, **result.state})
    except Exception as exc:  # never fail a run over the fit: it starts from the deployed model as it is
        algorithm.warm_start(state)
        log.warning("warm start: the output layer was not fitted: %s: %s", type(exc).__name__, exc)
        return {"skipped": f"the fit failed: {type(exc).__name__}: {exc}"}
    if result.state:
        r = result.record
        log.info("warm start: fitted the output layer %s to %d windows of the store (cross-entropy %.3f -> %.3f)",
                 r["layer"], r["samples"], r["loss_before"], r["loss_after"])
    else:
        log.info("warm start: the output layer was not fitted: %s", result.record["skipped"])
    return result.record


def warm_start(algorithm: Any, state_dir: str | Path, init: str, probe: bool = True, ramp: int = 5) -> dict[str, Any]:
    """Load the deployed model into ``algorithm`` when ``init`` is ``"deployed"`` and it fits,
    then, with ``probe``, fit its output layer to the store (:func:`probe_output_layer`).
    The fit needs the learning-rate ramp (``ramp`` rounds, ``training.warm_start_ramp``):
    without it, full-rate steps from the fitted layer lost more of the first round than no
    fit at all (``bench/warm_start/results/ramp.md``), so with ``ramp`` 0 it is skipped.

    Returns:
        ``{"init": init, "started_from": version | None, "reason": str}`` (``reason`` says
        why a run with ``init = "deployed"`` starts fresh; empty otherwise), with ``probe``
        (the fit's record) after a warm start with ``probe``.
    """
    if init != "deployed":
        log.info("warm start: off (init = %s): the run starts from fresh weights", init)
        return {"init": init, "started_from": None, "reason": "init = fresh"}
    v, state, why = deployed_state(state_dir)
    if state is not None:
        try:
            what = algorithm.warm_start(state)
        except ValueError as exc:  # another architecture: nothing was loaded
            why = f"the deployed model v{v} has another architecture: {exc}"
        else:
            log.info("warm start: the run starts from the deployed model v%d (%s)", v, what)
            start: dict[str, Any] = {"init": init, "started_from": v, "reason": ""}
            if probe:
                start["probe"] = probe_output_layer(algorithm, state) if ramp > 0 else {"skipped": RAMPLESS}
            return start
    log.info("warm start: the run starts from fresh weights: %s", why)
    algorithm.join_cold()  # its neighbours started warm, maybe: it adopts their models first
    return {"init": init, "started_from": None, "reason": why}


def begin_run(algorithm: Any, state_dir: str | Path, run_dir: Path | None, init: str, resumed: bool,
              probe: bool = True, ramp: int = 5) -> dict[str, Any]:
    """The run's start: a new run (``resumed`` False) warm-starts (:func:`warm_start`, with
    ``probe`` and ``ramp``) and keeps it in ``run_dir/start.json`` (nothing without a run
    folder); a resumed one, restored from its checkpoint, reports the start it kept there."""
    path = None if run_dir is None else Path(run_dir) / START_FILE
    if not resumed:
        start = warm_start(algorithm, state_dir, init, probe, ramp)
        if path is not None:
            atomic_write(path, json.dumps(start, sort_keys=True))
        return start
    try:  # none recorded, or unreadable: unknown
        doc = bounded_loads(path.read_bytes(), "state") if path is not None else None
    except (OSError, ValueError):
        doc = None
    return doc if isinstance(doc, dict) and doc else {"init": init, "started_from": None,
                                                       "reason": "unknown: resumed from a checkpoint"}
