"""Signed control envelopes: roles, sequence numbers across restarts, replay and forgery."""

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.security import ControlRejected, SecurityGuard, SeqCounter, TrustStore
from dfl_agent.security.keys import (
    SecurityError,
    certificate_role,
    issue_certificate,
    public_key_b64,
    verify_certificate,
)

FED = "f"


def _guard(nid, key, trust, **kw):
    return SecurityGuard(nid, key, trust, **kw)


def _pair(require=True, tmp_path=None):
    fed_key = Ed25519PrivateKey.generate()
    a_key, b_key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    fed_pub = public_key_b64(fed_key)
    a = _guard("a", a_key, TrustStore(FED, {"a": public_key_b64(a_key)}, fed_pub), require_signatures=require,
               certificate=issue_certificate(fed_key, FED, "a", public_key_b64(a_key)),
               seq=SeqCounter(tmp_path / "seq.json" if tmp_path else None))
    b = _guard("b", b_key, TrustStore(FED, {"b": public_key_b64(b_key)}, fed_pub), require_signatures=require)
    return fed_key, a, b


def test_certificate_v2_roles_and_v1_is_device():
    fed = Ed25519PrivateKey.generate()
    k = public_key_b64(Ed25519PrivateKey.generate())
    op = issue_certificate(fed, FED, "alice", k, role="operator")
    assert op["v"] == 2 and verify_certificate(op, fed.public_key(), FED) == ("alice", k)
    assert certificate_role(op) == "operator"
    v1 = {key: val for key, val in issue_certificate(fed, FED, "n", k).items() if key not in ("role", "sig")}
    v1["v"] = 1
    import base64

    from dfl_agent.security.keys import canonical
    v1["sig"] = base64.b64encode(fed.sign(canonical(v1))).decode()
    verify_certificate(v1, fed.public_key(), FED)
    assert certificate_role(v1) == "device"
    with pytest.raises(SecurityError):
        issue_certificate(fed, FED, "x", k, role="root")
    op["role"] = "device"  # a changed role breaks the signature
    with pytest.raises(SecurityError):
        verify_certificate(op, fed.public_key(), FED)


def test_sign_verify_roles_replay_and_duplicate(tmp_path):
    _fed, a, b = _pair(tmp_path=tmp_path)
    m1 = a.sign_control("status", {"round": 3})
    assert b.verify_control(m1, "status", "a") == ("a", "device", {"round": 3})  # trusted by its certificate
    assert b.role_of("a") == "device" and b.is_member("a")
    with pytest.raises(ControlRejected) as e:
        b.verify_control(m1, "status", "a")
    assert e.value.reason == "duplicate" and not b.control_dropped  # retained copy again: not a drop
    m2 = a.sign_control("status", {"round": 4})
    b.verify_control(m2, "status", "a")
    with pytest.raises(ControlRejected) as e:
        b.verify_control(m1, "status", "a")  # an older one: replay, however fresh its time
    assert e.value.reason == "replay" and b.control_dropped["replay"] == 1
    # a restarted sender continues above every number it used
    SeqCounter._shared.clear()  # a new process
    a2 = SecurityGuard("a", a.key, a.trust, require_signatures=True, seq=SeqCounter(tmp_path / "seq.json"))
    assert b.verify_control(a2.sign_control("status", {"round": 5}), "status", "a")[2] == {"round": 5}


@pytest.mark.parametrize("mutate,reason", [
    (lambda env: env.update(payload={"state": "finished", "round": 10**9}), "bad_signature"),
    (lambda env: env.update(sig=None), "unsigned"),
    (lambda env: env.update(sender="c"), "wrong_sender"),
    (lambda env: env.update(fed="other"), "wrong_federation"),
    (lambda env: env.update(kind="presence"), "wrong_kind"),
    (lambda env: env.pop("ctl"), "unsigned"),
    (lambda env: env.update(seq="1"), "malformed"),
])
def test_forgeries_are_rejected_and_counted(mutate, reason):
    _fed, a, b = _pair()
    env = json.loads(a.sign_control("status", {"round": 1}))
    mutate(env)
    with pytest.raises(ControlRejected) as e:
        b.verify_control(json.dumps(env).encode(), "status", "a")
    assert e.value.reason == reason and b.control_dropped[reason] == 1


def test_unknown_sender_and_unsigned_without_requirement():
    _fed, a, b = _pair(require=False)
    outsider = SecurityGuard("x", Ed25519PrivateKey.generate(), TrustStore(FED), require_signatures=False)
    assert b.verify_control(outsider.sign_control("presence", {"state": "online"}), "presence", "x")[1] == "unverified"
    assert b.verify_control(b'{"state": "online"}', "presence", "x")[1] == "unverified"
    _fed, a, b = _pair(require=True)
    for msg, why in ((outsider.sign_control("presence", {}), "unknown_sender"), (b'{"state": "offline"}', "unsigned"),
                     (b"\xff", "malformed")):
        with pytest.raises(ControlRejected) as e:
            b.verify_control(msg, "presence", "x")
        assert e.value.reason == why


def test_pinned_operator_is_not_a_member():
    op = Ed25519PrivateKey.generate()
    g = SecurityGuard("n", Ed25519PrivateKey.generate(), TrustStore(FED, operators={"alice": public_key_b64(op)}),
                      require_signatures=True)
    sender = SecurityGuard("alice", op, TrustStore(FED))
    assert g.verify_control(sender.sign_control("run", {"x": 1}), "run", "alice")[1] == "operator"
    assert g.role_of("alice") == "operator" and not g.is_member("alice") and g.role_of("zz") == "unverified"


def test_seq_counter_persists_blocks(tmp_path):
    c = SeqCounter(tmp_path / "s.json", block=3)
    got = [c.next("status") for _ in range(5)]
    assert got == sorted(got) and len(set(got)) == 5
    SeqCounter._shared.clear()  # a new process
    assert SeqCounter(tmp_path / "s.json").next("status") > got[-1]  # restart (even a crash) never repeats
    assert not (tmp_path / "s.json.tmp").exists()
