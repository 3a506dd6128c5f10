"""``dflctl export --onnx`` and ``dflctl predict``.

  dflctl export --onnx OUT.onnx [--dataset har] [--model-size small|--spec JSON]
                [--weights STATE.safetensors] [--train-epochs N] [--windows-out W.npz] [--json]
      build the model (weights from a safetensors state dict, or trained N epochs on
      the dataset's pool, or freshly initialised), export it with torch.onnx (one file;
      see dfl_agent.models.onnx_export), check onnxruntime against torch on test windows
      (max |Δlogit| <= 1e-4); one torch thread (the export is small: more threads only spin)
  dflctl predict --model M.onnx --windows FILE.npz|FILE.csv [--json]
      onnxruntime predictions on a window file (the same as ``dfl-infer predict``)
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dfl_agent.cli.dflctl import DflctlParser


def cmd_export(a: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from dfl_agent.data import load_dataset
    from dfl_agent.learning.training import TrainConfig, train_local
    from dfl_agent.models import build_model, default_spec, validate_spec
    from dfl_agent.models.onnx_export import export_checked

    if not a.onnx:
        raise ValueError("export: --onnx OUT.onnx is required (the only export format)")
    torch.set_num_threads(1)
    bundle = load_dataset(a.dataset, path=a.dataset_path)
    shape = list(bundle.pool.input_shape)
    spec = validate_spec(json.loads(a.spec)) if a.spec else default_spec(shape, bundle.pool.num_classes, a.model_size)
    torch.manual_seed(a.seed)
    model = build_model(spec)
    source = "initial weights"
    if a.weights:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(a.weights))
        source = f"weights {a.weights}"
    elif a.train_epochs > 0:
        train_local(model, bundle.pool.x, bundle.pool.y, TrainConfig(epochs=a.train_epochs), np.random.default_rng(a.seed))
        source = f"trained {a.train_epochs} epoch(s) on the {a.dataset} pool"
    test_x = bundle.test.x[: a.check_windows]
    data = export_checked(model, shape, test_x, atol=1e-4, spec=spec, path=a.onnx)
    from dfl_agent.models.onnx_export import max_abs_difference

    diff = max_abs_difference(data, model, test_x)
    if a.windows_out:
        np.savez(a.windows_out, x=bundle.test.x[: a.check_windows], y=bundle.test.y[: a.check_windows])
    with torch.no_grad():
        acc = float((model.eval()(torch.from_numpy(bundle.test.x)).argmax(1).numpy() == bundle.test.y).mean())
    out = {"onnx": a.onnx, "bytes": len(data), "spec": spec, "source": source, "max_abs_diff": diff,
           "checked_windows": int(len(test_x)), "torch_test_accuracy": acc, "windows_out": a.windows_out}
    if a.json:
        from dfl_agent.cli.output import json_doc

        print(json_doc(out))
    else:
        print(f"exported {a.onnx} ({len(data)} bytes, {spec['type']}, {source}); onnxruntime vs torch on "
              f"{len(test_x)} test windows: max |Δlogit| = {diff:.2e}; torch test accuracy {acc:.4f}")
    return 0


def cmd_predict(a: argparse.Namespace) -> int:
    from dfl_agent.cli.infer import predict_command

    return predict_command(a.model, a.windows, as_json=a.json, label_column=a.label_column, threads=a.threads)


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``dflctl export`` and ``dflctl predict``."""
    e = sub.add_parser("export", help="export a model to ONNX (for inference-only members)")
    e.add_argument("--onnx", required=True, metavar="OUT.onnx", help="ONNX file to write")
    e.add_argument("--dataset", default="har", choices=["har", "digits", "idx", "npz"], help="dataset the model is trained on")
    e.add_argument("--dataset-path", default=None, help="directory for --dataset idx|npz")
    e.add_argument("--model-size", default="medium", choices=["small", "medium", "large"], help="model size")
    e.add_argument("--spec", default=None, help="model spec as JSON (instead of --model-size)")
    e.add_argument("--weights", default=None, help="state dict in safetensors format")
    e.add_argument("--train-epochs", type=int, default=0, help="train this many epochs on the pool first")
    e.add_argument("--seed", type=int, default=0, help="random seed")
    e.add_argument("--check-windows", type=int, default=256, help="test windows for the onnxruntime check")
    e.add_argument("--windows-out", default=None, help="also save those windows (x, y) as .npz")
    e.add_argument("--json", action="store_true", help="one JSON document (schema_version 1)")
    e.set_defaults(func=cmd_export)
    p = sub.add_parser("predict", help="onnxruntime predictions on a .npz/.csv of windows")
    p.add_argument("--model", required=True, help="ONNX model file")
    p.add_argument("--windows", required=True, help=".npz or .csv of windows")
    p.add_argument("--label-column", action="store_true", help="CSV: the last column is the label")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    p.add_argument("--json", action="store_true", help="one JSON document (schema_version 1)")
    p.set_defaults(func=cmd_predict)
