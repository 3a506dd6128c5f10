"""The run lobby: the always-on side of a node's MQTT life between runs.

:class:`RunLobby` listens for run descriptors (``dfl/{fed}/run/+``, retained), their
cancel records (``dfl/{fed}/run/+/cancel``, retained, read first) and peers' statuses,
keeps the known runs in queue order (:class:`RunQueue`: the signed ``submitted_at``, then
``run_id``, never broker arrival) and publishes this node's status while it is not
training.  A descriptor of a cancelled run (a replay) or one whose ``not_after`` passed
before this node started it is refused and counted (``cancelled``, ``expired``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dfl_agent.jsonbound import JSONBoundError, RateLimitedLog
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.service.privacy_budget import PrivacyWatch
from dfl_agent.runtime.shared.degraded import FIELDS as DEGRADED_FIELDS
from dfl_agent.runtime.shared.descriptor import RunDescriptor, RunVerifier, cancel_topic, run_topic
from dfl_agent.transport.versions import status_versions

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt
    from paho.mqtt.properties import Properties
    from paho.mqtt.reasoncodes import ReasonCode

    from dfl_agent.runtime.service.ledger import RunLedger
    from dfl_agent.runtime.service.service_counters import ServiceCounters
    from dfl_agent.runtime.shared.config import NodeConfig
    from dfl_agent.security.trust import SecurityGuard

#: a run's states on a node after its training there (a late joiner no longer joins it)
AFTER_TRAINED = ("trained", "deploying", "deployed", "kept", "adopted", "recorded", "finished")
log = logging.getLogger("dfl_agent.runs")


class RunQueue:
    """Known runs of a federation (latest accepted copy of each), in queue order."""

    def __init__(self) -> None:
        self.runs: dict[str, RunDescriptor] = {}

    def offer(self, d: RunDescriptor) -> bool:
        """Add or update a run; a copy with a lower ``seq`` than the known one is ignored
        (returns False)."""
        old = self.runs.get(d.run_id)
        if old is not None and d.seq <= old.seq:
            return False
        self.runs[d.run_id] = d
        return True

    def ordered(self) -> list[RunDescriptor]:
        """All runs by ``submitted_at`` then ``run_id``."""
        return sorted(self.runs.values(), key=RunDescriptor.order_key)

    def next_runnable(self, done: Callable[[str], bool], now: float | None = None) -> RunDescriptor | None:
        """The first run in queue order that is not cancelled, not done here, and whose
        ``start_at`` has passed."""
        now = time.time() if now is None else now
        return next((d for d in self.ordered() if not d.cancelled and not done(d.run_id)
                     and (d.start_at is None or d.start_at <= now)), None)


class RunLobby:
    """The always-on side of a node: listens for run descriptors (``dfl/{fed}/run/+``,
    retained) and peers' statuses, and publishes this node's status while it is not
    training (``state = "idle"``, ``run = {id, state, round, reason}`` of the last run).

    It uses its own MQTT connection (client id ``dfl-{fed}-{node}-runs-...``), which holds the
    node's last will; it publishes the node's presence only while a run process trains
    (:meth:`publish_presence`): an idle node is not a member of any run's rounds.

    Args:
        cfg: the node's :class:`~dfl_agent.runtime.shared.config.NodeConfig`.
        node_id: this node.
        verifier: :class:`RunVerifier` for descriptors.
        guard: the :class:`~dfl_agent.security.SecurityGuard` that signs this node's statuses
            and verifies peers' ones (None: bare JSON).
        ledger: the node's :class:`~dfl_agent.runtime.service.ledger.RunLedger` (None: cancels
            are not remembered across restarts, and ``not_after`` counts every run as not started).
    """

    def __init__(self, cfg: NodeConfig, node_id: str, verifier: RunVerifier, *, guard: SecurityGuard | None = None,
                 ledger: RunLedger | None = None):
        self.cfg, self.node_id, self.verifier = cfg, node_id, verifier
        self.queue = RunQueue()
        self.statuses: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.client: mqtt.Client | None = None
        self.heartbeat = 0
        self.connected = threading.Event()
        self.guard = guard
        #: statuses dropped by reason (``status_{reason}``), and ``handler_error``: messages
        #: whose handling raised (caught, counted, logged; the listener goes on)
        self.dropped: dict[str, int] = {}
        self._errors = RateLimitedLog(log)
        #: the node's :class:`~dfl_agent.runtime.service.service_counters.ServiceCounters` (None: this
        #: lobby's own counts since its start)
        self.counters: ServiceCounters | None = None
        #: called with the run id, on the MQTT thread, as soon as a cancelled copy of a
        #: run or its cancel record arrives (the agent stops that run's training at once)
        self.on_cancel: Callable[[str], None] | None = None
        self.ledger = ledger
        #: run ids whose verified cancel record arrived (the ledger remembers them too)
        self.cancels: set[str] = set()
        self._sub_mid: int | None = None
        #: the log of this session's broker outages (lost, still away, back); set by start()
        self.outage: Any = None
        self._up = False  # connected (CONNACK accepted), no disconnect since
        self._stopping = False
        self._gone = threading.Event()  # set by each disconnect (stop waits for its own)
        #: the last presence published (stop waits for the broker's acknowledgement of it)
        self._presence_info: mqtt.MQTTMessageInfo | None = None
        #: while a run process trains: the presence descriptor and the last status it relayed
        #: (republished after a reconnection)
        self.run_presence: dict[str, Any] | None = None
        self.run_status: tuple[dict[str, Any], dict[str, Any]] | None = None
        #: this session's connection (a random id, new before every connection attempt), in
        #: the node's last will, presence and statuses: a will of an earlier one is stale
        self.session = secrets.token_hex(8)
        #: peers whose reported privacy budget went down (a reset ledger), in this node's status
        self.privacy_watch = PrivacyWatch()
        self._expiry_logged = time.time()  # build_security logged it at start: the next a day later

    def start(self) -> None:
        """Connect (non-blocking; paho reconnects on its own)."""
        from dfl_agent.transport.endpoint import parse_endpoint
        from dfl_agent.transport.mqtt import mqtt_session
        from dfl_agent.transport.outage import BrokerOutage

        m = self.cfg.mqtt
        host, port = parse_endpoint(m.broker)
        self.outage, self._up, self._stopping = BrokerOutage(self.node_id, m.broker, log), False, False
        c = mqtt_session(f"dfl-{self.cfg.federation}-{self.node_id}-runs-{secrets.token_hex(3)}",
                         protocol=m.protocol, username=m.username, password=m.password,
                         tls_ca=m.tls_ca, tls_cert=m.tls_cert, tls_key=m.tls_key)
        # the node's last will (the run process sets none: the supervisor speaks for the node),
        # signed for each connection attempt (discovery.presence: a session id binds it)
        c.on_pre_connect = self._on_pre_connect
        c.on_connect = self._on_connect
        c.on_connect_fail = self._on_connect_fail
        c.on_disconnect = self._on_disconnect
        c.on_subscribe = self._on_subscribe
        c.on_message = self._on_message
        from dfl_agent.transport.link_rate import derive

        c.connect_async(host, port, keepalive=derive(m.link_rate, keepalive=m.keepalive).keepalive)
        c.loop_start()
        self.client = c

    def stop(self, wait: float = 3.0) -> None:
        """Leave cleanly: wait (up to ``wait`` seconds each) for the broker to acknowledge the
        last presence, then for the DISCONNECT to go out, before the network thread stops.  paho's
        ``loop_stop`` does not flush what is queued: without the waits a stop could close the
        socket with no DISCONNECT, and the broker then published the node's last will ("offline
        (last will)", a crash to its peers) after its "offline: stopping" presence."""
        self._stopping = True
        c = self.client
        if c is None:
            return
        connected = self._up
        info = self._presence_info
        if connected and info is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # not queued / the connection went away
                info.wait_for_publish(timeout=wait)
        from dfl_agent.transport.mqtt import close_session

        close_session(c, self._gone, connected, wait)

    def _on_pre_connect(self, client: mqtt.Client, userdata: object) -> None:
        """paho, before each connection attempt: a new session id, and the node's last will for
        it (a presence "offline" that names the session, signed now)."""
        from dfl_agent.security.trust import will_payload
        from dfl_agent.transport.mqtt import topic

        self.session = secrets.token_hex(8)
        client.will_set(topic(self.cfg.federation, self.node_id, "presence"),
                        self._signed("presence", will_payload(self.node_id, self.session)), qos=1, retain=True)

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: mqtt.ConnectFlags, reason_code: ReasonCode,
                    properties: Properties | None) -> None:
        if getattr(reason_code, "is_failure", False):
            from dfl_agent.transport.mqtt import refused

            self.outage.attempt_failed(refused(reason_code, self.cfg.mqtt.username))  # throttled
            return
        self._up = True
        self.outage.connected()  # after an outage: "broker ... back after ..." (INFO)
        # the cancel records first: their retained copies arrive before any descriptor; with them
        # the federation's revocation list (retained), before any status is verified
        first = [(cancel_topic(self.cfg.federation), 1)]
        if self.guard is not None:
            from dfl_agent.security.revocation import revocation_topic

            first.append((revocation_topic(self.cfg.federation), 1))
        self._sub_mid = client.subscribe(first)[1]
        self._republish_run()

    def up(self) -> bool:
        """Whether the session is connected and subscribed (no disconnect since)."""
        return self._up and self.connected.is_set()

    def _on_connect_fail(self, client: mqtt.Client, userdata: object) -> None:
        if not self._stopping:
            self.outage.attempt_failed("no connection")  # the first one logged, then throttled

    def _on_disconnect(self, client: mqtt.Client, userdata: object, flags: mqtt.DisconnectFlags, reason_code: ReasonCode,
                       properties: Properties | None) -> None:
        was, self._up = self._up, False
        self._gone.set()
        if was and not self._stopping:
            self.outage.lost(str(reason_code))  # WARNING once; paho reconnects

    def _on_subscribe(self, client: mqtt.Client, userdata: object, mid: int, *args: object) -> None:
        """Once the cancel records are subscribed, the descriptors and the statuses."""
        from dfl_agent.transport.mqtt import topic

        if mid != self._sub_mid:
            return
        client.subscribe([(run_topic(self.cfg.federation), 1), (topic(self.cfg.federation, "+", "status"), 1)])
        self.connected.set()

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        """paho's message callback: whatever one message does, the listener thread goes on
        (an exception is counted as ``handler_error`` and logged, rate-limited)."""
        try:
            self._handle_message(msg)
        except Exception:  # noqa: BLE001 - never end the run listener thread
            self._drop("handler_error")
            self._errors.exception("run lobby: error handling a message on %s", getattr(msg, "topic", "?"))

    def _handle_message(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic.split("/")
        if len(parts) == 3 and parts[2] == "revocations":
            self._revocation_list(msg.payload)
        elif len(parts) == 5 and parts[2] == "run" and parts[4] == "cancel":
            self._cancel_record(parts[3], msg.payload)
        elif len(parts) == 4 and parts[2] == "run":
            if not msg.payload:
                return
            d, why = self.verifier.check(msg.payload)
            if why is not None:
                if why != "duplicate":
                    log.warning("refused run descriptor on %s: %s", msg.topic, why)
                return
            assert d is not None
            if d.run_id != parts[3]:
                self.verifier.refused["malformed"] = self.verifier.refused.get("malformed", 0) + 1
                return
            why = self.refusal(d)
            if why is not None:
                self.verifier.refused[why] = self.verifier.refused.get(why, 0) + 1
                log.warning("refused run descriptor on %s: %s", msg.topic, why)
                return
            with self.lock:
                fresh = self.queue.offer(d)
                if fresh:
                    log.info("run %s (%s, %d rounds, submitted by %s)%s", d.run_id, d.algorithm, d.rounds,
                             d.submitter or "?", " cancelled" if d.cancelled else "")
                    self.changed.set()
            hook = self.on_cancel
            if fresh and d.cancelled and hook is not None:
                try:
                    hook(d.run_id)
                except Exception:
                    log.exception("cancel hook failed")
        elif len(parts) == 5 and parts[4] == "status":
            st = self._open_status(parts[3], msg.payload)
            if st is False:
                return
            with self.lock:
                if isinstance(st, dict):
                    self.statuses[parts[3]] = st
                else:
                    self.statuses.pop(parts[3], None)
            if isinstance(st, dict) and (flag := self.privacy_watch.observe(parts[3], st.get("privacy"))):
                log.warning("node %s reports privacy epsilon %g, below the %g it reported before (its privacy "
                            "ledger was reset?)", parts[3], flag["now"], flag["was"])

    def _revocation_list(self, payload: bytes | bytearray) -> None:
        """The federation's retained revocation list: kept (and saved in the state directory,
        where the run process reads it) when it verifies with the federation key and is newer
        than the one held; else ignored and counted (``revocations_{reason}``).  An empty
        payload (a cleared topic) revokes nothing back."""
        from dfl_agent.security.revocation import IGNORE_REASONS

        if not payload or self.guard is None:
            return
        why = self.guard.trust.revocations.offer(bytes(payload), count=False)
        if why in IGNORE_REASONS:
            self._drop(f"revocations_{why}")
            log.warning("ignored the revocation list on the broker: %s (this node holds number %d)", why,
                        self.guard.trust.revocations.number)
        elif why is None:
            if self.guard.trust.revoked(self.node_id):
                log.error("this node (%s) is revoked by the federation's revocation list %d: its peers ignore it",
                          self.node_id, self.guard.trust.revocations.number)
            with self.lock:  # statuses of revoked nodes no longer count
                for n in [n for n in self.statuses if self.guard.trust.revoked(n)]:
                    self.statuses.pop(n, None)
            self.changed.set()

    def security_status(self) -> dict[str, Any]:
        """The status fields of this node's trust material: ``revocation_list`` (the number of
        the newest verified list, 0: none), ``revoked`` (the node ids it revokes) and
        ``certificate_expires`` (this node's certificate's expiry, unix s, or None).  Logs the
        expiry warning (:func:`~dfl_agent.runtime.shared.assembly.warn_expiry`) at most once a day."""
        guard = self.guard
        if guard is None:
            return {}
        rev = guard.trust.revocations.current
        cert = guard.certificate if isinstance(guard.certificate, dict) else {}
        now = time.time()
        if now >= self._expiry_logged + 86400.0:
            from dfl_agent.runtime.shared.assembly import warn_expiry

            self._expiry_logged = now
            warn_expiry(cert, now)
        return {"revocation_list": rev.number if rev is not None else 0,
                "revoked": sorted(rev.nodes()) if rev is not None else [],
                "certificate_expires": cert.get("expires")}

    def is_cancelled(self, run_id: str) -> bool:
        """Whether an operator cancelled ``run_id``: a verified cancel record, or the ledger."""
        return run_id in self.cancels or (self.ledger is not None and self.ledger.is_cancelled(run_id))

    def refusal(self, d: RunDescriptor) -> str | None:
        """Why a verified descriptor may not be queued, or None: ``"cancelled"`` for a live
        copy of a run an operator cancelled (a replayed submission), ``"expired"`` when its
        ``not_after`` passed and this node has not started it."""
        if d.cancelled:
            return None
        if self.is_cancelled(d.run_id):
            return "cancelled"
        if d.expired(time.time()) and not (self.ledger is not None and self.ledger.started(d.run_id)):
            return "expired"
        return None

    def _cancel_record(self, run_id: str, payload: bytes | bytearray) -> None:
        """A retained cancel record: verified (:meth:`RunVerifier.check_cancel`), remembered
        in the ledger, and the run's queued copy marked cancelled (the cancel hook fires)."""
        if not payload:
            return  # a removed record never un-cancels a run
        why = self.verifier.check_cancel(payload, run_id)
        if why is not None:
            if why != "duplicate":
                log.warning("ignored the cancel record of run %s: %s", run_id, why)
            return
        if self.ledger is not None:
            self.ledger.remember_cancel(run_id)
        with self.lock:
            fresh = run_id not in self.cancels
            self.cancels.add(run_id)
            old = self.queue.runs.get(run_id)
            if old is not None and not old.cancelled:
                self.queue.runs[run_id] = dataclasses.replace(old, cancelled=True)
            self.changed.set()
        if fresh:
            log.info("run %s cancelled by the operator (cancel record)", run_id)
        hook = self.on_cancel
        if hook is not None and old is not None:
            try:
                hook(run_id)
            except Exception:
                log.exception("cancel hook failed")

    def _open_status(self, node: str, payload: bytes | bytearray) -> object:
        """A peer's status dict, None (cleared), or False (dropped and counted): verified
        with :attr:`guard` when set - with ``require_signatures`` only a trusted device's
        signed status counts (``accepted_by`` decides ``min_members`` on it)."""
        from dfl_agent.security.trust import ControlRejected

        if node == self.node_id:
            return False
        guard = self.guard
        if not payload:
            return False if guard is not None and guard.require_signatures else None
        if guard is None:
            try:  # bounded: 64 KiB, nesting depth 32
                st = bounded_loads(payload, "status")
            except JSONBoundError as exc:
                self._drop(f"status_{exc.reason}")
                return False
            return st.get("payload") if isinstance(st, dict) and "ctl" in st else st
        try:
            _s, role, st = guard.verify_control(payload, "status", node)
        except ControlRejected as exc:
            if exc.reason != "duplicate":
                self._drop(f"status_{exc.reason}")
            return False
        if guard.require_signatures and role != "device":
            self._drop("status_not_member")
            return False
        return st

    def _drop(self, key: str) -> None:
        """Count a message dropped for ``key`` in :attr:`dropped` (under the lock: the counters'
        saving thread and the metrics endpoint read it)."""
        with self.lock:
            self.dropped[key] = self.dropped.get(key, 0) + 1

    def queued(self, done: Callable[[str], bool], limit: int = 20) -> list[str]:
        """The ids of the runs queued here, in queue order (at most ``limit``): known, not
        cancelled and not ``done`` (the ledger's terminal states); the run in training, if
        any, is among them.  In every status as ``runs_queued``."""
        with self.lock:
            return [d.run_id for d in self.queue.ordered() if not d.cancelled and not done(d.run_id)][:limit]

    def run(self, run_id: str) -> RunDescriptor | None:
        """The newest known descriptor of ``run_id``."""
        with self.lock:
            return self.queue.runs.get(run_id)

    def _run_states(self, run_id: str) -> dict[str, Any]:
        """Each node's state of ``run_id``, from its status: its current run, or its run history."""
        out = {}
        with self.lock:
            for n, s in self.statuses.items():
                r = s.get("run")
                hist = s.get("run_history")
                if isinstance(r, dict) and r.get("id") == run_id:
                    out[n] = r.get("state")
                elif isinstance(hist, dict) and isinstance(hist.get(run_id), dict):
                    out[n] = hist[run_id].get("state")
        return out

    def declined_by(self, run_id: str) -> set[str]:
        """Nodes whose status (its current run, or its run history) says they declined ``run_id``."""
        return {n for n, state in self._run_states(run_id).items() if state == "declined"}

    def late_for(self, run_id: str) -> str:
        """Why a node that never trained ``run_id`` is too late to join it ("" when it is
        not): the run ended on other members, or they train it past round 1 (joining then
        would make every member wait for this node's rounds)."""
        if ended := self.finished_by(run_id):
            return f"the run had ended on {len(ended)} member(s)"
        rnd = self.training_round(run_id)
        return f"the run was at round {rnd} on its members" if rnd > 1 else ""

    def training_round(self, run_id: str) -> int:
        """The highest round a node's status shows while it trains ``run_id`` (0: none trains it)."""
        with self.lock:
            rounds = [s["run"].get("round") for s in self.statuses.values() if isinstance(s.get("run"), dict)
                      and s["run"].get("id") == run_id and s["run"].get("state") == "training"]
        return max((int(r) for r in rounds if isinstance(r, int) and not isinstance(r, bool)), default=0)

    def finished_by(self, run_id: str) -> set[str]:
        """Nodes whose status says ``run_id`` ended there after its training (trained,
        deploying, deployed, kept, recorded or finished): too late for a node to join it."""
        return {n for n, state in self._run_states(run_id).items() if state in AFTER_TRAINED}

    def may_join(self, run_id: str) -> int:
        """How many other known nodes may still join ``run_id``: every node with a verified
        status except those that declined it (a node that declined is not waited for).
        Unbounded (``sys.maxsize``) while no node declined: statuses may still be arriving."""
        import sys

        declined = self.declined_by(run_id)
        if not declined:
            return sys.maxsize
        with self.lock:
            return len(set(self.statuses) - declined)

    def accepted_by(self, run_id: str) -> set[str]:
        """Nodes whose status says they accepted or train ``run_id``."""
        with self.lock:
            return {n for n, s in self.statuses.items() if isinstance(s.get("run"), dict)
                    and s["run"].get("id") == run_id and s["run"].get("state") in ("accepted", "training")}

    # -- speaking for a run process (runtime.supervisor) ------------------------------------
    def _signed(self, kind: str, doc: dict[str, Any]) -> bytes | str:
        return self.guard.sign_control(kind, doc, self.cfg.federation) if self.guard is not None else json.dumps(doc)

    def publish_presence(self, descriptor: dict[str, Any] | None, reason: str = "") -> None:
        """This node's presence while a run process trains: "online" with the run's descriptor,
        or (``descriptor`` None) "offline" with ``reason`` when the run process ended - signed by
        this node, retained.  The run process publishes none itself."""
        from dfl_agent.transport.mqtt import topic

        doc: dict[str, Any] = {"state": "online" if descriptor is not None else "offline", "node_id": self.node_id}
        if descriptor is not None:
            doc.update(descriptor=dict(descriptor), session=self.session)
        elif reason:
            doc["reason"] = reason
        doc["time"] = time.time()
        with self.lock:
            self.run_presence = dict(descriptor) if descriptor is not None else None
            if descriptor is None:
                self.run_status = None
        if self.client is not None:
            self._presence_info = self.client.publish(topic(self.cfg.federation, self.node_id, "presence"),
                                                      self._signed("presence", doc), qos=1, retain=True)

    def publish_run_status(self, status: dict[str, Any], service: dict[str, Any] | None = None) -> None:
        """A run process's status (its node's :meth:`~dfl_agent.runtime.node.node.Node.status`), with
        ``node_id``, ``time``, a ``heartbeat`` counter and the service's counters (``service``)
        added, signed by this node and retained: the status heartbeat of a training node."""
        from dfl_agent.transport.mqtt import topic

        with self.lock:
            self.heartbeat += 1
            st = {**dict(status), **dict(service or {}), "node_id": self.node_id, "time": time.time(),
                  "heartbeat": self.heartbeat, "session": self.session, **status_versions()}
            self.run_status = dict(status), dict(service or {})
        if self.client is not None:
            self.client.publish(topic(self.cfg.federation, self.node_id, "status"), self._signed("status", st),
                                qos=1, retain=True)

    def _republish_run(self) -> None:
        """After a reconnection while a run process trains: its presence and status again."""
        with self.lock:
            presence, status = self.run_presence, self.run_status
        if presence is not None:
            self.publish_presence(presence)
        if status is not None:
            self.publish_run_status(*status)

    def publish_status(self, run: dict[str, Any] | None, state: str = "idle",
                       history: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Publish this node's status (retained) while no run trains; ``history`` (run id
        -> ledger entry, the newest 20 kept) lets ``dflctl run list`` show finished runs, and a
        member that missed a run's end find the members that deployed its model (``model``:
        ``deployed``, ``adopted`` or ``kept``; ``version``; ``adopted_from``)."""
        from dfl_agent.transport.mqtt import topic

        if self.client is None:
            return
        self.heartbeat += 1
        st = {"node_id": self.node_id, "state": state, "time": time.time(), "heartbeat": self.heartbeat,
              "session": self.session, **status_versions(), "run": run, "runs_refused": dict(self.verifier.refused), "algorithm": None, "round": 0,
              "run_history": {k: {f: v.get(f) for f in ("state", "round", "reason", "started_from", "privacy", "peak_rss_mb",
                                                         "model", "version", "adopted_from",
                                                         *(DEGRADED_FIELDS if v.get("degraded") else ()))}
                              for k, v in sorted((history or {}).items(), key=lambda kv: kv[1].get("time", 0))[-20:]}}
        # the refusal and drop counters, always present: with counters, the totals over restarts
        st.update(self.counters.view() if self.counters is not None else {"control_dropped": dict(self.dropped)})
        if isinstance(priv := st.get("privacy"), Mapping) and priv.get("dp"):  # DP: no figure that reveals N
            from dfl_agent.privacy.policy import redact_status

            st = redact_status(st)
        self.client.publish(topic(self.cfg.federation, self.node_id, "status"), self._signed("status", st), qos=1,
                            retain=True)
