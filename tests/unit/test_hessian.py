"""Hessian-diagonal estimators against closed forms (seed 001 §IV-A, Eq. 4-5).

Two models with a known Hessian diagonal:
- linear least squares, L = ½·mean_k (w·x_k + b − y_k)²: the Hessian (= Gauss-Newton
  JᵀJ) is XᵀX/N, diagonal mean_k x_kn²; the per-sample gradient is r_k·x_k, so the
  estimators have exact closed forms too, and at the true weights with noise σ the
  empirical Fisher Σ_k (r_k x_kn)² ≈ N·σ²·mean_k x_kn² (σ² times N times the Hessian);
- softmax regression with cross-entropy (the default loss): the Hessian diagonal
  w.r.t. W_cn is mean_k p_kc(1−p_kc)·x_kn², and with labels drawn from the model's own
  distribution the empirical Fisher Σ_k (∂ℓ_k/∂W_cn)² estimates N times it.
"""

import numpy as np
import pytest
import torch
from torch import nn

from dfl_agent.learning import hessian as H


def _mse(out, y):
    return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()


def _linear(w, b):
    m = nn.Linear(len(w), 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor(np.asarray(w)[None, :], dtype=torch.float32))
        m.bias.fill_(float(b))
    return m


@pytest.fixture
def lsq():
    rng = np.random.default_rng(0)
    n, d = 237, 4
    x = (rng.normal(size=(n, d)) * np.array([0.5, 1.0, 2.0, 3.0])).astype(np.float32)
    w_true, b_true = np.array([1.0, -2.0, 0.5, 0.3]), 0.7
    y = (x @ w_true + b_true + rng.normal(scale=0.5, size=n)).astype(np.float32)
    return x, y


def test_per_sample_matches_closed_form_least_squares(lsq):
    x, y = lsq
    w, b = np.array([0.2, 0.1, -0.3, 0.4]), -0.1
    model = _linear(w, b)
    h = H.per_sample_sq_grad(model, x, y, batch_size=50, loss_fn=_mse)
    r = x.astype(np.float64) @ w + b - y  # residuals (N,)
    np.testing.assert_allclose(h["weight"][0], ((r[:, None] * x) ** 2).sum(0), rtol=1e-4)
    np.testing.assert_allclose(h["bias"][0], (r**2).sum(), rtol=1e-4)
    assert set(h) == {"weight", "bias"} and h["weight"].shape == (1, 4) and h["weight"].dtype == np.float64


def test_batch_sq_grad_matches_closed_form_least_squares(lsq):
    x, y = lsq
    w, b = np.array([0.2, 0.1, -0.3, 0.4]), -0.1
    h = H.batch_sq_grad(_linear(w, b), x, y, batch_size=100, loss_fn=_mse)
    r = x.astype(np.float64) @ w + b - y
    expect = np.zeros(4)
    for i in range(0, len(x), 100):  # batches 100, 100, 37 in data order
        expect += ((r[i : i + 100, None] * x[i : i + 100]).mean(0)) ** 2
    np.testing.assert_allclose(h["weight"][0], expect, rtol=1e-4)
    # batch size 1 is the per-sample estimator
    h1 = H.batch_sq_grad(_linear(w, b), x, y, batch_size=1, loss_fn=_mse)
    hp = H.per_sample_sq_grad(_linear(w, b), x, y, loss_fn=_mse)
    np.testing.assert_allclose(h1["weight"], hp["weight"], rtol=1e-4)


def test_fisher_estimates_analytic_hessian_diagonal_least_squares():
    """At the true weights, E[(r x_n)²] = σ² E[x_n²]: the empirical Fisher is N·σ²·diag(XᵀX/N)."""
    rng = np.random.default_rng(1)
    n, d, sigma = 50000, 4, 0.5
    x = (rng.normal(size=(n, d)) * np.array([0.5, 1.0, 2.0, 3.0])).astype(np.float32)
    w_true = np.array([1.0, -2.0, 0.5, 0.3])
    y = (x @ w_true + rng.normal(scale=sigma, size=n)).astype(np.float32)
    hessian_diag = (x.astype(np.float64) ** 2).mean(0)  # analytic ∂²L/∂w_n² = mean x_n²
    h = H.estimate("per_sample_sq_grad", _linear(w_true, 0.0), x, y, loss_fn=_mse, batch_size=5000)
    # relative standard error sqrt(8/N) = 1.3%
    np.testing.assert_allclose(h["weight"][0] / (n * sigma**2), hessian_diag, rtol=0.06)
    # after Eq. 4 normalisation the direction matches the normalised true diagonal
    hn = H.normalise({"w": h["weight"][0]})["w"]
    np.testing.assert_allclose(hn, hessian_diag / np.linalg.norm(hessian_diag), atol=0.02)


def test_fisher_estimates_analytic_hessian_diagonal_softmax_regression():
    rng = np.random.default_rng(2)
    n, d, k = 20000, 3, 3
    x = (rng.normal(size=(n, d)) * np.array([0.5, 1.0, 2.0])).astype(np.float32)
    model = nn.Linear(d, k)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.2, 0.3], [-0.4, 0.6, 0.1], [0.2, 0.1, -0.5]]))
        model.bias.copy_(torch.tensor([0.1, -0.1, 0.0]))
        p = torch.softmax(model(torch.from_numpy(x)), 1).double().numpy()  # (N, K)
    y = np.array([rng.choice(k, p=pi / pi.sum()) for pi in p])  # labels from the model itself
    analytic = ((p * (1 - p))[:, :, None] * (x.astype(np.float64) ** 2)[:, None, :]).mean(0)  # (K, d)
    h = H.per_sample_sq_grad(model, x, y, batch_size=2000)
    np.testing.assert_allclose(h["weight"] / n, analytic, rtol=0.08)
    np.testing.assert_allclose(h["bias"] / n, (p * (1 - p)).mean(0), rtol=0.08)
    # the exact Hessian diagonal from autograd agrees with the closed form
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    W0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    hess = torch.autograd.functional.hessian(
        lambda W: nn.functional.cross_entropy(xt @ W.reshape(k, d).T + b0, yt), W0.reshape(-1)
    )
    np.testing.assert_allclose(torch.diagonal(hess).reshape(k, d).double().numpy(), analytic, rtol=1e-3)


def test_estimators_leave_model_untouched_and_restore_mode():
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = rng.normal(size=(30, 5)).astype(np.float32), rng.integers(0, 3, 30)
    a = H.batch_sq_grad(model, x, y, batch_size=1)
    b = H.per_sample_sq_grad(model, x, y)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    for k in a:  # eval mode (dropout off): both estimators agree, so dropout was off
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-10)
        assert (a[k] >= 0).all()


def test_estimator_errors():
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="non-empty"):
        H.batch_sq_grad(m, np.zeros((0, 2), np.float32), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="batch_size"):
        H.per_sample_sq_grad(m, np.zeros((3, 2), np.float32), np.zeros(3, np.int64), batch_size=0)
    with pytest.raises(ValueError, match="unknown Hessian estimator"):
        H.estimate("exact", m, np.zeros((3, 2), np.float32), np.zeros(3, np.int64))


def test_normalisation_eq4():
    h = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}
    g = H.normalise(h, "l2")
    np.testing.assert_allclose(g["a"], [0.6, 0.0])
    np.testing.assert_allclose(g["b"], [[0.8]])
    assert H.global_l2_norm(g) == pytest.approx(1.0)
    per = H.normalise(h, "per_layer_l2")
    np.testing.assert_allclose(per["a"], [1.0, 0.0])
    np.testing.assert_allclose(per["b"], [[1.0]])
    np.testing.assert_allclose(H.normalise(h, "none")["a"], h["a"])
    zero = H.normalise({"a": np.zeros(3)}, "l2")  # zero norm: stays zero (fallback later), no NaN
    assert (zero["a"] == 0).all()
    with pytest.raises(ValueError, match="normalisation"):
        H.normalise(h, "l1")


def test_accumulation_eq5():
    h1, h2 = {"a": np.array([1.0, 0.0])}, {"a": np.array([0.0, 2.0])}
    acc = H.accumulate(None, h1)  # Alg. 1 line 3
    np.testing.assert_allclose(acc["a"], [1.0, 0.0])
    acc = H.accumulate(acc, h2, beta=1.0)  # Eq. 5 with β = 1
    np.testing.assert_allclose(acc["a"], [1.0, 2.0])
    np.testing.assert_allclose(H.accumulate(acc, h2, beta=0.5)["a"], [1.0, 3.0])
    np.testing.assert_allclose(H.accumulate(acc, h2, beta=0.25, mode="ema")["a"], [0.75, 2.0])
    np.testing.assert_allclose(H.accumulate(acc, h2, beta=1.0, mode="ema")["a"], h2["a"])  # no memory
    with pytest.raises(ValueError, match="beta"):
        H.accumulate(acc, h2, beta=1.5)
    with pytest.raises(ValueError, match="names or shapes"):
        H.accumulate(acc, {"a": np.zeros(3)})
    with pytest.raises(ValueError, match="accumulation"):
        H.accumulate(acc, h2, mode="max")
