"""``dflctl demo`` labels what its DFML tables and plot show: the deployed (peak) model, flat
between α maxima, against the regular model, and whether a node took part in a round."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from dfl_agent.cli.demo import PEAK_NOTE, _final_table, _table, progress_line
from dfl_agent.runtime.node import metrics


def _render(renderable) -> str:
    buf = io.StringIO()
    Console(file=buf, width=250, no_color=True).print(renderable)
    return buf.getvalue()


def _dfml_history(node: int) -> list[dict]:
    # the peak stays flat while the regular model moves; the node takes part every other round
    return [{"node": f"n{node}", "round": t, "global_accuracy": 0.5 if t < 3 else 0.7, "local_accuracy": 0.6,
             "regular_global_accuracy": 0.4 + 0.05 * t, "local_only_global_accuracy": 0.45,
             "participated": (t + node) % 2 == 0, "participants": 2, "bytes_sent": 1e6 * t,
             "bytes_received": 1e6 * t, "round_seconds": 1.0} for t in range(1, 5)]


def test_dfml_live_table_and_lines_name_peak_regular_and_participation():
    statuses = {"n0": {"round": 3, "state": "running", "global_accuracy": 0.7, "regular_global_accuracy": 0.55,
                       "participated": False, "local_only_global_accuracy": 0.45},
                "n1": {"round": 3, "state": "running", "global_accuracy": 0.7, "regular_global_accuracy": 0.6,
                       "participated": True}}
    text = _render(_table(statuses, {}, ["n0", "n1"], 4))
    for label in ("peak", "regular", "took part", "0.550", "0.600", "deployed model"):
        assert label in text, label
    assert "new maximum" in text  # the caption explains the flat peak curve
    line0, line1 = progress_line("n0", statuses["n0"], 4), progress_line("n1", statuses["n1"], 4)
    assert line0 == "n0 round 3/4: peak (deployed) 0.700, regular 0.550, did not take part, alone 0.450, peers 0"
    assert "regular 0.600, took part" in line1


def test_other_algorithms_keep_the_plain_federated_column():
    statuses = {"n0": {"round": 2, "global_accuracy": 0.8, "neighbours": 2}}
    text = _render(_table(statuses, {}, ["n0"], 4))
    assert "federated" in text and "peak" not in text and "new maximum" not in text
    assert progress_line("n0", statuses["n0"], 4).startswith("n0 round 2/4: federated 0.800, alone -")


def test_dfml_final_table_counts_rounds_taken_part():
    histories = {f"n{i}": _dfml_history(i) for i in range(2)}
    summary = metrics.summarize("dfml", histories, wall_seconds=1.0,
                                bytes_by_node={n: (4e6, 4e6) for n in histories},
                                extra={"max_round_seconds": 1.0})
    buf = io.StringIO()
    _final_table(Console(file=buf, width=250, no_color=True), summary, histories, list(histories), set())
    text = buf.getvalue()
    assert "peak model" in text and "regular model" in text and "took part" in text
    assert "2/4" in text  # each node took part in 2 of 4 rounds
    assert "0.600" in text  # the regular model's last accuracy (0.4 + 0.05 * 4)
    assert PEAK_NOTE.split(";")[0][:40] in text.replace("\n", " ")


def test_dfml_plot_is_written_with_regular_and_participation(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    shown: list[str] = []
    real_text = plt.Axes.text

    def spy(self, x, y, s, *a, **kw):
        shown.append(s)
        return real_text(self, x, y, s, *a, **kw)

    plt.Axes.text = spy
    try:
        assert metrics.plot_accuracy({f"n{i}": _dfml_history(i) for i in range(2)}, tmp_path / "a.png")
    finally:
        plt.Axes.text = real_text
    assert (tmp_path / "a.png").stat().st_size > 0
    assert any("deployed (peak)" in s and "dotted: regular" in s and "took part" in s for s in shown)


def test_dfml_round_log_says_whether_the_node_took_part(caplog):
    pytest.importorskip("torch")
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    caplog.set_level("INFO", logger="dfl_agent.runtime.node.node")
    s = simulate(SimConfig(algorithm="dfml", nodes=4, rounds=3, dataset="iris", partition="iid", model_size="small",
                           options={"sender_ratio": 0.34}))
    assert s["rounds_completed"] == 3
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert lines and not any("neighbours" in m for m in lines)
    assert any(re.search(r"took part \(\d+ participants\)", m) for m in lines)
    assert any("did not take part (model unchanged this round)" in m for m in lines)
