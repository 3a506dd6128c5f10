"""Round progress of ``dflctl simulate`` and the benchmarks (dfl_agent.cli.progress).

Without a terminal: one plain line per round on stderr, stdout untouched (``--json`` stays
one clean JSON document)."""

from __future__ import annotations

import io
import json
import re

import pytest

from dfl_agent.cli.progress import progress_line, round_progress


def test_plain_lines_without_a_terminal():
    err = io.StringIO()  # not a terminal: isatty() is False
    with round_progress(4, "simulate fedavg", file=err) as tick:
        tick(0, None)  # rounds start: prints nothing
        tick(1, 0.5)
        tick(2, None)  # not evaluated this round: the last accuracy stays
        tick(3, 0.75)
        tick(4, 0.8)
    lines = err.getvalue().splitlines()
    assert len(lines) == 4
    assert re.fullmatch(r"simulate fedavg: round 1/4, accuracy 0\.5000, [0-9.]+s elapsed, ETA [0-9.]+s", lines[0])
    assert "round 2/4, accuracy 0.5000" in lines[1] and "round 3/4, accuracy 0.7500" in lines[2]
    assert lines[3].startswith("simulate fedavg: round 4/4, accuracy 0.8000") and "ETA" not in lines[3]
    assert "\x1b" not in err.getvalue()  # no terminal codes in a log


def test_progress_line_eta_and_durations():
    assert progress_line("x", 2, 10, None, 20.0) == "x: round 2/10, 20.0s elapsed, ETA 1m20s"
    assert progress_line("x", 2, 10, 0.25, 100.0, 30.0, 1) == \
        "x: round 2/10, accuracy 0.2500, 1m40s elapsed, ETA 4m00s"
    assert progress_line("x", 1, 400, None, 30.0).endswith("ETA 3h19m")


def test_rich_bar_on_a_terminal_and_disabled():
    out = io.StringIO()
    with round_progress(3, "run", file=out, rich_display=True) as tick:
        for t, acc in ((0, None), (1, 0.5), (2, None), (3, 0.7)):
            tick(t, acc)
    assert "3/3" in out.getvalue() and "acc 0.7000" in out.getvalue()
    quiet = io.StringIO()
    with round_progress(3, "run", file=quiet, enabled=False) as tick:
        tick(1, 0.5)
    assert quiet.getvalue() == ""


def test_simulate_json_stdout_stays_clean_and_progress_goes_to_stderr(capsys):
    pytest.importorskip("torch")
    from dfl_agent.cli.dflctl import main

    rc = main(["simulate", "--nodes", "3", "--rounds", "3", "--dataset", "iris", "--partition", "iid",
               "--steps", "1", "--model-size", "small", "--eval-every", "2", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)  # the whole of stdout is one JSON document
    assert doc["rounds_completed"] == 3
    rounds = [int(m) for m in re.findall(r"simulate fedavg \(3 nodes\): round (\d)/3", err)]
    assert rounds == [1, 2, 3]
    # evaluated at rounds 1, 2 and 3 (the last): the shown accuracy is the nodes' mean
    last = float(re.findall(r"round 3/3, accuracy ([0-9.]+)", err)[0])
    assert last == pytest.approx(doc["global_accuracy"]["mean"], abs=1e-4)
    capsys.readouterr()
    assert main(["simulate", "--nodes", "2", "--rounds", "1", "--dataset", "iris", "--partition", "iid",
                 "--steps", "1", "--model-size", "small", "--no-progress", "--json"]) == 0
    assert "round 1/1" not in capsys.readouterr().err


def test_killed_nodes_do_not_stall_progress():
    pytest.importorskip("torch")
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    ticks: list[tuple[int, float | None]] = []
    simulate(SimConfig(nodes=3, rounds=3, dataset="iris", partition="iid", kill={1: 2}, model_size="small"),
             progress=lambda t, acc: ticks.append((t, acc)))
    assert [t for t, _ in ticks] == [0, 1, 2, 3]
    assert ticks[0][1] is None and all(acc is not None for _, acc in ticks[1:])
