"""The field lab's scenario files (dfl_agent.cli.lab.scenario): the shipped ones parse, device
ids are <class>-<n> across the file, and a file that breaks the format is refused naming the
key (``dflctl lab run`` exits 2 before touching the host, so no root is needed here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from dfl_agent.cli.dflctl import main as dflctl
from dfl_agent.cli.lab.scenario import ScenarioError, load, parse

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "tools" / "lab" / "scenarios" / "smoke.toml"

BASE = """
[lab]
duration_s = 60
[[site]]
name = "a"
[[class]]
name = "pi"
cpu = 0.25
memory_mb = 256
rate = "2mbit"
loss = 0.02
[[class]]
name = "gate"
[[device]]
class = "pi"
count = 2
[[device]]
class = "gate"
[[device]]
class = "pi"
start_s = 30
[[run]]
at_s = 5
algorithm = "fedavg"
rounds = 2
[[event]]
at_s = 10
kind = "partition"
target = "pi-1"
duration_s = 5
"""


def _doc(extra: str = "", **replace: str) -> dict:
    text = BASE
    for old, new in replace.items():
        text = text.replace(old.replace("_", " "), new)
    return tomllib.loads(text + extra)


def test_the_smoke_scenario_parses():
    s = load(SMOKE)
    assert [d.id for d in s.devices] == ["pi-0", "pi-1", "pi-2", "cam-0"]
    assert [d.id for d in s.training()] == ["pi-0", "pi-1", "pi-2"] and s.checks["inference_received"]
    assert len(s.runs) == 1 and {e.kind for e in s.events} == {"partition", "broker_outage"}
    assert s.checks["max_rounds_alone"] == 0 and s.checks["min_final_accuracy"] > 0


def test_device_ids_count_per_class_across_the_file():
    s = parse(_doc())
    assert [(d.id, d.start_s) for d in s.devices] == [("pi-0", 0.0), ("pi-1", 0.0), ("gate-0", 0.0), ("pi-2", 30.0)]
    assert s.devices[0].cls.rate == "2mbit" and s.devices[0].cls.loss == 0.02
    assert s.events[0].target == "pi-1"


def test_perfect_drops_limits_loss_and_events():
    s = parse(_doc("", **{"[lab]": "[lab]\nperfect = true"}))
    assert s.events == [] and s.classes["pi"].cpu is None and s.classes["pi"].loss == 0.0


@pytest.mark.parametrize("extra, key", [
    ('[checks]\nmax_rounds_alon = 0\n', "checks.max_rounds_alon"),
    ('[[event]]\nat_s = 1\nkind = "meteor"\ntarget = "pi-0"\n', "event[1].kind"),
    ('[[event]]\nat_s = 1\nkind = "partition"\ntarget = "pi-9"\nduration_s = 3\n', "event[1].target"),
    ('[[event]]\nat_s = 1\nkind = "partition"\ntarget = "pi-0"\n', "event[1].duration_s"),
    ('[[event]]\nat_s = 1\nkind = "flap"\ntarget = "pi-0"\nduration_s = 9\nperiod_s = 2\ndown_s = 3\n',
     "event[1].down_s"),
    ('[[event]]\nat_s = 1\nkind = "rate"\ntarget = "pi-0"\nvalue = "fast"\n', "event[1].value"),
    ('[[event]]\nat_s = 1\nkind = "broker_outage"\ntarget = "b"\nduration_s = 3\n', "event[1].target"),
    ('[[event]]\nat_s = 1\nkind = "loss"\ntarget = "pi-0"\nvalue = 1.5\n', "event[1].value"),
    ('[[event]]\nat_s = 1\nafter_run = 3\nkind = "partition"\ntarget = "pi-0"\nduration_s = 3\n',
     "event[1].after_run"),
    ('[[run]]\nat_s = 1\nalgorithm = "fedavg"\n', "run[1].rounds"),
    ('[[run]]\nat_s = 1\nalgorithm = "fedavg"\nrounds = "two"\n', "run[1].rounds"),
    ('[[device]]\nclass = "nope"\n', "device[3].class"),
    ('[[device]]\nclass = "pi"\nsite = "b"\n', "device[3].site"),
    ('[[site]]\nname = "b"\n[wan]\nrate = "2 parsecs"\n', "wan.rate"),
    ('[wan]\nrate = "2mbit"\n', "wan"),  # one site: no WAN
    ('[[event]]\nat_s = 1\nkind = "wan_down"\nduration_s = 3\n', "event[1].kind"),  # one site
    ('[[site]]\nname = "b"\n[[event]]\nat_s = 1\nkind = "wan_down"\ntarget = "a"\nduration_s = 3\n',
     "event[1].target"),
    ('[[site]]\nname = "b"\n[[event]]\nat_s = 1\nkind = "wan_down"\n', "event[1].duration_s"),
    ('[lab2]\nx = 1\n', "scenario.lab2"),
])
def test_a_bad_key_is_named(extra, key):
    with pytest.raises(ScenarioError) as e:
        parse(_doc(extra))
    assert e.value.key == key, str(e.value)
    assert str(e.value).startswith(f"{key}: ")


def test_bad_values_in_lab_and_class_are_named():
    for old, new, key in (("duration_s = 60", "duration_s = -1", "lab.duration_s"),
                          ("cpu = 0.25", "cpu = 0", "class[0].cpu"),
                          ("loss = 0.02", "loss = 1.0", "class[0].loss"),
                          ('name = "gate"', 'name = "broker"', "class[1].name"),
                          ("memory_mb = 256", 'memory_mb = "lots"', "class[0].memory_mb")):
        with pytest.raises(ScenarioError) as e:
            parse(tomllib.loads(BASE.replace(old, new)))
        assert e.value.key == key, str(e.value)


def test_two_sites_a_wan_and_wan_down():
    s = parse(_doc('[[site]]\nname = "b"\n[[device]]\nclass = "pi"\nsite = "b"\n[wan]\nrate = "5mbit"\nloss = 0.01\n'
                   '[[event]]\nat_s = 20\nkind = "wan_down"\nduration_s = 8\n'))
    assert s.sites == ["a", "b"] and [(d.id, d.site) for d in s.devices][-1] == ("pi-3", "b")
    assert s.wan == {"rate": "5mbit", "loss": 0.01}
    assert (s.events[1].kind, s.events[1].target, s.events[1].end_s) == ("wan_down", "wan", 28.0)


def test_an_inference_member_is_a_device_that_does_not_train():
    s = parse(_doc('[[device]]\nclass = "gate"\nrole = "inference"\n'))
    assert [(d.id, d.role) for d in s.devices][-1] == ("gate-1", "inference")
    assert "gate-1" not in [d.id for d in s.training()]
    with pytest.raises(ScenarioError) as e:  # its process is not an agent: no power cut
        parse(_doc('[[device]]\nclass = "gate"\nrole = "inference"\n'
                   '[[event]]\nat_s = 5\nkind = "power_cut"\ntarget = "gate-1"\nduration_s = 3\n'))
    assert e.value.key == "event[1].target"


def test_inference_received_fails_for_a_member_without_the_deployed_run():
    from dfl_agent.cli.lab.members import member_checks

    check = {"inference_received": True}
    run = {"run_id": "r-1", "state": "finished", "members": ["pi-0"], "deployed_on": ["pi-0"]}
    cam = {"id": "cam-0", "role": "inference", "deployed_versions": [2], "received": [{"version": 2, "run_id": "r-1"}]}
    assert member_checks(check, {"devices": [cam], "runs": [run]}) == []
    old = dict(cam, received=[{"version": 1, "run_id": "r-0"}])
    assert member_checks(check, {"devices": [old], "runs": [run]}) == ["inference_received: cam-0 received no model "
                                                                       "of run r-1"]
    none = dict(cam, deployed_versions=[], received=[])
    assert member_checks(check, {"devices": [none], "runs": [dict(run, deployed_on=[])]}) == [
        "inference_received: cam-0 received no model"]
    assert member_checks({}, {"devices": [none], "runs": [run]}) == []  # not asked for


def test_lab_run_exits_2_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(BASE + "[checks]\nmin_final_accuracy = \"high\"\n")
    assert dflctl(["lab", "run", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checks.min_final_accuracy: must be int or float" in err, err
    assert not (tmp_path / "out").exists()
    (tmp_path / "broken.toml").write_text("[lab\n")
    assert dflctl(["lab", "run", str(tmp_path / "broken.toml"), "--out", str(tmp_path / "out")]) == 2
    assert "not TOML" in capsys.readouterr().err
    assert dflctl(["lab", "run", str(tmp_path / "absent.toml"), "--out", str(tmp_path / "out")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def _report(**over) -> dict:
    dev = {"id": "pi-0", "role": "train", "samples_lost": 0, "oom_kills": 0, "rounds_alone": 0}
    rep = {"devices": [dev], "events": [{"kind": "partition", "target": "pi-0", "at_s": 10.0,
                                         "recovered_after_s": 5.0}],
           "runs": [{"run_id": "r-1", "algorithm": "fedavg", "state": "finished", "members": ["pi-0"], "rounds": 3,
                     "deployed_on": ["pi-0"]}],
           "discovery": {"seconds_to_full_membership": 3.0, "via": ["mdns"]}, "final_accuracy_mean": 0.6}
    for k, v in over.items():
        if k in dev:
            dev[k] = v
        else:
            rep[k] = v
    return rep


def test_every_check_can_fail():
    from dfl_agent.cli.lab.report import evaluate_checks

    s = load(SMOKE)
    assert evaluate_checks(s, _report()) == []
    cases = {
        "samples_lost": _report(samples_lost=3),
        "oom_kills": _report(oom_kills=1),
        "max_rounds_alone": _report(rounds_alone=2),
        "max_recovery_s": _report(events=[{"kind": "broker_outage", "target": "a", "at_s": 16.0,
                                           "recovered_after_s": None}]),
        "all_runs_deployed": _report(runs=[{"run_id": "r-1", "algorithm": "fedavg", "state": "finished", "rounds": 3,
                                            "members": ["pi-0", "pi-1"], "deployed_on": ["pi-0"]}]),
        "discovery_via": _report(discovery={"seconds_to_full_membership": None, "via": []}),
        "min_final_accuracy": _report(final_accuracy_mean=0.2),
        "inference_received": _report(devices=[{"id": "pi-0", "role": "train", "samples_lost": 0, "oom_kills": 0,
                                                "rounds_alone": 0},
                                               {"id": "cam-0", "role": "inference", "deployed_versions": [],
                                                "received": []}]),
        "runs_trained": _report(runs=[{"run_id": "r-1", "algorithm": "fedavg", "state": "finished",
                                       "members": ["pi-0"], "rounds": 0, "deployed_on": ["pi-0"]}]),
    }
    for check, rep in cases.items():
        failed = evaluate_checks(s, rep)
        assert [f.split(":")[0] for f in failed] == [check], failed
    assert "pi-0 closed 2 round(s) alone (at most 0)" in evaluate_checks(s, cases["max_rounds_alone"])[0]
    assert "broker_outage a at 16 s never recovered" in evaluate_checks(s, cases["max_recovery_s"])[0]
    assert "not deployed on pi-1" in evaluate_checks(s, cases["all_runs_deployed"])[0]
    # a device whose deploy gate kept its deployed model ends the run with a deployed model
    kept = _report(runs=[{"run_id": "r-1", "algorithm": "fedavg", "state": "finished", "rounds": 3,
                          "members": ["pi-0", "pi-1"], "deployed_on": ["pi-0"], "kept_on": ["pi-1"]}])
    assert not [f for f in evaluate_checks(s, kept) if f.startswith("all_runs_deployed")]
    assert evaluate_checks(s, _report(final_accuracy_mean=None))[0].startswith("min_final_accuracy: final deployed "
                                                                              "accuracy none")


def test_quotas_over_the_host_cores_are_noted_in_the_report(monkeypatch):
    import os

    from dfl_agent.cli.lab.runner import LabRun

    said: list[str] = []
    run = LabRun(load(Path(__file__).resolve().parents[2] / "tools/lab/scenarios/smoke.toml"), Path("/nonexistent"),
                 say=said.append)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    run._warn_overcommit(2.0)
    assert run.notes == []
    run._warn_overcommit(2.25)
    assert len(run.notes) == 1 and run.notes[0].startswith("the devices' CPU quotas add up to 2.25 cores, more than "
                                                          "this host's 2")


def test_perfect_from_the_command_line_is_the_same_scenario_without_limits_loss_and_events():
    path = Path(__file__).resolve().parents[2] / "tools/lab/scenarios/field-trial.toml"
    field, perfect = load(path), load(path, perfect=True)
    assert not field.perfect and field.events and field.classes["pi"].cpu == 0.25
    assert perfect.perfect and perfect.events == [] and perfect.classes["pi"].cpu is None
    assert perfect.classes["pi"].rate is None and perfect.classes["pi"].loss == 0.0
    assert [d.id for d in perfect.devices] == [d.id for d in field.devices]
    assert [(r.at_s, r.rounds) for r in perfect.runs] == [(r.at_s, r.rounds) for r in field.runs]


def test_a_late_decline_is_not_a_member_and_not_a_failed_state():
    from dfl_agent.cli.lab.report import run_membership

    members, late, states = run_membership({
        "pi-0": {"state": "finished"}, "pi-1": {"state": "finished"}, "pi-4": None,
        "pi-3": {"state": "declined", "reason": "late: the run had ended on 2 member(s) before this node joined"}})
    assert sorted(members) == ["pi-0", "pi-1"] and late == ["pi-3"] and states == {"finished"}
    members, late, states = run_membership({"pi-0": {"state": "finished"},
                                            "pi-1": {"state": "declined", "reason": "profile: too little memory"}})
    assert members == ["pi-0"] and late == [] and states == {"finished", "declined"}  # all_runs_deployed fails on it


def test_recovery_is_counted_while_a_run_can_train():
    """An event's recovery time counts from its end while a run is in progress, else from the
    next run's submission; an event that ended after the last run is not a failed recovery
    (a run that finished fast has nothing left to recover in), and the report says so."""
    from dfl_agent.cli.lab.report import evaluate_checks, recovery_start

    spans = [(100.0, 170.0), (300.0, 420.0)]  # (submitted, last round) of two runs
    assert recovery_start(150.0, spans) == 150.0  # in the first run
    assert recovery_start(200.0, spans) == 300.0  # between the runs: from the second's submission
    assert recovery_start(90.0, spans) == 100.0  # before the first
    assert recovery_start(430.0, spans) is None  # after the last
    s = load(SMOKE)
    after = _report(events=[{"kind": "power_cut", "target": "pi-0", "at_s": 60.0, "recovered_after_s": None,
                             "no_run_after": True}])
    assert evaluate_checks(s, after) == []
    never = _report(events=[{"kind": "power_cut", "target": "pi-0", "at_s": 60.0, "recovered_after_s": None,
                             "no_run_after": False}])
    assert evaluate_checks(s, never)[0].startswith("max_recovery_s: power_cut pi-0 at 60 s never recovered")


def test_recovery_is_judged_per_affected_device_against_its_own_runs():
    """A device that finished its run while the event lasted has nothing to recover in, even
    while a slower device still trains; every affected device that had a run must recover."""
    from dfl_agent.cli.lab.report import event_recovery

    def rounds(*times, peers=1):
        return [{"time": t, "neighbours": peers} for t in times]

    spans = {"pi-1": [(0.0, 200.0)], "pi-2": [(0.0, 50.0)]}  # pi-2 finished at 50 s, pi-1 at 200 s
    recs = {"pi-1": {"r": rounds(40.0, 63.0, 64.0)}, "pi-2": {"r": rounds(40.0, 50.0)}}
    assert event_recovery(60.0, ["pi-2"], spans, recs) == (None, True)  # not pi-1's run
    assert event_recovery(60.0, ["pi-1"], spans, recs) == (3.0, False)
    assert event_recovery(60.0, ["pi-1", "pi-2"], spans, recs) == (3.0, False)  # pi-2 does not count
    alone = {"pi-1": {"r": rounds(63.0, 64.0, peers=0)}}  # rounds after the event, none with a peer
    assert event_recovery(60.0, ["pi-1"], spans, alone) == (None, False)  # never recovered
    assert event_recovery(None, ["pi-1"], spans, recs) == (None, False)  # the event never ended


# ---- checks that agree with the run: what no device would run is refused before anything is built

@pytest.mark.parametrize("run, key, words", [
    ('algorithm = "no-such-algorithm"', "run[1].algorithm", "unknown algorithm 'no-such-algorithm'; known: "),
    ('algorithm = "fedavg"\noptions = { bogus = 1 }', "run[1].options.bogus", "unknown option for algorithm 'fedavg'"),
    ('algorithm = "fedavg"\noptions = { round_timeout = "long" }', "run[1].options.round_timeout", "expected float"),
    ('algorithm = "fedavg"\noptions = { round_timeout = 0 }', "run[1].options.round_timeout", "must be > 0"),
    ('algorithm = "fedavg"\nmodels = "H9"', "run[1].models", "a model family (H0, "),
])
def test_a_run_no_device_would_accept_exits_2_before_building(tmp_path, capsys, run, key, words):
    """Every device declines a run whose algorithm the registry lacks, or whose options or model
    family it refuses: ``lab run`` says so in one line naming the file and the key, exit 2,
    before it builds anything (on 75535c2 it built the lab and reported a pass)."""
    bad = tmp_path / "bad.toml"
    bad.write_text(BASE + f"[[run]]\nat_s = 5\nrounds = 2\n{run}\n")
    with pytest.raises(ScenarioError) as e:
        load(bad)
    assert e.value.key == key and words in str(e.value), str(e.value)
    assert dflctl(["lab", "run", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and f"{key}: " in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("text, key, words", [
    (BASE.replace("count = 2", "count = 100000000"), "device[0].count", "at most 200 devices in a scenario"),
    (BASE + "[[device]]\nclass = \"pi\"\ncount = 197\n", "device[3].count", "after 4: at most 200 devices"),
    (BASE + "[[run]]\nat_s = 5\nrounds = 2\nalgorithm = \"fedavg\"\noptions = { x = " + "[" * 5000 + "]" * 5000
     + " }\n", "run[1].options", "nested deeper than 32 levels"),
    (BASE + "[agent]\ntraining = " + "{ a = " * 40 + "1" + " }" * 40 + "\n", "agent.training",
     "nested deeper than 32 levels"),
    (BASE + "[agent." + ".".join(["t"] * 40) + "]\nx = 1\n", "agent" + ".t" * 31, "nested deeper than 32 levels"),
    (BASE.replace('name = "gate"', 'name = "g\udce9te"'), "class[1].name", "not UTF-8 text: byte 0xe9 at line 13"),
    ("# r\udce9sum\u00e9\n" + BASE, "line 1", "not UTF-8 text: byte 0xe9 at line 1, column 4"),
])
def test_a_file_too_large_too_deep_or_not_utf8_exits_2_naming_file_and_key(tmp_path, capsys, text, key, words):
    """``count = 100000000`` (it hung), thousands of nested arrays (a RecursionError thousands of
    lines long), tables nested deeper than 32 levels, a byte that is not UTF-8 (named neither the
    file nor the key): one line naming the file and the key, exit 2, at once."""
    bad = tmp_path / "bad.toml"
    bad.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ScenarioError) as e:
        load(bad)
    assert e.value.key == key and words in str(e.value), str(e.value)
    assert dflctl(["lab", "run", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and f"{key}: " in err and words in err, err[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_run_declined_everywhere_or_that_trained_no_round_fails_the_report():
    """On by default (``runs_trained``): a run every device declined, one that trained no round,
    and one never submitted each fail the report, whatever else the scenario checks; a file
    may turn the check off."""
    from dfl_agent.cli.lab.report import evaluate_checks

    s = parse(_doc())  # checks nothing else
    assert s.checks == {"runs_trained": True} and evaluate_checks(s, _report()) == []
    declined = {"run_id": "r-1", "algorithm": "fedavg", "state": "declined", "members": [], "rounds": 0,
                "deployed_on": []}
    assert evaluate_checks(s, _report(runs=[declined])) == ["runs_trained: run r-1 (fedavg) declined on every device"]
    idle = dict(declined, state="failed", members=["pi-0", "pi-1"])
    assert evaluate_checks(s, _report(runs=[idle])) == ["runs_trained: run r-1 (fedavg) trained no round (failed)"]
    unsent = dict(declined, run_id=None, state="not submitted")
    assert evaluate_checks(s, _report(runs=[unsent])) == ["runs_trained: run 0 (fedavg) was not submitted"]
    off = parse(_doc("[checks]\nruns_trained = false\n"))
    assert evaluate_checks(off, _report(runs=[declined])) == []
