"""Meta-tests: patch a feature off and check that the test named after it fails.

Each case runs a strengthened test's body against a deliberately broken variant
(monkeypatch) and expects its assertion to fire."""

from __future__ import annotations

import os
import sys

import pytest

from tests.system.conftest import needs_mosquitto

pytest.importorskip("torch")


@pytest.mark.slow
def test_robust_check_fails_when_the_aggregation_option_is_ignored(monkeypatch):
    import dfl_agent.runtime.node.simulator as simulator
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


# -- subprocess tests: the broken variant is patched into every Python process they start --------

def _break_processes(monkeypatch, tmp_path, code: str) -> None:
    """Run ``code`` at the start of every Python process started from here on (a
    ``sitecustomize`` on ``PYTHONPATH``): the demo's agents, their broker, dflctl."""
    d = tmp_path / "broken_site"
    d.mkdir()
    (d / "sitecustomize.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(d), os.environ.get("PYTHONPATH")) if p))


#: per demo test: code that switches the named feature off in the agent processes
DEMO_BREAKS = {
    # DecHW: every aggregation falls back to data-size weights (no Hessian weighting)
    "dechw": "from dfl_agent.algorithms.dechw import DecHW\nDecHW.uses_hessian = lambda self, t: False\n",
    # Def-KT: the receiver never takes the sender's model
    "defkt": ("from dfl_agent.algorithms.protocols.pairs import PushAlgorithm\n"
              "async def act_as_receiver(self, t, sender, deadline):\n    return {'fused': False}\n"
              "PushAlgorithm.act_as_receiver = act_as_receiver\n"),
    # HeteroFL: the aggregator invites nobody, so it aggregates only its own model
    "heterofl": ("from dfl_agent.algorithms.protocols.rotating import RotatingAggregator\n"
                 "_select = RotatingAggregator.select\n"
                 "def select(self, t, token, live):\n    _, me, nxt = _select(self, t, token, live)\n"
                 "    return [], me, nxt\n"
                 "RotatingAggregator.select = select\n"),
}


@needs_mosquitto
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("algorithm", sorted(DEMO_BREAKS))
def test_demo_algorithm_check_fails_when_the_algorithm_ignores_its_neighbours(algorithm, monkeypatch, tmp_path):
    from tests.system import test_demo

    _break_processes(monkeypatch, tmp_path, DEMO_BREAKS[algorithm])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(AssertionError):
        test_demo.test_other_algorithms_run_on_real_agent_processes(run_dir, algorithm)


@pytest.mark.slow
@pytest.mark.integration
def test_amqtt_demo_check_fails_when_agents_ignore_the_protocol(monkeypatch, tmp_path):
    pytest.importorskip("amqtt")
    from tests.system import test_demo

    _break_processes(monkeypatch, tmp_path, (  # the agents connect with MQTT 5 whatever --protocol says
        "import dfl_agent.transport.mqtt as m\n_init = m.MqttTransport.__init__\n"
        "def init(self, *a, **k):\n    k['protocol'] = '5'\n    _init(self, *a, **k)\n"
        "m.MqttTransport.__init__ = init\n"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(AssertionError):
        test_demo.test_demo_over_amqtt_with_mqtt_311(run_dir)


@pytest.mark.slow
@pytest.mark.integration
def test_reload_check_fails_when_sighup_applies_nothing(monkeypatch, tmp_path, mosquitto_broker, federation):
    from tests.integration import test_systemd_notify

    code = ("import sys\nfrom dfl_agent.runtime.service import daemon, run_manager\n"
            "def reload(self):  # says RELOADING and READY, applies nothing (the run is not told)\n"
            "    self.notifier.reloading()\n    self.notifier.ready('idle')\n"
            "run_manager.RunManager.reload = reload\nsys.exit(daemon.main())\n")
    monkeypatch.setattr(test_systemd_notify, "AGENT", [sys.executable, "-c", code])
    with pytest.raises(AssertionError, match="applied runtime.log_level|DEBUG|assert False"):
        test_systemd_notify.test_agent_process_notifies_ready_status_watchdog_and_reloads(
            tmp_path, mosquitto_broker, federation)
