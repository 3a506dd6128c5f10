"""The lab report's held-out accuracy of a deployed model: from ``model.onnx`` with
onnxruntime where the version has one, else from the torch model (``deploy.onnx = false``
or no onnx extra); both give the figure computed from the model itself."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dfl_agent.cli.demo_feed import collect  # noqa: E402
from dfl_agent.cli.lab.report import _torch_accuracy  # noqa: E402
from dfl_agent.onnx_model import onnx_available  # noqa: E402
from tests.unit.test_deployed_model import deploy  # noqa: E402


def _truth(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x)).argmax(1).numpy()


@pytest.mark.parametrize("onnx", [False, True])
def test_deployed_accuracy_on_held_out_windows(tmp_path, onnx):
    if onnx and not onnx_available():
        pytest.skip("the onnx extra is not installed")
    torch.set_num_threads(1)
    model, x, _ = deploy(tmp_path, onnx=onnx)
    y = _truth(model, x)
    y[:6] = (y[:6] + 1) % 6  # 6 of 24 wrong: 0.75
    test = SimpleNamespace(x=x, y=y)
    col = collect({"pi-0": tmp_path}, ["r1"], test)
    run = col["nodes"]["pi-0"]["runs"][0]
    assert run["deployed_version"] == 1
    if not onnx:
        assert run["heldout_accuracy"] is None  # no model.onnx: nothing measured without the fallback
    _torch_accuracy(col, {"pi-0": tmp_path}, test)
    assert run["heldout_accuracy"] == pytest.approx(0.75, abs=1e-9)
    assert col["deployments"][0]["heldout_accuracy"] == pytest.approx(0.75, abs=1e-9)
    assert np.isfinite(run["heldout_accuracy"])
