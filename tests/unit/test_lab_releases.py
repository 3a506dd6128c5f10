"""The field lab's releases (dfl_agent.cli.lab.releases) and its ``upgrade`` event: a device that
runs a given wheel, checked before anything is built (exit 2 naming the key), the rolling
upgrade's schedule (one device at a time, the next once the one before is back), and the lab
reading a device's run ledger without taking an earlier release's over."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import tomllib

from dfl_agent.cli.dflctl import main as dflctl
from dfl_agent.cli.lab.releases import CURRENT, ledger_entries, prepare
from dfl_agent.cli.lab.scenario import ScenarioError, load, parse, upgrade_steps

ROOT = Path(__file__).resolve().parents[2]
ROLLING = ROOT / "tools" / "lab" / "scenarios" / "rolling-upgrade.toml"

BASE = """
[lab]
duration_s = 60
[[site]]
name = "a"
[[class]]
name = "pi"
[[class]]
name = "cam"
[[device]]
class = "pi"
count = 3
release = "old"
[[device]]
class = "cam"
role = "inference"
[[run]]
at_s = 2
algorithm = "fedavg"
rounds = 5
"""


def fake_wheel(path: Path, entry: str = "dfl_agent.runtime.daemon:main", package: bool = True) -> Path:
    """A wheel-shaped zip: ``dfl_agent/__init__.py`` and a dist-info naming the entry point."""
    with zipfile.ZipFile(path, "w") as z:
        if package:
            z.writestr("dfl_agent/__init__.py", "__version__ = '0.0.1'\n")
        z.writestr("dfl_agent-0.0.1.dist-info/entry_points.txt", f"[console_scripts]\ndfl-agent = {entry}\n")
    return path


def _parse(tmp_path: Path, extra: str = "", releases: str | None = None) -> object:
    wheel = fake_wheel(tmp_path / "dfl_agent-0.0.1-py3-none-any.whl")
    table = releases if releases is not None else f'[releases]\nold = "{wheel}"\n'
    return parse(tomllib.loads(BASE + table + extra))


def test_a_device_runs_the_release_it_names(tmp_path):
    s = _parse(tmp_path)
    assert [(d.id, d.release) for d in s.devices] == [("pi-0", "old"), ("pi-1", "old"), ("pi-2", "old"),
                                                       ("cam-0", "current")]
    assert s.releases["old"] == tmp_path / "dfl_agent-0.0.1-py3-none-any.whl" and s.releases[CURRENT] is None


@pytest.mark.parametrize("releases, extra, key, words", [
    ('[releases]\nold = "{tmp}/absent.whl"\n', "", "releases.old", "no such wheel or folder: "),
    ('[releases]\nold = "{tmp}/text.whl"\n', "", "releases.old", "not a wheel"),
    ('[releases]\nold = "{tmp}/other.whl"\n', "", "releases.old", "not a wheel of dfl-agent (no dfl_agent/__init__.py"),
    ('[releases]\nold = "{tmp}"\n', "", "releases.old", "a folder without dfl_agent/__init__.py"),
    ('[releases]\nold = "{wheel}"\ncurrent = "{wheel}"\n', "", "releases.current", "the dfl-agent that runs the lab"),
    ('[releases]\nold = 3\n', "", "releases.old", "the path of a wheel or a release folder"),
    ("", "", "device[0].release", "a release of [releases] (current), not 'old'"),
    ('[releases]\nold = "{wheel}"\n', '[[event]]\nat_s = 1\nkind = "upgrade"\ntarget = "pi-0"\nvalue = "new"\n',
     "event[0].value", "a release of [releases] (current, old), not 'new'"),
    ('[releases]\nold = "{wheel}"\n', '[[event]]\nat_s = 1\nkind = "upgrade"\ntarget = "cam-0"\n',
     "event[0].target", "a training device (pi-0, pi-1, pi-2) or \"all\" for upgrade, not 'cam-0'"),
    ('[releases]\nold = "{wheel}"\n', '[[event]]\nat_s = 10\nkind = "upgrade"\ntarget = "pi-0"\nduration_s = 5\n'
                                      '[[event]]\nat_s = 12\nkind = "upgrade"\ntarget = "pi-1"\n',
     "event[1].at_s", "upgrade of pi-1 at 12 s while pi-0 is down (10-15 s): one device at a time"),
])
def test_a_release_that_cannot_run_is_named_by_its_key(tmp_path, releases, extra, key, words):
    wheel = fake_wheel(tmp_path / "dfl_agent-0.0.1-py3-none-any.whl")
    (tmp_path / "text.whl").write_text("not a zip")
    fake_wheel(tmp_path / "other.whl", package=False)
    doc = tomllib.loads(BASE + releases.format(tmp=tmp_path, wheel=wheel) + extra)
    with pytest.raises(ScenarioError) as e:
        parse(doc)
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_an_inference_member_runs_the_labs_own_release(tmp_path):
    wheel = fake_wheel(tmp_path / "w.whl")
    doc = tomllib.loads(BASE.replace('role = "inference"', 'role = "inference"\nrelease = "old"')
                        + f'[releases]\nold = "{wheel}"\n')
    with pytest.raises(ScenarioError) as e:
        parse(doc)
    assert e.value.key == "device[1].release"


def test_lab_run_exits_2_naming_a_missing_wheel(tmp_path, capsys):
    """A release whose wheel is not there: one line naming the file and ``releases.previous``,
    exit 2, before anything is built (no output folder)."""
    out = tmp_path / "out"
    assert dflctl(["lab", "run", str(ROLLING), "--out", str(out), "--release",
                   f"previous={tmp_path / 'dfl_agent-0.1.0-py3-none-any.whl'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(ROLLING) in err, err
    assert f"releases.previous: no such wheel or folder: {tmp_path / 'dfl_agent-0.1.0-py3-none-any.whl'}" in err, err
    assert not out.exists()
    assert dflctl(["lab", "run", str(ROLLING), "--out", str(out), "--release", "previous"]) == 2
    assert "--release previous: NAME=PATH" in capsys.readouterr().err


def test_the_rolling_upgrade_scenario_upgrades_every_device_one_at_a_time(tmp_path):
    """The shipped scenario: three devices on the previous release, each upgraded to this one in
    turn during run 0 (the first 10 s after it trains everywhere, each next one once the one
    before is back), checked by all_upgraded, max_rounds_alone = 0 and samples_lost = 0."""
    s = load(ROLLING, releases={"previous": str(fake_wheel(tmp_path / "w.whl"))})
    assert [(d.id, d.release) for d in s.training()] == [("pi-0", "previous"), ("pi-1", "previous"),
                                                         ("pi-2", "previous")]
    steps = upgrade_steps(s)
    assert [(st.device, st.release, st.after_run, st.after_device) for st in steps] == [
        ("pi-0", "current", 0, None), ("pi-1", "current", None, "pi-0"), ("pi-2", "current", None, "pi-1")]
    assert all(st.down_s > 0 for st in steps) and len(s.runs) == 1
    assert s.checks["all_upgraded"] and s.checks["max_rounds_alone"] == 0 and s.checks["samples_lost"] == 0
    assert s.checks["all_runs_deployed"]


def _rounds(path: Path, *recs: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def test_the_next_device_is_stopped_only_once_the_one_before_is_back(tmp_path):
    """The lab's timeline of an upgrade of all: pi-0's stop counts from run 0; its start from its
    stop; pi-1's stop has no moment until pi-0, started on the new release, has closed a round
    with a peer's update (a round alone, or one from before its stop, does not count)."""
    from dfl_agent.cli.lab.runner import Agent, LabRun

    s = load(ROLLING, releases={"previous": str(fake_wheel(tmp_path / "w.whl"))})
    run = LabRun(s, tmp_path / "out", say=lambda _m: None)
    for d in s.training():
        run.agents[d.id] = Agent(d, tmp_path / d.id, tmp_path / f"{d.id}.toml", tmp_path / f"{d.id}.log",
                                 release=d.release)
    acts = sorted((a for a in run._actions() if "upgrade" in a[2]), key=lambda a: a[2])  # pi-0 stop, start, ...
    assert [(at, what) for at, _after, what, _fn in acts] == [
        (5.0, "upgrade pi-0: agent started on release current"), (10.0, "upgrade pi-0: agent stopped (SIGTERM)"),
        (5.0, "upgrade pi-1: agent started on release current"), (10.0, "upgrade pi-1: agent stopped (SIGTERM)"),
        (5.0, "upgrade pi-2: agent started on release current"), (10.0, "upgrade pi-2: agent stopped (SIGTERM)")]
    assert acts[1][1] == 0  # pi-0's stop: after run 0 trains everywhere
    start0, stop1 = acts[0][1], acts[3][1]
    assert start0() is None and stop1() is None  # pi-0 not stopped yet: nothing
    pi0 = run.upgrades[0]
    pi0.update(stopped=100.0)
    assert start0() == 100.0 and stop1() is None  # stopped, not back
    pi0.update(started=106.0)
    metrics = tmp_path / "pi-0" / "runs" / "r-1" / "metrics.jsonl"
    _rounds(metrics, {"round": 7, "time": 99.0, "neighbours": 2},  # before its stop
            {"round": 30, "time": 110.0, "neighbours": 0})  # alone after its start
    assert stop1() is None
    _rounds(metrics, {"round": 31, "time": 112.5, "neighbours": 1})
    assert stop1() == 112.5  # pi-1 is stopped period_s (10 s) after this


def test_the_lab_reads_an_earlier_releases_ledger_without_taking_it_over(tmp_path):
    """0.1.0 keeps its run ledger in runs/ledger.json; this release's RunLedger takes such a file
    over when it opens the folder (moving it to ledger.json.migrated), which under a running 0.1.0
    agent would lose its history. The lab reads it and leaves the folder as it was."""
    from dfl_agent.runtime.service.ledger import RunLedger

    runs = tmp_path / "old" / "runs"
    runs.mkdir(parents=True)
    (runs / "ledger.json").write_text(json.dumps({"r-1": {"state": "training", "round": 4}, "bad": 3}))
    before = sorted(p.name for p in runs.iterdir())
    assert ledger_entries(tmp_path / "old") == {"r-1": {"state": "training", "round": 4}}
    assert sorted(p.name for p in runs.iterdir()) == before == ["ledger.json"]
    RunLedger(tmp_path / "old")  # what the lab must not do: this release takes the file over
    assert "ledger.json" not in [p.name for p in runs.iterdir()]
    # this release's SQLite ledger, read-only
    new = RunLedger(tmp_path / "new")
    new.set("r-2", "finished", round=9)
    new.close()
    assert ledger_entries(tmp_path / "new")["r-2"]["state"] == "finished"
    assert ledger_entries(tmp_path / "none") == {} and not (tmp_path / "none").exists()


def test_a_wheel_is_unpacked_and_run_through_its_own_entry_point(tmp_path):
    wheel = fake_wheel(tmp_path / "w.whl", entry="dfl_agent.runtime.daemon:main")
    rel = prepare("old", wheel, tmp_path / "releases")
    assert rel.site == tmp_path / "releases" / "old" / "site" and (rel.site / "dfl_agent" / "__init__.py").is_file()
    argv = rel.agent_argv("python3", "run", "--config", "n.toml")
    assert argv[:2] == ["python3", "-c"] and "from dfl_agent.runtime.daemon import main" in argv[2]
    assert argv[3:] == ["run", "--config", "n.toml"]
    env = rel.env({"PYTHONPATH": "/x", "HOME": "/root"})
    assert env["PYTHONPATH"] == f"{rel.site}:/x" and env["HOME"] == "/root"
    cur = prepare(CURRENT, None, tmp_path / "releases")
    assert cur.env({"A": "1"}) == {"A": "1"}
    assert cur.agent_argv("py", "--version") == ["py", "-m", "dfl_agent.runtime.service.daemon", "--version"]


def test_all_upgraded_fails_for_each_way_an_upgrade_can_go_wrong(tmp_path):
    from dfl_agent.cli.lab.report import evaluate_checks

    s = load(ROLLING, releases={"previous": str(fake_wheel(tmp_path / "w.whl"))})
    s.checks = {"all_upgraded": True}

    def rep(upgrades, releases=("current",) * 3):
        return {"devices": [{"id": f"pi-{i}", "role": "train", "release": r} for i, r in enumerate(releases)],
                "upgrades": upgrades, "runs": [], "events": []}

    ok = [{"device": f"pi-{i}", "to": "current", "running_before": True, "started_s": 50.0 + i, "back_after_s": 9.0}
          for i in range(3)]
    assert evaluate_checks(s, rep(ok)) == []
    assert evaluate_checks(s, rep(ok[:2], ("current", "current", "previous"))) == [
        "all_upgraded: pi-2 was not upgraded to current", "all_upgraded: pi-2 ends on release previous, not current"]
    assert evaluate_checks(s, rep([*ok[:2], dict(ok[2], back_after_s=None)])) == [
        "all_upgraded: pi-2 closed no round with a peer after its upgrade to current"]
    assert evaluate_checks(s, rep([dict(ok[0], running_before=False), *ok[1:]])) == [
        "all_upgraded: pi-0 was not running when its upgrade came"]


def test_a_release_folder_runs_as_it_is(tmp_path):
    """A folder holding ``dfl_agent`` (as an unpacked wheel, or a release laid out from git)
    is used in place; without a dist-info its agent's entry point is found by its modules."""
    site = tmp_path / "site"
    (site / "dfl_agent" / "runtime").mkdir(parents=True)
    (site / "dfl_agent" / "__init__.py").write_text("")
    (site / "dfl_agent" / "runtime" / "daemon.py").write_text("")
    rel = prepare("old", site, tmp_path / "releases")
    assert rel.site == site and rel.entry == "dfl_agent.runtime.daemon:main"
    assert not (tmp_path / "releases").exists()
