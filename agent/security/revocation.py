"""Revocation lists: which node keys the federation no longer trusts.

A revocation list is a JSON document signed by the federation key (the key that signs the
device certificates), numbered so that a newer list always has a higher ``number``::

    {"v": 1, "kind": "revocations", "fed": str, "number": int >= 1, "issued": unix s,
     "revoked": [{"node_id": str, "public_key": b64 | null, "reason": str, "time": unix s}, ...],
     "sig": b64 Ed25519 signature of the federation key}

An entry with a ``public_key`` revokes that key of the node (every certificate of it, e.g. the
old key after a renewal with a new key); one with ``"public_key": null`` revokes the node id
itself: every key, also one certified later.  The signature covers the canonical JSON of every
field but ``sig`` (:func:`dfl_agent.security.keys.canonical`), like a certificate's.

``dflctl keys revoke`` writes it (``FEDERATION_DIR/revocations.json``) and publishes it
retained on ``dfl/{fed}/revocations`` (:func:`revocation_topic`); the broker carries it like a
run descriptor, and no online certificate-status service is involved.  An agent keeps the
newest list it verified in its state directory (:data:`REVOCATIONS_FILE`, written atomically)
so that after a restart without a broker it still knows it.

:class:`Revocations` is the list an agent holds: :meth:`Revocations.offer` takes a received
list and keeps it only when it verifies and is newer; one that is older (``stale``), does not
verify (``bad_signature``), names another federation (``wrong_federation``) or is not a list
(``malformed``, ``oversized``, ``too_deep``) is ignored and counted in
:attr:`Revocations.dropped` as ``revocations_{reason}``.  The very list again (a retained copy
after a reconnection) is a ``duplicate``, not counted.  :meth:`Revocations.refresh` reloads the
state file when another process of the node (its supervisor) wrote a newer one.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dfl_agent.fsutil import atomic_write
from dfl_agent.jsonbound import JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.security.keys import SecurityError, canonical, parse_public_key

log = logging.getLogger("dfl_agent.security")

REVOCATION_VERSION = 1
#: the node's copy of the newest verified list, in its state directory
REVOCATIONS_FILE = "revocations.json"
#: largest revocation list accepted (bytes of JSON), checked before parsing
MAX_REVOCATION_BYTES = 256 * 1024
#: longest ``reason`` kept in an entry (characters)
MAX_REASON_CHARS = 200
#: why a received list is ignored (counter keys ``revocations_{reason}``)
IGNORE_REASONS = ("malformed", "oversized", "too_deep", "wrong_federation", "bad_signature", "stale")
#: seconds between two looks at the state file by :meth:`Revocations.refresh`
REFRESH_EVERY = 0.5


def revocation_topic(federation: str) -> str:
    """``dfl/{federation}/revocations``: the retained revocation list of a federation."""
    return f"dfl/{federation}/revocations"


class RevocationRejected(ValueError):
    """A revocation list that may not be used; ``reason`` is one of :data:`IGNORE_REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Revoked:
    """One entry: ``node_id`` (with ``public_key`` None: every key of it), why and when (unix s)."""

    node_id: str
    public_key: str | None
    reason: str
    time: float

    def to_dict(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "public_key": self.public_key, "reason": self.reason, "time": self.time}


@dataclasses.dataclass(frozen=True)
class RevocationList:
    """A verified revocation list (:func:`verify_revocations`) or one to sign (:func:`sign_revocations`).

    Attributes:
        federation: the federation it is for.
        number: its number (a newer list has a higher one), >= 1.
        issued: when it was signed (unix s).
        entries: the revoked keys and node ids.
        doc: the signed document as received or signed (JSON-ready, ``sig`` included).
    """

    federation: str
    number: int
    issued: float
    entries: tuple[Revoked, ...]
    doc: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        nodes = {e.node_id: e for e in self.entries if e.public_key is None}
        keys = {(e.node_id, e.public_key): e for e in self.entries if e.public_key is not None}
        object.__setattr__(self, "_nodes", nodes)
        object.__setattr__(self, "_keys", keys)

    def revoked(self, node_id: str, public_key: str | None = None) -> Revoked | None:
        """The entry that revokes ``node_id`` (every key of it) or its key ``public_key``
        (base64), or None."""
        hit: Revoked | None = self._nodes.get(node_id)  # type: ignore[attr-defined]
        if hit is None and public_key is not None:
            hit = self._keys.get((node_id, public_key))  # type: ignore[attr-defined]
        return hit

    def nodes(self) -> set[str]:
        """The node ids with at least one revoked entry."""
        return {e.node_id for e in self.entries}

    def payload(self) -> bytes:
        """The signed document as the bytes published on the broker and saved."""
        return json.dumps(self.doc, sort_keys=True, separators=(",", ":")).encode()


def sign_revocations(federation_key: Ed25519PrivateKey, federation: str, number: int,
                     entries: list[Revoked] | tuple[Revoked, ...], now: float | None = None) -> RevocationList:
    """A revocation list numbered ``number``, signed by ``federation_key``.

    Raises:
        ValueError: ``number`` < 1, or an entry whose ``public_key`` is not a public key.
    """
    if not isinstance(number, int) or number < 1:
        raise ValueError(f"a revocation list's number must be an integer >= 1, got {number!r}")
    for e in entries:
        if e.public_key is not None:
            parse_public_key(e.public_key)
    doc: dict[str, Any] = {"v": REVOCATION_VERSION, "kind": "revocations", "fed": federation, "number": number,
                           "issued": time.time() if now is None else now,
                           "revoked": [e.to_dict() for e in entries]}
    doc["sig"] = base64.b64encode(federation_key.sign(canonical(doc))).decode()
    return RevocationList(federation, number, doc["issued"], tuple(entries), doc)


def _entry(raw: object) -> Revoked:
    if not isinstance(raw, dict) or set(raw) != {"node_id", "public_key", "reason", "time"}:
        raise RevocationRejected("malformed", "an entry is not {node_id, public_key, reason, time}")
    nid, key, reason, t = raw["node_id"], raw["public_key"], raw["reason"], raw["time"]
    if (not isinstance(nid, str) or not nid or not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS
            or not isinstance(t, (int, float)) or isinstance(t, bool) or not (key is None or isinstance(key, str))):
        raise RevocationRejected("malformed", "an entry has fields of the wrong type")
    return Revoked(nid, key, reason, float(t))


def verify_revocations(data: bytes | dict[str, Any], federation_public: Ed25519PublicKey,
                       federation: str) -> RevocationList:
    """Check a revocation list (bytes as received, or parsed) and return it.

    Raises:
        RevocationRejected: ``oversized``, ``too_deep``, ``malformed`` (not a version-1 list),
            ``wrong_federation`` or ``bad_signature`` (not signed by the federation key).
    """
    if isinstance(data, dict):
        doc = data
    else:
        try:
            doc = bounded_loads(data, max_bytes=MAX_REVOCATION_BYTES)
        except JSONBoundError as exc:
            raise RevocationRejected(exc.reason, str(exc)) from None
    fields = {"v", "kind", "fed", "number", "issued", "revoked", "sig"}
    if not isinstance(doc, dict) or set(doc) != fields or doc.get("v") != REVOCATION_VERSION \
            or doc.get("kind") != "revocations":
        raise RevocationRejected("malformed", "not a version-1 revocation list")
    number, issued, revoked, sig = doc["number"], doc["issued"], doc["revoked"], doc["sig"]
    if (not isinstance(number, int) or isinstance(number, bool) or number < 1 or not isinstance(revoked, list)
            or not isinstance(issued, (int, float)) or isinstance(issued, bool) or not isinstance(sig, str)):
        raise RevocationRejected("malformed", "fields of the wrong type")
    if doc["fed"] != federation:
        raise RevocationRejected("wrong_federation", f"for {doc['fed']!r}, not {federation!r}")
    try:
        federation_public.verify(base64.b64decode(sig, validate=True),
                                 canonical({k: v for k, v in doc.items() if k != "sig"}))
    except (binascii.Error, ValueError, InvalidSignature):
        raise RevocationRejected("bad_signature", "not signed by the federation key") from None
    entries = tuple(_entry(e) for e in revoked)
    return RevocationList(federation, number, float(issued), entries, dict(doc))


class Revocations:
    """The newest verified revocation list of a federation, as one node holds it (thread-safe).

    Args:
        federation: the federation id lists must name.
        federation_key: its public key (None: no list can be verified; every one is ignored
            as ``bad_signature``).
        path: the state file (:data:`REVOCATIONS_FILE` in the state directory): read at
            construction, written when a newer list is accepted (``persist``), and re-read by
            :meth:`refresh`.  None: memory only.
        persist: whether :meth:`offer` writes an accepted list to ``path`` (the node's
            supervisor does; its run process only reads).
        clock: monotonic time source of :meth:`refresh`'s throttle.
    """

    def __init__(self, federation: str, federation_key: Ed25519PublicKey | None, path: str | os.PathLike[str] | None = None,
                 *, persist: bool = True, clock: Callable[[], float] = time.monotonic):
        self.federation = federation
        self.federation_key = federation_key
        self.path = Path(path) if path is not None else None
        self.persist = persist
        self._clock = clock
        self._lock = threading.Lock()
        self._loading = threading.Lock()
        #: the newest verified list (None: none known)
        self.current: RevocationList | None = None
        #: ignored lists by reason: ``revocations_{reason}`` (see :data:`IGNORE_REASONS`)
        self.dropped: collections.Counter[str] = collections.Counter()
        #: called with the list after a newer one was accepted (on the caller's thread)
        self.on_change: list[Callable[[RevocationList], None]] = []
        self._stamp: tuple[int, int] | None = None
        self._next_look = 0.0
        if self.path is not None:
            self._load_file(initial=True)

    @property
    def number(self) -> int:
        """The number of the list held (0: none)."""
        cur = self.current
        return cur.number if cur is not None else 0

    def revoked(self, node_id: str, public_key: str | None = None) -> Revoked | None:
        """The entry revoking ``node_id`` or its key ``public_key``, or None."""
        cur = self.current
        return cur.revoked(node_id, public_key) if cur is not None else None

    def offer(self, payload: bytes | dict[str, Any], *, count: bool = True) -> str | None:
        """A received list: kept when it verifies and is newer than the one held.

        Returns:
            None when it was accepted (now :attr:`current`); else why not: ``"duplicate"``
            (the very list held, not counted), or a reason of :data:`IGNORE_REASONS`
            (counted as ``revocations_{reason}`` unless ``count`` is False).
        """
        try:
            if self.federation_key is None:
                raise RevocationRejected("bad_signature", "no federation key configured to verify it with")
            new = verify_revocations(payload, self.federation_key, self.federation)
        except RevocationRejected as exc:
            if count:
                with self._lock:
                    self.dropped[f"revocations_{exc.reason}"] += 1
                log.warning("ignored a revocation list: %s", exc)
            return exc.reason
        with self._lock:
            cur = self.current
            if cur is not None and new.number <= cur.number:
                if new.number == cur.number and new.doc.get("sig") == cur.doc.get("sig"):
                    return "duplicate"
                if count:
                    self.dropped["revocations_stale"] += 1
                    log.warning("ignored revocation list %d: this node holds number %d", new.number, cur.number)
                return "stale"
            self.current = new
        if self.persist and self.path is not None:
            self._save(new)
        self._changed(new)
        return None

    def _changed(self, new: RevocationList, level: int = logging.WARNING) -> None:
        log.log(level, "revocation list %d of federation %s: %s", new.number, self.federation,
                    "; ".join(f"{e.node_id}{'' if e.public_key is None else ' key ' + e.public_key[:8]} "
                              f"revoked ({e.reason})" for e in new.entries) or "nothing revoked")
        for fn in list(self.on_change):
            try:
                fn(new)
            except Exception:  # noqa: BLE001 - a listener's bug never stops verification
                log.exception("revocation listener failed")

    def _save(self, new: RevocationList) -> None:
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, new.payload(), 0o644)
            self._stamp = self._file_stamp()
        except OSError as exc:
            log.warning("could not save the revocation list to %s: %s", self.path, exc)

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat() if self.path is not None else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size) if st is not None else None

    def _load_file(self, initial: bool = False) -> None:
        """Read the state file (a list this node verified before); it is verified again.
        A damaged or forged file is named in the log and ignored (the broker's copy follows)."""
        assert self.path is not None
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            log.warning("cannot read the revocation list %s: %s", self.path, exc)
            return
        if self.federation_key is None:
            return
        try:
            new = verify_revocations(data, self.federation_key, self.federation)
        except RevocationRejected as exc:
            log.warning("ignored the revocation list saved in %s: %s", self.path, exc)
            return
        with self._lock:
            cur = self.current
            if cur is not None and new.number <= cur.number:
                return
            self.current = new
        if not initial:  # what another process of this node accepted (and logged) from the broker
            self._changed(new, logging.INFO)
        else:
            log.info("revocation list %d from %s: %d entr%s", new.number, self.path, len(new.entries),
                     "y" if len(new.entries) == 1 else "ies")

    def refresh(self) -> None:
        """Take a newer list from the state file, if another process wrote one (looks at most
        every :data:`REFRESH_EVERY` s: cheap enough to call before every verification)."""
        if self.path is None:
            return
        now = self._clock()
        if now < self._next_look:
            return
        self._next_look = now + REFRESH_EVERY
        if self._loading.acquire(blocking=False):  # another thread looks already
            try:
                self._load_file()
            finally:
                self._loading.release()


def load_revocation_file(path: str | os.PathLike[str], federation_public: Ed25519PublicKey,
                         federation: str) -> RevocationList | None:
    """A federation folder's ``revocations.json``, verified; None when there is none.

    Raises:
        SecurityError: unreadable, or it does not verify (the message names the file).
    """
    p = Path(path)
    if not p.exists():
        return None
    try:
        return verify_revocations(p.read_bytes(), federation_public, federation)
    except OSError as exc:
        raise SecurityError(f"cannot read {p}: {exc.strerror}") from None
    except RevocationRejected as exc:
        raise SecurityError(f"{p}: {exc}") from None
