"""One optimizer factory (learning.training.make_optimizer), and the vectorised SGD step of
the simulator's batched training (learning.training.sgd_step) equals torch.optim.SGD."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dfl_agent.learning.training import make_optimizer, sgd_step  # noqa: E402


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 5e-4), (0.9, 5e-4)])
def test_stacked_sgd_step_equals_torch_sgd(momentum: float, weight_decay: float) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    g, shapes = 3, {"w": (4, 5), "b": (5,)}
    # G models' parameters, stepped one optimizer each and stacked along axis 0
    models = [{n: torch.randn(s, generator=gen, requires_grad=True) for n, s in shapes.items()} for _ in range(g)]
    stacked = {n: torch.stack([m[n].detach() for m in models]).clone() for n in shapes}
    opts = [make_optimizer(list(m.values()), lr=0.05, momentum=momentum, weight_decay=weight_decay) for m in models]
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
    sgd = make_optimizer(p, lr=0.1, momentum=0.9, weight_decay=1e-4)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    assert sgd.defaults["weight_decay"] == 1e-4 and not sgd.defaults["nesterov"]
    adam = make_optimizer(p, "adam", lr=0.01)
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["lr"] == 0.01
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer(p, "rmsprop", lr=0.1)
    with pytest.raises(ValueError, match="adam takes no momentum"):
        make_optimizer(p, "adam", lr=0.1, momentum=0.9)
