"""Ed25519 node keys and federation-signed device certificates (``cryptography``).

The per-message signatures (:func:`signer`, :func:`verifier`) run on libsodium through PyNaCl
where it is installed: Ed25519 signatures are deterministic (RFC 8032), so they are byte for
byte the ones ``cryptography`` (OpenSSL) makes, and libsodium verifies about twice as fast and
signs about 1.4 times as fast (``bench/scale/transport.md``, the stage table).  Without PyNaCl
both use ``cryptography``.

Files in a node's state directory:

``node_key.pem``
    the node's private key, PKCS#8 PEM, unencrypted, mode 0600, created on first
    start (:func:`load_or_create_key`), written atomically (temp file + rename), so a
    crash never leaves a half-written key.
``node_cert.json``
    optional device certificate issued by ``dflctl keys enroll`` (see
    :func:`issue_certificate`).

Public keys travel as standard base64 of the 32 raw bytes (44 characters).

Certificate (JSON), version 2::

    {"v": 2, "role": "device" | "operator", "fed": str, "node_id": str,
     "public_key": b64, "issued": unix s, "expires": unix s | null,
     "sig": b64 Ed25519 signature of the federation key}

A certificate is valid from ``issued`` (less :data:`CLOCK_SKEW_S`, for clocks a little
apart) until ``expires`` (null: never; :func:`issue_certificate` gives
:data:`DEFAULT_VALID_DAYS` by default).  Outside that window :func:`verify_certificate`
raises :class:`CertificateExpired` or :class:`CertificateNotYetValid` (a device whose clock
is behind: a clock problem, not an attack), each naming the node and the date.

Version 1 has no ``role`` field and means ``role = "device"`` (still accepted).
An *operator* certificate (``dflctl keys enroll NAME --role operator``) lets its
holder submit and cancel runs; it never makes its holder a training member.

The signature covers the canonical JSON (sorted keys, no spaces) of the certificate
without ``sig``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from dfl_agent.fsutil import atomic_write
from dfl_agent.jsonbound import JSONBoundError, loads

_sodium: Any
try:  # libsodium: the same Ed25519 signatures as OpenSSL's, made and checked faster
    import nacl.bindings as _sodium
    from nacl.exceptions import BadSignatureError as _BadSignature
except ImportError:  # pragma: no cover - PyNaCl is a dependency; cryptography alone still works
    _sodium = None

KEY_FILE = "node_key.pem"
CERT_FILE = "node_cert.json"
CERT_VERSION = 2
#: certificate roles (version 1 certificates are "device")
ROLES = ("device", "operator")
#: largest certificate accepted (bytes of JSON), checked before parsing
MAX_CERT_BYTES = 2048
#: a certificate's lifetime when none is given (``dflctl keys enroll --valid-days``)
DEFAULT_VALID_DAYS = 365.0
#: how early before its ``issued`` time a certificate is already accepted (seconds): clocks apart
CLOCK_SKEW_S = 300.0
#: a certificate this close to its expiry is warned about (``dflctl doctor``, ``status``, the log)
EXPIRY_WARNING_DAYS = 30.0


class SecurityError(ValueError):
    """A key or certificate is unreadable or invalid (message says which and why)."""


class CertificateExpired(SecurityError):
    """A certificate whose ``expires`` time has passed; the message names the node and the date.

    Attributes:
        node_id, expires: the certificate's node and its expiry (unix s).
    """

    def __init__(self, node_id: str, expires: float):
        super().__init__(f"the certificate of node {node_id} expired on {utc_date(expires)}")
        self.node_id, self.expires = node_id, expires


class CertificateNotYetValid(SecurityError):
    """A certificate issued after the verifier's clock reading (beyond :data:`CLOCK_SKEW_S`):
    the verifier's clock is behind (a device without a real-time clock), not a forgery.

    Attributes:
        node_id, issued, now: the certificate's node, its ``issued`` time and the clock's reading (unix s).
    """

    def __init__(self, node_id: str, issued: float, now: float):
        super().__init__(f"the certificate of node {node_id} is valid from {utc_date(issued)}, but this "
                         f"device's clock reads {utc_date(now)}: the clock is behind (set it, or enable NTP)")
        self.node_id, self.issued, self.now = node_id, issued, now


def utc_date(t: float) -> str:
    """``t`` (unix s) as ``YYYY-MM-DD HH:MM UTC``."""
    import datetime

    try:
        return datetime.datetime.fromtimestamp(float(t), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    except (OverflowError, OSError, ValueError):
        return f"unix time {t}"


def signer(key: Ed25519PrivateKey) -> Callable[[bytes], bytes]:
    """``sign(data)``: the 64-byte Ed25519 signature of ``data`` by ``key`` (libsodium where
    PyNaCl is installed, else ``cryptography``; the same bytes either way)."""
    if _sodium is None:
        return key.sign
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    secret = _sodium.crypto_sign_seed_keypair(seed)[1]

    def sign(data: bytes) -> bytes:
        return bytes(_sodium.crypto_sign(bytes(data), secret)[:64])

    return sign


def verifier(pub: Ed25519PublicKey) -> Callable[[bytes, bytes], None]:
    """``verify(signature, data)``: returns when ``signature`` is ``pub``'s Ed25519 signature
    of ``data`` (libsodium where PyNaCl is installed, else ``cryptography``).

    Raises:
        InvalidSignature: it is not (also a signature of the wrong length).
    """
    if _sodium is None:
        return pub.verify
    public = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def verify(signature: bytes, data: bytes) -> None:
        if len(signature) != 64:
            raise InvalidSignature
        try:
            _sodium.crypto_sign_open(bytes(signature) + bytes(data), public)
        except _BadSignature:
            raise InvalidSignature from None

    return verify


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """Standard base64 of the 32 raw public-key bytes."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """Public key from base64 of its 32 raw bytes.

    Raises:
        SecurityError: not base64 or not 32 bytes.
    """
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError, AttributeError) as exc:
        raise SecurityError(f"public key is not base64: {exc}") from None
    if len(raw) != 32:
        raise SecurityError(f"public key must be 32 bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def fingerprint(public_b64: str) -> str:
    """Short SHA-256 fingerprint (16 hex) of a base64 public key, for logs and ``keys show``."""
    return hashlib.sha256(public_b64.encode()).hexdigest()[:16]


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read a PEM Ed25519 private key.

    Raises:
        SecurityError: unreadable, not PEM or not Ed25519.
    """
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise SecurityError(f"cannot read private key {path}: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SecurityError(f"{path}: not an Ed25519 key")
    return key


def save_private_key(key: Ed25519PrivateKey, path: Path) -> None:
    """Write ``key`` as PKCS#8 PEM with mode 0600 (atomic)."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    atomic_write(Path(path), pem, 0o600)


def load_or_create_key(state_dir: str | os.PathLike[str], key_file: str | None = None) -> Ed25519PrivateKey:
    """The node's key: ``key_file`` (or ``state_dir/node_key.pem``), created on first use.

    A new key is generated with ``Ed25519PrivateKey.generate()`` and written with mode
    0600.  An existing file with group/other permissions is tightened to 0600.

    Raises:
        SecurityError: the file exists but is not a valid Ed25519 PEM key.
    """
    path = Path(key_file) if key_file else Path(state_dir) / KEY_FILE
    if path.exists():
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        return load_private_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    save_private_key(key, path)
    return key


def canonical(obj: dict[str, Any]) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces, no NaN) - what signatures cover."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def issue_certificate(
    federation_key: Ed25519PrivateKey, federation: str, node_id: str, public_b64: str,
    *, valid_days: float | None = DEFAULT_VALID_DAYS, now: float | None = None, role: str = "device",
) -> dict[str, Any]:
    """A version-2 certificate binding ``node_id`` to ``public_b64`` in ``federation``
    with ``role`` (``"device"`` or ``"operator"``), valid for ``valid_days`` days from
    ``now`` (None: it never expires).

    Raises:
        SecurityError: ``public_b64`` is not a valid public key, or an unknown role.
    """
    parse_public_key(public_b64)
    if role not in ROLES:
        raise SecurityError(f"role must be one of {ROLES}, got {role!r}")
    issued = time.time() if now is None else now
    cert: dict[str, Any] = {
        "v": CERT_VERSION, "role": role, "fed": federation, "node_id": node_id, "public_key": public_b64,
        "issued": issued, "expires": None if valid_days is None else issued + valid_days * 86400.0,
    }
    cert["sig"] = base64.b64encode(federation_key.sign(canonical(cert))).decode()
    return cert


def verify_certificate(cert: object, federation_public: Ed25519PublicKey, federation: str,
                       now: float | None = None) -> tuple[str, str]:
    """Check a certificate (version 1 or 2); return ``(node_id, public_key_b64)``.
    Its role is :func:`certificate_role` (call it after this check).

    Raises:
        CertificateExpired: its ``expires`` passed (checked after the signature).
        CertificateNotYetValid: it was issued after ``now`` (beyond :data:`CLOCK_SKEW_S`).
        SecurityError: malformed, for another federation, or a bad signature.
    """
    if not isinstance(cert, dict):
        raise SecurityError("certificate is not an object")
    fields = {"v", "fed", "node_id", "public_key", "issued", "expires", "sig"}
    if cert.get("v") == 2:
        fields.add("role")
        if cert.get("role") not in ROLES:
            raise SecurityError(f"certificate role must be one of {ROLES}")
    elif cert.get("v") != 1:
        raise SecurityError("certificate has an unknown version")
    if set(cert) != fields:
        raise SecurityError("certificate has unexpected fields or version")
    if not all(isinstance(cert[k], str) for k in ("fed", "node_id", "public_key", "sig")):
        raise SecurityError("certificate fields have wrong types")
    if cert["fed"] != federation:
        raise SecurityError(f"certificate is for federation {cert['fed']!r}, not {federation!r}")
    exp, issued = cert["expires"], cert["issued"]
    if (exp is not None and (not isinstance(exp, (int, float)) or isinstance(exp, bool))) \
            or not isinstance(issued, (int, float)) or isinstance(issued, bool):
        raise SecurityError("certificate times have wrong types")
    body = {k: v for k, v in cert.items() if k != "sig"}
    try:
        sig = base64.b64decode(cert["sig"], validate=True)
        federation_public.verify(sig, canonical(body))
    except (binascii.Error, ValueError, InvalidSignature):
        raise SecurityError("certificate signature does not verify with the federation key") from None
    parse_public_key(cert["public_key"])
    t = time.time() if now is None else now
    if exp is not None and t > exp:
        raise CertificateExpired(cert["node_id"], float(exp))
    if t < issued - CLOCK_SKEW_S:
        raise CertificateNotYetValid(cert["node_id"], float(issued), t)
    return cert["node_id"], cert["public_key"]


def certificate_role(cert: dict[str, Any]) -> str:
    """The role a (verified) certificate grants: its ``role``, ``"device"`` for version 1."""
    return str(cert.get("role", "device")) if cert.get("v") == 2 else "device"


def load_certificate(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a certificate JSON file (not verified here).

    Raises:
        SecurityError: unreadable, too large or not JSON.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise SecurityError(f"cannot read certificate {p}: {exc.strerror}") from None
    if len(data) > MAX_CERT_BYTES:
        raise SecurityError(f"certificate {p} is larger than {MAX_CERT_BYTES} bytes")
    try:
        cert = loads(data, max_bytes=MAX_CERT_BYTES)
    except JSONBoundError as exc:
        raise SecurityError(f"certificate {p} is not usable JSON: {exc}") from None
    if not isinstance(cert, dict):
        raise SecurityError(f"certificate {p} is not an object")
    return cert


def save_certificate(cert: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a certificate (atomic, mode 0644: it is public)."""
    atomic_write(Path(path), (json.dumps(cert, indent=1, sort_keys=True) + "\n").encode(), 0o644)


FEDERATION_KEY_FILE = "federation_key.pem"


def enroll_local(federation_key: Ed25519PrivateKey, federation: str, node_id: str,
                 state_dir: str | os.PathLike[str], valid_days: float | None = DEFAULT_VALID_DAYS,
                 role: str = "device") -> dict[str, Any]:
    """Enroll a node whose state directory is on this machine (demo, tests, ``dflctl``).

    Creates the node's key in ``state_dir`` if it has none (as the daemon would on first
    start), issues its certificate and writes it to ``state_dir/node_cert.json``, where
    the daemon finds it.  Returns the certificate.
    """
    key = load_or_create_key(state_dir)
    cert = issue_certificate(federation_key, federation, node_id, public_key_b64(key), valid_days=valid_days,
                             role=role)
    save_certificate(cert, Path(state_dir) / CERT_FILE)
    return cert
