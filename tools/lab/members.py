"""The field lab's inference members (``role = "inference"``): their row of the report.

An inference member is ``dfl-infer run --config`` in its own namespace and cgroup (its
class's limits), logged in with the credentials ``dflctl keys enroll`` made for it, over TLS,
with signatures required and mDNS on its lab address (:meth:`LabRun.make_member
<dfl_agent.cli.lab.runner.LabRun.make_member>`).  It trains nothing: its row says what it
received (``models.jsonl`` in its state folder, one line per model taken) and how the model
it holds does on HAR's held-out users; the sample and round keys are null.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def received(state: Path) -> list[dict[str, Any]]:
    """The models a member took, in order (its ``models.jsonl``); [] before the first."""
    try:
        text = (state / "models.jsonl").read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def heldout_accuracy(state: Path, test: Any) -> float | None:
    """Accuracy of the member's ``model.onnx`` on the held-out windows (None without a model
    or onnxruntime)."""
    model_file = state / "model.onnx"
    if test is None or not model_file.exists():
        return None
    try:
        from dfl_agent.onnx_model import OnnxModel

        pred = OnnxModel.from_file(model_file).predict(test.x.astype("float32"))["label"]
    except Exception:  # noqa: BLE001 - no onnxruntime or an unusable file: no figure
        return None
    return round(float((pred == test.y).mean()), 4)


def member_row(run: Any, d: Any, test: Any) -> dict[str, Any]:
    """The report's device row of inference member ``d``: the keys of a training device's row,
    with ``role = "inference"``, ``deployed_versions`` the versions it received, ``received``
    (version, run, source and when, in seconds since the agents started) and ``accuracy``
    (its model on the held-out users); samples and rounds are null."""
    m = run.members.get(d.id)
    cg = run.cgroups.get(d.id, {})
    got = received(m.state) if m else []
    wall_t0 = time.time() - (time.monotonic() - run.t0)  # when the agents started, wall clock
    return {
        "id": d.id, "class": d.cls.name, "role": "inference", "site": d.site, "address": run.lab_hosts[d.id],
        "start_s": d.start_s, "peak_rss_mb": round(m.peak_rss_mb, 1) if m else None,
        "cgroup_peak_mb": cg.get("peak_mb"), "memory_limit_mb": cg.get("limit_mb"),
        "oom_killed": bool(cg.get("oom_kills")), "oom_kills": cg.get("oom_kills", 0),
        "samples_fed": None, "samples_stored": None, "samples_evicted": None, "samples_rejected": None,
        "samples_lost": None,
        "deployed_versions": [g.get("version") for g in got],
        "current_version": got[-1].get("version") if got else None,
        "received": [{"version": g.get("version"), "run_id": g.get("run_id"), "source": g.get("source"),
                      "at_s": round(g["time"] - wall_t0, 1) if "time" in g else None} for g in got],
        "accuracy": heldout_accuracy(m.state, test) if m else None,
        "rounds_trained": None, "rounds_alone": None, "rounds_alone_at": [], "rounds_cut_off": None,
        "agent_starts": len(m.starts) if m else 0, "round_accuracy": [],
    }


def member_checks(checks: dict[str, Any], rep: dict[str, Any]) -> list[str]:
    """``inference_received = true``: every inference member received a model of each finished
    run that was deployed (its ``received`` names the run); the failures, one line each."""
    if not checks.get("inference_received"):
        return []
    deployed = [r["run_id"] for r in rep.get("runs", []) if r.get("run_id") and r.get("deployed_on")]
    failed = []
    for d in rep["devices"]:
        if d["role"] != "inference":
            continue
        got = {g.get("run_id") for g in d.get("received") or []}
        missing = [rid for rid in deployed if rid not in got]
        if not d.get("deployed_versions") or missing:
            failed.append(f"inference_received: {d['id']} received "
                          + (f"no model of run {', '.join(missing)}" if missing else "no model"))
    return failed
