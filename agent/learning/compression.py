"""Compression operators for model exchanges: quantization, sparsification, casts.

Pure functions over numpy arrays, no I/O (seed 003 §3.6.4 "Communication
Optimization"; ALGORITHMS.md "Compression").  The wire glue lives in
:mod:`dfl_agent.transport.codec`; error feedback and CHOCO-SGD in
:mod:`dfl_agent.learning.error_feedback`.

Operators
---------
- :func:`quantize` / :func:`dequantize`: probabilistic (stochastic) uniform
  quantization to ``b ∈ {2, 4, 8}`` bits (Konečný et al. 2016, as in seed 003
  §3.6.4 "Probabilistic Quantization"): per block of ``B`` values (``B = 0``: the
  whole tensor) the levels are ``lo + l·s``, ``s = (hi − lo) / (2^b − 1)``,
  ``l ∈ {0, …, 2^b − 1}`` (2^b − 1 steps, so ``hi`` stays representable;
  ALGORITHMS.md) and ``v`` rounds up to the next level with probability
  ``(v − lo)/s − ⌊(v − lo)/s⌋``, so ``E[Q(v)] = v`` (unbiased) and ``|Q(v) − v| < s``.
- :func:`cast_fp16`, :func:`cast_bf16`: IEEE half precision (values clipped to
  ±65504) and bfloat16 (round to nearest even), stored as 2 bytes per value.
- :func:`topk_indices`: the ``k`` largest magnitudes of one tensor ("layer-wise TopK
  sparsification", seed 003 §3.6.4); :func:`random_indices`: ``k`` positions drawn
  from a seed that travels in the encoding description, so the receiver regenerates
  them and no index is sent (random-k, Stich et al. 2018).  Values are kept
  unscaled (a contraction, as error feedback and CHOCO require; Koloskova et al. 2019).
- :func:`encode_indices` / :func:`decode_indices`: sorted positions as delta varints
  (LEB128 of the gaps) or as a bitmap, whichever is smaller.
- :func:`compress_dict` / :func:`decompress_dict`: a whole message (dict of arrays)
  into one byte blob plus a JSON-friendly description; sparsify, then quantize the
  kept values, then optionally zstd or lz4 over the whole blob.  The description
  alone is enough to decode.

Spec grammar (:func:`parse_spec`)
---------------------------------
::

    SPEC   := "none" | STAGE ("+" STAGE)*          (at most one stage of each group)
    sparse := "topk:" K | "randk:" K               K: fraction 0<K<1 ("0.01"),
                                                      percent ("1%") or count ("100")
    value  := "fp32" | "fp16" | "bf16" | "q8" | "q4" | "q2"  ["/" BLOCK]
    coder  := "zstd" [":" LEVEL] | "lz4"

Examples: ``fp16``, ``q8``, ``q4/256`` (4-bit, one scale per 256 values),
``topk:0.01+q8``, ``topk:1%+q8+zstd``, ``randk:0.1+q8``.  ``none`` = float32 as is.
``auto`` (the agent's default) = ``q4+zstd`` for difference streams (CHOCO gossip) and
float32 for plain messages such as whole models (:data:`AUTO`, :class:`CompressionPolicy`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

VALUE_CODERS = ("fp32", "fp16", "bf16", "q8", "q4", "q2")
ENTROPY_CODERS = ("zstd", "lz4")
FP16_MAX = 65504.0
WIRE_BLOB = "blob"  # the one wire tensor of a compressed message (dfl_agent.transport.codec)
DEFAULT_MAX_ELEMENTS = 1 << 26  # decoded elements per message (256 MB of float32)
#: ``auto``, the agent's default ``[compression] spec``: difference streams (CHOCO gossip,
#: :meth:`CompressionPolicy.stream_spec`) use :data:`AUTO_STREAM_SPEC` with error feedback; plain
#: messages (whole models, gradients) go as float32, since without error feedback 4-bit models
#: cost DFML 30 points (``bench/compression/results/default_choice.md``)
AUTO = "auto"
AUTO_STREAM_SPEC = "q4+zstd"
_F32_MAX = float(np.finfo(np.float32).max)
_LOSSLESS_DTYPES = {
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
}


class CompressionError(ValueError):
    """A compression spec or an encoded blob/description is invalid."""


# -- spec -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    """A parsed compression spec (see the module docstring for the grammar).

    Attributes:
        sparsifier: ``None``, ``"topk"`` or ``"randk"``.
        k: fraction of each tensor's values kept (``0 < k < 1``), or a count (``k >= 1``).
        value: value coder: ``fp32`` (as is), ``fp16``, ``bf16``, ``q8``, ``q4``, ``q2``.
        block: quantization block size in values (0 = one scale per tensor).
        coder: entropy coder over the final payload: ``None``, ``zstd`` or ``lz4``.
        level: zstd level.
    """

    sparsifier: str | None = None
    k: float = 0.0
    value: str = "fp32"
    block: int = 0
    coder: str | None = None
    level: int = 3

    @property
    def bits(self) -> int | None:
        """Quantization bits, or None for casts."""
        return int(self.value[1:]) if self.value.startswith("q") else None

    @property
    def is_identity(self) -> bool:
        """True for ``none``: tensors travel as they are."""
        return self.sparsifier is None and self.value == "fp32" and self.coder is None

    @property
    def sparse(self) -> bool:
        return self.sparsifier is not None

    def value_only(self) -> CompressionSpec:
        """The same spec without its sparsifier (for whole-model exchanges)."""
        return dataclasses.replace(self, sparsifier=None, k=0.0)

    def kept(self, n: int) -> int:
        """Values kept of a tensor of ``n`` values (``n`` when not sparsified)."""
        if self.sparsifier is None or n == 0:
            return n
        k = math.ceil(self.k * n) if self.k < 1 else int(self.k)
        return max(1, min(n, k))

    def __str__(self) -> str:
        parts = []
        if self.sparsifier:
            k = f"{self.k:g}" if self.k < 1 else str(int(self.k))
            parts.append(f"{self.sparsifier}:{k}")
        if self.value != "fp32" or not (self.sparsifier or self.coder):
            parts.append(self.value + (f"/{self.block}" if self.block else ""))
        if self.coder:
            parts.append(self.coder + (f":{self.level}" if self.coder == "zstd" and self.level != 3 else ""))
        s = "+".join(parts)
        return "none" if s == "fp32" else s


_SPARSE_RE = re.compile(r"^(topk|randk):([0-9.eE+-]+%?)$")
_VALUE_RE = re.compile(r"^(fp32|fp16|bf16|q8|q4|q2)(?:/(\d+))?$")
_CODER_RE = re.compile(r"^(zstd|lz4)(?::(-?\d+))?$")


def parse_spec(text: str | CompressionSpec | None) -> CompressionSpec:
    """Parse a compression spec string (grammar in the module docstring).

    Raises:
        CompressionError: unknown stage, repeated group, or a bad number.
    """
    if isinstance(text, CompressionSpec):
        return text
    if text is None:
        return CompressionSpec()
    if not isinstance(text, str):
        raise CompressionError(f"compression spec must be a string, got {type(text).__name__}")
    s = text.strip().lower()
    if s in ("", "none", "float32"):
        return CompressionSpec()
    if s == AUTO:  # the spec of its difference streams (CompressionPolicy.from_config)
        return parse_spec(AUTO_STREAM_SPEC)
    fields: dict[str, Any] = {}
    for stage in s.split("+"):
        stage = stage.strip()
        if m := _SPARSE_RE.match(stage):
            if "sparsifier" in fields:
                raise CompressionError(f"{text!r}: more than one sparsifier")
            raw = m.group(2)
            try:
                if raw.endswith("%"):
                    k = float(raw[:-1]) / 100
                    ok = 0 < k < 1
                elif re.fullmatch(r"\d+", raw):
                    k = float(int(raw))
                    ok = k >= 1
                else:
                    k = float(raw)
                    ok = 0 < k < 1
            except ValueError:
                raise CompressionError(f"{text!r}: bad k {raw!r}") from None
            if not ok:
                raise CompressionError(
                    f"{text!r}: k must be a fraction in (0, 1), a percentage below 100% or a whole count >= 1"
                )
            fields["sparsifier"], fields["k"] = m.group(1), k
        elif m := _VALUE_RE.match(stage):
            if "value" in fields:
                raise CompressionError(f"{text!r}: more than one value coder")
            fields["value"] = m.group(1)
            if m.group(2) is not None:
                if not m.group(1).startswith("q"):
                    raise CompressionError(f"{text!r}: a block size applies to q8/q4/q2 only")
                block = int(m.group(2))
                if block < 1:
                    raise CompressionError(f"{text!r}: block size must be >= 1")
                fields["block"] = block
        elif m := _CODER_RE.match(stage):
            if "coder" in fields:
                raise CompressionError(f"{text!r}: more than one entropy coder")
            fields["coder"] = m.group(1)
            if m.group(2) is not None:
                if m.group(1) != "zstd":
                    raise CompressionError(f"{text!r}: lz4 takes no level")
                fields["level"] = int(m.group(2))
                if not -7 <= fields["level"] <= 22:
                    raise CompressionError(f"{text!r}: zstd level must be in -7..22")
        else:
            raise CompressionError(
                f"{text!r}: unknown stage {stage!r} (expected topk:K, randk:K, fp32, fp16, bf16, q8, q4, q2, zstd, lz4)"
            )
    return CompressionSpec(**fields)


# -- quantization -------------------------------------------------------------------
def _blocks(n: int, block: int) -> int:
    return 0 if n == 0 else (1 if block <= 0 else -(-n // block))


def quantize(
    x: np.ndarray, bits: int, rng: np.random.Generator, block: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stochastic uniform quantization (unbiased; 2^bits − 1 steps per block).

    Args:
        x: float array of ``n`` values (flattened; finite).
        bits: 2, 4 or 8.
        rng: source of the rounding noise.
        block: values per block sharing ``lo``/``s`` (0 = the whole array).

    Returns:
        ``(levels uint8 (n,), lo float32 (nblocks,), step float32 (nblocks,))`` with
        ``dequantize(...) = lo + levels·step`` per block, ``E[...] = x`` and every
        value within one ``step`` of ``x``.

    Raises:
        ValueError: bad ``bits`` or non-finite input.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    v = np.asarray(x, dtype=np.float32).reshape(-1)
    n = v.size
    if n == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.float32), np.zeros(0, np.float32)
    if not np.isfinite(v).all():
        raise ValueError("cannot quantize non-finite values")
    nb = _blocks(n, block)
    size = n if block <= 0 else block
    pad = nb * size - n
    vb = np.concatenate([v, np.full(pad, v[-1], np.float32)]).reshape(nb, size) if pad else v.reshape(nb, size)
    lo = vb.min(axis=1).astype(np.float32)
    hi = vb.max(axis=1).astype(np.float32)
    top = (1 << bits) - 1
    step = ((hi.astype(np.float64) - lo) / top).astype(np.float32)
    safe = np.where(step > 0, step, 1.0).astype(np.float64)
    pos = (vb.astype(np.float64) - lo[:, None]) / safe[:, None]
    levels = np.floor(pos + rng.random(pos.shape))
    levels = np.clip(levels, 0, top)
    levels[step == 0] = 0
    return levels.reshape(-1)[:n].astype(np.uint8), lo, step


def dequantize(levels: np.ndarray, lo: np.ndarray, step: np.ndarray, block: int = 0) -> np.ndarray:
    """Inverse of :func:`quantize`: float32 ``(n,)`` = ``lo + levels·step`` per block,
    computed in float64 and clamped to the finite float32 range, so finite input never
    decodes to inf."""
    n = levels.size
    if n == 0:
        return np.zeros(0, np.float32)
    size = n if block <= 0 else block
    which = np.arange(n) // size
    # float64, then clamped to the float32 range: ``lo + l·s`` of finite input can exceed
    # float32's largest value by rounding (e.g. lo = -3e38, hi = 3e38), and must never
    # decode to inf
    out = lo[which].astype(np.float64) + levels.astype(np.float64) * step[which].astype(np.float64)
    return np.clip(out, -_F32_MAX, _F32_MAX).astype(np.float32)


def pack_levels(levels: np.ndarray, bits: int) -> bytes:
    """Pack ``bits``-bit levels (uint8 ``(n,)``), ``8 // bits`` per byte, low bits first."""
    per = 8 // bits
    lv = levels.astype(np.uint8)
    if per == 1:
        return lv.tobytes()
    pad = (-lv.size) % per
    if pad:
        lv = np.concatenate([lv, np.zeros(pad, np.uint8)])
    lv = lv.reshape(-1, per)
    out = np.zeros(lv.shape[0], np.uint8)
    for j in range(per):
        out |= (lv[:, j] << (bits * j)).astype(np.uint8)
    return out.tobytes()


def unpack_levels(data: bytes | np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_levels`: uint8 ``(n,)``."""
    per = 8 // bits
    raw = np.frombuffer(bytes(data), np.uint8)
    if per == 1:
        return raw[:n].copy()
    mask = (1 << bits) - 1
    out = np.stack([(raw >> (bits * j)) & mask for j in range(per)], axis=1).reshape(-1)
    return out[:n].astype(np.uint8)


# -- casts ------------------------------------------------------------------------
def cast_fp16(x: np.ndarray) -> np.ndarray:
    """float32 -> float16 (values beyond ±65504 are clipped, not turned into inf)."""
    return np.clip(np.asarray(x, np.float32), -FP16_MAX, FP16_MAX).astype(np.float16)


def cast_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


def uncast_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# -- sparsification -------------------------------------------------------------------
def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions (int64 ``(k,)``) of the ``k`` largest ``|x|`` of the flattened ``x``."""
    v = np.abs(np.asarray(x).reshape(-1))
    if k >= v.size:
        return np.arange(v.size, dtype=np.int64)
    idx = np.argpartition(v, v.size - k)[v.size - k :]
    return np.sort(idx).astype(np.int64)


def random_indices(n: int, k: int, seed: int) -> np.ndarray:
    """Sorted positions (int64 ``(k,)``) of random-k, regenerated from ``seed`` alone."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(k, n), replace=False)).astype(np.int64)


def _varint_encode(values: np.ndarray) -> bytes:
    v = values.astype(np.uint64)
    if v.size == 0:
        return b""
    nbytes = np.ones(v.size, np.int64)
    for s in (7, 14, 21, 28, 35, 42, 49, 56):
        nbytes += (v >= (np.uint64(1) << np.uint64(s))).astype(np.int64)
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.zeros(int(ends[-1]), np.uint8)
    for j in range(int(nbytes.max())):
        sel = nbytes > j
        byte = (v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (nbytes[sel] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + j] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _varint_decode(data: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(data, np.uint8)
    if b.size == 0:
        if count:
            raise CompressionError("varint stream too short")
        return np.zeros(0, np.int64)
    if b[-1] & 0x80:
        raise CompressionError("truncated varint")
    ends = (b & 0x80) == 0
    group = np.concatenate([[0], np.cumsum(ends)[:-1]])
    if int(ends.sum()) != count:
        raise CompressionError(f"varint stream holds {int(ends.sum())} values, expected {count}")
    starts = np.flatnonzero(np.concatenate([[True], ends[:-1]]))
    pos = np.arange(b.size) - starts[group]
    if pos.max() > 8:
        raise CompressionError("varint too long")
    terms = (b & 0x7F).astype(np.uint64) << (7 * pos).astype(np.uint64)
    return np.bitwise_or.reduceat(terms, starts).astype(np.int64)


def encode_indices(idx: np.ndarray, n: int) -> tuple[str, bytes]:
    """Encode sorted unique positions in ``[0, n)``: ``("v", delta varints)`` (gaps
    minus one, LEB128) or ``("m", bitmap of n bits)``, whichever is smaller."""
    idx = np.asarray(idx, np.int64)
    gaps = np.diff(idx, prepend=-1) - 1
    varints = _varint_encode(gaps)
    bitmap_len = -(-n // 8)
    if len(varints) <= bitmap_len:
        return "v", varints
    mask = np.zeros(n, bool)
    mask[idx] = True
    return "m", np.packbits(mask, bitorder="little").tobytes()


def decode_indices(mode: str, data: bytes, n: int, k: int) -> np.ndarray:
    """Inverse of :func:`encode_indices`; validates count, order and range.

    Raises:
        CompressionError: malformed stream.
    """
    if mode == "v":
        gaps = _varint_decode(data, k)
        if (gaps < 0).any():
            raise CompressionError("negative gap")
        idx = np.cumsum(gaps + 1) - 1
    elif mode == "m":
        if len(data) != -(-n // 8):
            raise CompressionError("bitmap length differs from the tensor size")
        bits = np.unpackbits(np.frombuffer(data, np.uint8), count=n, bitorder="little")
        idx = np.flatnonzero(bits).astype(np.int64)
        if idx.size != k:
            raise CompressionError(f"bitmap holds {idx.size} positions, expected {k}")
    else:
        raise CompressionError(f"unknown index mode {mode!r}")
    if idx.size and (idx[-1] >= n or idx[0] < 0):
        raise CompressionError("index out of range")
    return idx


# -- whole messages ---------------------------------------------------------------------
def _value_len(coder: str, kept: int, block: int) -> int:
    """Bytes of the value section (quantization params included)."""
    if coder in ("fp16", "bf16"):
        return 2 * kept
    if coder == "fp32":
        return 4 * kept
    per = 8 // int(coder[1:])  # levels packed per byte (pack_levels)
    return 8 * _blocks(kept, block) + -(-kept // per)


def compress_tensor(
    x: np.ndarray, spec: CompressionSpec, rng: np.random.Generator
) -> tuple[dict[str, Any], bytes, np.ndarray]:
    """Compress one array.

    Float arrays with finite values follow ``spec``; anything else (integer/bool
    buffers, non-finite values) travels raw in its own dtype, so nothing is lost and
    a receiver can still reject non-finite values.

    Returns:
        ``(entry, data, decoded)``: the description entry (JSON-friendly), the bytes,
        and exactly what :func:`decompress_tensor` will return (same shape and dtype
        as ``x``).
    """
    a = np.asarray(x)
    shape = [int(s) for s in a.shape]
    dtype = str(a.dtype)
    n = int(a.size)
    entry: dict[str, Any] = {"s": shape}
    if dtype != "float32":
        entry["d"] = dtype
    if a.dtype.kind != "f" or not np.isfinite(a).all() or (spec.sparsifier is None and spec.value == "fp32"):
        if dtype not in _LOSSLESS_DTYPES:
            raise CompressionError(f"dtype {dtype} cannot travel")
        data = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
        entry["c"] = "raw"
        return entry, data, a.copy()
    flat = a.astype(np.float32).reshape(-1)
    k = spec.kept(n)
    parts: list[bytes] = []
    idx = None
    if k < n:
        entry["k"] = k
        if spec.sparsifier == "topk":
            idx = topk_indices(flat, k)
            mode, idx_bytes = encode_indices(idx, n)
            entry["i"] = mode
            if mode == "v":
                entry["il"] = len(idx_bytes)
            parts.append(idx_bytes)
        else:
            seed = int(rng.integers(0, 2**62))
            idx = random_indices(n, k, seed)
            entry["i"], entry["r"] = "r", seed
        vals = flat[idx]
    else:
        vals = flat
    coder = spec.value  # the description's default coder; entries name it only when they differ
    if coder == "fp32":
        dec = vals.copy()
        parts.append(vals.astype("<f4").tobytes())
    elif coder == "fp16":
        h = cast_fp16(vals)
        dec = h.astype(np.float32)
        parts.append(h.astype("<f2").tobytes())
    elif coder == "bf16":
        b = cast_bf16(vals)
        dec = uncast_bf16(b)
        parts.append(b.astype("<u2").tobytes())
    else:
        bits = spec.bits
        assert bits is not None
        levels, lo, step = quantize(vals, bits, rng, spec.block)
        dec = dequantize(levels, lo, step, spec.block)
        parts.append(lo.astype("<f4").tobytes() + step.astype("<f4").tobytes())
        parts.append(pack_levels(levels, bits))
    data = b"".join(parts)
    if idx is not None:
        full = np.zeros(n, np.float32)
        full[idx] = dec
        dec = full
    return entry, data, dec.reshape(shape).astype(a.dtype)


def section_len(entry: Mapping[str, Any], coder: str, block: int = 0) -> int:
    """Bytes of one tensor's section, from its entry (``coder``/``block``: the
    description's defaults).

    Raises:
        CompressionError: inconsistent entry.
    """
    shape, dtype, coder = entry["s"], entry.get("d", "float32"), entry.get("c", coder)
    if dtype not in _LOSSLESS_DTYPES:
        raise CompressionError(f"dtype {dtype!r} not allowed")
    n = math.prod(shape)
    if coder == "raw":
        return n * np.dtype(dtype).itemsize
    if coder not in VALUE_CODERS:
        raise CompressionError(f"unknown value coder {coder!r}")
    if np.dtype(dtype).kind != "f":
        raise CompressionError(f"value coder {coder} on a {dtype} tensor")
    k = entry.get("k", n)
    if not isinstance(k, int) or isinstance(k, bool) or not (0 < k <= n or n == k == 0):
        raise CompressionError("bad kept count")
    il = 0
    if k < n:
        mode = entry.get("i")
        if mode == "v":
            il_raw = entry.get("il")
            if not isinstance(il_raw, int) or isinstance(il_raw, bool) or not 0 <= il_raw <= 10 * k:
                raise CompressionError("bad index length")
            il = il_raw
        elif mode == "m":
            il = -(-n // 8)
        elif mode != "r":
            raise CompressionError(f"unknown index mode {mode!r}")
    return il + _value_len(coder, k, block)


def decompress_tensor(entry: Mapping[str, Any], data: bytes, coder: str = "fp32", block: int = 0) -> np.ndarray:
    """Inverse of :func:`compress_tensor` from the entry alone (``coder``/``block``:
    the description's defaults).

    Raises:
        CompressionError: the entry or the bytes are malformed.
    """
    shape, dtype, coder = entry["s"], entry.get("d", "float32"), entry.get("c", coder)
    n = math.prod(shape)
    if len(data) != section_len(entry, coder, block):
        raise CompressionError("section length differs from its description")
    if coder == "raw":
        if dtype not in _LOSSLESS_DTYPES:
            raise CompressionError(f"dtype {dtype} not allowed")
        dt = np.dtype(dtype)
        return np.frombuffer(data, dt.newbyteorder("<")).astype(dt).reshape(shape)
    k = entry.get("k", n)
    off = 0
    idx = None
    if k < n:
        mode = entry.get("i")
        if mode == "r":
            seed = entry.get("r")
            if not isinstance(seed, int) or not 0 <= seed < 2**63:
                raise CompressionError("bad random-k seed")
            idx = random_indices(n, k, seed)
        else:
            il = entry["il"] if mode == "v" else -(-n // 8)
            idx = decode_indices(str(mode), data[:il], n, k)
            off = il
    body = data[off:]
    if coder == "fp32":
        vals = np.frombuffer(body, "<f4").astype(np.float32)
    elif coder == "fp16":
        vals = np.frombuffer(body, "<f2").astype(np.float32)
    elif coder == "bf16":
        vals = uncast_bf16(np.frombuffer(body, "<u2"))
    else:
        bits = int(coder[1:])
        nb = _blocks(k, block)
        lo = np.frombuffer(body[: 4 * nb], "<f4").astype(np.float32)
        step = np.frombuffer(body[4 * nb : 8 * nb], "<f4").astype(np.float32)
        levels = unpack_levels(body[8 * nb :], bits, k)
        vals = dequantize(levels, lo, step, block)
    if idx is not None:
        full = np.zeros(n, np.float32)
        full[idx] = vals
        vals = full
    return vals.reshape(shape).astype(dtype)


def compress_dict(
    tensors: Mapping[str, np.ndarray], spec: CompressionSpec | str, rng: np.random.Generator
) -> tuple[np.ndarray, dict[str, Any], dict[str, np.ndarray]]:
    """Compress a message's tensors into one uint8 blob.

    Args:
        tensors: name -> array (float arrays are compressed, others travel raw).
        spec: a :class:`CompressionSpec` or spec string.
        rng: randomness of stochastic rounding and random-k seeds.

    Returns:
        ``(blob uint8 (L,), description, decoded)``: ``description`` is
        ``{"c": value coder, "b": block?, "t": {name: entry}, "z": coder?, "zl": raw length?}``;
        ``decoded`` is exactly what :func:`decompress_dict` returns (what the
        receivers will see; error feedback uses it).

    Raises:
        CompressionError: a tensor of a dtype that cannot travel.
    """
    spec = parse_spec(spec)
    entries: dict[str, Any] = {}
    chunks: list[bytes] = []
    decoded: dict[str, np.ndarray] = {}
    # sections in the order of the sorted names, the order a receiver decodes them in
    # whatever the order of the description's keys (a signed envelope's canonical JSON
    # sorts them): the layout must not depend on dict order
    for name in sorted(tensors):
        if not isinstance(name, str):
            raise CompressionError(f"tensor names must be strings, got {name!r}")
        entry, data, dec = compress_tensor(tensors[name], spec, rng)
        entries[name] = entry
        chunks.append(data)
        decoded[name] = dec
    raw = b"".join(chunks)
    desc: dict[str, Any] = {"c": spec.value, "t": entries}
    if spec.block:
        desc["b"] = spec.block
    if spec.coder == "zstd":
        import zstandard

        desc["z"], desc["zl"] = "zstd", len(raw)
        raw = zstandard.ZstdCompressor(level=spec.level).compress(raw)
    elif spec.coder == "lz4":
        import lz4.frame

        desc["z"], desc["zl"] = "lz4", len(raw)
        raw = lz4.frame.compress(raw)
    return np.frombuffer(raw, np.uint8).copy(), desc, decoded


def zstd_inflate(data: bytes, limit: int) -> bytes:
    """Inflate one zstd frame of at most ``limit`` bytes, safely for untrusted input.

    The frame's declared content size is checked before anything is allocated
    (zstandard allocates what a frame declares).

    Raises:
        CompressionError: not a zstd frame, corrupt, or larger than ``limit``.
    """
    import zstandard

    try:
        declared = zstandard.frame_content_size(data)
        if declared > limit:
            raise CompressionError(f"zstd frame declares {declared} bytes > {limit}")
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=max(limit, 1))
    except (zstandard.ZstdError, MemoryError) as exc:
        raise CompressionError(f"zstd: {exc}") from None


def decompress_dict(
    blob: np.ndarray | bytes, desc: Mapping[str, Any], *, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> dict[str, np.ndarray]:
    """Inverse of :func:`compress_dict`, from the description alone.

    Args:
        max_elements: refuse descriptions that decode to more values than this
            (a tiny sparse blob must not allocate gigabytes).

    Raises:
        CompressionError: malformed description or blob.
    """
    try:
        return _decompress_dict(blob, desc, max_elements)
    except CompressionError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError, IndexError) as exc:
        raise CompressionError(f"malformed encoding: {exc!r}") from None


def _decompress_dict(blob: Any, desc: Mapping[str, Any], max_elements: int) -> dict[str, np.ndarray]:
    if not isinstance(desc, Mapping) or not isinstance(desc.get("t"), Mapping):
        raise CompressionError("description lacks its tensor table")
    data = bytes(blob) if not isinstance(blob, np.ndarray) else blob.tobytes()
    entries = desc["t"]
    coder, block = desc.get("c", "fp32"), desc.get("b", 0)
    if coder not in VALUE_CODERS:
        raise CompressionError(f"unknown value coder {coder!r}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 0:
        raise CompressionError("bad block size")
    if not all(isinstance(name, str) for name in entries):
        raise CompressionError("bad tensor entry")
    # sections follow the sorted names (see compress_dict), never the table's key order
    ordered = [(name, entries[name]) for name in sorted(entries)]
    total, expected = 0, 0
    lengths = []
    for name, e in ordered:
        if not isinstance(e, Mapping):
            raise CompressionError("bad tensor entry")
        shape = e.get("s")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise CompressionError(f"{name}: bad shape")
        total += math.prod(shape)
        if total > max_elements:
            break
        lengths.append(section_len(e, coder, block))
        expected += lengths[-1]
    if total > max_elements:
        raise CompressionError(f"encoding decodes to {total} values > {max_elements}")
    z = desc.get("z")
    if z is not None:
        zl = desc.get("zl")
        if not isinstance(zl, int) or zl != expected:
            raise CompressionError("declared raw length differs from the tensor table")
        if z == "zstd":
            data = zstd_inflate(data, zl)
        elif z == "lz4":
            import lz4.frame

            try:
                d = lz4.frame.LZ4FrameDecompressor()
                data = d.decompress(data, max_length=zl)
            except RuntimeError as exc:
                raise CompressionError(f"lz4: {exc}") from None
        else:
            raise CompressionError(f"unknown entropy coder {z!r}")
    if len(data) != expected:
        raise CompressionError(f"blob holds {len(data)} bytes, the table {expected}")
    out: dict[str, np.ndarray] = {}
    off = 0
    for (name, e), ln in zip(ordered, lengths):
        out[name] = decompress_tensor(e, data[off : off + ln], coder, block)
        off += ln
    return out


@dataclasses.dataclass
class CompressionPolicy:
    """Which spec a node uses for which message kind (configuration ``[compression]``).

    Attributes:
        default: spec of every kind not listed in ``kinds``.  Averaging gossip
            (compressed differences, CHOCO) uses it whole; other exchanges (whole
            models: DFML, Def-KT) use only its value coder and entropy coder, since
            sparsifying a raw model would zero most of it.
        kinds: ``{kind: spec}``, applied exactly as written, on top of any algorithm.
        error_feedback: keep a residual per stream for sparsified streams
            (Stich et al. 2018; CHOCO's copies for gossip); off only to compare.
        keyframe_every: CHOCO streams resend their shared copy, value-coded, every
            this many messages, so a peer that missed a message rejoins and the copy
            error stays bounded (0 = automatic: first message only for dense specs,
            every 100 for sparsified ones; < 0 = first message only).
        consensus_step: CHOCO's γ for sparsified gossip (0 = 1.0 for dense specs,
            see :mod:`dfl_agent.learning.error_feedback`).
        whole_model: spec of plain messages not in ``kinds`` (whole models; None: the
            default's value and entropy coders); ``auto`` sets it to float32.
    """

    default: CompressionSpec = dataclasses.field(default_factory=CompressionSpec)
    kinds: dict[str, CompressionSpec] = dataclasses.field(default_factory=dict)
    error_feedback: bool = True
    keyframe_every: int = 0
    consensus_step: float = 0.0
    whole_model: CompressionSpec | None = None

    @classmethod
    def from_config(
        cls, default: str | None = "none", kinds: Mapping[str, str] | None = None, **kw: Any
    ) -> CompressionPolicy:
        """Build from spec strings (``auto``: see :data:`AUTO`). Raises :class:`CompressionError`
        naming the bad spec."""
        if isinstance(default, str) and default.strip().lower() == AUTO:
            kw.setdefault("whole_model", CompressionSpec())
        return cls(parse_spec(default), {k: parse_spec(v) for k, v in (kinds or {}).items()}, **kw)

    @property
    def active(self) -> bool:
        return not self.default.is_identity or any(not s.is_identity for s in self.kinds.values())

    def stream_spec(self, kind: str) -> CompressionSpec:
        """Spec of a difference stream (gossip, accumulated gradients) of ``kind``."""
        return self.kinds.get(kind, self.default)

    def message_spec(self, kind: str) -> CompressionSpec:
        """Spec the runtime applies to a plain (not pre-encoded) message of ``kind``."""
        if kind in self.kinds:
            return self.kinds[kind]
        if self.whole_model is not None:
            return self.whole_model
        return self.default.value_only()
