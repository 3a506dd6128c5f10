"""The deploy gate and a version's files: evaluate the candidate against the deployed model,
write ``model.safetensors``, ``spec.json`` and ``model.onnx``, and the announcement document.

Pure files, no network: the runtime publishes the announcement
(:func:`dfl_agent.runtime.run.deployment.deploy_after_run`).  torch is imported inside the
functions; :mod:`dfl_agent.deploy.versions` is torch-free.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.deploy.versions import ModelStore
from dfl_agent.extras import extra_hint
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.onnx_model import onnx_available

log = logging.getLogger(__name__)
_onnx_warned = False


def model_files(model: Any, spec: dict[str, Any], input_shape: Sequence[int], class_names: Sequence[str],
                check_x: np.ndarray | None = None, onnx: bool | None = None) -> dict[str, bytes]:
    """The files of a version: ``model.safetensors`` (the state dict), ``spec.json`` and,
    with the onnx extra, ``model.onnx`` checked against torch on ``check_x`` (atol 1e-4).
    ``onnx``: None = when the extra is installed, False = never (safetensors + spec only).

    Raises:
        dfl_agent.models.onnx_export.OnnxExportError: export failed or disagrees with torch.
    """
    global _onnx_warned
    from safetensors.numpy import save as st_save

    m = copy.deepcopy(model).to("cpu").eval()
    tensors = {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in m.state_dict().items()}
    meta = {"spec": spec, "input_shape": [int(s) for s in input_shape], "num_classes": int(spec["num_classes"]),
            "class_names": list(class_names), "input_name": "x", "output_name": "logits",
            "input_dtype": "float32"}
    files = {"model.safetensors": st_save(tensors), "spec.json": json.dumps(meta, indent=1, sort_keys=True).encode()}
    if onnx is not False and onnx_available():
        from dfl_agent.models.onnx_export import export_checked

        x = check_x if check_x is not None and len(check_x) else np.random.default_rng(0).normal(
            size=(8, *input_shape)).astype(np.float32)
        files["model.onnx"] = export_checked(m, input_shape, np.ascontiguousarray(x[:64], dtype=np.float32),
                                             spec=spec, atol=1e-4)
    elif onnx is None and not _onnx_warned:
        _onnx_warned = True
        log.warning("deploying without model.onnx: the onnx extra is not installed (%s); "
                    "model.safetensors and spec.json only", extra_hint("onnx"))
    return files


def load_torch(folder: str | Path) -> Any:
    """The torch model of a version (or candidate) folder: spec.json + model.safetensors."""
    import torch
    from safetensors.numpy import load_file

    from dfl_agent.models import build_model

    f = Path(folder)
    meta = bounded_loads((f / "spec.json").read_bytes(), "manifest")
    model = build_model(meta["spec"])
    state = {k: torch.from_numpy(v.copy()) for k, v in load_file(str(f / "model.safetensors")).items()}
    model.load_state_dict(state)
    return model.eval()


def deploy_model(models: ModelStore, model: Any, spec: dict[str, Any], input_shape: Sequence[int],
                 class_names: Sequence[str], val_x: np.ndarray, val_y: np.ndarray, *, run_id: str,
                 round: int, algorithm: str, tolerance: float = 0.01, min_validation: int = 20,
                 force: bool = False, onnx: bool | None = None, switch: bool = True,
                 started_from: int | None = None, privacy: dict[str, Any] | None = None,
                 adopted_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """The deploy gate, then install or stage.

    Evaluates ``model`` and the deployed model on today's validation slice ``(val_x, val_y)``.
    Deploys unless the candidate is worse than the deployed model by more than
    ``tolerance`` (accuracy fraction).  With fewer than ``min_validation`` validation
    samples it deploys only when ``force`` or when nothing is deployed yet (the
    manifest's ``note`` says so).  A refused candidate goes to ``models/candidate``.
    ``switch=False`` installs the version without switching ``current`` to it
    (:meth:`~dfl_agent.deploy.versions.ModelStore.install`; a run process's supervisor switches).
    ``started_from``: the version the run started from (its warm start; None: fresh weights),
    recorded in the manifest.  ``privacy``: the model's differential privacy (the ε of the run that
    trained it and the device's lifetime ε at deployment, with δ), recorded in the manifest; None
    without DP.  ``adopted_from``: for a model another member of the run deployed and this node
    adopted (it missed the run's end), ``{"node", "version", "sha256", "round"}`` of that member's
    version, recorded in the manifest.

    Returns:
        ``{"deployed": bool, "version": int|None, "accuracy": float, "deployed_accuracy":
        float|None, "note": str}``.
    """
    from dfl_agent.learning.training import evaluate

    acc = float(evaluate(copy.deepcopy(model).to("cpu"), val_x, val_y)["accuracy"]) if len(val_y) else float("nan")
    cur = models.current_version()
    dep_acc = None
    if cur is not None and len(val_y):
        try:
            dep_acc = float(evaluate(load_torch(models.folder(cur)), val_x, val_y)["accuracy"])
        except Exception as exc:  # noqa: BLE001 - another model shape/spec: it cannot compete
            log.warning("the deployed model v%d cannot be evaluated on today's data (%s)", cur, exc)
    n = len(val_y)
    if n < min_validation:
        ok = force or cur is None
        note = (f"only {n} validation samples (< {min_validation}): "
                + ("deployed with --force" if force else "deployed because no model was deployed yet" if ok
                   else "not deployed (use dflctl model deploy --force)"))
    elif force or cur is None or dep_acc is None:
        ok, note = True, "deployed with --force" if force else "no comparable deployed model"
    else:
        ok = not (acc < dep_acc - tolerance)
        note = (f"validation accuracy {acc:.4f} vs deployed v{cur} {dep_acc:.4f} on the same {n} samples "
                f"(tolerance {tolerance:g})")
    info = {"run_id": run_id, "round": int(round), "algorithm": algorithm,
            "accuracy": None if math.isnan(acc) else acc, "validation_samples": n,
            "deployed_accuracy": dep_acc, "forced": bool(force), "note": note, "time": time.time(),
            "started_from": started_from, "privacy": privacy,
            **({"adopted_from": dict(adopted_from)} if adopted_from is not None else {})}
    files = model_files(model, spec, input_shape, class_names, val_x, onnx=onnx)
    if ok:
        version = models.install(files, info, switch=switch)
        log.info("deployed model v%d (run %s, round %d): %s", version, run_id, round, note)
    else:
        models.stage_candidate(files, info)
        version = None
        log.warning("model of run %s not deployed: %s", run_id, note)
    return {"deployed": ok, "version": version, "accuracy": acc, "deployed_accuracy": dep_acc, "note": note}


def announcement(models: ModelStore, node_id: str, federation: str, guard: Any = None,
                 private: bool = False) -> dict[str, Any] | None:
    """The retained ``dfl/{fed}/node/{id}/model`` document of the current version, signed
    (``sig`` over the canonical JSON of the other fields) when ``guard`` holds a key.
    ``private`` (the node trains under differential privacy), or a version trained under DP (its
    manifest's ``privacy``): ``accuracy`` is None, the validation accuracy stays on the device
    (:mod:`dfl_agent.privacy.policy`)."""
    v = models.current_version()
    if v is None:
        return None
    m = models.manifest(v)
    doc = {"node_id": node_id, "federation": federation, "version": v, "run_id": m.get("run_id"),
           "round": m.get("round"), "accuracy": None if private or m.get("privacy") else m.get("accuracy"),
           "sha256": m.get("sha256"),
           "onnx": m.get("onnx"), "time": m.get("time")}
    if guard is not None and getattr(guard, "key", None) is not None:
        from dfl_agent.security.keys import canonical

        doc["sig"] = guard.sign(canonical(doc))
    return doc

