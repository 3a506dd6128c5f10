"""Crash-safe checkpoints of a node's state, written after every round.

A checkpoint of round ``t`` is two files in the checkpoint folder
(``{state_dir}/checkpoints``):

- ``round-{t:08d}.safetensors``: every tensor — the algorithm's models (DFML: regular
  and peak), optimizer state, Hessian accumulators (DecHW), the context's persistent
  state (e.g. error-feedback residuals, see :data:`PERSISTENT_PREFIX`) and torch's
  RNG state.  Safetensors only: nothing is ever unpickled on load.
- ``round-{t:08d}.json``: the manifest — format, round, node, algorithm, model hash,
  the algorithm's JSON state (α schedule and token, rotation state, ...), the numpy
  RNG state, the peer directory, the SHA-256 of the tensors file, a digest of the
  restored state, and the node's round records not yet written to its metrics file
  (``pending_records``: a kill between the checkpoint and the record loses no record).

Writing is atomic: each file is written to a temporary name, ``fsync``-ed, renamed
into place, and the folder is ``fsync``-ed; the manifest goes last and is the commit
record (a manifest names the hash of its tensors file, so a torn pair is detected).
The newest ``keep`` checkpoints are kept (default 2: the current and the previous).
:meth:`CheckpointStore.load_latest` tries them newest first and falls back to an older
one, with a warning, when a manifest or tensors file is missing, truncated, corrupt or
does not fit; a SIGKILL at any moment therefore never leaves an unreadable state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.fsutil import atomic_write
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.shared.sample_store import SNAPSHOT_KEY

if TYPE_CHECKING:
    from dfl_agent.algorithms.base import Algorithm
    from dfl_agent.runtime.node.context import RuntimeContext

log = logging.getLogger(__name__)

FORMAT = "dfl-checkpoint/1"
#: tensor-name prefix of the algorithm's state in the tensors file
ALGORITHM_PREFIX = "algorithm/"
#: tensor-name prefix of ``ctx.persistent_state`` (error-feedback residuals, ...)
PERSISTENT_PREFIX = "context/"
TORCH_RNG = "runtime/torch_rng"
_NAME = re.compile(r"^round-(\d{8})\.json$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, corrupt, partial, or of another node)."""


@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        round: the last completed round ``t`` (resume at ``t + 1``).
        tensors: the algorithm's tensors (prefix stripped), name -> array.
        persistent: the context's persistent tensors (prefix stripped).
        manifest: the JSON manifest (``meta`` = the algorithm's JSON state).
        path: the manifest's path.
    """

    round: int
    tensors: dict[str, np.ndarray]
    persistent: dict[str, np.ndarray]
    manifest: dict[str, Any]
    path: Path

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})


def state_digest(tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> str:
    """SHA-256 (hex) over the names, dtypes, shapes and bytes of ``tensors`` (sorted by
    name) and the canonical JSON of ``meta``: equal digests = bit-identical state."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()


class CheckpointStore:
    """The checkpoint folder of one node.

    Args:
        folder: where checkpoints live (created on first save).
        keep: how many of the newest checkpoints to keep (>= 2 keeps a fallback).
    """

    def __init__(self, folder: str | os.PathLike[str], keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.keep = keep

    def rounds(self) -> list[int]:
        """Rounds that have a manifest, newest first (validity not checked)."""
        if not self.folder.is_dir():
            return []
        out = [int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME.match(p.name))]
        return sorted(out, reverse=True)

    def _paths(self, t: int) -> tuple[Path, Path]:
        return self.folder / f"round-{t:08d}.json", self.folder / f"round-{t:08d}.safetensors"

    def save(
        self,
        t: int,
        tensors: Mapping[str, np.ndarray],
        meta: Mapping[str, Any],
        *,
        persistent: Mapping[str, np.ndarray] | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of round ``t`` atomically and prune old ones.

        Args:
            t: the last completed round (>= 0).
            tensors: the algorithm's tensors (:meth:`Algorithm.state_dict`).
            meta: the algorithm's JSON state.
            persistent: the context's persistent tensors (error-feedback residuals ...).
            info: further manifest fields (node id, algorithm, model hash, RNG state,
                peer directory ...), JSON-serialisable.

        Returns the manifest path.  Raises:
            OSError: writing failed (the previous checkpoints are untouched).
            TypeError, ValueError: state that is not JSON-serialisable / not an array.
        """
        from safetensors.numpy import save as st_save

        self.folder.mkdir(parents=True, exist_ok=True)
        manifest_path, tensors_path = self._paths(t)
        flat = {ALGORITHM_PREFIX + k: np.ascontiguousarray(v) for k, v in tensors.items()}
        flat.update({PERSISTENT_PREFIX + k: np.ascontiguousarray(v) for k, v in (persistent or {}).items()})
        blob = st_save(flat) if flat else st_save({"runtime/empty": np.zeros(0, np.uint8)})
        manifest = {
            **dict(info or {}),
            "format": FORMAT,
            "round": int(t),
            "written": time.time(),
            "meta": dict(meta),
            "tensors_file": tensors_path.name,
            "tensors_sha256": hashlib.sha256(blob).hexdigest(),
            "tensors_bytes": len(blob),
            "state_digest": state_digest(tensors, meta),
        }
        text = json.dumps(manifest, sort_keys=True, allow_nan=False).encode()
        atomic_write(tensors_path, blob, 0o600)  # readable by the owner only
        atomic_write(manifest_path, text, 0o600)
        self.prune()
        return manifest_path

    def prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints, and stray temporary files."""
        for t in self.rounds()[self.keep:]:
            for p in self._paths(t):
                p.unlink(missing_ok=True)
        keep = set(self.rounds()[: self.keep])
        for p in self.folder.iterdir():
            m = re.match(r"^round-(\d{8})\.safetensors$", p.name)
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)
            elif m and int(m.group(1)) not in keep and int(m.group(1)) < max(keep, default=0):
                p.unlink(missing_ok=True)  # tensors of a checkpoint whose manifest never landed

    def load(self, t: int) -> Checkpoint:
        """Load and verify the checkpoint of round ``t``.

        Raises:
            CheckpointError: missing file, bad JSON, wrong format, hash mismatch,
                unreadable tensors (the message says which).
        """
        from safetensors.numpy import load as st_load

        manifest_path, tensors_path = self._paths(t)
        try:
            manifest = bounded_loads(manifest_path.read_bytes(), "state")
        except (OSError, ValueError) as exc:  # JSONBoundError included: oversized, too_deep, malformed
            raise CheckpointError(f"{manifest_path.name}: unreadable manifest ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path.name}: not a {FORMAT} manifest")
        if manifest.get("round") != t or not isinstance(manifest.get("meta"), dict):
            raise CheckpointError(f"{manifest_path.name}: inconsistent manifest")
        try:
            blob = tensors_path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{tensors_path.name}: {exc.strerror}") from None
        if hashlib.sha256(blob).hexdigest() != manifest.get("tensors_sha256"):
            raise CheckpointError(f"{tensors_path.name}: hash mismatch (partial or corrupt write)")
        try:
            flat = st_load(blob)
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{tensors_path.name}: unreadable tensors ({exc})") from None
        algo = {k[len(ALGORITHM_PREFIX):]: v for k, v in flat.items() if k.startswith(ALGORITHM_PREFIX)}
        pers = {k[len(PERSISTENT_PREFIX):]: v for k, v in flat.items() if k.startswith(PERSISTENT_PREFIX)}
        return Checkpoint(t, algo, pers, manifest, manifest_path)

    def candidates(self) -> Iterable[Checkpoint]:
        """Valid checkpoints, newest first; logs a warning for each unusable one."""
        for t in self.rounds():
            try:
                yield self.load(t)
            except CheckpointError as exc:
                log.warning("checkpoint of round %d is unusable, falling back to an older one: %s", t, exc)

    def load_latest(self) -> Checkpoint | None:
        """The newest valid checkpoint, or None (warnings for skipped ones)."""
        return next(iter(self.candidates()), None)


# -- wiring to a node --------------------------------------------------------------------

def _peer_directory(peers: Any) -> list[dict[str, Any]]:
    keys = ("node_id", "broker", "profile", "algorithm", "model_hash", "version", "address")
    return [{k: getattr(info, k, "") for k in keys} for info in getattr(peers, "all", list)()]


def _restore_peers(peers: Any, directory: Any) -> None:
    """Put the saved directory entries (peer -> broker, descriptor) back, as not live:
    liveness comes from discovery again; known entries (static peers) win."""
    if not isinstance(directory, list) or not hasattr(peers, "upsert"):
        return
    for entry in directory:
        if not isinstance(entry, dict) or not isinstance(entry.get("node_id"), str):
            continue
        nid = entry["node_id"]
        if peers.get(nid) is not None:
            continue
        fields = {k: v for k, v in entry.items() if k != "node_id" and isinstance(v, str) and v}
        if peers.upsert(nid, "static", **fields) is not None:
            peers.withdraw(nid, "static")


def _pending_records(value: object) -> list[dict[str, Any]]:
    """The ``pending_records`` of a manifest (a JSON list of records), [] when absent or bad."""
    if not isinstance(value, str):
        return []
    try:
        records = bounded_loads(value, "state")
    except ValueError:  # JSONBoundError included
        log.warning("checkpoint: unreadable pending_records; ignored")
        return []
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("round"), int)] \
        if isinstance(records, list) else []


class NodeCheckpointer:
    """Saves and restores one node's algorithm + context state in a :class:`CheckpointStore`.

    Args:
        store: the node's checkpoint folder.
        algorithm: the node's :class:`~dfl_agent.algorithms.base.Algorithm` (after ``setup``).
        ctx: its context; reads ``node_id``, ``federation``, ``rng`` (numpy Generator),
            ``peers`` (the directory) and ``persistent_state`` (a dict of numpy arrays
            that other runtime components — error-feedback compression — keep across
            restarts; absent = nothing).
        model_hash: the node's model-spec hash; a checkpoint of another model is skipped.
        pending: returns the node's round records not yet written
            (:meth:`dfl_agent.runtime.node.node.Node.pending_records`), saved in the manifest
            and read back by :meth:`restore` into :attr:`restored_pending`.
    """

    def __init__(self, store: CheckpointStore, algorithm: Algorithm, ctx: RuntimeContext, model_hash: str = "",
                 pending: Callable[[], list[dict[str, Any]]] | None = None):
        self.store, self.algorithm, self.ctx, self.model_hash = store, algorithm, ctx, model_hash
        self.pending = pending
        self.last_saved = 0
        self.restored_digest: str | None = None
        #: the records not yet written when the restored checkpoint was saved
        self.restored_pending: list[dict[str, Any]] = []

    def snapshot(self, t: int) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
        """Copy the state of round ``t`` (call on the event loop, between rounds)."""
        import torch

        tensors, meta = self.algorithm.state_dict()
        persistent = {k: np.array(v, copy=True) for k, v in dict(getattr(self.ctx, "persistent_state", {}) or {}).items()}
        persistent[TORCH_RNG.split("/", 1)[1]] = torch.get_rng_state().numpy().copy()
        rng = getattr(self.ctx, "rng", None)
        info = {
            "node_id": getattr(self.ctx, "node_id", ""),
            "federation": getattr(self.ctx, "federation", ""),
            "algorithm": getattr(self.algorithm, "name", ""),
            "model_hash": self.model_hash,
            "numpy_rng": rng.bit_generator.state if rng is not None else None,
            "peers": _peer_directory(getattr(self.ctx, "peers", None)),
        }
        if self.pending is not None:
            # a JSON string: a record may hold a NaN (a diverged loss), which the manifest refuses
            info["pending_records"] = json.dumps(self.pending(), sort_keys=True, default=float)
        return tensors, meta, persistent, info

    async def save_async(self, t: int) -> None:
        """Snapshot on the loop, write in a worker thread (the loop keeps serving; inline
        when the context computes inline, as in the simulator)."""
        import asyncio

        tensors, meta, persistent, info = self.snapshot(t)
        if getattr(self.ctx, "compute_in_thread", True):
            await asyncio.to_thread(self.store.save, t, tensors, meta, persistent=persistent, info=info)
        else:  # the simulator's virtual clock: no threads
            self.store.save(t, tensors, meta, persistent=persistent, info=info)
        self.last_saved = t

    def restore(self) -> int:
        """Load the newest usable checkpoint into the algorithm and context.

        Returns the restored round (0 = none: start from scratch).  Checkpoints of
        another node, algorithm or model, or that the algorithm rejects, are skipped
        with a warning (an older one is tried).
        """
        import torch

        for ck in self.store.candidates():
            m = ck.manifest
            mine = (getattr(self.ctx, "node_id", ""), getattr(self.algorithm, "name", ""), self.model_hash)
            theirs = (m.get("node_id", ""), m.get("algorithm", ""), m.get("model_hash", ""))
            if any(a and b and a != b for a, b in zip(mine, theirs)):
                log.warning("checkpoint of round %d belongs to node/algorithm/model %s, not %s; skipped",
                            ck.round, theirs, mine)
                continue
            try:
                self.algorithm.load_state_dict(ck.tensors, ck.meta)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("checkpoint of round %d does not fit this node (%s); trying an older one", ck.round, exc)
                continue
            pers = dict(ck.persistent)
            rng_state = pers.pop(TORCH_RNG.split("/", 1)[1], None)
            if rng_state is not None:
                torch.set_rng_state(torch.from_numpy(np.array(rng_state, dtype=np.uint8)))
            target = getattr(self.ctx, "persistent_state", None)
            if isinstance(target, dict):
                target.clear()
                target.update(pers)
            rng = getattr(self.ctx, "rng", None)
            if rng is not None and isinstance(m.get("numpy_rng"), dict):
                rng.bit_generator.state = m["numpy_rng"]
            _restore_peers(getattr(self.ctx, "peers", None), m.get("peers"))
            tensors, meta = self.algorithm.state_dict()
            self.restored_digest = state_digest(tensors, meta)
            if self.restored_digest != m.get("state_digest"):
                log.warning("restored state of round %d differs from the checkpoint's digest", ck.round)
            self.last_saved = ck.round
            self.restored_pending = _pending_records(m.get("pending_records"))
            log.info("resumed from checkpoint of round %d (%s, state %s)", ck.round, ck.path.name,
                     self.restored_digest[:16])
            return ck.round
        return 0


def snapshot_from_checkpoint(state_dir: str | Path, rounds: int | None = None) -> np.ndarray | None:
    """The snapshot saved with the newest usable checkpoint (a resumed run trains on the same
    data), or None; with ``rounds``, only from a checkpoint of an unfinished run (round < rounds)."""
    try:
        ck = CheckpointStore(Path(state_dir) / "checkpoints").load_latest()
    except Exception as exc:  # noqa: BLE001 - an unusable checkpoint means a fresh snapshot
        log.warning("cannot read the checkpoint's data snapshot: %s", exc)
        return None
    if ck is None or (rounds is not None and ck.round >= rounds):
        return None
    ids = ck.persistent.get(SNAPSHOT_KEY)
    if ids is None:
        ids = ck.persistent.get(PERSISTENT_PREFIX + SNAPSHOT_KEY)
    return None if ids is None else np.asarray(ids, dtype=np.int64)
