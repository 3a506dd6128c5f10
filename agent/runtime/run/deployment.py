"""The runtime's side of deployment: after a run, gate and install the model (pure files,
:mod:`dfl_agent.deploy`), then announce the deployed version on MQTT."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Sequence
from typing import Any

from dfl_agent.deploy.gate import deploy_model
from dfl_agent.deploy.versions import ModelStore
from dfl_agent.runtime.shared.privacy_ledger import deployment_privacy

log = logging.getLogger(__name__)


async def deploy_after_run(agent: Any, spec: dict[str, Any], input_shape: Sequence[int]) -> dict[str, Any]:
    """The run's after-run step: gate the deployable model on the run's validation slice and,
    when it passes, install it as a new version (:func:`dfl_agent.deploy.gate.deploy_model`)
    without switching ``current``: the supervisor switches ``current`` to it and announces it
    once the run ledger recorded ``deployed`` (:mod:`dfl_agent.runtime.service.supervisor`).  A run
    whose model an earlier, killed deployment already installed or staged
    (:meth:`~dfl_agent.deploy.versions.ModelStore.run_outcome`) is not deployed again.

    Returns:
        :func:`~dfl_agent.deploy.gate.deploy_model`'s result.
    """
    cfg, ctx, node = agent.cfg, agent.ctx, agent.node
    models = ModelStore(agent.state_dir, keep=cfg.deploy.keep)
    run = getattr(agent, "run_desc", None)
    run_id = run.run_id if run is not None else agent.run_id
    res = await asyncio.to_thread(models.run_outcome, run_id, False) if run is not None else None
    if res is not None:  # a restart after a kill mid-deployment: never a second version
        what = f"deployed as v{res['version']}" if res["deployed"] else "kept out by the gate (candidate staged)"
        log.info("the model of run %s was already %s before the restart", run_id, what)
        res.update(accuracy=None, deployed_accuracy=None, note=f"{what} before a restart")
    else:
        data = ctx.data
        model = copy.deepcopy(node.algorithm.deployable_model()).to("cpu")
        last_round = max((int(r.get("round", 0)) for r in node.history), default=0)
        res = await asyncio.to_thread(
            deploy_model, models, model, spec, input_shape, data.class_names, data.val_x, data.val_y,
            run_id=run_id,
            round=last_round, algorithm=node.algorithm.name,
            tolerance=cfg.deploy.tolerance, min_validation=cfg.deploy.min_validation,
            onnx=None if cfg.deploy.onnx else False, switch=False,
            started_from=(getattr(agent, "start", None) or {}).get("started_from"),  # its warm start
            privacy=deployment_privacy(cfg, agent.state_dir, run_id))  # the model's epsilon (the privacy ledger)
    return res
