"""Bounded JSON parsing (dfl_agent.jsonbound) and its use on every path where JSON arrives:
signed control envelopes, run descriptors, the run lobby, the MQTT transport, the wire
header, dflctl's observer and ``run list``.

The hostile value of the issue: 100,000 ``[`` (200 KB with the closing brackets), on which
:func:`json.loads` raises RecursionError - not a ValueError - and ends the thread that parses.
Each path must drop it under its own reason (``too_deep``, ``oversized``), count it, and go on.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.runtime.service.lobby import RunLobby
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import RunDescriptor, RunVerifier, open_run_message, sign_descriptor
from dfl_agent.security import ControlRejected, SecurityGuard, TrustStore
from dfl_agent.security.keys import public_key_b64

DEEP = b"[" * 100_000 + b"]" * 100_000  # the retained value: 200 KB
DEEP_SMALL = b"[" * 5_000 + b"]" * 5_000  # deep enough for RecursionError, under 64 KiB
FED = "f"


def _nest(n: int) -> str:
    return "[" * n + "]" * n


def _reason(data, *args, **kw) -> str:
    from dfl_agent.jsonbound import JSONBoundError, loads

    with pytest.raises(JSONBoundError) as ei:
        loads(data, *args, **kw)
    return ei.value.reason


# -- the parser (imported in each test: the path tests below also run, and fail, on code without it)
def test_premise_json_loads_recurses_on_the_deep_value():
    with pytest.raises(RecursionError):
        json.loads(DEEP_SMALL)


def test_deep_values_are_too_deep_without_recursion_and_fast():
    from dfl_agent.jsonbound import depth

    t0 = time.perf_counter()
    assert _reason(DEEP, max_bytes=1 << 20) == "too_deep"
    assert _reason(b'{"a":' * 40_000 + b"1" + b"}" * 40_000, max_bytes=1 << 20) == "too_deep"
    assert time.perf_counter() - t0 < 1.0
    assert depth(DEEP.decode()) == 100_000  # counted, not recursed


def test_exactly_at_the_depth_limit_parses_one_more_does_not():
    from dfl_agent.jsonbound import MAX_DEPTH, loads

    assert MAX_DEPTH == 32
    assert loads(_nest(32), max_bytes=1000) == json.loads(_nest(32))
    assert _reason(_nest(33), max_bytes=1000) == "too_deep"
    obj = '{"a":' * 32 + "1" + "}" * 32
    assert loads(obj, max_bytes=1000)["a"]["a"]["a"] is not None
    assert _reason('{"a":' * 33 + "1" + "}" * 33, max_bytes=1000) == "too_deep"
    assert loads(_nest(3), max_bytes=100, max_depth=3) == [[[]]]
    assert _reason(_nest(4), max_bytes=100, max_depth=3) == "too_deep"


def test_wide_values_are_fine():
    from dfl_agent.jsonbound import depth, loads

    wide = json.dumps([{"k": [i, i + 1]} for i in range(10_000)])  # 20,000 brackets, depth 3
    assert len(loads(wide, max_bytes=len(wide))) == 10_000
    assert depth(wide) == 3


def test_brackets_inside_strings_do_not_count():
    from dfl_agent.jsonbound import depth, loads

    s = json.dumps({"a": "[" * 1000, "b": "{" * 1000, "c": '\\"[[[[', "d": ["x]]]]}}}}"]})
    assert depth(s) == 2
    assert loads(s, max_bytes=len(s))["a"] == "[" * 1000
    assert loads(r'["a\\", "[[["]', max_bytes=100) == ["a\\", "[[["]  # an escaped backslash ends no string


def test_size_is_checked_first_and_exactly_at_the_limit_passes():
    from dfl_agent.jsonbound import LIMITS, loads

    doc = json.dumps({"x": "y" * 100}).encode()
    assert loads(doc, max_bytes=len(doc)) == {"x": "y" * 100}
    assert _reason(doc, max_bytes=len(doc) - 1) == "oversized"
    assert _reason(b"\xff" * 70_000, "status") == "oversized"  # before any decoding
    assert _reason(DEEP, "status") == "oversized"  # the 200 KB value, on a 64 KiB topic
    assert LIMITS["presence"] == LIMITS["status"] == LIMITS["descriptor"] == LIMITS["announcement"] == 64 * 1024
    assert _reason("é" * 40, max_bytes=60) == "oversized"  # a str counts its UTF-8 bytes


def test_malformed_inputs():
    from dfl_agent.jsonbound import JSONBoundError, loads

    for bad in (b'"abc', b"[1,", b"\xff\xfe\xfd", b"", b"]]][[[", b'{"a": "x}', b"nope"):
        assert _reason(bad, max_bytes=100) == "malformed", bad
    assert isinstance(JSONBoundError("too_deep"), ValueError)  # old ``except ValueError`` still catches it
    with pytest.raises(TypeError):
        loads(b"1")


# -- control envelopes, run descriptors, the lobby ---------------------------------------
def _operator():
    fed_key = Ed25519PrivateKey.generate()
    op_key = Ed25519PrivateKey.generate()
    from dfl_agent.runtime.shared.descriptor import operator_certificate

    cert = operator_certificate(fed_key, FED, "alice", public_key_b64(op_key))
    return fed_key, op_key, cert


def test_control_envelopes_drop_deep_and_oversized_under_their_own_reason():
    g = SecurityGuard("b", None, TrustStore(FED), require_signatures=False)
    for frame, kind, why in ((DEEP_SMALL, "status", "too_deep"), (DEEP, "status", "oversized"),
                             (b'{"ctl":1,"payload":' + b"[" * 40 + b"]" * 40 + b"}", "presence", "too_deep"),
                             (b'{"pad":"' + b"x" * 70_000 + b'"}', "presence", "oversized"),
                             (b'{"pad":"' + b"x" * 70_000 + b'"}', "run:r-1", "oversized")):
        with pytest.raises(ControlRejected) as ei:
            g.verify_control(frame, kind, "x")
        assert ei.value.reason == why, (kind, why)
    assert g.control_dropped == {"too_deep": 2, "oversized": 3}
    # a 70 KB signed control message of another kind is still within the general limit
    assert g.verify_control(b'{"pad":"' + b"x" * 70_000 + b'"}', "other")[1] == "unverified"


def test_run_verifier_counts_deep_and_oversized_descriptors():
    fed_key, op_key, cert = _operator()
    v = RunVerifier(FED, require_signatures=True, federation_key=public_key_b64(fed_key))
    assert v.check(DEEP)[1] == "oversized"
    assert v.check(DEEP_SMALL)[1] == "too_deep"
    d = RunDescriptor("r-1", FED, "fedavg", 2, options={"deep": json.loads(_nest(31))})
    assert v.check(sign_descriptor(d, op_key, "alice", cert))[1] == "too_deep"  # 33 levels in the envelope
    good = RunDescriptor("r-2", FED, "fedavg", 2)
    assert v.check(sign_descriptor(good, op_key, "alice", cert))[0] is not None
    assert v.refused == {"oversized": 1, "too_deep": 2}
    assert open_run_message(DEEP_SMALL) is None


def _msg(topic: str, payload: bytes):
    return SimpleNamespace(topic=topic, payload=payload)


@pytest.mark.parametrize("signed", [False, True])
def test_run_lobby_drops_deep_statuses_and_survives_any_message(signed):
    guard = SecurityGuard("me", None, TrustStore(FED), require_signatures=False) if signed else None
    lobby = RunLobby(config_from_dict({"federation": FED}), "me", RunVerifier(FED, require_signatures=False), guard=guard)
    lobby._on_message(None, None, _msg(f"dfl/{FED}/node/x/status", DEEP_SMALL))  # RecursionError on 0c2393f
    lobby._on_message(None, None, _msg(f"dfl/{FED}/node/y/status", DEEP))
    lobby._on_message(None, None, _msg(f"dfl/{FED}/run/r-9", DEEP_SMALL))
    assert lobby.dropped == {"status_too_deep": 1, "status_oversized": 1}
    assert lobby.verifier.refused == {"too_deep": 1}

    def boom(run_id):
        raise RuntimeError("a handler bug")

    lobby.on_cancel = boom  # a cancel hook failure is the hook's own business (logged there)
    lobby.queue = None  # type: ignore[assignment]  # any failure while handling one message ...
    lobby._on_message(None, None, _msg(f"dfl/{FED}/run/r-1", sign_descriptor(RunDescriptor("r-1", FED, "fedavg", 1),
                                                                              None)))
    assert lobby.dropped["handler_error"] == 1  # ... is caught and counted; the listener goes on
    lobby._on_message(None, None, _msg(f"dfl/{FED}/node/z/status", json.dumps({"state": "idle"}).encode()))
    assert lobby.statuses["z"] == {"state": "idle"}


# -- the MQTT transport ---------------------------------------------------------------------
def test_mqtt_transport_counts_deep_presence_and_status_and_handler_errors():
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.discovery.presence import node_transport
    from dfl_agent.transport.mqtt import _Conn

    t = node_transport("n1", FED, broker="127.0.0.1:1", peers=PeerTable("n1", FED), descriptor={})
    conn = _Conn("127.0.0.1:1", home=True)
    t._on_message(None, conn, _msg(f"dfl/{FED}/node/x/status", DEEP_SMALL))
    t._on_message(None, conn, _msg(f"dfl/{FED}/node/x/presence", DEEP_SMALL))
    t._on_message(None, conn, _msg(f"dfl/{FED}/node/y/status", DEEP))
    t._on_message(None, conn, _msg(f"dfl/{FED}/node/y/presence", b"{" * 10))
    dropped = dict(t.stats.dropped)
    assert dropped == {"status_too_deep": 1, "presence_too_deep": 1, "status_oversized": 1, "bad_presence": 1}
    t.channel._handle_status = None  # type: ignore[union-attr]  # handling raises: caught and counted
    t._on_message(None, conn, _msg(f"dfl/{FED}/node/z/status", b"{}"))
    assert t.stats.dropped["handler_error"] == 1
    t._invoke(lambda: 1 / 0, ())  # a handler on the event loop that raises
    assert t.stats.dropped["handler_error"] == 2


def test_mqtt_transport_with_a_guard_counts_too_deep():
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.discovery.presence import node_transport
    from dfl_agent.transport.mqtt import _Conn

    g = SecurityGuard("n1", Ed25519PrivateKey.generate(), TrustStore(FED), require_signatures=True)
    t = node_transport("n1", FED, broker="127.0.0.1:1", peers=PeerTable("n1", FED), descriptor={}, control=g)
    t._on_message(None, _Conn("127.0.0.1:1", home=True), _msg(f"dfl/{FED}/node/x/status", DEEP_SMALL))
    t._on_message(None, _Conn("127.0.0.1:1", home=True), _msg(f"dfl/{FED}/node/x/presence", DEEP_SMALL))
    assert dict(t.stats.dropped) == {"status_too_deep": 1, "presence_too_deep": 1}


# -- the wire header ---------------------------------------------------------------------------
def test_wire_header_nested_too_deep_is_dropped_as_too_deep():
    from dfl_agent.transport import wire

    hdr = b'{"v":' + b"[" * 5000 + b"]" * 5000 + b"}"
    frame = wire._PREFIX.pack(wire.MAGIC, wire.WIRE_VERSION, len(hdr)) + hdr
    with pytest.raises(wire.WireError) as ei:
        wire.raw_header(frame)
    assert ei.value.reason == "too_deep"


# -- dflctl: observer and run list --------------------------------------------------------------
def test_observer_marks_deep_documents_and_survives_handler_errors():
    from dfl_agent.cli.observer import Observer

    obs = Observer("127.0.0.1:1", FED)
    obs._on_message(None, None, _msg(f"dfl/{FED}/node/x/status", DEEP_SMALL))
    obs._on_message(None, None, _msg(f"dfl/{FED}/run/r-1", DEEP_SMALL))
    assert obs.statuses == {} and obs.runs == {}
    assert obs._open("status", "x", DEEP_SMALL) == (None, "untrusted: too_deep")
    obs.statuses = None  # type: ignore[assignment]  # handling raises: caught and counted
    obs._on_message(None, None, _msg(f"dfl/{FED}/node/x/status", b"{}"))
    assert obs.dropped["handler_error"] == 1


def test_run_list_shows_only_operator_signed_descriptors_with_trust_material():
    from dfl_agent.cli.cli_runs import run_rows, verify_runs
    from dfl_agent.cli.observer import observer_guard

    fed_key, op_key, cert = _operator()
    stranger = Ed25519PrivateKey.generate()
    good = RunDescriptor("r-good", FED, "fedavg", 2, submitted_at=1.0)
    payloads = {"r-good": sign_descriptor(good, op_key, "alice", cert),
                "r-unsigned": sign_descriptor(RunDescriptor("r-unsigned", FED, "fedavg", 2), None),
                "r-stranger": sign_descriptor(RunDescriptor("r-stranger", FED, "fedavg", 2), stranger, "mallory"),
                "r-moved": sign_descriptor(RunDescriptor("r-other", FED, "fedavg", 2), op_key, "alice", cert)}
    runs = {rid: open_run_message(p) for rid, p in payloads.items()}
    assert all(runs.values())
    # without trust material: everything listed, every entry marked unverified
    shown, hidden = verify_runs(runs, payloads, FED, None)
    assert set(shown) == set(payloads) and not hidden
    assert {r["trust"] for r in run_rows(shown, {})} == {"unverified"}
    # with it: only the operator's descriptor on its own topic
    cfg = config_from_dict({"federation": FED, "security": {"federation_key": public_key_b64(fed_key)}})
    shown, hidden = verify_runs(runs, payloads, FED, observer_guard(cfg))
    assert list(shown) == ["r-good"] and shown["r-good"]["trust"] == "operator"
    assert hidden == {"unsigned": 1, "unknown_key": 1, "malformed": 1}
    assert [r["trust"] for r in run_rows(shown, {})] == ["operator"]
