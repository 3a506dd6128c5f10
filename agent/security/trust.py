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
``bad_signature``
    the Ed25519 signature over the canonical header (which holds the payload's SHA-256)
    does not verify with the sender's key;
``replay``
    a message id already accepted, a send time outside ``replay_window`` seconds of
    our clock, or a lower round than one already accepted from the same sender and
    kind that was also sent earlier (a restarted sender - lower round, later time -
    is accepted).

``wrong_federation`` is checked before, by :func:`dfl_agent.transport.wire.decode`.

Memory: message ids are remembered for the replay window, at most ``max_seen`` of
them; when that memory is full the oldest id is forgotten and messages sent before
it are rejected as replays (the window shrinks, it never opens).  Per-sender round
records exist only for senders whose signature verified (bounded by the federation).
"""

from __future__ import annotations

import base64
import binascii
import collections
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dfl_agent.security.keys import SecurityError, canonical, parse_public_key, public_key_b64, verify_certificate

log = logging.getLogger(__name__)

REJECT_REASONS = ("unsigned", "unknown_sender", "bad_signature", "replay")
SIG_PREFIX = "ed25519:"


class TrustStore:
    """Public keys of the federation's members.

    Args:
        federation: the federation id certificates must name.
        pinned: ``node_id -> base64 public key`` (trusted unconditionally).
        federation_key: base64 public key that signs device certificates (``None``:
            certificates are not accepted).
        clock: unix time source (certificate expiry).

    Raises:
        SecurityError: a pinned key or the federation key is not a valid public key
            (the message names the node id).
    """

    def __init__(self, federation: str, pinned: Mapping[str, str] | None = None,
                 federation_key: str | None = None, clock: Callable[[], float] = time.time):
        self.federation = federation
        self._clock = clock
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._pinned: set[str] = set()
        self._b64: dict[str, str] = {}
        for node_id, text in (pinned or {}).items():
            try:
                self._keys[node_id] = parse_public_key(text)
            except SecurityError as exc:
                raise SecurityError(f"{node_id}: {exc}") from None
            self._pinned.add(node_id)
            self._b64[node_id] = text.strip()
        self.federation_key = parse_public_key(federation_key) if federation_key else None

    def key_for(self, node_id: str) -> Ed25519PublicKey | None:
        """The trusted key of ``node_id``, or ``None``."""
        return self._keys.get(node_id)

    def is_trusted(self, node_id: str) -> bool:
        return node_id in self._keys

    def trusted(self) -> dict[str, str]:
        """``node_id -> base64 public key`` of every trusted node."""
        return dict(self._b64)

    def add_certificate(self, cert: Any) -> str:
        """Trust the node named by a valid device certificate; return its node id.

        Raises:
            SecurityError: no federation key configured, an invalid certificate, or a
                certificate that contradicts a pinned key.
        """
        if self.federation_key is None:
            raise SecurityError("no federation key configured; certificates are not accepted")
        node_id, b64 = verify_certificate(cert, self.federation_key, self.federation, self._clock())
        if node_id in self._pinned and self._b64[node_id] != b64:
            raise SecurityError(f"certificate for {node_id} contradicts its pinned key")
        if self._b64.get(node_id) != b64:
            self._keys[node_id] = parse_public_key(b64)
            self._b64[node_id] = b64
            log.info("trusted %s by its federation certificate", node_id)
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
                 clock: Callable[[], float] = time.time):
        if not replay_window > 0:
            raise ValueError("replay_window must be > 0 seconds")
        self.node_id = node_id
        self.key = key
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

    # -- sending --------------------------------------------------------------
    def sign(self, body: bytes) -> str:
        """``"ed25519:" + base64(signature of body)``.

        Raises:
            RuntimeError: no private key.
        """
        if self.key is None:
            raise RuntimeError("no private key to sign with")
        return SIG_PREFIX + base64.b64encode(self.key.sign(body)).decode()

    # -- membership -----------------------------------------------------------
    def is_member(self, node_id: str) -> bool:
        """True when ``node_id`` may take part (always, unless signatures are required)."""
        return not self.require_signatures or self.trust.is_trusted(node_id)

    def learn(self, node_id: str, cert: Any) -> bool:
        """Trust ``node_id`` by a certificate it announced (presence); False when invalid."""
        if cert is None or self.trust.federation_key is None:
            return False
        try:
            return self.trust.add_certificate(cert) == node_id
        except SecurityError as exc:
            log.warning("ignored the certificate announced by %s: %s", node_id, exc)
            return False

    # -- receiving ------------------------------------------------------------
    def check(self, header: Mapping[str, Any]) -> str | None:
        """Check a received, already decoded envelope header (a dict, ``sig`` included).

        Returns ``None`` when the message may be used, else the rejection reason
        (one of :data:`REJECT_REASONS`).  Accepted signed messages are remembered for
        replay detection.
        """
        sig = header.get("sig")
        sender = header.get("sender")
        if sig is None:
            return "unsigned" if self.require_signatures else None
        pub = self.trust.key_for(sender)
        cert = header.get("cert")
        if pub is None and cert is not None and self.trust.federation_key is not None:
            try:
                if self.trust.add_certificate(cert) == sender:
                    pub = self.trust.key_for(sender)
            except SecurityError as exc:
                log.debug("certificate in an envelope from %s rejected: %s", sender, exc)
        if pub is None:
            return "unknown_sender" if self.require_signatures else None
        if not isinstance(sig, str) or not sig.startswith(SIG_PREFIX):
            return "bad_signature"
        try:
            raw = base64.b64decode(sig[len(SIG_PREFIX):], validate=True)
            body = canonical({k: v for k, v in header.items() if k != "sig"})
            pub.verify(raw, body)
        except (binascii.Error, ValueError, InvalidSignature):
            return "bad_signature"
        return self._replay_check(header)

    def _replay_check(self, header: Mapping[str, Any]) -> str | None:
        msg_id, sent, sender = header["msg_id"], float(header["time"]), header["sender"]
        kind, rnd = header["kind"], int(header["round"])
        now = self._clock()
        if msg_id in self._seen or abs(now - sent) > self.replay_window or sent <= self._floor:
            return "replay"
        last = self._rounds.get((sender, kind))
        if last is not None and rnd < last[0] and sent <= last[1]:
            return "replay"
        if last is None or rnd >= last[0] or sent > last[1]:
            self._rounds[(sender, kind)] = (rnd, sent)
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
