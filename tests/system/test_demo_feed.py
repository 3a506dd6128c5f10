"""``dflctl demo --feed`` at tiny scale: agents start with little data, a feeder adds each
user's windows, two runs follow each other, and the final table shows the deployed versions
with their accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@needs_mosquitto
@pytest.mark.timeout(900)
def test_feed_demo_deploys_every_run_and_the_second_run_trains_on_more(tmp_path):
    out = tmp_path / "feed"
    r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "demo", "--feed", "--nodes", "2", "--runs", "2",
                        "--rounds", "1", "--max-windows", "100", "--feed-interval", "1", "--feed-chunk", "25",
                        "--broker", "mosquitto", "--out", str(out), "--no-live"],
                       capture_output=True, text=True, timeout=840, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert len(s["runs"]) == 2 and not s["failed"]
    assert "final: deployed models" in r.stdout
    for nid, node in s["nodes"].items():
        first, second = node["runs"]
        assert second["train_samples"] > first["train_samples"] > 0, node  # the feeder's windows were used
        assert node["store_samples"] == 100
        deployed = [run for run in node["runs"] if run["deployed_version"] is not None]
        assert deployed and first["deployed_version"] == 1, node  # nothing was deployed: run 1's model is
        for run in deployed:
            assert isinstance(run["accuracy"], float) and 0.0 <= run["accuracy"] <= 1.0
            assert run["deploy_latency_s"] is not None and run["deploy_latency_s"] >= 0
            # the table row shows the version and its accuracy
            assert f"v{run['deployed_version']} acc {run['accuracy']:.3f}" in r.stdout
        assert nid in r.stdout
    # the feeder wrote atomically named files and they all reached the stores
    fed = [json.loads(line) for line in (out / "feed.jsonl").read_text().splitlines()]
    assert {e["node"] for e in fed} == set(s["nodes"]) and max(e["total"] for e in fed) == 100
