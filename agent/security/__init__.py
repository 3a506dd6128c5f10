"""Security: node keys, the federation trust store, signed envelopes and replay protection.

* :mod:`dfl_agent.security.keys` - Ed25519 keys in the state directory, device certificates.
* :mod:`dfl_agent.security.trust` - :class:`TrustStore` (who is a member) and
  :class:`SecurityGuard` (sign outgoing envelopes; verify and replay-check incoming ones).
"""

from dfl_agent.security.keys import SecurityError
from dfl_agent.security.trust import (
    CONTROL_REJECT_REASONS,
    REJECT_REASONS,
    ControlRejected,
    SecurityGuard,
    SeqCounter,
    TrustStore,
)

__all__ = [
    "CONTROL_REJECT_REASONS",
    "REJECT_REASONS",
    "ControlRejected",
    "SecurityError",
    "SecurityGuard",
    "SeqCounter",
    "TrustStore",
]
