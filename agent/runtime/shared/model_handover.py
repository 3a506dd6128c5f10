"""The hand-over of a run's deployed model to a member that missed the run's end.

A device that lost power during a run and comes back after its members finished it has no
final model of that run.  Its run process asks the members, one at a time, for the model they
deployed of that run, and adopts it through its own deploy gate
(:mod:`dfl_agent.runtime.run.adoption`).  The request is a field of its status, the answer a
wire frame to its inbox:

* **request**: the node's status (signed by its service, retained, verified by every peer's
  service like every status) carries ``model_wanted``: ``{"run_id", "from", "nonce",
  "round"}``: the run, the member asked now, a fresh random ``nonce`` per request, and the
  run's last round (the answer's round);
* **answer**: the asked member's service (:mod:`dfl_agent.runtime.service.model_handover`) sends
  one :data:`MODEL_FILES_KIND` frame (signed with the member's key, chunked) to the
  requester's inbox: tensors ``{"safetensors": uint8 (n,), "spec": uint8 (m,)}`` (the bytes of
  the version's ``model.safetensors`` and ``spec.json``), meta ``{"run_id", "nonce",
  "version", "round", "algorithm", "sha256", "files": {name: sha256}}`` (``sha256``: the
  version's, as its manifest and model announcement say); or, when it holds no version of
  that run, no tensors and meta ``{"run_id", "nonce", "missing": reason}``.

Both sides use this module: :func:`files_message` builds the answer from a version folder
(torch-free, on the service), :func:`check_files` checks a received one (on the run process):
the run and the nonce asked for, exactly the two files, each within the size bound and
matching the SHA-256 the answer names.  Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from dfl_agent.algorithms.context import Message

#: the wire kind of an answer (the version's files, or why there are none)
MODEL_FILES_KIND = "model.files"
#: the status field of a request
WANTED_FIELD = "model_wanted"
#: a version's files that travel (file name -> tensor name on the wire)
TENSORS = {"model.safetensors": "safetensors", "spec.json": "spec"}
#: the largest ``spec.json`` taken (bytes)
MAX_SPEC_BYTES = 1 << 16
#: why a received answer is dropped (each counted in the run's ``dropped`` as ``model_files_{reason}``)
DROP_REASONS = ("wrong_run", "stale", "malformed", "too_large", "bad_hash", "wrong_model", "not_member")


def new_request(run_id: str, member: str, last_round: int) -> dict[str, Any]:
    """The ``model_wanted`` status field asking ``member`` for the model of ``run_id``
    (``last_round``: the run's rounds), with a fresh nonce."""
    return {"run_id": run_id, "from": member, "nonce": secrets.token_hex(8), "round": int(last_round)}


def asked(status: Mapping[str, Any], node_id: str) -> dict[str, Any] | None:
    """The request in a peer's ``status`` that asks ``node_id``, or None (none, another
    member asked, or malformed: statuses are untrusted JSON)."""
    want = status.get(WANTED_FIELD)
    if not isinstance(want, Mapping) or want.get("from") != node_id:
        return None
    rid, nonce, rnd = want.get("run_id"), want.get("nonce"), want.get("round", 0)
    if not (isinstance(rid, str) and 0 < len(rid) <= 128 and isinstance(nonce, str) and 0 < len(nonce) <= 64):
        return None
    if isinstance(rnd, bool) or not isinstance(rnd, int) or not 0 <= rnd < 1 << 31:
        return None
    return {"run_id": rid, "nonce": nonce, "round": rnd}


def version_of_run(models: Any, run_id: str) -> int | None:
    """The newest version of ``models`` (a :class:`~dfl_agent.deploy.versions.ModelStore`) whose
    manifest names ``run_id``, or None."""
    from dfl_agent.deploy.versions import DeployError

    found = None
    for v in models.versions():
        with contextlib.suppress(DeployError):  # an unreadable manifest: not that run's
            if models.manifest(v).get("run_id") == run_id:
                found = v
    return found


def files_message(models: Any, run_id: str, nonce: str, last_round: int, *, max_bytes: int,
                  why_none: str) -> Message:
    """The answer to a request for ``run_id``'s model: the files of the newest version of
    ``models`` that holds it (its hashes checked against its manifest), or a message saying why
    there is none (``why_none`` when no version holds it).  ``max_bytes``: the largest answer
    sent (the files together); a version over it is answered ``missing``."""
    from dfl_agent.deploy.versions import DeployError, verify_folder

    meta: dict[str, Any] = {"run_id": run_id, "nonce": nonce}
    v = version_of_run(models, run_id) if models is not None else None
    if v is None:
        return Message(MODEL_FILES_KIND, last_round, {}, {**meta, "missing": why_none})
    folder = models.folder(v)
    try:
        manifest = verify_folder(folder)
        files = {name: (folder / name).read_bytes() for name in TENSORS}
    except (DeployError, OSError) as exc:
        return Message(MODEL_FILES_KIND, last_round, {}, {**meta, "missing": f"its version v{v} is unreadable: {exc}"})
    size = sum(len(b) for b in files.values())
    if size > max_bytes:
        return Message(MODEL_FILES_KIND, last_round, {}, {**meta, "missing": f"its version v{v} is {size} bytes, "
                                                                             f"more than {max_bytes}"})
    meta.update(version=v, round=int(manifest.get("round") or 0), algorithm=manifest.get("algorithm"),
                sha256=manifest.get("sha256"), files={n: hashlib.sha256(b).hexdigest() for n, b in files.items()})
    return Message(MODEL_FILES_KIND, last_round, {TENSORS[n]: np.frombuffer(b, np.uint8) for n, b in files.items()},
                   meta)


def check_files(msg: Message, run_id: str, nonce: str, max_bytes: int) -> tuple[dict[str, bytes] | None, str]:
    """Check a received :data:`MODEL_FILES_KIND` answer to the request ``(run_id, nonce)``.

    Returns:
        ``(files, "")``: the version's files (file name -> bytes), each within ``max_bytes``
        and matching the SHA-256 the answer names; ``(None, reason)`` for an answer to drop
        (``reason``: one of :data:`DROP_REASONS`, then ``": "`` and the detail); ``(None, "")``
        for an answer that says the member holds no such model (``msg.meta["missing"]``).
    """
    meta = msg.meta if isinstance(msg.meta, dict) else {}
    if meta.get("run_id") != run_id:
        return None, f"wrong_run: a model of run {str(meta.get('run_id'))[:80]!r}, not {run_id}"
    if meta.get("nonce") != nonce:
        return None, "stale: the answer to an earlier request"
    if "missing" in meta and not msg.tensors:
        return None, ""
    if set(msg.tensors) != set(TENSORS.values()):
        return None, f"malformed: tensors {sorted(msg.tensors)[:4]}"
    digests = meta.get("files")
    if not isinstance(digests, dict):
        return None, "malformed: no file hashes"
    files: dict[str, bytes] = {}
    for name, tensor in TENSORS.items():
        a = msg.tensors[tensor]
        if a.dtype != np.uint8 or a.ndim != 1:
            return None, f"malformed: {tensor} is not bytes"
        limit = MAX_SPEC_BYTES if name == "spec.json" else max_bytes
        if a.nbytes > limit:
            return None, f"too_large: {name} of {a.nbytes} bytes (at most {limit})"
        data = a.tobytes()
        if hashlib.sha256(data).hexdigest() != digests.get(name):
            return None, f"bad_hash: {name} does not match its SHA-256"
        files[name] = data
    return files, ""
