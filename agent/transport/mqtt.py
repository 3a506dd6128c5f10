"""The MQTT transport: the connection pool and the frames of one node over real brokers.

Topic tree of a federation ``{fed}`` (``{id}`` = node id)::

    dfl/{fed}/node/{id}/inbox     frames addressed to this node (QoS ``qos``, default 1).
    dfl/{fed}/node/{id}/out       this node's broadcasts (QoS ``qos``); every node
                                  subscribes to ``dfl/{fed}/node/+/out``, ignores its own.

A node's presence and status (``dfl/{fed}/node/{id}/presence`` and ``.../status``,
retained, QoS 1) and their signatures live in :mod:`dfl_agent.discovery.presence`; they
ride on this transport's home session through a :class:`ControlChannel` given as
``channel`` (its last will is set on the home connection before it connects, its topics
are subscribed on every connection, it announces itself on every (re)connection of the
home broker, its heartbeat ticks in the maintenance thread, it says goodbye on ``stop()``).

Payloads on ``inbox`` and ``out`` are either a whole frame (opaque bytes, normally a
wire frame ``b"DFL"...``, see :mod:`dfl_agent.transport.wire`) or a chunk of one
(``b"DFC"...``, see :mod:`dfl_agent.transport.chunking`): every outgoing frame goes
through :func:`~dfl_agent.transport.chunking.split` with ``chunk_size`` and every
incoming payload through one :class:`~dfl_agent.transport.chunking.Reassembler` per
(broker, topic).

Connections: one paho client per broker endpoint ("host:port").  The *home* broker
(``broker``) carries this node's own topics, the channel's last will, its inbox subscription.
A frame for a peer goes to the peer's inbox on ``peers.broker_of(peer)`` (``""`` =
home); such an extra broker gets its own client, created lazily (or as soon as the
peer table names it), which subscribes there to ``+/out`` and the channel's topics
(``+/presence``, ``+/status``) so that the peers living there are heard too.  Use one spelling per
broker in the directory: two spellings of one broker make two connections and
duplicate deliveries.

Threads: each paho client runs its network thread (``loop_start``), which also
reassembles chunks (hashing a chunked frame's payload as its chunks arrive) and, when
``prepare_frame`` is set (the runtime sets its decoder and signature check there),
prepares every complete frame, so that the event loop is handed one finished message
per frame; handlers (``on_frame``, ``on_presence``, the channel's) are
always called on the asyncio loop that called :meth:`MqttTransport.start`, through
``loop.call_soon_threadsafe``.  A maintenance thread expires incomplete transfers
and ticks the channel (its heartbeat).  ``send``/``broadcast`` never block the loop on the
network: paho queues the publishes and its thread writes them.

Failures: paho reconnects with exponential backoff (1 s doubling to 30 s); on every
(re)connect the transport subscribes again and the channel announces itself again.
Frames published while a broker is away are queued by paho (QoS >= 1, up to
``max_pending_bytes`` per broker) and written after the reconnection; with QoS 0
they are dropped.
Nothing received raises: malformed payloads are counted and logged at warning.
Incomplete transfers are held at most ``4 * max_frame_bytes`` per broker connection,
and at most ``max_transfers`` of them per connection (all topics together); a
declared frame size is checked against ``max_frame_bytes`` before anything is stored.

TLS: with ``tls_ca`` the connection uses TLS (``ssl.PROTOCOL_TLS_CLIENT``), the
broker's certificate must chain to ``tls_ca`` and match the host name; ``tls_cert`` +
``tls_key`` add a client certificate (for brokers with ``require_certificate``).

Byte accounting: "wire bytes" are the MQTT *payload* bytes of all the messages a
frame travelled in (chunk headers included, MQTT fixed header and topic excluded:
add ``len(topic) + 4`` per message for a close estimate of the full packet).
``stats.bytes_received`` counts every payload received on ``inbox``/``out``
(also those then dropped); presence and status traffic is not counted.

Drop counters (``stats.dropped``): the :class:`~dfl_agent.transport.chunking.ChunkError`
reasons (``bad_chunk``, ``oversized``, ``too_many_transfers``),
``incomplete_transfer`` (expired), the channel's counters (presence and status:
see :mod:`dfl_agent.discovery.presence`), ``handler_error`` (handling
one message raised: caught, counted, logged at most once a minute after the first few;
paho's thread and the event loop go on), ``not_connected`` (QoS 0 publish while disconnected, or after ``stop()``),
``queue_full`` (more than ``max_pending_bytes`` waiting to be written),
``publish_error``.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt
from paho.mqtt.subscribeoptions import SubscribeOptions

from dfl_agent.jsonbound import RateLimitedLog
from dfl_agent.transport.base import FrameHandler, PresenceHandler, Transport, TransportStats
from dfl_agent.transport.chunking import HEADER_LEN, ChunkError, Reassembler, chunked_size, is_chunk, iter_chunks
from dfl_agent.transport.endpoint import parse_endpoint
from dfl_agent.transport.link_rate import FAST_CHUNK, FAST_KEEPALIVE
from dfl_agent.transport.outage import BrokerOutage
from dfl_agent.transport.wire import payload_offset

if TYPE_CHECKING:
    from dfl_agent.discovery.peers import PeerInfo, PeerTable

log = logging.getLogger(__name__)

TOPIC_ROOT = "dfl"
PROTOCOLS = {"5": mqtt.MQTTv5, "3.1.1": mqtt.MQTTv311}
#: most bytes of one MQTT payload paho accepts (MQTT limit minus room for the topic)
MAX_CHUNK_SIZE = 256 * 1024 * 1024 - 64 * 1024
#: frames larger than this are split and published off the event loop thread (below, the
#: copy into chunks takes less time than the hop to a worker thread and back)
_OFFLOAD_BYTES = 4 * 1024 * 1024
#: how long ``stop()`` waits for the channel's goodbye and queued frames to go out (s)
STOP_FLUSH_TIMEOUT = 2.0

_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def topic(federation: str, node_id: str, leaf: str) -> str:
    """``dfl/{federation}/node/{node_id}/{leaf}`` (``node_id`` may be ``+``)."""
    return f"{TOPIC_ROOT}/{federation}/node/{node_id}/{leaf}"


_paho_logger = logging.getLogger(__name__ + ".paho")


class _PahoLog:
    """paho's own messages, all at debug level on ``dfl_agent.transport.mqtt.paho``: paho
    reports every failed reconnection attempt at ERROR, and our own messages say what
    matters (lost/reconnected broker).  Given to ``Client.enable_logger``, so that a message
    is formatted only when that logger takes debug messages (paho formats every line for an
    ``on_log`` callback: two per MQTT message, about 10 us each)."""

    @staticmethod
    def log(level: int, msg: str, *args: object) -> None:
        _paho_logger.debug(msg, *args)


_paho_log = _PahoLog()


def refused(reason_code: object, username: str | None) -> str:
    """The line for a connection the broker refused (CONNACK ``reason_code``); a refusal of
    the credentials names the user and the configuration keys to check."""
    text = str(reason_code)
    if any(w in text.lower() for w in ("not authori", "user name or password", "bad username")):
        who = f"user {username!r}" if username else "no user name (anonymous)"
        return (f"broker refused the connection: {text} as {who}; check mqtt.username and mqtt.password, "
                "and the broker's password file and ACL")
    return f"broker refused the connection: {text}"


def close_session(client: Any, gone: threading.Event, connected: bool, wait: float = 3.0) -> None:
    """End a paho session cleanly (blocking): DISCONNECT, wait up to ``wait`` seconds for it to
    go out (``gone``: an event the client's ``on_disconnect`` sets) when ``connected``, then stop
    the network thread.  paho's ``loop_stop`` does not flush its queue: without the wait the
    socket could close with no DISCONNECT, and the broker then published the session's last
    will (a crash to the node's peers) after whatever it said last."""
    gone.clear()
    try:
        client.disconnect()
    except Exception:  # noqa: BLE001 - a session already gone: stop its thread all the same
        pass
    if connected:
        gone.wait(wait)
    client.loop_stop()


def mqtt_session(client_id: str, *, protocol: str = "5", username: str | None = None,
                 password: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, userdata: Any = None,
                 reconnect_delay: tuple[int, int] | None = (1, 5)) -> mqtt.Client:
    """A paho client (callback API 2), not yet connected: the one session factory of every MQTT user.

    The agent's connection pool (:class:`MqttTransport`), the run lobby, the inference member
    (through its :class:`MqttTransport`) and ``dflctl``'s fleet commands (observer, ``run``)
    all build their clients here, so credentials, TLS, protocol and reconnection are set
    the same way everywhere.

    Args:
        client_id: the MQTT client id (unique per connection).
        protocol: ``"5"`` or ``"3.1.1"`` (:data:`PROTOCOLS`); 3.1.1 starts a clean session.
        username, password: broker credentials (``username`` None: none).
        tls_ca: CA file; given, the connection uses TLS (``PROTOCOL_TLS_CLIENT``) and the
            broker's certificate must chain to it and match the host name.
        tls_cert, tls_key: a client certificate and its key (brokers with
            ``require_certificate``).
        userdata: handed to the client's callbacks.
        reconnect_delay: paho's reconnection backoff ``(min, max)`` in seconds (default 1 s
            doubling up to 5 s, so a node is back within about 5 s of its broker's return: the
            field lab measured 15 s after an 8 s outage with a 30 s cap); None keeps paho's
            default (1 s to 120 s).

    Raises:
        KeyError: ``protocol`` is not in :data:`PROTOCOLS`.
    """
    kwargs: dict[str, Any] = {"clean_session": True} if protocol == "3.1.1" else {}
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=PROTOCOLS[protocol],
                         userdata=userdata, reconnect_on_failure=True, **kwargs)
    client.enable_logger(_paho_log)  # type: ignore[arg-type]  # paho's own messages, at debug level only
    if reconnect_delay is not None:
        client.reconnect_delay_set(min_delay=reconnect_delay[0], max_delay=reconnect_delay[1])
    if username is not None:
        client.username_pw_set(username, password)
    if tls_ca is not None:  # -- security: TLS with server verification
        import ssl

        client.tls_set(ca_certs=tls_ca, certfile=tls_cert, keyfile=tls_key,
                       cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
    return client


class ControlChannel(abc.ABC):
    """What rides on a node's home MQTT session beside the frames: its presence and
    status (:class:`dfl_agent.discovery.presence.MqttPresence`).  The transport calls it;
    it never calls back into the network but through the transport's public methods
    (:meth:`MqttTransport.count`, :meth:`~MqttTransport.dispatch`,
    :meth:`~MqttTransport.home_session`, :attr:`~MqttTransport.running`).
    """

    #: topic leaves (``dfl/{fed}/node/+/{leaf}``) subscribed at QoS 1 on every connection
    #: and handed to :meth:`on_message`
    leaves: tuple[str, ...] = ()
    #: seconds between two calls of :meth:`tick` at most (e.g. the heartbeat interval)
    period: float = 1.0
    #: latest status dict of every other node heard (node id -> status)
    statuses: dict[str, dict[str, Any]]

    @abc.abstractmethod
    def bind(self, transport: MqttTransport) -> None:
        """Called once by the transport's constructor."""

    @abc.abstractmethod
    def will(self) -> tuple[str, bytes] | None:
        """The home connection's last will, ``(topic, payload)`` (retained, QoS 1), or None;
        called before every connection attempt (paho's ``on_pre_connect``)."""

    @abc.abstractmethod
    def announce(self, client: mqtt.Client) -> None:
        """The home connection is up and subscribed (at every reconnection): publish."""

    @abc.abstractmethod
    def started(self) -> None:
        """The transport's ``start()`` succeeded."""

    @abc.abstractmethod
    def tick(self) -> None:
        """Called from the maintenance thread (every ``period`` or more often)."""

    @abc.abstractmethod
    def goodbye(self, client: mqtt.Client) -> mqtt.MQTTMessageInfo | None:
        """The transport stops, its home connection is up: publish the last message."""

    @abc.abstractmethod
    def on_message(self, home: bool, client: mqtt.Client | None, sender: str, leaf: str, payload: bytes) -> None:
        """A message on ``dfl/{fed}/node/{sender}/{leaf}`` (network thread); ``home``:
        it came over the home connection (``client``)."""

    @abc.abstractmethod
    async def publish_status(self, status: dict[str, Any]) -> None:
        """Publish this node's status now (see :meth:`Transport.publish_status`)."""


class _Conn:
    """One paho client to one broker endpoint, with its readiness state."""

    def __init__(self, endpoint: str, home: bool, who: str = ""):
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint)
        self.home = home
        #: the log of this connection's outages (lost, still away, back)
        self.outage = BrokerOutage(who, endpoint, log)
        self.client: mqtt.Client | None = None
        self.connected = False  # CONNACK success seen, no disconnect since
        self.ready = threading.Event()  # connected and SUBACK for our subscriptions
        self.gone = threading.Event()  # set by each disconnect (a close waits for its own)
        self.ever_ready = False
        self.sub_mid: int | None = None
        self.error = ""  # last connection/subscription problem, for messages
        self.fatal = ""  # subscription refused: start() fails at once
        self.created = time.monotonic()
        self.lock = threading.Lock()
        self.pending: collections.deque[tuple[mqtt.MQTTMessageInfo, int]] = collections.deque()
        self.pending_bytes = 0
        # one Reassembler per topic heard on this connection, fed by paho's thread and
        # expired by the maintenance thread, both under reasm_lock
        self.reassemblers: dict[str, Reassembler] = {}
        self.reasm_lock = threading.Lock()

    def prune(self) -> int:
        """Forget published messages at the head of the queue; return bytes still pending."""
        with self.lock:
            while self.pending:
                info, size = self.pending[0]
                try:
                    done = info.is_published()
                except (ValueError, RuntimeError):
                    done = True  # failed: not pending any more
                if not done:
                    break
                self.pending.popleft()
                self.pending_bytes -= size
            return self.pending_bytes

    def track(self, info: mqtt.MQTTMessageInfo, size: int) -> None:
        with self.lock:
            self.pending.append((info, size))
            self.pending_bytes += size


class MqttTransport(Transport):
    """Moves frames of node ``node_id`` of federation ``federation`` over MQTT.

    Args:
        node_id: this node's id (``[A-Za-z0-9_.-]{1,64}``, it is a topic level).
        federation: federation id (same alphabet).
        broker: home broker, ``"host:port"``.
        peers: the peer directory; ``peers.broker_of(peer)`` names the broker of a
            peer's topics ("" = home).  Its listener is used to connect early to
            brokers it names (see ``connect_peer_brokers``).
        protocol: ``"5"`` or ``"3.1.1"`` (amqtt speaks only 3.1.1).
        chunk_size: largest MQTT payload sent, in bytes (chunk header included);
            keep it at or under the broker's maximum packet size minus the topic; None:
            256 KiB.  On slow links take it, the keepalive and the timeouts from
            :func:`dfl_agent.transport.link_rate.derive` (``mqtt.link_rate``).
        max_frame_bytes: largest frame sent or accepted, in bytes.
        reassembly_timeout: seconds without a new chunk after which an incomplete
            transfer is dropped (counted as ``incomplete_transfer``).
        keepalive: MQTT keepalive in seconds (None: 10); the broker publishes the last will
            after about 1.5 x keepalive of silence, and counts only complete packets: one
            chunk must go through the link well within it.
        username, password: broker credentials (password needs a username).
        qos: MQTT QoS of frames (0, 1 or 2); the channel's topics always use 1.
        connect_timeout: seconds ``start`` waits for the home broker (and ``send``
            for a newly created extra connection).
        max_pending_bytes: most bytes of frames queued per broker connection and not
            yet written (e.g. while disconnected); beyond, frames are dropped
            (``queue_full``).
        connect_peer_brokers: connect to every broker the peer table names as soon as
            it names it (to hear the broadcasts there); otherwise only on first send.
        tls_ca: CA certificate file (PEM) that the broker's certificate must chain to;
            ``None`` = plain TCP.
        tls_cert, tls_key: client certificate and key (PEM), both or neither; need ``tls_ca``.
        max_transfers: most incomplete chunked transfers held per broker connection.
        channel: the node's presence and status (a :class:`ControlChannel`, e.g.
            :class:`dfl_agent.discovery.presence.MqttPresence`; see
            :func:`dfl_agent.discovery.presence.node_transport`), or None (frames only).
        broadcasts: subscribe to the federation's broadcasts (``dfl/{fed}/node/+/out``,
            every training node's model gossip); False for a member that takes only the
            frames addressed to it (an inference member: its deployed models).

    Raises:
        ValueError: an invalid argument (the message names it).
    """

    def __init__(
        self,
        node_id: str,
        federation: str,
        *,
        broker: str,
        peers: PeerTable,
        protocol: str = "5",
        chunk_size: int | None = None,
        max_frame_bytes: int = 64 * 1024 * 1024,
        reassembly_timeout: float = 30.0,
        keepalive: int | None = None,
        username: str | None = None,
        password: str | None = None,
        qos: int = 1,
        connect_timeout: float = 10.0,
        max_pending_bytes: int = 256 * 1024 * 1024,
        connect_peer_brokers: bool = True,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        max_transfers: int = 64,
        channel: ControlChannel | None = None,
        broadcasts: bool = True,
    ):
        chunk_size = FAST_CHUNK if chunk_size is None else chunk_size
        keepalive = FAST_KEEPALIVE if keepalive is None else keepalive

        if not isinstance(node_id, str) or not _ID_RE.match(node_id):
            raise ValueError(f"node_id: must match [A-Za-z0-9_.-]{{1,64}}, got {node_id!r}")
        if not isinstance(federation, str) or not _ID_RE.match(federation):
            raise ValueError(f"federation: must match [A-Za-z0-9_.-]{{1,64}}, got {federation!r}")
        try:
            parse_endpoint(broker)
        except ValueError as exc:
            raise ValueError(f"broker: {exc}") from None
        if peers is None or not callable(getattr(peers, "broker_of", None)):
            raise ValueError("peers: must be a PeerTable (with broker_of)")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol: must be one of {sorted(PROTOCOLS)}, got {protocol!r}")
        if not isinstance(chunk_size, int) or not HEADER_LEN + 1 < chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size: must be an int in {HEADER_LEN + 2}..{MAX_CHUNK_SIZE}, got {chunk_size!r}")
        if not isinstance(max_frame_bytes, int) or max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes: must be a positive int, got {max_frame_bytes!r}")
        if not isinstance(reassembly_timeout, (int, float)) or not reassembly_timeout > 0:
            raise ValueError(f"reassembly_timeout: must be > 0 seconds, got {reassembly_timeout!r}")
        if not isinstance(keepalive, int) or not 1 <= keepalive <= 65535:
            raise ValueError(f"keepalive: must be an int in 1..65535 seconds, got {keepalive!r}")
        if username is not None and not isinstance(username, str):
            raise ValueError("username: must be a str or None")
        if password is not None and (not isinstance(password, str) or username is None):
            raise ValueError("password: must be a str, and needs a username")
        if qos not in (0, 1, 2):
            raise ValueError(f"qos: must be 0, 1 or 2, got {qos!r}")
        if not isinstance(connect_timeout, (int, float)) or not connect_timeout > 0:
            raise ValueError(f"connect_timeout: must be > 0 seconds, got {connect_timeout!r}")
        if not isinstance(max_pending_bytes, int) or max_pending_bytes < chunk_size:
            raise ValueError(f"max_pending_bytes: must be an int >= chunk_size, got {max_pending_bytes!r}")

        if tls_cert is not None and (tls_ca is None or tls_key is None):
            raise ValueError("tls_cert: needs tls_ca and tls_key")
        if not isinstance(max_transfers, int) or max_transfers < 1:
            raise ValueError(f"max_transfers: must be a positive int, got {max_transfers!r}")
        #: the node's presence and status riding on the home session (or None)
        self.channel = channel
        self.tls_ca, self.tls_cert, self.tls_key = tls_ca, tls_cert, tls_key
        self.max_transfers = max_transfers
        self.node_id = node_id
        self.federation = federation
        self.broker = broker
        self.peers = peers
        self.protocol = protocol
        self.chunk_size = chunk_size
        self.max_frame_bytes = max_frame_bytes
        self.reassembly_timeout = float(reassembly_timeout)
        self.keepalive = keepalive
        self.username = username
        self.password = password
        self.qos = qos
        self.connect_timeout = float(connect_timeout)
        self.max_pending_bytes = max_pending_bytes
        self.connect_peer_brokers = connect_peer_brokers
        self.broadcasts = bool(broadcasts)

        #: most bytes of incomplete transfers held per broker connection, all topics together
        self._max_reassembly_bytes = 4 * max_frame_bytes
        self.stats = TransportStats()

        self._lock = threading.RLock()
        #: rate-limited log of the exceptions caught per message (``handler_error``)
        self._errors = RateLimitedLog(log)
        self._conns: dict[str, _Conn] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_frame: FrameHandler | None = None
        #: ``prepare_frame(frame, wire_bytes)``, when set, is called on the network thread
        #: for every complete frame, and its result is handed to ``on_frame`` instead of
        #: the frame (the runtime decodes and verifies there; see RuntimeContext)
        self.prepare_frame: Callable[[bytes, int], object] | None = None
        self._on_presence: PresenceHandler | None = None
        self._started = False
        self._stopping = False
        self._stopped = False
        self._maint_stop = threading.Event()
        self._maint_thread: threading.Thread | None = None
        self._bad_directory: set[str] = set()

        self._t_inbox = topic(federation, node_id, "inbox")
        self._t_out = topic(federation, node_id, "out")
        if channel is not None:
            channel.bind(self)

    # ------------------------------------------------------------------ state

    @property
    def connected(self) -> bool:
        """True while the home connection is up and subscribed."""
        conn = self._conns.get(self.broker)
        return conn is not None and conn.ready.is_set()

    def connections(self) -> dict[str, bool]:
        """Broker endpoint -> whether that connection is up and subscribed."""
        with self._lock:
            return {ep: c.ready.is_set() for ep, c in self._conns.items()}

    def use_prepare_frame(self, prepare: Callable[[bytes, int], object]) -> bool:
        """Set :attr:`prepare_frame` (see :meth:`Transport.use_prepare_frame`); True."""
        self.prepare_frame = prepare
        return True

    def count(self, reason: str, n: int = 1) -> None:
        """Count ``n`` dropped messages under ``reason`` (``stats.dropped``; thread-safe)."""
        with self._lock:
            self.stats.dropped[reason] += n

    @property
    def running(self) -> bool:
        """True between a successful ``start()`` and ``stop()``."""
        return self._started and not self._stopping

    @property
    def presence_handler(self) -> PresenceHandler | None:
        """The ``on_presence`` handler given to ``start()`` (None before)."""
        return self._on_presence

    @property
    def statuses(self) -> dict[str, dict[str, Any]]:
        """The latest status of every other node heard, as the channel holds it
        (node id -> status; empty without a channel)."""
        return self.channel.statuses if self.channel is not None else {}

    def home_session(self) -> tuple[mqtt.Client, bool] | None:
        """The home connection's client and whether it is connected now; None before it
        exists or while stopping."""
        conn = self._conns.get(self.broker)
        if conn is None or conn.client is None or self._stopping:
            return None
        return conn.client, conn.connected

    def dispatch(self, fn: Callable[..., Any] | None, *args: Any) -> None:
        """Call ``fn(*args)`` on the event loop of ``start()`` (from any thread); an
        exception it raises is counted as ``handler_error`` and logged."""
        self._dispatch(fn, *args)

    # ----------------------------------------------------------- connections

    def _subscriptions(self, conn: _Conn) -> list[tuple[str, Any]]:
        fed = self.federation
        topics = [(topic(fed, "+", "out"), self.qos, True)] if self.broadcasts else []
        if self.channel is not None:
            topics += [(topic(fed, "+", leaf), 1, False) for leaf in self.channel.leaves]
        if conn.home:
            topics.insert(0, (self._t_inbox, self.qos, False))
        if self.protocol == "5":
            return [(t, SubscribeOptions(qos=q, noLocal=no_local)) for t, q, no_local in topics]
        return [(t, q) for t, q, _ in topics]

    def _get_conn(self, endpoint: str, home: bool = False) -> _Conn:
        """The connection to ``endpoint``, created and started (non-blocking) if new."""
        with self._lock:
            conn = self._conns.get(endpoint)
            if conn is not None:
                return conn
            if self._stopping:
                raise RuntimeError("MqttTransport is stopping")
            conn = _Conn(endpoint, home, self.node_id)
            client = mqtt_session(f"dfl-{self.federation}-{self.node_id}-{secrets.token_hex(4)}",
                                  protocol=self.protocol, username=self.username, password=self.password,
                                  tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key, userdata=conn)
            if home and self.channel is not None:  # a fresh last will before every connection attempt
                client.on_pre_connect = self._on_pre_connect
            client.on_connect = self._on_connect
            client.on_connect_fail = self._on_connect_fail
            client.on_disconnect = self._on_disconnect
            client.on_subscribe = self._on_subscribe
            client.on_message = self._on_message
            conn.client = client
            self._conns[endpoint] = conn
            connect_kwargs: dict[str, Any] = {"clean_start": True} if self.protocol == "5" else {}
            client.connect_async(conn.host, conn.port, keepalive=self.keepalive, **connect_kwargs)
            client.loop_start()
            log.info("%s: connecting to %sbroker %s (MQTT %s)", self.node_id,
                     "home " if home else "", endpoint, self.protocol)
            return conn

    def _on_pre_connect(self, client, conn: _Conn) -> None:
        """paho, before each attempt of the home connection: the channel's last will for it."""
        will = self.channel.will() if self.channel is not None else None
        if will is not None:
            client.will_set(will[0], will[1], qos=1, retain=True)

    def _on_connect(self, client, conn: _Conn, flags, reason_code, properties) -> None:
        try:
            if reason_code.is_failure:
                conn.error = refused(reason_code, self.username)
                conn.outage.attempt_failed(conn.error)  # logged once, then throttled
                return
            conn.connected = True
            conn.error = ""
            conn.outage.connected()  # after an outage: "back after ..." (INFO)
            rc, mid = client.subscribe(self._subscriptions(conn))
            if rc != mqtt.MQTT_ERR_SUCCESS:
                # Not subscribed: stay not ready (start() times out naming this error). A lost
                # socket is followed by a disconnect, and paho's reconnect subscribes again.
                conn.sub_mid = None
                conn.error = f"subscribe failed: {mqtt.error_string(rc)}"
                log.warning("%s: %s: %s", self.node_id, conn.endpoint, conn.error)
                return
            conn.sub_mid = mid
            if conn.home and not self._stopping and self.channel is not None:
                self.channel.announce(client)
        except Exception:  # noqa: BLE001 - never kill paho's thread
            log.exception("%s: error in on_connect", self.node_id)

    def _on_connect_fail(self, client, conn: _Conn) -> None:
        conn.error = conn.error or "connection failed (is the broker running?)"
        if not self._stopping:
            conn.outage.attempt_failed("no connection")

    def _on_disconnect(self, client, conn: _Conn, flags, reason_code, properties) -> None:
        was = conn.connected
        conn.connected = False
        conn.ready.clear()
        conn.gone.set()
        if was and not self._stopping:
            conn.outage.lost(str(reason_code))  # WARNING; the attempts that follow are throttled

    def _on_subscribe(self, client, conn: _Conn, mid, reason_code_list, properties) -> None:
        if mid != conn.sub_mid:
            return
        refused = [str(rc) for rc in reason_code_list if getattr(rc, "is_failure", False)]
        if refused:
            conn.fatal = f"broker refused subscriptions: {', '.join(refused)}"
            log.error("%s: %s: %s", self.node_id, conn.endpoint, conn.fatal)
            return
        if not conn.ever_ready:  # a reconnection was logged by conn.outage ("back after ...")
            log.info("%s: connected to %s", self.node_id, conn.endpoint)
        conn.ever_ready = True
        conn.ready.set()

    async def _wait_ready(self, conn: _Conn, deadline: float) -> bool:
        delay = 0.002
        while not conn.ready.is_set():
            if conn.fatal:
                raise ConnectionError(f"MQTT broker {conn.endpoint}: {conn.fatal}")
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True

    async def _close_conn(self, conn: _Conn) -> None:
        client = conn.client
        if client is None:
            return
        await asyncio.get_running_loop().run_in_executor(None, close_session, client, conn.gone, conn.connected)

    # ------------------------------------------------------------- receiving

    def _dispatch(self, fn: Callable[..., Any] | None, *args: Any) -> None:
        loop = self._loop
        if fn is None or loop is None or self._stopped:
            return
        try:
            loop.call_soon_threadsafe(self._invoke, fn, args)
        except RuntimeError:
            pass  # loop closed

    def _invoke(self, fn: Callable[..., Any], args: tuple) -> None:
        if self._stopped:
            return
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a handler bug must not stop the transport
            self.count("handler_error")
            self._errors.exception("%s: handler %r failed", self.node_id, fn)

    def _on_message(self, client, conn: _Conn, msg) -> None:
        try:
            parts = msg.topic.split("/")
            if len(parts) != 5 or parts[0] != TOPIC_ROOT or parts[1] != self.federation or parts[2] != "node":
                return
            sender, leaf = parts[3], parts[4]
            payload = msg.payload
            if leaf == "inbox":
                if sender == self.node_id:
                    self._handle_frame(conn, msg.topic, payload)
            elif leaf == "out":
                if sender != self.node_id:
                    self._handle_frame(conn, msg.topic, payload)
            elif self.channel is not None and leaf in self.channel.leaves:
                self.channel.on_message(conn.home, conn.client, sender, leaf, payload)
        except Exception:  # noqa: BLE001 - never kill paho's thread
            self.count("handler_error")
            self._errors.exception("%s: error handling a message on %s", self.node_id, getattr(msg, "topic", "?"))

    def _handle_frame(self, conn: _Conn, topic_name: str, payload: bytes) -> None:
        with self._lock:
            self.stats.bytes_received += len(payload)
        limit = self.max_frame_bytes + (HEADER_LEN if is_chunk(payload) else 0)
        if len(payload) > limit:
            self.count("oversized")
            log.warning("%s: dropped a %d-byte payload on %s (oversized)", self.node_id, len(payload), topic_name)
            return
        with conn.reasm_lock:
            if is_chunk(payload):
                held = sum(r.held_bytes for r in conn.reassemblers.values())
                if held + len(payload) > self._max_reassembly_bytes:
                    self.count("too_many_transfers")
                    log.warning("%s: dropped a chunk on %s: %d bytes of incomplete transfers held",
                                self.node_id, topic_name, held)
                    return
                # -- security: bounded chunks in flight per connection (all topics)
                in_flight = sum(r.pending for r in conn.reassemblers.values())
                mine = conn.reassemblers.get(topic_name)
                if in_flight >= self.max_transfers and (mine is None or not mine.holds(payload)):
                    self.count("too_many_transfers")
                    log.warning("%s: dropped a chunk on %s: %d transfers in flight",
                                self.node_id, topic_name, in_flight)
                    return
            reassembler = conn.reassemblers.get(topic_name)
            if reassembler is None:
                reassembler = Reassembler(max_transfers=self.max_transfers,
                                          max_bytes=self._max_reassembly_bytes, timeout=self.reassembly_timeout,
                                          max_frame_bytes=self.max_frame_bytes, hash_from=payload_offset)
                conn.reassemblers[topic_name] = reassembler
            try:
                result = reassembler.feed_with_size(payload)
            except ChunkError as exc:
                self.count(exc.reason)
                log.warning("%s: dropped a chunk on %s: %s", self.node_id, topic_name, exc)
                return
        if result is None:
            return
        with self._lock:
            self.stats.frames_received += 1
        frame: Any = result[0]
        prepare = self.prepare_frame
        if prepare is not None and not self._stopped:
            # decode and verify here, on the network thread: one handover per finished message
            try:
                frame = prepare(frame, result[1])
            except Exception:  # noqa: BLE001 - the handler on the loop decodes it then
                log.exception("%s: preparing a frame failed", self.node_id)
        self._dispatch(self._on_frame, frame, result[1])

    # ------------------------------------------------------------ maintenance

    def _maintenance(self) -> None:
        heartbeat = self.channel.period if self.channel is not None else 1.0
        period = max(0.05, min(1.0, heartbeat, self.reassembly_timeout / 2))
        while not self._maint_stop.wait(period):
            try:
                expired = 0
                for conn in list(self._conns.values()):
                    with conn.reasm_lock:
                        for name, r in list(conn.reassemblers.items()):
                            expired += r.expire()
                            if r.idle:
                                del conn.reassemblers[name]
                    conn.prune()
                if expired:
                    self.count("incomplete_transfer", expired)
                    log.warning("%s: dropped %d incomplete transfer(s)", self.node_id, expired)
                if self.channel is not None:
                    self.channel.tick()
            except Exception:  # noqa: BLE001 - keep the maintenance (and the heartbeat) alive
                log.exception("%s: maintenance failed", self.node_id)

    def _on_peer_event(self, event: str, node_id: str, info: PeerInfo) -> None:
        if event == "removed" or not self._started or self._stopping or not self.connect_peer_brokers:
            return
        try:
            self._endpoint_for(node_id, create=True)
        except Exception:  # noqa: BLE001 - called from a discovery thread
            log.debug("%s: could not connect to the broker of %r", self.node_id, node_id, exc_info=True)

    def _endpoint_for(self, peer: str, create: bool = False) -> str:
        endpoint = self.peers.broker_of(peer) or self.broker
        if endpoint != self.broker:
            try:
                parse_endpoint(endpoint)
            except ValueError:
                if endpoint not in self._bad_directory:
                    self._bad_directory.add(endpoint)
                    log.warning("%s: bad broker %r for peer %r in the directory; using the home broker",
                                self.node_id, endpoint, peer)
                return self.broker
            if create:
                self._get_conn(endpoint)
        return endpoint

    # -------------------------------------------------------------- interface

    async def start(self, on_frame: FrameHandler, on_presence: PresenceHandler) -> None:
        """Connect to the home broker, subscribe; the channel announces presence "online".

        Returns once the home connection is up and its subscriptions acknowledged.
        Handlers are then called on the running event loop.

        Raises:
            RuntimeError: already started.
            ConnectionError: the home broker (named as host:port) did not accept the
                connection and subscriptions within ``connect_timeout`` seconds.
        """
        if self._started or self._stopped:
            raise RuntimeError("MqttTransport.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._on_frame = on_frame
        self._on_presence = on_presence
        conn = self._get_conn(self.broker, home=True)
        try:
            ok = await self._wait_ready(conn, time.monotonic() + self.connect_timeout)
        except ConnectionError:
            await self._abort_start()
            raise
        if not ok:
            why = conn.error or "no answer"
            await self._abort_start()
            raise ConnectionError(f"could not connect to MQTT broker {self.broker} "
                                  f"within {self.connect_timeout:g} s: {why}")
        self._started = True
        if self.channel is not None:
            self.channel.started()
        self._maint_thread = threading.Thread(target=self._maintenance, daemon=True,
                                              name=f"dfl-mqtt-maint-{self.node_id}")
        self._maint_thread.start()
        if hasattr(self.peers, "add_listener"):
            self.peers.add_listener(self._on_peer_event)
        if self.connect_peer_brokers and hasattr(self.peers, "all"):
            for info in self.peers.all():
                self._endpoint_for(info.node_id, create=True)

    async def _abort_start(self) -> None:
        self._stopping = True
        self._stopped = True
        await asyncio.gather(*(self._close_conn(c) for c in list(self._conns.values())))

    def check_started(self) -> None:
        """Raises RuntimeError before ``start()`` (fine after ``stop()``)."""
        if not self._started and not self._stopped:
            raise RuntimeError("MqttTransport used before start()")

    async def send(self, peer: str, frame: bytes) -> int:
        """Publish ``frame`` to ``peer``'s inbox on the peer's broker (pooled connection).

        Returns the wire bytes (payload bytes of all chunks), 0 when dropped (after
        ``stop()``, QoS 0 while disconnected, queue full; counted in ``stats.dropped``).
        A new connection to the peer's broker is awaited up to ``connect_timeout``;
        with QoS >= 1 frames to a broker that is down are queued (``max_pending_bytes``).

        Raises:
            RuntimeError: before ``start()``.
            ValueError: ``peer`` is not a valid node id, or the frame is larger than
                ``max_frame_bytes``.
        """
        self.check_started()
        if not isinstance(peer, str) or not _ID_RE.match(peer):
            raise ValueError(f"peer: not a valid node id: {peer!r}")
        if self._stopping:
            self.count("not_connected")
            return 0
        conn = self._get_conn(self._endpoint_for(peer))
        if not conn.ever_ready:
            try:
                await self._wait_ready(conn, conn.created + self.connect_timeout)
            except ConnectionError as exc:
                log.warning("%s: %s", self.node_id, exc)  # publish anyway: queued or refused
        return await self._publish_frame(conn, topic(self.federation, peer, "inbox"), frame)

    async def broadcast(self, frame: bytes, audience: Collection[str] | None = None) -> int:
        """Publish ``frame`` on this node's ``out`` topic (home broker).

        ``audience`` is ignored: every subscriber of the topic receives the frame (the
        nodes outside a configured graph reject it as ``not_neighbour``).  Returns and
        raises like :meth:`send`.
        """
        self.check_started()
        if self._stopping:
            self.count("not_connected")
            return 0
        return await self._publish_frame(self._conns[self.broker], self._t_out, frame)

    async def _publish_frame(self, conn: _Conn, topic_name: str, frame: bytes) -> int:
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise TypeError("frame must be bytes")
        if len(frame) > self.max_frame_bytes:
            raise ValueError(f"frame of {len(frame)} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        if len(frame) > _OFFLOAD_BYTES:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, self._publish_chunks, conn, topic_name, frame)
        return self._publish_chunks(conn, topic_name, frame)

    def _publish_chunks(self, conn: _Conn, topic_name: str, frame: bytes) -> int:
        if self.qos == 0 and not conn.connected:
            self.count("not_connected")
            return 0
        size = chunked_size(frame, self.chunk_size)
        if conn.prune() + size > self.max_pending_bytes:
            self.count("queue_full")
            log.warning("%s: dropped a %d-byte frame for %s: more than %d bytes queued for %s",
                        self.node_id, len(frame), topic_name, self.max_pending_bytes, conn.endpoint)
            return 0
        client = conn.client
        if client is None:  # not connecting yet
            self.count("not_connected")
            return 0
        # all chunks built first, then queued in one go: building one while paho writes the
        # previous makes the two threads trade the GIL (measured slower on a loaded 2-core VM)
        for chunk in list(iter_chunks(frame, self.chunk_size)):
            info = client.publish(topic_name, chunk, qos=self.qos)
            if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                self.count("publish_error")
                log.warning("%s: publish to %s failed: %s", self.node_id, topic_name, mqtt.error_string(info.rc))
                return 0
            conn.track(info, len(chunk))
        with self._lock:
            self.stats.bytes_sent += size
            self.stats.frames_sent += 1
        return size

    async def publish_status(self, status: dict[str, Any]) -> None:
        """Publish ``status`` through the channel (retained JSON, see
        :meth:`dfl_agent.discovery.presence.MqttPresence.publish_status`).

        Raises:
            RuntimeError: before ``start()``, or without a channel.
            ValueError: ``status`` is not a JSON-serialisable dict.
        """
        self.check_started()
        if self.channel is None:
            raise RuntimeError("this MqttTransport has no presence/status channel")
        await self.channel.publish_status(status)

    async def stop(self) -> None:
        """Let the channel say goodbye ("offline", retained) and queued frames go out
        (up to ~2 s), disconnect all.

        Idempotent; also safe after a failed ``start()``.
        """
        if self._stopped:
            return
        self._stopping = True
        self._maint_stop.set()
        home = self._conns.get(self.broker)
        if home is not None and home.client is not None and home.connected:
            info = self.channel.goodbye(home.client) if self.channel is not None else None
            deadline = time.monotonic() + STOP_FLUSH_TIMEOUT
            while time.monotonic() < deadline:
                try:
                    if ((info is None or info.is_published())
                            and all(c.prune() == 0 or not c.connected for c in self._conns.values())):
                        break
                except (ValueError, RuntimeError):
                    break
                await asyncio.sleep(0.005)
        self._stopped = True
        await asyncio.gather(*(self._close_conn(c) for c in list(self._conns.values())))
        if self._maint_thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._maint_thread.join)
        log.info("%s: stopped (%s)", self.node_id, self.stats.as_dict())
