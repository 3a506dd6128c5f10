"""The lab report's traffic per link (counters read with ``ip -s -j link``, counted from the
first sample, downsampled), its tables in report.md, and plots that are optional."""

from __future__ import annotations

import builtins
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from dfl_agent.cli.lab.report import _accuracy_traffic_md, _plots
from dfl_agent.cli.lab.traffic import downsample, parse_link_stats, summarize


def test_counters_are_read_from_ip_json_output() -> None:
    text = json.dumps([{"ifname": "lo", "stats64": {"rx": {"bytes": 5}, "tx": {"bytes": 7}}},
                       {"ifname": "dlab0", "stats64": {"rx": {"bytes": 1200}, "tx": {"bytes": 3400}}},
                       {"ifname": "br0"}])
    assert parse_link_stats(text) == {"lo": (5, 7), "dlab0": (1200, 3400)}
    r = subprocess.run(["ip", "-s", "-j", "link"], capture_output=True, text=True)
    if r.returncode == 0:  # this machine's own output parses (lo at least)
        assert "lo" in parse_link_stats(r.stdout)


def test_downsampling_keeps_the_first_and_last_point() -> None:
    pts = [[float(i), i * 10, i] for i in range(1000)]
    out = downsample(pts, 300)
    assert len(out) == 300 and out[0] == pts[0] and out[-1] == pts[-1]
    assert [p[0] for p in out] == sorted(p[0] for p in out)
    assert downsample(pts[:5], 300) == pts[:5] and downsample(pts, 1) == [pts[-1]]


def test_a_link_counts_from_its_first_sample_and_over_a_counter_restart() -> None:
    samples = [{"t": 100.0, "links": {"pi-0": [1000, 500]}},
               {"t": 101.0, "links": {"pi-0": [1600, 900], "broker-a": [10, 20]}},
               {"t": 102.0, "links": {"pi-0": [100, 950], "broker-a": [30, 20]}},  # to: counter restarted
               {"t": 103.0, "links": {"pi-0": [300, 1000], "broker-a": [40, 60]}}]
    links = summarize(samples, t0=99.0)
    assert links["pi-0"] == {"bytes_to_host": 900, "bytes_from_host": 500,
                             "series": [[1.0, 0, 0], [2.0, 600, 400], [3.0, 700, 450], [4.0, 900, 500]]}
    assert links["broker-a"]["bytes_to_host"] == 30 and links["broker-a"]["bytes_from_host"] == 40
    many = summarize([{"t": float(i), "links": {"h": [i * 3, i]}} for i in range(2000)], t0=0.0)
    assert len(many["h"]["series"]) == 300 and many["h"]["bytes_to_host"] == 1999 * 3


def _rep() -> dict:
    return {"runs": [{"run_id": "r-1", "accuracy_curve": [[20.0, 1, 0.5], [30.0, 2, 0.7]],
                      "time_to_accuracy": {"target": 0.65, "seconds": 27.5, "round": 2, "best": 0.7}},
                     {"run_id": "r-2", "accuracy_curve": [[50.0, 1, 0.4]],
                      "time_to_accuracy": {"target": 0.65, "seconds": None, "round": None, "best": 0.4}},
                     {"run_id": None, "accuracy_curve": [],
                      "time_to_accuracy": {"target": 0.65, "seconds": None, "round": None, "best": None}}],
            "links": {"pi-0": {"bytes_to_host": 2_500_000, "bytes_from_host": 1_000_000,
                               "series": [[0.0, 0, 0], [5.0, 2_500_000, 1_000_000]]}},
            "devices": [{"id": "pi-0", "round_accuracy": [[20.0, 1, 0.5], [30.0, 2, 0.7]]}],
            "events": [{"started_s": 10.0, "ended_s": 15.0}], "notes": []}


def test_report_md_gives_time_to_accuracy_and_bytes_per_link() -> None:
    md = "\n".join(_accuracy_traffic_md(_rep()))
    assert "| r-1 | 2 | 0.700 | 0.65: 27.5 s (round 2) |" in md
    assert "| r-2 | 1 | 0.400 | 0.65: never |" in md and "| None | 0 | - | 0.65: - |" in md
    assert "| pi-0 | 2.50 | 1.00 |" in md


def _run(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(out=tmp_path, agents={"pi-0": None}, t0=0.0)


def test_plots_are_optional_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    rep = _rep()
    assert _plots(_run(tmp_path), rep, {"pi-0": {}}, {"deployments": []}) == []
    assert "matplotlib is not installed" in rep["notes"][0] and not list(tmp_path.iterdir())


def test_plots_show_round_and_link_figures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rep = _rep()
    col = {"deployments": [{"node": "pi-0", "time": 0.0, "heldout_accuracy": 0.7}]}
    assert _plots(_run(tmp_path), rep, {"pi-0": {}}, col) == ["accuracy.png", "traffic.png"]
    assert all((tmp_path / n).stat().st_size > 1000 for n in ("accuracy.png", "traffic.png"))
