"""Inference-only members of an agent that deploys (the sample store) receive the deployed
version only: an improvement during a run is not sent, each deployment is, unchanged."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def test_inference_member_receives_only_deployed_versions(mosquitto_broker, federation, tmp_path):
    pytest.importorskip("onnxscript")
    import torch

    from dfl_agent.deploy import ModelStore
    from dfl_agent.deploy.gate import deploy_model
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.discovery.presence import node_transport
    from dfl_agent.models import build_model
    from dfl_agent.runtime.context import RuntimeContext
    from dfl_agent.runtime.onnx_publisher import OnnxPublisher

    broker = mosquitto_broker.endpoint
    spec = {"type": "cnn1d", "in_channels": 3, "length": 32, "channels": [4, 8], "kernel": 5, "num_classes": 4}
    torch.manual_seed(3)
    model = build_model(spec).eval()
    x = np.random.default_rng(2).normal(size=(40, 3, 32)).astype(np.float32)
    with torch.no_grad():
        y = model(torch.from_numpy(x)).argmax(1).numpy()
    np.savez(tmp_path / "windows.npz", x=x, y=y)
    inf = tmp_path / "inf"
    code = ("import sys; sys.modules['torch'] = None; from dfl_agent.cli.infer import main; "
            f"sys.exit(main(['run', '--broker', {broker!r}, '--federation', {federation!r}, '--node-id', 'inf', "
            f"'--state-dir', {str(inf)!r}, '--windows', {str(tmp_path / 'windows.npz')!r}, "
            "'--log-level', 'warning']))")
    member = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    models = ModelStore(tmp_path / "agent")

    class Holder:  # the algorithm: its deployable model changes during the run
        def deployable_model(self):
            return model

    def predictions(version, deadline):
        out = inf / "predictions.json"
        while time.monotonic() < deadline:
            if out.exists():
                doc = json.loads(out.read_text())
                if doc["model"]["version"] == version:
                    return doc
            time.sleep(0.2)
        raise AssertionError(f"the member never served v{version}")

    async def main():
        peers = PeerTable("t", federation)
        tr = node_transport("t", federation, broker=broker, peers=peers, descriptor={"algorithm": "fedavg"})
        ctx = RuntimeContext(node_id="t", federation=federation, transport=tr, peers=peers, data=None,
                             model_spec=spec, train=None, init_seed=0, rng=np.random.default_rng(0))
        await ctx.start()
        try:
            deadline = time.monotonic() + 90
            while "inf" not in peers.live_peers() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            pub = OnnxPublisher(ctx, Holder(), (3, 32), spec, models=models)
            assert pub.members() == ["inf"]
            await pub(1, {"local_accuracy": 0.5})  # an improvement, nothing deployed: nothing sent
            assert pub.sent == {} and pub.data is None
            # the run ends: the deploy gate installs v1, the agent delivers it
            deploy_model(models, model, spec, (3, 32), list("abcd"), x, y, run_id="run-1", round=2,
                         algorithm="fedavg")
            assert await pub.deliver(2) == 1 and pub.sent == {"inf": 1}
            doc1 = await asyncio.to_thread(predictions, 1, deadline)
            # the next run improves its model round after round: the member keeps v1
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05)
            for t, acc in ((1, 0.7), (2, 0.9)):
                await pub(t, {"local_accuracy": acc})
            assert pub.sent == {"inf": 1}
            assert await pub.deliver(2) == 0  # the member holds the deployed version already
            deploy_model(models, model, spec, (3, 32), list("abcd"), x, y, run_id="run-2", round=2,
                         algorithm="fedavg", force=True)
            await pub(1, {"local_accuracy": 0.95})  # the round hook delivers the new deployed version too
            assert pub.sent == {"inf": 2}
            doc2 = await asyncio.to_thread(predictions, 2, deadline)
            return doc1, doc2
        finally:
            await ctx.stop()

    try:
        doc1, doc2 = asyncio.run(main())
    finally:
        member.terminate()
        _, err = member.communicate(timeout=20)
    assert member.returncode == 0, err
    assert doc1["model"]["run_id"] == "run-1" and doc1["model"]["deployed"] and doc1["accuracy"] == 1.0
    assert doc2["model"]["run_id"] == "run-2" and doc2["model"]["version"] == 2
    # the member holds the deployed file byte for byte
    held = hashlib.sha256((inf / "model.onnx").read_bytes()).hexdigest()
    assert held == models.manifest(2)["files"]["model.onnx"]["sha256"] == doc2["model"]["sha256"]
