"""Release 0.1.0's frames, read by this release (kept forever: the previous release's golden fixtures).

``tests/fixtures/compat/0.1.0/wire/`` was written by release 0.1.0's own code (commit ``75535c2``,
tag ``v0.1.0``; ``tests/fixtures/compat/0.1.0/generate.py``): the first frame of every message kind of
every algorithm 0.1.0 registered, run in its simulator by three nodes that sign every frame and carry
their device certificates, with no compression, with ``q4+zstd`` (CHOCO-coded differences) and with
``topk:0.3+q8`` (error feedback).  This release must decode every one of them, verify its signature
through the certificate it carries (signatures required), and find the kind, sender, round, metadata
and tensors that 0.1.0 wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
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
