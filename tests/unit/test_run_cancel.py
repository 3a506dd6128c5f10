"""Cancel stays cancelled, and runs expire (dfl_agent.runtime.shared.descriptor, ledger, lobby,
run_manager): operator-signed cancel records, the ledger's cancelled ids, a replayed
submission refused, ``not_after`` - a real lobby, verifier, ledger and run manager,
fed the messages a broker would deliver (no MQTT connection)."""

import dataclasses
import json
import time
from types import SimpleNamespace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.profiles import resolve_profile
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.lobby import RunLobby
from dfl_agent.runtime.service.run_manager import RunManager
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import (
    RunDescriptor,
    RunVerifier,
    cancel_topic,
    operator_certificate,
    run_topic,
    sign_cancel,
    sign_descriptor,
)
from dfl_agent.security.keys import issue_certificate, public_key_b64
from dfl_agent.security.trust import SeqCounter

FED = "f"


class Keys:
    def __init__(self):
        self.fed = Ed25519PrivateKey.generate()
        self.op, self.dev = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
        self.op_cert = operator_certificate(self.fed, FED, "alice", public_key_b64(self.op))
        self.dev_cert = issue_certificate(self.fed, FED, "n-1", public_key_b64(self.dev))
        self.seq = SeqCounter(None)

    def submit(self, d):
        return sign_descriptor(d, self.op, "alice", self.op_cert, seq=self.seq)

    def cancel(self, run_id):
        return sign_cancel(FED, run_id, self.op, "alice", self.op_cert, seq=self.seq)


def lobby(tmp_path, keys):
    cfg = config_from_dict({"federation": FED, "state_dir": str(tmp_path)})
    lob = RunLobby(cfg, "n-2", RunVerifier(FED, require_signatures=True, federation_key=public_key_b64(keys.fed)),
                   ledger=RunLedger(tmp_path))
    return lob


def deliver(lob, topic, payload):
    lob._on_message(None, None, SimpleNamespace(topic=topic, payload=payload))


def run(rid="r-1", **kw):
    return RunDescriptor(run_id=rid, federation=FED, algorithm="fedavg", rounds=1, submitted_at=time.time(), **kw)


def test_only_an_operator_signed_cancel_record_counts(tmp_path):
    keys = Keys()
    lob = lobby(tmp_path, keys)
    d = run()
    submission = keys.submit(d)
    deliver(lob, cancel_topic(FED, "r-1"), sign_cancel(FED, "r-1", None))  # unsigned
    deliver(lob, cancel_topic(FED, "r-1"), sign_cancel(FED, "r-1", keys.dev, "n-1", keys.dev_cert))  # a device
    deliver(lob, cancel_topic(FED, "r-1"), keys.cancel("r-2"))  # another run's record on this run's topic
    assert not lob.is_cancelled("r-1")
    assert lob.verifier.refused == {"cancel_unsigned": 1, "cancel_not_operator": 1, "cancel_malformed": 1}
    deliver(lob, run_topic(FED, "r-1"), submission)
    assert lob.run("r-1") is not None and not lob.run("r-1").cancelled  # queued live
    fired = []
    lob.on_cancel = fired.append
    record = keys.cancel("r-1")
    assert json.loads(record)["kind"] == "cancel:r-1"
    deliver(lob, cancel_topic(FED, "r-1"), record)
    assert lob.run("r-1").cancelled and fired == ["r-1"]  # the queued copy is cancelled, training stops
    deliver(lob, cancel_topic(FED, "r-1"), record)  # retained, delivered again on a reconnect: not counted
    deliver(lob, cancel_topic(FED, "r-1"), b"")  # a removed record never un-cancels
    assert lob.is_cancelled("r-1") and fired == ["r-1"]
    assert lob.verifier.refused == {"cancel_unsigned": 1, "cancel_not_operator": 1, "cancel_malformed": 1}


def test_a_replayed_submission_of_a_cancelled_run_is_refused_by_a_new_node_and_after_a_restart(tmp_path):
    keys = Keys()
    d = run()
    submission = keys.submit(d)
    record = keys.cancel("r-1")
    new = lobby(tmp_path / "new", keys)  # a node that never saw the run: the cancel record comes first
    deliver(new, cancel_topic(FED, "r-1"), record)
    deliver(new, run_topic(FED, "r-1"), submission)
    assert new.run("r-1") is None and new.verifier.refused == {"cancelled": 1}
    # the ledger remembers: after a restart the replay is refused before any cancel record arrives
    again = lobby(tmp_path / "new", keys)
    deliver(again, run_topic(FED, "r-1"), submission)
    assert again.run("r-1") is None and again.verifier.refused == {"cancelled": 1}
    assert RunLedger(tmp_path / "new").is_cancelled("r-1") and not RunLedger(tmp_path / "new").is_cancelled("r-2")
    # the operator's cancelled copy of the descriptor itself is taken (it is a cancel)
    deliver(again, run_topic(FED, "r-1"), keys.submit(dataclasses.replace(d, cancelled=True, seq=1)))
    assert again.run("r-1").cancelled


def test_a_run_past_not_after_is_refused_unless_this_node_started_it(tmp_path):
    keys = Keys()
    lob = lobby(tmp_path, keys)
    past = time.time() - 1
    deliver(lob, run_topic(FED, "r-old"), keys.submit(run("r-old", not_after=past)))
    assert lob.run("r-old") is None and lob.verifier.refused == {"expired": 1}
    lob.ledger.run_dir("r-mine").mkdir(parents=True)  # started here before it expired (its checkpoints)
    deliver(lob, run_topic(FED, "r-mine"), keys.submit(run("r-mine", not_after=past)))
    deliver(lob, run_topic(FED, "r-new"), keys.submit(run("r-new", not_after=time.time() + 3600)))
    assert lob.run("r-mine") is not None and lob.run("r-new") is not None
    assert lob.verifier.refused == {"expired": 1}
    # a queued run whose not_after passes before it starts is declined at pick time, and counted
    prof = resolve_profile("generic-x86", {"behaviour": {"algorithms": ["fedavg"]}})[0]
    m = RunManager(lob.cfg, None, node_id="n-2", profile=prof, ledger=lob.ledger, lobby=lob,
                   agent_factory=lambda *a, **k: None, notifier=SimpleNamespace(
                       watchdog_interval=lambda: None, ready=lambda line: None, status=lambda line: None))
    m.has_default = False
    with lob.lock:
        lob.queue.runs["r-new"] = dataclasses.replace(lob.queue.runs["r-new"], not_after=time.time() - 1)
    assert m.next_run().run_id == "r-mine"  # started here: it goes on
    assert lob.ledger.state("r-new") == "declined" and "not_after" in lob.ledger.entries["r-new"]["reason"]
    assert lob.verifier.refused == {"expired": 2} and m.state == "idle"


def test_not_after_is_signed_and_checked_when_parsed():
    d = RunDescriptor.from_dict({"run_id": "r", "federation": FED, "algorithm": "fedavg", "rounds": 1,
                                 "not_after": 1e9})
    assert d.expired(1e9 + 1) and not d.expired(1e9)
    assert RunDescriptor.from_dict({"run_id": "r", "federation": FED, "algorithm": "fedavg", "rounds": 1}).not_after \
        is None  # a descriptor without it (an older dflctl) never expires
    for bad in ("tomorrow", True):
        try:
            RunDescriptor.from_dict({"run_id": "r", "federation": FED, "algorithm": "fedavg", "rounds": 1,
                                     "not_after": bad})
        except ValueError as exc:
            assert "not_after" in str(exc)
        else:
            raise AssertionError(f"not_after {bad!r} accepted")
    keys = Keys()
    forged = json.loads(keys.submit(run(not_after=time.time() - 1)))
    forged["payload"]["not_after"] = time.time() + 86400  # prolonged by a man in the middle
    v = RunVerifier(FED, require_signatures=True, federation_key=public_key_b64(keys.fed))
    assert v.check(json.dumps(forged).encode()) == (None, "bad_signature")
