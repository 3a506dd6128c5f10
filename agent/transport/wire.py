"""Wire format v1: a versioned JSON envelope followed by tensors in safetensors.

Frame layout (all integers big-endian)::

    b"DFL" | version:u8 (=1, | 0x80) | header_len:u32 | header (UTF-8 JSON) | payload

When the version byte carries :data:`HEADER_ZSTD` (0x80), the header is a zstd frame
of that JSON (the sender compresses it whenever that is shorter: ~40 % of a model
message's envelope, issue 8); a receiver inflates it to at most
:data:`MAX_HEADER_BYTES` before parsing.  The signature covers the parsed header
(see below), so it does not depend on the header's byte form.

The header is the *envelope*::

    {"v": 1, "fed": str, "sender": str, "recipient": str ("*" = broadcast),
     "kind": str, "round": int, "msg_id": hex str, "time": float (unix s),
     "payload_sha256": hex str, "payload_len": int,
     "encoding": {"format": "safetensors" | "none",
                  "tensors": {name: {"dtype": "float32", "shape": [..]}},
                  "codec": {...}},   # optional: compressed tensors, see codec.py
     "meta": {...}, "sig": null}

The payload is a safetensors blob holding exactly the tensors the encoding names.
A receiver needs nothing but the envelope to decode.  Nothing received is ever
unpickled.  Every check failure raises :class:`WireError` with a short
``reason`` used as a counter key (``malformed``, ``oversized``, ``version``,
``wrong_federation``, ``wrong_recipient``, ``hash_mismatch``, ``bad_tensor``,
``non_finite``, ``bad_encoding``).

Compression (issue 8): a compressed message has ``encoding = {"format": "codec",
"codec": {...}}`` (no ``tensors`` table) and its payload is the codec blob of
:mod:`dfl_agent.transport.codec` as is, without a safetensors header; in the codec table
an entry that only holds a shape (``{"s": [..]}``) travels as the shape list.
:func:`decode` returns the tensors rebuilt from that description alone.

Compact envelope (issue 8): fields the receiver can infer are left out -
``payload_len``/``payload_sha256`` when the payload is empty (absent = 0 bytes),
``encoding`` when there are no tensors (absent = ``{"format": "none"}``), ``sig``
when the sender does not sign (absent = ``null``).  Frames that carry them are
still accepted.

The ``sig`` field holds ``"ed25519:" + base64`` of the sender's Ed25519 signature
over the canonical JSON (sorted keys, no spaces) of the header without ``sig`` -
which includes ``payload_sha256``, so the payload is covered too - or ``null`` when
the sender does not sign.  A signed header may carry ``cert``, the sender's device
certificate (see :mod:`dfl_agent.security`).  Verification is the receiver's
:class:`dfl_agent.security.SecurityGuard`'s job (:func:`raw_header` gives it the header).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from dfl_agent.algorithms.context import BROADCAST, Message
from dfl_agent.learning.compression import CompressionError, zstd_inflate
from dfl_agent.transport import codec as _codec

#: the frame format's version byte (unchanged by protocol revisions that did not touch it;
#: :data:`dfl_agent.WIRE_VERSION` is the protocol as a whole, announced in presence and mDNS)
WIRE_VERSION = 1
MAGIC = b"DFL"
_PREFIX = struct.Struct(">3sBI")
PREFIX_LEN = _PREFIX.size
MAX_HEADER_BYTES = 256 * 1024
#: flag in the version byte: the header is zstd-compressed JSON
HEADER_ZSTD = 0x80
_HEADER_ZSTD_LEVEL = 3
#: compress headers when shorter (receivers accept both forms); ``False`` sends plain
#: JSON, e.g. to read envelopes with ``mosquitto_sub`` or to compare byte counts with
#: runs made before header compression
COMPRESS_HEADERS = True
MAX_TENSORS = 4096
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

ALLOWED_DTYPES = {
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
}
_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_KIND_RE = re.compile(r"^[a-z0-9_.\-]{1,32}$")


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
    payload_sha256: str
    payload_len: int
    encoding: dict[str, Any]
    meta: dict[str, Any]
    sig: str | None


def valid_id(value: str) -> bool:
    """True when ``value`` is a valid node or federation id (``[A-Za-z0-9_.-]{1,64}``)."""
    return isinstance(value, str) and bool(_ID_RE.match(value))


def _tensor_description(tensors: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    return {name: {"dtype": str(a.dtype), "shape": list(a.shape)} for name, a in tensors.items()}


_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


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
           sign: Callable[[bytes], str] | None = None, cert: dict[str, Any] | None = None) -> bytes:
    """Serialise ``message`` into one v1 frame.

    ``sign`` (e.g. :meth:`dfl_agent.security.SecurityGuard.sign`) maps the canonical header
    bytes to the ``sig`` string; ``cert`` (a device certificate) is put into the signed
    header when given.

    Sets ``message.msg_id`` (if empty), ``message.time``, ``message.sender``.

    Raises:
        ValueError: a tensor has a dtype outside :data:`ALLOWED_DTYPES`, the kind or
            an id is invalid, or ``meta`` is not JSON-serialisable.
    """
    if not _KIND_RE.match(message.kind):
        raise ValueError(f"invalid message kind {message.kind!r}")
    if not valid_id(federation) or not valid_id(sender):
        raise ValueError("invalid federation or sender id")
    if message.recipient != BROADCAST and not valid_id(message.recipient):
        raise ValueError(f"invalid recipient {message.recipient!r}")
    tensors: dict[str, np.ndarray] = {}
    for name, arr in message.tensors.items():
        a = np.asarray(arr)
        if str(a.dtype) not in ALLOWED_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} not allowed on the wire")
        # safetensors 0.8 silently writes wrong values for non-contiguous arrays.
        tensors[name] = np.ascontiguousarray(a)
    # -- compression (issue 8): a compressed message's blob is the payload as is --
    raw_codec = message.encoding is not None and _is_codec_blob(tensors)
    if raw_codec:
        payload = tensors[_codec.BLOB].tobytes()
    else:
        payload = st_save(tensors) if tensors else b""
    message.msg_id = message.msg_id or uuid.uuid4().hex
    message.time = time.time()
    message.sender = sender
    header = {
        "v": WIRE_VERSION,
        "fed": federation,
        "sender": sender,
        "recipient": message.recipient,
        "kind": message.kind,
        "round": int(message.round),
        "msg_id": message.msg_id,
        "time": message.time,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_len": len(payload),
        "encoding": {
            "format": "safetensors" if tensors else "none",
            "tensors": _tensor_description(tensors),
            **({"codec": message.encoding} if message.encoding is not None else {}),
        },
        "meta": message.meta,
        "sig": None,
    }
    # -- compact envelope (issue 8): leave out what the receiver can infer --
    if raw_codec and message.encoding is not None:
        header["encoding"] = {"format": "codec", "codec": _compact_codec(message.encoding)}
    if not payload:
        del header["payload_sha256"], header["payload_len"]
        if not tensors and message.encoding is None:
            del header["encoding"]
    del header["sig"]
    # -- security: sign the header (sig excluded; it holds the payload hash) --
    if sign is not None:
        if cert is not None:
            header["cert"] = cert
        header["sig"] = sign(signed_body(header))
    hbytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if len(hbytes) > MAX_HEADER_BYTES:
        raise ValueError(f"envelope too large ({len(hbytes)} bytes)")
    version = WIRE_VERSION
    packed = zstandard.ZstdCompressor(level=_HEADER_ZSTD_LEVEL).compress(hbytes) if COMPRESS_HEADERS else hbytes
    if len(packed) < len(hbytes):  # compact envelope (issue 8): send the shorter form
        hbytes, version = packed, WIRE_VERSION | HEADER_ZSTD
    frame = _PREFIX.pack(MAGIC, version, len(hbytes)) + hbytes + payload
    message.wire_bytes = len(frame)
    return frame


def signed_body(header: dict[str, Any]) -> bytes:
    """The bytes a signature covers: canonical JSON of ``header`` without ``sig``.

    Raises:
        ValueError: the header holds NaN/Inf or non-JSON values.
    """
    body = {k: v for k, v in header.items() if k != "sig"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def raw_header(frame: bytes) -> dict[str, Any]:
    """The header of a frame that :func:`decode_envelope` accepted, as a plain dict.

    Raises:
        WireError: ``malformed`` (call :func:`decode_envelope` first for full checks).
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
        WireError: ``malformed`` (bad zstd, over :data:`MAX_HEADER_BYTES`, not a JSON object).
    """
    raw = bytes(frame[PREFIX_LEN : PREFIX_LEN + hlen])
    if version & HEADER_ZSTD:
        try:
            raw = zstd_inflate(raw, MAX_HEADER_BYTES)
        except CompressionError as exc:
            raise WireError("malformed", f"compressed envelope does not inflate: {exc}") from None
        if len(raw) > MAX_HEADER_BYTES:
            raise WireError("malformed", "envelope too large")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError("malformed", f"envelope is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("malformed", "envelope is not an object")
    return header


def _req(header: dict[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in header:
        raise WireError("malformed", f"envelope lacks {key!r}")
    value = header[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise WireError("malformed", f"envelope field {key!r} has type {type(value).__name__}")
    return value


def decode_envelope(frame: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Envelope:
    """Parse and validate the header of ``frame`` without touching the payload.

    Raises:
        WireError: ``oversized``, ``malformed`` or ``version``.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError("malformed", "frame is not bytes")
    if len(frame) > max_frame_bytes:
        raise WireError("oversized", f"{len(frame)} > {max_frame_bytes} bytes")
    if len(frame) < PREFIX_LEN:
        raise WireError("malformed", "frame shorter than its prefix")
    magic, version, hlen = _PREFIX.unpack_from(frame, 0)
    if magic != MAGIC:
        raise WireError("malformed", "bad magic")
    if version & ~HEADER_ZSTD != WIRE_VERSION:
        raise WireError("version", f"unsupported wire version {version & ~HEADER_ZSTD}")
    if hlen > MAX_HEADER_BYTES or PREFIX_LEN + hlen > len(frame):
        raise WireError("malformed", "header length out of range")
    header = _parse_header(frame, version, hlen)
    if _req(header, "v", int) != WIRE_VERSION:
        raise WireError("version", f"envelope version {header['v']}")
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
    digest = _req(header, "payload_sha256", str) if plen or "payload_sha256" in header else _EMPTY_SHA256
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
    if fmt not in ("safetensors", "none", "codec") or not isinstance(desc, dict) or len(desc) > MAX_TENSORS:
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
        round=rnd, msg_id=msg_id, time=float(t), payload_sha256=digest, payload_len=plen,
        encoding=encoding, meta=meta, sig=sig,
    )


def decode(
    frame: bytes,
    *,
    federation: str | None = None,
    recipient: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """Fully decode and validate ``frame`` into a :class:`Message`.

    Args:
        federation: when given, frames of any other federation are rejected.
        recipient: when given (this node's id), frames addressed to another node
            are rejected (broadcasts pass).

    Raises:
        WireError: any failed check (see module docstring for reasons).
    """
    env = decode_envelope(frame, max_frame_bytes=max_frame_bytes)
    if federation is not None and env.federation != federation:
        raise WireError("wrong_federation", f"{env.federation!r} != {federation!r}")
    if recipient is not None and env.recipient not in (BROADCAST, recipient):
        raise WireError("wrong_recipient", env.recipient)
    payload = bytes(frame[len(frame) - env.payload_len :]) if env.payload_len else b""
    if hashlib.sha256(payload).hexdigest() != env.payload_sha256:
        raise WireError("hash_mismatch", "payload hash differs from envelope")
    desc: dict[str, dict[str, Any]] = env.encoding.get("tensors", {})
    tensors: dict[str, np.ndarray] = {}
    if env.encoding.get("format") == "safetensors":
        try:
            tensors = st_load(payload)
        except Exception as exc:  # safetensors raises its own error types
            raise WireError("bad_tensor", f"payload is not safetensors: {exc}") from None
    elif env.encoding.get("format") == "codec":
        tensors = {_codec.BLOB: np.frombuffer(payload, dtype=np.uint8).copy()}
        desc = {_codec.BLOB: {"dtype": "uint8", "shape": [len(payload)]}}
    elif payload:
        raise WireError("malformed", "payload present but encoding is 'none'")
    if set(tensors) != set(desc):
        raise WireError("bad_tensor", "tensor names differ from the envelope's encoding")
    for name, arr in tensors.items():
        d = desc[name]
        if str(arr.dtype) != d["dtype"] or list(arr.shape) != d["shape"]:
            raise WireError("bad_tensor", f"{name}: {arr.dtype}{list(arr.shape)} != {d['dtype']}{d['shape']}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise WireError("non_finite", f"{name} holds NaN or Inf")
    codec_desc = env.encoding.get("codec")
    if codec_desc is not None:
        try:
            codec_desc = _expand_codec(codec_desc)
            tensors = _codec.decode_tensors(tensors, codec_desc)
        except ValueError as exc:  # CompressionError and anything numpy raises on bad input
            raise WireError("bad_encoding", str(exc)) from None
        for name, arr in tensors.items():
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise WireError("non_finite", f"{name} holds NaN or Inf")
    return Message(
        kind=env.kind, round=env.round, tensors=tensors, meta=env.meta, sender=env.sender,
        recipient=env.recipient, msg_id=env.msg_id, time=env.time, wire_bytes=len(frame),
        encoding=codec_desc,
    )
