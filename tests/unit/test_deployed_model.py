"""A deployed model is usable from torch (``dfl_agent.models.load_deployed``) and from ONNX,
and the documentation's examples of both run as printed against a version folder written
by the real deploy code (``deploy_model`` into a ``ModelStore``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dfl_agent.deploy import ModelStore
from dfl_agent.deploy.gate import deploy_model
from dfl_agent.models import DeployedModelError, build_model, default_spec, load_deployed
from dfl_agent.onnx_model import onnx_available

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (3, 128)  # a HAR window, as in the live-data tutorial
CLASSES = ["walk", "up", "down", "sit", "stand", "lie"]


def deploy(state_dir: Path, onnx: bool, seed: int = 0):
    """Deploy a small cnn1d through the real gate; returns (model, inputs, ModelStore)."""
    spec = default_spec(SHAPE, len(CLASSES), "small")
    torch.manual_seed(seed)
    model = build_model(spec).eval()
    x = np.random.default_rng(seed).normal(size=(24, *SHAPE)).astype(np.float32)
    with torch.no_grad():
        y = model(torch.from_numpy(x)).argmax(1).numpy()
    store = ModelStore(state_dir)
    res = deploy_model(store, model, spec, SHAPE, CLASSES, x, y, run_id="r1", round=3, algorithm="fedavg",
                       onnx=onnx)
    assert res["deployed"]
    return model, x, store


def python_heredocs(page: Path) -> list[str]:
    """The ``python3 - <<'PY'`` scripts of a page's ``bash`` blocks."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
        out += re.findall(r"python3 - <<'PY'\n(.*?)\nPY\n", block, flags=re.S)
    return out


def run_snippet(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<doc snippet>", "exec"), {"__name__": "__doc_snippet__"})
    return out.getvalue()


def test_load_deployed_reproduces_the_model(tmp_path):
    model, x, store = deploy(tmp_path, onnx=False)
    assert "model.onnx" not in store.manifest(1)["files"]  # torch users need no ONNX
    want = model(torch.from_numpy(x)).detach().numpy()
    models = tmp_path / "models"
    for where in (models / "v1", models / "current", models):  # a version, the link, the models folder
        back = load_deployed(where)
        assert not back.training
        with torch.no_grad():
            np.testing.assert_allclose(back(torch.from_numpy(x)).numpy(), want, atol=1e-6)


def test_load_deployed_rejects_bad_folders(tmp_path):
    _, _, store = deploy(tmp_path / "a", onnx=False)
    v1 = tmp_path / "a" / "models" / "v1"
    with pytest.raises(FileNotFoundError, match="no such deployed model folder"):
        load_deployed(tmp_path / "nothing")
    # a copy without manifest.json (as an application may keep one): the spec and tensors are still checked
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("spec.json", "model.safetensors"):
        (bare / name).write_bytes((v1 / name).read_bytes())
    load_deployed(bare)
    (bare / "model.safetensors").rename(bare / "weights.bin")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors: missing"):
        load_deployed(bare)
    (bare / "weights.bin").rename(bare / "model.safetensors")
    # a spec.json whose model is not the one the tensors belong to: the shape is named
    meta = json.loads((v1 / "spec.json").read_text())
    meta["spec"]["channels"] = [c * 2 for c in meta["spec"]["channels"]]
    (bare / "spec.json").write_text(json.dumps(meta))
    with pytest.raises(DeployedModelError, match=r"tensor 'features\.0\.weight' has shape \[8, 3, 5\], .* needs \[16, 3, 5\]"):
        load_deployed(bare)
    meta["spec"] = {"type": "transformer"}
    (bare / "spec.json").write_text(json.dumps(meta))
    with pytest.raises(DeployedModelError, match=r"spec\.json: bad model spec: .*'type'"):
        load_deployed(bare)
    (bare / "spec.json").write_bytes(b"{not json")
    with pytest.raises(DeployedModelError, match=r"spec\.json: not valid JSON"):
        load_deployed(bare)
    (bare / "spec.json").write_bytes((v1 / "spec.json").read_bytes())
    (bare / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(DeployedModelError, match=r"model\.safetensors: unreadable safetensors file"):
        load_deployed(bare)
    # a file swapped into a version folder: it does not match the version's manifest
    other = tmp_path / "b"
    deploy(other, onnx=False, seed=1)
    os.chmod(v1 / "model.safetensors", 0o640)
    (v1 / "model.safetensors").write_bytes((other / "models" / "v1" / "model.safetensors").read_bytes())
    with pytest.raises(DeployedModelError, match=r"model\.safetensors: SHA-256 differs from manifest\.json"):
        load_deployed(v1)
    load_deployed(v1, verify=False)  # same architecture: loads when the caller opts out


def test_documented_examples_run(tmp_path, monkeypatch):
    """The live-data tutorial's step 6 (onnxruntime and torch) and the torch example of
    docs/data-and-models.md run as printed on a real deployed version; both predict alike."""
    if not onnx_available():
        pytest.skip("needs the onnx extra (model.onnx)")
    deploy(tmp_path / "node0", onnx=True)
    np.savez(tmp_path / "samples-node0.npz", x=np.random.default_rng(5).normal(size=(9, *SHAPE)).astype(np.float32),
             y=np.zeros(9, dtype=np.int64))
    monkeypatch.chdir(tmp_path)
    tutorial = [c for c in python_heredocs(ROOT / "docs" / "tutorials" / "live-data.md") if "models/current" in c]
    printed = "".join(run_snippet(c) for c in tutorial)
    onnx_pred = re.search(r"^onnxruntime: (\[[0-9, ]+\])$", printed, re.M)
    torch_pred = re.search(r"^torch: (\[[0-9, ]+\])$", printed, re.M)
    assert onnx_pred and torch_pred, printed
    assert onnx_pred.group(1) == torch_pred.group(1) and len(json.loads(torch_pred.group(1))) == 5
    assert "deployed version 1 of run r1" in printed

    page = (ROOT / "docs" / "data-and-models.md").read_text(encoding="utf-8")
    torch_examples = [c for c in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "load_deployed" in c]
    assert len(torch_examples) == 1
    out = run_snippet(torch_examples[0].replace("/var/lib/dfl-agent/models", str(tmp_path / "node0" / "models")))
    assert all(name in CLASSES for name in json.loads(out.replace("'", '"'))) and len(json.loads(out.replace("'", '"'))) == 4
