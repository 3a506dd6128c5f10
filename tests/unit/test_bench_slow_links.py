"""bench/lab/slow_links.py's pure parts: its six scenarios (the committed files are the
script's and the lab accepts them), the time split from round records, the rows, the
compression factor and the table."""

from __future__ import annotations

from bench.lab import slow_links as bench
from dfl_agent.cli.lab.scenario import load


def test_six_cells_three_rates_without_and_with_the_default_compression() -> None:
    cells = bench.cells("auto")
    assert [c[0] for c in cells] == ["slow-500kbit-none", "slow-500kbit-auto", "slow-2mbit-none", "slow-2mbit-auto",
                                     "slow-10mbit-none", "slow-10mbit-auto"]
    assert bench.cells("topk:0.01+q8")[1][0] == "slow-500kbit-topk_0.01_q8"


def test_the_committed_scenarios_are_the_scripts_and_the_lab_takes_them() -> None:
    for name, rate, spec in bench.cells():
        path = bench.SCENARIOS / f"{name}.toml"
        assert path.read_text() == bench.SCENARIO.format(name=name, rate=rate, spec=spec, rounds=bench.ROUNDS,
                                                         duration=bench.DURATION_S), name
        sc = load(path)
        assert [d.id for d in sc.devices] == ["dev-0", "dev-1", "dev-2"] and not sc.events
        assert sc.devices[0].cls.cpu == 0.5 and sc.devices[0].cls.rate == rate and sc.duration_s <= 210
        assert [(r.algorithm, r.rounds) for r in sc.runs] == [("fedavg", 30)]
        assert sc.agent["model"] == {"family": "H2", "size": "large"}
        assert sc.agent["compression"]["spec"] == spec and sc.agent["mqtt"]["link_rate"] == rate


def _rec(rnd: int, time: float, wall: float, train: float, sent: int, got: int) -> dict:
    return {"round": rnd, "time": time, "round_wall_s": wall, "train_s": train, "round_bytes_sent": sent,
            "round_bytes_received": got}


def test_the_split_of_a_devices_rounds() -> None:
    # 1 Mbit/s: round 1 moves 250 kB (2 s of link), round 2 1 MB (8 s, more than the 6 s not training)
    recs = [_rec(1, 110.0, 5.0, 1.0, 100_000, 250_000), _rec(2, 117.0, 7.0, 1.0, 1_000_000, 400_000),
            _rec(3, 120.0, 3.0, 1.0, 0, 0)]
    assert bench._split(recs, None, 1e6, submitted=100.0) == {
        "startup_s": 5.0, "training_s": 3.0, "transfer_s": 8.0, "waiting_s": 4.0}
    assert bench._split(recs, 1, 1e6, submitted=100.0) == {
        "startup_s": 5.0, "training_s": 1.0, "transfer_s": 2.0, "waiting_s": 2.0}
    assert bench._split([], None, 1e6, 0.0)["training_s"] == 0.0


def _report(tta: dict, sent: int) -> dict:
    return {"runs": [{"state": "finished", "submitted_s": 2.0, "time_to_accuracy": tta,
                      "accuracy_curve": [[20.0, 1, 0.5]]}],
            "devices": [{"id": "dev-0", "role": "train", "round_accuracy": [[20.0, 1, 0.5]]}],
            "links": {"dev-0": {"bytes_to_host": 3_000_000, "bytes_from_host": 1_000_000}, "broker-a": {
                "bytes_to_host": 9, "bytes_from_host": 9}},
            "bytes_total": sent, "wall_seconds": 100.0, "passed": True}


def test_rows_factors_and_the_table() -> None:
    recs = {"dev-0": [_rec(r, 1000.0 + 10 * r, 5.0, 1.0, 1000, 2000) for r in range(1, 11)]}
    never = {"target": 0.65, "seconds": None, "round": None, "best": 0.612}
    reached = {"target": 0.65, "seconds": 41.0, "round": 4, "best": 0.7}
    assert bench._t0(_report(never, 0), recs) == 1000.0 + 10 - 20.0
    rows = bench.with_factors([bench.row(_report(never, 8_000_000), recs, 990.0, "2mbit", "none", "slow-2mbit-none"),
                               bench.row(_report(reached, 1_000_000), recs, 990.0, "2mbit", "auto", "slow-2mbit-auto")])
    assert [r["factor"] for r in rows] == [1.0, 8.0]
    assert rows[0]["wire_bytes"] == 4_000_000 and rows[0]["bytes_sent_per_round"] == 800_000
    assert rows[1]["split"]["training_s"] == 4.0 and rows[0]["split"]["training_s"] == 10.0
    md = bench.render(rows, {"command": "cmd", "host": "x86_64, 2 cores", "date": "2026-01-01"})
    assert "| 2mbit | none | 10 | never (best 0.612) | - | 8.00 | 800 | 1.0x | 4.00 |" in md
    assert "| 2mbit | auto | 10 | 41 (round 4) | - | 1.00 | 100 | 8.0x |" in md  # no time factor against "never"
    rows[0]["time_to_accuracy"] = dict(reached, seconds=82.0)
    rows = bench.with_factors(rows)
    assert [r["speedup"] for r in rows] == [1.0, 2.0]
    assert "| 2mbit | auto | 10 | 41 (round 4) | 2.0x | 1.00 |" in bench.render(rows, {})
    assert md.index("| 2mbit | none") < md.index("| 2mbit | auto")
