"""Device profiles on real daemons over mosquitto: a battery below its threshold stops
training within one round while the node stays visible in ``dflctl peers`` with the
reason; a DecHW peer with another architecture is reported and excluded; the
torch-free inference member receives the model as ONNX and matches torch within 1e-4."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from dfl_agent.runtime.run.agent import Agent
from dfl_agent.runtime.shared.config import (
    AlgorithmSection,
    DataSection,
    DiscoverySection,
    ModelSection,
    MqttSection,
    NodeConfig,
    RuntimeSection,
    TrainingSection,
    config_from_dict,
)
from tests.host import LobbyHost
from tests.unit.test_profiles import FakePsutil

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def node_cfg(tmp_path, fed, broker, nid, index, ids, algorithm, rounds, **kw):
    return NodeConfig(
        federation=fed, node_id=nid, state_dir=str(tmp_path / nid), seed=0, profile=kw.get("profile", "generic-x86"),
        profile_overrides=kw.get("overrides", {}),
        algorithm=AlgorithmSection(name=algorithm, rounds=rounds, options={"round_timeout": kw.get("timeout", 8.0)}),
        training=TrainingSection(threads=1, batch_size=64),
        model=ModelSection(size=kw.get("size", "small")),
        data=DataSection(dataset="digits", partition="iid", num_nodes=len(ids), node_index=index),
        mqtt=MqttSection(broker=broker, heartbeat_interval=0.5),
        discovery=DiscoverySection(mdns=False, static_peers=[p for p in ids if p != nid], min_peers=kw.get("min_peers", 1),
                                   start_timeout=20.0, heartbeat_timeout=30.0),
        runtime=RuntimeSection(log_level="warning"),
    )


def peers_json(broker, fed):
    """``dflctl peers --json`` (in-process: what an operator sees)."""
    import contextlib
    import io

    from dfl_agent.cli.dflctl import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["peers", "--broker", broker, "--federation", fed, "--json", "--timeout", "3"]) == 0
    return {row["node_id"]: row for row in json.loads(out.getvalue())["peers"]}


def test_battery_gating_on_daemons(mosquitto_broker, federation, tmp_path):
    broker = mosquitto_broker.endpoint
    ids = ["a", "b"]
    battery = FakePsutil(battery=(90, False))
    # rounds to spare: under load a may run ahead of b before b's gating shows (a test that waited
    # for a round past a's last one hung until pytest-timeout); stop ends both runs early
    rounds = 30
    cfgs = [node_cfg(tmp_path, federation, broker, n, i, ids, "fedavg", rounds, timeout=3.0) for i, n in enumerate(ids)]
    agents = [Agent(c, psutil_mod=battery if c.node_id == "b" else FakePsutil(), host=LobbyHost(c)) for c in cfgs]
    seen = {}

    async def main():
        stop = asyncio.Event()
        runs = [asyncio.ensure_future(a.run(stop)) for a in agents]
        b = agents[1]
        while b.node is None or len(b.node.history) < 2:
            await asyncio.sleep(0.1)
        battery.battery = (10, False)  # unplugged and drained, at the end of b's round 2
        drained_at = len(b.node.history)
        while b.ctx.gated is None:
            await asyncio.sleep(0.1)
        a_round = len(agents[0].node.history)
        while len(agents[0].node.history) < a_round + 2 and not runs[0].done():  # a trains on without b
            await asyncio.sleep(0.1)
        seen["a_went_on"] = len(agents[0].node.history) >= min(a_round + 2, rounds)
        seen["b_rounds"], seen["drained_at"] = len(b.node.history), drained_at
        seen["a_live"] = agents[0].ctx.live_peers()
        seen["peers"] = await asyncio.to_thread(peers_json, broker, federation)
        stop.set()
        await asyncio.gather(*runs)
        for x in agents:
            x.host.stop()

    asyncio.run(main())
    assert seen["a_went_on"]
    assert seen["b_rounds"] <= seen["drained_at"] + 1  # training stopped within one round
    b = seen["peers"]["b"]
    assert b["state"] == "online" and b["gated"].startswith("battery 10% < 20%")
    assert "gated: battery" in b["note"]
    assert seen["a_live"] == []  # a leaves the gated peer out of its rounds


def test_dechw_excludes_peer_with_other_architecture(mosquitto_broker, federation, tmp_path):
    broker = mosquitto_broker.endpoint
    ids = ["a", "b", "c"]
    cfgs = [node_cfg(tmp_path, federation, broker, n, i, ids, "dechw", 2, size="large" if n == "c" else "small",
                     min_peers=0 if n == "c" else 1)  # c has no compatible peer to wait for
            for i, n in enumerate(ids)]
    cfgs[2].runtime.eval_background = False  # c's after-round hook (hold) runs before its next round
    agents = [Agent(c, psutil_mod=FakePsutil(), host=LobbyHost(c)) for c in cfgs]
    a, b, c = agents

    def all_seen() -> bool:  # each of the three has seen the others' descriptors (model hashes)
        return (a.ctx is not None and b.ctx is not None and "c" in a.ctx.excluded and "c" in b.ctx.excluded
                and set(c.ctx.excluded) == {"a", "b"})

    async def hold(t, record):  # c's after-round hook: its round 2 (a model a and b drop) waits until
        # every exclusion is seen
        deadline = time.monotonic() + 60
        while t == 1 and not all_seen() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def main():
        # The order is explicit, not raced. c decides as it starts whether its run is already
        # finished by its peers' say (runtime rejoin: a and b are its static peers, and their
        # statuses are read before it knows their model hashes). Started together with a and b,
        # which finish their two rounds in well under a second, c could find them finished and
        # run no round at all. So c starts first, a and b once c is in its rounds.
        stop = asyncio.Event()
        runs = [asyncio.ensure_future(c.run(stop))]
        while c.node is None and not runs[0].done():
            await asyncio.sleep(0)
        if c.node is None:
            await runs[0]  # c failed to start: its error
        c.node.hooks.after_round.append(hold)
        while c.node.state != "running" and not runs[0].done():
            await asyncio.sleep(0.02)
        runs += [asyncio.ensure_future(x.run(stop)) for x in (a, b)]
        await asyncio.gather(*runs)
        try:
            return await asyncio.to_thread(peers_json, broker, federation)
        finally:
            for x in agents:
                x.host.stop()

    peers = asyncio.run(main())
    assert "c" in a.ctx.excluded and "dechw averages parameters" in a.ctx.excluded["c"]
    assert a.ctx.counters()["dropped"].get("incompatible_peer", 0) >= 1
    assert set(c.ctx.excluded) == {"a", "b"}
    assert all(r["neighbours"] == 1 for r in a.node.history)  # only b: c excluded, no time-outs on it
    assert len(a.node.history) == 2 and len(c.node.history) == 2  # nobody crashed
    assert any("excluded by a" in n for n in peers["c"]["excluded_by"])


def test_inference_member_without_torch_gets_onnx_model(mosquitto_broker, federation, tmp_path):
    pytest.importorskip("onnxscript")
    import torch

    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.discovery.presence import node_transport
    from dfl_agent.models import build_model
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.run.live_export import LiveExport
    from dfl_agent.runtime.service.lobby import RunLobby
    from dfl_agent.runtime.service.member_delivery import MemberDelivery
    from dfl_agent.runtime.shared.descriptor import RunVerifier

    broker = mosquitto_broker.endpoint
    spec = {"type": "cnn1d", "in_channels": 3, "length": 32, "channels": [4, 8], "kernel": 5, "num_classes": 4}
    torch.manual_seed(3)
    model = build_model(spec).eval()
    x = np.random.default_rng(2).normal(size=(20, 3, 32)).astype(np.float32)
    np.savez(tmp_path / "windows.npz", x=x)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    code = ("import sys; sys.modules['torch'] = None; from dfl_agent.cli.infer import main; "
            f"sys.exit(main(['run', '--broker', {broker!r}, '--federation', {federation!r}, '--node-id', 'inf', "
            f"'--state-dir', {str(tmp_path / 'inf')!r}, '--windows', {str(tmp_path / 'windows.npz')!r}, "
            "'--log-level', 'warning']))")
    member = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)

    cfg = config_from_dict({"federation": federation, "node_id": "t", "state_dir": str(tmp_path / "t"),
                            "mqtt": {"broker": broker}})

    async def main():
        peers = PeerTable("t", federation)
        tr = node_transport("t", federation, broker=broker, peers=peers, descriptor={"algorithm": "fedavg"})
        ctx = RuntimeContext(node_id="t", federation=federation, transport=tr, peers=peers, data=None,
                             model_spec=spec, train=None, init_seed=0, rng=np.random.default_rng(0))
        await ctx.start()
        lobby = RunLobby(cfg, "t", RunVerifier(federation, require_signatures=False))  # the service's session, which delivers
        lobby.start()
        try:
            deadline = time.monotonic() + 60
            while "inf" not in peers.live_peers() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            export = LiveExport(cfg.state_dir, peers, lambda: model, (3, 32), spec, "run-1", ctx.compute_ungated)
            assert export.members() == ["inf"]
            await export(1, {"local_accuracy": 0.5})  # the run: an improved model, exported
            delivery = MemberDelivery(cfg, lobby)  # the service: sends it to the member that lacks it
            out = tmp_path / "inf" / "predictions.json"
            while not out.exists() and time.monotonic() < deadline:
                await asyncio.to_thread(delivery.tick)
                await asyncio.sleep(0.2)
            return json.loads(out.read_text())
        finally:
            lobby.stop()
            await ctx.stop()

    try:
        doc = asyncio.run(main())
    finally:
        member.terminate()
        _, err = member.communicate(timeout=20)
    assert member.returncode == 0, err
    assert np.abs(np.asarray(doc["logits"]) - want).max() <= 1e-4
    assert doc["model"]["source"] == "t" and doc["model"]["version"] == 1
    assert (tmp_path / "inf" / "model.onnx").exists()
