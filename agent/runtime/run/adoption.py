"""A member that missed its run's end adopts the run's model from a member that deployed it.

A device that lost power during a run and comes back after most of the run's members report it
finished (:meth:`~dfl_agent.runtime.run.rejoin.RunMembers._federation_finished`) trains no more
rounds of it.  Without a final checkpoint it has no model of the run; instead of keeping its
previous version in silence, it asks the members that finished the run, one at a time, for the
model they deployed (:mod:`dfl_agent.runtime.shared.model_handover`: a request in its status, the
member's service answers with the version's files, signed, to its inbox), checks the answer like
any update (signed by an enrolled device of the federation, the run asked for, the model's spec
its own, each file's SHA-256, bounded sizes, finite weights), evaluates the model on its own
validation slice and deploys it through the same deploy gate as its own models
(:func:`~dfl_agent.deploy.gate.deploy_model`; the manifest's ``adopted_from`` names the member and
its version).  A member that answers with a model of another run, a wrong hash or too large a file
is dropped and counted (``model_files_{reason}`` in the run's drops) and the next one is asked.

Members are asked in this order: those whose status says they deployed (or adopted) the run's
model, then the others that finished it, each in node order; a member whose last status is too
old (its service is down) is not asked.  :func:`adopt` returns what happened: ``adopted`` (a new
version, not yet current: the supervisor switches), ``kept`` (the gate kept the deployed model;
the adopted one is staged as the candidate), or ``missed`` with every member's answer.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from dfl_agent.runtime.shared.model_handover import MODEL_FILES_KIND, check_files, new_request

log = logging.getLogger("dfl_agent.daemon")

#: seconds to wait for a member's answer beyond the transfer time of the model at the link rate
ANSWER_BASE_S = 15.0
#: a member whose last status is older than this many heartbeat timeouts is not asked
STALE_HEARTBEATS = 3.0


@dataclasses.dataclass
class Adoption:
    """What :func:`adopt` did.

    Attributes:
        state: ``adopted``, ``kept`` (the gate kept the deployed model) or ``missed``.
        version: the version installed (``adopted``), else None.
        source: ``{"node", "version", "sha256", "round"}`` of the member's version (None: ``missed``).
        reason: the gate's note (``adopted``, ``kept``), or each member's answer (``missed``).
    """

    state: str
    version: int | None = None
    source: dict[str, Any] | None = None
    reason: str = ""


def candidates(statuses: Mapping[str, Mapping[str, Any]], members: set[str], run_id: str, *,
               max_age: float, now: float | None = None) -> tuple[list[str], dict[str, str]]:
    """The members to ask for ``run_id``'s model, in order, and those left out with why.

    ``statuses``: node id -> its status as :meth:`~dfl_agent.runtime.run.rejoin.RunMembers._run_statuses`
    gives it (``state`` of the run; ``model``: how it ended the run's model, from its run
    history).  Asked: the ``members`` whose status says the run is finished there, those that
    deployed or adopted its model first; not asked: a member whose status is older than
    ``max_age`` seconds, or says its gate kept the model it had."""
    now = time.time() if now is None else now
    first, then, left = [], [], {}
    for m in sorted(members):
        st = statuses.get(m)
        if not isinstance(st, Mapping) or st.get("state") != "finished":
            continue
        sent = st.get("time")
        age = now - float(sent) if isinstance(sent, (int, float)) and not isinstance(sent, bool) else float("inf")
        if age > max_age:
            left[m] = f"not asked: its last status is {age:.0f} s old" if age != float("inf") else \
                "not asked: its status has no time"
        elif st.get("model") == "kept":
            left[m] = "its deploy gate kept the model it had (its status)"
        elif st.get("model") in ("deployed", "adopted"):
            first.append(m)
        else:
            then.append(m)
    return first + then, left


def _answer_seconds(expected_bytes: int, bps: float | None) -> float:
    """How long to wait for one member's answer: :data:`ANSWER_BASE_S` plus three times the
    model's transfer time at the link rate (``bps``: bits/s; None: 8 MB/s)."""
    rate = (bps / 8.0) if bps else 8e6
    return ANSWER_BASE_S + 3.0 * expected_bytes / rate


def load_adopted(files: Mapping[str, bytes], model: Any, spec: Mapping[str, Any]) -> tuple[Any | None, str]:
    """``model`` (a copy of this node's deployable model) with the weights of ``files``
    (``model.safetensors`` and ``spec.json`` of a member's version), or ``(None, reason)`` when
    they are not a model of ``spec``: another spec, other tensor names, shapes or dtypes,
    non-finite weights, or unreadable files (``reason``: ``wrong_model: ...`` or
    ``malformed: ...``).  Nothing is unpickled: safetensors and bounded JSON only."""
    import numpy as np
    import torch
    from safetensors.numpy import load as st_load

    from dfl_agent.jsonbound import loads as bounded_loads
    from dfl_agent.models import spec_hash

    try:
        doc = bounded_loads(files["spec.json"], "manifest")
        theirs = doc.get("spec") if isinstance(doc, dict) else None
        if not isinstance(theirs, dict) or spec_hash(theirs) != spec_hash(spec):
            return None, "wrong_model: another model spec than this node's"
        arrays = st_load(files["model.safetensors"])
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any parse error drops the answer
        return None, f"malformed: {type(exc).__name__}: {str(exc)[:120]}"
    own = model.state_dict()
    if set(arrays) != set(own):
        return None, "wrong_model: other tensors than this node's model"
    state = {}
    for name, t in own.items():
        a = arrays[name]
        if tuple(a.shape) != tuple(t.shape) or str(a.dtype) != str(t.dtype).replace("torch.", ""):
            return None, f"wrong_model: {name} is {a.dtype}{list(a.shape)}, not {t.dtype}{list(t.shape)}"
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return None, f"wrong_model: {name} holds NaN or Inf"
        state[name] = torch.from_numpy(np.array(a, copy=True))
    model.load_state_dict(state)
    return model.eval(), ""


async def fetch(agent: Any, run_id: str, asked: list[str], *, max_bytes: int, wait_s: float,
                spec: Mapping[str, Any]) -> tuple[Any | None, dict[str, Any] | None, dict[str, str]]:
    """Ask the members ``asked`` in turn for ``run_id``'s model; returns ``(model, source,
    answers)``: the first good answer's model (loaded into a copy of the node's deployable
    model) and its source, else ``(None, None, answers)``; ``answers``: member -> why it gave
    none.  The request is the node's status field ``model_wanted``, published at once."""
    ctx, node, guard = agent.ctx, agent.node, agent.ctx.security
    loop = asyncio.get_running_loop()
    answers: dict[str, str] = {}
    base = copy.deepcopy(node.algorithm.deployable_model()).to("cpu")
    for member in asked:
        request = new_request(run_id, member, agent.cfg.algorithm.rounds)
        agent.want_model(request)
        await node.publish_status()
        log.info("asking %s for the model of run %s (waiting up to %.0f s)", member, run_id, wait_s)
        deadline = loop.time() + wait_s
        answers[member] = f"no answer within {wait_s:.0f} s"
        while True:
            msg = await ctx.receive(MODEL_FILES_KIND, sender=member, deadline=deadline)
            if msg is None:
                break
            if guard is not None and guard.require_signatures and guard.role_of(msg.sender) != "device":
                ctx.reject(msg, f"model_files_not_member: {msg.sender} is not an enrolled device")
                answers[member] = "its answer was not signed by an enrolled device"
                break
            files, why = check_files(msg, run_id, request["nonce"], max_bytes)
            if why.startswith("stale"):
                continue  # the answer to an earlier request of this node: the next one may follow
            if why:
                ctx.reject(msg, f"model_files_{why}")
                answers[member] = f"its answer was dropped ({why})"
                break
            if files is None:
                answers[member] = str(msg.meta.get("missing") or "it holds no model of the run")[:300]
                break
            model, why = await ctx.compute_ungated(load_adopted, files, copy.deepcopy(base), spec)
            if model is None:
                ctx.reject(msg, f"model_files_{why}")
                answers[member] = f"its answer was dropped ({why})"
                break
            meta = msg.meta
            source = {"node": member, "version": meta.get("version"), "sha256": meta.get("sha256"),
                      "round": meta.get("round")}
            agent.want_model(None)
            return model, source, answers
    agent.want_model(None)
    await node.publish_status()
    return None, None, answers


async def adopt(agent: Any, spec: dict[str, Any], input_shape: Any, *, bps: float | None = None,
                heartbeat_timeout: float = 30.0) -> Adoption:
    """The run's model for ``agent`` (a training :class:`~dfl_agent.runtime.run.agent.Agent` whose
    run's members finished it while it was away): from a member that deployed it, checked,
    evaluated on the node's validation slice and deployed through the deploy gate as a new
    version (not switched: the supervisor switches ``current``).  A version of the run installed
    before a restart is not installed again.  ``bps``: the link rate (bits/s, None: fast);
    ``heartbeat_timeout``: the peers' liveness timeout (s), which ages members' statuses.

    Returns:
        :class:`Adoption`.
    """
    from dfl_agent.deploy.gate import deploy_model
    from dfl_agent.deploy.versions import ModelStore
    from dfl_agent.models import param_count
    from dfl_agent.runtime.shared.privacy_ledger import deployment_privacy

    cfg, node = agent.cfg, agent.node
    run_id = agent.run_desc.run_id
    models = ModelStore(agent.state_dir, keep=cfg.deploy.keep)
    done = await asyncio.to_thread(models.run_outcome, run_id, False)
    if done is not None:  # a restart after a kill mid-adoption: never a second version
        if not done["deployed"]:
            return Adoption("kept", None, None, "kept by the deploy gate before a restart")
        src = models.manifest(done["version"]).get("adopted_from")
        return Adoption("adopted", done["version"], src if isinstance(src, dict) else None,
                        "installed before a restart")
    expected = 4 * param_count(spec) + (1 << 16)
    members = agent._members()
    asked, answers = candidates(agent._run_statuses(), members, run_id,
                                max_age=STALE_HEARTBEATS * max(heartbeat_timeout, 10.0))
    node.set_state("adopting")
    await node.publish_status()
    model, source, got = await fetch(agent, run_id, asked, max_bytes=2 * expected + (1 << 20),
                                     wait_s=_answer_seconds(expected, bps), spec=spec)
    answers.update(got)
    if model is None or source is None:
        why = "; ".join(f"{m}: {a}" for m, a in sorted(answers.items())) or "no member finished it"
        return Adoption("missed", reason=f"no member could provide the run's model ({why})")
    data = agent.ctx.data
    res = await asyncio.to_thread(
        deploy_model, models, model, spec, input_shape, data.class_names, data.val_x, data.val_y, run_id=run_id,
        round=int(source.get("round") or cfg.algorithm.rounds), algorithm=node.algorithm.name,
        tolerance=cfg.deploy.tolerance, min_validation=cfg.deploy.min_validation,
        onnx=None if cfg.deploy.onnx else False, switch=False,
        started_from=None, privacy=deployment_privacy(cfg, agent.state_dir, run_id), adopted_from=source)
    what = "adopted" if res["deployed"] else "kept"
    log.info("run %s: the model of %s (its v%s) %s: %s", run_id, source["node"], source.get("version"),
             f"adopted as v{res['version']}" if res["deployed"] else "kept out by the deploy gate", res["note"])
    return Adoption(what, res["version"], source, res["note"])
