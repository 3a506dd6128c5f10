"""A read-only MQTT observer of a federation: retained presence and status topics.

Used by ``dflctl demo`` (live progress) and the fleet commands (``peers``, ``status``,
``watch``, ``run list|show|submit|cancel``), which connect it with their
:class:`~dfl_agent.cli.fleet.FleetTarget` (credentials, TLS).  It announces nothing and
publishes nothing.

A query answers from what the broker holds retained, so it must know when the broker has
delivered that: :meth:`Observer.settle` waits for the subscription's acknowledgement (SUBACK),
then for the acknowledgement of a *barrier*, an UNSUBSCRIBE sent right after the SUBSCRIBE.
A broker answers one client's packets in order and sends a subscription's retained messages
right after its SUBACK, so once the barrier's UNSUBACK is in, every retained message of the
subscribed topics has arrived (``tests/integration/test_fleet_settle.py`` checks it on
mosquitto with 203 retained statuses).  A broker that does not answer the barrier is waited
for until no message arrived for a quiet period.  Nothing is timed from before the connection
is up.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from dfl_agent.cli.fleet import observer_guard  # noqa: F401 - its home was here
from dfl_agent.jsonbound import JSONBoundError, RateLimitedLog
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.service.privacy_budget import PrivacyWatch
from dfl_agent.security.trust import is_will
from dfl_agent.transport.endpoint import parse_endpoint

if TYPE_CHECKING:
    from dfl_agent.cli.fleet import FleetTarget

log = logging.getLogger(__name__)


class Observer:
    """Subscribe to ``dfl/{federation}/node/+/{presence,status}`` on ``broker``.

    ``broker`` is a ``host:port`` (no credentials) or a :class:`~dfl_agent.cli.fleet.FleetTarget`
    (its broker, credentials, TLS and protocol; ``federation`` None: the target's).

    Attributes:
        statuses: node id -> latest status document (dict).
        presence: node id -> latest presence document (``{"state": "online"|"offline", ...}``).

    Raises:
        ConnectionError: from :meth:`start` (a :class:`~dfl_agent.cli.fleet.BrokerError`) when the
            broker cannot be used, saying why (refused, unknown host, TLS, not authorised, no answer).
    """

    def __init__(self, broker: str | FleetTarget, federation: str | None = None, protocol: str = "5"):
        from dfl_agent.cli.fleet import FleetTarget

        if isinstance(broker, FleetTarget):
            self.target = broker if federation is None else dataclasses.replace(broker, federation=federation)
        else:
            self.target = FleetTarget(broker=broker, federation=federation or "default",
                                      protocol="5" if protocol == "5" else "3.1.1")
        self.host, self.port = parse_endpoint(self.target.broker)
        self.federation = self.target.federation
        self.statuses: dict[str, dict[str, Any]] = {}
        self.presence: dict[str, dict[str, Any]] = {}
        #: run id -> latest retained run descriptor message (parsed JSON, not verified)
        self.runs: dict[str, dict[str, Any]] = {}
        #: run id -> the raw retained message of :attr:`runs` (for verification)
        self.run_payloads: dict[str, bytes] = {}
        #: run id -> the raw retained cancel record on ``dfl/{fed}/run/{id}/cancel`` (not verified)
        self.run_cancels: dict[str, bytes] = {}
        #: devices whose reported privacy epsilon went down while this observer ran
        self.privacy_watch = PrivacyWatch()
        #: messages dropped by reason (``handler_error``: handling one raised)
        self.dropped: collections.Counter[str] = collections.Counter()
        self._errors = RateLimitedLog(log)
        #: monotonic time of the last retained message, or of the SUBACK (None before it)
        self.updated: float | None = None
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._subscribed = threading.Event()  # SUBACK of the subscriptions
        self._synced = threading.Event()  # UNSUBACK of the barrier: the retained messages are in
        self._sub_mid: int | None = None
        self._barrier_mid: int | None = None
        #: SecurityGuard verifying presence/status (set before start; None: all "unverified"); it
        #: also verifies the federation's revocation list (``dfl/{fed}/revocations``)
        self.guard: Any = None
        #: the retained revocation list as received (not verified), or None
        self.revocations_payload: bytes | None = None
        #: (leaf, node id) -> the public key its newest presence/status certificate names
        self._keys: dict[tuple[str, str], str | None] = {}
        self._client = self.target.session("dflctl")
        self._client.on_connect = self._on_connect
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._client.on_unsubscribe = self._on_unsubscribe

    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        base = f"dfl/{self.federation}/node/+/"
        self._subscribed.clear()
        self._synced.clear()
        self._sub_mid = client.subscribe([(f"dfl/{self.federation}/revocations", 0),
                                          (base + "status", 0), (base + "presence", 0),
                                          (f"dfl/{self.federation}/run/+", 0),
                                          (f"dfl/{self.federation}/run/+/cancel", 0)])[1]
        # the barrier (see the module docstring): a topic nobody publishes on and this client
        # never subscribed to, so its UNSUBACK carries no message and needs no ACL grant
        self._barrier_mid = client.unsubscribe(f"dfl/{self.federation}/dflctl/barrier")[1]
        self._connected.set()

    def _on_subscribe(self, client, userdata, mid, reason_codes=None, properties=None) -> None:
        if mid == self._sub_mid:
            with self._lock:
                self.updated = time.monotonic()
            self._subscribed.set()

    def _on_unsubscribe(self, client, userdata, mid, reason_codes=None, properties=None) -> None:
        if mid == self._barrier_mid:
            with self._lock:  # the quiet period after the barrier starts at its acknowledgement
                self.updated = time.monotonic()
            self._synced.set()

    def _on_message(self, client, userdata, msg) -> None:
        try:
            self._handle(msg)
        except Exception:  # noqa: BLE001 - one bad message never ends paho's thread
            with self._lock:
                self.dropped["handler_error"] += 1
            self._errors.exception("observer: error handling a message on %s", getattr(msg, "topic", "?"))

    def _handle(self, msg: Any) -> None:
        parts = msg.topic.split("/")
        if len(parts) == 3 and parts[2] == "revocations":
            self.revocations_payload = bytes(msg.payload) if msg.payload else None
            guard = getattr(self, "guard", None)
            if msg.payload and guard is not None:  # verified with the federation key, newest kept
                why = guard.trust.revocations.offer(bytes(msg.payload), count=False)
                if why not in (None, "duplicate"):
                    with self._lock:
                        self.dropped[f"revocations_{why}"] += 1
            with self._lock:
                self.updated = time.monotonic()
            return
        if len(parts) == 4 and parts[2] == "run":
            from dfl_agent.runtime.shared.descriptor import open_run_message

            run = open_run_message(msg.payload) if msg.payload else None
            with self._lock:
                if run is not None:
                    self.runs[parts[3]] = run
                    self.run_payloads[parts[3]] = bytes(msg.payload)
                else:
                    self.runs.pop(parts[3], None)
                    self.run_payloads.pop(parts[3], None)
                self.updated = time.monotonic()
            return
        if len(parts) == 5 and parts[2] == "run" and parts[4] == "cancel":
            with self._lock:
                if msg.payload:
                    self.run_cancels[parts[3]] = bytes(msg.payload)
                else:
                    self.run_cancels.pop(parts[3], None)
                self.updated = time.monotonic()
            return
        if len(parts) != 5:
            return
        node, leaf = parts[3], parts[4]
        doc, trust = self._open(leaf, node, msg.payload)
        if doc is None:
            return
        doc = {**doc, "trust": trust, "verified": trust in ("device", "operator")}
        key = self._signing_key(msg.payload)
        with self._lock:
            self._keys[(leaf, node)] = key
            if leaf == "presence" and is_will(doc) and self._stale_will(node, doc):
                self.dropped["presence_stale_will"] += 1  # of an earlier connection: the node is back
                return
            if leaf == "presence" and "descriptor" not in doc and node in self.presence:
                # keep what the node advertised while online (address, profile) after it leaves
                doc = {**doc, "descriptor": self.presence[node].get("descriptor")}
            (self.statuses if leaf == "status" else self.presence)[node] = doc
            self.updated = time.monotonic()
        if leaf == "status" and not trust.startswith("untrusted"):
            self.privacy_watch.observe(node, doc.get("privacy"))

    @staticmethod
    def _signing_key(payload: bytes) -> str | None:
        """The public key named by the certificate of a signed presence/status (None: none)."""
        try:
            env = bounded_loads(payload, "status")
        except JSONBoundError:
            return None
        cert = env.get("cert") if isinstance(env, dict) else None
        key = cert.get("public_key") if isinstance(cert, dict) else None
        return key if isinstance(key, str) else None

    def _mark_revoked(self, leaf: str, docs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``docs`` with ``trust = "revoked"`` (and the entry's ``revoked`` reason) for every node
        the verified revocation list names, or whose signing key it names, whatever arrived first
        (the caller holds the lock)."""
        guard = getattr(self, "guard", None)
        if guard is None or guard.trust.revocations.current is None:
            return dict(docs)
        out = {}
        for node, doc in docs.items():
            hit = guard.trust.revocations.revoked(node, self._keys.get((leaf, node)))
            out[node] = {**doc, "trust": "revoked", "verified": False, "revoked": hit.reason} if hit else doc
        return out

    def _stale_will(self, node: str, will: dict[str, Any]) -> bool:
        """Whether ``node``'s last will ``will`` is of an earlier connection than the one its
        current online presence names (a late or replayed will; the caller holds the lock)."""
        p = self.presence.get(node) or {}
        return p.get("state") == "online" and isinstance(p.get("session"), str) and p["session"] != will["session"]

    def _open(self, leaf: str, node: str, payload: bytes) -> tuple[dict[str, Any] | None, str]:
        """A presence/status document and its trust: ``"device"``/``"operator"`` when its
        signature verified with :attr:`guard` (a SecurityGuard from ``--config``),
        ``"unverified"`` without trust material, ``"revoked"`` when the federation's revocation
        list names the sender or its key, ``"untrusted: REASON"`` when it failed otherwise.
        A last will (:func:`~dfl_agent.security.trust.is_will`) is verified as one
        (:meth:`~dfl_agent.security.SecurityGuard.verify_will`)."""
        if not payload:
            return {"state": "offline"}, "unverified"
        try:  # bounded: 64 KiB, nesting depth 32
            env = bounded_loads(payload, leaf if leaf in ("presence", "status") else "control")
        except JSONBoundError as exc:
            return None, f"untrusted: {exc.reason}"
        if not isinstance(env, dict):
            return None, "untrusted: malformed"
        inner = env.get("payload") if "ctl" in env else env
        if not isinstance(inner, dict):
            return None, "untrusted: malformed"
        guard = getattr(self, "guard", None)
        if guard is None:
            return inner, "unverified"
        from dfl_agent.security.trust import ControlRejected

        try:
            if leaf == "presence" and is_will(inner):
                _sender, role, _p = guard.verify_will(payload, node)
            else:
                _sender, role, _p = guard.verify_control(payload, leaf, node)
        except ControlRejected as exc:
            if exc.reason == "duplicate":
                return inner, guard.role_of(node)
            return inner, "revoked" if exc.reason == "revoked" else f"untrusted: {exc.reason}"
        return inner, role

    def start(self, timeout: float = 10.0) -> Observer:
        self.target.connect(self._client, timeout)  # raises BrokerError, saying why
        return self

    def seen_anything(self) -> bool:
        """Whether any presence, status or run of the federation has arrived."""
        with self._lock:
            return bool(self.presence or self.statuses or self.runs)

    def settle(self, quiet: float = 0.1, fallback: float = 0.5, limit: float = 5.0) -> bool:
        """Wait until the broker has delivered the retained messages of the subscribed topics
        (call after :meth:`start`).

        The wait starts when the broker acknowledged the subscription (SUBACK), never
        before the connection is up; it ends ``quiet`` s after the barrier's acknowledgement
        (see the module docstring) with no message since, or, with a broker that does
        not answer the barrier, once no message arrived for ``fallback`` s after the SUBACK;
        at most ``limit`` s in all.

        Returns:
            True when the barrier was acknowledged (every retained message is in), False
            when the wait ended on the quiet period or on ``limit``.
        """
        end = time.monotonic() + limit
        if not self._subscribed.wait(limit):
            return False
        synced = False
        while time.monotonic() < end:
            synced = synced or self._synced.is_set()
            with self._lock:
                since = time.monotonic() - (self.updated or 0.0)
            if since >= (quiet if synced else fallback):
                return synced
            if synced:
                time.sleep(0.02)
            else:
                self._synced.wait(0.02)
        return synced

    def snapshot(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """``(statuses, presence)``: node id -> document (see the class), each with its ``trust``:
        ``"revoked"`` for a node the federation's verified revocation list names."""
        with self._lock:
            return self._mark_revoked("status", self.statuses), self._mark_revoked("presence", self.presence)

    def stop(self) -> None:
        """Disconnect and stop the network loop (the DISCONNECT wakes the loop at once)."""
        self._client.disconnect()
        self._client.loop_stop()
