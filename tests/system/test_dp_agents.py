"""A real agent process (over a real mosquitto) trains a run under ``privacy.dp``:
every round is DP-SGD with the run's plan (the log names σ, C, q and the steps), each round
record counts its DP steps, and the run takes exactly the steps its plan reserved."""

import json
import math
import re
import subprocess
import sys

import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]

pytest.importorskip("opacus")


@needs_mosquitto
def test_agents_train_under_their_dp_plan(tmp_path):
    fed, rounds = "dpagents", 3
    with start_broker("mosquitto") as broker:
        procs = []
        for i in range(1):
            cfg = config_from_dict({
                "federation": fed, "node_id": f"a{i}", "state_dir": str(tmp_path / f"a{i}"),
                "algorithm": {"name": "local", "rounds": rounds},
                "data": {"dataset": "digits", "partition": "iid", "num_nodes": 2, "node_index": i},
                "training": {"batch_size": 32},
                "mqtt": {"broker": broker.endpoint},
                "discovery": {"min_peers": 0},
                "privacy": {"dp": {"max_grad_norm": 0.8, "noise_multiplier": 1.1}},
            })
            path = tmp_path / f"a{i}.toml"
            path.write_text(dump_toml(cfg))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                stdout=open(tmp_path / f"a{i}.log", "w"), stderr=subprocess.STDOUT))
        for i, p in enumerate(procs):
            assert p.wait(timeout=120) == 0, (tmp_path / f"a{i}.log").read_text()[-3000:]
    for i in range(1):
        log = (tmp_path / f"a{i}.log").read_text()
        m = re.search(r"differential privacy: noise multiplier 1\.1, max_grad_norm 0\.8, sampling rate ([\d.]+), "
                      r"(\d+) DP steps \((\d+) a round, 0 taken before\)", log)
        assert m, log[-3000:]
        q, total, per_round = float(m.group(1)), int(m.group(2)), int(m.group(3))
        assert per_round == math.ceil(1 / q - 1e-9) and total == rounds * per_round  # one epoch a round
        records = [json.loads(x) for x in (tmp_path / f"a{i}" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in records if "round" in r]
        assert [r["round"] for r in rows] == [1, 2, 3]
        # each record counts the steps since the record before (a round's training may overlap
        # the previous record); together they are the run's steps, exactly the plan's
        assert all(r["dp_steps"] > 0 for r in rows) and sum(r["dp_steps"] for r in rows) == total
