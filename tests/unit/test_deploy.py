"""Model delivery: the deploy gate, versions, current link, rollback, --force, ONNX vs torch."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dfl_agent.deploy import DeployError, ModelStore, verify_folder
from dfl_agent.deploy.gate import (
    announcement,
    deploy_model,
    load_torch,
)
from dfl_agent.models import build_model, default_spec
from dfl_agent.onnx_model import onnx_available

SHAPE = (3, 16)


def make(seed):
    spec = default_spec(SHAPE, 4, "small")
    torch.manual_seed(seed)
    return spec, build_model(spec).eval()


def labelled_by(model, n, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, *SHAPE)).astype(np.float32)
    with torch.no_grad():
        y = model(torch.from_numpy(x)).argmax(1).numpy().astype(np.int64)
    return x, y


def verify_announcement(doc: dict[str, Any], public_key: Any) -> bool:
    """True when ``doc['sig']`` is a valid Ed25519 signature of the rest by ``public_key``."""
    import base64

    from dfl_agent.security.keys import canonical
    from dfl_agent.security.trust import SIG_PREFIX

    sig = doc.get("sig")
    if not isinstance(sig, str) or not sig.startswith(SIG_PREFIX):
        return False
    try:
        public_key.verify(base64.b64decode(sig[len(SIG_PREFIX):]), canonical({k: v for k, v in doc.items()
                                                                               if k != "sig"}))
        return True
    except Exception:  # noqa: BLE001 - InvalidSignature, bad base64
        return False


def go(models, model, spec, x, y, **kw):
    return deploy_model(models, model, spec, SHAPE, ["a", "b", "c", "d"], x, y, run_id=kw.pop("run_id", "r1"),
                        round=5, algorithm="fedavg", **kw)


def test_gate_force_rollback_and_onnx_agreement(tmp_path, capsys):
    from dfl_agent.cli.dflctl import main

    models = ModelStore(tmp_path, keep=3)
    spec, good = make(0)
    _, bad = make(1)
    x, y = labelled_by(good, 60)
    res = go(models, good, spec, x, y)
    assert res["deployed"] and res["version"] == 1 and res["accuracy"] == 1.0
    assert os.readlink(tmp_path / "models" / "current") == "v1"
    m = verify_folder(tmp_path / "models" / "current")
    assert m["version"] == 1 and m["run_id"] == "r1" and m["round"] == 5 and m["validation_samples"] == 60
    assert set(m["files"]) >= {"model.safetensors", "spec.json"}
    # a worse candidate is not deployed; it waits as the candidate
    res = go(models, bad, spec, x, y, run_id="r2")
    assert not res["deployed"] and res["deployed_accuracy"] == 1.0 and res["accuracy"] < 0.9
    assert models.current_version() == 1 and (tmp_path / "models" / "candidate" / "manifest.json").exists()
    assert main(["model", "show", "--state-dir", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["current"]["version"] == 1 and doc["current"]["accuracy"] == 1.0
    assert doc["current"]["sha256"] == m["sha256"] and doc["candidate"]["run_id"] == "r2"
    assert main(["model", "deploy", "--state-dir", str(tmp_path)]) == 2  # needs --force
    assert main(["model", "deploy", "--force", "--state-dir", str(tmp_path)]) == 0
    assert models.current_version() == 2 and models.manifest(2)["forced"] and models.manifest(2)["run_id"] == "r2"
    assert main(["model", "rollback", "--state-dir", str(tmp_path)]) == 0
    assert models.current_version() == 1
    assert main(["model", "rollback", "--to", "v2", "--state-dir", str(tmp_path)]) == 0
    assert models.current_version() == 2
    assert main(["model", "rollback", "--to", "9", "--state-dir", str(tmp_path)]) == 2
    # the deployed files reproduce the torch model
    back = load_torch(tmp_path / "models" / "v1")
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.from_numpy(x)).numpy(), good(torch.from_numpy(x)).numpy(), atol=1e-6)
    if onnx_available():
        import onnxruntime as ort

        sess = ort.InferenceSession(str(tmp_path / "models" / "v1" / "model.onnx"), providers=["CPUExecutionProvider"])
        got = sess.run(None, {"x": x})[0]
        with torch.no_grad():
            want = good(torch.from_numpy(x)).numpy()
        assert np.abs(got - want).max() <= 1e-4
        assert m["onnx"] and m["sha256"] == m["files"]["model.onnx"]["sha256"]
        # the example of the application contract (FORMAT.md) runs as printed
        import contextlib
        import importlib.resources
        import io
        import re

        text = (importlib.resources.files("dfl_agent.deploy") / "FORMAT.md").read_text(encoding="utf-8")
        code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
        assert len(code.strip().splitlines()) <= 22
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace("/var/lib/dfl-agent/models", str(tmp_path / "models")), {})
        assert out.getvalue().startswith("2 [")  # current is v2 here


def test_few_validation_samples_and_keep(tmp_path):
    """(without ONNX, as with the onnx extra missing: safetensors + spec.json only)"""
    models = ModelStore(tmp_path, keep=2)
    spec, good = make(0)
    x, y = labelled_by(good, 10)

    def go(models, model, spec, x, y, **kw):
        return deploy_model(models, model, spec, SHAPE, list("abcd"), x, y, run_id="r", round=1,
                            algorithm="fedavg", onnx=False, **kw)

    res = go(models, good, spec, x, y)
    assert "model.onnx" not in models.manifest(1)["files"] and not models.manifest(1)["onnx"]
    assert res["deployed"] and "deployed because no model was deployed yet" in models.manifest(1)["note"]
    res = go(models, good, spec, x, y)
    assert not res["deployed"] and "only 10 validation samples" in res["note"]
    res = go(models, good, spec, x, y, force=True)
    assert res["deployed"] and res["version"] == 2 and models.manifest(2)["forced"]
    xs, ys = labelled_by(good, 40)
    for _ in range(2):
        go(models, good, spec, xs, ys)
    assert models.versions() == [3, 4] and models.current_version() == 4  # keep = 2
    models.rollback()
    assert models.current_version() == 3
    go(models, good, spec, xs, ys)  # v5; current v5; the kept set never drops the current one
    assert models.versions() == [4, 5] and models.current_version() == 5
    with pytest.raises(DeployError):
        ModelStore(tmp_path / "empty").rollback()


def test_signed_announcement(tmp_path):
    from dfl_agent.security import SecurityGuard, TrustStore
    from dfl_agent.security.keys import load_or_create_key

    models = ModelStore(tmp_path)
    spec, good = make(0)
    x, y = labelled_by(good, 30)
    deploy_model(models, good, spec, SHAPE, list("abcd"), x, y, run_id="r", round=1, algorithm="a", onnx=False)
    key = load_or_create_key(tmp_path)
    guard = SecurityGuard("n1", key, TrustStore("fed", {}))
    doc = announcement(models, "n1", "fed", guard)
    assert doc["version"] == 1 and doc["sha256"] == models.manifest(1)["sha256"]
    assert verify_announcement(doc, key.public_key())
    assert not verify_announcement({**doc, "version": 2}, key.public_key())



def test_promote_is_idempotent_after_a_kill_before_the_candidate_is_removed(tmp_path):
    """A kill between installing the promoted candidate and removing it leaves the candidate
    staged; promoting again must not make a second version of it."""
    models = ModelStore(tmp_path, keep=5)
    models.install({"model.safetensors": b"v1 weights", "spec.json": b"{}"}, {"run_id": "r1"})
    models.stage_candidate({"model.safetensors": b"cand weights", "spec.json": b"{}"},
                           {"run_id": "r2", "note": "worse"})

    class Killed(BaseException):
        pass

    real_remove = ModelStore._remove

    def killed_at_removal(self, folder):
        if folder.name == "candidate":
            raise Killed  # the process dies here: the version is installed, the candidate still staged
        real_remove(self, folder)

    ModelStore._remove = killed_at_removal
    try:
        with pytest.raises(Killed):
            models.promote_candidate()
    finally:
        ModelStore._remove = real_remove
    assert models.versions() == [1, 2] and (tmp_path / "models" / "candidate" / "manifest.json").is_file()
    models.rollback(1)  # even if the operator rolled back meanwhile, the promotion is the same version
    assert models.promote_candidate() == 2
    assert models.versions() == [1, 2] and models.current_version() == 2
    assert not (tmp_path / "models" / "candidate").exists()
    assert models.manifest(2)["candidate_sha256"] and models.manifest(2)["run_id"] == "r2"
    assert (tmp_path / "models" / "v2" / "model.safetensors").read_bytes() == b"cand weights"
    with pytest.raises(DeployError):
        models.promote_candidate()  # nothing left to promote
    # a new candidate with the same files is a new promotion
    models.stage_candidate({"model.safetensors": b"cand weights", "spec.json": b"{}"}, {"run_id": "r3"})
    assert models.promote_candidate() == 3
