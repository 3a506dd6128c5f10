"""The smoke scenario, as CI runs it: ``dflctl lab run tools/lab/scenarios/smoke.toml`` as
root builds a site (TLS mosquitto with logins and the shipped ACL, an operator, three real
always-on agents with signatures, compression and multicast mDNS, each fed its HAR user's
windows, and a torch-free inference member), submits a run, cuts a device off and stops the broker, writes the report, checks
it, and leaves nothing behind. Skipped, with the reason, where the lab cannot run.

The lab exists to find the agent's defects. A failed check whose cause the lab has found
and reported (its signature in the agents' logs, listed in ``KNOWN``) marks the test xfail
with the evidence; any other failure fails it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dfl_agent.cli.lab.runner import lab_compression
from dfl_agent.cli.lab.state import state_dir

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "tools" / "lab" / "scenarios" / "smoke.toml"
DEVICE_KEYS = {"id", "class", "role", "address", "peak_rss_mb", "memory_limit_mb", "oom_killed", "samples_fed",
               "samples_stored", "samples_evicted", "samples_rejected", "deployed_versions", "rounds_trained",
               "rounds_alone"}
RUN_KEYS = {"run_id", "algorithm", "state", "members", "rounds", "deployed_on", "final_accuracy_mean"}
EVENT_KEYS = {"kind", "target", "at_s", "duration_s", "recovered_after_s"}

#: agent defects the lab found, still open: (what, the log line that shows it, the checks it fails)
KNOWN = [
    ("after the broker outage, compressed updates are dropped as out of sequence (choco_gap) and rounds close "
     "alone", re.compile(r"choco_gap"), {"max_rounds_alone", "max_recovery_s"}),
    ("rounds close alone around the broker outage", re.compile(r"round \d+ closed alone"),
     {"max_rounds_alone", "max_recovery_s"}),
]


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("dfl-lab-")]


def _processes_using(folder: Path) -> list[str]:
    """Command lines that name ``folder`` (the lab's agents and brokers do)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmd and "lab run" not in cmd:
            found.append(cmd)
    return found


def test_the_smoke_scenario(tmp_path):
    out = tmp_path / "smoke"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "lab", "run", str(SMOKE), "--out", str(out)],
                       capture_output=True, text=True, timeout=280)
    took = time.monotonic() - t0
    print(r.stderr[-3000:], f"\n(lab run took {took:.0f} s)")
    assert r.returncode in (0, 1), r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    # nothing of this lab is left (other labs may run beside it): no namespace, no state file
    lab = rep["lab_id"]
    assert re.fullmatch(r"[0-9a-f]{8}", lab) and f"lab {lab}: building 4 device(s)" in r.stderr
    assert not [n for n in _namespaces() if n.startswith(f"dfl-lab-{lab}-")], _namespaces()
    assert not (state_dir() / f"{lab}.json").exists()
    assert not _processes_using(out), "processes of the lab still run"

    assert {"scenario", "mechanisms", "passed", "failed_checks", "devices", "runs", "events", "discovery", "host",
            "bytes_total"} <= set(rep)
    assert rep["scenario"] == "smoke" and rep["mechanisms"]["rate"] == "tbf"
    assert rep["mechanisms"]["loss"] in ("netem", "iptables") and rep["mechanisms"]["memory"].startswith("cgroup-v")
    assert [d["id"] for d in rep["devices"]] == ["pi-0", "pi-1", "pi-2", "cam-0"]
    assert rep["compression"] == dict.fromkeys(("pi-0", "pi-1", "pi-2"), lab_compression())
    train = [d for d in rep["devices"] if d["role"] == "train"]
    cam = rep["devices"][-1]  # the inference member (dfl-infer, torch-free): nothing fed, no rounds
    assert cam["role"] == "inference" and set(cam) >= DEVICE_KEYS and cam["address"].startswith("198.18.")
    assert cam["samples_fed"] is None and cam["rounds_trained"] is None and cam["memory_limit_mb"] == 256
    assert 0 < cam["peak_rss_mb"] < 150 and (out / "logs" / "cam-0.log").stat().st_size > 0
    for d in train:
        assert set(d) >= DEVICE_KEYS, d
        assert d["address"].startswith("198.18.") and d["memory_limit_mb"] == 1024
        assert d["samples_fed"] > 0 and (out / "logs" / f"{d['id']}.log").stat().st_size > 0
    assert len(rep["runs"]) == 1 and set(rep["runs"][0]) >= RUN_KEYS
    # each member's run process recorded its peak memory in its run ledger: the report shows it
    run0 = rep["runs"][0]
    assert set(run0["peak_rss_mb"]) == set(run0["members"])
    for d in train:
        if d["id"] in run0["members"]:
            assert 0 < d["run_peak_rss_mb"][run0["run_id"]] == run0["peak_rss_mb"][d["id"]] < d["memory_limit_mb"]
    assert [e["kind"] for e in rep["events"]] == ["partition", "broker_outage"]
    assert all(set(e) >= EVENT_KEYS for e in rep["events"])
    assert {"seconds_to_full_membership", "via"} <= set(rep["discovery"])
    assert rep["host"]["cores"] >= 1 and len(rep["host"]["load_avg"]) == 3
    assert (out / "report.md").read_text().startswith("# Lab report: smoke")
    # every round's model measured from its checkpoint; every link's bytes sampled
    curve, tta = rep["runs"][0]["accuracy_curve"], rep["runs"][0]["time_to_accuracy"]
    assert curve and tta["target"] == 0.65 and tta["best"] == max(p[2] for p in curve)
    assert {"pi-0", "pi-1", "pi-2", "broker-a", "operator"} <= set(rep["links"])
    for d in train:
        assert d["round_accuracy"] and all(0 <= a <= 1 for _, _, a in d["round_accuracy"]), d["id"]
        metrics = next((out / "metrics" / d["id"]).glob("*.jsonl")).read_text().splitlines()
        sent = max(json.loads(line)["bytes_sent"] for line in metrics)
        assert rep["links"][d["id"]]["bytes_from_host"] > sent > 0  # payload < bytes on the wire
    # the checks were evaluated: the verdict and the exit code agree with the list of failures
    assert rep["passed"] == (not rep["failed_checks"]) == (r.returncode == 0)
    for f in rep["failed_checks"]:
        assert f.split(":")[0] in rep["checks"], f
        assert f in r.stderr
    if r.returncode == 0:
        assert rep["runs"][0]["state"] == "finished" and "mdns" in rep["discovery"]["via"]
        assert rep["discovery"]["mdns_missing"] == []  # every pair found each other through mDNS
        assert all(d["rounds_alone"] == 0 and d["deployed_versions"] for d in train)
        # the scenario is sized so that both faults fall inside the run, which recovers from each
        for e in rep["events"]:
            assert e["started_s"] is not None and not e["no_run_after"] and e["recovered_after_s"] is not None, (
                f"{e['kind']} was not inside the run (the run ended first: smoke.toml needs more rounds here): {e}")
        # the inference member received the run's deployed models over TLS, signed (inference_received)
        assert {g["run_id"] for g in cam["received"]} == {rep["runs"][0]["run_id"]} and cam["accuracy"] is not None
        # the deployed model is the last round's: its held-out accuracy, measured both ways
        last = [d["round_accuracy"][-1][2] for d in train]
        assert sum(last) / len(last) == pytest.approx(rep["runs"][0]["final_accuracy_mean"], abs=0.002)
        return
    logs = "\n".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    failed = {f.split(":")[0] for f in rep["failed_checks"]}
    for what, sign, checks in KNOWN:
        if sign.search(logs) and (checks is None or failed <= checks):
            pytest.xfail(f"the lab found a known agent defect: {what}; failed checks: {rep['failed_checks']}")
    pytest.fail(f"smoke scenario failed: {rep['failed_checks']}\n{r.stderr[-3000:]}")


FAILING = """
[lab]
duration_s = 90
initial_windows = 48
max_windows = 48
[[site]]
name = "a"
[[class]]
name = "pi"
cpu = 0.5
memory_mb = 512
agent = { profile_overrides = { behaviour = { algorithms = ["fedavg"] } } }
[[device]]
class = "pi"
count = 2
[[run]]
at_s = 1
algorithm = "dfedavg"
rounds = 1
[[event]]
at_s = 1
after_run = 0
kind = "partition"
target = "pi-0"
duration_s = 1
[checks]
all_runs_deployed = true
min_final_accuracy = 0.5
samples_lost = 0
"""


def test_failed_checks_exit_1_naming_them(tmp_path):
    """A run every device declines (an algorithm their profile does not allow): exit 1 naming
    the three checks that fail (runs_trained is on by default), the one that holds not named;
    the event that waited for the run is skipped and said so; nothing is left (~10 s)."""
    sc = tmp_path / "failing.toml"
    sc.write_text(FAILING)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "lab", "run", str(sc), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "failing: 3 check(s) failed:" in r.stderr and "samples_lost" not in r.stderr, r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["passed"] is False and [f.split(":")[0] for f in rep["failed_checks"]] == [
        "all_runs_deployed", "runs_trained", "min_final_accuracy"]
    assert f"runs_trained: run {rep['runs'][0]['run_id']} (dfedavg) declined on every device" in r.stderr
    assert rep["runs"][0]["state"] == "declined" and rep["runs"][0]["members"] == []
    assert any("not done: partition pi-0" in n for n in rep["notes"]), rep["notes"]
    assert rep["events"][0]["started_s"] is None
    assert not [n for n in _namespaces() if n.startswith(f"dfl-lab-{rep['lab_id']}-")]
    assert not (state_dir() / f"{rep['lab_id']}.json").exists() and not _processes_using(out)
