"""DP-SGD in local training (dfl_agent.learning.dp through Opacus): per-sample clipping,
the noise's standard deviation, Poisson batches, the step count, DFML's mutual learning."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from dfl_agent.algorithms.base import dp_steps_per_round  # noqa: E402
from dfl_agent.learning.dp import DPBudgetExceeded, DPSteps, DPTraining, check_model  # noqa: E402
from dfl_agent.learning.mutual import mutual_learning  # noqa: E402
from dfl_agent.learning.training import TrainConfig, train_adam, train_local  # noqa: E402

torch.set_num_threads(1)


def _data(n: int = 16, d: int = 6, k: int = 3, scale: float = 10.0, seed: int = 0):
    r = np.random.default_rng(seed)
    return (r.normal(size=(n, d)) * scale).astype(np.float32), r.integers(0, k, n).astype(np.int64)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _per_sample_grads(models: list[nn.Module], x: np.ndarray, y: np.ndarray, loss) -> torch.Tensor:
    """(N, P): each sample's gradient over every parameter of ``models`` (by autograd, one by one)."""
    rows = []
    params = [p for m in models for p in m.parameters()]
    for i in range(len(x)):
        xb, yb = torch.from_numpy(x[i:i + 1]), torch.from_numpy(y[i:i + 1])
        grads = torch.autograd.grad(loss(xb, yb), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def _clipped_mean(g: torch.Tensor, c: float) -> torch.Tensor:
    norms = g.norm(dim=1, keepdim=True)
    return (g * (c / (norms + 1e-6)).clamp(max=1.0)).mean(0)


SGD1 = dict(lr=1.0, momentum=0.0, steps=1, batch_size=16)


def test_clipping_bounds_every_per_sample_gradient() -> None:
    """σ = 0, q = 1, one SGD step of lr 1: the update is the mean of the per-sample gradients,
    each clipped to C, exactly as computed by hand, and no single sample moves the model by
    more than C."""
    x, y = _data()
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    original = copy.deepcopy(model)
    before = _flat(model)
    g = _per_sample_grads([model], x, y, lambda xb, yb: F.cross_entropy(model(xb), yb))
    c = 0.5
    assert (g.norm(dim=1) > 4 * c).sum() >= 12  # most samples' raw gradients are far above C
    dp = DPTraining(noise_multiplier=0.0, max_grad_norm=c, sample_rate=1.0)
    stats = train_local(model, x, y, TrainConfig(**SGD1, dp=dp), np.random.default_rng(0))
    update = before - _flat(model)
    assert torch.allclose(update, _clipped_mean(g, c), atol=1e-5)
    assert not torch.allclose(update, g.mean(0), atol=1e-2)  # plain SGD would move it otherwise
    assert stats["dp_steps"] == 1 and dp.counter.taken == 1
    for i in range(len(x)):  # one sample alone: its step's norm is min(|g_i|, C) <= C
        m = copy.deepcopy(original)
        b = _flat(m)
        train_local(m, x[i:i + 1], y[i:i + 1], TrainConfig(**SGD1, dp=dataclasses.replace(dp, counter=DPSteps())),
                    np.random.default_rng(0))
        assert float((b - _flat(m)).norm()) == pytest.approx(min(float(g[i].norm()), c), rel=1e-4)


def test_noise_has_the_configured_standard_deviation() -> None:
    """A zero-gradient loss: the step is noise only, N(0, (σ·C)²) per coordinate, divided by
    the expected batch size q·N; measured over 20 010 parameters on a fixed seed."""
    x, y = _data(n=20)
    torch.manual_seed(0)
    model = nn.Linear(6, 2000)
    nn.init.zeros_(model.weight), nn.init.zeros_(model.bias)
    sigma, c = 1.3, 2.0
    dp = DPTraining(noise_multiplier=sigma, max_grad_norm=c, sample_rate=1.0)
    train_local(model, x, y % 2, TrainConfig(**SGD1, dp=dp), np.random.default_rng(7),
                loss_fn=lambda z, t: (z * 0.0).sum())
    step = -_flat(model) * len(x)  # lr 1, expected batch q·N = 20
    assert float(step.std()) == pytest.approx(sigma * c, rel=0.03)
    assert abs(float(step.mean())) < 0.05 * sigma * c


def test_dp_training_is_poisson_sampled_counted_and_reproducible() -> None:
    """TrainConfig.dp changes the training (not silently off), runs ⌈1/q⌉·epochs Poisson
    steps of varying batch size, is reproducible from the node's seed, and never runs past
    the plan's steps."""
    x, y = _data(n=64, scale=1.0)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    cfg = TrainConfig(epochs=2, batch_size=16, lr=0.1)
    plain, a, b = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    s0 = train_local(plain, x, y, cfg, np.random.default_rng(1))
    dp = DPTraining(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=16 / 64)
    s1 = train_local(a, x, y, dataclasses.replace(cfg, dp=dp), np.random.default_rng(1))
    train_local(b, x, y, dataclasses.replace(cfg, dp=DPTraining(1.0, 1.0, 16 / 64)), np.random.default_rng(1))
    assert "dp_steps" not in s0 and s1["dp_steps"] == 8 == dp.counter.taken  # 2 epochs × ⌈64/16⌉
    assert s1["samples"] != s0["samples"]  # Poisson batches: not 128 samples exactly
    assert not torch.allclose(_flat(plain), _flat(a))
    assert torch.equal(_flat(a), _flat(b))  # the same seed: the same batches and noise
    capped = DPTraining(1.0, 1.0, 0.25, counter=DPSteps(limit=5))
    with pytest.raises(DPBudgetExceeded, match="reserved 5 DP steps"):
        train_local(copy.deepcopy(base), x, y, dataclasses.replace(cfg, dp=capped), np.random.default_rng(1))
    assert capped.counter.taken == 5
    r = train_adam(copy.deepcopy(base), x, y, epochs=1, batch_size=16, lr=0.01, rng=np.random.default_rng(1),
                   dp=DPTraining(1.0, 1.0, 0.25))  # DP-Adam
    assert r["dp_steps"] == 4 and r["diverged"] == 0.0


def test_mutual_learning_under_dp_clips_jointly_and_noises() -> None:
    """DFML's mutual-learning step under DP: each sample's gradient over all the models
    together is clipped to C (σ = 0: the update is exactly the mean of the clipped joint
    per-sample gradients), and with σ > 0 noise is added and the steps are counted."""
    from dfl_agent.learning.losses import kl_divergence

    x, y = _data(n=12)
    torch.manual_seed(0)
    models = [nn.Linear(6, 3), nn.Linear(6, 3)]
    w = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    alpha = 0.4

    def loss(xb, yb):
        z = [m(xb) for m in models]
        return sum((1 - alpha) * F.cross_entropy(z[n], yb) + alpha * w[n, 1 - n] * kl_divergence(z[1 - n], z[n])
                   for n in range(2))

    g = _per_sample_grads(models, x, y, loss)
    before = torch.cat([_flat(m) for m in models])
    c = 0.3
    dp = DPTraining(noise_multiplier=0.0, max_grad_norm=c, sample_rate=1.0)
    stats = mutual_learning(models, [21, 21], x, y, alpha=alpha, epochs=1, batch_size=12, lr=1.0,
                            rng=np.random.default_rng(0), momentum=0.0, weight_decay=0.0, dp=dp)
    update = before - torch.cat([_flat(m) for m in models])
    assert torch.allclose(update, _clipped_mean(g, c), atol=1e-5)
    assert stats["dp_steps"] == 1
    noisy = [copy.deepcopy(m) for m in models]
    ref = [copy.deepcopy(m) for m in models]
    dp2 = DPTraining(noise_multiplier=1.0, max_grad_norm=c, sample_rate=0.5)
    s = mutual_learning(noisy, [21, 21], x, y, alpha=alpha, epochs=3, batch_size=6, lr=0.1,
                        rng=np.random.default_rng(0), momentum=0.0, dp=dp2)
    mutual_learning(ref, [21, 21], x, y, alpha=alpha, epochs=3, batch_size=6, lr=0.1,
                    rng=np.random.default_rng(0), momentum=0.0, dp=DPTraining(0.0, c, 0.5))
    assert s["dp_steps"] == 6 == dp2.counter.taken  # 3 epochs × ⌈1/0.5⌉
    assert not torch.allclose(torch.cat([_flat(m) for m in noisy]), torch.cat([_flat(m) for m in ref]))


def test_batchnorm_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^privacy\.dp: Sequential cannot train under DP .*BatchNorm") as e:
        check_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert "\n" not in str(e.value)
    from dfl_agent.models import build_model, default_spec

    check_model(build_model(default_spec((3, 32), 6)))  # the HAR default CNN trains under DP


def test_dp_steps_per_round() -> None:
    assert dp_steps_per_round("fedavg", None, n_samples=100, batch_size=32, epochs=2, steps=0) == 8
    assert dp_steps_per_round("fedavg", None, n_samples=100, batch_size=32, epochs=2, steps=5) == 5
    from dfl_agent.algorithms.base import get_algorithm, parse_options

    dfml = parse_options(get_algorithm("dfml"), {"mutual_epochs": 3})
    assert dp_steps_per_round("dfml", dfml, n_samples=100, batch_size=32, epochs=2, steps=0) == 4 + 12
    adam = parse_options(get_algorithm("local_adam"), {"adam_epochs": 2})
    assert dp_steps_per_round("local_adam", adam, n_samples=100, batch_size=32, epochs=5, steps=0) == 8


def test_simulate_dp_epsilon_reports_what_each_node_spent(tmp_path, capsys) -> None:
    """``dflctl simulate --dp-epsilon 8``: every node trains under DP (batched training falls
    back to the per-node loop) and summary.json says what it spent: 0 < ε ≤ 8, no more DP
    steps than planned."""
    import json

    from dfl_agent.cli.dflctl import main

    out = tmp_path / "sim"
    assert main(["simulate", "--algorithm", "fedavg", "--nodes", "2", "--rounds", "2", "--dataset", "digits",
                 "--partition", "iid", "--dp-epsilon", "8", "--dp-max-grad-norm", "0.5", "--no-progress",
                 "--out", str(out)]) == 0
    assert "differential privacy: epsilon spent" in capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    dp = s["dp"]
    assert 0 < dp["epsilon_spent"] <= 8.0 and dp["delta"] == 1e-5 and dp["max_grad_norm"] == 0.5
    for node in dp["per_node"].values():
        assert 0 < node["epsilon_spent"] <= 8.0 and 0 < node["steps"] <= node["steps_planned"]
        assert node["noise_multiplier"] > 0 and 0 < node["sample_rate"] < 1
    assert s["batching"]["batched_nodes"] == 0  # DP-SGD runs the per-node loop


def test_simulate_refuses_what_cannot_train_under_dp() -> None:
    from dfl_agent.runtime.node.simulator import SimConfig

    with pytest.raises(ValueError, match="fedd2s"):
        SimConfig(algorithm="fedd2s", dataset="digits", dp_epsilon=8.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        SimConfig(algorithm="fedavg", dataset="digits", dp_epsilon=8.0, dp_max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="baseline_local"):
        SimConfig(algorithm="fedavg", dataset="digits", dp_epsilon=8.0, baseline_local=True)


def test_dp_without_opacus_is_a_one_line_config_error(monkeypatch) -> None:
    """The configuration check finds Opacus without importing it (the supervisor is torch-free)."""
    import importlib.util

    from dfl_agent.privacy.config import parse_privacy

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "opacus" else real(name, *a))
    with pytest.raises(ValueError, match=r"^privacy\.dp: DP training needs Opacus, .*\[privacy\]") as e:
        parse_privacy({"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}})
    assert "\n" not in str(e.value)
    assert parse_privacy({"lifetime_epsilon": 5.0}).dp is None  # no DP asked: no Opacus needed


def test_the_run_trains_under_its_plan_and_records_its_steps(tmp_path) -> None:
    """The training process's side (runtime/run/dp_run.py): privacy.dp -> the plan -> TrainConfig.dp
    (σ, q; steps capped at the plan's less those a resumed run's records count); every round
    record carries the DP steps taken since the record before."""
    from types import SimpleNamespace

    from dfl_agent.runtime.run.dp_run import dp_sink, recorded_dp_steps, with_privacy
    from dfl_agent.runtime.shared.assembly import StartupError

    cfg = SimpleNamespace(privacy={"dp": {"max_grad_norm": 0.5, "noise_multiplier": 1.1}}, state_dir=tmp_path,
                          runtime=SimpleNamespace(baseline_local=False), algorithm=SimpleNamespace(rounds=4))
    train = TrainConfig(epochs=2, batch_size=10)
    got = with_privacy(cfg, None, "fedavg", None, 95, train)
    dp = got.dp
    assert (dp.noise_multiplier, dp.max_grad_norm, dp.sample_rate, dp.counter.limit) == (1.1, 0.5, 10 / 95, 80)
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"round": 1, "dp_steps": 20}\n{"round": 2, "dp_steps": 20}\n{"rou')
    assert recorded_dp_steps(run_dir) == 40
    assert with_privacy(cfg, None, "fedavg", None, 95, train, run_dir).dp.counter.limit == 40  # resumed
    from dfl_agent.privacy.plan import RunPlan
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger

    ledger = PrivacyLedger(tmp_path)
    assert ledger.get("r1")["planned_steps"] == 80  # a run of the service without reservation reserves its plan
    ledger.reserve("r2", RunPlan(noise_multiplier=2.5, sample_rate=0.2, steps=12, epsilon=1.0, delta=1e-5,
                                 max_grad_norm=0.7), 4)  # what admission reserved
    dp2 = with_privacy(cfg, None, "fedavg", None, 95, train, tmp_path / "runs" / "r2").dp
    assert (dp2.noise_multiplier, dp2.sample_rate, dp2.max_grad_norm, dp2.counter.limit) == (2.5, 0.2, 0.7, 12)
    assert with_privacy(SimpleNamespace(**{**vars(cfg), "privacy": None}), None, "fedavg", None, 95, train) is train
    with pytest.raises(StartupError, match="fedd2s"):
        with_privacy(cfg, None, "fedd2s", None, 95, train)
    with pytest.raises(StartupError, match=r"delta: .* not below 1/N"):
        with_privacy(cfg, None, "fedavg", None, 50_000_000, train)
    records: list[dict] = []
    sink = dp_sink(records.append, got)
    dp.counter.take(), dp.counter.take()
    sink({"round": 1}), sink({"event": "x"})
    dp.counter.take()
    sink({"round": 2})
    assert records == [{"round": 1, "dp_steps": 2}, {"event": "x"}, {"round": 2, "dp_steps": 1}]
    assert dp_sink(records.append, train) == records.append


def test_dfml_aggregator_runs_its_mutual_learning_under_dp() -> None:
    """In a DFML federation under DP the aggregator's mutual learning takes DP steps too: the
    nodes take more than their local steps, and no more than planned."""
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    s = simulate(SimConfig(algorithm="dfml", nodes=2, rounds=2, dataset="digits", partition="iid",
                           options={"mutual_epochs": 1}, train=TrainConfig(batch_size=64), dp_epsilon=8.0))
    per = s["dp"]["per_node"].values()
    local = sum(2 * math.ceil(1 / v["sample_rate"] - 1e-9) for v in per)  # one epoch a round each
    assert sum(v["steps"] for v in per) > local
    assert all(v["steps"] <= v["steps_planned"] == 2 * 2 * math.ceil(1 / v["sample_rate"] - 1e-9) for v in per)


def test_dp_steps_per_round_is_the_plans_for_a_local_step() -> None:
    from dfl_agent.privacy.plan import steps_per_round

    for n, b, e, k in [(100, 32, 1, 0), (100, 32, 3, 0), (64, 64, 2, 0), (10, 32, 1, 0), (500, 16, 1, 7)]:
        assert dp_steps_per_round("fedavg", None, n_samples=n, batch_size=b, epochs=e, steps=k) == \
            steps_per_round(n, b, e, k)
