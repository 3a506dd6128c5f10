"""Inference-only members of an agent that deploys (the sample store) receive the deployed
version only: an improvement during a run is not sent (the run exports nothing), each
deployment is, unchanged, by the service's delivery."""

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
    from dfl_agent.models import build_model
    from dfl_agent.runtime.run.live_export import LIVE_DIR
    from dfl_agent.runtime.service.lobby import RunLobby
    from dfl_agent.runtime.service.member_delivery import MemberDelivery
    from dfl_agent.runtime.shared.config import config_from_dict
    from dfl_agent.runtime.shared.descriptor import RunVerifier

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
    cfg = config_from_dict({"federation": federation, "node_id": "t", "state_dir": str(tmp_path / "agent"),
                            "mqtt": {"broker": broker},
                            "data": {"dataset": "store", "input_shape": [3, 32], "num_classes": 4}})
    models = ModelStore(tmp_path / "agent")

    def predictions(version, deadline):
        out = inf / "predictions.json"
        while time.monotonic() < deadline:
            if out.exists():
                doc = json.loads(out.read_text())
                if doc["model"]["version"] == version:
                    return doc
            time.sleep(0.2)
        raise AssertionError(f"the member never served v{version}")

    def deliver_until(delivery, n, deadline):
        """Tick the service's delivery until it sent ``n`` copies in all."""
        while sum(delivery.copies.values()) < n and time.monotonic() < deadline:
            delivery.tick()
            time.sleep(0.2)
        return sum(delivery.copies.values())

    async def main():
        lobby = RunLobby(cfg, "t", RunVerifier(federation, require_signatures=False))
        lobby.start()
        try:
            deadline = time.monotonic() + 90
            delivery = MemberDelivery(cfg, lobby, retry_s=3600.0)
            while not any(st.get("algorithm") == "inference" for st in dict(lobby.statuses).values()) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert delivery.tick() == 0  # nothing deployed yet: nothing sent
            assert not (tmp_path / "agent" / LIVE_DIR).exists()  # a node that deploys exports no live model
            # the run ends: the deploy gate installs v1, the service switches current and delivers it
            deploy_model(models, model, spec, (3, 32), list("abcd"), x, y, run_id="run-1", round=2,
                         algorithm="fedavg")
            assert await asyncio.to_thread(deliver_until, delivery, 1, deadline) == 1
            doc1 = await asyncio.to_thread(predictions, 1, deadline)
            # the next run improves its model round after round: the member keeps v1
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05)
            await asyncio.sleep(1.0)  # the member's status, holding v1, reaches the lobby
            assert delivery.tick() == 0  # the member holds the deployed version already
            deploy_model(models, model, spec, (3, 32), list("abcd"), x, y, run_id="run-2", round=2,
                         algorithm="fedavg", force=True)
            assert await asyncio.to_thread(deliver_until, delivery, 2, deadline) == 2
            doc2 = await asyncio.to_thread(predictions, 2, deadline)
            return doc1, doc2
        finally:
            lobby.stop()

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
