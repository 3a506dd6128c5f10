"""The outbox of a node: compress (with error feedback), frame and sign
(:func:`~dfl_agent.runtime.shared.framing.frame`), and account bytes.

Each frame is written in the wire version its receivers all speak (:meth:`Outbox.wire_version`:
the recipient's, or for a broadcast the live members'; :func:`~dfl_agent.transport.versions.negotiate`),
so that a node of the previous release reads it.

Plain messages are compressed on send with the context's
:class:`~dfl_agent.learning.compression.CompressionPolicy` (``message_spec(kind)``), with an
error-feedback residual per stream for sparsified kinds; messages an algorithm already
encoded (``Message.encoding``, e.g. CHOCO gossip) go as they are.  Every message's wire
bytes are counted by kind, cumulatively and for the round, together with what the same
message would have taken with float32 tensors (the compression ratio).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from dfl_agent.algorithms.context import BROADCAST, Message
from dfl_agent.learning.error_feedback import ChocoGossip, ErrorFeedback
from dfl_agent.runtime.shared.framing import frame
from dfl_agent.transport import codec
from dfl_agent.transport.versions import negotiate

if TYPE_CHECKING:
    from dfl_agent.runtime.node.context import RuntimeContext

#: a message as it went on the wire: ``(peer, or None for a broadcast; its audience, None: every
#: member; the message)``
Sent = tuple[str | None, list[str] | None, Message]


class Outbox:
    """Frames one node's outgoing messages and counts their bytes.

    Args:
        ctx: the node's context (identity, compression policy, security).
        init_seed: seeds the compression operators' randomness (``[init_seed, 0xC0DEC]``).
    """

    def __init__(self, ctx: RuntimeContext, init_seed: int):
        self.ctx = ctx
        self.compression_rng = np.random.default_rng([init_seed, 0xC0DEC])
        self.error_feedback: dict[str, ErrorFeedback] = {}
        self.bytes_sent_by_kind: collections.Counter[str] = collections.Counter()
        self.float32_bytes_sent = 0  # what the sent messages would have taken with float32 tensors
        self.round_sent: collections.Counter[str] = collections.Counter()
        #: the message :meth:`encode` framed last, as it went on the wire (compressed)
        self.last_encoded: Message | None = None
        #: with ``pause_when_disconnected``: the messages sent this round and the round
        #: before, as they went on the wire, ``(peer or None for a broadcast, audience,
        #: message)``, which a node sends again after a broker outage (:meth:`reframe`)
        self.round_sent_messages: list[Sent] = []
        self.previous_sent_messages: list[Sent] = []
        #: the broadcast's wire version, and the peer table's change count it was chosen at (kept
        #: only where liveness changes with the table alone: no heartbeat expiry, the simulator)
        self._broadcast_version: tuple[int, int] | None = None

    def wire_version(self, recipient: str) -> int:
        """The wire version of a frame to ``recipient`` (:data:`~dfl_agent.algorithms.context.BROADCAST`:
        to every live member): the highest version they all announced (:meth:`PeerInfo.wire_versions
        <dfl_agent.discovery.peers.PeerInfo.wire_versions>`; a peer not described yet counts as speaking
        the oldest version this release speaks), by :func:`~dfl_agent.transport.versions.negotiate`."""
        peers = self.ctx.peers
        if recipient != BROADCAST:
            info = peers.get(recipient)
            return negotiate([info.wire_versions() if info is not None else ()])
        cached = self._broadcast_version
        if cached is not None and peers.heartbeat_timeout is None and cached[0] == peers.changes:
            return cached[1]
        changes = peers.changes
        version = negotiate(info.wire_versions() for n in peers.live_peers()
                                 if (info := peers.get(n)) is not None)
        self._broadcast_version = (changes, version)
        return version

    def keep(self, peer: str | None, audience: list[str] | None, message: Message | None) -> None:
        """Remember a sent message (:attr:`last_encoded` right after its :meth:`encode`)
        for :meth:`recent`, only where the node pauses for a lost broker (elsewhere
        nothing sends them again).  :attr:`last_encoded` is let go: a node holds no copy of
        its last message's tensors until its next one."""
        self.last_encoded = None
        if self.ctx.pause_when_disconnected and message is not None:
            self.round_sent_messages.append((peer, audience, message))

    def recent(self) -> list[Sent]:
        """The messages sent this round and the round before, oldest first."""
        return [*self.previous_sent_messages, *self.round_sent_messages]

    def as_keyframe(self, message: Message) -> Message | None:
        """``message`` for a peer that may have lost its copy of this node's CHOCO stream
        (a restart): a message that is no CHOCO difference as it is; the latest message of
        its stream as an exact float32 keyframe of the node's copy x̂_i after it (the same
        sequence number, so the stream goes on from it); None for an older one, which the
        peer could not apply (Koloskova et al. 2019, Alg. 2: the copies must agree)."""
        info = message.meta.get(ChocoGossip.META)
        if not isinstance(info, list) or len(info) != 2:
            return message
        for stream in getattr(self.ctx.membership, "streams", ()):
            if getattr(stream, "kind", None) == message.kind and stream.own is not None and stream.seq - 1 == info[0]:
                tensors = {k: np.array(v, copy=True) for k, v in stream.own.items()}
                return dataclasses.replace(message, tensors=tensors, encoding=None,
                                           meta={**message.meta, ChocoGossip.META: [info[0], 1]})
        return None

    def reframe(self, message: Message) -> bytes:
        """A new frame of a message sent before, its tensors as they went on the wire (not
        compressed again: error feedback is not applied twice): a new message id, send
        time and signature, so that a peer that has it already drops the copy as a
        duplicate or stale round, never as a replay."""
        return frame(dataclasses.replace(message, msg_id=""), federation=self.ctx.federation,
                     sender=self.ctx.node_id, security=self.ctx.security,
                     version=self.wire_version(message.recipient))

    def encode(self, message: Message) -> tuple[bytes, int]:
        """Compress (per the context's ``compression``) and frame ``message``.

        Returns ``(frame, reference)``: ``reference`` = bytes of the tensors as float32
        minus the bytes that replaced them (0 when nothing was compressed), so that
        ``wire bytes + reference`` is the message's float32 size.
        """
        ctx = self.ctx
        orig = out = message
        policy = ctx.compression
        if message.encoding is not None and set(message.tensors) != {codec.BLOB}:
            # a received (already decoded) message sent on: its description no longer applies
            out = message = dataclasses.replace(message, encoding=None)
        if message.encoding is None and message.tensors and policy is not None:
            spec = policy.message_spec(message.kind)
            if not spec.is_identity:
                if spec.sparse and policy.error_feedback:
                    ef = self.error_feedback.setdefault(message.kind, ErrorFeedback(spec))
                    blob, desc, _ = ef.compress(message.recipient, message.tensors, self.compression_rng)
                    wire_tensors = {codec.BLOB: blob}
                else:
                    wire_tensors, desc, _ = codec.encode_tensors(message.tensors, spec, self.compression_rng)
                out = dataclasses.replace(message, tensors=wire_tensors, encoding=desc)
        data = frame(out, federation=ctx.federation, sender=ctx.node_id, security=ctx.security,
                     version=self.wire_version(out.recipient))
        self.last_encoded = out
        if out is not orig:
            orig.msg_id, orig.time, orig.sender, orig.wire_bytes = out.msg_id, out.time, out.sender, out.wire_bytes
        reference = 0
        if out.encoding is not None and codec.BLOB in out.tensors:
            reference = codec.float32_bytes_of(out.encoding) - int(np.asarray(out.tensors[codec.BLOB]).nbytes)
        return data, reference

    def account(self, kind: str, n: int, reference: int) -> None:
        """``n`` wire bytes of a ``kind`` message went out (``reference``: see :meth:`encode`)."""
        self.bytes_sent_by_kind[kind] += n
        self.round_sent[kind] += n
        self.float32_bytes_sent += n + reference if n else 0

    def end_round(self) -> dict[str, int]:
        """The bytes sent this round by kind; starts a new count."""
        sent = dict(self.round_sent)
        self.round_sent.clear()
        self.previous_sent_messages, self.round_sent_messages = self.round_sent_messages, []
        return sent

    def ef_resets(self) -> int:
        """Error-feedback streams reset because their residual went non-finite."""
        return sum(ef.resets for ef in self.error_feedback.values())
