"""Models built from a *spec*: a small JSON dict (type + sizes), never code.

A model travels between peers as its spec plus its tensors; the receiver rebuilds
it with :func:`build_model`.  Three families:

``cnn1d``  1-D CNN for sensor windows (HAR), input ``(B, C, L)``::

    {"type": "cnn1d", "in_channels": 3, "length": 128, "channels": [16, 32, 64],
     "kernel": 5, "num_classes": 6, "norm": "none"}

    per width: Conv1d(k, pad k//2) -> ReLU -> MaxPool1d(2) [-> LayerNorm([w, l]) when
    norm = "layer", as in the seeds' CNN family];  then global average pool over time
    -> Linear(channels[-1], num_classes).

``mlp``  input ``(B, *input_shape)`` flattened::

    {"type": "mlp", "input_shape": [1, 8, 8], "hidden": [128, 64], "num_classes": 10}

``cnn``  the seeds' CNN family (DFML seed 000, App. A.2 / Table 10), input ``(B, C, H, W)``::

    {"type": "cnn", "in_channels": 1, "image_size": 28, "widths": [32, 64],
     "kernel": 5, "num_classes": 10}

    per width: Conv2d(5x5, pad 2) -> ReLU -> MaxPool2d(2) -> LayerNorm([w, h, h]);
    then Flatten -> Linear(widths[-1]*h*h, num_classes).

``resnet``  a small pre-activation ResNet for ``[C, L]`` or ``[C, H, W]`` inputs
(seed 000 Table 10's ResNet member), see :mod:`dfl_agent.models.resnet`::

    {"type": "resnet", "input_shape": [1, 8, 8], "widths": [32, 64, 128, 256],
     "blocks": [2, 2, 2, 2], "num_classes": 10, "norm": "layer"}

All models return logits of shape ``(B, num_classes)``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dfl_agent.models.deployed import DeployedModelError, load_deployed  # noqa: F401 - public API

if TYPE_CHECKING:
    from torch import nn

    from dfl_agent.models.nets import CNN, MLP, CNN1d  # noqa: F401 - public API, imported on first use

MODEL_TYPES = ("cnn1d", "mlp", "cnn", "resnet")
MAX_WIDTH = 4096
MAX_LAYERS = 16


class SpecError(ValueError):
    """A model spec is invalid; the message names the offending key."""


def _int(spec: Mapping[str, Any], key: str, lo: int = 1, hi: int = 1 << 20) -> int:
    if key not in spec:
        raise SpecError(f"model spec ({spec.get('type')}) lacks {key!r}")
    v = spec[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise SpecError(f"model spec key {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _int_list(spec: Mapping[str, Any], key: str, allow_empty: bool = False) -> list[int]:
    v = spec.get(key)
    if (
        not isinstance(v, (list, tuple))
        or (not v and not allow_empty)
        or len(v) > MAX_LAYERS
        or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_WIDTH for x in v)
    ):
        raise SpecError(
            f"model spec key {key!r} must be a list of 1..{MAX_LAYERS} integers in [1, {MAX_WIDTH}], got {v!r}"
        )
    return list(v)


def validate_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``spec`` and return a normalised copy (defaults filled in).

    Raises:
        SpecError: unknown type or a missing/out-of-range key (named in the message).
    """
    if not isinstance(spec, Mapping):
        raise SpecError(f"model spec must be a mapping, got {type(spec).__name__}")
    if spec.get("type") == "convdense":  # FedD2S's 3-conv + 3-dense family (dfl_agent.models.convdense)
        from dfl_agent.models.convdense import validate_convdense_spec

        return validate_convdense_spec(spec)
    t = spec.get("type")
    if t not in MODEL_TYPES:
        raise SpecError(f"model spec 'type' must be one of {MODEL_TYPES}, got {t!r}")
    out: dict[str, Any] = {"type": t}
    if t == "cnn1d":
        out["in_channels"] = _int(spec, "in_channels", 1, 1024)
        out["length"] = _int(spec, "length", 1, 1 << 16)
        out["channels"] = _int_list(spec, "channels")
        out["kernel"] = _int({"kernel": spec.get("kernel", 5), "type": t}, "kernel", 1, 63)
        norm = spec.get("norm", "none")
        if norm not in ("none", "layer"):
            raise SpecError(f"model spec key 'norm' must be 'none' or 'layer', got {norm!r}")
        if norm != "none":
            out["norm"] = norm
        if out["length"] < 2 ** len(out["channels"]):
            raise SpecError("model spec 'channels' has too many layers for 'length'")
    elif t == "mlp":
        shape = spec.get("input_shape")
        if not isinstance(shape, (list, tuple)) or not shape or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape
        ):
            raise SpecError(f"model spec key 'input_shape' must be a list of positive integers, got {shape!r}")
        out["input_shape"] = list(shape)
        out["hidden"] = _int_list(spec, "hidden", allow_empty=True)
    elif t == "resnet":  # small pre-activation ResNet, see agent/models/resnet.py
        from dfl_agent.models.resnet import validate_resnet

        out.update(validate_resnet(spec, _int_list, SpecError))
    else:
        out["in_channels"] = _int(spec, "in_channels", 1, 1024)
        out["image_size"] = _int(spec, "image_size", 2, 4096)
        out["widths"] = _int_list(spec, "widths")
        out["kernel"] = _int({"kernel": spec.get("kernel", 5), "type": t}, "kernel", 1, 63)
        if out["image_size"] < 2 ** len(out["widths"]):
            raise SpecError("model spec 'widths' has too many layers for 'image_size'")
    out["num_classes"] = _int(spec, "num_classes", 2, 100000)
    return out


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """Instantiate the model a spec describes (weights from torch's current RNG state).

    Raises:
        SpecError: invalid spec (see :func:`validate_spec`).
    """
    from dfl_agent.models.nets import CNN, MLP, CNN1d

    s = validate_spec(spec)
    if s["type"] == "convdense":  # FedD2S's 3-conv + 3-dense family
        from dfl_agent.models.convdense import ConvDense

        return ConvDense(s["input_shape"], s["conv"], s["dense"], s["num_classes"], s["kernel"], s["pool"])
    if s["type"] == "cnn1d":
        return CNN1d(s["in_channels"], s["length"], s["channels"], s["kernel"], s["num_classes"],
                     s.get("norm", "none"))
    if s["type"] == "mlp":
        return MLP(math.prod(s["input_shape"]), s["hidden"], s["num_classes"])
    if s["type"] == "resnet":
        from dfl_agent.models.resnet import PreActResNet

        return PreActResNet(s["input_shape"], s["widths"], s["blocks"], s["num_classes"], s["norm"])
    return CNN(s["in_channels"], s["image_size"], s["widths"], s["kernel"], s["num_classes"])


def spec_hash(spec: Mapping[str, Any]) -> str:
    """Short stable hash (12 hex chars) of the normalised spec, advertised over mDNS."""
    canon = json.dumps(validate_spec(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:12]


def default_spec(input_shape: Sequence[int], num_classes: int, size: str = "medium") -> dict[str, Any]:
    """A sensible spec for a dataset's input shape.

    ``(C, L)`` -> ``cnn1d``; ``(C, H, H)`` with H >= 16 -> ``cnn``; otherwise ``mlp``.
    ``size`` in {"small", "medium", "large"} scales the widths (device size tiers).

    Raises:
        ValueError: unknown size.
    """
    scale = {"small": 0.5, "medium": 1.0, "large": 2.0}
    if size not in scale:
        raise ValueError(f"model size must be one of {sorted(scale)}, got {size!r}")
    f = scale[size]
    shape = list(input_shape)
    if len(shape) == 2:
        return {
            "type": "cnn1d", "in_channels": shape[0], "length": shape[1],
            "channels": [max(4, int(w * f)) for w in (16, 32, 64)], "kernel": 5, "num_classes": num_classes,
        }
    if len(shape) == 3 and shape[1] == shape[2] and shape[1] >= 16:
        return {
            "type": "cnn", "in_channels": shape[0], "image_size": shape[1],
            "widths": [max(4, int(w * f)) for w in (16, 32)], "kernel": 5, "num_classes": num_classes,
        }
    return {"type": "mlp", "input_shape": shape, "hidden": [max(8, int(w * f)) for w in (128, 64)],
            "num_classes": num_classes}


def spec_param_count(spec: Mapping[str, Any]) -> int | None:
    """Φ of the model ``spec`` describes, from the spec alone (no torch): equal to
    ``count_trainable(build_model(spec))`` for ``cnn1d``, ``mlp`` and ``cnn``; None for
    the other types (build the model to count them).

    Raises:
        SpecError: invalid spec (see :func:`validate_spec`).
    """
    s = validate_spec(spec)
    k = s["num_classes"]
    if s["type"] == "cnn1d":
        n, c, total = s["length"], s["in_channels"], 0
        for w in s["channels"]:
            n //= 2
            total += c * w * s["kernel"] + w + (2 * w * n if s.get("norm") == "layer" else 0)
            c = w
        return total + c * k + k
    if s["type"] == "mlp":
        f, total = math.prod(s["input_shape"]), 0
        for h in s["hidden"]:
            total += f * h + h
            f = h
        return total + f * k + k
    if s["type"] == "cnn":
        h, c, total = s["image_size"], s["in_channels"], 0
        for w in s["widths"]:
            h //= 2
            total += c * w * s["kernel"] ** 2 + w + 2 * w * h * h
            c = w
        return total + c * h * h * k + k
    return None


def count_trainable(model: nn.Module) -> int:
    """Φ: the number of trainable parameters (DFML seed 000, Eq. 3 weights)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def param_count(spec: Mapping[str, Any]) -> int:
    """Φ, the trainable parameters of the model ``spec`` describes, counted without
    allocating them: from the spec alone where it tells (``cnn1d``, ``mlp``, ``cnn``: no
    torch, :func:`dfl_agent.models.spec_param_count`), else by building the model on
    PyTorch's ``meta`` device, so a huge spec costs no memory.

    Raises:
        ValueError: an invalid spec.
    """
    s = validate_spec(dict(spec))
    n = spec_param_count(s)
    if n is not None:
        return int(n)
    import torch

    with torch.device("meta"):
        return int(count_trainable(build_model(s)))


def __getattr__(name: str) -> Any:
    """The torch modules (:mod:`dfl_agent.models.nets`), imported on first use, so that
    reading specs (:func:`validate_spec`, :func:`default_spec`, :func:`spec_hash`)
    imports no torch."""
    if name in ("CNN1d", "MLP", "CNN"):
        from dfl_agent.models import nets

        return getattr(nets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
