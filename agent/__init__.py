"""dfl-agent: serverless decentralized federated learning for edge devices.

Layers (each depends only on those above it in this list):
``learning`` -> ``algorithms`` -> ``transport``/``discovery`` -> ``runtime`` -> ``tools``.
"""

__version__ = "0.1.0"
WIRE_VERSION = 5  # 2: signed control envelopes for presence and status; 3: one payload hash, raw tensor payload, hashless chunks; 4: the payload hash is BLAKE3; 5: codec sections in sorted-name order
