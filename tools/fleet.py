"""How ``dflctl`` reaches a fleet: one option group and one connection helper.

The fleet commands (``peers``, ``status``, ``watch``, ``doctor`` and ``run submit|list|show|cancel``)
all take the same options (:func:`add_options`): ``--config NODE.toml``, whose ``[mqtt]``
section gives the broker, the credentials and the TLS material and whose ``[security]``
section gives the trust material, or, overriding it option by option, ``--broker``,
``--federation``, ``-u/--username``, ``--password-file``, ``--cafile``, ``--cert`` and
``--key`` (named and ordered as ``mosquitto_sub`` names them).  :func:`target` turns them into
a :class:`FleetTarget`; :meth:`FleetTarget.session` builds the paho client with
:func:`dfl_agent.transport.mqtt.mqtt_session`, and :meth:`FleetTarget.connect` connects it and
waits for the broker's CONNACK.

A connection that fails raises :class:`BrokerError` (a ``ConnectionError``: ``dflctl`` prints
its one line and exits 3) saying why: connection refused, unknown host, TLS failure, not
authorised (the broker's CONNACK reason), or no answer.

A query that hears nothing from its federation is answered by :func:`absent`: one line that
names the federations the broker does carry (:func:`federations_seen`), for exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt
    from paho.mqtt.properties import Properties
    from paho.mqtt.reasoncodes import ReasonCode

    from dfl_agent.runtime.shared.config import NodeConfig
    from dfl_agent.security.trust import SecurityGuard

#: the broker and federation when neither ``--config`` nor an option names them
DEFAULT_BROKER, DEFAULT_FEDERATION = "127.0.0.1:1883", "default"


class BrokerError(ConnectionError):
    """The broker cannot be used; the message is one line saying why (``dflctl`` exits 3)."""


class PublishRefused(Exception):
    """The broker answered a publish with a failure reason code (MQTT 5 PUBACK, e.g. 0x87 not
    authorized: its ACL denies the topic to this user); the message says so in one line
    (``dflctl`` exits 1)."""


class FederationAbsent(Exception):
    """A fleet query heard nothing from its federation; the message (:func:`absent`) names the
    federations the broker does carry (``dflctl`` prints it and exits 1)."""


@dataclasses.dataclass(frozen=True)
class FleetTarget:
    """Where a fleet command connects, and as whom.

    Attributes:
        broker: ``host:port``.
        federation: the federation id (topics ``dfl/{federation}/...``).
        username, password: broker credentials (``username`` None: none).
        tls_ca, tls_cert, tls_key: TLS material (``tls_ca`` None: plain MQTT).
        protocol: ``"5"`` or ``"3.1.1"``.
        config: the node configuration of ``--config`` (its ``[security]`` trust material),
            or None.
    """

    broker: str = DEFAULT_BROKER
    federation: str = DEFAULT_FEDERATION
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    protocol: str = "5"
    config: NodeConfig | None = dataclasses.field(default=None, repr=False, compare=False)

    def session(self, prefix: str = "dflctl", *, userdata: object = None) -> mqtt.Client:
        """A paho client (not connected) with this target's credentials, TLS and protocol,
        client id ``prefix-xxxxxxxx``, no automatic reconnection.

        Raises:
            ValueError: unreadable TLS files (the message names the option).
        """
        from dfl_agent.transport.mqtt import mqtt_session

        try:
            return mqtt_session(f"{prefix}-{secrets.token_hex(4)}", protocol=self.protocol, username=self.username,
                                password=self.password, tls_ca=self.tls_ca, tls_cert=self.tls_cert,
                                tls_key=self.tls_key, userdata=userdata, reconnect_delay=None)
        except (OSError, ssl.SSLError) as exc:
            files = ", ".join(f for f in (self.tls_ca, self.tls_cert, self.tls_key) if f)
            raise ValueError(f"cannot load the TLS files ({files}): {_why(exc)}") from None

    def connect(self, client: mqtt.Client, timeout: float = 5.0) -> None:
        """Connect ``client`` (from :meth:`session`), start its network loop and wait until the
        broker accepted the connection.  ``client.on_connect`` (if set) is called as usual once
        the broker accepted; it is not called for a refused login.

        Raises:
            BrokerError: refused, unknown host, TLS failure, not authorised, or no CONNACK
                within ``timeout`` s; the client is stopped.
            ValueError: ``broker`` is not ``host:port``.
        """
        from dfl_agent.transport.endpoint import parse_endpoint

        host, port = parse_endpoint(self.broker)
        done = threading.Event()
        outcome: dict[str, Any] = {}
        user_on_connect: Callable[..., object] | None = client.on_connect

        def on_connect(c: mqtt.Client, userdata: object, flags: mqtt.ConnectFlags, reason: ReasonCode,
                       properties: Properties | None = None) -> None:
            if _is_failure(reason):
                outcome["refused"] = reason
                c.disconnect()  # no automatic retry of a refused login
            elif user_on_connect is not None:
                user_on_connect(c, userdata, flags, reason, properties)
            done.set()

        def on_disconnect(c: mqtt.Client, userdata: object, flags: object = None, reason: object = None,
                          properties: object = None) -> None:
            if not done.is_set():
                outcome["closed"] = reason
                done.set()

        client.on_connect, client.on_disconnect = on_connect, on_disconnect
        try:
            client.connect(host, port, keepalive=30)
        except socket.gaierror:
            raise BrokerError(f"unknown host {host!r} (broker {self.broker}): check --broker or mqtt.broker") from None
        except ConnectionRefusedError:
            raise BrokerError(f"connection refused by {self.broker}: no MQTT broker listens there "
                              "(is it running? the right port?)") from None
        except ssl.SSLError as exc:
            raise BrokerError(f"TLS failure with {self.broker}: {_why(exc)}{self._tls_hint(exc)}") from None
        except ConnectionResetError:
            if self.tls_ca:
                raise BrokerError(f"TLS failure with {self.broker}: the connection was reset during the TLS "
                                  f"handshake (is {self.broker} a TLS listener?)") from None
            raise BrokerError(f"{self.broker} reset the connection") from None
        except (OSError, TimeoutError) as exc:
            raise BrokerError(f"cannot reach MQTT broker {self.broker}: {_why(exc)}") from None
        client.loop_start()
        if not done.wait(timeout):
            _stop(client)
            raise BrokerError(f"no answer from MQTT broker {self.broker} within {timeout:g}s")
        if "refused" in outcome or "closed" in outcome:
            _stop(client)
        if "refused" in outcome:
            raise BrokerError(self._refusal(outcome["refused"]))
        if "closed" in outcome:
            hint = "" if self.tls_ca else " (a TLS listener? give --cafile, or mqtt.tls_ca in --config)"
            raise BrokerError(f"{self.broker} closed the connection before answering{hint}")

    def _refusal(self, reason: object) -> str:
        text = str(reason)
        low = text.lower()
        who = (f"as user {self.username!r}" + ("" if self.password is not None else
                                                 " (no password given: --password-file, or mqtt.password)")
               if self.username else "without a user name (give --config, or -u and --password-file)")
        if "not authori" in low or "user name or password" in low or "bad user" in low:
            return f"{self.broker}: not authorised {who} (broker: {text})"
        return f"{self.broker} refused the connection: {text}"

    def _tls_hint(self, exc: BaseException) -> str:
        if not self.tls_ca:
            return ""
        if isinstance(exc, ssl.SSLCertVerificationError):
            return f" (is {self.tls_ca} the CA that signed the broker's certificate?)"
        if "wrong version" in str(exc).lower() or "record layer" in str(exc).lower():
            return f" (is {self.broker} a TLS listener?)"
        return ""

    def open(self, prefix: str = "dflctl", timeout: float = 5.0) -> mqtt.Client:
        """A connected client (:meth:`session` then :meth:`connect`); stop it with :func:`close`."""
        c = self.session(prefix)
        self.connect(c, timeout)
        return c


def _is_failure(reason: object) -> bool:
    failure = getattr(reason, "is_failure", None)
    if failure is not None:
        return bool(failure)
    return bool(reason)  # a plain int: 0 is success


def _why(exc: BaseException) -> str:
    """One line for an OS or TLS error (no ``[Errno n]`` noise, no file positions)."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).replace("_", " ").lower()
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _stop(client: mqtt.Client) -> None:
    try:
        client.disconnect()
    finally:
        client.loop_stop()


def close(client: mqtt.Client) -> None:
    """Disconnect ``client`` and stop its network loop."""
    _stop(client)


# -- options ---------------------------------------------------------------------------


def add_options(p: argparse.ArgumentParser, *, timeout: float = 5.0) -> None:
    """The fleet commands' connection options, one group: ``--config`` then mosquitto_sub's
    names (``--broker`` and ``--federation`` stand for its ``-h``/``-p`` and topic)."""
    g = p.add_argument_group("connection", "the node's configuration (--config), or the options below; "
                                           "an option given overrides the configuration's value")
    g.add_argument("--config", default=None, metavar="NODE.toml",
                   help="a node configuration: its [mqtt] broker, credentials and TLS files, its federation and "
                        "its [security] trust material (signatures are verified with it)")
    g.add_argument("--broker", default=None, metavar="HOST:PORT",
                   help=f"the broker (default: from --config, else {DEFAULT_BROKER})")
    g.add_argument("--federation", default=None,
                   help=f"federation name (default: from --config, else {DEFAULT_FEDERATION})")
    g.add_argument("-u", "--username", default=None, help="broker user name (default: mqtt.username of --config)")
    g.add_argument("--password-file", default=None, metavar="FILE",
                   help="file whose first line is the broker password (default: mqtt.password of --config)")
    g.add_argument("--cafile", default=None, metavar="FILE",
                   help="CA certificate: connect with TLS and verify the broker (default: mqtt.tls_ca of --config)")
    g.add_argument("--cert", default=None, metavar="FILE",
                   help="client certificate, for brokers that require one (needs --cafile and --key)")
    g.add_argument("--key", default=None, metavar="FILE", help="the client certificate's private key")
    g.add_argument("--timeout", type=float, default=timeout, help="seconds to wait for the broker")


def target(a: argparse.Namespace) -> FleetTarget:
    """The :class:`FleetTarget` of the options of :func:`add_options` (``--config`` first,
    each option given overriding its value).

    Raises:
        ValueError: an invalid configuration, an unreadable password file, ``--cert``
            without ``--key`` or without a CA (the message names the option; exit 2).
    """
    cfg = None
    if getattr(a, "config", None):
        from dfl_agent.runtime.shared.config import load_config

        cfg = load_config(a.config)
    m = cfg.mqtt if cfg is not None else None
    password = m.password if m is not None else None
    if getattr(a, "password_file", None):
        try:
            lines = Path(a.password_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"--password-file: cannot read {a.password_file}: {_why(exc)}") from None
        password = lines[0] if lines else ""
    t = FleetTarget(
        broker=getattr(a, "broker", None) or (m.broker if m is not None else DEFAULT_BROKER),
        federation=getattr(a, "federation", None) or (cfg.federation if cfg is not None else DEFAULT_FEDERATION),
        username=getattr(a, "username", None) or (m.username if m is not None else None),
        password=password,
        tls_ca=getattr(a, "cafile", None) or (m.tls_ca if m is not None else None),
        tls_cert=getattr(a, "cert", None) or (m.tls_cert if m is not None else None),
        tls_key=getattr(a, "key", None) or (m.tls_key if m is not None else None),
        protocol=m.protocol if m is not None else "5",
        config=cfg,
    )
    if bool(t.tls_cert) != bool(t.tls_key):
        raise ValueError("--cert and --key go together (a client certificate and its private key)")
    if t.tls_cert and not t.tls_ca:
        raise ValueError("--cert needs --cafile (the CA that signed the broker's certificate)")
    return t


def as_target(broker: str | FleetTarget, federation: str = DEFAULT_FEDERATION) -> FleetTarget:
    """``broker`` as a target: a :class:`FleetTarget` as it is, a ``host:port`` without
    credentials."""
    return broker if isinstance(broker, FleetTarget) else FleetTarget(broker=broker, federation=federation)


def trust_guard(t: FleetTarget) -> SecurityGuard | None:
    """A verifying-only guard from ``--config``'s ``[security]`` trust material, or None
    (no ``--config``, or an unsigned federation: no trusted keys, federation key or
    operators and signatures not required), where every entry shows as ``unverified``."""
    cfg = t.config
    if cfg is None:
        return None
    sec = cfg.security
    if not (sec.require_signatures or sec.trusted_keys or sec.federation_key or sec.operators):
        return None
    return observer_guard(cfg)


def observer_guard(cfg: NodeConfig) -> SecurityGuard:
    """A verifying-only :class:`~dfl_agent.security.SecurityGuard` from a node config's
    ``[security]`` trust material (pinned keys, operators, federation key); every
    unsigned or untrusted presence/status then shows as ``untrusted: REASON``."""
    from dfl_agent.security import SecurityGuard, TrustStore

    sec = cfg.security
    trust = TrustStore(cfg.federation, {k: str(v) for k, v in sec.trusted_keys.items()}, sec.federation_key,
                       operators={k: str(v) for k, v in sec.operators.items()})
    return SecurityGuard("dflctl", None, trust, require_signatures=True)


# -- which federations a broker carries --------------------------------------------------


def federations_seen(t: FleetTarget, timeout: float = 3.0, quiet: float = 0.4,
                     stop_at: str | None = None) -> dict[str, set[str]]:
    """The federations whose nodes have a retained presence or status on ``t.broker``
    (federation -> node ids), as far as the user may read ``dfl/+/node/+/presence`` and
    ``dfl/+/node/+/status``.  Retained messages follow the subscription at once: the scan
    ends ``quiet`` s after the last one (at most ``timeout`` s), or as soon as a node of
    federation ``stop_at`` is heard.

    Raises:
        BrokerError: as :meth:`FleetTarget.connect`.
    """
    seen: dict[str, set[str]] = {}
    lock = threading.Lock()
    acked, found = threading.Event(), threading.Event()
    last = [time.monotonic()]
    c = t.session("dflctl-scan")

    def on_connect(cl: mqtt.Client, *_: object) -> None:
        cl.subscribe([("dfl/+/node/+/presence", 0), ("dfl/+/node/+/status", 0)])

    def on_message(cl: mqtt.Client, ud: object, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic.split("/")
        if len(parts) == 5 and msg.payload:
            with lock:
                seen.setdefault(parts[1], set()).add(parts[3])
                last[0] = time.monotonic()
            if parts[1] == stop_at:
                found.set()

    def on_subscribe(*_: object) -> None:
        last[0] = time.monotonic()
        acked.set()

    c.on_connect, c.on_message, c.on_subscribe = on_connect, on_message, on_subscribe
    t.connect(c, timeout)
    try:
        end = time.monotonic() + timeout
        acked.wait(timeout)
        while time.monotonic() < end and time.monotonic() - last[0] < quiet and not found.is_set():
            time.sleep(0.02)
        with lock:
            return {f: set(n) for f, n in seen.items()}
    finally:
        _stop(c)


def absent(t: FleetTarget, what: str = "presence or status", seen: dict[str, set[str]] | None = None) -> str:
    """The one line for a query that heard nothing from ``t.federation``: which federations
    the broker does carry (``seen``, else :func:`federations_seen`; a likely misspelling
    first), or that it carries none that this user may read."""
    import difflib

    if seen is None:
        try:
            seen = federations_seen(t)
        except (ConnectionError, ValueError):
            seen = {}
    seen = {f: n for f, n in seen.items() if f != t.federation}
    line = f"no {what} from federation {t.federation!r} on {t.broker}"
    if not seen:
        user = f"user {t.username!r}" if t.username else "an anonymous client"
        return (f"{line}, nor from any other federation that {user} may read (no agent running? "
                "the broker's ACL?)")
    near = difflib.get_close_matches(t.federation, list(seen), n=1)
    names = sorted(seen, key=lambda f: (f not in near, f))
    listed = ", ".join(f"{f} ({len(seen[f])} node{'s' if len(seen[f]) != 1 else ''})" for f in names)
    hint = f"; did you mean --federation {near[0]}?" if near else ""
    return f"{line}; federations seen there: {listed}{hint}"


def publish_retained(broker: str | FleetTarget, topic: str, payload: bytes, timeout: float = 10.0) -> None:
    """Publish ``payload`` retained (QoS 1) and wait until the broker has it.

    Args:
        broker: a :class:`~dfl_agent.cli.fleet.FleetTarget` (credentials, TLS) or a ``host:port``.

    Raises:
        ConnectionError: the broker cannot be used (:class:`~dfl_agent.cli.BrokerError`,
            saying why), or does not acknowledge in ``timeout`` s.
        dfl_agent.cli.PublishRefused: the broker's PUBACK carries a failure reason code
            (MQTT 5; e.g. 0x87 not authorized: its ACL denies the topic to this user).  Under
            MQTT 3.1.1 a broker acknowledges a publish it drops, without a word.
    """
    t = as_target(broker)
    reasons: dict[int, ReasonCode | None] = {}
    c = t.session("dflctl-run")
    c.on_publish = lambda cl, ud, mid, reason=None, props=None: reasons.__setitem__(mid, reason)
    t.connect(c, timeout)
    try:
        info = c.publish(topic, payload, qos=1, retain=True)
        info.wait_for_publish(timeout)
        if not info.is_published():
            raise BrokerError(f"broker {t.broker} did not acknowledge the publish on {topic} within {timeout:.0f}s")
        reason = reasons.get(info.mid)
        if reason is not None and getattr(reason, "is_failure", False):
            raise PublishRefused(_refused_text(t, topic, reason))
    finally:
        close(c)


def _refused_text(t: FleetTarget, topic: str, reason: object) -> str:
    """One line for a publish the broker refused: its reason (name and code) and, for "not
    authorized", whom the broker's ACL denies the topic."""
    code = getattr(reason, "value", None)
    text = f"{reason}" + (f" (MQTT reason code 0x{code:02x})" if isinstance(code, int) else "")
    line = f"broker {t.broker} refused the publish on {topic}: {text}"
    if code == 0x87:
        who = f"user {t.username!r}" if t.username else "an anonymous client"
        line += (f"; its ACL does not let {who} publish runs: use an operator's broker account (the operator's "
                 "credentials as --config, or -u and --password-file)")
    return line


def fetch_retained(broker: str | FleetTarget, topic: str, timeout: float = 10.0,
                   absent_after: float = 2.0) -> bytes | None:
    """The retained message on ``topic`` (None when there is none: nothing arrived within
    ``absent_after`` s of the subscription being acknowledged).

    Args:
        broker: a :class:`~dfl_agent.cli.fleet.FleetTarget` (credentials, TLS) or a ``host:port``.

    Raises:
        ConnectionError: the broker cannot be used (saying why) or does not answer in ``timeout`` s.
    """
    t = as_target(broker)
    got: list[bytes] = []
    subscribed, arrived = threading.Event(), threading.Event()
    c = t.session("dflctl-get")
    c.on_connect = lambda cl, *_: cl.subscribe(topic, qos=1)
    c.on_subscribe = lambda *_: subscribed.set()

    def on_message(cl: mqtt.Client, ud: object, msg: mqtt.MQTTMessage) -> None:
        if msg.payload and not got:
            got.append(bytes(msg.payload))
            arrived.set()

    c.on_message = on_message
    t.connect(c, timeout)
    try:
        if not subscribed.wait(timeout):
            raise BrokerError(f"no answer from MQTT broker {t.broker} within {timeout:.0f}s")
        arrived.wait(absent_after)  # a retained message follows the subscription at once
        return got[0] if got else None
    finally:
        close(c)
