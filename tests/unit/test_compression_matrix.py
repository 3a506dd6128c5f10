"""Every compression spec × {unsigned, signed} × every model type, through the real wire.

The specs are generated from the grammar :func:`~dfl_agent.learning.compression.parse_spec`
accepts: {none, topk:0.1, randk:0.1} × {fp32, fp16, q8, q4, q2} × {none, zstd, lz4}.
Each case compresses a model's state (``codec.encode_tensors``: what the sender's decoder
predicts the receiver gets), frames it with ``wire.encode`` (signed by a real
:class:`~dfl_agent.security.SecurityGuard` or not), decodes it with ``wire.decode_with_header``
and checks it with the receiver's guard, then asserts that every tensor received equals
the prediction bit for bit.  Wire v4 broke this for signed frames of several tensors (the
signed envelope sorted the description's keys, the blob kept the sender's order).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.context import Message
from dfl_agent.learning.compression import parse_spec
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64
from dfl_agent.transport import codec, wire

FED = "matrix"
SPARSIFIERS = ("", "topk:0.1", "randk:0.1")
VALUES = ("fp32", "fp16", "q8", "q4", "q2")
CODERS = ("", "zstd", "lz4")


def _specs() -> list[str]:
    out = []
    for sparse, value, coder in itertools.product(SPARSIFIERS, VALUES, CODERS):
        text = "+".join(s for s in (sparse, value, coder) if s)
        spec = parse_spec(text)  # the grammar accepts every combination
        assert parse_spec(str(spec)) == spec
        out.append(text)
    return out


SPECS = _specs()

#: one small model of every type build_model accepts (names in PyTorch's state-dict order:
#: ``*.weight`` before ``*.bias``, which is not sorted order)
MODEL_SPECS = {
    "cnn1d": {"type": "cnn1d", "in_channels": 3, "length": 16, "channels": [4, 8], "kernel": 3, "num_classes": 4},
    "cnn": {"type": "cnn", "in_channels": 1, "image_size": 8, "widths": [4, 8], "kernel": 3, "num_classes": 4},
    "mlp": {"type": "mlp", "input_shape": [1, 8, 8], "hidden": [16, 8], "num_classes": 4},
    "resnet": {"type": "resnet", "input_shape": [1, 8, 8], "widths": [4, 8], "blocks": [1, 1],
               "num_classes": 4, "norm": "layer"},
    "convdense": {"type": "convdense", "input_shape": [1, 8, 8], "conv": [4, 8, 8], "dense": [8, 8],
                  "num_classes": 4, "kernel": 3, "pool": 2},
}


@pytest.fixture(scope="module")
def models() -> dict[str, dict[str, np.ndarray]]:
    torch = pytest.importorskip("torch")
    from dfl_agent.models import build_model

    torch.manual_seed(0)
    states: dict[str, dict[str, np.ndarray]] = {
        "one-tensor": {"w": np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)},
    }
    for name, spec in MODEL_SPECS.items():
        model = build_model(spec)
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        assert len(state) > 1 and list(state) != sorted(state), name  # the order that broke v4
        states[name] = state
    return states


@pytest.fixture(scope="module")
def guards() -> tuple[SecurityGuard, SecurityGuard]:
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    trust = TrustStore(FED, {"a": public_key_b64(ka), "b": public_key_b64(kb)})
    sender = SecurityGuard("a", ka, trust)
    receiver = SecurityGuard("b", kb, trust, require_signatures=True)
    return sender, receiver


def test_the_grammar_gives_45_specs():
    assert len(SPECS) == len(set(SPECS)) == 45


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("spec", SPECS)
def test_received_values_equal_the_senders_prediction(models, guards, spec, signed):
    sender, receiver = guards
    rng = np.random.default_rng(1)
    failures = []
    for model_name, state in models.items():
        wire_tensors, desc, predicted = codec.encode_tensors(state, spec, rng)
        msg = Message(kind="model", round=1, tensors=wire_tensors, encoding=desc)
        frame = wire.encode(msg, federation=FED, sender="a", sign=sender.sign if signed else None)
        received, header = wire.decode_with_header(frame, federation=FED)
        if signed:
            verdict = receiver.check(header, signed_bytes=getattr(header, "signed_bytes", None))
            assert verdict is None, f"{model_name}: signed frame rejected ({verdict})"
        assert set(received.tensors) == set(state), model_name
        for name, value in state.items():
            got = received.tensors[name]
            want = predicted[name]
            if got.shape != value.shape or got.dtype != value.dtype or not np.array_equal(got, want):
                err = float(np.max(np.abs(got.astype(np.float64) - want))) if got.shape == want.shape else "shape"
                failures.append(f"{model_name}/{name}: max error {err}")
    assert not failures, f"{spec} ({'signed' if signed else 'unsigned'}): " + "; ".join(failures[:5])


def test_q8_near_the_float32_limit_stays_finite():
    """lo + level·step in float32 overflowed to inf for finite input near ±3.4e38."""
    from dfl_agent.learning.compression import compress_dict, decompress_dict

    x = {"w": np.array([-3e38, 3e38, 1, 2], np.float32)}
    for spec in ("q8", "q4", "q2", "q8/2"):
        blob, desc, decoded = compress_dict(x, spec, np.random.default_rng(0))
        out = decompress_dict(blob, desc)["w"]
        assert np.isfinite(out).all() and np.isfinite(decoded["w"]).all(), spec
        assert np.array_equal(out, decoded["w"])
        assert abs(float(out[0]) + 3e38) <= 3e38 * 1e-6 and abs(float(out[1]) - 3e38) <= 3e38 * 0.01


def test_one_nan_does_not_poison_an_error_feedback_stream():
    from dfl_agent.learning.error_feedback import ErrorFeedback

    ef = ErrorFeedback("topk:0.1+q8")
    rng = np.random.default_rng(0)
    bad = {"w": np.array([np.nan, 1.0, 2.0, 3.0], np.float32)}
    ef.compress("all", bad, rng)
    assert ef.resets == 1 and "all" not in ef.residuals
    for step in range(3):
        blob, desc, decoded = ef.compress("all", {"w": np.arange(10, dtype=np.float32) + step}, rng)
        assert np.isfinite(decoded["w"]).all()
        assert all(np.isfinite(r).all() for r in ef.residuals["all"].values())
        out = codec.decode_tensors({codec.BLOB: blob}, desc)
        assert np.array_equal(out["w"], decoded["w"])
    assert ef.resets == 1
