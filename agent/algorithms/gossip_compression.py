"""Compressed averaging gossip for ``fedavg``, ``dechetero``, ``cfa`` and ``dechw``.

The algorithms call three helpers around their unchanged aggregation rule:

1. :func:`choco_for` at setup: a :class:`~dfl_agent.learning.error_feedback.ChocoGossip`
   when the node's compression policy (``ctx.compression``) compresses this kind,
   else ``None`` (then nothing changes: raw float32 models as before);
2. :func:`model_message` to send: with CHOCO, the message carries the compressed
   difference ``Q(x_i − x̂_i)`` (pre-encoded; the runtime sends it as it is);
3. :func:`received_copies` after collecting: each neighbour message is applied to
   that neighbour's copy ``x̂_j`` and replaced by it; the algorithm aggregates
   ``[x̂_i] + [x̂_j …]`` (:func:`own_for_mixing`) and :func:`finish_mixing` moves the
   exact model by ``γ (A(x̂) − x̂_i)`` (Koloskova et al. 2019, Alg. 2 line 8).

So no node ever averages in a lossy raw model (ALGORITHMS.md "Compression").

Hook for gradient streams (e.g. GT's accumulated gradients, issue in parallel): use
:class:`dfl_agent.learning.error_feedback.ErrorFeedback` with
``ctx.compression.stream_spec(kind)`` and send
``Message(kind, t, {WIRE_BLOB: blob}, encoding=desc)``; or just send plain tensors of
a kind listed in the ``[compression.kinds]`` table and the runtime compresses them
with a residual per stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from dfl_agent.algorithms.context import Message, NodeContext
from dfl_agent.learning.compression import WIRE_BLOB
from dfl_agent.learning.error_feedback import ChocoGossip

Tensors = dict[str, np.ndarray]


def choco_for(ctx: NodeContext, kind: str) -> ChocoGossip | None:
    """CHOCO state for the gossip stream ``kind``, or ``None`` when it is not compressed."""
    policy = ctx.compression
    if policy is None:
        return None
    spec = policy.stream_spec(kind)
    if spec.is_identity:
        return None
    gossip = ChocoGossip(
        spec, np.random.default_rng([int(ctx.init_seed), 0xC0C0]), error_feedback=policy.error_feedback,
        keyframe_every=policy.keyframe_every, consensus_step=policy.consensus_step,
    )
    gossip.kind = kind  # the resend of a keyframe to a restarted peer finds the stream by it
    gossip.epoch_source = lambda: gossip.gaps
    ctx.track_stream(gossip)  # the runtime: keyframes it lacks asked for, a returning peer gets one
    # a gap in a neighbour's stream (it was cut off, restarted, or its rounds went on without this
    # node) means it probably missed this node's messages too: the next one is a keyframe
    return gossip


def model_message(choco: ChocoGossip | None, kind: str, t: int, tensors: Mapping[str, np.ndarray], meta: dict) -> Message:
    """The round-``t`` gossip message: plain ``tensors``, or CHOCO's compressed difference.

    With CHOCO call it once per round and send the same message to every neighbour
    (the copies of all holders must receive the same ``q``).
    """
    if choco is None:
        return Message(kind, t, dict(tensors), meta=meta)
    blob, desc, extra = choco.outgoing(tensors)
    return Message(kind, t, {WIRE_BLOB: blob}, meta={**meta, **extra}, encoding=desc)


def received_copies(
    ctx: NodeContext, choco: ChocoGossip | None, got: Mapping[str, Message], nonnegative: tuple[str, ...] = ()
) -> dict[str, Message]:
    """Replace each neighbour message by one holding that neighbour's copy x̂_j.

    ``nonnegative``: name prefixes of tensors that must stay >= 0 (DecHW's Ĥ); their
    copies are clipped at 0 in what is returned (the copies themselves stay exact).

    Without CHOCO, messages of a CHOCO stream (differences, not models) are rejected
    (``compressed_stream``).  With CHOCO, a message out of sequence is rejected
    (``choco_gap``) and the neighbour waits for its next keyframe (the periodic one, or the
    one each sender sends after it saw this node come back); a plain model
    (a neighbour that does not compress) is used as an exact copy.
    """
    out: dict[str, Message] = {}
    for sender, msg in got.items():
        is_stream = ChocoGossip.META in msg.meta
        if choco is None:
            if is_stream:
                ctx.reject(msg, "compressed_stream: a CHOCO difference where a model was expected")
                continue
            out[sender] = msg
            continue
        if not is_stream:
            choco.forget(sender)
            out[sender] = msg
            continue
        copy = choco.incoming(sender, msg.tensors, msg.meta)
        if copy is None:
            ctx.reject(msg, "choco_gap: message out of sequence; waiting for a keyframe")
            continue
        if nonnegative:
            copy = {k: np.maximum(v, 0) if k.startswith(nonnegative) else v for k, v in copy.items()}
        out[sender] = dataclasses.replace(msg, tensors=copy)
    return out


def own_for_mixing(choco: ChocoGossip | None, own: Tensors) -> Tensors:
    """What the node contributes to its own aggregation: ``own`` or its copy x̂_i."""
    return own if choco is None else choco.own_copy(own.keys())


def finish_mixing(choco: ChocoGossip | None, own: Tensors, mixed: Tensors) -> Tensors:
    """The new model: ``mixed`` (no CHOCO) or ``own + γ (mixed − x̂_i)``."""
    return mixed if choco is None else choco.mix(own, mixed)
