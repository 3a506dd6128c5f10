"""Revocation lists, certificate expiry, renewal and clock trouble, on the one check every
verifying path makes (:meth:`dfl_agent.security.TrustStore.resolve`, through
:meth:`~dfl_agent.security.SecurityGuard.verify` for frames and
:meth:`~dfl_agent.security.SecurityGuard.verify_control` for presence, status and runs)."""

from __future__ import annotations

import json
import logging
import types

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.algorithms.context import Message
from dfl_agent.security import SecurityGuard, TrustStore
from dfl_agent.security.keys import issue_certificate, public_key_b64
from dfl_agent.transport import wire

FED = "fedrev"
DAY = 86400.0
T0 = 1_800_000_000.0  # 2027-01-15


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _frame(key, node, cert, rnd=1):
    msg = Message("model", rnd, {"w": np.arange(4, dtype=np.float32)}, meta={"samples": 3})
    sender = SecurityGuard(node, key, TrustStore(FED))
    return wire.encode(msg, federation=FED, sender=node, sign=sender.sign, cert=cert)


def _verdict(guard, frame):
    """What the receiver's guard says of ``frame``'s signature and sender (no replay rules)."""
    header = wire.raw_header(frame)
    return guard.verify(header, header.signed_bytes)


def _fleet(clock=None, **trust_kw):
    """A federation key, device a (key + certificate, valid 365 days from T0) and receiver b."""
    clock = clock or Clock()
    fed = Ed25519PrivateKey.generate()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    cert_a = issue_certificate(fed, FED, "a", public_key_b64(ka), valid_days=365, now=T0)
    trust = TrustStore(FED, {"b": public_key_b64(kb)}, public_key_b64(fed), clock=clock, **trust_kw)
    b = SecurityGuard("b", kb, trust, require_signatures=True, clock=clock)
    return types.SimpleNamespace(fed=fed, ka=ka, kb=kb, cert_a=cert_a, b=b, clock=clock)


def test_a_revoked_node_is_dropped_on_every_path_and_leaves_membership():
    from dfl_agent.security.revocation import Revoked, sign_revocations
    from dfl_agent.security.trust import ControlRejected

    f = _fleet()
    a = SecurityGuard("a", f.ka, TrustStore(FED), certificate=f.cert_a, clock=f.clock)
    assert _verdict(f.b, _frame(f.ka, "a", f.cert_a)) == "verified"
    f.b.verify_control(a.sign_control("status", {"round": 1}), "status", "a")
    assert f.b.is_member("a")
    rev = sign_revocations(f.fed, FED, 1, [Revoked("a", None, "stolen", T0)], now=T0)
    assert f.b.trust.revocations.offer(rev.payload()) is None
    # frames, statuses, presence and any other control kind (run descriptors, cancels)
    assert _verdict(f.b, _frame(f.ka, "a", f.cert_a, rnd=2)) == "revoked"
    for kind in ("status", "presence", "run:r1"):
        with pytest.raises(ControlRejected) as exc:
            f.b.verify_control(a.sign_control(kind, {"x": 1}), kind)
        assert exc.value.reason == "revoked"
    assert f.b.control_dropped["revoked"] == 3
    assert not f.b.is_member("a") and f.b.role_of("a") == "unverified" and f.b.trust.revoked("a")
    assert not f.b.learn("a", f.cert_a)  # a certificate does not bring it back
    # where signatures are not required, a revoked key is still refused (not passed as unsigned)
    lax = SecurityGuard("c", None, f.b.trust, require_signatures=False, clock=f.clock)
    assert _verdict(lax, _frame(f.ka, "a", f.cert_a, rnd=3)) == "revoked"
    # a node revoked as a whole stays revoked with a key certified after the list
    k2 = Ed25519PrivateKey.generate()
    cert2 = issue_certificate(f.fed, FED, "a", public_key_b64(k2), valid_days=365, now=T0 + 10)
    assert _verdict(f.b, _frame(k2, "a", cert2)) == "revoked"


def test_a_lower_numbered_or_forged_list_is_ignored_and_counted(caplog):
    from dfl_agent.security.revocation import Revoked, sign_revocations

    f = _fleet()
    revs = f.b.trust.revocations
    two = sign_revocations(f.fed, FED, 2, [Revoked("a", None, "stolen", T0)], now=T0)
    assert revs.offer(two.payload()) is None and revs.number == 2
    assert revs.offer(two.payload()) == "duplicate"  # the retained copy again, after a reconnection
    one = sign_revocations(f.fed, FED, 1, [], now=T0 + 5)  # an older list that revokes nothing
    assert revs.offer(one.payload()) == "stale"
    other = sign_revocations(f.fed, FED, 2, [], now=T0 + 6)  # the same number, other content
    assert revs.offer(other.payload()) == "stale"
    forged = sign_revocations(Ed25519PrivateKey.generate(), FED, 9, [Revoked("b", None, "forged", T0)], now=T0)
    assert revs.offer(forged.payload()) == "bad_signature"
    tampered = dict(two.doc, number=7, revoked=[])  # the number raised and the entry dropped after signing
    assert revs.offer(json.dumps(tampered).encode()) == "bad_signature"
    alien = sign_revocations(f.fed, "other-fed", 8, [], now=T0)
    assert revs.offer(alien.payload()) == "wrong_federation"
    assert revs.offer(b"{not json") == "malformed"
    assert revs.offer(b"[" * 100 + b"]" * 100) == "too_deep"
    assert revs.offer(b" " * (300 * 1024)) == "oversized"
    assert dict(revs.dropped) == {"revocations_stale": 2, "revocations_bad_signature": 2,
                                  "revocations_wrong_federation": 1, "revocations_malformed": 1,
                                  "revocations_too_deep": 1, "revocations_oversized": 1}
    assert revs.number == 2 and f.b.trust.revoked("a") and not f.b.trust.revoked("b")
    assert "ignored revocation list 1: this node holds number 2" in caplog.text


def test_the_newest_list_is_kept_in_the_state_dir_and_read_by_the_run_process(tmp_path, caplog):
    from dfl_agent.security.revocation import REVOCATIONS_FILE, Revocations, Revoked, sign_revocations

    fed = Ed25519PrivateKey.generate()
    path = tmp_path / REVOCATIONS_FILE
    t = [0.0]
    supervisor = Revocations(FED, fed.public_key(), path)
    run = Revocations(FED, fed.public_key(), path, persist=False, clock=lambda: t[0])
    assert run.number == 0
    supervisor.offer(sign_revocations(fed, FED, 1, [Revoked("a", None, "lost", T0)]).payload())
    t[0] += 1.0
    run.refresh()  # the run process reads what its supervisor saved
    assert run.number == 1 and run.revoked("a") is not None
    # a restart without a broker: the saved list is known at once (verified again)
    assert Revocations(FED, fed.public_key(), path).revoked("a").reason == "lost"
    # a forged file in the state directory is named and ignored
    forged = sign_revocations(Ed25519PrivateKey.generate(), FED, 5, []).payload()
    path.write_bytes(forged)
    assert Revocations(FED, fed.public_key(), path).number == 0
    assert f"ignored the revocation list saved in {path}: bad_signature" in caplog.text


def test_renewal_with_a_new_key_both_keys_verify_until_the_old_expires_or_is_revoked():
    """On 75535c2 a peer that trusted the old key dropped every frame of the new one as
    ``bad_signature`` (one key per node; a new certificate was never looked at)."""
    clock = Clock()
    f = _fleet(clock)
    old_cert = issue_certificate(f.fed, FED, "a", public_key_b64(f.ka), valid_days=10, now=T0)
    assert _verdict(f.b, _frame(f.ka, "a", old_cert)) == "verified"
    clock.t = T0 + 2 * DAY  # renewed with a new key, 8 days before the old certificate ends
    k_new = Ed25519PrivateKey.generate()
    new_cert = issue_certificate(f.fed, FED, "a", public_key_b64(k_new), valid_days=365, now=clock.t)
    assert _verdict(f.b, _frame(k_new, "a", new_cert)) == "verified"
    assert _verdict(f.b, _frame(f.ka, "a", old_cert)) == "verified"  # the overlap: both verify
    assert f.b.trust.usable_keys("a") == [public_key_b64(k_new), public_key_b64(f.ka)]
    clock.t = T0 + 11 * DAY  # the old certificate expired: only the new key verifies
    assert _verdict(f.b, _frame(f.ka, "a", old_cert)) == "expired"
    assert _verdict(f.b, _frame(k_new, "a", new_cert)) == "verified"
    assert f.b.is_member("a")


def test_renewal_overlap_ends_when_the_old_key_is_revoked():
    from dfl_agent.security.revocation import Revoked, sign_revocations

    f = _fleet()
    k_new = Ed25519PrivateKey.generate()
    new_cert = issue_certificate(f.fed, FED, "a", public_key_b64(k_new), valid_days=365, now=T0 + 60)
    assert _verdict(f.b, _frame(f.ka, "a", f.cert_a)) == "verified"
    assert _verdict(f.b, _frame(k_new, "a", new_cert)) == "verified"
    rev = sign_revocations(f.fed, FED, 1, [Revoked("a", public_key_b64(f.ka), "renewed", T0)])
    assert f.b.trust.revocations.offer(rev.payload()) is None
    assert _verdict(f.b, _frame(f.ka, "a", f.cert_a, rnd=2)) == "revoked"
    assert _verdict(f.b, _frame(k_new, "a", new_cert, rnd=2)) == "verified"
    assert f.b.is_member("a") and not f.b.trust.revoked("a")


def test_renewal_with_the_same_key_extends_its_validity():
    clock = Clock()
    f = _fleet(clock)
    short = issue_certificate(f.fed, FED, "a", public_key_b64(f.ka), valid_days=10, now=T0)
    assert _verdict(f.b, _frame(f.ka, "a", short)) == "verified"
    renewed = issue_certificate(f.fed, FED, "a", public_key_b64(f.ka), valid_days=365, now=T0 + 5 * DAY)
    clock.t = T0 + 5 * DAY
    assert _verdict(f.b, _frame(f.ka, "a", renewed)) == "verified"
    clock.t = T0 + 20 * DAY  # past the first certificate's end: the renewed one holds
    assert _verdict(f.b, _frame(f.ka, "a", renewed)) == "verified"
    # a replayed older certificate does not shorten it
    assert _verdict(f.b, _frame(f.ka, "a", short)) == "verified"


def test_an_expired_certificate_is_refused_with_one_line_naming_the_node_and_the_date(caplog):
    """On 75535c2 a certificate was checked for expiry only when first learnt: one that expired
    while the receiver ran stayed trusted (the frame below was accepted)."""
    clock = Clock()
    f = _fleet(clock)
    short = issue_certificate(f.fed, FED, "a", public_key_b64(f.ka), valid_days=1, now=T0)
    assert _verdict(f.b, _frame(f.ka, "a", short)) == "verified"
    clock.t = T0 + 2 * DAY
    caplog.set_level(logging.WARNING)
    assert _verdict(f.b, _frame(f.ka, "a", short)) == "expired"
    assert _verdict(f.b, _frame(f.ka, "a", short, rnd=2)) == "expired"
    lines = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
    assert lines == ["refused a certificate: the certificate of node a expired on 2027-01-16 08:00 UTC"], lines
    assert not f.b.is_member("a")
    # one already expired when first seen: "expired", not an unknown sender
    g = _fleet(Clock(T0 + 400 * DAY))
    assert _verdict(g.b, _frame(g.ka, "a", g.cert_a)) == "expired"


def test_the_agent_refuses_to_start_with_its_own_expired_certificate(tmp_path):
    from dfl_agent.runtime.shared.assembly import StartupError, build_security
    from dfl_agent.runtime.shared.config import config_from_dict
    from dfl_agent.security.keys import enroll_local

    fed = Ed25519PrivateKey.generate()
    cert = enroll_local(fed, FED, "dev1", tmp_path, valid_days=1)
    cert = issue_certificate(fed, FED, "dev1", cert["public_key"], valid_days=1, now=T0 - 400 * DAY)
    (tmp_path / "node_cert.json").write_text(json.dumps(cert))
    cfg = config_from_dict({"federation": FED, "node_id": "dev1", "state_dir": str(tmp_path),
                            "security": {"require_signatures": True, "federation_key": public_key_b64(fed)}})
    with pytest.raises(StartupError) as exc:
        build_security(cfg, tmp_path, "dev1")
    assert str(exc.value) == ("security: the certificate of node dev1 expired on 2025-12-12 08:00 UTC "
                              "(renew it: dflctl keys renew dev1)")


def test_a_clock_behind_the_certificate_is_a_clock_problem_not_a_forgery(tmp_path):
    """On 75535c2 a certificate issued after the receiver's clock reading was accepted as if
    valid, and ``doctor`` said nothing about it."""
    clock = Clock(T0 - 3 * DAY)  # a device without a real-time clock, 3 days behind
    f = _fleet(clock)
    assert _verdict(f.b, _frame(f.ka, "a", f.cert_a)) == "not_yet_valid"
    forged = issue_certificate(Ed25519PrivateKey.generate(), FED, "a", public_key_b64(f.ka), now=T0)
    assert _verdict(f.b, _frame(f.ka, "a", forged)) == "unknown_sender"  # a forged certificate is no clock problem
    from dfl_agent.cli.cli_ops import check_certificate
    from dfl_agent.runtime.shared.config import config_from_dict
    from dfl_agent.security.keys import save_certificate

    # doctor, on the device: its own certificate "not yet valid" is reported as the clock
    save_certificate(f.cert_a, tmp_path / "node_cert.json")
    cfg = config_from_dict({"federation": FED, "node_id": "a", "state_dir": str(tmp_path),
                            "security": {"federation_key": public_key_b64(f.fed)}})
    checks = check_certificate(cfg, str(tmp_path), now=T0 - 3 * DAY)
    assert [(c["check"], c["status"]) for c in checks] == [("clock", "fail"), ("certificate", "warn")]
    assert "the clock is behind" in checks[0]["detail"] and "not an attack" in checks[0]["detail"]
    soon = check_certificate(cfg, str(tmp_path), now=T0 + 340 * DAY)
    assert soon[0]["status"] == "warn" and "expires on 2028-01-15" in soon[0]["detail"]
    late = check_certificate(cfg, str(tmp_path), now=T0 + 366 * DAY)
    assert late[0]["status"] == "fail" and "the certificate of node a expired on 2028-01-15" in late[0]["detail"]
    assert check_certificate(cfg, str(tmp_path), now=T0 + DAY)[0]["status"] == "ok"


def test_the_lobby_follows_the_broker_list_and_counts_what_it_ignores(tmp_path):
    from dfl_agent.runtime.service.lobby import RunLobby
    from dfl_agent.runtime.shared.assembly import build_security
    from dfl_agent.runtime.shared.config import config_from_dict
    from dfl_agent.runtime.shared.descriptor import RunVerifier
    from dfl_agent.security.keys import enroll_local
    from dfl_agent.security.revocation import Revoked, sign_revocations

    fed = Ed25519PrivateKey.generate()
    enroll_local(fed, FED, "n0", tmp_path)
    cfg = config_from_dict({"federation": FED, "node_id": "n0", "state_dir": str(tmp_path),
                            "security": {"require_signatures": True, "federation_key": public_key_b64(fed)}})
    lobby = RunLobby(cfg, "n0", RunVerifier(FED, require_signatures=True), guard=build_security(cfg, tmp_path, "n0"))
    lobby.statuses["a"] = {"state": "idle"}

    def deliver(payload):
        lobby._on_message(None, None, types.SimpleNamespace(topic=f"dfl/{FED}/revocations", payload=payload))

    deliver(sign_revocations(fed, FED, 3, [Revoked("a", None, "stolen", T0)]).payload())
    deliver(sign_revocations(fed, FED, 2, []).payload())
    deliver(sign_revocations(Ed25519PrivateKey.generate(), FED, 4, []).payload())
    assert lobby.dropped == {"revocations_stale": 1, "revocations_bad_signature": 1}
    assert "a" not in lobby.statuses  # a revoked node's status no longer counts
    assert lobby.security_status()["revocation_list"] == 3 and lobby.security_status()["revoked"] == ["a"]
    # saved for the run process and the next start
    assert build_security(cfg, tmp_path, "n0").trust.revoked("a")


def test_dflctl_shows_revoked_nodes_and_expiring_certificates():
    from dfl_agent.cli.tables import certificate_warnings, peer_rows, status_rows

    now = T0
    statuses = {"a": {"state": "training", "trust": "revoked", "revoked": "stolen", "time": now},
                "b": {"state": "idle", "trust": "device", "time": now, "certificate_expires": now + 10 * DAY},
                "c": {"state": "idle", "trust": "device", "time": now, "certificate_expires": now + 90 * DAY}}
    presence = {"a": {"state": "online", "trust": "device", "time": now}}
    rows = {r["node_id"]: r for r in peer_rows(statuses, presence, now=now)}
    assert (rows["a"]["trust"], rows["a"]["state"], rows["a"]["revoked"]) == ("revoked", "revoked", "stolen")
    assert rows["b"]["state"] == "idle"
    assert {r["node_id"]: r["state"] for r in status_rows(statuses, now=now)}["a"] == "revoked"
    assert certificate_warnings(statuses, now=now) == [
        "node a is revoked (stolen): its peers ignore it",
        "the certificate of node b expires on 2027-01-25 08:00 UTC (in 10 days): dflctl keys renew b"]


def test_dflctl_keys_enroll_renew_and_revoke(tmp_path, capsys):
    from dfl_agent.cli.dflctl import main
    from dfl_agent.security.keys import load_certificate, load_private_key
    from dfl_agent.security.revocation import verify_revocations

    d, dev = tmp_path / "fed", tmp_path / "dev1"
    assert main(["keys", "federation-init", "--dir", str(d)]) == 0
    assert main(["keys", "enroll", "dev1", "--federation", FED, "--dir", str(d), "--state-dir", str(dev),
                 "--no-credentials"]) == 0
    first = load_certificate(dev / "node_cert.json")
    assert first["expires"] == pytest.approx(first["issued"] + 365 * DAY)  # expires by default
    old_key = first["public_key"]
    # renew with the same key, then with a new one (the old key kept beside)
    assert main(["keys", "renew", "dev1", "--dir", str(d), "--state-dir", str(dev), "--valid-days", "30"]) == 0
    same = load_certificate(dev / "node_cert.json")
    assert same["public_key"] == old_key and same["expires"] == pytest.approx(same["issued"] + 30 * DAY)
    assert main(["keys", "renew", "dev1", "--dir", str(d), "--state-dir", str(dev), "--new-key"]) == 0
    new = load_certificate(dev / "node_cert.json")
    assert new["public_key"] != old_key and new["fed"] == FED and new["role"] == "device"
    assert public_key_b64(load_private_key(dev / "node_key.pem.old")) == old_key
    out = capsys.readouterr().out
    assert "peers verify both keys until the old certificate expires or is revoked" in out
    assert [json.loads(x)["public_key"] for x in (d / "issued.jsonl").read_text().splitlines()] == \
        [old_key, old_key, new["public_key"]]
    # renew from the federation folder alone: the newest recorded key
    assert main(["keys", "renew", "dev1", "--dir", str(d), "--federation", FED]) == 0
    assert load_certificate(d / "certs" / "dev1.json")["public_key"] == new["public_key"]
    # revoke the old key, then the node; numbered lists signed by the federation key
    assert main(["keys", "revoke", "dev1", "--public-key", old_key, "--reason", "renewed", "--dir", str(d),
                 "--federation", FED, "--no-publish"]) == 0
    assert main(["keys", "revoke", "dev1", "--reason", "stolen", "--dir", str(d), "--federation", FED,
                 "--no-publish"]) == 0
    fed_pub = load_private_key(d / "federation_key.pem").public_key()
    rev = verify_revocations((d / "revocations.json").read_bytes(), fed_pub, FED)
    assert rev.number == 2 and [(e.node_id, e.public_key, e.reason) for e in rev.entries] == \
        [("dev1", old_key, "renewed"), ("dev1", None, "stolen")]
    out = capsys.readouterr().out
    assert "revocation list 2" in out and "remove dev1's broker account" in out
    # a revoked node id is not enrolled or renewed again
    assert main(["keys", "enroll", "dev1", "--federation", FED, "--dir", str(d), "--state-dir", str(dev),
                 "--no-credentials"]) == 2
    assert main(["keys", "renew", "dev1", "--dir", str(d), "--state-dir", str(dev)]) == 2
    assert "node dev1 is revoked (revocation list 2: stolen)" in capsys.readouterr().err
    assert main(["keys", "revocations", "--dir", str(d), "--federation", FED]) == 0
    assert "dev1: every key" in capsys.readouterr().out


def test_dflctl_keys_revoke_prints_the_broker_lines_to_remove(tmp_path, capsys):
    from dfl_agent.cli.cli_security import add_acl_user
    from dfl_agent.cli.dflctl import main

    d = tmp_path / "fed"
    assert main(["keys", "federation-init", "--dir", str(d)]) == 0
    for n in ("dev1", "dev2"):
        add_acl_user(d / "dfl.acl", n)
    (d / "mosquitto.passwd").write_text("dev1:$7$101$hash1\ndev2:$7$101$hash2\n")
    assert main(["keys", "revoke", "dev1", "--reason", "lost", "--dir", str(d), "--federation", FED,
                 "--no-publish"]) == 0
    out = capsys.readouterr().out
    assert "the line 'dev1:...'" in out and "dev2" not in out
    assert "    user dev1\n    topic write dfl/+/node/+/inbox\n" in out
    assert "    topic read dfl/+/revocations\n" in out
    assert "sudo mosquitto_passwd -D /etc/mosquitto/dfl.passwd dev1" in out


def test_acl_blocks_enrolled_before_revocation_lists_are_named(tmp_path):
    from dfl_agent.cli.cli_security import add_acl_user, blocks_without_revocations

    acl = tmp_path / "dfl.acl"
    add_acl_user(acl, "new-dev")
    add_acl_user(acl, "ops", "operator")
    acl.write_text(acl.read_text() + "\nuser old-dev\ntopic write dfl/+/node/+/inbox\ntopic read dfl/+/node/+/out\n"
                   "\nuser old-ops\ntopic write dfl/+/run/+\ntopic write dfl/+/run/+/cancel\ntopic read dfl/#\n")
    assert blocks_without_revocations(acl) == ["old-dev", "old-ops"]


def test_a_revoked_operators_runs_are_refused_as_revoked():
    from dfl_agent.runtime.shared.descriptor import RunDescriptor, RunVerifier, sign_descriptor
    from dfl_agent.security.revocation import Revoked, sign_revocations

    f = _fleet()
    kop = Ed25519PrivateKey.generate()
    # issued at the fleet's clock (T0), as `operator_certificate` issues it at the wall clock's now
    cert = issue_certificate(f.fed, FED, "alice", public_key_b64(kop), valid_days=365, now=T0, role="operator")
    verifier = RunVerifier(FED, require_signatures=True, guard=f.b)
    d = RunDescriptor(run_id="r-1", federation=FED, algorithm="fedavg", rounds=2)
    assert verifier.check(sign_descriptor(d, kop, "alice", cert))[1] is None
    rev = sign_revocations(f.fed, FED, 1, [Revoked("alice", None, "left the company", T0)])
    assert f.b.trust.revocations.offer(rev.payload()) is None
    d2 = RunDescriptor(run_id="r-2", federation=FED, algorithm="fedavg", rounds=2)
    assert verifier.check(sign_descriptor(d2, kop, "alice", cert))[1] == "revoked"
    assert verifier.refused == {"revoked": 1}


def test_the_agents_log_warns_30_days_before_its_certificate_expires(caplog):
    from dfl_agent.runtime.shared.assembly import warn_expiry

    cert = {"node_id": "dev1", "expires": T0 + 20 * DAY}
    with caplog.at_level(logging.WARNING):
        line = warn_expiry(cert, now=T0)
    assert line == ("the certificate of node dev1 expires on 2027-02-04 08:00 UTC (in 20 days): renew it with "
                    "dflctl keys renew dev1")
    assert line in caplog.text
    assert warn_expiry(cert, now=T0 - 20 * DAY) is None and warn_expiry({"expires": None}, now=T0) is None
