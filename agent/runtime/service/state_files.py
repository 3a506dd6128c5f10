"""Every file the agent keeps in its state directory, how each is written, and the check of
each at start.  Torch-free.

:data:`STATE_FILES` is the one list of the state files (``docs/operations.md`` has the same
table): what each holds, how it is written so that a power cut never leaves it half-written, its
size bound, and what the agent does when it finds it damaged.  Every write is one of:

* ``atomic``: :func:`dfl_agent.fsutil.atomic_write` (temporary file, fsync, rename, fsync of the
  folder): a reader sees the old file or the new one;
* ``sqlite``: a transaction of an SQLite database in WAL mode with ``synchronous = FULL``;
* ``folder``: files written and fsynced under a temporary folder name, then the folder renamed
  into place;
* ``append``: a line appended (a torn last line is ended at the next open and skipped by readers).

:func:`check_state` runs at every start of the service, before anything reads the files
(:func:`~dfl_agent.runtime.service.run_manager.build_run_manager`; ``dflctl state check`` runs it
without changing anything).  A damaged file gives one line naming it and what to do: either the
agent refuses to start (:class:`~dfl_agent.runtime.shared.assembly.StartupError`, exit code 2) or
it recovers safely and says so at WARNING, by the rule of :data:`STATE_FILES`.  A recovery never
lets the agent run again a run it already ended, and never touches the privacy ledger (which
checks itself: :mod:`dfl_agent.runtime.shared.privacy_ledger`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import atomic_write, sha256_file
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.retention import ENDED_FILE, low_space, prune_runs, read_ended, settle_all
from dfl_agent.runtime.shared.assembly import StartupError
from dfl_agent.runtime.shared.descriptor import TERMINAL

log = logging.getLogger("dfl_agent.daemon")


@dataclasses.dataclass(frozen=True)
class StateFile:
    """One kind of state file (a row of the table in ``docs/operations.md``).

    Attributes:
        path: its path under the state directory (``{run}``: a run's id).
        holds: what it holds.
        written: ``atomic``, ``sqlite``, ``folder`` or ``append`` (see the module docstring).
        writer: the modules that write it (``dfl_agent.`` left out; comma-separated).
        bound: its size bound.
        damaged: what the agent does when the file is unreadable, truncated, zeroed or fails its check.
    """

    path: str
    holds: str
    written: str
    writer: str
    bound: str
    damaged: str


#: the state files (see the module docstring); the docs' table lists the same paths
STATE_FILES: tuple[StateFile, ...] = (
    StateFile("state_version", "the state folder's schema, the release that wrote it and the migrations that brought "
              "it there", "atomic", "runtime.shared.state_version", "one small document (the last 32 migrations)",
              "refuses to start (exit 2) naming the file: restore it; a newer schema (written by a later release) "
              "is refused the same way"),
    StateFile("state-backup/schema-{N}-{time}/", "the files a migration from schema N rewrote, as they were before it",
              "folder", "runtime.shared.state_version", "as those files", "not read again (copy them back to roll "
              "back an upgrade)"),
    StateFile("node_id", "the node's id, when node.toml sets none", "atomic", "runtime.shared.run_config",
              "one line", "refuses to start (exit 2): write the device's id back (its certificate names it) or set "
              "`node_id` in node.toml"),
    StateFile("node_key.pem", "the node's private key (mode 0600)", "atomic", "security.keys", "under 1 kB",
              "refuses to start (exit 2) naming the file"),
    StateFile("node_cert.json", "the node's certificate", "atomic", "security.keys", "under 2 kB",
              "refuses to start (exit 2) naming the file: `dflctl keys renew`"),
    StateFile("revocations.json", "the newest revocation list this node verified", "atomic", "security.revocation",
              "one entry per revoked key", "ignored (WARNING); taken again from the broker's retained list"),
    StateFile("control_seq.json", "the sequence numbers reserved for this node's signed messages", "atomic",
              "security.trust", "one number per message kind",
              "WARNING; the sequence numbers restart from the clock (above any sent before)"),
    StateFile("counters.json", "the refusal and drop counters over the node's life", "atomic",
              "runtime.service.service_counters", "one number per reason", "WARNING; the counters start from 0"),
    StateFile("runs/ledger.sqlite", "the run ledger: every run's state on this node (the newest "
              "`runtime.keep_runs` ended runs whole, older ones as a one-line summary) and the cancelled runs",
              "sqlite", "runtime.service.ledger", "about 0.2 kB per older run, 1 kB per kept run",
              "refuses to start (exit 2): `dflctl state recover` rebuilds it; a run whose folder's `ended.json` "
              "the ledger lost is recorded again from it (WARNING)"),
    StateFile("runs/ledger.json.migrated", "an earlier release's run ledger and cancel records "
              "(`cancelled.json.migrated`), as they were when the ledger took them over", "atomic",
              "runtime.service.ledger", "as they were", "not read again"),
    StateFile("runs/damaged-{time}/", "the files `dflctl state recover` moved aside", "folder",
              "runtime.service.ledger_recovery", "as those files", "not read again"),
    StateFile("runs/{run}/descriptor.json", "the run's descriptor, for a restart that resumes it", "atomic",
              "runtime.service.run_manager", "under 64 kB", "a run killed after its training is recorded "
              "`failed` (WARNING, cannot resume); before it, admission writes the file again"),
    StateFile("runs/{run}/run.toml", "the run's effective configuration (mode 0600: the broker password)", "atomic",
              "runtime.service.supervisor", "a few kB; deleted when the run ended",
              "written again at each start of the run process"),
    StateFile("runs/{run}/members.json", "the run's members, for a restart that resumes it", "atomic",
              "runtime.run.rejoin", "one id per member; deleted when the run ended",
              "removed at start (WARNING); the run resumes with the members its peers name"),
    StateFile("runs/{run}/start.json", "how the run started (warm start)", "atomic", "runtime.run.warm_start",
              "under 1 kB; deleted when the run ended", "a resumed run reports its start as unknown"),
    StateFile("runs/{run}/metrics.jsonl", "the run's round records, one line a round", "append",
              "runtime.run.agent", "about 1 kB a round; gzipped when the run ended",
              "a torn last line is ended at the next open and skipped; a round not yet written is in the "
              "checkpoint (`pending_records`)"),
    StateFile("runs/{run}/metrics.jsonl.gz", "an ended run's round records, gzipped", "atomic",
              "runtime.service.retention", "about a fifth of the records", "read as no records"),
    StateFile("runs/{run}/ended.json", "how the run ended here (the ledger's entry, compact)", "atomic",
              "runtime.service.retention", "under 1 kB", "ignored (the ledger holds the same)"),
    StateFile("runs/{run}/checkpoints/", "the run's newest checkpoints (`round-N.safetensors`, then "
              "`round-N.json`, whose SHA-256 of the tensors commits the pair)", "atomic", "runtime.node.checkpoint",
              "`runtime.checkpoint_keep` times the model's training state; deleted when the run ended",
              "removed at start (WARNING); the run resumes from the checkpoint before it, or from its start"),
    StateFile("checkpoints/", "`dfl-agent run --once`: the checkpoints, as above", "atomic", "runtime.node.checkpoint",
              "`runtime.checkpoint_keep` times the model's training state", "as above"),
    StateFile("metrics.jsonl", "`dfl-agent run --once`: the round records (`runtime.metrics_file`)", "append",
              "runtime.run.agent", "about 1 kB a round, never pruned", "as above"),
    StateFile("members.json", "`dfl-agent run --once`: the run's members", "atomic", "runtime.run.rejoin",
              "one id per member", "removed at start (WARNING)"),
    StateFile("models/v{N}/", "a deployed version (model, spec, manifest.json with the SHA-256 of each file)",
              "folder", "deploy.versions", "`deploy.keep` versions", "not current: removed at start (WARNING); "
              "current: `current` switched back to the newest older version that checks (WARNING)"),
    StateFile("models/current", "the symlink to the deployed version", "atomic", "deploy.versions", "a link",
              "as a damaged current version"),
    StateFile("models/candidate/", "the model the deploy gate refused last", "folder", "deploy.versions",
              "one model", "removed (WARNING); a stale one (a newer version is deployed) is removed too (INFO)"),
    StateFile("models/.last_version", "the highest version number used", "atomic",
              "deploy.versions, runtime.service.state_files", "one number",
              "written again from the versions present (WARNING)"),
    StateFile("live_model/", "the run's live model for inference members (model.onnx, manifest.json)", "atomic",
              "runtime.run.live_export", "one model", "replaced at the next export; a member checks its hash"),
    StateFile("privacy/ledger.sqlite", "the privacy ledger: one row per DP run and the hash-chained history of "
              "every change; runs older than the newest `runtime.keep_runs` folded into their composed RDP "
              "curve", "sqlite", "runtime.shared.privacy_ledger, runtime.service.privacy_recovery",
              "bounded: about 56 KiB with `runtime.keep_runs` 20 (`bench/privacy/results/ledger.md`)",
              "DP runs declined with one line naming the file (non-DP runs go on; `dfl-agent run --once` exits 2): "
              "`dflctl privacy recover`"),
    StateFile("privacy/ledger.pre-chain.sqlite", "release 0.1.0's privacy ledger as it was before it was chained",
              "atomic", "runtime.shared.privacy_ledger", "as that ledger", "not read again"),
    StateFile("privacy/damaged-{time}/", "the files `dflctl privacy recover` moved aside", "folder",
              "runtime.service.privacy_recovery", "as those files", "not read again"),
    StateFile("privacy-head.json", "the privacy ledger's head marker: the chain's length and last hash, the composed "
              "ε", "atomic", "runtime.shared.privacy_chain", "one small document",
              "as the privacy ledger: a ledger without its marker, or a marker without its ledger, is refused"),
    StateFile("store/samples.sqlite", "the sample store", "sqlite", "store.sqlite", "`data.store_max_samples` samples",
              "refuses to start (exit 2) naming the file: move `store/` aside to start with an empty store"),
    StateFile("spool/rejected/{file}.reason", "why a spool file was rejected", "atomic", "store.sqlite",
              "one line per rejected file", "informational only"),
)

#: the temporary names the atomic writes leave behind when a kill comes before their rename
#: (:func:`dfl_agent.fsutil.atomic_writer`, ``.NAME.tmpPID-HEX`` and ``.NAME.linkPID-HEX``; the
#: ledger's ``.ledger.sqlite.newPID``)
TEMPORARY = re.compile(r"^\..+\.(tmp|link|new)\d+(-[0-9a-f]+)?$")
#: the checkpoint format (:data:`dfl_agent.runtime.node.checkpoint.FORMAT`; the service does not import
#: the node's modules)
CHECKPOINT_FORMAT = "dfl-checkpoint/1"
_MANIFEST = re.compile(r"^round-(\d{8})\.json$")


@dataclasses.dataclass
class Finding:
    """What the start check found wrong with one file, and what it did (or, without ``fix``,
    would do): ``line`` is the WARNING line."""

    path: Path
    line: str


def check_state(cfg: Any, ledger: RunLedger | None, fix: bool = True) -> list[Finding]:
    """Check the state directory's files at start (see the module docstring) and recover what
    may be recovered (with ``fix``); returns what was found, one line each (the caller logs them
    at WARNING).  The run ledger checks itself when it opens (``ledger``: the open ledger, None
    when the caller did not open it).

    Raises:
        StartupError: a file that the agent must not start without (its one line).
    """
    state_dir = Path(cfg.state_dir)
    if not state_dir.is_dir():
        return []
    _check_node_id(cfg, state_dir)
    _check_store(state_dir)
    remove_temporaries(state_dir, fix)
    out: list[Finding] = []
    unfinished: list[Path] = []
    if ledger is not None:
        out += _check_ledger_against_folders(ledger, fix)
        unfinished = [ledger.run_dir(rid) for rid in ledger.run_ids() if ledger.state(rid) not in TERMINAL
                      and ledger.run_dir(rid).is_dir()]
    for folder in [*unfinished, state_dir]:  # a run's folder; --once's files in the state directory
        out += _check_members(folder / "members.json", fix)
        out += _check_checkpoints(folder / "checkpoints", fix)
    out += check_models(state_dir, fix)
    return out


def _check_node_id(cfg: Any, state_dir: Path) -> None:
    from dfl_agent.transport.wire import valid_id

    path = state_dir / "node_id"
    if cfg.node_id or not path.exists():
        return
    try:
        nid = path.read_bytes().decode("utf-8").strip()
        what = "" if valid_id(nid) else (f"holds {nid[:40]!r}, not a node id" if nid else "is empty (truncated)")
    except (OSError, UnicodeDecodeError) as exc:
        what = f"cannot be read ({exc})"
    if what:
        raise StartupError(f"state file {path}: {what}; the agent does not start under another identity: write this "
                           f"device's node id into it (its certificate {state_dir / 'node_cert.json'} names it), or "
                           "set node_id in node.toml")


def _check_store(state_dir: Path) -> None:
    """A sample store cut short or zeroed is refused (SQLite would open it as an empty store)."""
    from dfl_agent.runtime.shared.sqlite_file import cut_short

    path = state_dir / "store" / "samples.sqlite"
    if not path.is_file():
        return
    try:
        what = cut_short(path)
    except OSError as exc:
        what = f"cannot be read ({exc})"
    if what:
        raise StartupError(store_damaged(path, what))


def store_damaged(path: Path, what: str) -> str:
    """The one line of a damaged sample store."""
    return (f"sample store {path}: {what}; the agent does not start: move the folder {path.parent} aside to start "
            "with an empty store (the samples in it are lost; the spool's files are taken again), or put back a copy")


def remove_temporaries(state_dir: Path, fix: bool = True) -> None:
    """Remove what atomic writes killed before their rename left behind (:data:`TEMPORARY`), and
    the deployments' ``models/.tmp-*`` folders, in the folders the service and its run processes
    write (none is writing at start).  Not a damage: logged at DEBUG."""
    folders = [state_dir, state_dir / "checkpoints", state_dir / "runs", state_dir / "models"]
    runs = state_dir / "runs"
    if runs.is_dir():
        for p in runs.iterdir():
            if p.is_dir() and not p.name.startswith("."):
                folders += [p, p / "checkpoints"]
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            stale = TEMPORARY.match(p.name) or (folder.name == "models" and p.name.startswith(".tmp-"))
            if stale and fix:
                log.debug("removing %s (a write a kill interrupted)", p)
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def _check_ledger_against_folders(ledger: RunLedger, fix: bool) -> list[Finding]:
    """Runs whose folder's ``ended.json`` says they ended but whose ledger row is missing or not
    ended (the ledger lost its last writes): recorded again from ``ended.json``."""
    lost = {}
    for folder in sorted(p for p in ledger.dir.iterdir() if p.is_dir() and (p / ENDED_FILE).is_file()):
        ended = read_ended(folder)
        if ended is not None and ended["state"] in TERMINAL and ledger.state(folder.name) not in TERMINAL:
            lost[folder.name] = ended
    if not lost:
        return []
    if fix:
        for rid, e in lost.items():
            ledger.set(rid, e["state"], int(e.get("round") or 0), str(e.get("reason") or ""),
                       {k: v for k, v in e.items() if k not in ("state", "round", "reason", "time")})
    shown = ", ".join(f"{rid} ({e['state']})" for rid, e in list(lost.items())[:5]) + (" ..." if len(lost) > 5 else "")
    return [Finding(ledger.path, f"run ledger {ledger.path}: it lost the record of {len(lost)} run(s) that ended here "
                                 f"(its last writes were cut off?); recorded {'again' if fix else 'to record again'} "
                                 f"from their folders' {ENDED_FILE}: {shown}")]


def _check_members(path: Path, fix: bool) -> list[Finding]:
    if not path.exists():
        return []
    try:
        doc = bounded_loads(path.read_bytes(), "state")
        ok = isinstance(doc, dict) and isinstance(doc.get("members"), list) and \
            all(isinstance(m, str) for m in doc["members"])
        what = "" if ok else "is not a members document"
    except (OSError, ValueError) as exc:
        what = f"cannot be read ({exc})"
    if not what:
        return []
    if fix:
        path.unlink(missing_ok=True)
    return [Finding(path, f"state file {path}: {what}; {'removed' if fix else 'to remove'}: the run resumes with the "
                          "members its peers name")]


def checkpoint_problem(manifest: Path) -> str | None:
    """What is wrong with the checkpoint whose manifest is ``manifest`` (``round-N.json``), or None
    when it checks: a readable manifest of the checkpoint format and round, and a tensors file
    whose SHA-256 is the one the manifest names."""
    m = _MANIFEST.match(manifest.name)
    if m is None:
        return "not a checkpoint manifest's name"
    try:
        doc = bounded_loads(manifest.read_bytes(), "state")
    except (OSError, ValueError) as exc:
        return f"its manifest cannot be read ({exc})"
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT or doc.get("round") != int(m.group(1)):
        return "its manifest is not the checkpoint's"
    tensors = manifest.with_name(f"round-{m.group(1)}.safetensors")
    try:
        digest = sha256_file(tensors)
    except OSError as exc:
        return f"its tensors file cannot be read ({exc.strerror})"
    if digest != doc.get("tensors_sha256"):
        return "its tensors file fails the SHA-256 the manifest names (cut short or corrupt)"
    return None


def _check_checkpoints(folder: Path, fix: bool) -> list[Finding]:
    if not folder.is_dir():
        return []
    rounds = {p: int(m.group(1)) for p in folder.iterdir() if (m := _MANIFEST.match(p.name))}
    bad = {p: what for p in sorted(rounds, reverse=True) if (what := checkpoint_problem(p)) is not None}
    good = [r for p, r in rounds.items() if p not in bad]
    out = []
    for p, what in bad.items():
        older = [g for g in good if g < rounds[p]]
        if fix:
            p.unlink(missing_ok=True)
            p.with_name(p.stem + ".safetensors").unlink(missing_ok=True)
        resume = f"from the checkpoint of round {max(older)}" if older else "from its start (no older checkpoint)"
        out.append(Finding(p, f"checkpoint {p}: {what}; {'removed' if fix else 'to remove'}: the run resumes {resume}"))
    return out


def check_models(state_dir: Path, fix: bool = True) -> list[Finding]:
    """The deployed versions (every file against its manifest's SHA-256), ``current``, the
    refused candidate and ``.last_version`` (see :data:`STATE_FILES` for what is done)."""
    from dfl_agent.deploy.versions import DeployError, ModelStore, verify_folder
    from dfl_agent.runtime.service.retention import remove_stale_candidate

    models = ModelStore(state_dir)
    root = models.root
    if not root.is_dir():
        return []
    out: list[Finding] = []
    versions = {int(m.group(1)): p for p in root.iterdir()
                if (m := re.match(r"^v(\d+)$", p.name)) and p.is_dir() and not p.is_symlink()}
    bad: dict[int, str] = {}
    for v, folder in sorted(versions.items()):
        try:
            verify_folder(folder)
        except DeployError as exc:
            bad[v] = str(exc)
    good = sorted(set(versions) - set(bad))
    cur = models.current_version()
    link = root / "current"
    cur_bad = bad.get(cur) if cur is not None else None
    if link.is_symlink() and (cur is None or cur not in versions):
        cur_bad = f"`current` points at {os.readlink(link)}, which is not a version here"
    for v, what in sorted(bad.items()):
        if v == cur:
            continue
        if fix:
            shutil.rmtree(versions[v], ignore_errors=True)
        out.append(Finding(versions[v], f"model version {versions[v]}: {what}; {'removed' if fix else 'to remove'} "
                                        "(it is not the current one)"))
    if cur_bad is not None:
        back = [v for v in good if cur is None or v < cur] or good
        if back:
            if fix:
                models.switch(back[-1])
            out.append(Finding(link, f"deployed model {link}: {cur_bad}; `current` "
                                     f"{'switched back' if fix else 'to switch back'} to v{back[-1]}, the newest "
                                     "version that checks (dflctl model rollback --to N chooses another)"))
        else:
            out.append(Finding(link, f"deployed model {link}: {cur_bad}; no other version checks: the next run that "
                                     "deploys installs a new one (inference should not load it until then)"))
    out += _check_last_version(root, max(versions, default=0), fix)
    cand = root / "candidate"
    if fix:
        why = remove_stale_candidate(state_dir, at_start=True)
        if why is not None and "fails its check" in why:
            out.append(Finding(cand, f"refused candidate {cand}: {why}; removed"))
    elif cand.is_dir():
        try:
            verify_folder(cand)
        except DeployError as exc:
            out.append(Finding(cand, f"refused candidate {cand}: it fails its check ({exc}); to remove"))
    return out


def _check_last_version(root: Path, highest: int, fix: bool) -> list[Finding]:
    path = root / ".last_version"
    if not path.exists():
        if highest and fix:
            atomic_write(path, str(highest), mode=0o640)
        return []
    try:
        last = int(path.read_text().strip())
        what = "" if last >= highest else f"holds {last}, below the version v{highest} present"
    except (OSError, ValueError) as exc:
        what = f"cannot be read ({exc})"
    if not what:
        return []
    if fix:
        atomic_write(path, str(highest), mode=0o640)
    return [Finding(path, f"state file {path}: {what}; {'written again' if fix else 'to write again'} as {highest} "
                          "(new versions are numbered above it)")]


def open_checked(cfg: Any) -> RunLedger:
    """The service's state at start: the run ledger opened (and checked, an earlier release's
    taken over), every state file checked (:func:`check_state`:
    one WARNING line per file recovered), the ended runs' folders settled and pruned, a stale
    candidate removed, and a WARNING when the disk is short of space.

    Raises:
        StartupError: a state file the agent must not start without (its one line: exit code 2).
    """
    ledger = RunLedger(cfg.state_dir)
    for finding in check_state(cfg, ledger):
        log.warning("%s", finding.line)
    rt = cfg.runtime
    try:
        settle_all(ledger, rt.keep_run_files)
        prune_runs(ledger, rt.keep_runs)
    except OSError as exc:
        log.warning("could not remove the files of ended runs under %s: %s", ledger.dir, exc)
    if (line := low_space(cfg.state_dir, rt.disk_warn_mb)) is not None:
        log.warning("%s", line)
    return ledger
