"""The privacy ledger fails closed and is tamper-evident (real SQLite, a real sample store, real
processes killed at exact points).

A ledger emptied, truncated, edited, cut short or removed declines every DP run with one line
naming the file and the recovery command, and reserves nothing; ``dfl-agent run --once`` exits 2
with that line; ``dflctl privacy recover`` starts a new chain that never lowers the spent ε; a
ledger written by release 0.1.0 is chained on its first open; a power cut during a write leaves
the write whole or rolled back, and a torn write that the head marker already counted is
detected; a device whose reported ε goes down is flagged by its peers and by ``dflctl``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from dfl_agent.privacy.accountant import rdp_epsilon
from dfl_agent.runtime.service.privacy_budget import PrivacyBudget
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger
from tests.unit.test_privacy_budget import _plan, _run, _store_cfg

DP = {"lifetime_epsilon": 10.0, "dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}}
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "compat" / "0.1.0" / "privacy" / "ledger.sqlite"


def _budget(state: Path, store=None, keep_runs: int = 20) -> PrivacyBudget:
    from dfl_agent.profiles import get_profile

    cfg = config_from_dict({"state_dir": str(state), "algorithm": {"name": "local", "rounds": 5},
                            "runtime": {"keep_runs": keep_runs},
                            "training": {"batch_size": 20, "steps": 4},
                            "data": {"dataset": "store", "input_shape": [3, 4], "num_classes": 2}, "privacy": DP})
    return PrivacyBudget(cfg, get_profile("generic-x86"), store)


def _spend(budget: PrivacyBudget, state: Path, *runs: str) -> float:
    """Admit, train and settle ``runs`` (5 rounds of 4 DP steps each); the composed ε after."""
    for rid in runs:
        assert budget.admit(_run(rid)) is None
        run_dir = state / "runs" / rid
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"round": t, "dp_steps": 4}) + "\n"
                                                       for t in range(1, 6)))
        budget.on_state(rid, "training", run_dir)
        assert budget.on_state(rid, "finished", run_dir)["privacy"]["state"] == "spent"
    return budget.status()["epsilon_spent"]


def _sql(statement: str):
    def damage(path: Path) -> None:
        con = sqlite3.connect(path)
        con.execute(statement)
        con.commit()
        con.close()
    return damage


def _truncate(fraction: float):
    def damage(path: Path) -> None:
        os.truncate(path, int(path.stat().st_size * fraction))
    return damage


#: what an operator or a power cut does to the file, and what the refusal says
DAMAGE = {
    "zero-bytes": (_truncate(0.0), "is 0 bytes"),
    "truncated": (_truncate(0.5), r"is \d+ bytes, but its header counts \d+ pages of \d+ bytes \(truncated\)"),
    "row-edited-to-released": (_sql("UPDATE runs SET state = 'released' WHERE run_id = 'a'"),
                               "table runs disagrees with its history at run a: state 'released'"),
    "row-removed": (_sql("DELETE FROM runs WHERE run_id = 'a'"), "table runs lacks run a"),
    "ledger-removed": (lambda p: p.unlink(), "is missing, but its head marker .* records 6 rows"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_ledger_declines_dp_runs_with_one_line(tmp_path: Path, damage: str, caplog) -> None:
    """Measured on 0.1.0: after ``: > privacy/ledger.sqlite`` the next run was admitted with the
    budget given back ("lifetime 8 of 10"); a hand-edited row was taken as is.  Now the restarted
    agent says what is wrong at start, declines the DP run with one line naming the file and the
    recovery command, reserves nothing, and its status says the ledger is damaged."""
    from dfl_agent.cli.tables import privacy_text

    cfg, store = _store_cfg(tmp_path, DP)
    spent = _spend(_budget(tmp_path, store), tmp_path, "a", "b")
    assert spent > 0
    ledger = tmp_path / "privacy" / "ledger.sqlite"
    fn, says = DAMAGE[damage]
    fn(ledger)
    before = ledger.read_bytes() if ledger.exists() else None
    with caplog.at_level(logging.ERROR, logger="dfl_agent.daemon"):
        budget = _budget(tmp_path, store)  # the agent restarted
    at_start = [r.getMessage() for r in caplog.records]
    reason = budget.admit(_run("c"))
    assert reason is not None, f"a damaged ledger admitted a DP run: {budget.status()}"
    assert "\n" not in reason and reason.startswith(f"privacy ledger {ledger}: "), reason
    import re

    assert re.search(says, reason), reason
    assert f"dflctl privacy recover --state-dir {tmp_path} --spent-epsilon E" in reason
    assert (ledger.read_bytes() if ledger.exists() else None) == before  # nothing reserved, nothing written
    assert at_start == [reason]  # said at start, at ERROR, in the same words
    st = budget.status()
    assert st["ledger"] == "damaged" and "epsilon_spent" not in st and privacy_text(st) == "ledger damaged"
    assert budget.admit(_run("d")) == reason  # every DP run, until an operator recovers it


def test_edits_that_keep_the_table_consistent_break_the_chain(tmp_path: Path) -> None:
    """Someone who edits the history too: a settlement removed with its row put back to
    ``reserved``, rows swapped, a row's steps changed, the head marker deleted."""
    from dfl_agent.runtime.shared.privacy_ledger import HEAD_FILE, LedgerDamaged

    led = PrivacyLedger(tmp_path / "s")
    for rid in ("a", "b"):
        led.reserve(rid, _plan(1.0, 0.05, 200), rounds=5)
        led.mark_trained(rid)
        led.settle(rid, 200)
    last = sqlite3.connect(led.path).execute("SELECT max(seq) FROM events").fetchone()[0]
    assert last == 6
    cases = {
        "the last settlement cut off": ["DELETE FROM events WHERE seq = 6",
                                        "UPDATE runs SET state = 'reserved', settled = NULL WHERE run_id = 'b'"],
        "rows swapped": ["UPDATE events SET seq = -1 WHERE seq = 2", "UPDATE events SET seq = 2 WHERE seq = 3",
                         "UPDATE events SET seq = 3 WHERE seq = -1"],
        "steps changed": ["UPDATE events SET body = replace(body, '\"steps\":200', '\"steps\":2') WHERE seq = 3",
                          "UPDATE runs SET steps = 2 WHERE run_id = 'a'"],
        "a middle row removed": ["DELETE FROM events WHERE seq = 2"],
    }
    said = {}
    for name, statements in cases.items():
        d = tmp_path / name.replace(" ", "-")
        shutil.copytree(tmp_path / "s", d)
        for s in statements:
            _sql(s)(d / "privacy" / "ledger.sqlite")
        with pytest.raises(LedgerDamaged) as exc:
            PrivacyLedger(d).state()
        said[name] = exc.value.what
    d = tmp_path / "no-marker"
    shutil.copytree(tmp_path / "s", d)
    (d / HEAD_FILE).unlink()
    with pytest.raises(LedgerDamaged, match="its head marker .* is missing"):
        PrivacyLedger(d).state()
    assert said == {
        "the last settlement cut off": "holds 5 rows of history, but its head marker records 6: rows were removed",
        "rows swapped": "row 2 of its history (run a, settle) was changed: its hash does not match",
        "steps changed": "row 3 of its history (run a, settle) was changed: its hash does not match",
        "a middle row removed": "row 2 of its history is missing (the rows go on at 3)",
    }
    assert PrivacyLedger(tmp_path / "s").state().events == 6  # the original verifies


def test_recovery_restores_admission_without_lowering_the_spent_epsilon(tmp_path: Path, capsys) -> None:
    """``dflctl privacy verify`` names the damage (exit 1) and what the device's records still
    show; ``recover`` refuses an ε below them (exit 2) and otherwise starts a new chain whose first
    row carries the stated ε: the next run is admitted against it, never against less."""
    from dfl_agent.cli.dflctl import main

    cfg, store = _store_cfg(tmp_path, DP)
    spent = _spend(_budget(tmp_path, store), tmp_path, "a", "b")
    ledger = tmp_path / "privacy" / "ledger.sqlite"
    ledger.write_bytes(b"")  # : > privacy/ledger.sqlite
    sd = ["--state-dir", str(tmp_path)]
    capsys.readouterr()
    assert main(["privacy", "verify", *sd]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"privacy ledger {ledger}: is 0 bytes (truncated)")
    assert f"the device's records still show epsilon {spent:.4g}"[:-1] in out, out
    assert main(["privacy", "recover", *sd, "--spent-epsilon", f"{spent / 2:g}"]) == 2  # below the records
    assert "a recovery never lowers a spent budget" in capsys.readouterr().err
    assert ledger.stat().st_size == 0
    assert main(["privacy", "recover", *sd, "--spent-epsilon", f"{spent:.4f}"]) == 0  # the status's figure
    out = capsys.readouterr().out
    assert "a new chain opens with epsilon" in out and "the damaged files are kept in" in out
    assert main(["privacy", "verify", *sd]) == 0
    assert "carried over by a recovery" in capsys.readouterr().out
    budget = _budget(tmp_path, store)
    st = budget.status()
    assert st["epsilon_spent"] >= spent and st["epsilon_carried"] == pytest.approx(spent, abs=1e-4)
    assert budget.admit(_run("c")) is None  # admitted again, against the carried amount plus its own
    row = budget.ledger.get("c")
    assert budget.status()["epsilon_spent"] == pytest.approx(spent + row["epsilon"], abs=2e-4)
    assert main(["privacy", "recover", *sd, "--spent-epsilon", "99"]) == 2  # a sound ledger: nothing to recover
    assert "nothing to recover" in capsys.readouterr().err


def test_run_once_with_a_corrupt_ledger_exits_2_with_one_line(tmp_path: Path) -> None:
    """Measured on 0.1.0: a traceback (``sqlite3.DatabaseError`` through admission) and exit 1.
    Now the real ``dfl-agent run --once`` says what is wrong in one line and exits 2."""
    cfg, store = _store_cfg(tmp_path, DP)
    from dfl_agent.runtime.service.ledger import RunLedger

    runs = RunLedger(tmp_path)  # the run ledger records the run that spent, as on a device
    _spend(_budget(tmp_path, store), tmp_path, "a")
    store.close()
    runs.set("a", "finished", 5)
    runs.close()
    ledger = tmp_path / "privacy" / "ledger.sqlite"
    with open(ledger, "r+b") as f:
        f.write(b"this is no database" * 4)  # a corrupt header
    raw = {"federation": "f", "node_id": "dev1", "state_dir": str(tmp_path),
           "algorithm": {"name": "local", "rounds": 5}, "training": {"batch_size": 20, "steps": 4},
           "data": {"dataset": "store", "input_shape": [3, 4], "num_classes": 2},
           "model": {"spec": {"type": "mlp", "input_shape": [3, 4], "hidden": [8], "num_classes": 2}},
           "mqtt": {"broker": "127.0.0.1:9"}, "discovery": {"mdns": False}, "privacy": DP}
    path = tmp_path / "node.toml"
    path.write_text(dump_toml(config_from_dict(raw)))
    r = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if "cannot start: run " in ln]
    assert len(lines) == 1, out[-3000:]
    assert f"privacy ledger {ledger}: is not a readable SQLite database (file is not a database); DP runs are " \
           f"refused until an operator runs: dflctl privacy recover --state-dir {tmp_path}" in lines[0]


def test_a_ledger_of_release_0_1_0_is_chained_on_its_first_open(tmp_path: Path, caplog) -> None:
    """The fixture was written by 0.1.0's own ``PrivacyLedger`` (its generator beside it).  The
    first open copies it, chains its rows in one transaction and says so at INFO; the rows and the
    composed ε are those 0.1.0 read; from then on an edit is detected."""
    from dfl_agent.cli.dflctl import main

    state = tmp_path / "state"
    (state / "privacy").mkdir(parents=True)
    shutil.copyfile(FIXTURE, state / "privacy" / "ledger.sqlite")
    shutil.copyfile(FIXTURE, tmp_path / "fixture.sqlite")  # read a copy: SQLite adds files beside what it opens
    con = sqlite3.connect(tmp_path / "fixture.sqlite")
    cols = [c[1] for c in con.execute("PRAGMA table_info(runs)")]
    old = [dict(zip(cols, r)) for r in con.execute("SELECT * FROM runs ORDER BY time, run_id")]
    con.close()
    history = [(r["noise_multiplier"], r["sample_rate"], r["steps"]) for r in old
               if r["state"] != "released" and r["steps"] > 0]
    assert len(old) == 5 and {r["state"] for r in old} == {"spent", "released", "reserved"}
    with caplog.at_level(logging.INFO, logger="dfl_agent.daemon"):
        led = PrivacyLedger(state)
        assert led.entries() == old
    assert f"privacy ledger {state / 'privacy' / 'ledger.sqlite'}: chained its 5 rows" in caplog.text
    assert led.epsilon(1e-5) == rdp_epsilon(history, 1e-5)  # the accountant's figure is unchanged
    from dfl_agent.runtime.shared.privacy_ledger import HEAD_FILE, PRE_CHAIN_FILE, LedgerDamaged

    verified = tmp_path / "verified"  # dflctl privacy verify reads an unchained ledger and leaves it so
    (verified / "privacy").mkdir(parents=True)
    shutil.copyfile(FIXTURE, verified / "privacy" / "ledger.sqlite")
    assert main(["privacy", "verify", "--state-dir", str(verified)]) == 0
    assert not (verified / HEAD_FILE).exists() and not (verified / PRE_CHAIN_FILE).exists()
    backup = sqlite3.connect(state / PRE_CHAIN_FILE)
    assert [dict(zip(cols, r)) for r in backup.execute("SELECT * FROM runs ORDER BY time, run_id")] == old
    backup.close()
    assert json.loads((state / HEAD_FILE).read_text())["events"] == 5
    led.settle("r-reserved", 60)  # the ledger goes on from there
    assert PrivacyLedger(state).get("r-reserved")["state"] == "spent"
    _sql("UPDATE runs SET state = 'released' WHERE run_id = 'r-spent'")(state / "privacy" / "ledger.sqlite")
    with pytest.raises(LedgerDamaged, match="state 'released', the history says 'spent'"):
        PrivacyLedger(state).state()


_WRITER = textwrap.dedent("""
    import sys
    from dfl_agent.privacy.plan import RunPlan
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger
    plan = RunPlan(noise_multiplier=1.0, sample_rate=0.05, steps=200, epsilon=5.0, delta=1e-5, max_grad_norm=1.0)
    PrivacyLedger(sys.argv[1]).reserve("r2", plan, 5)
""")


def _killed_at(at: str, script: str, base: Path, d: Path) -> Path:
    """A copy ``d`` of state folder ``base`` on which ``script`` was SIGKILLed at crash point
    ``privacy-ledger:AT`` (``DFL_TEST_CRASH_AT``)."""
    shutil.copytree(base, d)
    r = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "DFL_TEST_CRASH_AT": f"privacy-ledger:{at}"}, start_new_session=True)
    assert r.returncode == -signal.SIGKILL, f"{at}: not killed (rc {r.returncode}): {r.stderr[-2000:]}"
    return d


def test_a_power_cut_mid_write_is_rolled_back_or_detected(tmp_path: Path) -> None:
    """A process writing a reservation is SIGKILLed at each point of the write (the
    ``DFL_TEST_CRASH_AT`` switch): before the commit, after it (the journal not yet folded into
    the file, no marker yet), after the marker.  Each leaves a ledger that verifies, with the
    reservation whole or absent and ε never below what it was.  Then the journal of the killed
    commit is torn at every length (a power cut during its write): SQLite rolls the commit back,
    which the marker (not yet written) accepts; had the marker already counted it (a write the
    card acknowledged and lost), the ledger is refused.  A truncated database file is refused."""
    base = tmp_path / "base"
    led = PrivacyLedger(base)
    led.reserve("r1", _plan(1.1, 0.02, 400), rounds=10)
    led.mark_trained("r1")
    led.settle("r1", 400)
    eps0 = led.epsilon(1e-5)
    states = {}
    for at in ("before-commit", "committed", "marked"):
        d = _killed_at(at, _WRITER, base, tmp_path / at)
        if at == "committed":
            wal = d / "privacy" / "ledger.sqlite-wal"
            assert wal.stat().st_size > 0  # the commit lives in the journal
            shutil.copytree(d, tmp_path / "torn-source")
        st = PrivacyLedger(d).state()
        states[at] = (st.events, "r2" in st.rows)
        assert PrivacyLedger(d).epsilon(1e-5) >= eps0
    n0 = PrivacyLedger(base).state().events
    assert states == {"before-commit": (n0, False), "committed": (n0 + 1, True), "marked": (n0 + 1, True)}
    from dfl_agent.runtime.shared.privacy_ledger import HEAD_FILE, LedgerDamaged

    src = tmp_path / "torn-source"
    size = (src / "privacy" / "ledger.sqlite-wal").stat().st_size
    caught_up = tmp_path / "caught-up"  # its marker counts the commit: the next start wrote it
    shutil.copytree(src, caught_up)
    assert PrivacyLedger(caught_up).at_start() is not None
    outcomes = set()
    for cut in sorted({0, 1, 32, 33, size - 1, *range(0, size, 1031)}):
        for marker in ("before", "counted"):
            d = tmp_path / f"torn-{cut}-{marker}"
            shutil.copytree(src, d)
            os.truncate(d / "privacy" / "ledger.sqlite-wal", cut)
            if marker == "counted":
                shutil.copyfile(caught_up / HEAD_FILE, d / HEAD_FILE)
            try:
                st = PrivacyLedger(d).state()
            except LedgerDamaged as exc:
                assert marker == "counted" and "rows were removed" in exc.what, (cut, exc.what)
                outcomes.add((marker, "refused"))
                continue
            assert (st.events, "r2" in st.rows) == (n0, False), (cut, marker)  # rolled back, never half
            outcomes.add((marker, "rolled back"))
            shutil.rmtree(d)
    assert outcomes == {("before", "rolled back"), ("counted", "refused")}

    db = tmp_path / "marked" / "privacy" / "ledger.sqlite"
    full = db.stat().st_size
    for cut in (0, 100, 4096, full // 2, full - 1):
        d = tmp_path / f"db-{cut}"
        shutil.copytree(tmp_path / "marked", d)
        os.truncate(d / "privacy" / "ledger.sqlite", cut)
        with pytest.raises(LedgerDamaged):
            PrivacyLedger(d).state()


def test_a_device_whose_reported_epsilon_goes_down_is_flagged(tmp_path: Path) -> None:
    """A peer's run lobby and ``dflctl``'s observer keep the highest ε each device reported with
    no reservation outstanding; a device that reports less (a reset ledger, a restart) is flagged
    in the peer's own status (``privacy.peers_decreased``) and in ``dflctl status`` / ``peers``.  A
    reservation released (ε down from a status with a reservation) is not flagged."""
    from dfl_agent.cli.observer import Observer
    from dfl_agent.cli.tables import peer_rows, status_rows
    from dfl_agent.runtime.service.lobby import RunLobby
    from dfl_agent.runtime.service.service_counters import ServiceCounters

    def status(eps: float, reserved: int = 0) -> dict:
        return {"node_id": "dev1", "state": "idle", "privacy": {
            "dp": True, "epsilon_spent": eps, "epsilon_remaining": round(10 - eps, 4), "lifetime_epsilon": 10.0,
            "delta": 1e-5, "runs": 2, "reserved": reserved}}

    def msg(doc: dict) -> SimpleNamespace:
        return SimpleNamespace(topic="dfl/f/node/dev1/status", payload=json.dumps(doc).encode())

    lobby = RunLobby(SimpleNamespace(), "dev2", None)
    obs = Observer("127.0.0.1:1883", "f")
    counters = ServiceCounters(tmp_path, lobby)
    from dfl_agent.profiles import get_profile

    cfg = config_from_dict({"state_dir": str(tmp_path), "privacy": DP})
    PrivacyBudget(cfg, get_profile("generic-x86"), None, counters)
    for doc in (status(5.0, reserved=1), status(2.0), status(7.999)):  # a release, then a run spent
        lobby._handle_message(msg(doc))
        obs._handle(msg(doc))
    assert lobby.privacy_watch.view() == {} and obs.privacy_watch.view() == {}
    for doc in (status(0.0), status(0.0)):  # the device restarted with its ledger emptied
        lobby._handle_message(msg(doc))
        obs._handle(msg(doc))
    flag = counters.view()["privacy"]["peers_decreased"]["dev1"]
    assert (flag["was"], flag["now"]) == (7.999, 0.0)
    seen = obs.privacy_watch.view()
    assert seen["dev1"]["was"] == 7.999
    peer = {"node_id": "dev2", "state": "idle", "privacy": counters.view()["privacy"]}
    statuses = {"dev1": status(0.0), "dev2": peer}
    (row,) = [r for r in status_rows(statuses) if r["node_id"] == "dev1"]  # a one-shot dflctl status
    assert row["privacy"] == "eps 0/10 (10 left) DOWN from 7.999 (seen by dev2)"
    (row,) = [r for r in peer_rows(statuses, {}, privacy_seen=seen) if r["node_id"] == "dev1"]
    assert row["privacy"].endswith("DOWN from 7.999 (seen by dev2, dflctl)")
    assert row["privacy_decreased"]["now"] == 0.0
    lobby._handle_message(msg(status(8.0)))  # recovered: stated at least what it had spent
    assert lobby.privacy_watch.view() == {}
    assert "DOWN" not in status_rows({"dev1": status(8.0), "dev2": peer})[0]["privacy"]


def test_the_service_declines_dp_runs_and_serves_the_others(tmp_path: Path) -> None:
    """The always-on service with a damaged ledger: the DP run is declined with the one line as
    its reason, recorded in the run ledger and published in the status (``dflctl run show`` and
    ``status`` show it); the service stays up, and a node without DP on the same state folder
    admits and trains its run (its status says the ledger is damaged)."""
    import asyncio

    from dfl_agent.cli.tables import privacy_text
    from dfl_agent.runtime.shared.descriptor import RunDescriptor
    from tests.unit.test_run_manager import manager

    data = {"dataset": "digits", "partition": "iid", "num_nodes": 4}
    m = manager(tmp_path, privacy=DP, data=data)
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=2)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event()))
    assert PrivacyLedger(tmp_path).get("r1")["state"] == "spent"
    (tmp_path / "privacy" / "ledger.sqlite").write_bytes(b"")
    m = manager(tmp_path, privacy=DP, data=data)  # restarted
    assert not m.admit(RunDescriptor(run_id="r2", federation="f", algorithm="fedavg", rounds=2))
    m.idle()
    entry = m.ledger.entries["r2"]
    assert entry["state"] == "declined" and entry["reason"].startswith(
        f"privacy ledger {tmp_path / 'privacy' / 'ledger.sqlite'}: is 0 bytes (truncated)")
    assert m.lobby.published[-1][0] == {"id": "r2", "state": "declined", "round": 0, "reason": entry["reason"]}
    assert m.privacy.status()["ledger"] == "damaged"
    plain = manager(tmp_path, data=data)  # no DP: its runs go on
    d3 = RunDescriptor(run_id="r3", federation="f", algorithm="fedavg", rounds=2)
    assert plain.admit(d3) and asyncio.run(plain.train(d3, asyncio.Event()))
    assert plain.ledger.state("r3") == "finished"
    assert privacy_text(plain.privacy.status()) == "ledger damaged"


_FOLDER = textwrap.dedent("""
    import sys
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger
    PrivacyLedger(sys.argv[1]).fold(3)
""")


def _recurring(led: PrivacyLedger, n: int, start: int = 0) -> None:
    """``n`` recurring DP runs, each with its own noise multiplier and sampling rate (a device
    calibrates them to its growing store); every fifth never trained (released)."""
    for i in range(start, start + n):
        rid = f"r{i:03d}"
        led.reserve(rid, _plan(1.0 + 0.05 * (i % 7), 0.02 + 0.001 * (i % 11), 40), rounds=4)
        led.mark_trained(rid)
        led.settle(rid, 0 if i % 5 == 4 else 40)


def test_folding_keeps_the_ledger_bounded_and_the_epsilon_unchanged(tmp_path: Path) -> None:
    """A device with recurring DP runs appends four events a run; folding (after each settled
    run, keeping the newest ``keep``) bounds the file while the composed ε, the runs counted, the
    chain's checks and the marker stay as they were; a reserved run is never folded."""
    from dfl_agent.runtime.shared.privacy_ledger import HEAD_FILE, LedgerDamaged, read_head

    led = PrivacyLedger(tmp_path / "s")
    led.reserve("held", _plan(1.1, 0.02, 40), rounds=4)  # reserved (a run still going): never folded
    sizes, eps = [], []
    for block in range(12):
        _recurring(led, 10, 10 * block)
        before = led.epsilon(1e-5)
        led.fold(5)
        st = PrivacyLedger(tmp_path / "s").state(fresh=True)  # a new process's view
        eps.append((before, st.epsilon(1e-5)))
        sizes.append(sum(p.stat().st_size for p in (tmp_path / "s" / "privacy").iterdir()))
    assert all(abs(a - b) <= 1e-9 * a for a, b in eps), eps
    assert all(b >= a for a, b in zip(eps, eps[1:]))  # the ε spent only grows
    st = led.state(fresh=True)
    assert st.base > 0 and st.events == read_head(tmp_path / "s")["events"]
    assert st.rows["held"]["state"] == "reserved"
    assert st.runs_spent() == 1 + sum(1 for i in range(120) if i % 5 != 4)
    assert st.folded["runs"] >= 90 and len(st.rows) <= 1 + 5 + 5  # the reserved run, the newest kept, unfolded since
    assert max(sizes[4:]) <= max(sizes[:4]) * 1.5, sizes  # bounded, not one row a run
    # the fold is in the chain: an edit of it, or a lowered start of the chain, is refused
    for name, statement, says in (
            ("fold-edited", "UPDATE events SET body = replace(body, '\"steps\":', '\"steps\":1') "
                            "WHERE kind = 'fold'", "its hash does not match"),
            ("base-moved", "UPDATE meta SET value = CAST(value + 1 AS TEXT) WHERE key = 'base_seq'",
             "start of its history|is missing|follows a fold"),
    ):
        d = tmp_path / name
        shutil.copytree(tmp_path / "s", d)
        _sql(statement)(d / "privacy" / "ledger.sqlite")
        with pytest.raises(LedgerDamaged, match=says):
            PrivacyLedger(d).state()
    d = tmp_path / "old-marker"  # the marker of before the last fold: the history it names is gone
    shutil.copytree(tmp_path / "s", d)
    old_head = json.loads((d / HEAD_FILE).read_text())
    _recurring(PrivacyLedger(d), 6, 500)
    assert PrivacyLedger(d).fold(3) > 0
    assert PrivacyLedger(d).state().base > old_head["events"]
    (d / HEAD_FILE).write_text(json.dumps(old_head))
    with pytest.raises(LedgerDamaged):
        PrivacyLedger(d).state()


def test_a_fold_that_lowers_the_epsilon_is_refused() -> None:
    from dfl_agent.runtime.shared.privacy_chain import LedgerState, apply, fold_body

    st = LedgerState()
    for i in range(8):
        apply(st, f"r{i}", "reserve", {"time": float(i), "noise_multiplier": 1.0, "sample_rate": 0.05, "steps": 50,
                                       "planned_steps": 50, "steps_per_round": 10, "delta": 1e-5,
                                       "max_grad_norm": 1.0, "epsilon": 1.0})
        apply(st, f"r{i}", "settle", {"state": "spent", "steps": 50, "epsilon": 1.0, "settled": float(i)})
    body = fold_body(st, 2)
    assert body is not None and body["folded"]["runs"] == 6 and [r["run_id"] for r in body["rows"]] == ["r6", "r7"]
    body["folded"]["rdp"] = [0.99 * x for x in body["folded"]["rdp"]]
    with pytest.raises(ValueError, match="a fold lowers the composed epsilon"):
        apply(st, "", "fold", body)


def test_a_power_cut_mid_fold_leaves_a_ledger_that_verifies(tmp_path: Path) -> None:
    """A process folding the ledger is SIGKILLed before its commit, after it (no marker yet) and
    after the marker: each leaves a ledger that verifies, folded or not, with the same ε."""
    base = tmp_path / "base"
    led = PrivacyLedger(base)
    _recurring(led, 12)
    eps0, n0 = led.epsilon(1e-5), led.state().events
    folded = {}
    for at in ("before-commit", "committed", "marked"):
        d = _killed_at(at, _FOLDER, base, tmp_path / at)
        st = PrivacyLedger(d).state()
        folded[at] = st.base == n0
        assert abs(st.epsilon(1e-5) - eps0) <= 1e-9 * eps0
        assert PrivacyLedger(d).at_start() is not None
    assert folded == {"before-commit": False, "committed": True, "marked": True}


def test_the_service_folds_the_ledger_after_each_run(tmp_path: Path, capsys) -> None:
    """The service folds the runs older than ``runtime.keep_runs`` after settling each run: the
    status still counts every run and the same ε, and ``dflctl privacy verify`` says so."""
    from dfl_agent.cli.dflctl import main as dflctl

    cfg, store = _store_cfg(tmp_path, DP)
    budget = _budget(tmp_path, store, keep_runs=2)
    spent = _spend(budget, tmp_path, *[f"r{i}" for i in range(9)])
    st = PrivacyLedger(tmp_path).state()
    assert st.folded["runs"] >= 4 and len(st.rows) <= 2 + 3
    status = budget.status()
    assert status["runs"] == 9 and status["epsilon_spent"] == spent
    assert _budget(tmp_path, store).status()["epsilon_spent"] == spent  # a restart reads the same
    assert dflctl(["privacy", "verify", "--state-dir", str(tmp_path)]) == 0
    assert f"and {st.folded['runs']} older spent runs folded" in capsys.readouterr().out
