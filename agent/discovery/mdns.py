"""Peer discovery over mDNS / DNS-SD (python-zeroconf), feeding a :class:`PeerTable`.

Every daemon advertises one service instance and browses for the others.

What is advertised
    Instance name ``{federation}--{node_id}.{service_type}`` (default service type
    ``_dfl._tcp.local.``), an A (or AAAA) record with one address (the first of
    ``interfaces`` unless ``host_address`` is given), an SRV record with ``port``
    (informational, default 0: peers talk over MQTT, see ``broker``), and a TXT record:

    ======== ==========================================================
    key      value
    ======== ==========================================================
    id       node id (``dfl_agent.transport.wire.valid_id``)
    fed      federation id
    broker   ``host:port`` of the MQTT broker where this node's topics live ("" = default)
    profile  device profile name
    model    model spec hash
    alg      algorithm name
    ver      agent version (``"0.2.0/w5"``: the release and its newest wire version)
    wire     the oldest wire version it speaks (``"5"``; what agents of 0.1.0 compare with their own)
    wires    every wire version it speaks, comma-separated (``"5"``, ``"5,6"``)
    roles    roles this node may take (device profile), comma-separated
    comp     compression spec of its updates (device profile)
    ======== ==========================================================

    Each ``key=value`` string must fit a DNS character-string (255 bytes), and the
    instance name one DNS label (63 bytes); otherwise :class:`ValueError`.

What is accepted
    Instances of other federations (by instance name, before any resolution), this
    node's own instance, and records whose TXT is malformed (missing or invalid id,
    wrong federation, id not matching the instance name, no wire version in common (its
    ``wires``, else its ``wire``: an agent of 0.1.0), bad broker endpoint) are ignored; failures are logged and counted in ``errors``
    (a :class:`collections.Counter`), never raised out of zeroconf's callbacks.
    The identity is the TXT record's ``id``, not the instance name: an instance renamed
    after a name conflict (``{federation}--{node_id}-2``, zeroconf's renaming) is the
    node ``id`` names.  A broker that the TXT record names is a hint too: the peer table
    uses it only if it is trusted (:meth:`~dfl_agent.discovery.peers.PeerTable.broker_trusted`).
    A resolved peer is ``table.upsert(id, "mdns", ...)``; a goodbye (or an expired
    record) is ``table.withdraw(id, "mdns")``.  A peer that crashes sends no goodbye:
    its records live until their TTL runs out (zeroconf's defaults: 120 s for
    SRV/A, 75 min for PTR/TXT), so liveness on failure comes from MQTT presence.

Interfaces and loopback
    zeroconf listens on *every* interface unless told otherwise, so the caller must
    name the interface addresses (``interfaces=["192.168.1.20"]``); an empty list,
    ``0.0.0.0`` or ``::`` is rejected.  Tests use ``interfaces=["127.0.0.1"]``:
    multicast works over loopback on Linux although ``lo`` lacks the MULTICAST flag,
    and several zeroconf instances (in one process or several) on 127.0.0.1 see
    each other, because zeroconf binds port 5353 with SO_REUSEADDR/SO_REUSEPORT and
    enables IP_MULTICAST_LOOP.  Two consequences of sharing port 5353 on one host:
    a unicast (QU) answer reaches only *one* of the sockets, so this module asks QM
    questions (answers come by multicast); and zeroconf drops a packet identical to
    one it received within 0.8 s, so identical browse queries from several local
    instances may go unanswered once (announcements, which carry every record, are
    unaffected).

Name conflicts
    An instance name is only a name: anyone on the link can answer for it, so a conflict
    never stops a node.  python-zeroconf's probe only notices an owner whose records it
    already cached, so :meth:`MdnsDiscovery.start` first asks for its own instance name
    (``name_check_timeout``, 1 s); when another responder answers, or zeroconf's probe
    meets one, the node advertises itself as ``{federation}--{node_id}-2`` (``-3``, ...:
    zeroconf's renaming scheme of ``allow_name_change``, applied here so that the host name
    follows the instance name) and logs one WARNING naming the responder's address (the
    address its records give).  Peers find it by its TXT ``id``.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import re
from typing import Any

from zeroconf import DNSQuestionType, IPVersion, NonUniqueNameException, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from dfl_agent import WIRE_VERSIONS
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.transport import versions
from dfl_agent.transport.endpoint import valid_endpoint
from dfl_agent.transport.versions import versions_of
from dfl_agent.transport.wire import valid_id

log = logging.getLogger(__name__)

DEFAULT_SERVICE_TYPE = "_dfl._tcp.local."
DESCRIPTOR_KEYS = ("broker", "profile", "model_hash", "algorithm", "version", "roles", "compression")
# descriptor key -> TXT key
_TXT_KEYS = {
    "broker": "broker",
    "profile": "profile",
    "model_hash": "model",
    "algorithm": "alg",
    "version": "ver",
    "roles": "roles",  # device profile behaviour (dfl_agent.profiles): comma-separated roles
    "compression": "comp",  # and the compression spec
}
_SEPARATOR = "--"
RESOLVE_TIMEOUT_S = 3.0
NAME_CHECK_TIMEOUT_S = 1.0
STOP_STEP_TIMEOUT_S = 3.0
#: instance names :meth:`MdnsDiscovery.start` tries after a conflict before leaving the rest
#: to zeroconf's probe (a responder that answers for every name cannot keep a node from starting)
RENAME_TRIES = 4
_RENAMED = re.compile(r"(.+)-([0-9]+)")


class MdnsDiscovery:
    """Advertise this node over mDNS and feed peers of its federation into ``table``.

    Args:
        table: the peer table to feed (source ``"mdns"``).
        node_id: this node's id (``valid_id``).
        federation: federation id (``valid_id``); other federations are ignored.
        descriptor: advertised fields, keys among ``broker`` (``"host:port"`` or ""),
            ``profile``, ``model_hash``, ``algorithm``, ``version``; missing ones are "".
        interfaces: IP addresses of the interfaces to use (required, non-empty; e.g.
            ``["127.0.0.1"]`` in tests).  Never all interfaces by default.
        port: SRV port advertised (informational).
        service_type: DNS-SD service type.
        ip_version: zeroconf IP version (default IPv4 only).
        host_address: address to advertise (default: the first of ``interfaces``).
        resolve_timeout: seconds to wait for a peer's records when resolving.
        name_check_timeout: seconds :meth:`start` spends asking whether another
            responder already owns this instance name (0 = rely on zeroconf's probe
            alone, which only notices owners whose records are already cached).

    Raises:
        ValueError: invalid ids, descriptor, interfaces, address or over-long records.
    """

    def __init__(
        self,
        table: PeerTable,
        *,
        node_id: str,
        federation: str,
        descriptor: dict[str, str],
        interfaces: list[str],
        port: int = 0,
        service_type: str = DEFAULT_SERVICE_TYPE,
        ip_version: IPVersion = IPVersion.V4Only,
        host_address: str | None = None,
        resolve_timeout: float = RESOLVE_TIMEOUT_S,
        name_check_timeout: float = NAME_CHECK_TIMEOUT_S,
    ):
        if not valid_id(node_id):
            raise ValueError(f"invalid node id {node_id!r}")
        if not valid_id(federation):
            raise ValueError(f"invalid federation id {federation!r}")
        if not interfaces:
            raise ValueError("interfaces must name at least one interface address (e.g. ['127.0.0.1'])")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port!r}")
        if not service_type.endswith("._tcp.local.") and not service_type.endswith("._udp.local."):
            raise ValueError(f"service type {service_type!r} must end with '._tcp.local.' or '._udp.local.'")
        if resolve_timeout <= 0:
            raise ValueError("resolve_timeout must be positive")
        if name_check_timeout < 0:
            raise ValueError("name_check_timeout must be >= 0")
        self._interfaces = _check_interfaces(interfaces, ip_version)
        address = host_address if host_address is not None else self._interfaces[0]
        try:
            addr = ipaddress.ip_address(address)
        except ValueError:
            raise ValueError(f"host address {address!r} is not an IP address") from None
        if addr.is_unspecified:
            raise ValueError(f"host address {address!r} cannot be advertised")
        self.table = table
        self.node_id = node_id
        self.federation = federation
        self.port = port
        self.service_type = service_type
        self.ip_version = ip_version
        self.host_address = str(addr)
        self.resolve_timeout = resolve_timeout
        self.name_check_timeout = name_check_timeout
        #: the instance name this node asks for, and the one it advertises (after a conflict,
        #: ``{base}-2``, ...: :meth:`start`)
        self.base_instance = self.instance = f"{federation}{_SEPARATOR}{node_id}"
        if len(self.instance.encode()) > 63:
            raise ValueError(
                f"instance name {self.instance!r} exceeds 63 bytes; shorten the federation or node id"
            )
        self.name = f"{self.instance}.{service_type}"
        #: lower-cased service names another responder answered for at start (their records
        #: with this node's id are counted as ``duplicate_id``; the conflict was logged once)
        self.conflicts: set[str] = set()
        self._prefix = f"{federation}{_SEPARATOR}".lower()
        self._properties = self._txt(descriptor)
        self.errors: collections.Counter[str] = collections.Counter()
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}  # lower-cased service name -> resolution
        self._names: dict[str, str] = {}  # lower-cased service name -> node id (resolved)
        self._started = False
        self._stopped = False

    # ------------------------------------------------------------------ advertising

    def _txt(self, descriptor: dict[str, str]) -> dict[str, str]:
        unknown = set(descriptor) - set(DESCRIPTOR_KEYS)
        if unknown:
            raise ValueError(f"unknown descriptor keys {sorted(unknown)} (allowed: {list(DESCRIPTOR_KEYS)})")
        props = {"id": self.node_id, "fed": self.federation}
        for key, txt_key in _TXT_KEYS.items():
            value = "" if descriptor.get(key) is None else descriptor[key]
            if not isinstance(value, str):
                raise ValueError(f"descriptor {key!r} must be a string, got {type(value).__name__}")
            props[txt_key] = value
        props["wire"] = str(WIRE_VERSIONS[0])  # an agent of 0.1.0 takes only its own version (5) here
        props["wires"] = ",".join(str(v) for v in WIRE_VERSIONS)
        if props["broker"] and not valid_endpoint(props["broker"]):
            raise ValueError(f"descriptor broker {props['broker']!r} is not 'host:port'")
        for key, value in props.items():
            size = len(key.encode()) + 1 + len(value.encode())
            if size > 255:
                raise ValueError(f"TXT entry {key!r} is {size} bytes; at most 255 fit a DNS string")
        return props

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            self.service_type,
            self.name,
            port=self.port,
            properties=dict(self._properties),
            server=f"{self.instance}.local.",
            parsed_addresses=[self.host_address],
        )

    async def start(self) -> None:
        """Browse for peers, pick an instance name nobody answers for, then register.

        python-zeroconf's probe detects a conflict only from records already in its
        cache, so :meth:`start` first asks for its own instance name for up to
        ``name_check_timeout`` seconds; when another responder answers (a second device
        with this node id, or anyone's made-up record), it tries ``{instance}-2``,
        ``-3``, ... (a second each), then registers (probe and announce, about 1.7 s
        with zeroconf 0.154); a conflict the probe meets moves on to the next name too.
        After :data:`RENAME_TRIES` names taken, zeroconf's probe picks one
        (``allow_name_change``).  A conflict is one WARNING naming the other responder's
        address, never an error: peers know this node by its TXT ``id``.

        Raises:
            RuntimeError: started twice, or after :meth:`stop`.
            OSError: the mDNS sockets could not be opened.
        """
        if self._started or self._stopped:
            raise RuntimeError("MdnsDiscovery can be started once")
        self._started = True
        try:
            self._aiozc = AsyncZeroconf(interfaces=list(self._interfaces), ip_version=self.ip_version)
        except BaseException:
            self._stopped = True
            raise
        self._browser = AsyncServiceBrowser(
            self._aiozc.zeroconf,
            self.service_type,
            handlers=[self._on_service_state_change],
            question_type=DNSQuestionType.QM,
        )
        try:
            owners: list[str] = []  # the addresses of the responders that answered for our names
            for n in range(2, 2 + RENAME_TRIES):
                owner = await self._owner_of(self.name) if self.name_check_timeout > 0 else None
                if owner is None:
                    info = self._service_info()  # the host name follows the instance name
                    try:
                        announced = await self._aiozc.async_register_service(info, allow_name_change=False)
                        break
                    except NonUniqueNameException:  # zeroconf's probe met an owner our question missed
                        owner = self._cached_owner(self.name)
                owners.append(owner)
                self.conflicts.add(self.name.lower())
                self._rename(n)
            else:  # a responder answers for every name tried: zeroconf's probe picks one (-N)
                info = self._service_info()
                announced = await self._aiozc.async_register_service(info, allow_name_change=True)
                if info.name != self.name:
                    self.conflicts.add(self.name.lower())
                    self.instance, self.name = info.name[: -len("." + self.service_type)], info.name
            self._info = info
            await announced
        except BaseException:
            await self.stop()
            raise
        if owners:
            self.errors["name_conflict"] += 1
            log.warning("mdns: another responder, at %s, answers for %s (a second device with node id %r, or a "
                        "made-up record); this node advertises itself as %s: peers know it by its id, not its name",
                        ", ".join(dict.fromkeys(owners)), self.base_instance, self.node_id, self.instance)
        if info.decoded_properties != self._properties:  # update() during the probe
            await self.update(self._properties)
        log.info("mdns: advertising %s at %s:%d on %s", self.name, self.host_address, self.port, self._interfaces)

    def _rename(self, n: int) -> None:
        """Advertise as ``{base_instance}-{n}`` (zeroconf's renaming; the base is cut short
        to keep the instance within one 63-byte DNS label)."""
        suffix = f"-{n}"
        self.instance = self.base_instance[: 63 - len(suffix)] + suffix
        self.name = f"{self.instance}.{self.service_type}"

    async def _owner_of(self, name: str) -> str | None:
        """The address of another responder that answers for service ``name`` within
        ``name_check_timeout`` (``"an unknown address"`` when its records give none), or
        None when nobody answers."""
        assert self._aiozc is not None
        probe = AsyncServiceInfo(self.service_type, name)
        # QM: a unicast (QU) answer may land on another zeroconf instance's socket
        # when several share port 5353 on one host (SO_REUSEPORT).
        answered = await probe.async_request(
            self._aiozc.zeroconf, self.name_check_timeout * 1000.0, question_type=DNSQuestionType.QM
        )
        if not answered and probe.server is None:
            return None
        return _address_of(probe)

    def _cached_owner(self, name: str) -> str:
        """The address that zeroconf's cache holds for service ``name`` (another responder's)."""
        assert self._aiozc is not None
        probe = AsyncServiceInfo(self.service_type, name)
        probe.load_from_cache(self._aiozc.zeroconf)
        return _address_of(probe)

    async def update(self, descriptor: dict[str, str]) -> None:
        """Replace the advertised descriptor (TXT record) and announce it.

        Raises:
            ValueError: invalid descriptor (nothing is changed).
        """
        props = self._txt(descriptor)
        self._properties = props
        if self._aiozc is None or self._info is None or self._stopped:
            return
        self._info = self._service_info()
        announced = await self._aiozc.async_update_service(self._info)
        await announced

    async def stop(self) -> None:
        """Say goodbye, stop browsing and close the sockets; withdraw mDNS-vouched peers.

        Idempotent; each step is bounded by a timeout, so it never hangs.
        """
        if self._stopped:
            return
        self._stopped = True
        if self._aiozc is None:
            return
        if self._browser is not None:
            await self._bounded("browser_cancel", self._browser.async_cancel())
            self._browser = None
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_STEP_TIMEOUT_S)
        if self._info is not None:
            await self._bounded("unregister", self._unregister(self._info))
            self._info = None
        await self._bounded("close", self._aiozc.async_close())
        for node_id in sorted(set(self._names.values())):
            self.table.withdraw(node_id, "mdns")
        self._names.clear()

    async def _unregister(self, info: AsyncServiceInfo) -> None:
        assert self._aiozc is not None
        goodbye = await self._aiozc.async_unregister_service(info)
        await goodbye

    async def _bounded(self, step: str, awaitable: Any) -> None:
        try:
            await asyncio.wait_for(awaitable, STOP_STEP_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.errors[f"{step}_timeout"] += 1
            log.warning("mdns: %s timed out after %.0f s", step, STOP_STEP_TIMEOUT_S)
        except Exception as exc:  # shutting down: report, go on
            self.errors[f"{step}_error"] += 1
            log.warning("mdns: %s failed: %r", step, exc)

    async def __aenter__(self) -> MdnsDiscovery:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ browsing

    def _on_service_state_change(
        self,
        zeroconf: Any,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        """zeroconf callback (event loop thread); must never raise."""
        try:
            self._handle(name, state_change)
        except Exception as exc:  # never propagate into zeroconf
            self.errors["handler_error"] += 1
            log.warning("mdns: handling %s %s failed: %r", state_change, name, exc)

    def _handle(self, name: str, state_change: ServiceStateChange) -> None:
        if self._stopped:
            return
        key = name.lower()
        if key == self.name.lower():
            return
        instance = self._instance_of(name)
        if instance is None:  # other federation or another service's naming
            log.debug("mdns: ignoring %s", name)
            return
        pending = self._tasks.pop(key, None)  # a newer event supersedes a pending resolution
        if pending is not None:
            pending.cancel()
        if state_change is ServiceStateChange.Removed:
            node_id = self._names.pop(key, None)
            if node_id is None:  # never resolved: the id its name gives, if any
                node_id = instance if valid_id(instance) else None
            if node_id is None or node_id in self._names.values():  # another record of it stays
                return
            log.info("mdns: %s said goodbye", node_id)
            self.table.withdraw(node_id, "mdns")
            return
        # Added or Updated: (re)resolve
        self._tasks[key] = asyncio.get_running_loop().create_task(self._resolve(name, key))

    def _instance_of(self, name: str) -> str | None:
        """What follows ``{federation}--`` in the instance name of ``name`` (the node id,
        or the id renamed after a conflict: ``{node_id}-2``); None when not of this
        federation (or empty)."""
        suffix = "." + self.service_type
        if not name.lower().endswith(suffix.lower()):
            return None
        instance = name[: -len(suffix)]
        if not instance.lower().startswith(self._prefix):
            return None
        return instance[len(self._prefix) :] or None

    def _names_node(self, name: str, node_id: str) -> bool:
        """Whether service ``name`` is ``node_id``'s instance: ``{federation}--{node_id}``, or
        that renamed after a conflict (``-2``, ``-3``, ..., the id cut short where the
        63-byte label needed it)."""
        rest = (self._instance_of(name) or "").lower()
        node_id = node_id.lower()
        if rest == node_id:
            return True
        m = _RENAMED.fullmatch(rest)
        if m is None:
            return False
        full = len(self._prefix) + len(rest) == 63
        return m.group(1) == node_id or (full and node_id.startswith(m.group(1)))

    async def _resolve(self, name: str, key: str) -> None:
        try:
            assert self._aiozc is not None
            info = AsyncServiceInfo(self.service_type, name)
            ok = await info.async_request(
                self._aiozc.zeroconf, self.resolve_timeout * 1000.0, question_type=DNSQuestionType.QM
            )
            if not ok:
                self.errors["resolve_timeout"] += 1
                log.warning("mdns: no answer resolving %s within %.1f s", name, self.resolve_timeout)
                return
            self._apply(name, key, info)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.errors["resolve_error"] += 1
            log.warning("mdns: resolving %s failed: %r", name, exc)
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]

    def _apply(self, name: str, key: str, info: AsyncServiceInfo) -> None:
        fields = self._parse_txt(name, info)
        if fields is None:
            return
        node_id = fields.pop("node_id")
        self._names[key] = node_id
        self.table.upsert(node_id, "mdns", **fields)

    def _parse_txt(self, name: str, info: AsyncServiceInfo) -> dict[str, str] | None:
        """Validate a resolved record; count and log problems, return None then."""

        def reject(reason: str, detail: str) -> None:
            self.errors[reason] += 1
            log.warning("mdns: ignoring %s: %s", name, detail)

        try:
            props = info.decoded_properties
        except Exception as exc:
            reject("malformed_txt", f"undecodable TXT ({exc!r})")
            return None
        txt = {k: (v or "") for k, v in props.items()}
        node_id = txt.get("id", "")
        if not valid_id(node_id):
            reject("malformed_txt", f"invalid id {node_id!r}")
            return None
        if txt.get("fed", "") != self.federation:
            reject("malformed_txt", f"TXT federation {txt.get('fed')!r} does not match its name")
            return None
        if not self._names_node(name, node_id):
            reject("malformed_txt", f"TXT id {node_id!r} does not match the instance name")
            return None
        if node_id == self.node_id:
            if self._info is None or name.lower() in self.conflicts:  # start() logs a name conflict once
                self.errors["duplicate_id"] += 1
                return None
            reject("duplicate_id", f"another node advertises this node's id {node_id!r}")
            return None
        wires = versions_of(txt.get("wires")) or versions_of(txt.get("wire"))
        if not set(wires) & set(versions.SPOKEN):
            reject("wire_version", f"wire versions {txt.get('wires') or txt.get('wire')!r}, this node speaks "
                                   f"{','.join(map(str, versions.SPOKEN))}")
            return None
        broker = txt.get("broker", "")
        if broker and not valid_endpoint(broker):
            reject("malformed_txt", f"invalid broker endpoint {broker!r}")
            return None
        addresses = info.parsed_addresses()
        address = ""
        if addresses:
            host = addresses[0]
            host = f"[{host}]" if ":" in host else host
            address = f"{host}:{info.port or 0}"
        return {
            "node_id": node_id,
            "federation": self.federation,
            "broker": broker,
            "profile": txt.get("profile", ""),
            "algorithm": txt.get("alg", ""),
            "model_hash": txt.get("model", ""),
            "version": txt.get("ver", ""),
            "roles": txt.get("roles", ""),
            "compression": txt.get("comp", ""),
            "address": address,
            "wires": ",".join(map(str, wires)),
        }


def _address_of(info: AsyncServiceInfo) -> str:
    """``host:port`` (or the host alone) that a resolved service's records give."""
    addresses = info.parsed_addresses()
    if not addresses:
        return "an unknown address"
    host = addresses[0]
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{info.port}" if info.port else host


def _check_interfaces(interfaces: list[str], ip_version: IPVersion) -> list[str]:
    """Validate interface addresses: concrete IPs matching ``ip_version``."""
    if isinstance(interfaces, str):
        raise ValueError("interfaces must be a list of addresses, not a string")
    checked: list[str] = []
    for iface in interfaces:
        try:
            addr = ipaddress.ip_address(iface)
        except ValueError:
            raise ValueError(f"interface {iface!r} is not an IP address") from None
        if addr.is_unspecified:
            raise ValueError(f"interface {iface!r} would mean 'all/default interfaces'; name one address")
        if ip_version == IPVersion.V4Only and addr.version != 4:
            raise ValueError(f"interface {iface!r} is not IPv4 (ip_version=V4Only)")
        if ip_version == IPVersion.V6Only and addr.version != 6:
            raise ValueError(f"interface {iface!r} is not IPv6 (ip_version=V6Only)")
        checked.append(str(addr))
    return checked
