"""Bounded state: what the service removes once a run is recorded, and how much the state
directory holds.  Torch-free.

A device runs recurring runs for months on a small card, so nothing of a run may stay for ever:

* **An ended run's folder is settled** (:func:`settle_run`) once the run ledger records the run
  ended (``finished``, ``failed``, ``cancelled``, ``declined`` or ``missed``: the ledger's terminal states,
  after which nothing resumes it): its checkpoints, its ``run.toml`` (it holds the broker
  password), ``members.json`` and ``start.json`` are deleted, its round records are kept gzipped
  (``metrics.jsonl.gz``, read by :func:`read_records`), and ``ended.json`` records how it ended (the
  ledger's entry, compact), which a start checks the ledger against and ``dflctl state recover``
  rebuilds it from.  A run the ledger has not recorded ended keeps every file: a retry or a restart
  resumes it from its checkpoint and its descriptor.  ``runtime.keep_run_files = true`` keeps the
  files as the run left them (measurements on them: the field lab); ``ended.json`` is written
  either way.
* **The newest ``runtime.keep_runs`` ended runs keep their folders** (:func:`prune_runs`); older
  ones keep only their compact entry in the ledger (the one-line summary that the run ended here
  and how: :meth:`~dfl_agent.runtime.service.ledger.RunLedger.compact_older`).  A folder goes out of
  sight first (renamed to ``.del-*``), then is deleted: a kill leaves no half folder.
* **A stale refused candidate is removed** (:func:`remove_stale_candidate`): ``models/candidate``
  once the deployed version is newer than it (a later run deployed), and a candidate that fails
  its hash check.

Every step runs after the ledger's write, so a kill between the two leaves files that the next
start settles (:func:`settle_all`); the ``dfl-agent run --once`` layout (``state_dir/checkpoints``,
``runtime.metrics_file``) is never touched.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import atomic_write, atomic_writer, rename
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.service.ledger import RunLedger, doc_time, summary
from dfl_agent.runtime.shared.descriptor import TERMINAL

log = logging.getLogger("dfl_agent.daemon")

#: how an ended run ended, in its folder (the ledger's entry, compact)
ENDED_FILE = "ended.json"
#: a run's round records, as the run process appends them, and kept gzipped once the run ended
METRICS, METRICS_GZ = "metrics.jsonl", "metrics.jsonl.gz"
#: an ended run's files that nothing reads again (deleted when it is settled, with its checkpoints)
SPENT_FILES = ("run.toml", "members.json", "start.json")
#: the prefix of a folder on its way out (renamed, then deleted)
GOING = ".del-"


def read_records(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A run's round records, from ``metrics.jsonl`` or, once the run was settled,
    ``metrics.jsonl.gz`` ([] when neither is there); a torn or unreadable line is skipped."""
    folder = Path(run_dir)
    try:
        if (folder / METRICS).exists():
            text = (folder / METRICS).read_text(encoding="utf-8", errors="replace")
        elif (folder / METRICS_GZ).exists():
            with gzip.open(folder / METRICS_GZ, "rt", encoding="utf-8", errors="replace") as f:
                text = f.read()
        else:
            return []
    except (OSError, EOFError, gzip.BadGzipFile):
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict):
                out.append(rec)
    return out


def _gzip_metrics(folder: Path) -> None:
    """``metrics.jsonl`` -> ``metrics.jsonl.gz`` (written atomically first, then the plain file
    deleted: a kill between the two leaves both, and the next settling writes the archive again).
    The archive keeps the records' modification time: when the run wrote its last round."""
    src = folder / METRICS
    st = src.stat()
    with open(src, "rb") as fin, atomic_writer(folder / METRICS_GZ) as fout, \
            gzip.GzipFile(filename=METRICS, mode="wb", fileobj=fout, mtime=0) as gz:
        shutil.copyfileobj(fin, gz)
    os.utime(folder / METRICS_GZ, ns=(st.st_atime_ns, st.st_mtime_ns))
    src.unlink()


def settle_run(run_dir: Path, entry: Mapping[str, Any], keep_files: bool = False) -> bool:
    """Settle the folder of a run the ledger recorded ended (see the module docstring); does
    nothing for a run the ledger has not (``entry`` not terminal), and nothing that is already
    done (it is called again at each start).  Returns whether it changed anything.

    Raises:
        OSError: the disk refused (what was done stays done; the next start goes on).
    """
    if entry.get("state") not in TERMINAL or not run_dir.is_dir():
        return False
    changed = False
    ended = run_dir / ENDED_FILE
    if not ended.exists():
        atomic_write(ended, json.dumps(summary(entry), sort_keys=True) + "\n")
        changed = True
    if keep_files:
        return changed
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        shutil.rmtree(checkpoints)
        changed = True
    for name in SPENT_FILES:
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()
            changed = True
    if (run_dir / METRICS).exists():
        _gzip_metrics(run_dir)
        changed = True
    return changed


def _run_folders(runs_dir: Path) -> Iterator[Path]:
    """The run folders under ``runs_dir`` (hidden, on-their-way-out and ``damaged-*`` folders left out)."""
    try:
        entries = list(runs_dir.iterdir())
    except OSError:
        return
    for p in entries:
        if p.is_dir() and not p.is_symlink() and not p.name.startswith((".", "damaged-")):
            yield p


def _remove_folder(folder: Path) -> None:
    """Rename ``folder`` out of sight (atomic), then delete it."""
    gone = folder.with_name(f"{GOING}{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        rename(folder, gone, sync=False)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def prune_runs(ledger: RunLedger, keep_runs: int) -> list[str]:
    """Keep the newest ``keep_runs`` ended runs' folders and whole entries; older ended runs keep
    their compact entry (the ledger's one-line summary) and lose their folder.  Runs the ledger
    has not recorded ended are never touched.  Returns the run ids whose folders were removed."""
    ledger.compact_older(keep_runs)
    ledger.checkpoint()
    removed = []
    for folder in _run_folders(ledger.dir):
        if ledger.is_summary(folder.name):
            _remove_folder(folder)
            removed.append(folder.name)
    for left in ledger.dir.glob(f"{GOING}*"):  # a kill while a folder was being deleted
        shutil.rmtree(left, ignore_errors=True)
    if removed:
        log.info("removed the folders of %d older run(s) (runtime.keep_runs = %d; the ledger keeps a summary of "
                 "each): %s", len(removed), keep_runs, ", ".join(sorted(removed)[:5]) + (" ..." if len(removed) > 5
                                                                                        else ""))
    return removed


def settle_all(ledger: RunLedger, keep_files: bool = False) -> list[str]:
    """At start: settle every ended run's folder a kill left unsettled (:func:`settle_run`).
    Returns the run ids settled now."""
    done = []
    for rid, entry in ledger.recent_entries(TERMINAL).items():
        try:
            if settle_run(ledger.run_dir(rid), entry, keep_files):
                done.append(rid)
        except OSError as exc:
            log.warning("run %s: could not remove the files of the ended run from %s: %s", rid, ledger.run_dir(rid),
                        exc)
    return done


def remove_stale_candidate(state_dir: str | os.PathLike[str], at_start: bool = False) -> str | None:
    """Remove ``models/candidate`` when it is stale (the deployed version is newer than it: a later
    run deployed) or fails its hash check (damaged: WARNING).  Returns why it was removed, or None
    (no candidate, or one that ``dflctl model deploy --force`` may still deploy)."""
    from dfl_agent.deploy.versions import DeployError, ModelStore, verify_folder

    models = ModelStore(state_dir)
    cand = models.root / "candidate"
    if not cand.is_dir():
        return None
    try:
        staged = verify_folder(cand)
    except DeployError as exc:
        why = f"it fails its check ({exc})"
        level = logging.WARNING
    else:
        cur = models.current_version()
        try:
            deployed = models.manifest(cur) if cur is not None else None
        except DeployError:
            deployed = None
        if not isinstance(deployed, dict) or doc_time(deployed) <= doc_time(staged):
            return None
        why = (f"the refused model of run {staged.get('run_id')} is older than the deployed v{cur} "
               f"(run {deployed.get('run_id')})")
        level = logging.INFO
    _remove_folder(cand)
    log.log(level, "removed %s%s: %s", cand, " at start" if at_start else "", why)
    return why


def usage(state_dir: str | os.PathLike[str]) -> dict[str, int]:
    """The bytes the state directory's files take (their sizes), in total and per part:
    ``{"total", "store", "models", "runs", "privacy", "other"}`` (0 for a missing directory)."""
    root = Path(state_dir)
    parts = {"store": 0, "models": 0, "runs": 0, "privacy": 0, "other": 0}
    for top, _dirs, files in os.walk(root):
        rel = Path(top).relative_to(root).parts
        key = rel[0] if rel and rel[0] in parts else "other"
        for name in files:
            with contextlib.suppress(OSError):
                parts[key] += os.lstat(os.path.join(top, name)).st_size
    return {"total": sum(parts.values()), **parts}


def free_space(state_dir: str | os.PathLike[str]) -> tuple[int, int, Path]:
    """``(free bytes, total bytes, the folder measured)`` of the file system under ``state_dir``
    (its nearest existing folder)."""
    p = Path(state_dir)
    while not p.exists() and p != p.parent:
        p = p.parent
    du = shutil.disk_usage(p)
    return du.free, du.total, p


def low_space(state_dir: str | os.PathLike[str], warn_mb: int) -> str | None:
    """The WARNING line when the file system under ``state_dir`` has less than ``warn_mb`` MiB
    free (``runtime.disk_warn_mb``), else None."""
    free, total, where = free_space(state_dir)
    if warn_mb <= 0 or free >= warn_mb * 2**20:
        return None
    return (f"state directory {state_dir}: only {free / 2**20:.0f} MiB free of {total / 2**30:.1f} GiB on its disk "
            f"({where}), below runtime.disk_warn_mb = {warn_mb}: free space, or lower runtime.keep_runs, "
            "data.store_max_samples or deploy.keep")


def read_ended(run_dir: Path) -> dict[str, Any] | None:
    """The ``ended.json`` of a run folder (how the run ended), or None (none, or unreadable)."""
    try:
        doc = bounded_loads((run_dir / ENDED_FILE).read_bytes(), "state")
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("state"), str) else None
