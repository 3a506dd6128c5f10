"""The lab report's accuracy of every round's model: rebuilt from the run's checkpoints
(written by the agent's own CheckpointStore, the model spec by the agent's own rule on the
run's ``run.toml``) and measured on held-out windows; the devices' mean per round, and the
time a run takes to reach a target from its submission."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dfl_agent.cli.lab.accuracy import (
    accuracy_curve,
    checkpoints_to_keep,
    measure_run,
    rounds_to_measure,
    time_to_accuracy,
)


def test_rounds_to_measure_keeps_all_up_to_the_cap_then_spreads_them() -> None:
    assert rounds_to_measure([3, 1, 2, 2]) == [1, 2, 3]
    picked = rounds_to_measure(range(1, 101), cap=10)
    assert len(picked) == 10 and picked[0] == 1 and picked[-1] == 100
    assert all(b - a in (11, 12) for a, b in zip(picked, picked[1:])), picked
    assert rounds_to_measure([], cap=5) == [] and rounds_to_measure([4, 9], cap=1) == [9]


def test_the_curve_is_the_mean_per_round_at_the_latest_device_time() -> None:
    series = {"pi-0": [[10.0, 1, 0.5], [12.0, 2, 0.7]], "pi-1": [[11.0, 1, 0.3], [13.5, 2, 0.6], [15.0, 3, 0.8]]}
    assert accuracy_curve(series) == [[11.0, 1, 0.4], [13.5, 2, 0.65], [15.0, 3, 0.8]]
    assert accuracy_curve({}) == []


def test_time_to_accuracy_counts_from_the_submission_to_the_first_round_at_the_target() -> None:
    curve = [[11.0, 1, 0.4], [13.5, 2, 0.65], [15.0, 3, 0.6], [17.0, 4, 0.8]]
    assert time_to_accuracy(curve, 2.5) == {"target": 0.65, "seconds": 11.0, "round": 2, "best": 0.8}
    assert time_to_accuracy(curve, 2.5, target=0.9) == {"target": 0.9, "seconds": None, "round": None, "best": 0.8}
    assert time_to_accuracy([], None) == {"target": 0.65, "seconds": None, "round": None, "best": None}


def test_the_lab_keeps_every_rounds_checkpoint_of_its_longest_run() -> None:
    assert checkpoints_to_keep([100, 12]) == 102 and checkpoints_to_keep([]) == 2


# ---- measured from real checkpoints (torch) ------------------------------------------------
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _run_dir(tmp_path: Path) -> tuple[Path, dict]:
    """A run folder as the agent leaves it: run.toml (a HAR-shaped store, fedavg, size small)."""
    from dfl_agent.cli.lab.accuracy import _spec
    from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

    run_dir = tmp_path / "runs" / "r-1"
    run_dir.mkdir(parents=True)
    cfg = config_from_dict({"node_id": "pi-0", "state_dir": str(tmp_path), "model": {"size": "small"},
                            "profile": "generic-x86", "algorithm": {"name": "fedavg", "rounds": 5},
                            "data": {"dataset": "store", "input_shape": [3, 128], "num_classes": 6}})
    (run_dir / "run.toml").write_text(dump_toml(cfg))
    return run_dir, _spec(run_dir)


def _save(torch, run_dir: Path, t: int, model, spec: dict) -> None:
    """Round ``t``'s checkpoint as the agent writes it: the algorithm's state (its model and
    optimizer, Algorithm.state_dict) in the agent's CheckpointStore, keeping everything."""
    from dfl_agent.algorithms.base import Algorithm
    from dfl_agent.models import spec_hash
    from dfl_agent.runtime.node.checkpoint import CheckpointStore

    alg = Algorithm.__new__(Algorithm)
    alg.model = model
    alg.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tensors, meta = alg.state_dict()
    CheckpointStore(run_dir / "checkpoints", keep=100).save(
        t, tensors, meta, info={"algorithm": "fedavg", "model_hash": spec_hash(spec), "node_id": "pi-0"})


def test_each_rounds_model_is_measured_from_its_checkpoint(tmp_path: Path, torch) -> None:
    from dfl_agent.models import build_model

    torch.set_num_threads(1)
    run_dir, spec = _run_dir(tmp_path)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3, 128)).astype(np.float32)
    models = {}
    for t in (1, 2, 3, 4):
        torch.manual_seed(t)
        models[t] = build_model(spec).eval()
        _save(torch, run_dir, t, models[t], spec)
    with torch.no_grad():
        pred = {t: m(torch.from_numpy(x)).argmax(1).numpy() for t, m in models.items()}
    # labels: round 3's predictions with 10 of 40 changed; the truth for each round from its own model
    y = pred[3].copy()
    y[:10] = (y[:10] + 1) % 6
    truth = {t: float((p == y).mean()) for t, p in pred.items()}
    assert truth[3] == 0.75
    test = SimpleNamespace(x=x, y=y)
    # round 4 has no round record (the run stopped before it was written): not measured
    got = measure_run(run_dir, {1: 10.0, 2: 11.5, 3: 13.0}, test)
    assert got == [[10.0, 1, pytest.approx(truth[1], abs=1e-4)], [11.5, 2, pytest.approx(truth[2], abs=1e-4)],
                   [13.0, 3, 0.75]]
    assert len({a for _, _, a in got}) > 1, "every round measured the same model"
    # measured once: the folder is back to the agent's default two checkpoints
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.json")) == [
        "round-00000003.json", "round-00000004.json"]


def test_a_checkpoint_of_another_model_is_not_measured(tmp_path: Path, torch) -> None:
    from dfl_agent.models import build_model

    run_dir, spec = _run_dir(tmp_path)
    other = dict(spec, channels=[4, 8, 16])
    _save(torch, run_dir, 1, build_model(other), other)
    _save(torch, run_dir, 2, build_model(spec), spec)
    test = SimpleNamespace(x=np.zeros((4, 3, 128), np.float32), y=np.zeros(4, np.int64))
    assert [r for _, r, _ in measure_run(run_dir, {1: 1.0, 2: 2.0}, test, keep_after=None)] == [2]
    assert measure_run(tmp_path / "runs" / "none", {1: 1.0}, test) == []
