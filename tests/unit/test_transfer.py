"""Def-KT's mutual knowledge transfer (seed 004 Eq. 2-8) and Combo's segment helpers."""

import copy

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import TrainConfig, batches
from dfl_agent.learning.transfer import average_segment, flatten_segment, mutual_transfer, split_point
from dfl_agent.models import build_model

SPEC = {"type": "mlp", "input_shape": [4], "hidden": [6], "num_classes": 3}


def _model(seed):
    torch.manual_seed(seed)
    return build_model(SPEC)


def _data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=n).astype(np.int64)
    return x, y


def _kl(p_logits, q_logits):
    """KL(p‖q) = Σ p log(p/q), batch mean, written out (Eq. 8)."""
    p, q = F.softmax(p_logits, 1), F.softmax(q_logits, 1)
    return (p * (p.log() - q.log())).sum(1).mean()


def _reference(incoming, local, x, y, cfg, order_seed, epochs=1):
    """Algorithm 1's inner loops written out by hand: per batch P1 and P2 first, then
    plain SGD steps on CE + KL with the *other* model's prediction as a constant."""
    a, b = copy.deepcopy(incoming), copy.deepcopy(local)
    rng = np.random.default_rng(order_seed)
    for _ in range(epochs):
        for idx in batches(len(x), cfg.batch_size, rng):
            xb, yb = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
            z1, z2 = a(xb), b(xb)
            c1, c2 = z1.detach().clone(), z2.detach().clone()  # batch-start predictions, constants
            loss1 = F.cross_entropy(z1, yb) + _kl(c2, z1)
            loss2 = F.cross_entropy(z2, yb) + _kl(c1, z2)
            g1 = torch.autograd.grad(loss1, list(a.parameters()))
            g2 = torch.autograd.grad(loss2, list(b.parameters()))
            with torch.no_grad():
                for p, g in zip(a.parameters(), g1):
                    p -= cfg.lr * g
                for p, g in zip(b.parameters(), g2):
                    p -= cfg.lr * g
    return a, b


def _assert_same(m1, m2, atol=1e-6):
    for (k, v1), v2 in zip(model_to_numpy(m1).items(), model_to_numpy(m2).values()):
        np.testing.assert_allclose(v1, v2, atol=atol, rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("batch_size,epochs", [(8, 1), (24, 2), (10, 1)])
def test_matches_the_hand_written_eq_2_to_8(batch_size, epochs):
    x, y = _data()
    cfg = TrainConfig(batch_size=batch_size, lr=0.3, momentum=0.0)
    w_tilde, w = _model(1), _model(2)
    ref_a, ref_b = _reference(w_tilde, w, x, y, cfg, order_seed=5, epochs=epochs)
    stats = mutual_transfer(w_tilde, w, x, y, cfg, np.random.default_rng(5), epochs=epochs)
    _assert_same(w_tilde, ref_a)
    _assert_same(w, ref_b)
    assert stats["batches"] == epochs * len(batches(len(x), batch_size, np.random.default_rng(0)))


def test_predictions_are_from_the_start_of_the_batch():
    """Sequential DML (update w̃, then recompute P1 for w's step) gives a different w:
    our w's step must use P1 from *before* w̃'s step."""
    x, y = _data(8)
    cfg = TrainConfig(batch_size=8, lr=0.5, momentum=0.0)
    w_tilde, w = _model(1), _model(2)
    seq_a, seq_b = copy.deepcopy(w_tilde), copy.deepcopy(w)
    xb, yb = torch.from_numpy(x), torch.from_numpy(y)
    opt_a = torch.optim.SGD(seq_a.parameters(), lr=cfg.lr)
    opt_b = torch.optim.SGD(seq_b.parameters(), lr=cfg.lr)
    loss = F.cross_entropy(seq_a(xb), yb) + _kl(seq_b(xb).detach(), seq_a(xb))
    opt_a.zero_grad(); loss.backward(); opt_a.step()  # noqa: E702
    loss = F.cross_entropy(seq_b(xb), yb) + _kl(seq_a(xb).detach(), seq_b(xb))  # P1 after w̃'s step
    opt_b.zero_grad(); loss.backward(); opt_b.step()  # noqa: E702
    mutual_transfer(w_tilde, w, x, y, cfg, np.random.default_rng(0))
    _assert_same(w_tilde, seq_a)  # w̃'s step is the same in both orders
    diff = max(np.abs(a - b).max() for a, b in zip(model_to_numpy(w).values(), model_to_numpy(seq_b).values()))
    assert diff > 1e-5


def test_teachers_are_detached_and_both_models_change():
    """If gradients flowed into the teachers, each model would also get the other's
    KL gradient; the hand-written reference with constants matches, the coupled one does not."""
    x, y = _data(16)
    cfg = TrainConfig(batch_size=16, lr=0.5, momentum=0.0)
    w_tilde, w = _model(1), _model(2)
    before_a, before_b = model_to_numpy(w_tilde), model_to_numpy(w)
    coupled_a, coupled_b = copy.deepcopy(w_tilde), copy.deepcopy(w)
    xb, yb = torch.from_numpy(x), torch.from_numpy(y)
    z1, z2 = coupled_a(xb), coupled_b(xb)
    total = F.cross_entropy(z1, yb) + _kl(z2, z1) + F.cross_entropy(z2, yb) + _kl(z1, z2)  # not detached
    total.backward()
    with torch.no_grad():
        for p in list(coupled_a.parameters()) + list(coupled_b.parameters()):
            p -= cfg.lr * p.grad
    mutual_transfer(w_tilde, w, x, y, cfg, np.random.default_rng(0))
    for before, model in ((before_a, w_tilde), (before_b, w)):
        assert any(np.abs(before[k] - v).max() > 1e-4 for k, v in model_to_numpy(model).items())
    gap = max(np.abs(a - b).max() for a, b in zip(model_to_numpy(w).values(), model_to_numpy(coupled_b).values()))
    assert gap > 1e-5


def test_reported_ce_and_kl_are_the_batch_start_values():
    x, y = _data(12)
    cfg = TrainConfig(batch_size=12, lr=0.1, momentum=0.0)
    w_tilde, w = _model(3), _model(4)
    xb, yb = torch.from_numpy(x), torch.from_numpy(y)
    with torch.no_grad():
        z1, z2 = w_tilde(xb), w(xb)
        expected = {
            "ce_incoming": float(-F.log_softmax(z1, 1)[torch.arange(12), yb].mean()),
            "ce_local": float(-F.log_softmax(z2, 1)[torch.arange(12), yb].mean()),
            "kl_incoming": float(_kl(z2, z1)),  # KL(P2‖P1), Eq. 5
            "kl_local": float(_kl(z1, z2)),  # KL(P1‖P2), Eq. 6
        }
    stats = mutual_transfer(w_tilde, w, x, y, cfg, np.random.default_rng(0))
    for k, v in expected.items():
        assert stats[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert expected["kl_incoming"] > 0 and expected["kl_incoming"] != pytest.approx(expected["kl_local"])


def test_identical_models_stay_identical_and_kl_is_zero():
    x, y = _data()
    cfg = TrainConfig(batch_size=8, lr=0.2, momentum=0.9)
    a, b = _model(7), _model(7)
    stats = mutual_transfer(a, b, x, y, cfg, np.random.default_rng(1), epochs=2)
    assert stats["kl_incoming"] == pytest.approx(0.0, abs=1e-7)
    _assert_same(a, b, atol=0)


def test_temperature_scales_kl_by_tau_squared():
    x, y = _data(12)
    cfg = TrainConfig(batch_size=12, lr=1e-9, momentum=0.0)
    stats = {}
    for tau in (1.0, 3.0):
        stats[tau] = mutual_transfer(_model(3), _model(4), x, y, cfg, np.random.default_rng(0), temperature=tau)
    with torch.no_grad():
        xb = torch.from_numpy(x)
        z1, z2 = _model(3)(xb), _model(4)(xb)
        expected = 9.0 * float(_kl(z2 / 3.0, z1 / 3.0))
    assert stats[3.0]["kl_incoming"] == pytest.approx(expected, rel=1e-5)


def test_bad_arguments():
    x, y = _data()
    cfg = TrainConfig()
    with pytest.raises(ValueError, match="non-empty"):
        mutual_transfer(_model(0), _model(1), x[:0], y[:0], cfg, np.random.default_rng(0))
    with pytest.raises(ValueError, match="matching"):
        mutual_transfer(_model(0), _model(1), x, y[:3], cfg, np.random.default_rng(0))
    with pytest.raises(ValueError, match="epochs"):
        mutual_transfer(_model(0), _model(1), x, y, cfg, np.random.default_rng(0), epochs=0)
    with pytest.raises(ValueError, match="temperature"):
        mutual_transfer(_model(0), _model(1), x, y, cfg, np.random.default_rng(0), temperature=0.0)


# -- Combo segments ------------------------------------------------------------------------


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "a.weight": rng.normal(size=(3, 5)).astype(np.float32),  # 15
        "counter": np.array(7, dtype=np.int64),  # no segment
        "a.bias": rng.normal(size=(3,)).astype(np.float32),  # 3
        "b.weight": rng.normal(size=(2, 2)).astype(np.float64),  # 4 -> total 22 -> split 11
        "b.bias": rng.normal(size=(1,)).astype(np.float32),  # 1 -> total 23 -> split 11
    }


def test_segments_split_the_flattened_vector_in_two_halves():
    t = _tensors()
    split, total = split_point(t)
    assert (split, total) == (11, 23)
    full = np.concatenate([t[k].astype(np.float32).ravel() for k in ("a.weight", "a.bias", "b.weight", "b.bias")])
    s1, s2 = flatten_segment(t, 1), flatten_segment(t, 2)
    assert s1.dtype == np.float32 and s1.shape == (11,) and s2.shape == (12,)
    np.testing.assert_array_equal(np.concatenate([s1, s2]), full)
    with pytest.raises(ValueError):
        flatten_segment(t, 3)


@pytest.mark.parametrize("segment", [1, 2])
def test_average_segment_mixes_one_half_with_sample_weights(segment):
    own, other = _tensors(0), _tensors(1)
    received = flatten_segment(other, segment)
    out = average_segment(own, segment, received, n_own=30, n_received=10)
    keep = 2 if segment == 1 else 1
    np.testing.assert_array_equal(flatten_segment(out, keep), flatten_segment(own, keep))
    expected = 0.25 * received.astype(np.float64) + 0.75 * flatten_segment(own, segment).astype(np.float64)
    np.testing.assert_allclose(flatten_segment(out, segment), expected, rtol=1e-6, atol=1e-6)
    assert out["counter"] == own["counter"]
    assert all(out[k].dtype == own[k].dtype and out[k].shape == own[k].shape for k in own)
    # the two halves exchanged both ways = FullAvg of the pair (Eq. 9) over the whole vector
    both = average_segment(average_segment(own, 1, flatten_segment(other, 1), 1, 1), 2, flatten_segment(other, 2), 1, 1)
    for k in ("a.weight", "a.bias", "b.weight", "b.bias"):
        np.testing.assert_allclose(both[k], (own[k].astype(np.float64) + other[k]) / 2, rtol=1e-6, atol=1e-6)


def test_average_segment_rejects_bad_input():
    own = _tensors()
    with pytest.raises(ValueError, match="entries"):
        average_segment(own, 1, np.zeros(3, np.float32), 1, 1)
    with pytest.raises(ValueError, match="weights"):
        average_segment(own, 1, flatten_segment(own, 1), 0, 0)
