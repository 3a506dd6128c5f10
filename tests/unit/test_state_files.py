"""State that lasts for years: the run ledger in SQLite (taken over from an earlier release's
JSON, refused when damaged, rebuilt by ``dflctl state recover``), ended runs' folders bounded by
``runtime.keep_runs``, stale candidates removed, every state file checked at start, and every state
write surviving a kill at its crash point and a truncation of its file.

Real SQLite, real files, the real run manager with a stand-in agent (no MQTT, no torch); one test
starts the real ``dfl-agent`` on a damaged ledger.  The kill tests fork a child that sets
``DFL_TEST_CRASH_AT`` (:func:`dfl_agent.fsutil.crash_point`) and dies by SIGKILL at the write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dfl_agent.fsutil import CRASH_ENV
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.run_manager import RunHooks, RunManager
from dfl_agent.runtime.shared.assembly import StartupError
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import RunDescriptor
from tests.unit.test_run_manager import Agent, Lobby, Notifier

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "compat" / "0.1.0" / "runs"


class FileAgent(Agent):
    """Writes what a run process leaves in its run folder (two checkpoints, round records,
    run.toml, members.json, start.json), then reports the states after its rounds."""

    async def run(self, stop):
        run_dir = Path(self.kw["run_dir"])
        ck = run_dir / "checkpoints"
        ck.mkdir(parents=True, exist_ok=True)
        for t in (1, 2):
            (ck / f"round-{t:08d}.safetensors").write_bytes(b"\0" * 4096)
            (ck / f"round-{t:08d}.json").write_text("{}")
        rid = self.kw["run"].run_id
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"round": t, "run": rid, "global_accuracy": 0.5})
                                                       + "\n" for t in (1, 2)))
        for name in ("run.toml", "members.json", "start.json"):
            (run_dir / name).write_text("{}")
        return await super().run(stop)


def _config(state: Path, **runtime):
    cfg = config_from_dict({"federation": "f", "state_dir": str(state)})
    for k, v in runtime.items():  # set after parsing: the same test runs against an earlier release
        setattr(cfg.runtime, k, v)
    return cfg


def _manager(cfg, agent=FileAgent, lobby=None) -> RunManager:
    from dfl_agent.profiles import resolve_profile

    prof = resolve_profile("generic-x86", {"behaviour": {"algorithms": ["fedavg"]}})[0]
    return RunManager(cfg, None, node_id="n", profile=prof, ledger=RunLedger(cfg.state_dir), lobby=lobby or Lobby(),
                      agent_factory=agent, notifier=Notifier(), hooks=RunHooks())


def _finish(m: RunManager, rid: str) -> RunDescriptor:
    d = RunDescriptor(run_id=rid, federation="f", algorithm="fedavg", rounds=2)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event()))
    assert m.ledger.state(rid) == "finished"
    return d


def _folders(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "runs").iterdir() if p.is_dir() and not p.name.startswith("."))


# -- bounded state -------------------------------------------------------------------------------
def test_runs_folder_is_bounded_by_keep_runs_and_ended_runs_lose_their_checkpoints(tmp_path):
    """Eight recorded runs with ``runtime.keep_runs = 3``: three run folders (the newest), each
    without checkpoints, run.toml, members.json and start.json, its round records gzipped; the
    ledger still knows all eight as finished, the five older ones as one-line summaries (how the
    run and its model ended)."""
    m = _manager(_config(tmp_path, keep_runs=3))
    ids = [f"r{i}" for i in range(8)]
    for rid in ids:
        _finish(m, rid)
    assert _folders(tmp_path) == ["r5", "r6", "r7"]
    from dfl_agent.runtime.service.retention import read_records

    for rid in ("r5", "r6", "r7"):
        folder = tmp_path / "runs" / rid
        assert sorted(p.name for p in folder.iterdir()) == ["descriptor.json", "ended.json", "metrics.jsonl.gz"]
        assert [r["round"] for r in read_records(folder)] == [1, 2]
        assert json.loads((folder / "ended.json").read_text())["state"] == "finished"
    again = RunLedger(tmp_path)  # a restart: the ledger knows every run, never reruns one
    assert [again.state(r) for r in ids] == ["finished"] * 8 and all(again.is_done(r) for r in ids)
    assert [again.is_summary(r) for r in ids] == [True] * 5 + [False] * 3
    summary = again.entries["r0"]  # how the run ended, and how its model ended here
    assert set(summary) <= {"state", "round", "reason", "time", "snapshot_last_id", "model", "version",
                            "adopted_from"} and summary["model"] == again.entries["r7"]["model"], summary
    assert again.entries["r7"]["round"] == 2 and len(again.entries) == 8


def test_keep_run_files_keeps_what_the_run_left(tmp_path):
    m = _manager(_config(tmp_path, keep_run_files=True))
    _finish(m, "r1")
    names = sorted(p.name for p in (tmp_path / "runs" / "r1").iterdir())
    assert names == ["checkpoints", "descriptor.json", "ended.json", "members.json", "metrics.jsonl", "run.toml",
                     "start.json"]


def test_a_run_not_recorded_ended_keeps_everything_a_restart_needs(tmp_path):
    """A run the ledger records ``trained`` (a kill after its training) keeps its checkpoints and
    descriptor through a start's retention pass, with keep_runs 1 and ended runs around it."""
    from dfl_agent.runtime.service.state_files import open_checked as open_state

    cfg = _config(tmp_path, keep_runs=1)
    m = _manager(cfg)
    _finish(m, "r-old")
    run_dir = tmp_path / "runs" / "r-killed"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "descriptor.json").write_text("{}")
    m.ledger.set("r-killed", "trained", 2)
    _finish(m, "r-new")
    open_state(cfg).close()
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "descriptor.json").exists()
    assert _folders(tmp_path) == ["r-killed", "r-new"]


def test_a_repeat_a_power_cut_interrupted_in_an_earlier_period_is_recorded_failed(tmp_path):
    """A power cut during a repeat of the recurring default run (``algorithm.every``), the service
    back in a later period: the interrupted repeat (ledger ``training``) is recorded ``failed``
    with why and its folder settled (checkpoints and run.toml removed), so it neither stays
    ``training`` nor keeps its folder for the device's life; the current period's repeat, also
    interrupted, is the run taken next (it resumes), and an operator's run is left to its own resume."""
    from dfl_agent.runtime.service.default_run import default_descriptor

    cfg = config_from_dict({"federation": "f", "state_dir": str(tmp_path),
                            "algorithm": {"name": "fedavg", "rounds": 2, "every": "30d"}})
    current = default_descriptor(cfg).run_id
    base, idx = current.rsplit(".", 1)
    old = f"{base}.{int(idx) - 1}"
    ledger = RunLedger(tmp_path)
    run_dir = tmp_path / "runs" / old
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "round-00000001.safetensors").write_bytes(b"\0" * 4096)
    (run_dir / "checkpoints" / "round-00000001.json").write_text("{}")
    (run_dir / "run.toml").write_text("{}")
    (run_dir / "descriptor.json").write_text("{}")
    for rid in (old, current, "r-operator"):
        ledger.set(rid, "training", 1)
    ledger.close()
    m = _manager(cfg)  # the restart: the ledger read back from disk
    d = m.next_run()
    assert d is not None and d.run_id == current
    entry = m.ledger.entry(old)
    assert entry["state"] == "failed" and "its period is over" in entry["reason"], entry
    assert sorted(p.name for p in run_dir.iterdir()) == ["descriptor.json", "ended.json"]
    assert m.ledger.state(current) == "training" and m.ledger.state("r-operator") == "training"
    m.ledger.close()
    assert RunLedger(tmp_path).state(old) == "failed"


def _model_files() -> dict[str, bytes]:
    return {"model.safetensors": b"weights", "spec.json": b"{}"}


def test_a_stale_candidate_is_removed_at_start_and_a_newer_one_kept(tmp_path, caplog):
    """A refused candidate older than the deployed version (a later run deployed) is removed
    when the service starts, with an INFO line; one newer than it is kept for ``model deploy
    --force``."""
    from dfl_agent.deploy.versions import ModelStore
    from dfl_agent.runtime.service.run_manager import build_run_manager

    models = ModelStore(tmp_path)
    models.stage_candidate(_model_files(), {"run_id": "r-refused", "time": 1000.0})
    models.install(_model_files(), {"run_id": "r-deployed", "time": 2000.0})
    cfg = _config(tmp_path)
    with caplog.at_level(logging.INFO, logger="dfl_agent.daemon"):
        build_run_manager(cfg, None, agent_factory=Agent)
    assert not (tmp_path / "models" / "candidate").exists()
    assert any("candidate" in r.getMessage() and "older than the deployed v1" in r.getMessage()
               for r in caplog.records if r.levelno == logging.INFO)
    models.stage_candidate(_model_files(), {"run_id": "r-later", "time": 3000.0})
    build_run_manager(cfg, None, agent_factory=Agent)
    assert (tmp_path / "models" / "candidate" / "manifest.json").exists()


# -- a damaged run ledger ---------------------------------------------------------------------
def test_a_damaged_run_ledger_never_lets_a_finished_run_run_again(tmp_path):
    """The measured case: ``r-fin`` finished here, its descriptor still retained (queued in the
    lobby); the ledger is overwritten with ``{garbage`` and the cancel records with ``[[[[``.  The
    restarted service must not take ``r-fin`` again: the ledger refuses to open (one line naming
    the file and ``dflctl state recover``), and after the recovery ``r-fin`` is finished."""
    m = _manager(_config(tmp_path))
    d = _finish(m, "r-fin")
    m.ledger.remember_cancel("r-other")
    del m
    for name, junk in (("ledger.json", b"{garbage"), ("cancelled.json", b"[[[["), ("ledger.sqlite", b"{garbage")):
        if (tmp_path / "runs" / name).exists():
            (tmp_path / "runs" / name).write_bytes(junk)
    lobby = Lobby()
    lobby.queue.offer(d)  # still retained on the broker
    try:
        ledger = RunLedger(tmp_path)
    except StartupError as exc:
        refused = str(exc)
    else:
        m2 = RunManager(_config(tmp_path), None, node_id="n", profile=m_profile(), ledger=ledger, lobby=lobby,
                        agent_factory=FileAgent, notifier=Notifier(), hooks=RunHooks())
        again = m2.next_run()
        pytest.fail(f"the damaged ledger opened ({ledger.entries and dict(ledger.entries)!r}) and the finished run "
                    f"{again.run_id if again else None} was taken again")
    assert "\n" not in refused
    assert refused.startswith(f"run ledger {tmp_path / 'runs' / 'ledger.sqlite'}: ")
    assert f"dflctl state recover --state-dir {tmp_path}" in refused

    from dfl_agent.runtime.service.ledger_recovery import recover

    res = recover(tmp_path)
    assert res["from_folders"] == 1 and (Path(res["moved_to"]) / "ledger.sqlite").read_bytes() == b"{garbage"
    m2 = RunManager(_config(tmp_path), None, node_id="n", profile=m_profile(), ledger=RunLedger(tmp_path),
                    lobby=lobby, agent_factory=FileAgent, notifier=Notifier(), hooks=RunHooks())
    assert m2.next_run() is None
    assert m2.ledger.state("r-fin") == "finished"  # from its folder's ended.json


def m_profile():
    from dfl_agent.profiles import resolve_profile

    return resolve_profile("generic-x86", {"behaviour": {"algorithms": ["fedavg"]}})[0]


def test_the_agent_refuses_to_start_on_a_damaged_run_ledger(tmp_path):
    """The real ``dfl-agent run``: exit code 2 and the one line, before it connects anywhere."""
    from dfl_agent.runtime.shared.config import dump_toml

    state = tmp_path / "state"
    (state / "runs").mkdir(parents=True)
    (state / "runs" / "ledger.sqlite").write_bytes(b"\0" * 8192)
    cfg = config_from_dict({"federation": "f", "state_dir": str(state), "node_id": "n1",
                            "mqtt": {"broker": "127.0.0.1:9"}, "discovery": {"mdns": False}})
    path = tmp_path / "node.toml"
    path.write_text(dump_toml(cfg))
    r = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "run ledger" in ln and " INFO " not in ln]
    assert len(lines) == 1 and "holds only zero bytes" not in lines[0], lines
    assert f"run ledger {state / 'runs' / 'ledger.sqlite'}: begins with zero bytes" in lines[0]
    assert f"dflctl state recover --state-dir {state}" in lines[0]


@pytest.mark.parametrize("damage", ["empty", "zeroed", "half", "garbage", "another database"])
def test_every_kind_of_damage_refuses_the_ledger_with_one_line(tmp_path, damage):
    from dfl_agent.runtime.service.ledger import RunLedgerDamaged

    led = RunLedger(tmp_path)
    for i in range(40):
        led.set(f"r{i}", "finished", 3, "x" * 200)
    led.close()
    p = tmp_path / "runs" / "ledger.sqlite"
    size = p.stat().st_size
    if damage == "empty":
        p.write_bytes(b"")
    elif damage == "zeroed":
        p.write_bytes(b"\0" * size)
    elif damage == "half":
        with open(p, "r+b") as f:
            f.truncate(size // 2 + 100)
    elif damage == "garbage":
        p.write_bytes(b"{garbage")
    else:
        p.unlink()
        with sqlite3.connect(p) as con:
            con.execute("CREATE TABLE other (x)")
    with pytest.raises(RunLedgerDamaged) as exc:
        RunLedger(tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"run ledger {p}: ") and "dflctl state recover" in msg
    assert exc.value.what in {"empty": "is 0 bytes (truncated)",
                              "zeroed": f"begins with zero bytes where SQLite's header belongs ({size} bytes: zeroed)",
                              "half": exc.value.what, "garbage": exc.value.what,
                              "another database": "holds no run ledger (tables other)"}[damage]
    if damage == "half":
        assert "truncated" in exc.value.what
    if damage == "garbage":
        assert "not a readable SQLite database" in exc.value.what


def test_a_missing_ledger_beside_run_folders_is_refused(tmp_path):
    from dfl_agent.runtime.service.ledger import RunLedgerDamaged

    m = _manager(_config(tmp_path))
    _finish(m, "r1")
    m.ledger.close()
    for p in (tmp_path / "runs").glob("ledger.sqlite*"):
        p.unlink()
    with pytest.raises(RunLedgerDamaged, match=r"is missing, but 1 run folder\(s\) show runs that ran here \(r1\)"):
        RunLedger(tmp_path)


def test_a_ledger_that_lost_its_last_writes_is_caught_up_from_ended_json(tmp_path, caplog):
    """The ledger's row of an ended run is gone (its journal cut off): the start records it again
    from the run folder's ``ended.json``, at WARNING."""
    from dfl_agent.runtime.service.state_files import open_checked as open_state

    cfg = _config(tmp_path)
    m = _manager(cfg)
    _finish(m, "r1")
    m.ledger._con.execute("DELETE FROM runs WHERE run_id = 'r1'")
    m.ledger.close()
    with caplog.at_level(logging.WARNING, logger="dfl_agent.daemon"):
        led = open_state(cfg)
    assert led.state("r1") == "finished" and led.entries["r1"]["round"] == 2
    assert [r.getMessage() for r in caplog.records if "lost the record" in r.getMessage()] == [
        f"run ledger {tmp_path / 'runs' / 'ledger.sqlite'}: it lost the record of 1 run(s) that ended here (its last "
        "writes were cut off?); recorded again from their folders' ended.json: r1 (finished)"]


# -- migration from release 0.1.0 ------------------------------------------------------------
def test_release_0_1_0_ledger_and_cancel_records_are_taken_over(tmp_path, caplog):
    """``runs/ledger.json`` and ``runs/cancelled.json`` written by 0.1.0's own RunLedger
    (tests/fixtures/compat/0.1.0/runs/generate.py) are taken over at the first open: every entry
    and cancel record the same, the files kept as ``*.migrated`` byte for byte, one INFO line;
    a second open takes nothing over again."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("ledger.json", "cancelled.json"):
        shutil.copyfile(FIXTURE / name, runs / name)
    want = json.loads((FIXTURE / "ledger.json").read_text())
    with caplog.at_level(logging.INFO, logger="dfl_agent.daemon"):
        led = RunLedger(tmp_path)
    assert dict(led.entries) == want
    assert led.cancelled == json.loads((FIXTURE / "cancelled.json").read_text())
    assert led.is_done("r-fin") and led.entries["r-fin"]["snapshot_last_id"] == 412
    assert led.is_cancelled("r-never-seen") and not led.is_done("r-trained")
    assert sorted(led.in_states(("trained", "deploying"))) == ["r-deploying", "r-trained"]
    for name in ("ledger.json", "cancelled.json"):
        assert not (runs / name).exists()
        assert (runs / f"{name}.migrated").read_bytes() == (FIXTURE / name).read_bytes()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and infos[0].startswith("run ledger: took over 8 runs and 2 cancel records"), infos
    led.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dfl_agent.daemon"):
        assert dict(RunLedger(tmp_path).entries) == want
    assert not caplog.records


def test_an_unreadable_0_1_0_cancel_file_is_taken_over_without_it_at_warning(tmp_path, caplog):
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copyfile(FIXTURE / "ledger.json", runs / "ledger.json")
    (runs / "cancelled.json").write_bytes(b"[[[[")
    with caplog.at_level(logging.WARNING, logger="dfl_agent.daemon"):
        led = RunLedger(tmp_path)
    assert led.cancelled == {} and led.is_cancelled("r-unstarted")  # recorded cancelled in the ledger itself
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "cancelled.json (an earlier release's cancel records) cannot be read" in warning


def test_an_unreadable_0_1_0_ledger_refuses_the_start(tmp_path):
    from dfl_agent.runtime.service.ledger import RunLedgerDamaged

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "ledger.json").write_bytes(b"{garbage")
    with pytest.raises(RunLedgerDamaged, match=r"ledger\.json: cannot be read .*an earlier release's run ledger"):
        RunLedger(tmp_path)
    assert not (tmp_path / "runs" / "ledger.sqlite").exists()


# -- the other state files at start ---------------------------------------------------------------
def test_damaged_members_and_checkpoints_of_an_unfinished_run_are_removed_at_warning(tmp_path, caplog):
    import hashlib

    from dfl_agent.runtime.service.state_files import open_checked as open_state

    cfg = _config(tmp_path)
    led = RunLedger(tmp_path)
    led.set("r-on", "training", 2)
    led.close()
    ck = tmp_path / "runs" / "r-on" / "checkpoints"
    ck.mkdir(parents=True)
    for t in (1, 2):
        blob = bytes([t]) * 1000
        (ck / f"round-{t:08d}.safetensors").write_bytes(blob)
        (ck / f"round-{t:08d}.json").write_text(json.dumps({"format": "dfl-checkpoint/1", "round": t,
                                                            "tensors_sha256": hashlib.sha256(blob).hexdigest()}))
    with open(ck / "round-00000002.safetensors", "r+b") as f:
        f.truncate(300)  # cut short by a power cut
    (tmp_path / "runs" / "r-on" / "members.json").write_bytes(b"\0\0\0\0")
    with caplog.at_level(logging.WARNING, logger="dfl_agent.daemon"):
        open_state(cfg).close()
    assert sorted(p.name for p in ck.iterdir()) == ["round-00000001.json", "round-00000001.safetensors"]
    assert not (tmp_path / "runs" / "r-on" / "members.json").exists()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 2 and re.fullmatch(
        re.escape(f"state file {tmp_path / 'runs' / 'r-on' / 'members.json'}: cannot be read (") + r".+" +
        re.escape("); removed: the run resumes with the members its peers name"), lines[0]), lines
    assert lines[1:] == [
        f"checkpoint {ck / 'round-00000002.json'}: its tensors file fails the SHA-256 the manifest names (cut short "
        "or corrupt); removed: the run resumes from the checkpoint of round 1"], lines


def test_damaged_model_versions_current_and_last_version_at_start(tmp_path, caplog):
    from dfl_agent.deploy.versions import ModelStore
    from dfl_agent.runtime.service.state_files import check_models

    models = ModelStore(tmp_path, keep=5)
    for i in range(3):
        models.install(_model_files() | {"model.safetensors": b"w%d" % i}, {"run_id": f"r{i}"})
    assert models.current_version() == 3
    (tmp_path / "models" / "v3" / "model.safetensors").write_bytes(b"")  # cut short
    (tmp_path / "models" / "v1" / "manifest.json").write_bytes(b"\0" * 10)  # zeroed
    (tmp_path / "models" / ".last_version").write_bytes(b"")
    lines = [f.line for f in check_models(tmp_path)]
    assert models.current_version() == 2 and sorted(p.name for p in (tmp_path / "models").glob("v*")) == ["v2", "v3"]
    assert (tmp_path / "models" / ".last_version").read_text() == "3"
    assert lines[0].startswith(f"model version {tmp_path / 'models' / 'v1'}: ") and lines[0].endswith("removed (it is "
                                                                                                    "not the current one)")
    assert lines[1].startswith(f"deployed model {tmp_path / 'models' / 'current'}: ") and \
        "SHA-256 mismatch" in lines[1] and "switched back to v2" in lines[1]
    assert "cannot be read" in lines[2] and "written again as 3" in lines[2]
    assert models.install(_model_files(), {"run_id": "r3"}) == 4  # never a number used before


def test_a_damaged_node_id_refuses_the_start(tmp_path):
    from dfl_agent.runtime.service.state_files import check_state

    (tmp_path / "node_id").write_bytes(b"")
    with pytest.raises(StartupError, match=r"node_id: is empty \(truncated\); the agent does not start under "
                                           r"another identity"):
        check_state(_config(tmp_path), None)
    assert check_state(config_from_dict({"federation": "f", "state_dir": str(tmp_path), "node_id": "n1"}), None) == []


def test_a_sample_store_cut_short_refuses_the_start(tmp_path):
    from dfl_agent.runtime.service.state_files import check_state

    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "samples.sqlite").write_bytes(b"")
    with pytest.raises(StartupError, match=r"sample store .*samples\.sqlite: is 0 bytes \(truncated\); the agent does "
                                           r"not start: move the folder"):
        check_state(_config(tmp_path), None)


# -- every state write: a kill at its crash point, then a truncation ---------------------------
def _killed_at(point: str, fn) -> None:
    """Run ``fn`` in a forked child whose crash point is ``point``; it must die by SIGKILL."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.setpgrp()  # crash_point kills its own process group: this child alone
            os.environ[CRASH_ENV] = point
            fn()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{point}: not killed ({status})"


def _truncate(path: Path, keep: int = 0) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def test_the_run_ledger_survives_a_kill_inside_its_transaction_and_refuses_a_truncation(tmp_path):
    led = RunLedger(tmp_path)
    led.set("r1", "training", 1)
    led.close()
    _killed_at("run-ledger:before-commit", lambda: RunLedger(tmp_path).set("r1", "finished", 3))
    _killed_at("run-ledger:before-commit", lambda: RunLedger(tmp_path).remember_cancel("r2"))
    led = RunLedger(tmp_path)
    assert led.state("r1") == "training" and led.cancelled == {}
    led.set("r1", "finished", 3)
    led.close()
    _truncate(tmp_path / "runs" / "ledger.sqlite", 4096)
    with pytest.raises(StartupError, match="truncated"):
        RunLedger(tmp_path)


def test_the_migration_survives_a_kill_before_its_rename(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("ledger.json", "cancelled.json"):
        shutil.copyfile(FIXTURE / name, runs / name)
    _killed_at("write:ledger.sqlite", lambda: RunLedger(tmp_path))
    assert not (runs / "ledger.sqlite").exists() and (runs / "ledger.json").exists()
    assert len(RunLedger(tmp_path).entries) == 8  # taken over at the next start


def _counters(state: Path, n: int) -> None:
    from types import SimpleNamespace

    from dfl_agent.runtime.service.service_counters import ServiceCounters

    lobby = SimpleNamespace(verifier=SimpleNamespace(refused={"malformed": n}), dropped={})
    ServiceCounters(state, lobby).save()


def _seq(state: Path) -> None:
    from dfl_agent.security.trust import SeqCounter

    c = SeqCounter(state / "control_seq.json", block=1)
    for _ in range(3):
        c.next("status")


def _members(state: Path, who: list[str]) -> None:
    from dfl_agent.fsutil import atomic_write

    atomic_write(state / "members.json", json.dumps({"members": who}))  # as rejoin._save_members writes it


def settle_all_kept(state: Path) -> None:
    from dfl_agent.runtime.service.retention import settle_all

    settle_all(RunLedger(state), keep_files=True)


def _descriptor(state: Path, rid: str) -> None:
    m = _manager(_config(state))
    m.admit(RunDescriptor(run_id=rid, federation="f", algorithm="fedavg", rounds=2))


@pytest.mark.parametrize("name", ["counters.json", "control_seq.json", "members.json", "descriptor.json",
                                  "node_id", ".last_version", "ended.json"])
def test_each_atomic_state_write_survives_a_kill_before_its_rename(tmp_path, name, caplog):
    """Write the file once, then again in a child killed at ``write:NAME`` (its new content
    complete under the temporary name): the file holds the first content, whole; the start
    removes the temporary; a truncation of the file then gives the documented outcome."""
    from dfl_agent.runtime.service.state_files import TEMPORARY, check_state

    state = tmp_path
    first = second = None
    if name == "counters.json":
        first, second = (lambda: _counters(state, 1)), (lambda: _counters(state, 2))
        path = state / name
    elif name == "control_seq.json":
        first = second = lambda: _seq(state)
        path = state / name
    elif name == "members.json":
        first, second = (lambda: _members(state, ["a"])), (lambda: _members(state, ["a", "b"]))
        path = state / name
    elif name == "descriptor.json":
        first, second = (lambda: _descriptor(state, "r1")), (lambda: _descriptor(state, "r1"))
        path = state / "runs" / "r1" / name
    elif name == "node_id":
        from dfl_agent.runtime.shared.run_config import node_id_from_state

        path = state / name
        first = lambda: node_id_from_state(state, None)  # noqa: E731

        def second():  # written when missing only
            path.unlink()
            node_id_from_state(state, None)
    elif name == ".last_version":
        from dfl_agent.deploy.versions import ModelStore

        first = second = lambda: ModelStore(state).install(_model_files(), {"run_id": "r"})
        path = state / "models" / name
    else:
        m = _manager(_config(state, keep_run_files=True))
        first = lambda: _finish(m, "r1")  # noqa: E731
        path = state / "runs" / "r1" / name

        def second():
            path.unlink()
            settle_all_kept(state)
    first()
    before = path.read_bytes()
    _killed_at(f"write:{path.name}", second)
    if name in ("node_id", "ended.json"):  # written only when missing: still missing, never half-written
        assert not path.exists()
        first() if name == "node_id" else settle_all_kept(state)
    else:
        assert path.read_bytes() == before
    left = [p for p in path.parent.iterdir() if TEMPORARY.match(p.name)]
    assert left and all(p.name.startswith(f".{path.name}.tmp") for p in left)
    check_state(config_from_dict({"federation": "f", "state_dir": str(state), "node_id": "n1"}), None)
    assert not [p for p in path.parent.iterdir() if TEMPORARY.match(p.name)]  # the start removed it
    _truncate(path)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        if name == "counters.json":
            from dfl_agent.runtime.service.service_counters import load_counters

            assert load_counters(path) == {"runs_refused": {}, "control_dropped": {}}
            assert "the refusal and drop counters start from 0" in caplog.text
        elif name == "control_seq.json":
            from dfl_agent.security.trust import SeqCounter

            SeqCounter._shared.clear()
            assert SeqCounter(path).next("status") > json.loads(before)["status"]  # never a number sent before
            assert "is unreadable; control sequence numbers restart from the clock" in caplog.text
        elif name == "members.json":
            [found] = check_state(_config(state, node_id="n1"), None)
            assert found.path == path and not path.exists()
        elif name == "descriptor.json":
            led = RunLedger(state)
            led.set("r1", "trained", 2)
            m = RunManager(_config(state), None, node_id="n", profile=m_profile(), ledger=led, lobby=Lobby(),
                           agent_factory=FileAgent, notifier=Notifier(), hooks=RunHooks())
            assert m.next_run() is None and led.state("r1") == "failed"  # not taken again: failed, said
            assert "run r1 failed: cannot resume after a restart" in caplog.text
        elif name == "node_id":
            with pytest.raises(StartupError, match="node_id: is empty"):
                check_state(_config(state), None)
        elif name == ".last_version":
            [found] = check_state(_config(state, node_id="n1"), None)
            assert "written again as 2" in found.line and path.read_text() == "2"
        else:
            from dfl_agent.runtime.service.retention import read_ended

            assert read_ended(path.parent) is None  # ignored: the ledger holds the same
            assert RunLedger(state).state("r1") == "finished"


def test_checkpoints_survive_a_kill_before_the_manifest_lands_and_a_truncation(tmp_path):
    """The node's checkpoint store (tensors, then the manifest that commits them): a kill before
    the manifest's rename leaves the previous checkpoint the newest that loads; a truncated
    tensors file is removed at start and the run resumes from the one before."""
    np = pytest.importorskip("numpy")
    from dfl_agent.runtime.node.checkpoint import CheckpointStore
    from dfl_agent.runtime.service.state_files import check_state

    store = CheckpointStore(tmp_path / "checkpoints")
    store.save(1, {"w": np.ones(4, np.float32)}, {})
    store.save(2, {"w": np.ones(4, np.float32) * 2}, {})
    _killed_at("write:round-00000003.json", lambda: store.save(3, {"w": np.ones(4, np.float32) * 3}, {}))
    assert store.load_latest().round == 2
    _truncate(tmp_path / "checkpoints" / "round-00000002.safetensors", 10)
    [found] = check_state(_config(tmp_path, node_id="n1"), None)
    assert "round-00000002.json" in found.line and "resumes from the checkpoint of round 1" in found.line
    assert store.load_latest().round == 1


# -- the one list of state files --------------------------------------------------------------
#: how each way of writing reads in the docs' table
WRITTEN = {"atomic": "atomic", "sqlite": "SQLite transaction", "folder": "folder renamed into place",
           "append": "appended line"}


def markdown_table() -> str:
    """The table of :data:`~dfl_agent.runtime.service.state_files.STATE_FILES` as
    ``docs/operations.md`` shows it (Markdown)."""
    from dfl_agent.runtime.service.state_files import STATE_FILES

    rows = ["| file | holds | written | size | when damaged |", "|---|---|---|---|---|"]
    rows += [f"| `{f.path}` | {f.holds} | {WRITTEN[f.written]} | {f.bound} | {f.damaged} |" for f in STATE_FILES]
    return "\n".join(rows) + "\n"


def test_the_docs_table_is_the_table_of_state_files():
    """docs/operations.md shows :data:`STATE_FILES` as they are (regenerate it with
    ``markdown_table()`` after a change)."""
    from dfl_agent.runtime.service.state_files import STATE_FILES

    assert all(f.written in ("atomic", "sqlite", "folder", "append") for f in STATE_FILES)
    assert markdown_table() in (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")


#: modules that write files that are not the agent's state (outputs a user names, caches)
NOT_STATE = {"runtime/node/simulator.py", "runtime/node/metrics.py", "models/onnx_export.py", "data/cache.py",
             "inference/member.py"}


def test_every_module_that_writes_state_is_in_the_table():
    """Every module of agent/ that writes a file (atomic_write, atomic_writer, write_text,
    open(..., "w"/"a"), os.open for writing) writes a state file of :data:`STATE_FILES`, or
    writes no state (:data:`NOT_STATE`)."""
    from dfl_agent.runtime.service.state_files import STATE_FILES

    writers = {w.strip().replace(".", "/") + ".py" for f in STATE_FILES for w in f.writer.split(",")}
    call = re.compile(r"\batomic_write(r)?\s*\(|\.write_(text|bytes)\s*\(|\bopen\([^)]*[\"'][wa]b?[\"']|O_WRONLY|"
                      r"\bwrite_head\s*\(")
    found = set()
    for path in sorted((ROOT / "agent").rglob("*.py")):
        rel = str(path.relative_to(ROOT / "agent"))
        if rel in ("fsutil.py",):
            continue
        if any(call.search(line.split("#", 1)[0]) for line in path.read_text(encoding="utf-8").splitlines()):
            found.add(rel)
    cgroup = {"runtime/service/cgroup.py"}  # the kernel's cgroup files, not state
    assert found - writers - NOT_STATE - cgroup == set()


def test_gzipped_round_records_keep_the_time_of_the_last_round(tmp_path):
    """Settling an ended run gzips its round records; the archive keeps their modification time
    (when the run wrote its last round), which readers such as the feed demo's summary take as
    the run's end (a fresh mtime made a deployment look 0.03 s older than the run's end)."""
    import os

    from dfl_agent.runtime.service.retention import settle_run

    folder = tmp_path / "runs" / "r1"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"round": 1}\n')
    os.utime(folder / "metrics.jsonl", (1_700_000_000, 1_700_000_000))
    assert settle_run(folder, {"state": "finished"})
    assert not (folder / "metrics.jsonl").exists()
    assert (folder / "metrics.jsonl.gz").stat().st_mtime == 1_700_000_000
