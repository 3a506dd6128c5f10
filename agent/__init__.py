"""dfl-agent: serverless decentralized federated learning for edge devices.

Layers (each depends only on those above it in this list):
``learning`` -> ``algorithms`` -> ``transport``/``discovery`` -> ``runtime`` -> ``tools``.
"""

__version__ = "0.2.0"
#: the wire versions this release reads and writes, oldest first.  A release keeps every version of
#: the previous release (0.1.0 spoke 5) and writes each frame in the highest version its receivers
#: all speak (:func:`dfl_agent.transport.wire.negotiate`), so adding a new wire version is one more
#: entry here (and the format change in :mod:`dfl_agent.transport.wire`).  History: 2: signed
#: control envelopes for presence and status; 3: one payload hash, raw tensor payload, hashless
#: chunks; 4: the payload hash is BLAKE3; 5: codec sections in sorted-name order.
WIRE_VERSIONS: tuple[int, ...] = (5,)
#: the newest wire version this release speaks
WIRE_VERSION = WIRE_VERSIONS[-1]
