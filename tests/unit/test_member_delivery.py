"""Deployed models reach inference members: the member keeps the newest deployment whatever
the runs' round counts, and the supervisor sends ``models/current`` to the members whose
status lacks it, again with a growing wait while it still does."""

from __future__ import annotations

import hashlib
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from dfl_agent.algorithms.context import Message
from dfl_agent.deploy.versions import ModelStore
from dfl_agent.onnx_model import ONNX_KIND
from dfl_agent.runtime.service.member_delivery import MemberDelivery, lacks
from dfl_agent.transport import wire
from dfl_agent.transport.chunking import Reassembler

pytest.importorskip("onnx")

#: the sample store: a node whose runs deploy (NodeConfig.deploys)
STORE = {"dataset": "store", "input_shape": [4], "num_classes": 2}


def _onnx(weight: float) -> bytes:
    from tests.system.test_inference_production import _onnx as tiny

    return tiny(weight)


def _install(models: ModelStore, weight: float, run_id: str, rnd: int, at: float) -> int:
    spec = {"spec": {"type": "mlp", "input_shape": [4], "hidden": [], "num_classes": 2}}
    return models.install({"model.onnx": _onnx(weight), "spec.json": json.dumps(spec).encode()},
                          {"run_id": run_id, "round": rnd, "accuracy": 0.9, "time": at})


def _member_message(weight: float, *, rnd: int, at: float, run_id: str) -> Message:
    data = _onnx(weight)
    meta = {"version": 1, "round": rnd, "run_id": run_id, "deployed": True, "deployed_at": at,
            "sha256": hashlib.sha256(data).hexdigest()}
    return Message(ONNX_KIND, rnd, {"onnx": np.frombuffer(data, np.uint8).copy()}, meta, sender="t")


def test_member_keeps_the_newest_deployment_whatever_the_round(tmp_path):
    from dfl_agent.inference.member import InferenceMember

    m = InferenceMember("inf", "fed", broker="127.0.0.1:1", state_dir=tmp_path, sign=False)
    assert m.accept(_member_message(1.0, rnd=300, at=1000.0, run_id="run-1"))
    # the next run is shorter: round 100 < 300, but it was deployed later
    assert m.accept(_member_message(2.0, rnd=100, at=2000.0, run_id="run-2"))
    st = m.status()
    assert (st["model_run_id"], st["model_deployed_at"]) == ("run-2", 2000.0)
    assert st["model_sha256"] == hashlib.sha256(_onnx(2.0)).hexdigest()
    # a copy of an older deployment (another device's current of run 1) is refused and counted
    assert not m.accept(_member_message(3.0, rnd=300, at=1500.0, run_id="run-1"))
    assert m.ctx.counters()["dropped"] == {"stale_model": 1}
    # the deployment held, sent again: nothing to do, nothing counted
    assert not m.accept(_member_message(2.0, rnd=100, at=2000.0, run_id="run-2"))
    assert m.ctx.counters()["dropped"] == {"stale_model": 1}
    taken = [json.loads(line)["run_id"] for line in (tmp_path / "models.jsonl").read_text().splitlines()]
    assert taken == ["run-1", "run-2"]


def test_lacks_compares_the_held_deployment():
    meta = {"sha256": "b", "deployed_at": 200.0}
    assert lacks({}, meta)  # holds nothing
    assert lacks({"model_sha256": "a", "model_deployed_at": 100.0}, meta)
    assert lacks({"model_sha256": "a", "model_deployed_at": None}, meta)  # a model that was not deployed
    assert not lacks({"model_sha256": "b", "model_deployed_at": 200.0}, meta)
    assert not lacks({"model_sha256": "c", "model_deployed_at": 300.0}, meta)  # a newer deployment


class _Client:
    def __init__(self):
        self.published: list[tuple[str, bytes]] = []

    def publish(self, topic, payload, qos=0):
        self.published.append((topic, payload))


def _lobby(statuses):
    lobby = SimpleNamespace(lock=threading.Lock(), statuses=statuses, client=_Client(), guard=None, node_id="t",
                            connected=True)
    lobby.up = lambda: lobby.connected
    return lobby


def _frames(client: _Client, topic: str) -> list[Message]:
    asm, out = Reassembler(), []
    for t, payload in client.published:
        if t == topic:
            frame = asm.feed(payload)
            if frame is not None:
                out.append(wire.decode(frame, federation="fed", recipient="inf"))
    return out


def test_delivery_sends_to_members_that_lack_the_deployment_with_a_growing_wait(tmp_path):
    from dfl_agent.runtime.shared.config import config_from_dict

    cfg = config_from_dict({"federation": "fed", "state_dir": str(tmp_path), "mqtt": {"chunk_size": 1024},
                            "data": STORE})  # a node that deploys
    models = ModelStore(tmp_path)
    v = _install(models, 1.0, "run-1", 300, 1000.0)
    sha = models.manifest(v)["files"]["model.onnx"]["sha256"]
    statuses = {"inf": {"role": "inference", "state": "waiting_for_model", "time": 1.0},
                "gone": {"role": "inference", "state": "stopped", "time": 1.0},
                "newer": {"role": "inference", "state": "serving", "model_sha256": "x", "model_deployed_at": 5000.0},
                "p": {"algorithm": "fedavg", "state": "training"}}
    lobby, now = _lobby(statuses), [0.0]
    d = MemberDelivery(cfg, lobby, retry_s=30.0, max_retry_s=100.0, clock=lambda: now[0])
    assert d.chunk_size == 1024
    d.chunk_size = 300  # smaller than the tiny model's frame
    assert d.tick() == 1 and d.copies == {"inf": 1}
    [msg] = _frames(lobby.client, "dfl/fed/node/inf/inbox")
    assert msg.kind == ONNX_KIND and msg.sender == "t" and msg.round == 300
    assert msg.meta["deployed"] and msg.meta["deployed_at"] == 1000.0 and msg.meta["run_id"] == "run-1"
    assert hashlib.sha256(msg.tensors["onnx"].tobytes()).hexdigest() == msg.meta["sha256"] == sha
    assert len(lobby.client.published) > 1 and max(len(p) for _, p in lobby.client.published) <= 300
    assert {t for t, _ in lobby.client.published} == {"dfl/fed/node/inf/inbox"}
    # still lacking it: again after 30 s, then after 60, then at most 100
    for wait in (29.0, 1.0, 59.0, 1.0, 99.0, 1.0):
        now[0] += wait
        d.tick()
    assert d.copies == {"inf": 4}
    # a new status that shows the same (its error count changed): still the wait
    statuses["inf"] = {"role": "inference", "state": "waiting_for_model", "time": 2.0}
    now[0] += 99.0
    assert d.tick() == 0
    # it shows another holding (it took another device's older model, or restarted): the wait
    # starts again from 30 s after the last copy (not at once: a status that keeps changing
    # never gets more than one copy per 30 s)
    statuses["inf"] = {"role": "inference", "state": "serving", "model_sha256": "o", "model_deployed_at": 10.0}
    assert d.tick() == 1  # 99 s since the last copy
    statuses["inf"] = {"role": "inference", "state": "waiting_for_model", "time": 3.0}
    now[0] += 29.0
    assert d.tick() == 0
    now[0] += 1.0
    assert d.tick() == 1
    # it holds the deployment: nothing more
    statuses["inf"] = {"role": "inference", "state": "serving", "model_sha256": sha, "model_deployed_at": 1000.0}
    now[0] += 1000.0
    assert d.tick() == 0 and d.copies == {"inf": 6}
    # a new deployment goes at once
    _install(models, 2.0, "run-2", 100, 2000.0)
    assert d.tick() == 1 and _frames(lobby.client, "dfl/fed/node/inf/inbox")[-1].meta["run_id"] == "run-2"


def test_delivery_without_a_deployment_or_broker_sends_nothing(tmp_path):
    from dfl_agent.runtime.shared.config import config_from_dict

    cfg = config_from_dict({"federation": "fed", "state_dir": str(tmp_path), "data": STORE})
    lobby = _lobby({"inf": {"role": "inference", "state": "waiting_for_model"}})
    d = MemberDelivery(cfg, lobby)
    assert d.tick() == 0 and lobby.client.published == []
    _install(ModelStore(tmp_path), 1.0, "run-1", 3, 1000.0)
    lobby.connected = False  # the broker is away
    assert d.tick() == 0 and lobby.client.published == []
    lobby.connected = True
    assert d.tick() == 1


def test_the_member_and_the_supervisor_order_deployments_by_one_rule():
    """``deployment_order`` decides both what a member takes and what a supervisor sends it:
    a member shown to lack a deployment takes it, and one shown to hold a newer one neither
    gets it nor would take it."""
    from dfl_agent.onnx_model import deployment_order
    from dfl_agent.runtime.service.member_delivery import lacks

    assert deployment_order(200.0, "b", None, None) == "newer"  # the member holds nothing deployed
    assert deployment_order(200.0, "b", 100.0, "a") == "newer"
    assert deployment_order(100.0, "a", 200.0, "b") == "older"
    assert deployment_order(100.0, "a", 100.0, "b") == "older"  # a tie never flips the model held
    assert deployment_order(300.0, "a", 100.0, "a") == "held"  # the same bytes
    assert deployment_order(None, "b", 100.0, "a") == "older"
    for held_at, held_sha in ((None, None), (100.0, "a"), (300.0, "c"), (200.0, "b")):
        status = {"model_deployed_at": held_at, "model_sha256": held_sha}
        meta = {"deployed_at": 200.0, "sha256": "b"}
        assert lacks(status, meta) == (deployment_order(200.0, "b", held_at, held_sha) == "newer")
    assert [lacks({"model_deployed_at": h, "model_sha256": s}, {"deployed_at": 200.0, "sha256": "b"})
            for h, s in ((None, None), (100.0, "a"), (300.0, "c"), (200.0, "b"))] == [True, True, False, False]


def test_a_node_that_deploys_nothing_sends_the_runs_improved_model(tmp_path):
    """No deployment (no sample store): the run exports its model when it improved while an
    inference member is live (LiveExport), and the service sends that export to the members
    whose status shows another model; the run itself sends nothing."""
    import asyncio

    from dfl_agent.runtime.run.live_export import LiveExport
    from dfl_agent.runtime.shared.config import config_from_dict

    cfg = config_from_dict({"federation": "fed", "state_dir": str(tmp_path)})  # a data set: nothing deploys
    assert not cfg.deploys
    members = {"inf": SimpleNamespace(algorithm="inference"), "p": SimpleNamespace(algorithm="fedavg")}
    peers = SimpleNamespace(live_peers=lambda: sorted(members), get=members.get)
    exports = []

    async def compute(fn, model, shape, spec):  # export_onnx, in the node's compute thread
        exports.append(fn.__name__)
        return _onnx(float(len(exports)))

    spec = {"type": "mlp", "input_shape": [4], "hidden": [], "num_classes": 2}
    export = LiveExport(tmp_path, peers, lambda: SimpleNamespace(to=lambda dev: "model"), [4], spec,
                        "run-1", compute)
    statuses = {"inf": {"role": "inference", "state": "waiting_for_model"}}
    lobby = _lobby(statuses)
    d = MemberDelivery(cfg, lobby)
    assert d.tick() == 0  # nothing exported yet
    asyncio.run(export(1, {"local_accuracy": 0.5}))
    asyncio.run(export(2, {"local_accuracy": 0.4}))  # no better: not exported again
    assert exports == ["export_onnx"]
    assert d.tick() == 1
    [msg] = _frames(lobby.client, "dfl/fed/node/inf/inbox")
    assert msg.meta["deployed"] is False and msg.meta["round"] == 1 and msg.meta["run_id"] == "run-1"
    assert hashlib.sha256(msg.tensors["onnx"].tobytes()).hexdigest() == msg.meta["sha256"]
    statuses["inf"] = {"role": "inference", "state": "serving", "model_sha256": msg.meta["sha256"]}
    assert d.tick() == 0  # it holds it
    del members["inf"]
    asyncio.run(export(3, {"local_accuracy": 0.9}))  # better, but no member is live: no export
    assert exports == ["export_onnx"]
    members["inf"] = SimpleNamespace(algorithm="inference")
    asyncio.run(export(4, {"local_accuracy": 0.8}))  # a member again: the round-3 model goes
    assert exports == ["export_onnx", "export_onnx"] and d.tick() == 1
    assert _frames(lobby.client, "dfl/fed/node/inf/inbox")[-1].meta["round"] == 3
