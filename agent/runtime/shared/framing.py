"""Framing: the one place where a message becomes a wire frame (:func:`frame`).

A node's outbox (:mod:`dfl_agent.runtime.node.outbox`: compression with error feedback, byte
accounting) and the service's delivery to inference members
(:mod:`dfl_agent.runtime.service.member_delivery`) both frame through it: the wire encoder
(:func:`dfl_agent.transport.wire.encode`) is called nowhere else, and every frame is signed
the same way.  Torch-free.
"""

from __future__ import annotations

from typing import Any

from dfl_agent.algorithms.context import Message
from dfl_agent.transport import wire


def frame(message: Message, *, federation: str, sender: str, security: Any = None,
          version: int | None = None) -> bytes:
    """``message`` as one wire frame (:mod:`dfl_agent.transport.wire`) of wire ``version`` (the one
    its receivers all speak, :func:`~dfl_agent.transport.wire.negotiate`; None: the newest), signed
    with ``security``'s key (a :class:`~dfl_agent.security.SecurityGuard`) when it has one, its
    device certificate in the envelope.  Sets the message's ``msg_id``, ``time``, ``sender`` and
    ``wire_bytes``.

    Raises:
        ValueError: the message cannot be framed (bad ids or tensors, a version this release
            does not speak, an envelope over its limit).
    """
    signing = {"sign": security.sign, "cert": security.certificate} if security is not None and \
        security.key is not None else {}
    return wire.encode(message, federation=federation, sender=sender, version=version, **signing)
