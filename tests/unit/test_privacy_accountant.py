"""The torch-free RDP accountant and the run's DP plan.

The accountant must give the ε of Opacus's ``RDPAccountant`` (the independent implementation)
for the same history of several runs, within 1 %, and importing it must not load torch.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from dfl_agent.privacy.accountant import ORDERS, noise_for_epsilon, rdp_epsilon
from dfl_agent.privacy.config import DPConfig
from dfl_agent.privacy.plan import plan_run, steps_per_round

#: several runs of different noise, sampling rate and length (integer and fractional orders win)
HISTORY = [(1.1, 0.01, 1000), (0.8, 0.05, 300), (2.0, 0.2, 50), (5.0, 0.5, 10), (0.6, 0.001, 20000)]


def _opacus_epsilon(history, delta):
    pytest.importorskip("opacus")
    import warnings

    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = list(history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha"
        return acc.get_epsilon(delta=delta)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_agrees_with_opacus_within_one_percent(n: int) -> None:
    for delta in (1e-5, 1e-3):
        ours = rdp_epsilon(HISTORY[:n], delta)
        ref = _opacus_epsilon(HISTORY[:n], delta)
        assert ours == pytest.approx(ref, rel=0.01), (n, delta, ours, ref)


def test_each_run_alone_agrees_with_opacus() -> None:
    for run in HISTORY:
        assert rdp_epsilon([run], 1e-5) == pytest.approx(_opacus_epsilon([run], 1e-5), rel=0.01), run


def test_composition_grows_and_edges() -> None:
    assert rdp_epsilon([], 1e-5) == 0.0
    assert rdp_epsilon([(1.0, 0.0, 100)], 1e-5) == 0.0  # nothing sampled
    assert rdp_epsilon([(1.0, 0.1, 0)], 1e-5) == 0.0  # no step
    assert math.isinf(rdp_epsilon([(0.0, 0.1, 10)], 1e-5))  # no noise
    one = rdp_epsilon(HISTORY[:1], 1e-5)
    assert rdp_epsilon(HISTORY[:1] * 2, 1e-5) > one
    assert rdp_epsilon([(1.1, 0.01, 2000)], 1e-5) == pytest.approx(rdp_epsilon(HISTORY[:1] * 2, 1e-5))
    assert rdp_epsilon([(2.0, 1.0, 10)], 1e-5) > 0  # full batches: the plain Gaussian mechanism
    assert len(ORDERS) == 151 and ORDERS[0] == pytest.approx(1.1) and ORDERS[-1] == 63


@pytest.mark.filterwarnings("ignore:Optimal order")
def test_noise_for_epsilon_is_the_smallest_that_meets_the_target() -> None:
    q, steps, delta = 0.01, 2000, 1e-5
    sigma = noise_for_epsilon(3.0, q, steps, delta, history=HISTORY)
    assert rdp_epsilon([(sigma, q, steps)], delta) <= 3.0
    assert rdp_epsilon([(sigma * 0.999, q, steps)], delta) > 3.0
    pytest.importorskip("opacus")
    from opacus.accountants.utils import get_noise_multiplier

    ref = get_noise_multiplier(target_epsilon=3.0, target_delta=delta, sample_rate=q, steps=steps,
                               accountant="rdp", epsilon_tolerance=0.001)
    assert sigma == pytest.approx(ref, rel=0.01)


def test_unreachable_epsilon_is_refused() -> None:
    with pytest.raises(ValueError, match="no noise multiplier up to 1000"):
        noise_for_epsilon(1e-6, 1.0, 100000, 1e-5)
    with pytest.raises(ValueError, match="target epsilon"):
        noise_for_epsilon(0.0, 0.1, 10, 1e-5)


def test_plan_from_noise_and_from_target() -> None:
    assert steps_per_round(1000, 32, 2, 0) == 2 * 32
    assert steps_per_round(1000, 32, 2, 5) == 5
    p = plan_run(DPConfig(max_grad_norm=1.0, noise_multiplier=1.1), n_samples=1000, batch_size=32,
                 steps_per_round=32, rounds=10)
    assert (p.sample_rate, p.steps, p.noise_multiplier, p.max_grad_norm) == (0.032, 320, 1.1, 1.0)
    assert p.epsilon == pytest.approx(rdp_epsilon([(1.1, 0.032, 320)], 1e-5))
    t = plan_run(DPConfig(max_grad_norm=2.0, target_epsilon=4.0), n_samples=1000, batch_size=32,
                 steps_per_round=32, rounds=10)
    assert t.epsilon <= 4.0 and t.epsilon == pytest.approx(4.0, rel=0.01)
    assert plan_run(DPConfig(max_grad_norm=1.0, noise_multiplier=1.0), n_samples=10, batch_size=32,
                    steps_per_round=1, rounds=1).sample_rate == 1.0


@pytest.mark.parametrize("dp,n,match", [
    (DPConfig(max_grad_norm=1.0, noise_multiplier=1.0), 0, r"N = 0"),
    (DPConfig(max_grad_norm=1.0, delta=0.01, noise_multiplier=1.0), 100, r"privacy.dp.delta: 0.01 is not below 1/N"),
    (DPConfig(max_grad_norm=1.0, target_epsilon=1e-6), 100, r"privacy.dp.target_epsilon: no noise multiplier"),
])
def test_plan_refusals_are_one_line(dp: DPConfig, n: int, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        plan_run(dp, n_samples=n, batch_size=100, steps_per_round=1000, rounds=100)
    assert "\n" not in str(e.value)


def test_importing_the_accountant_and_plan_loads_no_torch() -> None:
    code = ("import sys, dfl_agent.privacy.accountant, dfl_agent.privacy.plan, dfl_agent.privacy.config\n"
            "from dfl_agent.privacy.accountant import rdp_epsilon\n"
            "rdp_epsilon([(1.0, 0.01, 100)], 1e-5)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'opacus'))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "[]", r.stdout


# SciPy made unimportable (None in sys.modules), as in an install of `[train]` alone: the agent's
# modules (the supervisor, the run manager, the training agent and its deployment) must import, a
# device without DP must account nothing, and the accountant names the `privacy` extra once used.
_NO_SCIPY = """
import sys
sys.modules["scipy"] = None
import dfl_agent.runtime.service.daemon, dfl_agent.runtime.service.supervisor, dfl_agent.runtime.service.run_manager
import dfl_agent.runtime.run.agent, dfl_agent.runtime.run.deployment, dfl_agent.runtime.service.privacy_budget
from dfl_agent.privacy.accountant import rdp_epsilon
assert rdp_epsilon([], 1e-5) == 0.0 and rdp_epsilon([(1.0, 0.0, 100), (1.0, 0.1, 0)], 1e-5) == 0.0
try:
    rdp_epsilon([(1.0, 0.01, 100)], 1e-5)
except ModuleNotFoundError as exc:
    print(exc)
leaked = sorted(m for m in sys.modules if m.startswith("scipy.") or (m == "scipy" and sys.modules[m] is not None))
print("leaked:", leaked)
"""


def test_the_agent_imports_and_runs_without_scipy_until_dp_is_accounted() -> None:
    r = subprocess.run([sys.executable, "-c", _NO_SCIPY], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[-1] == "leaked: []", r.stdout
    assert lines[0].startswith("the privacy accountant needs SciPy, which is not installed: pip install '")
    assert "[privacy]'" in lines[0], lines[0]
