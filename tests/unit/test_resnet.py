"""The small pre-activation ResNet (model type ``resnet``) and DFML's H1-resnet family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.partial import aggregate_partial, check_sub_model
from dfl_agent.learning.training import TrainConfig
from dfl_agent.models import SpecError, build_model, count_trainable, spec_hash, validate_spec
from dfl_agent.models.families import FAMILIES, family_specs

RATES = (1, 1 / 2, 1 / 4, 1 / 8, 1 / 16)


def scaled_widths(widths, rate: float) -> list[int]:
    """Width-scaled stage widths ``max(1, round(w · rate))`` (seed 000 H1 model rates)."""
    return [max(1, int(round(w * rate))) for w in widths]


def expected_params(c_in: int, widths, blocks, num_classes: int, dims: int, norm: bool = True) -> int:
    """Independent count: 3-wide convolutions without bias, GroupNorm affine (2 per channel)."""
    k = 3 ** dims
    total = c_in * widths[0] * k  # stem
    c = widths[0]
    for i, (w, n) in enumerate(zip(widths, blocks)):
        for j in range(n):
            stride = 2 if (i > 0 and j == 0) else 1
            total += (2 * c if norm else 0) + c * w * k + (2 * w if norm else 0) + w * w * k
            if stride != 1 or c != w:
                total += c * w * (1 ** dims)  # 1x1 shortcut
            c = w
    return total + (2 * c if norm else 0) + c * num_classes + num_classes


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 128)])
def test_family_shapes_and_parameter_counts_per_width(shape):
    specs = family_specs("H1-resnet", shape, 10)
    assert [s["widths"] for s in specs] == [scaled_widths([32, 64, 128, 256], r) for r in RATES]
    counts = []
    for s in specs:
        m = build_model(s)
        x = torch.randn(3, *shape)
        assert m(x).shape == (3, 10)
        assert m(x.flatten(1)).shape == (3, 10)  # flat inputs are reshaped
        n = count_trainable(m)
        assert n == expected_params(shape[0], s["widths"], s["blocks"], 10, len(shape) - 1)
        counts.append(n)
    # the conv weights dominate: halving the width divides the count by about 4
    for big, small in zip(counts, counts[1:]):
        assert 3.0 < big / small < 4.2


def test_full_width_2d_is_a_halved_resnet18():
    spec = family_specs("H1-resnet", (1, 8, 8), 10)[0]
    assert spec["blocks"] == [2, 2, 2, 2] and spec["widths"] == [32, 64, 128, 256]
    assert count_trainable(build_model(spec)) == 2_796_138


def test_norm_none_and_custom_blocks():
    spec = {"type": "resnet", "input_shape": [2, 16], "widths": [4, 8], "blocks": [1, 3], "num_classes": 3,
            "norm": "none"}
    m = build_model(spec)
    assert m(torch.randn(5, 2, 16)).shape == (5, 3)
    assert count_trainable(m) == expected_params(2, [4, 8], [1, 3], 3, 1, norm=False)
    assert spec_hash(spec) != spec_hash(dict(spec, norm="layer"))


def test_default_blocks_and_norm_are_filled_in():
    s = validate_spec({"type": "resnet", "input_shape": [1, 8, 8], "widths": [4, 8], "num_classes": 10})
    assert s["blocks"] == [2, 2] and s["norm"] == "layer"


@pytest.mark.parametrize("bad,key", [
    ({"input_shape": [1, 8, 8, 8]}, "input_shape"),
    ({"input_shape": "8x8"}, "input_shape"),
    ({"widths": []}, "widths"),
    ({"blocks": [2]}, "blocks"),
    ({"blocks": [2, 0]}, "blocks"),
    ({"norm": "batch"}, "norm"),
    ({"num_classes": 1}, "num_classes"),
])
def test_bad_specs_name_the_key(bad, key):
    spec = dict({"type": "resnet", "input_shape": [1, 8, 8], "widths": [4, 8], "num_classes": 10}, **bad)
    with pytest.raises(SpecError, match=key):
        validate_spec(spec)


def test_family_rejects_flat_inputs_and_is_listed():
    assert "H1-resnet" in FAMILIES
    with pytest.raises(ValueError):
        family_specs("H1-resnet", (64,), 10)


def test_width_scaled_members_are_slices_of_the_largest():
    specs = family_specs("H1-resnet", (1, 8, 8), 10)
    states = [model_to_numpy(build_model(s)) for s in specs]
    for st in states[1:]:
        check_sub_model(st, states[0])
    for scheme in ("heterofl", "fedrolex"):
        out = aggregate_partial(states, scheme, t=3)
        assert all(o[k].shape == s[k].shape for o, s in zip(out, states) for k in s)


def test_dfml_mixes_the_resnet_widths_in_the_simulator():
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    # 3 nodes hold the width rates 1/4, 1/8, 1/16 (the larger ones are covered above);
    # 2 rounds, K = 1 to keep it short
    specs = family_specs("H1-resnet", (1, 8, 8), 10)[2:]
    s = simulate(SimConfig(algorithm="dfml", nodes=3, rounds=2, dataset="digits", partition="iid",
                           model_specs=specs, options={"mutual_epochs": 1, "sender_ratio": 1.0},
                           train=TrainConfig(batch_size=64)))
    assert s["rounds_completed"] == 2
    assert len({str(v["widths"]) for v in s["model_specs"].values()}) == 3
    assert all(not d for d in s["dropped"].values())  # every architecture was accepted by the aggregators
    assert np.isfinite(s["global_accuracy"]["mean"])
