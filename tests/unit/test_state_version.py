"""The state folder's schema version (``STATE_DIR/state_version``) and its migrations.

Release 0.1.0 had no schema version: a later release could not tell an old folder from its own,
nor an older release a newer one.  Now a new folder gets this release's schema, an older one is
migrated forward step by step (each step's files copied aside first), and a newer one is refused
with one line (the agent exits 2 and changes nothing).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dfl_agent.runtime.service import ledger as run_ledger  # registers its part of schema 2
from dfl_agent.runtime.shared import state_version as sv
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

COMPAT = Path(__file__).resolve().parents[1] / "fixtures" / "compat" / "0.1.0"
PRIVACY_FIXTURE = COMPAT / "privacy" / "ledger.sqlite"


def _rows(db: Path) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return sorted(con.execute("SELECT run_id, state, noise_multiplier, sample_rate, steps FROM runs"))
    finally:
        con.close()


def read_cancelled(state_dir: Path) -> set[str]:
    """The cancelled run ids in the run ledger of ``state_dir``, read-only (see
    :func:`~dfl_agent.runtime.service.ledger.read_entries`)."""
    path = Path(state_dir) / "runs" / run_ledger.LEDGER_FILE
    try:
        con = sqlite3.connect(run_ledger.sqlite_uri(path, "ro"), uri=True, timeout=30.0)
        try:
            return {r[0] for r in con.execute("SELECT run_id FROM cancelled")}
        finally:
            con.close()
    except sqlite3.Error:
        return set()


def _old_folder(d: Path) -> Path:
    """A state folder as release 0.1.0 leaves it: no state_version, an unchained privacy ledger."""
    (d / "privacy").mkdir(parents=True)
    shutil.copyfile(PRIVACY_FIXTURE, d / "privacy" / "ledger.sqlite")
    (d / "node_id").write_text("n-0ld\n")
    return d


def test_a_new_folder_gets_this_schema(tmp_path: Path) -> None:
    info = sv.open_state(tmp_path / "state")
    assert info.found is None and not info.migrated
    doc = json.loads((tmp_path / "state" / sv.STATE_FILE).read_text())
    assert doc["schema"] == sv.STATE_VERSION and doc["migrations"] == []
    assert sv.open_state(tmp_path / "state").found == sv.STATE_VERSION  # opened again: nothing to do


def test_an_old_folder_is_migrated_once_with_a_backup(tmp_path: Path) -> None:
    d = _old_folder(tmp_path / "state")
    before = _rows(d / "privacy" / "ledger.sqlite")
    info = sv.open_state(d, clock=lambda: 1796200000.0)
    assert info.found == 1 and [m["to"] for m in info.migrated] == [2]
    step = info.migrated[0]
    assert step["did"] == "privacy ledger chained (5 rows)"
    # the copy of what the step rewrote: the ledger as release 0.1.0 left it (no chain)
    backup = d / step["backup"]
    assert backup.name == "schema-1-20261202T082640Z"
    kept = backup / "privacy" / "ledger.sqlite"
    con = sqlite3.connect(kept)
    assert {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")} == {"runs"}
    con.close()
    assert _rows(kept) == before == _rows(d / "privacy" / "ledger.sqlite")
    # the ledger itself is chained now, and the folder records schema 2 and how it got there
    con = sqlite3.connect(d / "privacy" / "ledger.sqlite")
    assert con.execute("SELECT count(*) FROM events").fetchone()[0] == 5
    con.close()
    doc = json.loads((d / sv.STATE_FILE).read_text())
    assert doc["schema"] == 2 and doc["migrations"][0]["from"] == 1 and doc["migrations"][0]["release"] == "0.2.0"
    assert (d / "node_id").read_text() == "n-0ld\n"
    again = sv.open_state(d)
    assert again.found == 2 and not again.migrated
    assert len(list((d / sv.BACKUP_DIR).iterdir())) == 1


def test_steps_run_in_order_and_a_failed_step_leaves_the_last_schema(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry is how later migrations join: a step to schema 3 registered beside the one to 2
    runs after it; one that fails leaves the folder at schema 2, its files copied aside, and runs
    again at the next start."""
    d = _old_folder(tmp_path / "state")
    (d / "later.json").write_text('{"r1": {"state": "finished"}}\n')
    calls: list[str] = []
    fail = [True]

    def to_3(state_dir: Path) -> str:
        calls.append("3")
        if fail[0]:
            raise OSError("disk full")
        (state_dir / "later.json").write_text('{"format": 3}\n')
        return "later.json rewritten"

    monkeypatch.setattr(sv, "MIGRATIONS", {k: list(v) for k, v in sv.MIGRATIONS.items()})
    monkeypatch.setattr(sv, "STATE_VERSION", 3)
    sv.register(sv.Migration(3, "test step", ("later.json",), to_3))
    with pytest.raises(ValueError):  # one part of a name per schema
        sv.register(sv.Migration(3, "test step", (), to_3))
    with pytest.raises(sv.StartupError, match=r"migration to schema 3 \(test step\) failed: OSError: disk full; "
                                              r"it stays at schema 2"):
        sv.open_state(d)
    assert json.loads((d / sv.STATE_FILE).read_text())["schema"] == 2
    fail[0] = False
    info = sv.open_state(d)
    assert info.found == 2 and [m["to"] for m in info.migrated] == [3] and calls == ["3", "3"]
    backups = sorted(p.name for p in (d / sv.BACKUP_DIR).iterdir())
    assert len(backups) == 3  # schema 1's privacy folder, and schema 2's later.json (twice: one per try)
    kept = [d / sv.BACKUP_DIR / b / "later.json" for b in backups if b.startswith("schema-2-")]
    assert kept and all(k.read_text() == '{"r1": {"state": "finished"}}\n' for k in kept)
    doc = json.loads((d / sv.STATE_FILE).read_text())
    assert [(m["from"], m["to"]) for m in doc["migrations"]] == [(1, 2), (2, 3)]


def test_release_0_1_0s_run_ledger_is_taken_over_by_the_migration_with_a_backup(tmp_path: Path) -> None:
    """Schema 2's run-ledger part: 0.1.0's runs/ledger.json and cancelled.json (the committed
    fixture) copied to state-backup/ first, then taken over into runs/ledger.sqlite."""
    d = _old_folder(tmp_path / "state")
    shutil.copytree(COMPAT / "runs", d / "runs", ignore=shutil.ignore_patterns("*.py"))
    before = {n: (d / "runs" / n).read_bytes() for n in ("ledger.json", "cancelled.json")}
    info = sv.open_state(d, clock=lambda: 1796200000.0)
    step = info.migrated[0]
    assert step["name"] == "the privacy ledger is hash-chained; the run ledger moves to SQLite"
    legacy = json.loads(before["ledger.json"])
    assert f"run ledger moved to SQLite ({len(legacy)} runs, " in step["did"]
    backup = d / step["backup"]
    assert {n: (backup / "runs" / n).read_bytes() for n in before} == before
    assert not (d / "runs" / "ledger.json").exists() and (d / "runs" / "ledger.json.migrated").exists()
    entries = run_ledger.read_entries(d)
    assert set(entries) == set(legacy) and all(entries[r]["state"] == legacy[r]["state"] for r in legacy)
    assert read_cancelled(d) == set(json.loads(before["cancelled.json"]))


def test_a_newer_folder_is_refused_and_left_alone(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir()
    newer = json.dumps({"schema": sv.STATE_VERSION + 1, "release": "9.0.0", "migrations": []})
    (d / sv.STATE_FILE).write_text(newer)
    with pytest.raises(sv.StateVersionError) as err:
        sv.open_state(d)
    msg = str(err.value)
    assert "\n" not in msg and f"has schema {sv.STATE_VERSION + 1}, written by dfl-agent 9.0.0" in msg
    assert (d / sv.STATE_FILE).read_text() == newer and sorted(p.name for p in d.iterdir()) == [sv.STATE_FILE]
    (d / sv.STATE_FILE).write_text("{not json")
    with pytest.raises(sv.StateVersionError, match="is not a state version document"):
        sv.open_state(d)


def test_the_agent_exits_2_with_one_line_on_a_newer_folder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / sv.STATE_FILE).write_text(json.dumps({"schema": sv.STATE_VERSION + 1, "release": "9.0.0"}))
    (state / "node_id").write_text("n-new\n")
    cfg = config_from_dict({"federation": "f", "node_id": "a", "state_dir": str(state),
                            "mqtt": {"broker": "127.0.0.1:1"}, "data": {"dataset": "iris"}})
    (tmp_path / "a.toml").write_text(dump_toml(cfg))
    r = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config",
                        str(tmp_path / "a.toml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot start: the state folder" in lines[0] and "schema 3" in lines[0], r.stderr
    assert sorted(p.name for p in state.iterdir()) == ["node_id", sv.STATE_FILE]  # nothing written
