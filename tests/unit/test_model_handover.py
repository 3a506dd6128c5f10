"""The hand-over of a run's deployed model to a member that missed the run's end: the member
asked answers a request in a peer's status once per nonce, with its version's files (signed,
hashes checked) or why it has none; the requester takes only an answer to its request, from an
enrolled device, with the files' hashes and sizes right and a model of its own spec, and asks
the members that deployed the run first."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.context import Message
from dfl_agent.deploy.versions import ModelStore
from dfl_agent.runtime.run.adoption import candidates
from dfl_agent.runtime.service.model_handover import MIN_INTERVAL_S, ModelHandover
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.model_handover import MODEL_FILES_KIND, check_files
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64
from dfl_agent.transport import wire
from dfl_agent.transport.chunking import Reassembler

STORE = {"dataset": "store", "input_shape": [4], "num_classes": 2}
FILES = {"model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(200)),
         "spec.json": json.dumps({"spec": {"type": "mlp"}}).encode()}


class _Client:
    def __init__(self):
        self.published: list[tuple[str, bytes]] = []

    def publish(self, topic, payload, qos=0):
        self.published.append((topic, payload))


def _guards():
    kt, kp = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pinned = {"t": public_key_b64(kt), "p2": public_key_b64(kp)}
    return (SecurityGuard("t", kt, TrustStore("fed", pinned), require_signatures=True),
            SecurityGuard("p2", kp, TrustStore("fed", pinned), require_signatures=True))


def _lobby(statuses, guard, ledger=None):
    lobby = SimpleNamespace(lock=threading.Lock(), statuses=statuses, client=_Client(), guard=guard, node_id="t",
                            ledger=ledger)
    lobby.up = lambda: True
    return lobby


def _answers(client, to="p2"):
    asm, out = Reassembler(), []
    for t, payload in client.published:
        if t == f"dfl/fed/node/{to}/inbox":
            frame = asm.feed(payload)
            if frame is not None:
                out.append(wire.decode_with_header(bytes(frame), federation="fed", recipient=to))
    return out


def _want(run_id="r1", nonce="n1", frm="t", age=0.0):
    return {"state": "adopting", "time": time.time() - age,
            "model_wanted": {"run_id": run_id, "from": frm, "nonce": nonce, "round": 3}}


def test_the_member_asked_answers_once_per_nonce_with_its_versions_files_signed(tmp_path):
    cfg = config_from_dict({"federation": "fed", "state_dir": str(tmp_path), "mqtt": {"chunk_size": 1024},
                            "data": STORE})
    v = ModelStore(tmp_path).install(FILES, {"run_id": "r1", "round": 3, "algorithm": "fedavg"})
    mine, theirs = _guards()
    statuses = {"p2": _want(), "p3": _want(frm="other"), "p4": _want(age=600.0),
                "p5": {**_want(), "state": "stopped"}}
    lobby, now = _lobby(statuses, mine), [100.0]
    h = ModelHandover(cfg, lobby, clock=lambda: now[0])
    h.chunk_size = 100  # the answer travels in chunks
    assert h.tick() == 1 and h.answers == {"files": 1, "missing": 0}
    [(msg, header)] = _answers(lobby.client)
    assert {t for t, _ in lobby.client.published} == {"dfl/fed/node/p2/inbox"}  # p3, p4, p5 get nothing
    assert msg.kind == MODEL_FILES_KIND and msg.sender == "t" and msg.round == 3
    assert theirs.check(header, signed_bytes=getattr(header, "signed_bytes", None)) is None  # signed by t
    assert msg.meta["version"] == v and msg.meta["sha256"] == ModelStore(tmp_path).manifest(v)["sha256"]
    files, why = check_files(msg, "r1", "n1", 1 << 20)
    assert why == "" and files == FILES
    assert h.tick() == 0  # the same request: answered once
    statuses["p2"] = _want(nonce="n2")
    assert h.tick() == 0  # a new one within MIN_INTERVAL_S: not yet
    now[0] += MIN_INTERVAL_S
    assert h.tick() == 1 and len(_answers(lobby.client)) == 2
    # a run it holds no version of: why, in one line
    statuses["p2"] = _want(run_id="r9", nonce="n3")
    now[0] += MIN_INTERVAL_S
    assert h.tick() == 1
    msg = _answers(lobby.client)[-1][0]
    assert not msg.tensors and msg.meta == {"run_id": "r9", "nonce": "n3", "missing": "it has no record of the run"}
    assert check_files(msg, "r9", "n3", 1 << 20) == (None, "")


@pytest.mark.parametrize("setup, why", [
    ({"deploy": {"enabled": False}}, "deployment is off on this device (deploy.enabled = false)"),
    ({"candidate": True}, "its deploy gate kept the model it had (worse)"),
    ({"ledger": {"state": "failed"}}, "the run is failed there"),
    ({"ledger": {"state": "finished"}}, "no version of the run is kept there (deploy.keep)"),
])
def test_a_member_without_the_runs_model_says_why(tmp_path, setup, why):
    cfg = config_from_dict({"federation": "fed", "state_dir": str(tmp_path), "data": STORE,
                            **({"deploy": setup["deploy"]} if "deploy" in setup else {})})
    if setup.get("candidate"):
        ModelStore(tmp_path).stage_candidate(FILES, {"run_id": "r1", "note": "worse"})
    ledger = SimpleNamespace(entries={"r1": setup["ledger"]}) if "ledger" in setup else None
    h = ModelHandover(cfg, _lobby({}, None, ledger))
    assert h.why_none("r1") == why


def _answer(files=FILES, **meta) -> Message:
    msg = Message(MODEL_FILES_KIND, 3, {"safetensors": np.frombuffer(files["model.safetensors"], np.uint8),
                                        "spec": np.frombuffer(files["spec.json"], np.uint8)},
                  {"run_id": "r1", "nonce": "n1", "version": 1,
                   "files": {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}, **meta})
    return msg


def test_an_answer_is_taken_only_for_the_request_with_the_right_files():
    assert check_files(_answer(), "r1", "n1", 1 << 20) == (FILES, "")
    assert check_files(_answer(run_id="r2"), "r1", "n1", 1 << 20)[1].startswith("wrong_run")
    assert check_files(_answer(nonce="old"), "r1", "n1", 1 << 20)[1].startswith("stale")
    assert check_files(_answer(), "r1", "n1", 100)[1].startswith("too_large: model.safetensors")
    bad = _answer()
    bad.meta["files"]["model.safetensors"] = "0" * 64
    assert check_files(bad, "r1", "n1", 1 << 20)[1].startswith("bad_hash")
    extra = _answer()
    extra.tensors["more"] = np.zeros(3, np.uint8)
    assert check_files(extra, "r1", "n1", 1 << 20)[1].startswith("malformed")
    floats = _answer()
    floats.tensors["spec"] = np.zeros(3, np.float32)
    assert check_files(floats, "r1", "n1", 1 << 20)[1].startswith("malformed")


def test_the_members_that_deployed_the_run_are_asked_first_and_stale_ones_not_at_all():
    now = 1000.0
    statuses = {"a": {"state": "finished", "time": now, "model": None},
                "b": {"state": "finished", "time": now, "model": "deployed"},
                "c": {"state": "finished", "time": now - 500, "model": "deployed"},
                "d": {"state": "finished", "time": now, "model": "kept"},
                "e": {"state": "running", "time": now},
                "f": {"state": "finished", "time": now, "model": "adopted"}}
    asked, left = candidates(statuses, {"a", "b", "c", "d", "e", "f", "g"}, "r1", max_age=90.0, now=now)
    assert asked == ["b", "f", "a"]
    assert set(left) == {"c", "d"} and "500 s old" in left["c"] and "kept" in left["d"]


def test_an_adopted_model_must_be_a_model_of_the_nodes_spec():
    pytest.importorskip("torch")
    import copy

    from safetensors.numpy import save

    from dfl_agent.models import build_model
    from dfl_agent.runtime.run.adoption import load_adopted

    spec = {"type": "mlp", "input_shape": [4], "hidden": [8], "num_classes": 2}
    theirs = build_model(spec)
    weights = {k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()}
    files = {"model.safetensors": save(weights), "spec.json": json.dumps({"spec": spec}).encode()}
    mine = build_model(spec)
    got, why = load_adopted(files, copy.deepcopy(mine), spec)
    assert why == "" and all(np.array_equal(got.state_dict()[k].numpy(), w) for k, w in weights.items())
    other = {**spec, "hidden": [9]}
    assert load_adopted({**files, "spec.json": json.dumps({"spec": other}).encode()}, copy.deepcopy(mine),
                        spec)[1].startswith("wrong_model: another model spec")
    first = next(iter(weights))
    renamed = {("x" + k if k == first else k): v for k, v in weights.items()}
    assert load_adopted({**files, "model.safetensors": save(renamed)}, copy.deepcopy(mine), spec)[1].startswith(
        "wrong_model: other tensors")
    nan = {k: (np.full_like(v, np.nan) if k == first else v) for k, v in weights.items()}
    assert "NaN" in load_adopted({**files, "model.safetensors": save(nan)}, copy.deepcopy(mine), spec)[1]
    assert load_adopted({**files, "model.safetensors": b"not safetensors"}, copy.deepcopy(mine),
                        spec)[1].startswith("malformed")
