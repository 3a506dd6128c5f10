"""The lone node (real mosquitto, real ``dfl-agent run --once`` processes): ``discovery.min_peers
= 2`` on a federation nobody else joined.  It trains alone, logs the degraded run at WARNING
at most once every 10 rounds, exits 4, and ``dflctl status`` shows it degraded; with
``runtime.allow_alone = true`` the same run exits 0.  At 0c2393f (and before this change) the
lone node exited 0 with one warning ("only 0 of 2 peers")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dfl_agent.cli.broker import start_broker
from tests.system.conftest import needs_mosquitto
from tests.system.test_agent_logs import _config

pytestmark = [pytest.mark.integration, needs_mosquitto]

AGENT = [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config"]


def _lone(tmp: Path, fed: str, broker: str, **runtime) -> Path:
    tmp.mkdir()
    return _config(tmp, fed, "solo", broker, {"name": "fedavg", "rounds": 12},
                   discovery={"min_peers": 2, "start_timeout": 2}, runtime=runtime)


def test_the_lone_node_exits_4_warns_and_shows_degraded(tmp_path):
    with start_broker("mosquitto") as broker:
        strict = _lone(tmp_path / "strict", "lone", broker.endpoint)
        allowed = _lone(tmp_path / "allowed", "lone-allowed", broker.endpoint, allow_alone=True)
        logs = {p: open(p.with_suffix(".log"), "w") for p in (strict, allowed)}
        procs = {p: subprocess.Popen([*AGENT, str(p)], stdout=f, stderr=subprocess.STDOUT) for p, f in logs.items()}
        rc = {p: proc.wait(120) for p, proc in procs.items()}
        text = strict.with_suffix(".log").read_text()
        status = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "status", "--config", str(strict)],
                                capture_output=True, text=True, timeout=60)
    assert rc[strict] == 4, text[-3000:]
    assert rc[allowed] == 0, allowed.with_suffix(".log").read_text()[-3000:]
    warned = re.findall(r"WARNING \S+: round (\d+) closed alone .* the run is degraded, (\d+) of (\d+) rounds", text)
    assert warned == [("1", "1", "1"), ("11", "11", "11")], text[-3000:]
    assert "ERROR dfl_agent.daemon: the run was degraded: 12 of 12 rounds closed alone" in text
    assert "Traceback" not in text
    assert status.returncode == 0, status.stderr
    assert re.search(r"solo .*12/12 alone", status.stdout), status.stdout
