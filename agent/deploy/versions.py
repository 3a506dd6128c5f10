"""The deployed-model folder ``state_dir/models`` (torch-free).

::

    models/v7/            one immutable version: model.onnx, model.safetensors, spec.json,
                          manifest.json (written last; SHA-256 of every other file)
    models/current -> v7  symlink, switched atomically (rename of a temporary link)
    models/candidate/     the last candidate the gate refused (``dflctl model deploy --force``)

A version folder is written under a temporary name (``.tmp-…``), every file is
fsync-ed, then the folder is renamed into place: a reader never sees a partial
version.  ``current`` is then replaced by a rename.  The newest ``keep`` versions
are kept (and always the current one).  Files are group-readable (0640, folders
0750) so the application may run as another user in the agent's group.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import atomic_symlink, atomic_write, crash_point, rename, sha256_file
from dfl_agent.jsonbound import loads as bounded_loads

SCHEMA_VERSION = 1
#: where a node that deploys nothing keeps its run's live model for inference members (under the
#: state directory, beside ``models/``: :mod:`dfl_agent.runtime.run.live_export`)
LIVE_DIR = "live_model"
_VERSION = re.compile(r"^v(\d+)$")
FILE_MODE, DIR_MODE = 0o640, 0o750


class DeployError(ValueError):
    """No such version, nothing to roll back to, a corrupt version or candidate."""


def verify_folder(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a version (or candidate) folder after checking every file's SHA-256.

    Raises:
        DeployError: missing manifest or file, or a hash mismatch.
    """
    f = Path(folder)
    try:
        manifest = bounded_loads((f / "manifest.json").read_bytes(), "manifest")
    except (OSError, ValueError) as exc:  # JSONBoundError included: oversized, too_deep, malformed
        raise DeployError(f"{f}: unreadable manifest.json ({exc})") from None
    for name, info in manifest.get("files", {}).items():
        try:
            got = sha256_file(f / name)
        except OSError as exc:
            raise DeployError(f"{f / name}: {exc.strerror}") from None
        if got != info.get("sha256"):
            raise DeployError(f"{f / name}: SHA-256 mismatch (corrupt file)")
    return manifest


class ModelStore:
    """``state_dir/models`` of one agent.

    Args:
        state_dir: the agent's state directory.
        keep: versions kept (>= 1).
    """

    def __init__(self, state_dir: str | os.PathLike[str], keep: int = 3):
        if keep < 1:
            raise ValueError(f"deploy.keep: must be >= 1, got {keep}")
        self.root = Path(state_dir) / "models"
        self.keep = keep

    # -- reading --------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Installed version numbers, ascending."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir()
                      if (m := _VERSION.match(p.name)) and (p / "manifest.json").is_file())

    def current_version(self) -> int | None:
        """The version ``current`` points at, or None."""
        try:
            m = _VERSION.match(os.readlink(self.root / "current"))
        except OSError:
            return None
        return int(m.group(1)) if m else None

    def folder(self, version: int) -> Path:
        return self.root / f"v{version}"

    def manifest(self, version: int) -> dict[str, Any]:
        """The manifest of ``version`` (not verified).

        Raises:
            DeployError: no such version.
        """
        try:
            return bounded_loads((self.folder(version) / "manifest.json").read_bytes(), "manifest")
        except (OSError, ValueError):
            raise DeployError(f"no model version v{version} under {self.root}") from None

    def show(self) -> dict[str, Any]:
        """The ``dflctl model show --json`` document."""
        cur = self.current_version()
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "models": str(self.root), "current": None,
                               "versions": []}
        for v in self.versions():
            m = self.manifest(v)
            entry = {k: m.get(k) for k in ("version", "run_id", "round", "algorithm", "accuracy", "sha256",
                                           "time", "validation_samples", "forced", "note", "onnx", "started_from",
                                           "privacy", "adopted_from")}
            entry["current"] = v == cur
            out["versions"].append(entry)
            if v == cur:
                out["current"] = entry
        cand = self.root / "candidate" / "manifest.json"
        if cand.is_file():
            try:
                m = bounded_loads(cand.read_bytes(), "manifest")
            except (OSError, ValueError) as exc:
                m = {"note": f"unreadable manifest.json ({exc})"}
            if not isinstance(m, dict):
                m = {"note": "manifest.json is not an object"}
            out["candidate"] = {k: m.get(k) for k in ("run_id", "round", "accuracy", "note", "time")}
        return out

    def run_outcome(self, run_id: str, switch: bool = True) -> dict[str, Any] | None:
        """What an earlier deployment of run ``run_id`` left here, or None when it left
        nothing: ``{"deployed": True, "version": v}`` when a version holds that run's model
        (``current`` is switched to it when a kill came between moving the version into
        place and switching, i.e. when it is newer than ``current``), ``{"deployed": False,
        "version": None}`` when the gate staged it as the refused candidate.  A restarted
        run that finished training asks this before it deploys, so its model is deployed
        or kept exactly once.  ``switch=False``: ``current`` is left as it is (a run process:
        its supervisor switches)."""
        mine = [v for v in self.versions() if self.manifest(v).get("run_id") == run_id]
        if mine:
            v, cur = mine[-1], self.current_version()
            if switch and (cur is None or v > cur):
                self.switch(v)
            return {"deployed": True, "version": v}
        cand = self.root / "candidate" / "manifest.json"
        try:
            staged = bounded_loads(cand.read_bytes(), "manifest") if cand.is_file() else None
        except (OSError, ValueError):
            staged = None
        if isinstance(staged, dict) and staged.get("run_id") == run_id:
            return {"deployed": False, "version": None}
        return None

    # -- writing (the agent, or dflctl as the agent's user) ----------------------------
    def _prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, DIR_MODE)
        for p in self.root.iterdir():  # leftovers of a killed deployment
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(
                    missing_ok=True)

    def _write_folder(self, files: Mapping[str, bytes], info: Mapping[str, Any]) -> Path:
        tmp = self.root / f".tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir(mode=DIR_MODE)
        os.chmod(tmp, DIR_MODE)
        digests = {}
        for name, data in files.items():
            atomic_write(tmp / name, data, mode=FILE_MODE)
            digests[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        main = "model.onnx" if "model.onnx" in files else "model.safetensors"
        manifest = {**dict(info), "schema_version": SCHEMA_VERSION, "files": digests,
                    "sha256": digests[main]["sha256"], "onnx": "model.onnx" in files,
                    "time": info.get("time", time.time())}
        atomic_write(tmp / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False),
                     mode=FILE_MODE)
        return tmp

    def install(self, files: Mapping[str, bytes], info: Mapping[str, Any], switch: bool = True) -> int:
        """Write a new version atomically, point ``current`` at it, prune.  Returns its number.

        Args:
            files: file name -> bytes (``model.safetensors`` and ``spec.json`` at least).
            info: manifest fields (run id, round, algorithm, accuracy, ...).
            switch: False leaves ``current`` and the older versions as they are (a run
                process: its supervisor calls :meth:`switch` and :meth:`prune`).
        """
        self._prepare()
        version = max(self.versions() + [self._last_version()], default=0) + 1
        tmp = self._write_folder(files, {**dict(info), "version": version})
        crash_point("deploying", "mid")  # the crash tests: a kill with the version under .tmp-*
        rename(tmp, self.folder(version))
        atomic_write(self.root / ".last_version", str(version), mode=FILE_MODE)
        if switch:
            self.switch(version)
            self.prune()
        return version

    def _last_version(self) -> int:
        try:
            return int((self.root / ".last_version").read_text())
        except (OSError, ValueError):
            return 0

    def switch(self, version: int) -> None:
        """Point ``current`` at ``version`` atomically (rename of a temporary symlink).

        Raises:
            DeployError: no such version or it fails its hash check.
        """
        verify_folder(self.folder(version))
        atomic_symlink(f"v{version}", self.root / "current")

    def prune(self) -> None:
        """Delete all but the newest ``keep`` versions (never the current one)."""
        cur = self.current_version()
        for v in self.versions()[:-self.keep]:
            if v != cur:
                self._remove(self.folder(v))

    def _remove(self, folder: Path) -> None:
        """Rename out of sight first (atomic), then delete: a kill never leaves half a version."""
        gone = self.root / f".tmp-del-{folder.name}-{uuid.uuid4().hex[:8]}"
        try:
            rename(folder, gone, sync=False)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def stage_candidate(self, files: Mapping[str, bytes], info: Mapping[str, Any]) -> Path:
        """Keep a refused candidate in ``models/candidate`` (replacing an older one)."""
        self._prepare()
        tmp = self._write_folder(files, info)
        dest = self.root / "candidate"
        if dest.exists():
            self._remove(dest)
        rename(tmp, dest)
        return dest

    def promote_candidate(self, note: str = "deployed with --force") -> int:
        """``dflctl model deploy --force``: install the staged candidate as a new version.

        Idempotent: the new version's manifest records ``candidate_sha256`` (SHA-256 of the
        candidate's ``manifest.json``); when a version with that hash exists already (a kill
        between installing it and removing the candidate), no second version is made: that
        version becomes current and the candidate is removed.

        Raises:
            DeployError: no candidate, or it fails its hash check.
        """
        cand = self.root / "candidate"
        if not (cand / "manifest.json").is_file():
            raise DeployError(f"no refused candidate under {cand}: the last run's model is already deployed "
                              "(or no run has finished)")
        manifest = verify_folder(cand)
        # the candidate's identity: a kill between install and removal leaves it staged, and
        # a second promotion must find the version the first one made instead of adding another
        ident = hashlib.sha256((cand / "manifest.json").read_bytes()).hexdigest()
        done = [v for v in self.versions() if self.manifest(v).get("candidate_sha256") == ident]
        if done:
            version = done[-1]
            if self.current_version() != version:
                self.switch(version)
        else:
            files = {name: (cand / name).read_bytes() for name in manifest["files"]}
            info = {k: v for k, v in manifest.items()
                    if k not in ("files", "sha256", "onnx", "schema_version", "time")}
            info.update(forced=True, note=f"{manifest.get('note', '')}; {note}".strip("; "),
                        candidate_sha256=ident)
            version = self.install(files, info)
        self._remove(cand)
        return version

    def rollback(self, to: int | None = None) -> int:
        """Point ``current`` at version ``to`` (default: the newest version older than the current).

        Raises:
            DeployError: nothing older to roll back to, or no such version.
        """
        cur = self.current_version()
        if to is None:
            older = [v for v in self.versions() if cur is None or v < cur]
            if not older:
                raise DeployError(f"no version older than v{cur} to roll back to (kept: {self.versions()})")
            to = older[-1]
        if to not in self.versions():
            raise DeployError(f"no model version v{to} under {self.root} (kept: {self.versions()})")
        self.switch(to)
        return to
