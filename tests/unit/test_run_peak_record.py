"""A run's peak memory in its record: the run process reports its peak resident memory
(``peak_rss_mb``, MiB) with its states and its end over the typed pipe, the supervisor records it
in the run's ledger entry, and the idle status's ``run_history``, ``dflctl status``,
``dflctl run show`` and the field lab's report show it per device."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace

from dfl_agent.cli.cli_runs import run_view
from dfl_agent.cli.lab.report import markdown, run_peaks
from dfl_agent.cli.tables import STATUS_COLUMNS, render_table, status_rows
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.lobby import RunLobby
from dfl_agent.runtime.service.supervisor import ChildRun, RunProgress
from dfl_agent.runtime.shared import pipe
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import RunDescriptor
from tests.unit import test_run_manager as rm

#: what a run process sends after its rounds, as lines of the pipe
LINES = [pipe.to_line(m) for m in (pipe.StateReport("trained", 1, round=2, peak_rss_mb=301.5),
                                   pipe.StateReport("deploying", 2, round=2, peak_rss_mb=310.0),
                                   pipe.StateReport("kept", 3, round=2, peak_rss_mb=330.0),
                                   pipe.End("finished", 2, 2, peak_rss_mb=352.3))]


class _PipedRun(ChildRun):
    """The supervisor's real ChildRun, fed the run process's lines without a process."""

    async def run(self, stop):
        self.progress = RunProgress("n", "f")
        self._send = lambda msg: None  # the acknowledgements
        for line in LINES:
            await self._handle(pipe.from_line(line))
        return 0


def test_the_peak_travels_from_the_pipe_to_the_ledger_the_status_and_dflctl(tmp_path):
    m = rm.manager(tmp_path, agent=functools.partial(_PipedRun, lobby=None))
    recorded = []
    real_set = m.ledger.set
    m.ledger.set = lambda rid, state, *a, **kw: (recorded.append((state, (a[2] if len(a) > 2 else kw.get("extra"))
                                                                  .get("peak_rss_mb"))), real_set(rid, state, *a, **kw))
    d = RunDescriptor(run_id="r1", federation="f", algorithm="fedavg", rounds=2)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event())) is True
    # each state after the rounds is recorded with the peak so far: a crash later keeps the last one
    assert [r for r in recorded if r[0] in ("trained", "deploying", "kept", "finished")] == [
        ("trained", 301.5), ("deploying", 310.0), ("kept", 330.0), ("finished", 352.3)]
    assert m.ledger.entries["r1"]["state"] == "finished" and m.ledger.entries["r1"]["peak_rss_mb"] == 352.3
    assert RunLedger(tmp_path).entries["r1"]["peak_rss_mb"] == 352.3  # on disk

    published = []
    lobby = RunLobby(config_from_dict({"federation": "f"}), "n", SimpleNamespace(refused={}))
    lobby.client = SimpleNamespace(publish=lambda topic, payload, **kw: published.append(payload))
    lobby._signed = lambda kind, doc: doc
    lobby.publish_status(m.info, "idle", m.ledger.entries)
    status = published[0]
    assert status["run_history"]["r1"]["peak_rss_mb"] == 352.3
    [row] = status_rows({"n": status})
    assert row["run_peak_mb"] == 352  # whole MiB in the table
    from io import StringIO

    from rich.console import Console

    buf = StringIO()
    Console(file=buf, width=250, no_color=True).print(render_table("status", [row], STATUS_COLUMNS))
    assert "run_peak_mb" in buf.getvalue() and "352" in buf.getvalue()
    view = run_view("r1", {"descriptor": {"run_id": "r1", "algorithm": "fedavg", "rounds": 2}}, {"n": status})
    assert view["nodes"]["n"]["peak_rss_mb"] == 352.3


def test_a_run_process_that_sent_no_peak_leaves_none_in_the_record(tmp_path):
    """An earlier release's run process (or an in-process agent) reports none: no field, no guess."""
    m = rm.manager(tmp_path)
    d = RunDescriptor(run_id="r2", federation="f", algorithm="fedavg", rounds=1)
    assert m.admit(d) and asyncio.run(m.train(d, asyncio.Event())) is True
    assert m.ledger.state("r2") == "finished" and "peak_rss_mb" not in m.ledger.entries["r2"]
    assert status_rows({"n": {"state": "idle", "run": {"id": "r2"}, "run_history": {"r2": {"state": "finished"}}}})[0][
        "run_peak_mb"] is None


def test_the_lab_report_shows_each_devices_run_peak_from_its_ledger(tmp_path):
    state = tmp_path / "pi-0"
    RunLedger(state).set("r-1", "finished", 3, "", {"peak_rss_mb": 352.3})
    RunLedger(state).set("r-0", "failed", 0, "run process killed by signal 9")  # none reported
    peaks = run_peaks(state)
    assert peaks == {"r-1": 352.3}
    dev = {"id": "pi-0", "class": "pi", "address": "198.18.0.2", "peak_rss_mb": 420.0, "run_peak_rss_mb": peaks,
           "memory_limit_mb": 1024, "oom_kills": 0, "samples_fed": 10, "samples_stored": 10, "samples_evicted": 0,
           "samples_rejected": 0, "rounds_trained": 3, "rounds_alone": 0, "deployed_versions": [1]}
    rep = {"scenario": "smoke", "passed": True, "wall_seconds": 1.0, "lab_id": "x", "host": {"cores": 2, "load_avg": []},
           "failed_checks": [], "mechanisms": {}, "devices": [dev],
           "runs": [{"run_id": "r-1", "algorithm": "fedavg", "state": "finished", "members": ["pi-0"], "rounds": 3,
                     "deployed_on": ["pi-0"], "final_accuracy_mean": 0.7, "peak_rss_mb": {"pi-0": 352.3}}],
           "events": [], "discovery": {"via": [], "seconds_to_full_membership": None}, "bytes_total": 0, "notes": []}
    md = markdown(rep)
    assert "| run peak MB |" in md and "| 420.0 | 352 | 1024 |" in md  # the device table
    assert "| run process peak MB |" in md and "| 0.7 | pi-0 352 |" in md  # the run table
