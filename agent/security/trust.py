"""Who is a member of the federation, and whether a received envelope may be used.

:class:`TrustStore` knows the public key of every trusted node, from two sources:

* *pinned keys*: ``node_id -> public key`` listed in the configuration
  (``security.trusted_keys``);
* *device certificates* signed by the federation key (``security.federation_key``),
  learned from the ``cert`` field of a signed envelope or from a presence message.
  A certificate never overrides a pinned key.

:class:`SecurityGuard` signs outgoing envelopes and checks incoming ones, in this order
(the first failure is the rejection reason, a counter key in the node status):

``unsigned``
    no signature while ``require_signatures`` is on;
``unknown_sender``
    signed, but the sender has no trusted key (no pin, no valid certificate for this
    federation; with ``require_signatures`` off such a message is accepted as if unsigned);
``revoked``
    the federation's revocation list (:mod:`dfl_agent.security.revocation`) names the
    sender or the key its message is signed with - refused also where signatures are not
    required;
``expired``
    the sender's certificate expired (the log names the node and the date, once);
``not_yet_valid``
    the sender's certificate was issued after this device's clock reading: this device's
    clock is behind (a clock problem, counted apart from forgeries; ``dflctl doctor`` says so);
``bad_signature``
    the Ed25519 signature over the canonical header (which holds the payload's SHA-256)
    does not verify with the sender's key;
``replay``
    a message id already accepted, a send time outside ``replay_window`` seconds of
    our clock, or a lower round than one already accepted from the same sender and
    kind that was also sent earlier (a restarted sender - lower round, later time -
    is accepted).

``wrong_federation`` is checked before, by :func:`dfl_agent.transport.wire.decode`.

Control plane (presence, status, run descriptors and other ``kind`` names):
:meth:`SecurityGuard.sign_control` wraps a JSON payload in a signed control envelope
(UTF-8 JSON)::

    {"ctl": 1, "kind": str, "fed": str, "sender": str, "seq": int, "time": unix s,
     "payload": {...}, "cert": certificate | null, "sig": "ed25519:" + b64}

The signature covers the canonical JSON of every field but ``sig``.  ``seq`` grows
by one per message of that (sender, kind) and survives restarts (:class:`SeqCounter`,
``control_seq.json`` in the state directory, written atomically).
:meth:`SecurityGuard.verify_control` returns ``(sender, role, payload)`` or raises
:class:`ControlRejected` whose ``reason`` is a counter key:

``malformed`` (not a control envelope), ``wrong_federation``, ``wrong_kind``,
``wrong_sender`` (the topic names another node), ``unsigned``, ``unknown_sender``,
``revoked``, ``expired``, ``not_yet_valid`` (as above), ``bad_signature``, ``duplicate`` (the very message verified last, delivered again -
e.g. retained, after a reconnect; not a drop), ``replay`` (a ``seq`` at or below the newest one verified for
that sender and kind: a retained message is valid however old as long as its ``seq``
is the newest seen; ``time`` is used for liveness only).

The MQTT last will is the broker's message, published when a node's connection breaks; its
node signs it when it connects (:func:`will_payload`): a presence "offline" whose payload's
``reason`` is :data:`WILL_REASON` and whose ``session`` names that connection (a random id per
connection, also in the node's "online" presence and statuses of that connection).  Signed
before the presence messages of its connection, its ``seq`` is lower than theirs:
:meth:`SecurityGuard.verify_will` checks it as :meth:`~SecurityGuard.verify_control` does but
for the sequence rule, and the receiver binds it to the node's current connection instead: a
will whose ``session`` is not the one of the node's newest presence or status is stale (a
replayed or late will of an earlier connection) and is ignored.

Unsigned payloads (``sig`` null, or no envelope at all - an older wire version) are
returned with role ``"unverified"`` when ``require_signatures`` is off and raise
``unsigned`` when it is on.  :meth:`SecurityGuard.role_of` says ``"device"``,
``"operator"`` or ``"unverified"`` for any node id.

Memory: message ids are remembered for the replay window, at most ``max_seen`` of
them; when that memory is full the oldest id is forgotten and messages sent before
it are rejected as replays (the window shrinks, it never opens).  Per-sender round
records exist only for senders whose signature verified (bounded by the federation).
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from dfl_agent.fsutil import atomic_write
from dfl_agent.jsonbound import LIMITS, JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.security.keys import (
    CertificateExpired,
    CertificateNotYetValid,
    SecurityError,
    canonical,
    certificate_role,
    parse_public_key,
    public_key_b64,
    signer,
    verifier,
    verify_certificate,
)
from dfl_agent.security.revocation import Revocations

log = logging.getLogger(__name__)

REJECT_REASONS = ("unsigned", "unknown_sender", "revoked", "expired", "not_yet_valid", "bad_signature", "replay")
#: reasons :meth:`SecurityGuard.verify_control` raises (counter keys)
CONTROL_REJECT_REASONS = ("malformed", "oversized", "too_deep", "wrong_federation", "wrong_kind", "wrong_sender",
                          "unsigned", "unknown_sender", "revoked", "expired", "not_yet_valid", "bad_signature",
                          "duplicate", "replay")
#: most keys kept per node (a renewal with a new key adds one; the oldest beyond are forgotten)
MAX_KEYS_PER_NODE = 4


class KeyRevoked(SecurityError):
    """A certificate whose node or key the federation's revocation list names."""
SIG_PREFIX = "ed25519:"
#: :meth:`SecurityGuard.verify` verdicts that are not rejections: signature verified, or
#: accepted without one (signatures not required)
VERIFIED, PASS = "verified", "pass"
CONTROL_VERSION = 1
SEQ_FILE = "control_seq.json"
#: largest control envelope accepted (bytes), checked before parsing
MAX_CONTROL_BYTES = LIMITS["control"]


#: the ``reason`` of a presence "offline" that is a node's MQTT last will
WILL_REASON = "last will"


def is_will(doc: object) -> bool:
    """Whether the presence payload ``doc`` (a dict, after the envelope) is a last will that
    names its connection (:data:`WILL_REASON` and a ``session``).  An older agent's bare will
    has neither."""
    return (isinstance(doc, dict) and doc.get("state") == "offline" and doc.get("reason") == WILL_REASON
            and isinstance(doc.get("session"), str))


def will_payload(node_id: str, session: str) -> dict[str, Any]:
    """The presence payload of ``node_id``'s last will for its connection ``session``, made
    (and signed) when the connection opens: its ``time`` is then."""
    return {"state": "offline", "node_id": node_id, "time": time.time(), "reason": WILL_REASON, "session": session}


def control_limit(kind: str | None) -> int:
    """Largest control envelope of ``kind`` accepted, in bytes, checked before parsing:
    64 KiB for presence, status and run descriptors (``run:{id}``), else
    :data:`MAX_CONTROL_BYTES`."""
    if kind in ("presence", "status"):
        return LIMITS[kind]
    if kind is not None and kind.startswith("run:"):
        return LIMITS["descriptor"]
    return MAX_CONTROL_BYTES


class ControlRejected(ValueError):
    """A control message that may not be used; ``reason`` is one of
    :data:`CONTROL_REJECT_REASONS` (a drop counter key)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class SeqCounter:
    """Monotonic sequence numbers per control kind, surviving restarts.

    Numbers are reserved in blocks of ``block``: the file ``path`` (JSON
    ``{kind: reserved_up_to}``, written atomically: temp file + rename) always holds a
    number above every one handed out, so after a crash or restart the next number is
    still larger than any sent before.  ``path = None`` keeps them in memory (tests)
    and starts from the current time in milliseconds, which also grows across restarts.
    """

    _shared: ClassVar[dict[str, SeqCounter]] = {}

    def __new__(cls, path: str | os.PathLike[str] | None = None, block: int = 1000) -> SeqCounter:
        # one counter per file in a process: two guards of one node (the training run and
        # the idle lobby) must never hand out the same number
        if path is None:
            return super().__new__(cls)
        key = str(Path(path).resolve())
        inst = cls._shared.get(key)
        if inst is None:
            inst = cls._shared[key] = super().__new__(cls)
        return inst

    def __init__(self, path: str | os.PathLike[str] | None, block: int = 1000):
        if getattr(self, "_ready", False):
            return
        self._ready = True
        self._lock = threading.Lock()
        self.path = Path(path) if path is not None else None
        self.block = block
        self._next: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        if self.path is not None and self.path.exists():
            try:
                data = bounded_loads(self.path.read_bytes(), "state")
                self._reserved = {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}
            except (OSError, ValueError, TypeError):
                log.warning("%s is unreadable; control sequence numbers restart from the clock", self.path)
                self._reserved = {}
            self._next = dict(self._reserved)

    def next(self, kind: str) -> int:
        """The next sequence number of ``kind`` (> every earlier one, also across restarts)."""
        with self._lock:
            if kind not in self._next:
                # unknown kind (or lost file): start above anything a sane earlier run sent
                self._next[kind] = max(self._reserved.get(kind, 0), int(time.time() * 1000))
            n = self._next[kind] + 1
            self._next[kind] = n
            if n >= self._reserved.get(kind, 0):
                self._reserved[kind] = n + self.block
                self._save()
            return n

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps(self._reserved))
        except OSError as exc:
            log.warning("could not save %s: %s", self.path, exc)


@dataclasses.dataclass(slots=True)
class _Key:
    """One trusted key of a node: pinned in the configuration, or from a certificate."""

    b64: str
    pub: Ed25519PublicKey
    verify: Callable[[bytes, bytes], None]
    role: str
    pinned: bool
    expires: float | None = None  # unix s; None: never (a pin, or a certificate without expiry)
    issued: float = 0.0  # the certificate's issued time (a newer certificate of the key replaces it)
    cert_sig: str | None = None  # the signature of the certificate it came from (already verified)


class TrustStore:
    """Public keys of the federation's members, and the federation's revocation list.

    A node may hold more than one key at a time: a renewal with a new key
    (``dflctl keys renew NODE --new-key``) gives it a second certificate, and both keys verify
    until the old one's certificate expires or is revoked (at most :data:`MAX_KEYS_PER_NODE`
    keys per node, the newest kept).  A certificate of a key already trusted that was issued
    later (a renewal with the same key) replaces its validity.  Every use of a key checks it
    (:meth:`resolve`): not revoked (:attr:`revocations`), not expired.

    Args:
        federation: the federation id certificates must name.
        pinned: ``node_id -> base64 public key`` (trusted unconditionally; a revocation list
            still revokes it).
        federation_key: base64 public key that signs device certificates and revocation lists
            (``None``: certificates are not accepted, no revocation list verifies).
        clock: unix time source (certificate validity).
        operators: ``node_id -> base64 public key`` of pinned operators.
        revocations: the node's :class:`~dfl_agent.security.revocation.Revocations` (None: one
            in memory only).

    Raises:
        SecurityError: a pinned key or the federation key is not a valid public key
            (the message names the node id).
    """

    def __init__(self, federation: str, pinned: Mapping[str, str] | None = None,
                 federation_key: str | None = None, clock: Callable[[], float] = time.time,
                 operators: Mapping[str, str] | None = None, revocations: Revocations | None = None):
        self.federation = federation
        self._clock = clock
        #: node_id -> its keys, newest first
        self._nodes: dict[str, list[_Key]] = {}
        self._pinned: set[str] = set()
        for role, table in (("device", pinned), ("operator", operators)):
            for node_id, text in (table or {}).items():
                try:
                    pub = parse_public_key(str(text))
                except SecurityError as exc:
                    raise SecurityError(f"{node_id}: {exc}") from None
                self._nodes[node_id] = [_Key(str(text).strip(), pub, verifier(pub), role, pinned=True)]
                self._pinned.add(node_id)
        self.federation_key = parse_public_key(federation_key) if federation_key else None
        #: the federation's newest verified revocation list
        self.revocations = revocations if revocations is not None else Revocations(federation, self.federation_key)
        self._noted: set[tuple[str, str, float]] = set()
        #: (certificate signature, revocation list number) -> why it was refused (expired, revoked)
        self._refused: dict[tuple[str, int], str] = {}

    # -- the one check every verifying path makes --------------------------------------
    def resolve(self, node_id: str, cert: object = None) -> tuple[Callable[[bytes, bytes], None] | None, str | None]:
        """The key to check a signature of ``node_id`` with, given the certificate its message
        carries (``cert``, may be None): the certificate's key when it is one of the node's
        (learnt now when the certificate is valid and new), else the node's newest key.

        Returns:
            ``(verify, None)``, or ``(None, reason)``: ``"revoked"`` (the revocation list names
            the node or that key), ``"expired"`` (its certificate expired; logged once per
            node and date, naming both), ``"not_yet_valid"`` (issued after this device's clock
            reading: a clock problem, logged once), ``"unknown_sender"`` (no key at all).
        """
        self.revocations.refresh()
        key: _Key | None = None
        if isinstance(cert, dict) and cert.get("node_id") == node_id and self.federation_key is not None:
            key = self._key(node_id, cert.get("public_key"))
            sig = cert.get("sig")
            if (key is None or (not key.pinned and key.cert_sig != sig)) and isinstance(sig, str):
                memo = (sig, self.revocations.number)
                why = self._refused.get(memo)
                if why is None:
                    why = self._learn(node_id, cert)
                    if why in ("expired", "revoked") and len(self._refused) < 1024:
                        self._refused[memo] = why  # the same certificate again: no second check
                if why not in (None, "unknown_sender") and key is None:  # a known key may be valid by a newer one
                    return None, why
                key = self._key(node_id, cert.get("public_key"))
        if key is None:
            keys = self._nodes.get(node_id)
            if not keys:
                return None, ("revoked" if self.revocations.revoked(node_id) else "unknown_sender")
            key = keys[0]
        return self._usable(node_id, key)

    def _learn(self, node_id: str, cert: dict[str, Any]) -> str | None:
        """:meth:`add_certificate` for :meth:`resolve`: None when learnt, else the reason it was refused."""
        try:
            self.add_certificate(cert)
        except CertificateExpired as exc:
            self._note("expired", exc)
            return "expired"
        except CertificateNotYetValid as exc:
            self._note("not_yet_valid", exc)
            return "not_yet_valid"
        except KeyRevoked:
            return "revoked"
        except SecurityError as exc:
            log.debug("certificate in a message from %s rejected: %s", node_id, exc)
            return "unknown_sender"
        return None

    def _key(self, node_id: str, b64: object) -> _Key | None:
        return next((k for k in self._nodes.get(node_id, ()) if k.b64 == b64), None)

    def _usable(self, node_id: str, key: _Key) -> tuple[Callable[[bytes, bytes], None] | None, str | None]:
        if self.revocations.revoked(node_id, key.b64) is not None:
            return None, "revoked"
        if key.expires is not None and self._clock() > key.expires:
            self._note("expired", CertificateExpired(node_id, key.expires))
            return None, "expired"
        return key.verify, None

    def _note(self, what: str, exc: CertificateExpired | CertificateNotYetValid) -> None:
        """Log a refused certificate once per node, kind and date (one line naming both)."""
        mark = (exc.node_id, what, exc.expires if isinstance(exc, CertificateExpired) else exc.issued)
        if mark in self._noted or len(self._noted) > 4096:
            return
        self._noted.add(mark)
        log.warning("refused %s: %s", "a certificate" if what == "expired" else "a certificate (clock problem)", exc)

    def usable_keys(self, node_id: str) -> list[str]:
        """The base64 keys of ``node_id`` that verify now (not expired, not revoked), newest first."""
        return [k.b64 for k in self._nodes.get(node_id, ()) if self._usable(node_id, k)[0] is not None]

    def revoked(self, node_id: str) -> bool:
        """Whether the revocation list revokes ``node_id`` as a whole, or every key it had."""
        self.revocations.refresh()
        if self.revocations.revoked(node_id) is not None:
            return True
        keys = self._nodes.get(node_id) or []
        return bool(keys) and all(self.revocations.revoked(node_id, k.b64) is not None for k in keys)

    def _newest(self, node_id: str) -> _Key | None:
        self.revocations.refresh()
        return next((k for k in self._nodes.get(node_id, ()) if self._usable(node_id, k)[0] is not None), None)

    # -- queries ---------------------------------------------------------------------------
    def role_of(self, node_id: str) -> str | None:
        """``"device"``, ``"operator"`` (pinned in ``security.operators`` or by an
        operator certificate), or ``None`` for an untrusted, expired or revoked id."""
        k = self._newest(node_id)
        return k.role if k is not None else None

    def trusted(self) -> dict[str, str]:
        """``node_id -> base64 public key`` (the newest usable one) of every trusted node."""
        return {n: k.b64 for n in list(self._nodes) if (k := self._newest(n)) is not None}

    def add_certificate(self, cert: Any) -> str:
        """Trust the node named by a valid certificate; return its node id.  A new key of a
        known node is added beside its others (renewal with a new key); a certificate of a
        known key issued later than the one known replaces its validity (renewal).

        Raises:
            CertificateExpired, CertificateNotYetValid: outside its validity (the message
                names the node and the date).
            KeyRevoked: the revocation list names the node or its key.
            SecurityError: no federation key configured, an invalid certificate, or a
                certificate that contradicts a pinned key.
        """
        if self.federation_key is None:
            raise SecurityError("no federation key configured; certificates are not accepted")
        node_id, b64 = verify_certificate(cert, self.federation_key, self.federation, self._clock())
        hit = self.revocations.revoked(node_id, b64)
        if hit is not None:
            raise KeyRevoked(f"node {node_id}{'' if hit.public_key is None else ' (this key)'} is revoked "
                             f"by revocation list {self.revocations.number}: {hit.reason}")
        role = certificate_role(cert)
        if node_id in self._pinned:
            pin = self._nodes[node_id][-1]
            if pin.b64 != b64:
                raise SecurityError(f"certificate for {node_id} contradicts its pinned key")
            if pin.role != role:
                raise SecurityError(f"certificate for {node_id} gives role {role}, its pin another")
            return node_id
        keys = list(self._nodes.get(node_id, ()))  # replaced, never changed in place: other threads read it
        old = self._key(node_id, b64)
        issued = float(cert["issued"])
        if old is not None:
            if issued > old.issued or (issued == old.issued and old.cert_sig is None):
                old.role, old.expires, old.issued, old.cert_sig = role, cert["expires"], issued, cert["sig"]
                log.info("renewed trust in %s (%s) by a newer certificate", node_id, role)
            return node_id
        pub = parse_public_key(b64)
        keys.append(_Key(b64, pub, verifier(pub), role, pinned=False, expires=cert["expires"], issued=issued,
                         cert_sig=cert["sig"]))
        keys = sorted(keys, key=lambda k: k.issued, reverse=True)[:MAX_KEYS_PER_NODE]
        self._nodes[node_id] = keys
        log.info("trusted %s (%s) by its federation certificate%s", node_id, role,
                 f" ({len(keys)} keys)" if len(keys) > 1 else "")
        return node_id


class SecurityGuard:
    """Signs this node's envelopes and checks received ones (see the module docstring).

    Args:
        node_id: this node.
        key: this node's private key (``None``: send unsigned).
        trust: the federation's :class:`TrustStore`.
        require_signatures: reject unsigned messages and unknown senders, and make only
            trusted peers members (:meth:`is_member`).
        certificate: this node's device certificate, sent in every envelope's ``cert``
            field so that receivers can trust it without a pin.
        replay_window: largest accepted difference between an envelope's send time and
            our clock, seconds (covers clock skew between devices).
        max_seen: most message ids remembered.
        clock: unix time source.
    """

    def __init__(self, node_id: str, key: Ed25519PrivateKey | None, trust: TrustStore, *,
                 require_signatures: bool = False, certificate: dict[str, Any] | None = None,
                 replay_window: float = 300.0, max_seen: int = 65536,
                 clock: Callable[[], float] = time.time, seq: SeqCounter | None = None):
        if not replay_window > 0:
            raise ValueError("replay_window must be > 0 seconds")
        self.node_id = node_id
        self.key = key
        self._sign = signer(key) if key is not None else None
        self.trust = trust
        self.require_signatures = require_signatures
        self.certificate = certificate
        self.replay_window = float(replay_window)
        self.max_seen = max_seen
        self._clock = clock
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._floor = float("-inf")  # messages sent at or before this time are replays
        self._rounds: dict[tuple[str, str], tuple[int, float]] = {}
        self.public_key = public_key_b64(key) if key is not None else None
        #: control sequence numbers of this node (persist them: ``SeqCounter(state_dir / SEQ_FILE)``)
        self.seq = seq if seq is not None else SeqCounter(None)
        #: newest verified control ``seq`` per (sender, kind); bounded by the trusted ids
        self._control_seq: dict[tuple[str, str], int] = {}
        self._control_sig: dict[tuple[str, str], str] = {}
        #: dropped control messages by reason (see :data:`CONTROL_REJECT_REASONS`)
        self.control_dropped: collections.Counter[str] = collections.Counter()

    # -- sending --------------------------------------------------------------
    def sign(self, body: bytes) -> str:
        """``"ed25519:" + base64(signature of body)``.

        Raises:
            RuntimeError: no private key.
        """
        if self._sign is None:
            raise RuntimeError("no private key to sign with")
        return SIG_PREFIX + base64.b64encode(self._sign(body)).decode()

    def sign_control(self, kind: str, payload: dict[str, Any], federation: str | None = None) -> bytes:
        """A control envelope (see the module docstring) for ``payload`` of ``kind``
        ("presence", "status", "run", ...), signed when this node has a key, with the
        next sequence number of ``kind``.

        Raises:
            ValueError: ``payload`` is not a JSON-serialisable dict.
        """
        if not isinstance(payload, dict):
            raise ValueError("control payload must be a dict")
        env: dict[str, Any] = {"ctl": CONTROL_VERSION, "kind": kind, "fed": federation or self.trust.federation,
                               "sender": self.node_id, "seq": self.seq.next(kind), "time": self._clock(),
                               "payload": payload, "cert": self.certificate}
        env["sig"] = self.sign(canonical(env)) if self.key is not None else None
        return json.dumps(env, separators=(",", ":")).encode()

    def verify_control(self, frame: bytes | bytearray, kind: str | None = None,
                       sender: str | None = None) -> tuple[str, str, dict[str, Any]]:
        """Check a received control message; return ``(sender, role, payload)``.

        ``kind``/``sender``, when given, must match the envelope (the topic it came on).
        ``role`` is ``"device"``/``"operator"`` for a verified sender, ``"unverified"``
        for an unsigned or untrusted message accepted because signatures are not
        required.  A payload that is not an envelope (older wire version) is unsigned.
        Each rejection is counted in :attr:`control_dropped`.

        Raises:
            ControlRejected: with ``reason`` in :data:`CONTROL_REJECT_REASONS`.
        """
        try:
            return self._verify_control(frame, kind, sender)
        except ControlRejected as exc:
            if exc.reason != "duplicate":  # the same retained message delivered again
                self.control_dropped[exc.reason] += 1
            raise

    def verify_will(self, frame: bytes | bytearray, sender: str | None = None) -> tuple[str, str, dict[str, Any]]:
        """Check a received last will (see the module docstring): every check of
        :meth:`verify_control` for a ``"presence"`` on ``sender``'s topic but the sequence
        rule, and the payload must be a will (:func:`is_will`, else ``malformed``); the very
        will again is a ``duplicate``.  Binding it to the sender's current connection (its
        ``session``) is the caller's part.

        Raises:
            ControlRejected: with ``reason`` in :data:`CONTROL_REJECT_REASONS`.
        """
        try:
            return self._verify_control(frame, "presence", sender, will=True)
        except ControlRejected as exc:
            if exc.reason != "duplicate":
                self.control_dropped[exc.reason] += 1
            raise

    def _verify_control(self, frame: bytes | bytearray, kind: str | None, sender: str | None,
                        will: bool = False) -> tuple[str, str, dict[str, Any]]:
        try:  # bounded: size by kind (64 KiB for presence, status, run descriptors), depth 32
            env = bounded_loads(frame, max_bytes=control_limit(kind))
        except JSONBoundError as exc:  # oversized, too_deep, malformed
            raise ControlRejected(exc.reason, str(exc)) from None
        if not isinstance(env, dict):
            raise ControlRejected("malformed", "not an object")
        if "ctl" not in env:  # an older wire version: a bare, unsigned payload
            if self.require_signatures:
                raise ControlRejected("unsigned", f"bare {kind} payload")
            return str(sender or env.get("node_id") or "?"), "unverified", env
        snd, knd, seq, payload = env.get("sender"), env.get("kind"), env.get("seq"), env.get("payload")
        if (env.get("ctl") != CONTROL_VERSION or not isinstance(snd, str) or not isinstance(knd, str)
                or not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(payload, dict)
                or not isinstance(env.get("time"), (int, float))):
            raise ControlRejected("malformed", "bad envelope fields")
        if env.get("fed") != self.trust.federation:
            raise ControlRejected("wrong_federation", str(env.get("fed")))
        if kind is not None and knd != kind:
            raise ControlRejected("wrong_kind", f"{knd} on a {kind} topic")
        if sender is not None and snd != sender:
            raise ControlRejected("wrong_sender", f"{snd} on the topic of {sender}")
        sig = env.get("sig")
        if sig is None:
            if self.require_signatures:
                raise ControlRejected("unsigned", f"{knd} of {snd}")
            return snd, "unverified", payload
        pub, why = self.trust.resolve(snd, env.get("cert"))
        if pub is None:
            if why == "revoked" or self.require_signatures:
                raise ControlRejected(why or "unknown_sender", f"{knd} of {snd}")
            return snd, "unverified", payload
        try:
            if not isinstance(sig, str) or not sig.startswith(SIG_PREFIX):
                raise ValueError("no ed25519 prefix")
            pub(base64.b64decode(sig[len(SIG_PREFIX):], validate=True),
                canonical({k: v for k, v in env.items() if k != "sig"}))
        except (binascii.Error, ValueError, InvalidSignature):
            raise ControlRejected("bad_signature", f"{knd} of {snd}") from None
        if will:  # no sequence rule: the caller binds the will to the sender's connection
            if not is_will(payload):
                raise ControlRejected("malformed", f"{knd} of {snd} is not a last will")
            if self._control_sig.get((snd, "will")) == sig:
                raise ControlRejected("duplicate", f"the last will of {snd} again")
            self._control_sig[(snd, "will")] = sig
            return snd, self.trust.role_of(snd) or "unverified", payload
        last = self._control_seq.get((snd, knd))
        if last is not None and seq <= last:
            if seq == last and self._control_sig.get((snd, knd)) == sig:
                raise ControlRejected("duplicate", f"{knd} of {snd}: seq {seq} again")  # not counted
            raise ControlRejected("replay", f"{knd} of {snd}: seq {seq} <= {last}")
        self._control_seq[(snd, knd)] = seq
        self._control_sig[(snd, knd)] = sig
        return snd, self.trust.role_of(snd) or "unverified", payload

    def role_of(self, sender: str) -> str:
        """``"device"``, ``"operator"`` or ``"unverified"`` (no trusted key)."""
        return self.trust.role_of(sender) or "unverified"

    # -- membership -----------------------------------------------------------
    def is_member(self, node_id: str) -> bool:
        """True when ``node_id`` may take part (always, unless signatures are required):
        a trusted *device* - operators submit runs, they never train."""
        return not self.require_signatures or self.trust.role_of(node_id) == "device"

    def learn(self, node_id: str, cert: object) -> bool:
        """Trust ``node_id`` by a certificate it announced (presence); False when invalid."""
        if cert is None or self.trust.federation_key is None:
            return False
        try:
            return self.trust.add_certificate(cert) == node_id
        except SecurityError as exc:
            log.warning("ignored the certificate announced by %s: %s", node_id, exc)
            return False

    # -- receiving ------------------------------------------------------------
    def check(self, header: Mapping[str, Any], *, remember_round: bool = True,
              signed_bytes: bytes | None = None, verdict: str | None = None) -> str | None:
        """Check a received, already decoded envelope header (a dict, ``sig`` included).

        Returns ``None`` when the message may be used, else the rejection reason
        (one of :data:`REJECT_REASONS`).  Accepted signed messages are remembered for
        replay detection.  With ``remember_round=False`` their (sender, kind) round is
        not: the caller checks the message further and calls :meth:`remember_round` once
        it passed every check, so that a bad message (a far future round, wrong tensors)
        cannot make the sender's genuine messages look like replays.

        ``signed_bytes``: see :meth:`verify`.  ``verdict``: what :meth:`verify` already
        returned for this very header (e.g. computed on the MQTT network thread), so
        that only the replay rules are left to check here.
        """
        if verdict is None:
            verdict = self.verify(header, signed_bytes)
        if verdict == PASS:
            return None
        if verdict != VERIFIED:
            return verdict
        return self._replay_check(header, remember_round)

    def verify(self, header: Mapping[str, Any], signed_bytes: bytes | None = None) -> str:
        """The signature part of :meth:`check`, without its replay rules (no state of
        this guard changes but the trust store learning a valid certificate, so it may
        run on another thread than :meth:`check`).

        ``signed_bytes``: the canonical bytes the header was parsed from, exactly as
        received (:attr:`dfl_agent.transport.wire.Header.signed_bytes`, passed straight
        from the decoder, never for a header changed since): the signature is verified
        over them, without serialising the header again; when it does not verify over
        them it is verified over the canonical form of ``header`` as without them.

        Returns:
            :data:`VERIFIED` (signed by the sender's trusted key), :data:`PASS`
            (unsigned or from an unknown sender, accepted because signatures are not
            required), or the rejection reason (``unsigned``, ``unknown_sender``,
            ``bad_signature``).
        """
        sig = header.get("sig")
        sender = header.get("sender")
        if sig is None:
            return "unsigned" if self.require_signatures else PASS
        pub, why = self.trust.resolve(sender, header.get("cert")) if isinstance(sender, str) else (None, None)
        if pub is None:  # a revoked key is refused also where signatures are not required
            return (why or "unknown_sender") if why == "revoked" or self.require_signatures else PASS
        if not isinstance(sig, str) or not sig.startswith(SIG_PREFIX):
            return "bad_signature"
        try:
            raw = base64.b64decode(sig[len(SIG_PREFIX):], validate=True)
            try:
                if signed_bytes is None:
                    raise InvalidSignature
                pub(raw, signed_bytes)
            except InvalidSignature:
                pub(raw, canonical({k: v for k, v in header.items() if k != "sig"}))
        except (binascii.Error, ValueError, InvalidSignature):
            return "bad_signature"
        return VERIFIED

    def remember_round(self, header: Mapping[str, Any]) -> None:
        """Record the round and send time of a message that passed :meth:`check` (with
        ``remember_round=False``) and every later check: an older round sent no later
        is then a replay."""
        sender, kind, rnd, sent = header["sender"], header["kind"], int(header["round"]), float(header["time"])
        last = self._rounds.get((sender, kind))
        if last is None or rnd >= last[0] or sent > last[1]:
            self._rounds[(sender, kind)] = (rnd, sent)

    def _replay_check(self, header: Mapping[str, Any], remember_round: bool = True) -> str | None:
        msg_id, sent, sender = header["msg_id"], float(header["time"]), header["sender"]
        kind, rnd = header["kind"], int(header["round"])
        now = self._clock()
        if msg_id in self._seen or abs(now - sent) > self.replay_window or sent <= self._floor:
            return "replay"
        last = self._rounds.get((sender, kind))
        if last is not None and rnd < last[0] and sent <= last[1]:
            return "replay"
        if remember_round:
            self.remember_round(header)
        self._seen[msg_id] = sent
        # forget ids that fell out of the window; keep at most max_seen
        while self._seen:
            oldest_id, oldest_t = next(iter(self._seen.items()))
            if now - oldest_t > self.replay_window:
                self._seen.popitem(last=False)
            elif len(self._seen) > self.max_seen:
                self._seen.popitem(last=False)
                self._floor = max(self._floor, oldest_t)
            else:
                break
        return None
