"""One optimizer factory (learning.training.make_optimizer); its SGD (learning.training.PlainSGD)
and the vectorised SGD step of the simulator's batched training (learning.training.sgd_step) equal
torch.optim.SGD bit for bit; training imports neither TorchDynamo nor SymPy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from dfl_agent.learning.training import PlainSGD, make_optimizer, sgd_step  # noqa: E402


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 5e-4), (0.9, 5e-4)])
def test_stacked_sgd_step_equals_torch_sgd(momentum: float, weight_decay: float) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    g, shapes = 3, {"w": (4, 5), "b": (5,)}
    # G models' parameters, stepped one optimizer each and stacked along axis 0
    models = [{n: torch.randn(s, generator=gen, requires_grad=True) for n, s in shapes.items()} for _ in range(g)]
    stacked = {n: torch.stack([m[n].detach() for m in models]).clone() for n in shapes}
    opts = [make_optimizer(list(m.values()), lr=0.05, momentum=momentum, weight_decay=weight_decay, torch_api=True)
            for m in models]
    bufs: dict = {}
    for _ in range(4):
        grads = {n: torch.randn((g, *s), generator=gen) for n, s in shapes.items()}
        for i, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            for n in shapes:
                m[n].grad = grads[n][i].clone()
            opt.step()
        sgd_step(stacked, grads, bufs, lr=0.05, momentum=momentum, weight_decay=weight_decay)
        for i, m in enumerate(models):
            for n in shapes:
                assert torch.equal(stacked[n][i], m[n].detach()), (n, i)


def test_make_optimizer_kinds() -> None:
    p = [torch.zeros(2, requires_grad=True)]
    plain = make_optimizer(p, lr=0.1, momentum=0.9, weight_decay=1e-4)
    assert isinstance(plain, PlainSGD) and (plain.lr, plain.momentum, plain.weight_decay) == (0.1, 0.9, 1e-4)
    sgd = make_optimizer(p, lr=0.1, momentum=0.9, weight_decay=1e-4, torch_api=True)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    assert sgd.defaults["weight_decay"] == 1e-4 and not sgd.defaults["nesterov"]
    for bad in ({"lr": -0.1}, {"lr": 0.1, "momentum": -0.5}, {"lr": 0.1, "weight_decay": -1.0}):
        with pytest.raises(ValueError, match="Invalid"):
            make_optimizer(p, **bad)
    adam = make_optimizer(p, "adam", lr=0.01)
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["lr"] == 0.01
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer(p, "rmsprop", lr=0.1)
    with pytest.raises(ValueError, match="adam takes no momentum"):
        make_optimizer(p, "adam", lr=0.1, momentum=0.9)


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 5e-4)])
def test_plain_sgd_trains_a_model_exactly_as_torch_sgd(momentum: float, weight_decay: float) -> None:
    """The same model, batches and settings: the parameters after each step are bit for bit
    torch.optim.SGD's, a parameter without a gradient is left alone, and the state moves between the
    two (torch's state_dict layout), so a checkpoint of either resumes in the other."""
    from dfl_agent.models import build_model

    torch.set_num_threads(1)
    spec = {"type": "cnn1d", "in_channels": 3, "length": 32, "channels": [4, 8], "kernel": 5, "num_classes": 4,
            "norm": "layer"}
    torch.manual_seed(0)
    a = build_model(spec)
    b = build_model(spec)
    b.load_state_dict(a.state_dict())
    frozen = next(a.parameters())  # no gradient for it in either model: skipped by both optimizers
    frozen.requires_grad_(False)
    next(b.parameters()).requires_grad_(False)
    mine = make_optimizer(a.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    theirs = make_optimizer(b.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay, torch_api=True)
    assert isinstance(mine, PlainSGD)
    gen = torch.Generator().manual_seed(1)
    before = frozen.detach().clone()

    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for i in range(6):
        x, y = torch.randn(8, 3, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        step(a, mine, x, y)
        step(b, theirs, x, y)
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (i, n)
        if i == 2:  # swap states: each optimizer goes on from the other's state_dict
            ours, torchs = mine.state_dict(), theirs.state_dict()
            assert sorted(ours["state"]) == sorted(torchs["state"])
            mine.load_state_dict(torchs)
            theirs.load_state_dict(ours)
    assert torch.equal(frozen, before)


def test_training_imports_neither_torchdynamo_nor_sympy() -> None:
    """Local training, the warm start's probe fit and evaluation, as a run process does them:
    torch.optim's optimizers import TorchDynamo and SymPy on their first step (about 75 MB of the
    run process's memory; bench/operations/run_peak.md), PlainSGD does not.  (The ONNX export:
    test_onnx.py's test_export_skips_dynamo_and_onnxscript.)"""
    code = """
import json, sys
import numpy as np
import torch
from dfl_agent.learning.probe import _fit
from dfl_agent.learning.training import TrainConfig, evaluate, train_local
from dfl_agent.models import build_model
spec = {"type": "cnn1d", "in_channels": 3, "length": 32, "channels": [4, 8], "kernel": 5, "num_classes": 4,
        "norm": "layer"}
rng = np.random.default_rng(0)
x, y = rng.normal(size=(40, 3, 32)).astype(np.float32), rng.integers(0, 4, 40)
model = build_model(spec)
train_local(model, x, y, TrainConfig(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4), rng=rng)
_fit(torch.randn(10, 5), torch.randint(0, 4, (10,)), torch.zeros(4, 5), torch.zeros(4), 0.1)
evaluate(model, x, y)
print(json.dumps([m for m in ("torch._dynamo", "sympy") if m in sys.modules]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []
