"""The field lab's parts that need no root: rates, the state file and its teardown
(real processes and folders; namespaces that are not there are not touched), and the
one-line refusal where the lab cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dfl_agent.cli import cli_lab
from dfl_agent.cli.lab import check, state
from dfl_agent.cli.lab.net import parse_rate


def test_rates_parse_in_bits_per_second() -> None:
    assert parse_rate("2mbit") == 2_000_000
    assert parse_rate("500kbit") == 500_000
    assert parse_rate("1.5Mbit") == 1_500_000
    assert parse_rate("1mbps") == 8_000_000
    assert parse_rate(64000) == 64000
    for bad in ("fast", "0mbit", "2 mb/s"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_the_state_file_is_rewritten_with_each_object(tmp_path: Path) -> None:
    st = state.LabState("abcd1234", tmp_path)
    st.write()
    st.add("netns", name="dfl-lab-abcd1234-x")
    obj = st.add("process", pid=1, start=None, host="x")
    doc = json.loads((tmp_path / "abcd1234.json").read_text())
    assert [o["kind"] for o in doc["objects"]] == ["netns", "process"]
    st.drop(obj)
    assert [o["kind"] for o in json.loads(st.path.read_text())["objects"]] == ["netns"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abcd1234.json"]  # no temporary file left
    assert [d["run_id"] for _, d in state.read_states(tmp_path)] == ["abcd1234"]


def test_teardown_stops_listed_processes_only_and_by_their_start_time(tmp_path: Path) -> None:
    ours = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])  # same kind of process, not listed
    reused = subprocess.Popen(["sleep", "60"])  # listed with another start time: its PID was reused
    folder = tmp_path / "cg"
    folder.mkdir()
    try:
        doc = {"objects": [
            {"kind": "cgroup", "path": str(folder)},
            {"kind": "process", "pid": ours.pid, "start": state.proc_start(ours.pid), "host": "h"},
            {"kind": "process", "pid": reused.pid, "start": 1, "host": "h"},
            {"kind": "netns", "name": "dfl-lab-ffff0000-absent"},
        ]}
        removed = state.teardown(doc)
        assert removed == [f"process {ours.pid} (h)", f"cgroup {folder}"]  # processes first
        assert ours.wait(timeout=5) is not None
        assert other.poll() is None and reused.poll() is None
        assert not folder.exists()
    finally:
        for p in (ours, other, reused):
            p.kill()
            p.wait()


def test_where_the_lab_cannot_run_check_and_down_say_why_in_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(check.os, "geteuid", lambda: 1000)
    assert check.main() == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().count("\n") == 0
    assert "cannot run here: the lab needs root" in err
    assert cli_lab.cmd_lab_down(None) == 2  # type: ignore[arg-type]
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(check.sys, "platform", "darwin")
    assert check.blocker() == "the lab needs Linux (this is darwin)"


def test_missing_names_what_the_lab_lacks() -> None:
    caps = [check.Capability("network namespaces", True, ""), check.Capability("tc tbf (rate)", False, "x"),
            check.Capability("sch_netem (loss, delay)", False, "", required=False),
            check.Capability("iptables statistic (loss)", False, "", required=False)]
    assert check.missing(caps) == ["tc tbf (rate)", "a loss mechanism (sch_netem or iptables statistic)"]
    caps[3].ok = True
    assert check.missing(caps) == ["tc tbf (rate)"]


def test_dflctl_lists_the_lab_commands() -> None:
    r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "lab", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "check" in r.stdout and "down" in r.stdout
