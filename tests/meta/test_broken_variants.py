"""Meta-tests: patch a feature off and check that the test named after it fails.

Each case runs a strengthened test's body against a deliberately broken variant
(monkeypatch) and expects its assertion to fire."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_robust_check_fails_when_the_aggregation_option_is_ignored(monkeypatch):
    import dfl_agent.runtime.simulator as simulator
    from tests.unit import test_robust

    real = simulator.parse_options

    def ignore_aggregation(cls, options):  # the broken variant: the option never reaches the algorithm
        return real(cls, {k: v for k, v in (options or {}).items() if k != "aggregation"})

    monkeypatch.setattr(simulator, "parse_options", ignore_aggregation)
    with pytest.raises(AssertionError):
        test_robust.test_algorithms_run_with_a_robust_rule("fedavg", "median", monkeypatch)


@pytest.mark.slow
def test_defkt_run_helper_fails_when_a_node_crashes():
    from tests.unit import test_defkt

    net, nodes = test_defkt._federation(3)

    async def crash(t):  # the broken variant: one node's round raises
        raise RuntimeError("node crashed")

    with pytest.raises(AssertionError, match="crashed"):
        test_defkt._run(net, nodes, 2, before=lambda: setattr(nodes[1].algorithm, "round", crash))
