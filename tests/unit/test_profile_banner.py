"""A run logs its device profile's decisions on one line, not one line per decision (a
7-line banner repeated by every run before)."""

from __future__ import annotations

import logging

from dfl_agent.runtime.run.agent import Agent
from dfl_agent.runtime.shared.config import config_from_dict
from tests.host import LobbyHost


def test_the_profile_decisions_are_one_log_line(tmp_path, caplog) -> None:
    cfg = config_from_dict({"federation": "f", "node_id": "n", "state_dir": str(tmp_path),
                            "profile": "raspberry-pi-4", "algorithm": {"name": "fedavg", "rounds": 1},
                            "data": {"dataset": "digits", "partition": "iid"}, "discovery": {"mdns": False}})
    with caplog.at_level(logging.INFO, logger="dfl_agent.daemon"):
        s = Agent(cfg, host=LobbyHost(publish=False))._prepare()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile raspberry-pi-4:")]
    assert len(s.behaviour.reasons) >= 2 and len(lines) == 1, lines
    assert all(reason in lines[0] for reason in s.behaviour.reasons)
