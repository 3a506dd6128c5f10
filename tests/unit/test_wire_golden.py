"""Frames written by an earlier release's encoder (commit 75535c2, wire v5) still decode, their
signatures still verify, and today's encoder writes the same bytes from the same message, key
and send time.

The fixtures in ``tests/fixtures/compat/0.1.0/wire/`` were written by 75535c2's ``dfl_agent`` package: a signed
frame of three tensors (float32 and int64), the same split into 300-byte chunks, a signed
``q8+zstd`` compressed frame, and an unsigned frame; ``wire_v5_tensors.npz`` holds the tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.context import Message
from dfl_agent.learning.compression import CompressionPolicy
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64
from dfl_agent.transport import chunking, codec, wire

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "compat" / "0.1.0" / "wire"
T0 = 1764633600.25  # the send time the fixtures were written with
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


def _frame(name: str) -> bytes:
    return (FIX / name).read_bytes()


def _tensors() -> dict[str, np.ndarray]:
    with np.load(FIX / "wire_v5_tensors.npz") as z:
        return {k: z[k] for k in z.files}


def _guards() -> tuple[SecurityGuard, SecurityGuard]:
    trust = TrustStore("golden", {"node-a": public_key_b64(KEY)})
    sender = SecurityGuard("node-a", KEY, trust)
    receiver = SecurityGuard("node-b", Ed25519PrivateKey.generate(), trust, require_signatures=True,
                             clock=lambda: T0 + 1.0)
    return sender, receiver


def test_old_frames_decode_and_their_signatures_verify() -> None:
    want = _tensors()
    _, receiver = _guards()
    for name, rnd in (("wire_v5_signed.bin", 3), ("wire_v5_unsigned.bin", 5)):
        msg, header = wire.decode_with_header(_frame(name), federation="golden", recipient="node-b")
        assert (msg.kind, msg.round, msg.sender, msg.time) == ("model", rnd, "node-a", T0)
        assert set(msg.tensors) == set(want)
        for k, v in want.items():
            assert msg.tensors[k].dtype == v.dtype and np.array_equal(msg.tensors[k], v), k
        verdict = receiver.check(header, signed_bytes=getattr(header, "signed_bytes", None))
        assert verdict == (None if "unsigned" not in name else "unsigned"), (name, verdict)
    msg, header = wire.decode_with_header(_frame("wire_v5_signed_q8.bin"), federation="golden")
    assert receiver.check(header, signed_bytes=header.signed_bytes) is None
    for k in ("conv.weight", "conv.bias"):  # q8: within one quantisation step of the original
        step = np.abs(want[k]).max() / 127
        assert np.abs(msg.tensors[k] - want[k]).max() <= step, k
    # one changed payload byte: the hash check rejects the old frame as it rejects a new one
    bad = bytearray(_frame("wire_v5_signed.bin"))
    bad[-3] ^= 1
    with pytest.raises(wire.WireError, match="hash_mismatch"):
        wire.decode(bytes(bad), federation="golden")


def test_old_chunks_reassemble_and_new_chunks_are_the_same_bytes() -> None:
    raw = _frame("wire_v5_signed.chunks.bin")
    chunks, i = [], 0
    while i < len(raw):
        n = int.from_bytes(raw[i:i + 4], "big")
        chunks.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    r = chunking.Reassembler(hash_from=wire.payload_offset)
    frames = [f for f in (r.feed(c) for c in chunks) if f is not None]
    assert [bytes(f) for f in frames] == [_frame("wire_v5_signed.bin")]
    assert chunking.split(_frame("wire_v5_signed.bin"), 300, transfer_id=bytes(16)) == chunks


def test_todays_encoder_writes_the_old_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire.time, "time", lambda: T0)
    sender, _ = _guards()
    tensors = _tensors()
    m = Message("model", 3, dict(tensors), meta={"samples": 120}, msg_id="0" * 31 + "1")
    assert wire.encode(m, federation="golden", sender="node-a", sign=sender.sign) == _frame("wire_v5_signed.bin")
    spec = CompressionPolicy.from_config("q8+zstd").message_spec("model")
    wt, desc, _ = codec.encode_tensors({k: v for k, v in tensors.items() if v.dtype == np.float32}, spec,
                                       np.random.default_rng(0))
    mc = Message("model", 4, wt, meta={"samples": 120}, msg_id="0" * 31 + "2", encoding=desc)
    assert wire.encode(mc, federation="golden", sender="node-a", sign=sender.sign) == _frame("wire_v5_signed_q8.bin")
    mu = Message("model", 5, dict(tensors), meta={"samples": 1}, msg_id="0" * 31 + "3")
    assert wire.encode(mu, federation="golden", sender="node-a") == _frame("wire_v5_unsigned.bin")
