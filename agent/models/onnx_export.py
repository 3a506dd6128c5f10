"""Export a deployable model to ONNX (for the inference-only member) and check it.

``torch.onnx.export``: one self-contained file, opset :data:`OPSET`, input ``x`` of shape
``(batch, *input_shape)`` with a dynamic batch axis, output ``logits`` of shape
``(batch, num_classes)``.  The model's spec and the exporter's metadata travel in the ONNX
``metadata_props`` (``dfl.spec``, ``dfl.input_shape``, plus caller extras).

The exporter is torch's TorchScript-based one (``dynamo=False``): the project's models are
plain feed-forward networks, which it traces into the same ONNX operators as the dynamo
exporter (torch's default since 2.9) at a fraction of the CPU time, because it imports
neither TorchDynamo nor onnxscript (``bench/operations/export_cpu.md``).  Where torch no longer
has it, or it fails on a model, the dynamo exporter is used.  Either way
:func:`export_checked` compares onnxruntime's logits with torch's.

Needs the ``onnx`` extra (onnx, onnxruntime; onnxscript for the dynamo exporter).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dfl_agent.fsutil import atomic_write

INPUT_NAME = "x"
OUTPUT_NAME = "logits"
#: the ONNX opset of every export (the dynamo exporter's default in torch 2.13)
OPSET = 20
#: the FutureWarning torch.onnx.export (dynamo) raises from torch's own pytree code (torch 2.13)
_TORCH_LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class OnnxExportError(ValueError):
    """The model could not be exported, or the export disagrees with torch."""


def export_onnx(
    model: nn.Module,
    input_shape: Sequence[int],
    *,
    spec: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    path: str | os.PathLike[str] | None = None,
) -> bytes:
    """Export ``model`` (a copy, on cpu, eval mode) to ONNX bytes.

    Args:
        model: maps float32 ``(B, *input_shape)`` to logits ``(B, K)``.
        input_shape: one sample's shape, e.g. ``(3, 128)`` for HAR windows.
        spec: the model spec (stored as ``dfl.spec``).
        metadata: further string-able metadata (``dfl.<key>``).
        path: also write the bytes there (atomically: temp file + rename).

    Raises:
        OnnxExportError: the exporter failed (the message says why; the ``onnx`` extra
            missing is the usual cause).
    """
    try:
        import onnx
    except ImportError as exc:
        from dfl_agent.extras import extra_hint

        raise OnnxExportError(f"ONNX export needs the 'onnx' extra ({extra_hint('onnx')}): {exc}") from None
    m = copy.deepcopy(model).to("cpu").eval()
    example = torch.zeros((2, *[int(s) for s in input_shape]), dtype=torch.float32)
    props = {"dfl.input_shape": json.dumps([int(s) for s in input_shape])}
    if spec is not None:
        props["dfl.spec"] = json.dumps(dict(spec), sort_keys=True)
    for k, v in (metadata or {}).items():
        props[f"dfl.{k}"] = v if isinstance(v, str) else json.dumps(v)
    try:
        proto = onnx.load_model_from_string(_export_torchscript(m, example))
    except Exception as exc:  # noqa: BLE001 - removed from torch, or a model it cannot trace
        logging.getLogger(__name__).debug("TorchScript ONNX export failed (%s); using the dynamo exporter", exc)
        proto = _export_dynamo(m, example)
    onnx.helper.set_model_props(proto, props)
    data = proto.SerializeToString()
    if path is not None:
        atomic_write(Path(path), data)
    return data


def _export_torchscript(m: nn.Module, example: torch.Tensor) -> bytes:
    """``m`` traced by torch's TorchScript-based ONNX exporter: the serialised ONNX model.

    Raises:
        Exception: whatever the exporter raises (also when torch no longer has it).
    """
    buf = io.BytesIO()
    with contextlib.redirect_stdout(io.StringIO()), torch.no_grad(), warnings.catch_warnings():
        # torch deprecates this exporter in favour of dynamo's (see the module docstring)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        # a file object is fine here (the exporter writes through torch.serialization._open_file_like)
        torch.onnx.export(
            m, (example,), buf,  # type: ignore[arg-type]
            dynamo=False, input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}}, opset_version=OPSET, verbose=False,
        )
    return buf.getvalue()


def _export_dynamo(m: nn.Module, example: torch.Tensor) -> Any:
    """``m`` exported by torch's dynamo exporter (needs onnxscript), as an ``onnx.ModelProto``.

    Raises:
        OnnxExportError: the exporter failed (the message says why; ``onnxscript`` missing is
            the usual cause).
    """
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    quiet = io.StringIO()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(quiet), torch.no_grad(), warnings.catch_warnings():
            # torch's own exporter code trips its pytree deprecation (LeafSpec); nothing of ours
            # calls it, and the warning would land in the agent's log on every export
            warnings.filterwarnings("ignore", message=_TORCH_LEAFSPEC_WARNING, category=FutureWarning)
            program = torch.onnx.export(
                m, (example,), dynamo=True, external_data=False, input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME], dynamic_shapes=({0: batch},), verbose=False, opset_version=OPSET,
            )
    except Exception as exc:  # noqa: BLE001 - the exporter raises many kinds
        raise OnnxExportError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}") from None
    if program is None:  # pragma: no cover - only the TorchScript exporter returns None
        raise OnnxExportError("torch.onnx.export returned no program (dynamo exporter unavailable?)")
    return program.model_proto


def max_abs_difference(onnx_bytes: bytes, model: nn.Module, x: np.ndarray) -> float:
    """max |onnxruntime(x) - model(x)| over the logits, for float32 ``x`` of ``(B, *shape)``."""
    from dfl_agent.onnx_model import OnnxModel

    got = OnnxModel(onnx_bytes).predict_logits(x)
    m = copy.deepcopy(model).to("cpu").eval()
    with torch.no_grad():
        want = m(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()
    return float(np.abs(got - want).max()) if len(x) else 0.0


def export_checked(model: nn.Module, input_shape: Sequence[int], x: np.ndarray, *, atol: float = 1e-4,
                   **kwargs: Any) -> bytes:
    """:func:`export_onnx`, then check onnxruntime against torch on ``x``.

    Raises:
        OnnxExportError: export failed or the largest logit difference exceeds ``atol``.
    """
    data = export_onnx(model, input_shape, **kwargs)
    diff = max_abs_difference(data, model, x)
    if not diff <= atol:
        raise OnnxExportError(f"ONNX and torch logits differ by {diff:.3g} > {atol:g}")
    return data
