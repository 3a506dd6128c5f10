"""The runtime's side of deployment: after a run, gate and install the model (pure files,
:mod:`dfl_agent.deploy`), then announce the deployed version on MQTT."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Sequence
from typing import Any

from dfl_agent.deploy.gate import announcement, deploy_model
from dfl_agent.deploy.versions import ModelStore
from dfl_agent.privacy.policy import dp_enabled
from dfl_agent.runtime.privacy_budget import deployment_privacy

log = logging.getLogger(__name__)


async def deploy_after_run(agent: Any, spec: dict[str, Any], input_shape: Sequence[int]) -> dict[str, Any]:
    """The daemon's after-run step: gate + deploy the deployable model on the run's validation
    slice (:func:`dfl_agent.deploy.gate.deploy_model`), then publish the retained
    ``dfl/{fed}/node/{id}/model`` announcement (:func:`dfl_agent.deploy.gate.announcement`).
    A run whose model an earlier, killed deployment already installed or staged
    (:meth:`~dfl_agent.deploy.versions.ModelStore.run_outcome`) is not deployed again.
    In a run process (``agent.host`` set) the version is installed without switching
    ``current`` and nothing is announced: the supervisor does both
    (:mod:`dfl_agent.runtime.supervisor`).

    Returns:
        :func:`~dfl_agent.deploy.gate.deploy_model`'s result.
    """
    cfg, ctx, node = agent.cfg, agent.ctx, agent.node
    models = ModelStore(agent.state_dir, keep=cfg.deploy.keep)
    run = getattr(agent, "run_desc", None)
    run_id = run.run_id if run is not None else agent.run_id
    supervised = agent.host is not None  # a run process: the supervisor switches, announces
    res = await asyncio.to_thread(models.run_outcome, run_id, not supervised) if run is not None else None
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
            onnx=None if getattr(cfg.deploy, "onnx", True) else False, switch=not supervised,
            started_from=(getattr(agent, "start", None) or {}).get("started_from"),  # its warm start
            privacy=deployment_privacy(cfg, agent.state_dir, run_id))  # the model's epsilon (the privacy ledger)
    if supervised:
        return res
    doc = announcement(models, agent.node_id, cfg.federation, getattr(ctx, "security", None), private=dp_enabled(cfg))
    publish = getattr(ctx.transport, "publish_retained", None)
    if doc is not None and publish is not None:
        try:
            await publish("model", doc)
        except Exception as exc:  # noqa: BLE001 - the files are the contract; MQTT is a convenience
            log.warning("could not publish the model announcement: %s", exc)
    return res
