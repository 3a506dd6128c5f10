"""Keys, certificates, trust store, signed envelopes and replay protection."""

import os
import stat

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.context import Message
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict
from dfl_agent.security import SecurityError, SecurityGuard, TrustStore
from dfl_agent.security.keys import (
    canonical,
    issue_certificate,
    load_or_create_key,
    public_key_b64,
    verify_certificate,
)
from dfl_agent.transport import wire

FED = "fedsec"


def _signed_body(header):
    """The bytes a signature covers: canonical JSON of ``header`` without ``sig``."""
    return canonical({k: v for k, v in header.items() if k != "sig"})


def _msg(rnd=1, kind="model"):
    return Message(kind, rnd, {"w": np.arange(4, dtype=np.float32)}, meta={"samples": 3})


def _guard(node_id, key, trust, **kw):
    return SecurityGuard(node_id, key, trust, **kw)


def _signed(guard, rnd=1, kind="model", cert=None, msg=None):
    m = msg or _msg(rnd, kind)
    return wire.encode(m, federation=FED, sender=guard.node_id, sign=guard.sign, cert=cert)


def _check(receiver, frame):
    """The guard's verdict on ``frame``, both ways: over the header's canonical form,
    and over the signed bytes as received (what the runtime does); they must agree."""
    wire.decode(frame, federation=FED)
    header = wire.raw_header(frame)
    state = receiver._seen.copy(), dict(receiver._rounds), receiver._floor
    plain = receiver.check(dict(header))
    receiver._seen, receiver._rounds, receiver._floor = state  # the same frame again, not a replay
    fast = receiver.check(header, signed_bytes=header.signed_bytes)
    assert plain == fast, (plain, fast)
    return fast


def test_key_created_once_with_0600(tmp_path):
    k1 = load_or_create_key(tmp_path)
    path = tmp_path / "node_key.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    k2 = load_or_create_key(tmp_path)
    assert public_key_b64(k1) == public_key_b64(k2)
    os.chmod(path, 0o644)
    load_or_create_key(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("garbage")
    with pytest.raises(SecurityError, match="cannot read private key"):
        load_or_create_key(tmp_path)


def test_certificate_roundtrip_and_tampering():
    fed_key, dev = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    cert = issue_certificate(fed_key, FED, "dev1", public_key_b64(dev))
    assert verify_certificate(cert, fed_key.public_key(), FED) == ("dev1", public_key_b64(dev))
    with pytest.raises(SecurityError, match="federation"):
        verify_certificate(cert, fed_key.public_key(), "other")
    forged = dict(cert, node_id="dev2")
    with pytest.raises(SecurityError, match="signature"):
        verify_certificate(forged, fed_key.public_key(), FED)
    with pytest.raises(SecurityError, match="signature"):
        verify_certificate(cert, Ed25519PrivateKey.generate().public_key(), FED)
    expired = issue_certificate(fed_key, FED, "dev1", public_key_b64(dev), valid_days=1, now=0.0)
    with pytest.raises(SecurityError, match="expired"):
        verify_certificate(expired, fed_key.public_key(), FED)


def test_signed_envelope_accepted_once_then_replay():
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    trust = TrustStore(FED, {"a": public_key_b64(ka), "b": public_key_b64(kb)})
    a = _guard("a", ka, trust)
    b = _guard("b", kb, trust, require_signatures=True)
    frame = _signed(a)
    assert _check(b, frame) is None
    assert _check(b, frame) == "replay"


def _reframe(header: dict, payload: bytes) -> bytes:
    """A frame with ``header`` as plain JSON (what a forger re-encoding by hand sends)."""
    import json
    import struct

    h = json.dumps(header).encode()
    return struct.pack(">3sBI", b"DFL", wire.WIRE_VERSION, len(h)) + h + payload


def test_rejection_reasons():
    ka, kb, kx = (Ed25519PrivateKey.generate() for _ in range(3))
    trust = TrustStore(FED, {"a": public_key_b64(ka), "b": public_key_b64(kb)})
    b = _guard("b", kb, trust, require_signatures=True)
    unsigned = wire.encode(_msg(), federation=FED, sender="a")
    assert _check(b, unsigned) == "unsigned"
    stranger = _guard("x", kx, TrustStore(FED, {}))
    assert _check(b, _signed(stranger)) == "unknown_sender"
    # a key that is not a's signs as "a"
    impostor = _guard("a", kx, TrustStore(FED, {}))
    assert _check(b, _signed(impostor)) == "bad_signature"
    # tampered header: change the round after signing (re-encode header by hand)
    good = _signed(_guard("a", ka, trust))
    header, payload = wire.split_frame(good)
    assert _check(b, _reframe(dict(header, round=2), payload)) == "bad_signature"
    assert _check(b, _reframe(dict(header, sig=header["sig"].replace("ed25519:", "ed25519:!")), payload)) \
        == "bad_signature"
    with pytest.raises(wire.WireError):  # bytes cut out of the (compressed) header: malformed before the guard
        _check(b, good[:20] + good[30:])
    # not required: unsigned and unknown pass, bad signatures of known senders still fail
    lax = _guard("b", kb, trust)
    assert _check(lax, unsigned) is None
    assert _check(lax, _signed(stranger)) is None
    assert _check(lax, _signed(impostor)) == "bad_signature"


def test_time_window_and_monotonic_rounds():
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    trust = TrustStore(FED, {"a": public_key_b64(ka)})
    now = [1000.0]
    a = _guard("a", ka, trust)
    b = _guard("b", kb, trust, require_signatures=True, replay_window=60, clock=lambda: now[0])

    def at(t, rnd, kind="model"):
        m = _msg(rnd, kind)
        frame = _signed(a, msg=m)
        # re-sign with a chosen send time
        header = wire.raw_header(frame)
        header["time"] = t
        header["sig"] = a.sign(_signed_body(header))
        return header

    assert b.check(at(1000.0, 5)) is None
    assert b.check(at(900.0, 6)) == "replay"  # outside the window
    assert b.check(at(999.0, 4)) == "replay"  # lower round, sent earlier
    assert b.check(at(999.0, 4, kind="other")) is None  # rounds are per kind
    assert b.check(at(1001.0, 1)) is None  # restarted sender: lower round, later time
    assert b.check(at(1002.0, 2)) is None


def test_seen_ids_are_bounded():
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    trust = TrustStore(FED, {"a": public_key_b64(ka)})
    a = _guard("a", ka, trust)
    b = _guard("b", kb, trust, max_seen=8)
    first = _signed(a, rnd=0)
    assert _check(b, first) is None
    for r in range(1, 20):
        assert _check(b, _signed(a, rnd=r)) is None
    assert len(b._seen) <= 8
    assert _check(b, first) == "replay"  # forgotten id, but older than the floor


def test_certificate_in_envelope_makes_a_member():
    fed_key, ka, kb = (Ed25519PrivateKey.generate() for _ in range(3))
    cert = issue_certificate(fed_key, FED, "a", public_key_b64(ka))
    fed_pub = public_key_b64(fed_key)
    trust_b = TrustStore(FED, {}, federation_key=fed_pub)
    b = _guard("b", kb, trust_b, require_signatures=True)
    assert not b.is_member("a")
    a = _guard("a", ka, TrustStore(FED, {}), certificate=cert)
    assert _check(b, _signed(a, cert=cert)) is None
    assert b.is_member("a")
    # a certificate for "a" does not let "c" in
    c = _guard("c", ka, TrustStore(FED, {}))
    assert _check(b, _signed(c, cert=cert)) == "unknown_sender"
    # presence hint with a forged certificate is ignored
    assert not b.learn("d", dict(cert, node_id="d"))
    assert not b.is_member("d")


def test_pinned_key_wins_over_certificate():
    fed_key, ka, kx = (Ed25519PrivateKey.generate() for _ in range(3))
    trust = TrustStore(FED, {"a": public_key_b64(ka)}, federation_key=public_key_b64(fed_key))
    with pytest.raises(SecurityError, match="pinned"):
        trust.add_certificate(issue_certificate(fed_key, FED, "a", public_key_b64(kx)))
    assert trust.trusted()["a"] == public_key_b64(ka)


def test_security_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="^security.require_signatures"):
        config_from_dict({"security": {"require_signatures": True}})
    with pytest.raises(ConfigError, match="^security.trusted_keys.a"):
        config_from_dict({"security": {"trusted_keys": {"a": "nope"}}})
    with pytest.raises(ConfigError, match="^security.federation_key"):
        config_from_dict({"security": {"federation_key": "AAAA"}})
    with pytest.raises(ConfigError, match="^security.replay_window"):
        config_from_dict({"security": {"replay_window": 0}})
    with pytest.raises(ConfigError, match="^mqtt.tls_ca"):
        config_from_dict({"mqtt": {"tls_ca": str(tmp_path / "missing.pem")}})
    with pytest.raises(ConfigError, match="^security.bogus"):
        config_from_dict({"security": {"bogus": 1}})
    k = public_key_b64(Ed25519PrivateKey.generate())
    cfg = config_from_dict({"security": {"require_signatures": True, "trusted_keys": {"a": k}}})
    assert cfg.security.trusted_keys == {"a": k}


def test_dflctl_keys(tmp_path, capsys):
    from dfl_agent.cli.dflctl import main

    fed_dir, state = tmp_path / "fed", tmp_path / "dev1"
    assert main(["keys", "federation-init", "--dir", str(fed_dir)]) == 0
    assert stat.S_IMODE((fed_dir / "federation_key.pem").stat().st_mode) == 0o600
    assert main(["keys", "federation-init", "--dir", str(fed_dir)]) == 2  # no silent overwrite
    assert main(["keys", "enroll", "dev1", "--federation", FED, "--dir", str(fed_dir), "--state-dir", str(state)]) == 0
    assert (state / "node_key.pem").exists() and (state / "node_cert.json").exists()
    passwd = (fed_dir / "mosquitto.passwd").read_text()
    assert passwd.startswith("dev1:")
    creds = (fed_dir / "credentials" / "dev1.toml").read_text()
    assert 'username = "dev1"' in creds and "federation_key" in creds
    cfg = config_from_dict(__import__("tomllib").loads(creds))  # the snippet is a valid configuration
    assert cfg.mqtt.username == "dev1" and cfg.security.require_signatures
    capsys.readouterr()
    assert main(["keys", "show", "--state-dir", str(state), "--dir", str(fed_dir)]) == 0
    assert "certificate: node dev1 federation fedsec: valid" in capsys.readouterr().out


def _memory_federation(n, intruder):
    """n fedavg nodes on the memory network, enrolled by a federation key, signatures
    required; optionally an intruder that is present (presence "online") and injects
    well-formed but unsigned or wrongly signed poisoned updates into n0's inbox."""
    import asyncio
    import types

    from dfl_agent.algorithms.base import get_algorithm, parse_options
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.learning.params import model_to_numpy
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.node.node import Node
    from dfl_agent.transport.memory import MemoryNetwork, run_virtual

    spec = {"type": "mlp", "input_shape": [4], "hidden": [8], "num_classes": 2}

    def data(seed, k=40):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(k, 4)).astype(np.float32)
        y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
        return types.SimpleNamespace(train_x=x[:32], train_y=y[:32], val_x=x[32:], val_y=y[32:], num_classes=2)

    fed_key = Ed25519PrivateKey.generate()
    net = MemoryNetwork(latency=0.01)
    cls = get_algorithm("fedavg")
    opts = parse_options(cls, {"round_timeout": 5.0})
    nodes = []
    for i in range(n):
        nid = f"n{i}"
        key = Ed25519PrivateKey.generate()
        cert = issue_certificate(fed_key, "f", nid, public_key_b64(key))
        guard = SecurityGuard(nid, key, TrustStore("f", {}, federation_key=public_key_b64(fed_key)),
                              require_signatures=True, certificate=cert)
        ctx = RuntimeContext(
            node_id=nid, federation="f", transport=net.transport(nid, "f", {"cert": cert}),
            peers=PeerTable(nid, "f"), data=data(i), model_spec=spec, train=TrainConfig(batch_size=8, lr=0.1),
            init_seed=0, rng=np.random.default_rng(i), security=guard,
        )
        nodes.append(Node(ctx, cls(ctx, opts), data(99).train_x, data(99).train_y))
    mallory = net.transport("mallory", "f", {}) if intruder else None
    impostor = SecurityGuard("n1", Ed25519PrivateKey.generate(), TrustStore("f"))

    async def attack():
        await mallory.start(lambda f, w: None, lambda n_, d: None)
        for t in range(1, 4):  # all before round 1 ends: they would be used first if accepted
            poison = {k: np.full_like(v, 1e3) for k, v in model_to_numpy(nodes[1].algorithm.model).items()}
            for sign in (None, impostor.sign):
                frame = wire.encode(Message("model", t, poison, meta={"samples": 1000}, recipient="n0"),
                                    federation="f", sender="n1", sign=sign)
                net.deliver_raw("n0", frame)

    async def main():
        for node in nodes:
            await node.ctx.start()
            await node.setup()
        tasks = [node.run(3) for node in nodes] + ([attack()] if intruder else [])
        await asyncio.gather(*tasks)

    run_virtual(main())
    return nodes


def test_intruder_changes_no_model_in_a_signed_memory_federation():
    import torch

    torch.manual_seed(0)
    clean = _memory_federation(3, intruder=False)
    torch.manual_seed(0)
    attacked = _memory_federation(3, intruder=True)
    n0 = attacked[0]
    assert n0.ctx.rejected["unsigned"] == 3 and n0.ctx.rejected["bad_signature"] == 3
    assert "mallory" not in n0.ctx.live_peers()  # present, but not a member: never waited for
    assert [r["neighbours"] for r in n0.history] == [2, 2, 2]
    for a, c in zip(attacked, clean):
        for (name, pa), pc in zip(a.algorithm.model.state_dict().items(), c.algorithm.model.state_dict().values()):
            assert torch.equal(pa, pc), name


def test_signature_verified_over_the_bytes_as_received(monkeypatch):
    """A signed frame's envelope is the signed canonical JSON with ``sig`` last: the
    receiver verifies those bytes without serialising the header again, and any change
    to them still fails."""
    import json
    import struct

    from dfl_agent.security import trust as trust_mod

    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    trust = TrustStore(FED, {"a": public_key_b64(ka)})
    a = _guard("a", ka, trust)
    b = _guard("b", kb, trust, require_signatures=True)
    wire_compress = wire.COMPRESS_HEADERS
    monkeypatch.setattr(wire, "COMPRESS_HEADERS", False)  # read and rewrite the envelope's bytes
    frame = _signed(a, rnd=7)
    frame2 = _signed(a, rnd=9)
    monkeypatch.setattr(wire, "COMPRESS_HEADERS", wire_compress)
    header = wire.raw_header(frame)
    assert header.signed_bytes == _signed_body(header)  # the canonical bytes, as received
    hlen = struct.unpack_from(">I", frame, 4)[0]
    raw = frame[8:8 + hlen].rstrip(b" ")
    assert raw == header.signed_bytes[:-1] + b',"sig":' + json.dumps(header["sig"]).encode() + b"}"

    def no_canonical(obj):
        raise AssertionError("the header was serialised again")

    monkeypatch.setattr(trust_mod, "canonical", no_canonical)
    assert b.check(header, signed_bytes=header.signed_bytes, remember_round=False) is None
    monkeypatch.undo()
    # one byte of the signed JSON changed, the form kept (round 7 -> 8): bad signature both ways
    forged = frame.replace(b'"round":7', b'"round":8')
    assert forged != frame
    assert _check(b, forged) == "bad_signature"
    # an unsigned envelope, or a signed one in another byte form, has no signed bytes
    assert wire.raw_header(wire.encode(_msg(), federation=FED, sender="a")).signed_bytes is None
    h2, payload = wire.split_frame(frame2)
    other = _reframe(dict(h2), payload)  # json.dumps with spaces: not the signed form
    assert wire.raw_header(other).signed_bytes is None
    assert _check(b, other) is None  # still verified, over the canonical form


def test_frames_prepared_off_the_loop_keep_every_rule():
    """The MQTT transport decodes and verifies frames on its network thread
    (RuntimeContext.prepare_frame) and hands the event loop a PreparedFrame: the same
    drops (counted by reason), replay and duplicate rules apply as for a raw frame."""
    import asyncio
    import threading

    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.runtime.node.context import PreparedFrame, RuntimeContext
    from dfl_agent.transport.memory import MemoryNetwork

    ka, kb, kx = (Ed25519PrivateKey.generate() for _ in range(3))
    trust = TrustStore(FED, {"a": public_key_b64(ka), "b": public_key_b64(kb)})
    a = _guard("a", ka, trust)
    net = MemoryNetwork()
    ctx = RuntimeContext(node_id="b", federation=FED, transport=net.transport("b", FED), peers=PeerTable("b", FED),
                         data=None, model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0),
                         security=_guard("b", kb, trust, require_signatures=True))

    def prepared(frame):
        out = []  # prepared on another thread, as the MQTT network thread does
        t = threading.Thread(target=lambda: out.append(ctx.prepare_frame(frame, len(frame))))
        t.start()
        t.join()
        assert isinstance(out[0], PreparedFrame)
        return out[0]

    async def main():
        ctx._started = True
        good = _signed(a, rnd=1)
        p = prepared(good)
        assert p.error is None and p.verdict == "verified" and p.seconds > 0
        ctx._on_frame(p, len(good))
        got = await ctx.receive("model", round=1, deadline=asyncio.get_running_loop().time() + 5)
        assert got is not None and got.sender == "a" and got.wire_bytes == len(good)
        assert ctx.timing["receive_s"] >= p.seconds
        ctx._on_frame(prepared(good), len(good))  # the same frame again
        header, payload = wire.split_frame(_signed(a, rnd=2))
        ctx._on_frame(prepared(_reframe(dict(header, round=3), payload)), 1)  # changed after signing
        ctx._on_frame(prepared(_signed(_guard("a", kx, TrustStore(FED, {})), rnd=4)), 1)  # impostor
        ctx._on_frame(prepared(wire.encode(_msg(5), federation=FED, sender="a")), 1)  # unsigned
        ctx._on_frame(prepared(b"DFL garbage"), 1)  # not a v3 frame
        ctx._on_frame(prepared(_signed(a, rnd=6)[:-1]), 1)  # truncated
        assert ctx.rejected["replay"] == 1
        assert ctx.rejected["bad_signature"] == 2
        assert ctx.rejected["unsigned"] == 1
        assert ctx.rejected["version"] == 1 and ctx.rejected["malformed"] == 1
        assert ctx._take("model", None, None) is None  # nothing else was buffered

    asyncio.run(main())


def test_libsodium_signatures_are_cryptographys_and_both_verify(monkeypatch):
    """The per-message signature engine (libsodium through PyNaCl) makes byte for byte the
    signature cryptography (OpenSSL) makes, each verifies the other's, and a changed byte,
    a changed key or a truncated signature fails - also through the guard."""
    from cryptography.exceptions import InvalidSignature

    from dfl_agent.security import keys

    assert keys._sodium is not None  # PyNaCl is a dependency: the fast engine is the one in use
    k, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    data = b'{"fed":"fedsec","round":7}'
    sig = keys.signer(k)(data)
    assert sig == k.sign(data)  # Ed25519 is deterministic: the same bytes
    k.public_key().verify(sig, data)  # OpenSSL accepts libsodium's signature
    verify = keys.verifier(k.public_key())
    verify(k.sign(data), data)  # and libsodium OpenSSL's
    for bad_sig, bad_data in ((sig, data.replace(b"7", b"8")), (sig[:63], data), (b"\0" * 64, data),
                              (other.sign(data), data)):
        with pytest.raises(InvalidSignature):
            verify(bad_sig, bad_data)
    trust = TrustStore(FED, {"a": public_key_b64(k), "o": public_key_b64(other)})
    a, b = _guard("a", k, trust), _guard("b", other, trust, require_signatures=True)
    monkeypatch.setattr(wire, "COMPRESS_HEADERS", False)  # to change one byte of the envelope
    frame = _signed(a, rnd=3)
    forged = frame.replace(b'"round":3', b'"round":4')
    assert forged != frame and _check(b, forged) == "bad_signature"
    assert _check(b, frame) is None
    env = a.sign_control("status", {"state": "idle"})
    assert b.verify_control(env, "status", "a")[0] == "a"
