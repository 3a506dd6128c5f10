"""A node's presence and status on MQTT, and their signatures: the control plane that
rides on the home session of :class:`~dfl_agent.transport.mqtt.MqttTransport`.

Topics of a federation ``{fed}`` (``{id}`` = node id)::

    dfl/{fed}/node/{id}/presence  retained JSON, QoS 1
        online:  {"state": "online", "node_id": id, "descriptor": {...}, "time": unix s,
                  "session": this connection's id}
        offline: {"state": "offline", "node_id": id, "time": unix s} (published when the
                 transport stops), or the MQTT last will: {"state": "offline", "node_id": id,
                 "time": when the connection opened, "reason": "last will", "session": its id};
        an empty retained payload (cleared) also means offline.
    dfl/{fed}/node/{id}/status    retained JSON, QoS 1: the dict given to
        ``publish_status`` plus "node_id", "time" (unix s), "heartbeat" (a counter) and
        "session"; republished every ``heartbeat_interval`` seconds, so it is also the heartbeat.

:class:`MqttPresence` is the transport's :class:`~dfl_agent.transport.mqtt.ControlChannel`:
the transport sets its last will on the home connection before connecting, subscribes
to ``+/presence`` and ``+/status`` on every broker connection, calls :meth:`MqttPresence.announce`
on every (re)connection of the home broker (presence "online", then the status), hands it
every message on those topics, ticks it from its maintenance thread (the heartbeat) and
lets it say goodbye (a signed "offline") when it stops.  A run process's presence
(:class:`~dfl_agent.runtime.run.hosted_presence.HostedPresence`) publishes none of these itself:
it hands its presence descriptor and statuses to its host and the supervisor signs and
publishes them (the supervisor's session also holds the node's last will).  If this node sees its own
presence turn "offline" while it runs (the late last will of an earlier run of the same
node id), it republishes "online".  :func:`node_transport` builds the two together.

Signed control plane: with ``control`` (a :class:`dfl_agent.security.SecurityGuard`)
presence and status payloads are the JSON above wrapped in a signed control envelope
(:meth:`~dfl_agent.security.SecurityGuard.sign_control`, kinds ``"presence"`` and
``"status"``, a sequence number per kind that survives restarts), and every received
one goes through :meth:`~dfl_agent.security.SecurityGuard.verify_control`: a rejected
one is dropped and counted as ``presence_{reason}`` / ``status_{reason}`` (reasons in
:data:`~dfl_agent.security.trust.CONTROL_REJECT_REASONS`), never handed on.  The MQTT
last will is signed when the home connection opens (before every connection attempt, with a
new ``session`` id: :func:`~dfl_agent.security.trust.will_payload`) and checked with
:meth:`~dfl_agent.security.SecurityGuard.verify_will`; a will whose ``session`` is not the
one of the node's newest presence or status (a late or replayed will of an earlier
connection) is dropped as ``presence_stale_will``.  With ``require_signatures`` a last will,
verified or an older agent's bare one (counted as ``presence_unsigned``), is only a hint: the
node stays a member until its status heartbeats stop for ``discovery.heartbeat_timeout`` (a
connection that breaks for a moment does not end a membership).  Without it a will is
obeyed at once.  Stopping publishes a signed "offline", which is obeyed at once.

Drop counters (in the transport's ``stats.dropped``): ``bad_presence``, ``bad_status``,
``presence_oversized`` / ``status_oversized`` (over 64 KiB), ``presence_too_deep`` /
``status_too_deep`` (nested deeper than 32 levels; every presence and status is parsed
by :func:`dfl_agent.jsonbound.loads` before any other use), ``presence_self_forged`` /
``status_self_forged`` (something this node did not sign on its own topics),
``presence_unsigned`` / ``status_unsigned``, ``status_not_member``, ``presence_stale_will``.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from dfl_agent.jsonbound import JSONBoundError, LogLimit
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.security.trust import is_will, will_payload
from dfl_agent.transport.endpoint import valid_endpoint
from dfl_agent.transport.mqtt import ControlChannel, MqttTransport, topic

#: the transport's logger: the log lines of presence and status keep their logger name
log = logging.getLogger("dfl_agent.transport.mqtt")

#: Called for every status message of another node: ``on_heartbeat(node_id, status_dict)``.
HeartbeatHandler = Callable[[str, "dict[str, Any]"], None]


class MqttPresence(ControlChannel):
    """Presence, status heartbeats and their signatures of node ``node_id``.

    Args:
        node_id, federation: the node and its federation (topic levels).
        descriptor: JSON-serialisable dict announced in the presence message.
        heartbeat_interval: seconds between republications of the status.
        on_heartbeat: ``on_heartbeat(node_id, status_dict)`` for every status message
            of another node (called on the transport's event loop).
        control: a :class:`~dfl_agent.security.SecurityGuard` that signs outgoing and
            verifies incoming presence/status, or None (bare JSON).

    Raises:
        ValueError: an invalid argument (the message names it).
    """

    leaves = ("presence", "status")

    def __init__(self, node_id: str, federation: str, *, descriptor: dict[str, Any],
                 heartbeat_interval: float = 5.0, on_heartbeat: HeartbeatHandler | None = None,
                 control: Any = None):
        if not isinstance(descriptor, dict):
            raise ValueError("descriptor: must be a dict")
        try:
            json.dumps(descriptor)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"descriptor: must be JSON-serialisable ({exc})") from None
        if not isinstance(heartbeat_interval, (int, float)) or not heartbeat_interval > 0:
            raise ValueError(f"heartbeat_interval: must be > 0 seconds, got {heartbeat_interval!r}")
        if on_heartbeat is not None and not callable(on_heartbeat):
            raise ValueError("on_heartbeat: must be callable or None")
        self.node_id = node_id
        self.federation = federation
        self.descriptor = dict(descriptor)
        self.heartbeat_interval = float(heartbeat_interval)
        self.period = self.heartbeat_interval
        self.on_heartbeat = on_heartbeat
        #: signs outgoing and verifies incoming presence/status (SecurityGuard or None)
        self.control = control
        #: latest status dict of every other node heard (node id -> status)
        self.statuses: dict[str, dict[str, Any]] = {}
        #: this node's home connection (a random id, new before every connection attempt:
        #: :meth:`will`), in its presence, statuses and last will
        self.session = secrets.token_hex(8)
        #: the newest connection of every other node, from its presence and statuses
        #: (node id -> session): a last will of another one is stale
        self.sessions: dict[str, str] = {}
        self._transport: MqttTransport | None = None
        self._lock = threading.RLock()
        self._status: dict[str, Any] | None = None
        self._heartbeat_seq = 0
        self._last_status_pub = 0.0
        self._t_presence = topic(federation, node_id, "presence")
        self._t_status = topic(federation, node_id, "status")
        self._drop_log = LogLimit(60.0, 5)  # dropped presence/status lines per (leaf, node, reason)

    # ----------------------------------------------------------- the channel

    def bind(self, transport: MqttTransport) -> None:
        self._transport = transport

    def _t(self) -> MqttTransport:
        if self._transport is None:
            raise RuntimeError("MqttPresence is not bound to a transport")
        return self._transport

    def will(self) -> tuple[str, bytes] | None:
        """The last will of the next connection attempt of the home connection, for a new
        session id, signed now (called before every attempt)."""
        self.session = secrets.token_hex(8)
        doc = will_payload(self.node_id, self.session)
        if self.control is not None:
            return self._t_presence, self.control.sign_control("presence", doc, self.federation)
        return self._t_presence, json.dumps(doc).encode()

    def announce(self, client: Any) -> None:
        self._say_online(client)
        if self._status is not None:
            self._publish_status_now(client)

    def _say_online(self, client: Any) -> None:
        """Presence "online" (retained) on ``client``."""
        client.publish(self._t_presence, self._presence_payload(True), qos=1, retain=True)

    def started(self) -> None:
        self._last_status_pub = time.monotonic()

    def tick(self) -> None:
        if time.monotonic() - self._last_status_pub >= self.heartbeat_interval:
            self._publish_status_now()

    def goodbye(self, client: Any) -> Any:
        return client.publish(self._t_presence, self._presence_payload(False), qos=1, retain=True)

    def on_message(self, home: bool, client: Any, sender: str, leaf: str, payload: bytes) -> None:
        if leaf == "presence":
            self._handle_presence(home, client, sender, payload)
        elif sender != self.node_id:
            self._handle_status(sender, payload)
        elif payload and not self._own_payload(payload):
            self._t().count("status_self_forged")  # someone else wrote on this node's topic

    # --------------------------------------------------------------- payloads

    def _presence_payload(self, online: bool, signed: bool = True) -> bytes:
        msg: dict[str, Any] = {"state": "online" if online else "offline", "node_id": self.node_id}
        if online:
            msg["descriptor"] = self.descriptor
            msg["session"] = self.session
        msg["time"] = time.time()
        if signed and self.control is not None:
            return self.control.sign_control("presence", msg, self.federation)
        return json.dumps(msg).encode()

    def _status_payload(self) -> bytes:
        with self._lock:
            self._heartbeat_seq += 1
            status = dict(self._status or {})
            status.update(node_id=self.node_id, time=time.time(), heartbeat=self._heartbeat_seq, session=self.session)
            self._last_status_pub = time.monotonic()
            if self.control is not None:
                return self.control.sign_control("status", status, self.federation)
        return json.dumps(status).encode()

    def _open_control(self, leaf: str, node_id: str, payload: bytes,
                      will: bool = False) -> tuple[dict[str, Any], str] | None:
        """The payload dict of a received presence/status and its sender's role, or
        None when dropped (counted as ``{leaf}_{reason}``).  Without ``control`` the
        payload is bare JSON (role "unverified").  ``will``: the presence is a last will
        (:meth:`~dfl_agent.security.SecurityGuard.verify_will`)."""
        count = self._t().count
        if self.control is None:
            try:  # bounded: 64 KiB, nesting depth 32
                msg = bounded_loads(payload, leaf)
            except JSONBoundError as exc:
                count(f"bad_{leaf}" if exc.reason == "malformed" else f"{leaf}_{exc.reason}")
                log.warning("%s: dropped %s of %r: %s", self.node_id, leaf, node_id, exc)
                return None
            if isinstance(msg, dict) and "ctl" in msg and isinstance(msg.get("payload"), dict):
                msg = msg["payload"]  # a signed peer, read without verifying (no trust material)
            if not isinstance(msg, dict):
                count(f"bad_{leaf}")
                return None
            return msg, "unverified"
        from dfl_agent.security.trust import ControlRejected

        try:
            if will:
                _sender, role, msg = self.control.verify_will(payload, node_id)
            else:
                _sender, role, msg = self.control.verify_control(payload, leaf, node_id)
        except ControlRejected as exc:
            if exc.reason == "duplicate":
                return None  # a retained message delivered again (reconnect): not a drop
            count(f"{leaf}_{exc.reason}")
            # a replay is most often an older copy queued for this session during a disconnect
            # (QoS 1), delivered after the newest: counted, and logged at debug level only.  Others
            # (a revoked node still connected, a forger) are logged 5 times per node and reason,
            # then once a minute: every heartbeat of theirs would flood the log
            if exc.reason == "replay":
                log.debug("%s: dropped %s on the topic of %r: %s", self.node_id, leaf, node_id, exc)
                return None
            log_it, held, _ = self._drop_log.check((leaf, node_id, exc.reason))
            if log_it:
                log.warning("%s: dropped %s on the topic of %r: %s%s", self.node_id, leaf, node_id, exc,
                            f" ({held} more not logged)" if held else "")
            return None
        return msg, role

    # ------------------------------------------------------------- receiving

    def _own_payload(self, payload: bytes) -> bool:
        """Whether a payload on this node's own topic was signed by this node."""
        if self.control is None or self.control.key is None:
            return True
        try:
            env = bounded_loads(payload, max_bytes=1 << 20)
            if not isinstance(env, dict) or env.get("sender") != self.node_id or not env.get("sig"):
                return False
            from dfl_agent.security.keys import canonical

            sig = env["sig"].split(":", 1)[1]
            import base64

            self.control.key.public_key().verify(base64.b64decode(sig),
                                                 canonical({k: v for k, v in env.items() if k != "sig"}))
            return True
        except Exception:  # noqa: BLE001 - anything that does not verify is not ours
            return False

    def _handle_presence(self, home: bool, client: Any, node_id: str, payload: bytes) -> None:
        t = self._t()
        descriptor: dict[str, Any] | None
        if node_id == self.node_id:
            # Our own topic: a stale last will of an earlier run, or a forgery: say we are
            # online.  Anything on it that this node did not sign (but a bare will) is counted.
            ours = not payload or self._own_payload(payload)
            if not ours and not self._is_bare_offline(payload):
                t.count("presence_self_forged")
            offline = not payload or not ours or b'"offline"' in payload
            if offline and home and t.running and client is not None:
                self._say_online(client)
            return
        signed_only = self.control is not None and self.control.require_signatures
        note = getattr(t.peers, "note_departure", None)  # how it went offline: its log line's level
        if not payload:
            descriptor = None
            if signed_only:
                t.count("presence_unsigned")  # a cleared topic: only a hint, liveness decides
                return
            if note is not None:
                note(node_id, "cleared")
        else:
            if signed_only and self._is_bare_offline(payload):
                t.count("presence_unsigned")  # an older agent's unsigned last will: a hint only
                self._will_hint(node_id, "unsigned")
                return
            will = self._is_will(payload)
            opened = self._open_control("presence", node_id, payload, will=will)
            if opened is None:
                return
            if will:
                if node_id in self.sessions and opened[0].get("session") != self.sessions[node_id]:
                    t.count("presence_stale_will")  # of an earlier connection: the node is back
                    log.debug("%s: stale last will of peer %s ignored", self.node_id, node_id)
                    return
                if signed_only:  # verified, yet a hint only: liveness decides (a short break ends no membership)
                    self._will_hint(node_id, "signed")
                    return
            elif isinstance(opened[0].get("session"), str):
                self.sessions[node_id] = opened[0]["session"]
            try:
                descriptor = self._descriptor_of(opened[0], node_id)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError included
                t.count("bad_presence")
                log.warning("%s: dropped presence of %r: %s", self.node_id, node_id, exc)
                return
            if descriptor is None and note is not None:
                note(node_id, self._departure(node_id, opened[0], payload))
            trust = getattr(t.peers, "trust_broker", None)
            broker = descriptor.get("broker") if descriptor is not None else None
            if opened[1] == "device" and trust is not None and isinstance(broker, str) and valid_endpoint(broker):
                trust(broker)  # signed by an enrolled member: mDNS records may name this broker
        t.dispatch(t.presence_handler, node_id, descriptor)

    def _will_hint(self, node_id: str, how: str) -> None:
        """A last will of ``node_id`` (``how``: "signed" or "unsigned") under
        ``require_signatures``: a hint only.  A live peer lost its connection (it may have
        missed messages: ``note_session_lost``); its heartbeats decide when it leaves."""
        peers = self._t().peers
        is_live = getattr(peers, "is_live", None)
        if is_live is not None and is_live(node_id):  # not a retained will of long ago
            log.warning("%s: peer %s lost its connection (its %s last will: crashed or cut off); "
                        "a member until its heartbeats stop", self.node_id, node_id, how)
            lost = getattr(peers, "note_session_lost", None)
            if lost is not None:  # back within its heartbeat timeout, it may have missed messages
                lost(node_id)
        else:
            log.debug("%s: %s last will of peer %s ignored (not live)", self.node_id, how, node_id)

    def _departure(self, node_id: str, msg: dict[str, Any], payload: bytes) -> str:
        """How ``node_id``'s presence went offline (a :data:`dfl_agent.discovery.peers.DEPARTURES`
        key): ``"will"`` for its last will - one that names its connection, or an older agent's
        bare JSON where this node signs (every agent signs its goodbye), or, without signing, an
        "offline" older than the peer's last status (the will is written when its connection
        opens); ``"goodbye"`` when it stopped before its
        run's end (its status said ``stopped``, or the goodbye's reason is ``stopping``);
        ``"run_end"`` after its status said ``finished``, or for a goodbye that names another
        reason (the supervisor's ``run ended``); else ``"goodbye"``."""
        last = self.statuses.get(node_id) or {}
        if is_will(msg):
            return "will"
        if self._is_bare_offline(payload):
            if self.control is not None:
                return "will"
            sent, seen = msg.get("time"), last.get("time")
            if isinstance(sent, (int, float)) and isinstance(seen, (int, float)) and sent < seen:
                return "will"
        reason, state = msg.get("reason"), last.get("state")
        if reason == "stopping" or state == "stopped":
            return "goodbye"
        if state == "finished" or (isinstance(reason, str) and reason):
            return "run_end"
        return "goodbye"

    @staticmethod
    def _descriptor_of(msg: Any, node_id: str) -> dict[str, Any] | None:
        """The descriptor of an "online" presence, None for "offline".

        Raises:
            ValueError: not a presence object of ``node_id``.
        """
        if not isinstance(msg, dict) or msg.get("node_id", node_id) != node_id:
            raise ValueError("not a presence object of this node")
        state = msg.get("state")
        if state == "online":
            descriptor = msg.get("descriptor", {})
            if not isinstance(descriptor, dict):
                raise ValueError("descriptor is not an object")
            return descriptor
        if state == "offline":
            return None
        raise ValueError(f"unknown state {state!r}")

    @staticmethod
    def _is_will(payload: bytes) -> bool:
        """Whether a presence payload (signed or bare) is a last will that names its connection."""
        try:
            msg = bounded_loads(payload, "presence")
        except ValueError:
            return False
        return isinstance(msg, dict) and is_will(msg.get("payload") if "ctl" in msg else msg)

    @staticmethod
    def _is_bare_offline(payload: bytes) -> bool:
        try:
            msg = bounded_loads(payload, "presence")
        except ValueError:  # JSONBoundError included: oversized, too deep, malformed
            return False
        return isinstance(msg, dict) and "ctl" not in msg and msg.get("state") == "offline"

    def _handle_status(self, node_id: str, payload: bytes) -> None:
        t = self._t()
        if not payload:
            if self.control is not None and self.control.require_signatures:
                t.count("status_unsigned")  # clearing a status is no evidence of anything
                return
            self.statuses.pop(node_id, None)
            return
        opened = self._open_control("status", node_id, payload)
        if opened is None:
            return
        status = opened[0]
        if self.control is not None and self.control.require_signatures and opened[1] != "device":
            t.count("status_not_member")  # e.g. an operator's key: statuses come from members
            return
        self.statuses[node_id] = status
        if isinstance(status.get("session"), str):
            self.sessions[node_id] = status["session"]
        t.dispatch(self.on_heartbeat, node_id, status)

    # ----------------------------------------------------------------- status

    def _publish_status_now(self, client: Any = None) -> None:
        """The status now, on ``client`` (None: the home session, when connected)."""
        if client is None:
            session = self._t().home_session()
            if session is None:
                return
            client, connected = session
            if not connected:
                self._last_status_pub = time.monotonic()  # republished on reconnect anyway
                return
        client.publish(self._t_status, self._status_payload(), qos=1, retain=True)

    async def publish_status(self, status: dict[str, Any]) -> None:
        """Publish ``status`` (retained JSON) now; the heartbeat republishes it.

        "node_id", "time" (unix s) and "heartbeat" (a counter) are added.

        Raises:
            RuntimeError: before the transport's ``start()``.
            ValueError: ``status`` is not a JSON-serialisable dict.
        """
        self._t().check_started()
        if not isinstance(status, dict):
            raise ValueError("status must be a dict")
        try:
            json.dumps(status)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"status must be JSON-serialisable ({exc})") from None
        with self._lock:
            self._status = dict(status)
        self._publish_status_now()


def node_transport(node_id: str, federation: str, *, descriptor: dict[str, Any], heartbeat_interval: float = 5.0,
                   on_heartbeat: HeartbeatHandler | None = None, control: Any = None,
                   **transport_args: Any) -> MqttTransport:
    """A node's MQTT transport with its presence and status (:class:`MqttPresence`).

    ``descriptor``, ``heartbeat_interval``, ``on_heartbeat`` and ``control`` go to the presence;
    every other argument (``broker``, ``peers``, ``protocol``, TLS, ...) to
    :class:`~dfl_agent.transport.mqtt.MqttTransport`.  The presence is the transport's
    ``channel``.

    Raises:
        ValueError: an invalid argument (the message names it).
    """
    presence = MqttPresence(node_id, federation, descriptor=descriptor, heartbeat_interval=heartbeat_interval,
                            on_heartbeat=on_heartbeat, control=control)
    return MqttTransport(node_id, federation, channel=presence, **transport_args)
