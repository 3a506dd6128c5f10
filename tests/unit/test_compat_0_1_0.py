"""Release 0.1.0's frames, messages and state folder, read by this release (kept forever: the
previous release's golden fixtures).

``tests/fixtures/compat/0.1.0/wire/`` was written by release 0.1.0's own code (commit ``75535c2``,
tag ``v0.1.0``; ``tests/fixtures/compat/0.1.0/generate.py``): the first frame of every message kind of
every algorithm 0.1.0 registered, run in its simulator by three nodes that sign every frame and carry
their device certificates, with no compression, with ``q4+zstd`` (CHOCO-coded differences) and with
``topk:0.3+q8`` (error feedback).  This release must decode every one of them, verify its signature
through the certificate it carries (signatures required), and find the kind, sender, round, metadata
and tensors that 0.1.0 wrote.

``live/`` is every message two always-on agents of 0.1.0 and an operator of 0.1.0 put on the
broker (signatures required, the default compression, 1 KiB chunks): statuses, presence (signed,
and a last will), run descriptors and a cancel record, the round's frames in chunks, and a
deployed ONNX model framed for an inference member.  This release's lobby takes the statuses, runs
and cancel as its own receiving code does, its security guard verifies every signed message
through the federation key, and every chunked frame reassembles, decodes and verifies.

``state/`` is the first agent's state folder as 0.1.0 left it after those runs (and the privacy
ledger 0.1.0 wrote, ``privacy/``); this release's start migrates it to schema 2 with a backup and
keeps the node's id, key, certificate, deployed model, run history, samples and spool.
"""

from __future__ import annotations

import base64
import json
import shutil
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.transport import versions, wire

COMPAT = Path(__file__).resolve().parents[1] / "fixtures" / "compat" / "0.1.0"


def _frames() -> tuple[dict[str, Any], list[tuple[dict[str, Any], bytes]]]:
    doc = json.loads((COMPAT / "wire" / "frames.json").read_text())
    blob = (COMPAT / "wire" / "frames.bin").read_bytes()
    out, i = [], 0
    while i < len(blob):
        n = int.from_bytes(blob[i:i + 4], "big")
        out.append(blob[i + 4:i + 4 + n])
        i += 4 + n
    assert len(out) == len(doc["frames"])
    return doc, [(entry, frame) for entry, frame in zip(doc["frames"], out, strict=True)]


def _receiver(doc: dict[str, Any], now: float) -> SecurityGuard:
    """A receiver of this release that knows only the federation key: every frame must carry a
    certificate that the federation key signed, and a valid signature by the certificate's key."""
    trust = TrustStore(doc["federation"], {}, federation_key=doc["federation_key"])
    return SecurityGuard("observer", None, trust, require_signatures=True, clock=lambda: now)


def test_the_fixtures_cover_every_kind_algorithm_and_compression_of_0_1_0() -> None:
    doc, frames = _frames()
    assert doc["release"] == "0.1.0" and doc["commit"] == "75535c2"
    algorithms = {e["case"].split("/")[0] for e, _ in frames}
    # 0.1.0's registered algorithms (agent/algorithms at 75535c2)
    assert algorithms == {"cfa", "combo", "dechetero", "dechw", "defkt", "dfedavg", "dfedprox", "dfml", "fedavg",
                          "fedd2s", "fedper", "fedrolex", "fullavg", "gt", "heterofl", "local-steps"}
    assert {e["case"].split("/")[1] for e, _ in frames} == {"none", "q4+zstd", "topk"}
    kinds = {e["kind"] for e, _ in frames}
    for fam in ("dfedavg", "dfedprox", "dfml", "fedd2s", "fedper", "fedrolex", "heterofl"):  # the rotating family
        assert {f"{fam}.{k}" for k in ("invite", "model", "update", "done", "decline")} <= kinds
    assert {"model", "combo.seg1", "combo.seg2", "combo.done", "defkt.model", "defkt.done", "fullavg.model",
            "fullavg.done", "gt.sync", "gt.vote"} <= kinds
    assert all(e["signed"] and e["certificate"] and e["version"] == 5 for e, _ in frames)
    assert sum(e["codec"] for e, _ in frames) >= 40  # compressed frames, of both coders
    # the averaging gossip's CHOCO-coded frames: a keyframe and a difference
    assert len({e["meta"]["choco"][1] for e, _ in frames if isinstance(e["meta"].get("choco"), list)}) == 2
    # what 0.1.0 wrote is what this release still reads
    assert 5 in versions.SPOKEN


@pytest.mark.parametrize("case", ["none", "q4+zstd", "topk"])
def test_every_frame_of_0_1_0_decodes_and_verifies(case: str) -> None:
    doc, frames = _frames()
    n = 0
    for entry, frame in frames:
        if entry["case"].split("/")[1] != case:
            continue
        n += 1
        what = f"{entry['case']} {entry['kind']}"
        to = entry["recipient"] if entry["recipient"] != "*" else "node02"
        msg, header = wire.decode_with_header(frame, federation=doc["federation"], recipient=to)
        assert (msg.kind, msg.sender, msg.round, msg.time) == (entry["kind"], entry["sender"], entry["round"],
                                                               entry["time"]), what
        assert msg.recipient in (entry["recipient"], None) or entry["recipient"] == "*", what
        assert json.loads(json.dumps(msg.meta)) == entry["meta"], what
        assert sorted(msg.tensors) == entry["tensors"] or entry["codec"], what
        for name, t in msg.tensors.items():
            assert isinstance(t, np.ndarray) and (t.dtype.kind not in "fc" or np.isfinite(t).all()), (what, name)
        if entry["codec"]:  # decoded back to the tensors 0.1.0 compressed
            assert msg.tensors and all(t.dtype == np.float32 for t in msg.tensors.values()), what
        guard = _receiver(doc, entry["time"] + 1.0)
        assert guard.check(header, signed_bytes=getattr(header, "signed_bytes", None)) is None, what
    assert n >= 40


def test_a_changed_frame_of_0_1_0_is_refused() -> None:
    """The evidence that the check above checks: one changed signature byte, or one changed
    payload byte, and the same frame no longer passes."""
    doc, frames = _frames()
    entry, frame = next((e, f) for e, f in frames if e["codec"] and e["kind"] == "model")
    to = entry["recipient"] if entry["recipient"] != "*" else "node02"
    _, h = wire.decode_with_header(frame, federation=doc["federation"], recipient=to)
    assert _receiver(doc, entry["time"] + 1.0).check(h, signed_bytes=getattr(h, "signed_bytes", None)) is None
    other = dict(doc, federation_key=doc["keys"]["node00"])  # certificates not signed by this federation key
    assert _receiver(other, entry["time"] + 1.0).check(h, signed_bytes=getattr(h, "signed_bytes", None)) is not None
    bad = bytearray(frame)
    bad[-3] ^= 1
    with pytest.raises(wire.WireError, match="hash_mismatch"):
        wire.decode(bytes(bad), federation=doc["federation"], recipient=to)


# -- live: the messages of a federation of 0.1.0 ------------------------------------------------
def _live() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    trust = json.loads((COMPAT / "live" / "trust.json").read_text())
    with open(COMPAT / "live" / "messages.jsonl") as f:
        return trust, [json.loads(line) for line in f]


def _payload(m: dict[str, Any]) -> bytes:
    return m["json"].encode() if "json" in m else base64.b64decode(m["base64"])


def test_the_messages_of_a_0_1_0_federation_are_taken_by_this_releases_lobby(monkeypatch: pytest.MonkeyPatch) -> None:
    """Statuses, run descriptors and the cancel record, through :class:`RunLobby`'s own handler
    (a device ``c`` of this release that knows only the federation key, signatures required).
    The lobby's clock is each message's own time: the runs' ``not_after`` passed a day after the
    fixtures were written, and on that day an agent rightly refuses them as ``expired``."""
    from dfl_agent.runtime.service import lobby as lobby_module
    from dfl_agent.runtime.service.lobby import RunLobby
    from dfl_agent.runtime.shared.config import config_from_dict
    from dfl_agent.runtime.shared.descriptor import RunVerifier

    trust, messages = _live()
    fed = trust["federation"]
    now = [0.0]
    monkeypatch.setattr(lobby_module, "time", SimpleNamespace(time=lambda: now[0]))
    guard = SecurityGuard("c", None, TrustStore(fed, {}, federation_key=trust["federation_key"]),
                          require_signatures=True, clock=lambda: now[0])
    cfg = config_from_dict({"federation": fed, "node_id": "c", "mqtt": {"broker": "127.0.0.1:1"},
                            "security": {"require_signatures": True, "federation_key": trust["federation_key"]}})
    lobby = RunLobby(cfg, "c", RunVerifier(fed, require_signatures=True, guard=guard), guard=guard)
    seen: dict[str, dict[str, Any]] = {}
    for m in messages:
        now[0] = m["time"]
        parts = m["topic"].split("/")
        if parts[2] == "run" or parts[-1] == "status":
            lobby._handle_message(SimpleNamespace(topic=m["topic"], payload=_payload(m), retain=m["retain"]))
            if parts[-1] == "status" and parts[3] in lobby.statuses:
                seen[parts[3]] = lobby.statuses[parts[3]]
    assert lobby.dropped == {} and lobby.verifier.refused == {}
    assert {d.run_id for d in lobby.queue.ordered()} >= {"r-compat-1", "r-compat-2"}
    assert lobby.is_cancelled("r-compat-2") and not lobby.is_cancelled("r-compat-1")
    for node in ("a", "b"):  # each peer's statuses taken, the last one saying how both runs ended
        assert seen[node]["run_history"]["r-compat-1"]["state"] == "finished", seen[node]
        assert seen[node]["run_history"]["r-compat-2"]["state"] == "cancelled", seen[node]


def test_every_signed_message_and_chunked_frame_of_0_1_0_verifies() -> None:
    from dfl_agent.transport import chunking

    trust, messages = _live()
    fed = trust["federation"]
    now = [0.0]
    guard = SecurityGuard("c", None, TrustStore(fed, {}, federation_key=trust["federation_key"]),
                          require_signatures=True, clock=lambda: now[0])
    kinds: dict[str, int] = {}
    wills = 0
    assemblers: dict[str, chunking.Reassembler] = {}
    frames: list[tuple[dict[str, Any], bytes]] = []
    for m in messages:
        now[0] = m["time"]
        parts = m["topic"].split("/")
        if "json" in m:
            doc = json.loads(m["json"])
            if parts[-1] == "model" or not doc or (parts[-1] == "presence" and "ctl" not in doc):
                wills += parts[-1] == "presence" and doc.get("state") == "offline"
                continue  # the deployment announcement (its own signature) and the unsigned last will
            kind = doc["kind"] if isinstance(doc.get("kind"), str) else parts[-1]
            sender, role, payload = guard.verify_control(_payload(m), kind)
            assert sender == doc["sender"] and role in ("device", "operator") and isinstance(payload, dict), m
            kinds[kind.split(":")[0]] = kinds.get(kind.split(":")[0], 0) + 1
        else:
            r = assemblers.setdefault(m["topic"], chunking.Reassembler(hash_from=wire.payload_offset))
            whole = r.feed(_payload(m))
            if whole is not None:
                frames.append((m, bytes(whole)))
    assert kinds.keys() >= {"status", "presence", "run"} and wills >= 1, kinds
    assert len(frames) >= 6  # the rounds' models of both nodes
    for m, frame in frames:
        recipient = m["topic"].split("/")[3] if m["topic"].endswith("/inbox") else "c"
        msg, header = wire.decode_with_header(frame, federation=fed, recipient=recipient)
        assert msg.kind == "model" and msg.tensors, msg.kind
        assert guard.check(header, signed_bytes=getattr(header, "signed_bytes", None)) is None, (m["topic"], msg.round)
    # the deployed model, framed for an inference member as 0.1.0 sends it, and its chunks
    frame = (COMPAT / "live" / "onnx_model.bin").read_bytes()
    msg, header = wire.decode_with_header(frame, federation=fed, recipient="infer")
    assert msg.kind == "onnx.model" and msg.meta["run_id"] == "r-compat-1" and msg.tensors["onnx"].size > 1000
    now[0] = msg.time + 1.0
    assert guard.check(header, signed_bytes=getattr(header, "signed_bytes", None)) is None
    raw, r, got = (COMPAT / "live" / "onnx_model.chunks.bin").read_bytes(), chunking.Reassembler(), None
    i = 0
    while i < len(raw):
        n = int.from_bytes(raw[i:i + 4], "big")
        got = r.feed(raw[i + 4:i + 4 + n]) or got
        i += 4 + n
    assert got is not None and bytes(got) == frame


# -- state: the state folder 0.1.0 left ---------------------------------------------------------
def test_0_1_0s_state_folder_is_migrated_by_this_releases_start_with_nothing_lost(tmp_path: Path) -> None:
    """The agent's start as ``dfl-agent run`` does it (:func:`build_run_manager`: the migration,
    then the run ledger and every state file's check), on a copy of 0.1.0's state folder."""
    from dfl_agent.deploy import ModelStore
    from dfl_agent.runtime.service import ledger as run_ledger
    from dfl_agent.runtime.service.run_manager import build_run_manager
    from dfl_agent.runtime.shared import state_version as sv
    from dfl_agent.runtime.shared.config import load_config
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger
    from tests.unit.test_state_version import read_cancelled

    state = tmp_path / "state"
    shutil.copytree(COMPAT / "state", state, symlinks=True)
    before = {p.relative_to(state).as_posix(): p.read_bytes() for p in state.rglob("*") if p.is_file()}
    toml = (COMPAT / "live" / "a.toml").read_text().replace("STATE_DIR", str(state))
    (tmp_path / "a.toml").write_text(toml)
    cfg = load_config(str(tmp_path / "a.toml"))
    assert sv.read_state_version(state)[0] == 1
    manager = build_run_manager(cfg, str(tmp_path / "a.toml"))
    try:
        doc = json.loads((state / sv.STATE_FILE).read_text())
        assert doc["schema"] == sv.STATE_VERSION == 2 and [(m["from"], m["to"]) for m in doc["migrations"]] == [(1, 2)]
        did = doc["migrations"][0]["did"]
        assert "privacy ledger chained (5 rows)" in did and "run ledger moved to SQLite (2 runs, 1 cancel" in did
        backup = state / doc["migrations"][0]["backup"]
        for rel in ("runs/ledger.json", "runs/cancelled.json"):  # what the migration rewrote, as it was
            assert (backup / rel).read_bytes() == before[rel], rel
        con = sqlite3.connect(f"file:{backup / 'privacy' / 'ledger.sqlite'}?mode=ro", uri=True)
        try:  # the unchained ledger, kept as 0.1.0 left it
            assert con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 5
        finally:
            con.close()
        # the same node: id, key, certificate
        assert manager.node_id == "a" and manager.lobby.guard.certificate == json.loads(before["node_cert.json"])
        assert (state / "node_key.pem").read_bytes() == before["node_key.pem"]
        # its run history: one finished run, one cancelled
        assert {r: e["state"] for r, e in run_ledger.read_entries(state).items()} == {
            "r-compat-1": "finished", "r-compat-2": "cancelled"}
        assert "r-compat-2" in read_cancelled(state)
        # its deployed model, its samples, the spool file that arrived while it was stopped
        assert ModelStore(state).current_version() == 1
        assert (state / "models" / "v1" / "model.onnx").read_bytes() == before["models/v1/model.onnx"]
        assert manager.store is not None and manager.store.count() == 210
        assert (state / "spool" / "w3.npz").read_bytes() == before["spool/w3.npz"]
        assert PrivacyLedger(state).state().migrated == 0  # chained: nothing left to migrate
    finally:
        manager.ledger.close()
        if manager.store is not None:
            manager.store.close()
    # started again: nothing more to migrate
    assert sv.open_state(state).migrated == []
