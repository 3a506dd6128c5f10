"""The agent's shipped compression is the one measured in ``bench/compression/default_choice.py``,
and ``dflctl simulate`` can reproduce the agent's CHOCO settings (``--consensus-step``)."""

from __future__ import annotations

import json

import pytest

from bench.compression import default_choice as bench
from dfl_agent.cli.dflctl import build_parser, main
from dfl_agent.learning.compression import CompressionPolicy, parse_spec
from dfl_agent.runtime.shared.config import NodeConfig


def test_the_shipped_default_is_the_measured_choice_and_meets_the_target() -> None:
    c = NodeConfig().compression
    assert (c.spec, c.error_feedback, c.consensus_step) == bench.CHOSEN
    policy = c.policy()
    assert policy is not None and policy.default == parse_spec(bench.CHOSEN[0]) and policy.error_feedback
    # auto: q4+zstd for averaging gossip, float32 for plain messages (whole models, gradients)
    assert str(policy.stream_spec("model")) == "q4+zstd"  # CHOCO gossip
    assert all(policy.message_spec(k).is_identity for k in ("dfml.model", "defkt.model", "gt.sync"))
    kinds = CompressionPolicy.from_config("auto", {"dfml.model": "q8"})
    assert str(kinds.message_spec("dfml.model")) == "q8" and kinds.message_spec("dfml.update").is_identity
    explicit = CompressionPolicy.from_config("q4+zstd")  # a spec as written still codes whole models with it
    assert str(explicit.message_spec("dfml.model")) == "q4+zstd"
    rows = {bench.key(r): r for r in bench.table(bench.rows_of("fedavg"))}
    chosen = rows[bench.CHOSEN]
    assert chosen["command"] == bench.command_line(*bench.CHOSEN)
    assert chosen["rounds"] == 20
    # within 2 points of no compression, with at least 10x fewer bytes than it
    assert chosen["points"] >= -bench.MAX_LOSS_PT and chosen["factor"] >= bench.MIN_FACTOR, chosen
    assert chosen["passes"]
    # whole models as float32: DFML keeps its accuracy (4-bit models without error feedback do not)
    dfml = {r["spec"]: r for r in bench.table(bench.rows_of("dfml"))}
    assert dfml[bench.CHOSEN[0]]["points"] >= -bench.MAX_LOSS_PT, dfml
    # the committed report is the one the committed rows make
    assert bench.REPORT.read_text() == bench.report()


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
