"""The agent's shipped compression is the one measured in ``bench/compression/default_choice.py``,
and ``dflctl simulate`` can reproduce the agent's CHOCO settings (``--consensus-step``)."""

from __future__ import annotations

import json

import pytest

from dfl_agent.cli.dflctl import build_parser, main


def test_simulate_takes_the_agents_consensus_step(capsys) -> None:
    assert build_parser().parse_args(["simulate"]).consensus_step == 0.0  # automatic, as the config's default
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["simulate", "--consensus-step", "-0.5"])
    assert e.value.code == 2
    assert "--consensus-step: must be >= 0" in capsys.readouterr().err
    rc = main(["simulate", "--algorithm", "fedavg", "--dataset", "iris", "--partition", "iid", "--nodes", "2",
               "--rounds", "1", "--compression", "topk:0.5+q8", "--consensus-step", "0.25", "--json", "--no-progress"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["compression"], s["error_feedback"], s["consensus_step"]) == ("topk:0.5+q8", True, 0.25)
