"""Wire glue of compression: a message's tensors <-> one blob + the envelope's codec description.

``encode_tensors`` turns a dict of arrays into the wire tensors (one uint8 blob named
:data:`BLOB`) and the description that goes into the envelope
(``encoding.codec``, see :mod:`dfl_agent.transport.wire`); ``decode_tensors`` rebuilds
the arrays from the description alone, so a receiver needs no knowledge of the
sender's configuration.  The operators are :mod:`dfl_agent.learning.compression`.

Description (JSON, in the envelope)::

    {"c": "fp32"|"fp16"|"bf16"|"q8"|"q4"|"q2",   # value coder of the float tensors
     "b": block size (quantization, optional; default one scale per tensor),
     "t": {name: {"s": shape,
                  "d": dtype (when not float32), "c": "raw" (tensors sent as they are:
                  integer buffers, non-finite values),
                  "k": values kept (sparse only), "i": "v"|"m"|"r" (delta varints,
                  bitmap, random-k: no indices, "r" the seed), "il": varint bytes}},
     "z": "zstd"|"lz4" (optional), "zl": blob bytes before the entropy coder}

Section lengths follow from the table, so nothing in it is redundant; a table that
does not match the blob's length is rejected.

The blob is the concatenation of the tensors' sections in the order of the tensor
names sorted by Unicode code point (wire v5), never in the order of the table's keys:
a signed envelope is canonical JSON with sorted keys, and an unsigned one keeps the
sender's order, so the layout must not depend on either.  Each section is
[index bytes][lo, step float32 per block (q only)][values].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dfl_agent.learning.compression import (
    DEFAULT_MAX_ELEMENTS,
    WIRE_BLOB,
    CompressionError,
    CompressionSpec,
    compress_dict,
    decompress_dict,
)

BLOB = WIRE_BLOB


def encode_tensors(
    tensors: Mapping[str, np.ndarray], spec: CompressionSpec | str, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, np.ndarray]]:
    """Compress ``tensors`` for the wire.

    Returns:
        ``(wire_tensors, description, decoded)``: ``{BLOB: uint8 (L,)}``, the codec
        description for the envelope, and what the receiver will decode.

    Raises:
        CompressionError: bad spec, or a dtype that cannot travel.
    """
    blob, desc, decoded = compress_dict(tensors, spec, rng)
    return {BLOB: blob}, desc, decoded


def decode_tensors(
    wire_tensors: Mapping[str, np.ndarray], description: Mapping[str, Any], *, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> dict[str, np.ndarray]:
    """Rebuild the tensors from the wire tensors and the codec description.

    Raises:
        CompressionError: anything malformed (wire tensors other than one uint8
            blob, a description that does not match the blob, too many values).
    """
    if set(wire_tensors) != {BLOB}:
        raise CompressionError(f"a compressed message carries exactly one tensor {BLOB!r}")
    blob = np.asarray(wire_tensors[BLOB])
    if blob.dtype != np.uint8 or blob.ndim != 1:
        raise CompressionError("the codec blob must be uint8 of rank 1")
    return decompress_dict(blob, description, max_elements=max_elements)


def float32_bytes_of(description: Mapping[str, Any]) -> int:
    """The float32 size of the tensors a codec description encodes."""
    total = 0
    for e in description.get("t", {}).values():
        n = int(np.prod(e["s"])) if e["s"] else 1
        dt = np.dtype(e.get("d", "float32"))
        total += 4 * n if dt.kind == "f" else n * dt.itemsize
    return total
