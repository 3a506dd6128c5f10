"""ONNX export (torch.onnx, the TorchScript-based exporter, the dynamo one where that fails)
against onnxruntime, window files, and the torch-free inference path (a subprocess where
``import torch`` fails)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import torch  # noqa: E402

from dfl_agent.inference.windows import load_windows  # noqa: E402
from dfl_agent.models import build_model  # noqa: E402
from dfl_agent.models.onnx_export import export_checked, export_onnx, max_abs_difference  # noqa: E402
from dfl_agent.onnx_model import InferenceError, OnnxModel  # noqa: E402

SPEC = {"type": "cnn1d", "in_channels": 3, "length": 32, "channels": [4, 8], "kernel": 5, "num_classes": 4,
        "norm": "layer"}
NO_TORCH = "import sys; sys.modules['torch'] = None; "


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    model = build_model(SPEC).eval()
    x = np.random.default_rng(0).normal(size=(50, 3, 32)).astype(np.float32)
    y = np.arange(50) % 4
    data = export_checked(model, (3, 32), x, spec=SPEC, path=d / "m.onnx")
    np.savez(d / "w.npz", x=x, y=y)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    return d, model, data, x, y, want


def test_export_matches_torch_and_carries_metadata(exported):
    d, model, data, x, y, want = exported
    assert (d / "m.onnx").read_bytes() == data and not (d / "m.onnx.tmp").exists()
    m = OnnxModel(data)
    assert m.input_shape == [3, 32] and json.loads(m.metadata["dfl.spec"])["channels"] == [4, 8]
    got = m.predict_logits(x[:7])  # dynamic batch
    assert got.shape == (7, 4) and np.abs(got - want[:7]).max() <= 1e-4
    assert max_abs_difference(data, model, x) <= 1e-4
    out = m.predict(x)
    np.testing.assert_allclose(out["probability"].sum(1), 1.0, rtol=1e-5)
    assert (out["label"] == want.argmax(1)).all()


def test_windows_from_csv_and_npz_and_errors(exported, tmp_path):
    d, _, data, x, y, _ = exported
    xs, ys = load_windows(d / "w.npz")
    assert xs.shape == (50, 3, 32) and (ys == y).all()
    csv = tmp_path / "w.csv"
    rows = ["header"] + [",".join([repr(float(v)) for v in w.ravel()] + [str(int(lab))]) for w, lab in zip(x, y)]
    csv.write_text("\n".join(rows) + "\n")
    xc, yc = load_windows(csv, (3, 32), label_column=True)
    np.testing.assert_allclose(xc, x, rtol=1e-6)
    assert (yc == y).all()
    with pytest.raises(InferenceError, match="rows have"):
        load_windows(csv, (3, 16), label_column=True)
    np.savez(tmp_path / "bad.npz", x=np.full((2, 3, 32), np.nan, np.float32))
    with pytest.raises(InferenceError, match="NaN"):
        load_windows(tmp_path / "bad.npz")
    with pytest.raises(InferenceError, match="wants"):
        OnnxModel(data).predict_logits(np.zeros((1, 3, 16), np.float32))
    with pytest.raises(InferenceError, match="cannot load"):
        OnnxModel(b"not onnx")


def test_export_of_the_image_cnn():
    for spec, shape in (({"type": "cnn", "in_channels": 1, "image_size": 8, "widths": [4], "kernel": 5,
                          "num_classes": 10}, (1, 8, 8)),):
        torch.manual_seed(1)
        m = build_model(spec)
        x = np.random.default_rng(1).normal(size=(5, *shape)).astype(np.float32)
        assert max_abs_difference(export_onnx(m, shape), m, x) <= 1e-4


def test_torch_free_predict_matches_torch(exported):
    """The inference member's code path with torch unimportable: dfl-infer predict."""
    d, _, _, _, y, want = exported
    code = (NO_TORCH + "from dfl_agent.cli.infer import main; "
            f"rc = main(['predict', '--model', {str(d / 'm.onnx')!r}, '--windows', {str(d / 'w.npz')!r}, '--json']); "
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert np.abs(np.asarray(doc["logits"]) - want).max() <= 1e-4
    assert doc["n"] == 50 and 0.0 <= doc["accuracy"] <= 1.0


def test_dflctl_predict_and_bad_file(exported, capsys):
    from dfl_agent.cli.dflctl import main

    d = exported[0]
    assert main(["predict", "--model", str(d / "m.onnx"), "--windows", str(d / "w.npz")]) == 0
    assert "50 windows, accuracy" in capsys.readouterr().out
    assert main(["predict", "--model", str(d / "m.onnx"), "--windows", str(d / "nope.npz")]) == 2


def test_export_skips_dynamo_and_onnxscript():
    """The export traces with the TorchScript-based exporter: neither TorchDynamo nor onnxscript
    is imported (the CPU time of ``dflctl export``; bench/operations/export_cpu.md)."""
    code = ("import sys, json; from dfl_agent.models import build_model; "
            "from dfl_agent.models.onnx_export import export_onnx; "
            f"export_onnx(build_model({SPEC!r}), (3, 32), spec={SPEC!r}); "
            "print(json.dumps([m for m in ('torch._dynamo', 'onnxscript', 'torch.export._trace') if m in sys.modules]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []
    assert "DeprecationWarning" not in r.stderr


def test_dynamo_exporter_where_torchscript_fails(exported, monkeypatch):
    """Where torch has no TorchScript-based exporter any more (or it fails on a model), the dynamo
    exporter makes the same model: the same operators, the same logits in onnxruntime."""
    import onnx

    from dfl_agent.models import onnx_export

    d, model, data, x, _, want = exported

    def gone(*a, **k):
        raise RuntimeError("no TorchScript-based exporter in this torch")

    monkeypatch.setattr(onnx_export, "_export_torchscript", gone)
    other = export_onnx(model, (3, 32), spec=SPEC)
    ops = [[n.op_type for n in onnx.load_model_from_string(b).graph.node if n.op_type != "Constant"]
           for b in (data, other)]
    assert ops[0] == ops[1]
    for b in (data, other):
        m = OnnxModel(b)
        assert m.input_shape == [3, 32] and json.loads(m.metadata["dfl.spec"]) == SPEC
        assert np.abs(m.predict_logits(x) - want).max() <= 1e-4
