"""Wire format (v5): a versioned JSON envelope followed by the tensors' raw bytes.

Frame layout (all integers big-endian)::

    b"DFL" | version:u8 (=5, | 0x80) | header_len:u32 | header (UTF-8 JSON) | payload

When the version byte carries :data:`HEADER_ZSTD` (0x80), the header is a zstd frame
of that JSON.  The sender compresses it only where it pays: when the JSON is at least
:data:`HEADER_ZSTD_MIN_SHARE` of the frame (small and compressed updates, control
messages) and the compressed form is shorter; a receiver inflates it to at most
:data:`MAX_HEADER_BYTES` before parsing.  A plain JSON header is padded with trailing
spaces so that the payload starts at a multiple of 8 bytes into the frame.  The
signature covers the parsed header (see below), so it does not depend on the header's
byte form.

The header is the *envelope*::

    {"v": 5, "fed": str, "sender": str, "recipient": str ("*" = broadcast),
     "kind": str, "round": int, "msg_id": hex str, "time": float (unix s),
     "payload_blake3": hex str, "payload_len": int,
     "encoding": {"format": "raw" | "none",
                  "tensors": {name: {"dtype": "float32", "shape": [..]}},
                  "codec": {...}},   # optional: compressed tensors, see codec.py
     "meta": {...}, "sig": null}

Payload (``format = "raw"``): the tensors' bytes (C order, little-endian) in the
order of their sorted names, each starting at the next multiple of 8 bytes
(zero bytes in between); its length is therefore fixed by the table, and a payload
of any other length is rejected.  A receiver decodes the tensors as numpy views into
the received buffer (one copy at most: when the buffer is immutable or unaligned),
so nothing but the envelope is needed to decode, and nothing received is ever
unpickled.

``payload_blake3`` (the 256-bit BLAKE3 digest of the payload, 64 hex digits; see
:func:`payload_digest`) is the only hash of the payload on the whole path: computed once
by the sender (over the tensors' buffers, before the frame is joined) and once by the
receiver; the chunk layer (:mod:`dfl_agent.transport.chunking`) carries none, so a
chunk that was altered or mixed into a transfer is caught here as ``hash_mismatch``.
BLAKE3 replaced the SHA-256 of wire v3 because it is two to three times faster on x86
CPUs with SHA instructions and faster still on ARM cores without them (Raspberry Pi 4);
it is a cryptographic hash of the same 128-bit security level, so a signature still
binds the payload through it.

Every check failure raises :class:`WireError` with a short ``reason`` used as a
counter key (``malformed``, ``oversized``, ``version``, ``wrong_federation``,
``wrong_recipient``, ``hash_mismatch``, ``bad_tensor``, ``non_finite``,
``bad_encoding``).  A frame of a wire version this release does not speak (e.g. v4 of
older agents) is rejected as ``version``.

Versions: this release reads and writes every version in
:data:`dfl_agent.transport.versions.SPOKEN` (:data:`dfl_agent.WIRE_VERSIONS`: the previous
release's and its own), and :func:`encode` writes the one it is given.  Agents announce the versions they speak (presence descriptor ``wires``,
mDNS TXT ``wires``; an agent of 0.1.0 only ``version = "0.1.0/w5"`` and TXT ``wire=5``:
:func:`versions_of` reads all three), and a sender writes each frame in the highest version its
receivers all speak (:func:`negotiate`): the recipient's for a message to one node, the lowest
of the live members' highest for a broadcast.

Wire v5 changed one thing against v4: a codec blob's sections follow the sorted tensor
names (see :mod:`dfl_agent.transport.codec`).  In v4 they followed the sender's
dict order while a signed envelope sorted the description's keys, so a signed,
compressed message of several tensors was rejected or decoded into the wrong tensors.

Compression: a compressed message has ``encoding = {"format": "codec",
"codec": {...}}`` (no ``tensors`` table) and its payload is the codec blob of
:mod:`dfl_agent.transport.codec` as is; in the codec table an entry that only holds a
shape (``{"s": [..]}``) travels as the shape list.  :func:`decode` returns the
tensors rebuilt from that description alone.

Compact envelope: fields the receiver can infer are left out - ``payload_len``/
``payload_blake3`` when the payload is empty (absent = 0 bytes), ``encoding`` when
there are no tensors (absent = ``{"format": "none"}``), ``sig`` when the sender does
not sign (absent = ``null``).  Frames that carry them are still accepted.

The ``sig`` field holds ``"ed25519:" + base64`` of the sender's Ed25519 signature
over the canonical JSON (sorted keys, no spaces) of the header without ``sig`` -
which includes ``payload_blake3``, so the signature covers the payload through that
single digest - or ``null`` when the sender does not sign.  A signed header may carry
``cert``, the sender's device certificate (see :mod:`dfl_agent.security`).  :func:`encode`
writes a signed header as those signed canonical bytes with ``,"sig":"..."`` appended as
the last member; a receiver that finds this form parses the header from the signed bytes
and keeps them (:attr:`Header.signed_bytes`), so the signature is checked over the bytes
as received without serialising the header again (any other form is checked over its
canonical JSON, as before).
Verification is the receiver's :class:`dfl_agent.security.SecurityGuard`'s job:
:func:`decode_with_header` returns the parsed header with the message, so it is
parsed once.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import zstandard

from dfl_agent.algorithms.context import BROADCAST, Message
from dfl_agent.jsonbound import JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.learning.compression import CompressionError, zstd_inflate
from dfl_agent.transport import codec as _codec
from dfl_agent.transport import versions as _versions
from dfl_agent.transport.versions import negotiate, versions_of

__all__ = ["negotiate", "versions_of"]  # re-exported: the version negotiation (dfl_agent.transport.versions)

#: the newest wire version this release speaks (:data:`dfl_agent.WIRE_VERSION`); every version it
#: reads and writes is in :data:`dfl_agent.transport.versions.SPOKEN`
WIRE_VERSION = _versions.SPOKEN[-1]
MAGIC = b"DFL"
_PREFIX = struct.Struct(">3sBI")
PREFIX_LEN = _PREFIX.size
MAX_HEADER_BYTES = 256 * 1024
#: flag in the version byte: the header is zstd-compressed JSON
HEADER_ZSTD = 0x80
_HEADER_ZSTD_LEVEL = 3
#: compress headers where it pays (receivers accept both forms); ``False`` sends plain
#: JSON, e.g. to read envelopes with ``mosquitto_sub`` or to compare byte counts with
#: runs made before header compression
COMPRESS_HEADERS = True
#: the header is compressed only when its JSON is at least this share of the frame:
#: below, the saving is under ~1 % of the bytes and not worth the CPU time
HEADER_ZSTD_MIN_SHARE = 0.02
#: payload alignment of every tensor (and of the payload in a frame with a plain header)
ALIGN = 8
MAX_TENSORS = 4096
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

ALLOWED_DTYPES = {
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
}
#: numpy dtype -> its wire name (str(dtype) is slow), and back
_DTYPE_NAME = {np.dtype(n): n for n in ALLOWED_DTYPES}
_DTYPE_OF = {n: np.dtype(n) for n in ALLOWED_DTYPES}
_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_KIND_RE = re.compile(r"^[a-z0-9_.\-]{1,32}$")
#: JSON encoders of the envelope, built once: compact, and canonical (what a signature covers)
_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)
#: a signed envelope as :func:`encode` writes it ends with ``,"sig":"ed25519:<base64>"}``
#: (then padding spaces), everything before being the signed canonical JSON
_SIG_TAIL = b',"sig":"ed25519:'
_SIG_CHARS = re.compile(rb"[A-Za-z0-9+/=]{1,200}")
class Header(dict[str, Any]):
    """A parsed envelope (a plain ``dict`` to its readers).

    ``signed_bytes``: when the header arrived in the form :func:`encode` writes for a
    signed message - the canonical JSON of every field but ``sig``, then ``sig`` as the
    last member - those canonical bytes exactly as received (the header itself was
    parsed from them), so a signature check verifies them without serialising the
    header again; ``None`` otherwise."""

    __slots__ = ("signed_bytes",)

    def __init__(self, *args: Any, signed_bytes: bytes | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.signed_bytes = signed_bytes


class WireError(ValueError):
    """A received frame failed a check. ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Envelope:
    """Decoded and validated frame header (see module docstring)."""

    version: int
    federation: str
    sender: str
    recipient: str
    kind: str
    round: int
    msg_id: str
    time: float
    payload_blake3: str
    payload_len: int
    encoding: dict[str, Any]
    meta: dict[str, Any]
    sig: str | None


def valid_id(value: str) -> bool:
    """True when ``value`` is a valid node or federation id (``[A-Za-z0-9_.-]{1,64}``)."""
    return isinstance(value, str) and bool(_ID_RE.match(value))


def _tensor_description(tensors: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    return {name: {"dtype": _DTYPE_NAME[a.dtype], "shape": list(a.shape)} for name, a in tensors.items()}


def _u8(buffer: Any) -> Any:
    """``buffer`` as unsigned bytes for the hasher (a C-contiguous numpy array is viewed
    as ``uint8``; bytes, bytearrays and byte memoryviews pass as they are)."""
    if type(buffer) is np.ndarray:
        return buffer.reshape(-1).view(np.uint8)
    return buffer


def payload_digest(*buffers: Any) -> str:
    """The wire format's payload hash: BLAKE3-256 of the buffers' bytes, concatenated.

    Args:
        buffers: bytes-like objects or C-contiguous numpy arrays (hashed as their raw
            bytes in memory order).

    Returns:
        64 lowercase hex digits, as in the envelope's ``payload_blake3``.
    """
    h = blake3.blake3()
    for b in buffers:
        h.update(_u8(b))
    return str(h.hexdigest())


_EMPTY_DIGEST = payload_digest(b"")


def _is_codec_blob(tensors: dict[str, np.ndarray]) -> bool:
    """True for the wire tensors of :func:`dfl_agent.transport.codec.encode_tensors`."""
    blob = tensors.get(_codec.BLOB)
    return len(tensors) == 1 and blob is not None and blob.dtype == np.uint8 and blob.ndim == 1


def _compact_codec(desc: dict[str, Any]) -> dict[str, Any]:
    """Wire form of a codec description: a tensor entry that holds only its shape
    (``{"s": [..]}``, the common case of dense float32 tensors) travels as the shape
    list itself.  :func:`_expand_codec` is the inverse."""
    table = desc.get("t")
    if not isinstance(table, dict):
        return desc
    return {**desc, "t": {n: (e["s"] if isinstance(e, dict) and set(e) == {"s"} else e) for n, e in table.items()}}


def _expand_codec(desc: dict[str, Any]) -> dict[str, Any]:
    table = desc.get("t")
    if not isinstance(table, dict):
        return desc
    return {**desc, "t": {n: ({"s": e} if isinstance(e, list) else e) for n, e in table.items()}}


def encode(message: Message, *, federation: str, sender: str,
           sign: Callable[[bytes], str] | None = None, cert: dict[str, Any] | None = None,
           version: int | None = None) -> bytes:
    """Serialise ``message`` into one frame of wire ``version`` (one of
    :data:`~dfl_agent.transport.versions.SPOKEN`; None: the newest), chosen for its receivers by
    :func:`~dfl_agent.transport.versions.negotiate`.

    The tensors' bytes are hashed in place and copied once, into the frame.

    ``sign`` (e.g. :meth:`dfl_agent.security.SecurityGuard.sign`) maps the canonical header
    bytes to the ``sig`` string; ``cert`` (a device certificate) is put into the signed
    header when given.

    Sets ``message.msg_id`` (if empty), ``message.time``, ``message.sender``.

    Raises:
        ValueError: a tensor has a dtype outside :data:`ALLOWED_DTYPES` (or is not
            little-endian), the kind or an id is invalid, ``meta`` is not
            JSON-serialisable, or ``version`` is not one this release speaks.
    """
    spoken = _versions.SPOKEN
    v = spoken[-1] if version is None else version
    if v not in spoken:
        raise ValueError(f"wire version {version!r} is not one this release speaks {list(spoken)}")
    if not _KIND_RE.match(message.kind):
        raise ValueError(f"invalid message kind {message.kind!r}")
    if not valid_id(federation) or not valid_id(sender):
        raise ValueError("invalid federation or sender id")
    if message.recipient != BROADCAST and not valid_id(message.recipient):
        raise ValueError(f"invalid recipient {message.recipient!r}")
    tensors: dict[str, np.ndarray] = {}
    for name, arr in message.tensors.items():
        a = arr if type(arr) is np.ndarray else np.asarray(arr)
        if a.dtype not in _DTYPE_NAME:  # also refuses big-endian dtypes
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} not allowed on the wire")
        tensors[name] = a if a.ndim and a.flags.c_contiguous else np.ascontiguousarray(a)
    # -- compression: a compressed message's blob is the payload as is --
    raw_codec = message.encoding is not None and _is_codec_blob(tensors)
    names = [_codec.BLOB] if raw_codec else sorted(tensors)
    # the payload's pieces: zero padding and each tensor's C-contiguous buffer (no copies;
    # hashed here and copied once, into the frame)
    pieces: list[Any] = []
    plen = 0
    digest = blake3.blake3()
    for name in names:
        a = tensors[name]
        if plen % ALIGN:
            pad = bytes(ALIGN - plen % ALIGN)
            pieces.append(pad)
            digest.update(pad)
            plen += len(pad)
        pieces.append(a)
        digest.update(_u8(a))
        plen += a.nbytes
    message.msg_id = message.msg_id or os.urandom(16).hex()
    message.time = time.time()
    message.sender = sender
    header: dict[str, Any] = {
        "v": v,
        "fed": federation,
        "sender": sender,
        "recipient": message.recipient,
        "kind": message.kind,
        "round": int(message.round),
        "msg_id": message.msg_id,
        "time": message.time,
        "payload_blake3": digest.hexdigest(),
        "payload_len": plen,
        "encoding": {
            "format": "raw" if tensors else "none",
            "tensors": _tensor_description(tensors),
            **({"codec": message.encoding} if message.encoding is not None else {}),
        },
        "meta": message.meta,
    }
    # -- compact envelope: leave out what the receiver can infer --
    if raw_codec and message.encoding is not None:
        header["encoding"] = {"format": "codec", "codec": _compact_codec(message.encoding)}
    if not plen:
        del header["payload_blake3"], header["payload_len"]
        if not tensors and message.encoding is None:
            del header["encoding"]
    # -- security: sign the header (sig excluded; it holds the payload's one digest) --
    if sign is not None:
        if cert is not None:
            header["cert"] = cert
        # the envelope sent is the signed canonical JSON itself with ``sig`` appended as
        # its last member: serialised once, and verified as received (Header.signed_bytes)
        body = _CANONICAL.encode(header).encode()
        sig = sign(body)
        header["sig"] = sig
        hbytes = b"".join((body[:-1], b',"sig":', _JSON.encode(sig).encode(), b"}"))
    else:
        hbytes = _JSON.encode(header).encode()
    if len(hbytes) > MAX_HEADER_BYTES:
        raise ValueError(f"envelope too large ({len(hbytes)} bytes)")
    version = v
    if COMPRESS_HEADERS and len(hbytes) >= HEADER_ZSTD_MIN_SHARE * (len(hbytes) + plen):
        packed = zstandard.ZstdCompressor(level=_HEADER_ZSTD_LEVEL).compress(hbytes)
        if len(packed) < len(hbytes):
            hbytes, version = packed, v | HEADER_ZSTD
    if not version & HEADER_ZSTD:  # pad the JSON so that the payload starts aligned
        hbytes += b" " * (-(PREFIX_LEN + len(hbytes)) % ALIGN)
    frame = b"".join([_PREFIX.pack(MAGIC, version, len(hbytes)), hbytes, *pieces])
    message.wire_bytes = len(frame)
    return frame


def payload_offset(first: bytes | memoryview) -> int | None:
    """Where the payload starts in a frame whose first bytes are ``first`` (at least its
    prefix), or ``None`` when they are not the prefix of a frame of a version in :data:`~dfl_agent.transport.versions.SPOKEN`.  A chunk reassembler
    hashes the payload from there while the chunks arrive
    (:class:`dfl_agent.transport.chunking.Reassembler`'s ``hash_from``); :func:`decode`
    uses that hash when it covers exactly the payload it finds."""
    if len(first) < PREFIX_LEN:
        return None
    magic, version, hlen = _PREFIX.unpack_from(first, 0)
    if magic != MAGIC or version & ~HEADER_ZSTD not in _versions.SPOKEN or hlen > MAX_HEADER_BYTES:
        return None
    return PREFIX_LEN + int(hlen)


def raw_header(frame: bytes) -> dict[str, Any]:
    """The header of a frame that :func:`decode` accepted, as a plain dict.

    Raises:
        WireError: ``malformed`` (call :func:`decode` first for full checks).
    """
    if len(frame) < PREFIX_LEN:
        raise WireError("malformed", "frame shorter than its prefix")
    _, version, hlen = _PREFIX.unpack_from(frame, 0)
    return _parse_header(frame, version, hlen)


def split_frame(frame: bytes) -> tuple[dict[str, Any], bytes]:
    """``(header, payload)`` of a frame, the header inflated and parsed (for tools and
    tests that rewrite envelopes; no validation beyond :func:`raw_header`'s).

    Raises:
        WireError: ``malformed``.
    """
    header = raw_header(frame)
    return header, bytes(frame[PREFIX_LEN + _PREFIX.unpack_from(frame, 0)[2] :])


def _parse_header(frame: bytes, version: int, hlen: int) -> dict[str, Any]:
    """The JSON header of ``frame`` (inflated first when ``version`` has :data:`HEADER_ZSTD`).

    Raises:
        WireError: ``malformed`` (bad zstd, over :data:`MAX_HEADER_BYTES`, not a JSON object),
            ``too_deep`` (JSON nested deeper than 32 levels).
    """
    raw = bytes(frame[PREFIX_LEN : PREFIX_LEN + hlen])
    if version & HEADER_ZSTD:
        try:
            raw = zstd_inflate(raw, MAX_HEADER_BYTES)
        except CompressionError as exc:
            raise WireError("malformed", f"compressed envelope does not inflate: {exc}") from None
        if len(raw) > MAX_HEADER_BYTES:
            raise WireError("malformed", "envelope too large")
    raw = raw.rstrip(b" ")
    cut = raw.rfind(_SIG_TAIL) if raw.endswith(b'"}') else -1
    if cut > 0 and _SIG_CHARS.fullmatch(raw, cut + len(_SIG_TAIL), len(raw) - 2):
        # the signed form of encode(): parse the signed bytes, the signature is the tail
        body = raw[:cut] + b"}"
        try:  # bounded in size and nesting depth (32), like every JSON received
            parsed = bounded_loads(body, max_bytes=MAX_HEADER_BYTES)
        except JSONBoundError:
            parsed = None
        if isinstance(parsed, dict):
            header = Header(parsed, signed_bytes=body)
            header["sig"] = raw[cut + len(_SIG_TAIL) - 8 : -2].decode()
            return header
    try:
        parsed = bounded_loads(raw, max_bytes=MAX_HEADER_BYTES)
    except JSONBoundError as exc:  # too_deep (over 32 levels), oversized, malformed
        raise WireError(exc.reason, f"envelope is not usable JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise WireError("malformed", "envelope is not an object")
    return Header(parsed)


def _req(header: dict[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in header:
        raise WireError("malformed", f"envelope lacks {key!r}")
    value = header[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise WireError("malformed", f"envelope field {key!r} has type {type(value).__name__}")
    return value


def _decode_envelope(frame: bytes, *, max_frame_bytes: int) -> tuple[Envelope, dict[str, Any]]:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError("malformed", "frame is not bytes")
    if len(frame) > max_frame_bytes:
        raise WireError("oversized", f"{len(frame)} > {max_frame_bytes} bytes")
    if len(frame) < PREFIX_LEN:
        raise WireError("malformed", "frame shorter than its prefix")
    magic, version, hlen = _PREFIX.unpack_from(frame, 0)
    if magic != MAGIC:
        raise WireError("malformed", "bad magic")
    if version & ~HEADER_ZSTD not in _versions.SPOKEN:
        raise WireError("version", f"unsupported wire version {version & ~HEADER_ZSTD}")
    if hlen > MAX_HEADER_BYTES or PREFIX_LEN + hlen > len(frame):
        raise WireError("malformed", "header length out of range")
    header = _parse_header(frame, version, hlen)
    if _req(header, "v", int) != version & ~HEADER_ZSTD:
        raise WireError("version", f"envelope version {header['v']} in a frame of version {version & ~HEADER_ZSTD}")
    fed = _req(header, "fed", str)
    sender = _req(header, "sender", str)
    recipient = _req(header, "recipient", str)
    kind = _req(header, "kind", str)
    rnd = _req(header, "round", int)
    msg_id = _req(header, "msg_id", str)
    t = _req(header, "time", (int, float))
    # compact envelope (issue 8): an empty payload needs no length or hash, a message
    # without tensors no encoding
    plen = _req(header, "payload_len", int) if "payload_len" in header else 0
    digest = _req(header, "payload_blake3", str) if plen or "payload_blake3" in header else _EMPTY_DIGEST
    encoding = _req(header, "encoding", dict) if "encoding" in header else {"format": "none"}
    meta = _req(header, "meta", dict)
    sig = header.get("sig")
    if not (valid_id(fed) and valid_id(sender) and (recipient == BROADCAST or valid_id(recipient))):
        raise WireError("malformed", "invalid id in envelope")
    if not _KIND_RE.match(kind) or rnd < 0 or not (0 < len(msg_id) <= 64):
        raise WireError("malformed", "invalid kind, round or message id")
    if plen != len(frame) - PREFIX_LEN - hlen:
        raise WireError("malformed", f"payload length {len(frame) - PREFIX_LEN - hlen} != declared {plen}")
    if sig is not None and not isinstance(sig, str):
        raise WireError("malformed", "sig must be null or a string")
    fmt = encoding.get("format")
    desc = encoding.get("tensors", {})
    if fmt == "codec" and "tensors" in encoding:
        raise WireError("malformed", "a codec payload has no tensor table")
    if fmt not in ("raw", "none", "codec") or not isinstance(desc, dict) or len(desc) > MAX_TENSORS:
        raise WireError("malformed", "unknown encoding")
    for name, d in desc.items():
        if (
            not isinstance(d, dict)
            or d.get("dtype") not in ALLOWED_DTYPES
            or not isinstance(d.get("shape"), list)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in d["shape"])
        ):
            raise WireError("malformed", f"bad tensor description for {name!r}")
    if ("codec" in encoding or fmt == "codec") and not isinstance(encoding.get("codec"), dict):
        raise WireError("malformed", "codec description must be an object")
    return Envelope(
        version=header["v"], federation=fed, sender=sender, recipient=recipient, kind=kind,
        round=rnd, msg_id=msg_id, time=float(t), payload_blake3=digest, payload_len=plen,
        encoding=encoding, meta=meta, sig=sig,
    ), header


def decode(
    frame: bytes,
    *,
    federation: str | None = None,
    recipient: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """Fully decode and validate ``frame`` into a :class:`Message`.

    Args:
        frame: the received bytes (``bytes``, ``bytearray`` or ``memoryview``).  A
            writable, aligned buffer (e.g. a reassembled ``bytearray``) is decoded
            without copying: the tensors are views into it, so it must not be reused.
        federation: when given, frames of any other federation are rejected.
        recipient: when given (this node's id), frames addressed to another node
            are rejected (broadcasts pass).

    Returns:
        the message; its tensors are writable numpy arrays.

    Raises:
        WireError: any failed check (see module docstring for reasons).
    """
    return decode_with_header(frame, federation=federation, recipient=recipient,
                              max_frame_bytes=max_frame_bytes)[0]


def _check_finite(tensors: dict[str, np.ndarray], whole: np.ndarray | None = None) -> None:
    """Raise ``non_finite`` when a float tensor holds NaN or Inf.

    A finite sum proves it in one pass without a temporary array (over ``whole``, the
    payload as one float array, when every tensor has that dtype); a sum that is not
    finite - NaN, Inf, or an overflow - is settled element by element.

    Raises:
        WireError: ``non_finite``.
    """
    floats = [(name, a) for name, a in tensors.items() if a.dtype.kind == "f"]
    if not floats:
        return
    with np.errstate(all="ignore"):
        if whole is not None and np.isfinite(whole.sum()):
            return
        for name, arr in floats:
            if not np.isfinite(arr.sum()) and not np.isfinite(arr).all():
                raise WireError("non_finite", f"{name} holds NaN or Inf")


def decode_with_header(
    frame: bytes,
    *,
    federation: str | None = None,
    recipient: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> tuple[Message, dict[str, Any]]:
    """Like :func:`decode`, and also return the parsed header (a plain dict, ``sig``
    included) for :meth:`dfl_agent.security.SecurityGuard.check`.

    Raises:
        WireError: any failed check (see module docstring for reasons).
    """
    env, header = _decode_envelope(frame, max_frame_bytes=max_frame_bytes)
    if federation is not None and env.federation != federation:
        raise WireError("wrong_federation", f"{env.federation!r} != {federation!r}")
    if recipient is not None and env.recipient not in (BROADCAST, recipient):
        raise WireError("wrong_recipient", env.recipient)
    view = memoryview(frame)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    start = len(view) - env.payload_len
    payload = view[start:] if env.payload_len else view[:0]
    # the payload's one hash on this side: computed here, or while the frame's chunks
    # arrived (a reassembled frame says over which bytes: chunking.Frame)
    digest = getattr(frame, "payload_digest", None) if getattr(frame, "payload_offset", -1) == start else None
    if (digest or payload_digest(payload)) != env.payload_blake3:
        raise WireError("hash_mismatch", "payload hash differs from envelope")
    fmt = env.encoding.get("format")
    desc: dict[str, dict[str, Any]] = env.encoding.get("tensors", {})
    tensors: dict[str, np.ndarray] = {}
    if fmt == "raw" or fmt == "codec":
        if fmt == "codec":
            desc = {_codec.BLOB: {"dtype": "uint8", "shape": [env.payload_len]}}
        table = []  # (name, dtype, offset, elements, shape)
        off = 0
        dtypes = set()
        for name in sorted(desc):
            d = desc[name]
            n = math.prod(d["shape"])
            dt = _DTYPE_OF[d["dtype"]]
            dtypes.add(dt)
            off = -(-off // ALIGN) * ALIGN
            table.append((name, dt, off, n, d["shape"]))
            off += n * dt.itemsize
        total = off
        if total != env.payload_len:
            raise WireError("bad_tensor", f"tensors need {total} payload bytes, the payload has {env.payload_len}")
        # one copy at most: into a fresh writable, aligned buffer when the received one is not
        buf: Any = payload
        if payload.readonly or (total and np.frombuffer(payload, np.uint8, count=1).ctypes.data % ALIGN):
            buf = bytearray(payload)
        whole = None
        if len(dtypes) == 1 and total:  # one dtype: the padding is whole zero elements, one array views all
            dt = dtypes.pop()
            whole = np.frombuffer(buf, dtype=dt, count=total // dt.itemsize)
            isz = dt.itemsize
            for name, _, o, n, shape in table:
                tensors[name] = whole[o // isz : o // isz + n].reshape(shape)
            if dt.kind != "f":
                whole = None
        else:
            for name, dt, o, n, shape in table:
                tensors[name] = np.frombuffer(buf, dtype=dt, count=n, offset=o).reshape(shape)
        _check_finite(tensors, whole)
    elif payload:
        raise WireError("malformed", f"payload present but encoding is {fmt!r}")
    codec_desc = env.encoding.get("codec")
    if codec_desc is not None:
        try:
            codec_desc = _expand_codec(codec_desc)
            tensors = _codec.decode_tensors(tensors, codec_desc)
        except ValueError as exc:  # CompressionError and anything numpy raises on bad input
            raise WireError("bad_encoding", str(exc)) from None
        _check_finite(tensors)
    msg = Message(
        kind=env.kind, round=env.round, tensors=tensors, meta=env.meta, sender=env.sender,
        recipient=env.recipient, msg_id=env.msg_id, time=env.time, wire_bytes=len(view),
        encoding=codec_desc,
    )
    return msg, header
