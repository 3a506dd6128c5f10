"""Error feedback for compressed streams, and CHOCO-SGD's shared copies for gossip.

Pure state machines over dicts of float32 arrays (no I/O); the operators are in
:mod:`dfl_agent.learning.compression`.

- :class:`ErrorFeedback`: one residual ``e`` per outgoing stream (per destination or
  per broadcast, per message kind).  Stich, Cordonnier & Jaggi, "Sparsified SGD with
  memory" (NeurIPS 2018), Alg. 1: send ``c = C(x + e)``, keep ``e ← x + e − c``.
  Used for streams of deltas/gradients (e.g. GT's accumulated gradients).
- :class:`ChocoGossip`: Koloskova, Stich & Jaggi, "Decentralized Stochastic
  Optimization and Gossip Algorithms with Compressed Communication" (ICML 2019),
  Alg. 2 (CHOCO-SGD).  Node ``i`` keeps a public copy ``x̂_j`` of itself and of every
  neighbour ``j``; each round it sends ``q_i = Q(x_i − x̂_i)``, every holder adds
  it, ``x̂_i ← x̂_i + q_i``, and the consensus step is
  ``x_i ← x_i + γ Σ_j w_ij (x̂_j − x̂_i)`` (Alg. 2 line 8).  Written with the
  algorithm's own mixing rule ``A`` (weighted average, Hessian weights, consensus):
  ``x_i ← x_i + γ (A(x̂_i, x̂_j…) − x̂_i)``, which is exactly ``A`` on exact models
  when ``Q`` is the identity and ``γ = 1``.  A node therefore never averages in a
  lossy raw model: the copies are identical on both sides and the own exact
  model is only moved by their differences.  The difference ``x_i − x̂_i`` keeps
  whatever was not yet sent, so the copies are the error feedback (``error_feedback
  = False`` sends ``Q(x_i − x_i^{prev})`` instead and loses what ``Q`` dropped:
  the ablation).

Copies start from a *keyframe*: the first message of a stream (and every
``keyframe_every`` messages) carries ``x_i`` value-coded but not sparsified, and both
sides set ``x̂_i`` to its decoded value.  A message arriving out of sequence (a peer
missed one) leaves that neighbour out until its next keyframe.  Sparsified streams
resend a keyframe every :data:`SPARSE_KEYFRAME_EVERY` messages unless configured
otherwise: with a constant learning rate the copy error ``x_i − x̂_i`` of top-1 %
CHOCO drifts slowly and, measured on digits (6 nodes, one SGD step per round,
γ = 0.05), made a run collapse after ~2 400 rounds; a keyframe every 100 messages
bounds it (0.7 points below float32 at 4 000 rounds) for ~1/100 of a q8 model per
message (``bench/compression/steps.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from dfl_agent.learning.compression import CompressionSpec, compress_dict, parse_spec

Tensors = dict[str, np.ndarray]


def _is_float(a: np.ndarray) -> bool:
    return np.asarray(a).dtype.kind == "f"


class ErrorFeedback:
    """Residuals per stream (Stich et al. 2018, Alg. 1 "mem-SGD").

    Args:
        spec: the compression applied to every stream.
    """

    def __init__(self, spec: CompressionSpec | str):
        self.spec = parse_spec(spec)
        self.residuals: dict[Hashable, Tensors] = {}
        #: streams whose residual went non-finite and was reset (see :meth:`compress`)
        self.resets = 0

    def compress(
        self, stream: Hashable, tensors: Mapping[str, np.ndarray], rng: np.random.Generator
    ) -> tuple[np.ndarray, dict[str, Any], Tensors]:
        """Compress ``tensors + e_stream``; keep the new residual.

        A residual that is not finite (the input held NaN or Inf, which travels raw and
        leaves ``NaN - NaN`` behind) is dropped and counted in :attr:`resets`: the stream
        restarts from an empty residual, so one bad message never poisons the ones after it.

        Returns:
            ``(blob, description, decoded)`` as :func:`compress_dict`; ``decoded`` is
            what the receiver gets.  Residuals of tensors whose shape changed restart.
        """
        e = self.residuals.get(stream, {})
        corrected = {}
        for k, v in tensors.items():
            if _is_float(v):
                r = e.get(k)
                corrected[k] = v.astype(np.float32) + r if r is not None and r.shape == v.shape else v.astype(np.float32)
            else:
                corrected[k] = v
        blob, desc, decoded = compress_dict(corrected, self.spec, rng)
        residual = {
            k: (corrected[k] - decoded[k]).astype(np.float32) for k in corrected if _is_float(corrected[k])
        }
        with np.errstate(all="ignore"):
            finite = all(np.isfinite(r.sum()) or np.isfinite(r).all() for r in residual.values())
        if finite:
            self.residuals[stream] = residual
        else:
            self.residuals.pop(stream, None)
            self.resets += 1
        return blob, desc, decoded

    def reset(self, stream: Hashable | None = None) -> None:
        """Forget one stream's residual (or all)."""
        if stream is None:
            self.residuals.clear()
        else:
            self.residuals.pop(stream, None)


#: keyframe period of a sparsified CHOCO stream when ``keyframe_every`` is 0 (automatic)
SPARSE_KEYFRAME_EVERY = 100


def default_keyframe_every(spec: CompressionSpec) -> int:
    """Keyframe period when none is configured: 0 (first message only) for dense specs,
    whose copies converge geometrically, and :data:`SPARSE_KEYFRAME_EVERY` for
    sparsified ones (see the module docstring)."""
    return SPARSE_KEYFRAME_EVERY if spec.sparse else 0


def default_consensus_step(spec: CompressionSpec) -> float:
    """CHOCO's γ when none is configured: 1 for dense specs (exact gossip is then
    the algorithm's own rule), the kept fraction for sparsified ones (``topk:0.1``:
    0.1; a count k: 0.05).  CHOCO needs γ of the order of the compression's
    contraction δ = k/n (Koloskova et al. 2019, Thm. 2 takes γ ∝ δ²ω); measured on
    pure gossip of 6 nodes (tests/unit/test_compression.py) γ = 1 diverges for
    top-10% and top-1%, γ = k/n converges."""
    if not spec.sparse:
        return 1.0
    return float(spec.k) if spec.k < 1 else 0.05


class ChocoGossip:
    """CHOCO-SGD copies for one node's averaging gossip (see module docstring).

    Args:
        spec: compression of the differences (e.g. ``topk:0.01+q8``); keyframes use
            its value coder only.
        rng: randomness of the compression.
        error_feedback: ``True`` (CHOCO): differences against the shared copy;
            ``False``: against the previous exact model (what was dropped is lost).
        keyframe_every: resend a keyframe every this many messages (0: automatic,
            :func:`default_keyframe_every`; a negative value: the first message only).
        consensus_step: γ of Alg. 2 line 8 (0 = :func:`default_consensus_step`).

    The message meta of a CHOCO stream is ``{"choco": [seq, key]}`` (key: 1 for a keyframe).
    """

    META = "choco"

    def __init__(
        self,
        spec: CompressionSpec | str,
        rng: np.random.Generator,
        *,
        error_feedback: bool = True,
        keyframe_every: int = 0,
        consensus_step: float = 0.0,
    ):
        self.spec = parse_spec(spec)
        self.rng = rng
        self.error_feedback = error_feedback
        kf = int(keyframe_every)
        self.keyframe_every = default_keyframe_every(self.spec) if kf == 0 else max(0, kf)
        if not consensus_step >= 0:
            raise ValueError(f"consensus_step must be >= 0, got {consensus_step}")
        self.gamma = consensus_step or default_consensus_step(self.spec)
        self.own: Tensors | None = None  # x̂_i
        self.previous: Tensors | None = None  # x_i at the last send (ablation without EF)
        self.seq = 0
        self.copies: dict[str, Tensors] = {}  # x̂_j
        self.kind: str | None = None  # the message kind of the stream (set by its user)
        self.next_seq: dict[str, int] = {}
        self.gaps = 0
        #: ``() -> int`` that grows when a holder of this stream may have lost its copy (a
        #: neighbour came back); the next message is then a keyframe.  None: never.
        self.epoch_source: Any = None
        self._epoch: Any = None

    # -- sending ------------------------------------------------------------------------
    def outgoing(self, x: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
        """Encode this round's message from the exact model/state ``x`` and update x̂_i.

        Returns:
            ``(blob uint8, description, meta)``: the wire blob and description of
            :func:`~dfl_agent.learning.compression.compress_dict`, and the meta entries
            to add to the message.
        """
        epoch = self.epoch_source() if self.epoch_source is not None else None
        key = self.own is None or set(self.own) != set(x) or (
            self.keyframe_every > 0 and self.seq % self.keyframe_every == 0
        ) or epoch != self._epoch  # a neighbour came back: its copy of x̂_i may be gone
        self._epoch = epoch
        if key:
            blob, desc, decoded = compress_dict(x, self.spec.value_only(), self.rng)
            self.own = {k: np.array(v, copy=True) for k, v in decoded.items()}
        else:
            assert self.own is not None
            base = self.own if self.error_feedback else (self.previous or self.own)
            diff = {k: (np.asarray(v, np.float32) - base[k]) if _is_float(v) else np.asarray(v) for k, v in x.items()}
            blob, desc, decoded = compress_dict(diff, self.spec, self.rng)
            self.own = _apply(self.own, decoded)
        self.previous = {k: np.array(v, dtype=np.float32 if _is_float(v) else None, copy=True) for k, v in x.items()}
        meta = {self.META: [self.seq, int(key)]}
        self.seq += 1
        return blob, desc, meta

    # -- receiving --------------------------------------------------------------------
    def incoming(self, sender: str, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Tensors | None:
        """Apply a neighbour's decoded message to its copy x̂_j.

        Returns:
            the updated copy restricted to the names in the message (the copy as it is for
            the message applied last, presented again: it is never applied twice), or
            ``None`` when the message is not part of a CHOCO stream, is older than the one
            applied last, or arrived out of sequence (the neighbour is left out until its
            next keyframe; counted in ``gaps``).
        """
        info = meta.get(self.META)
        if not (isinstance(info, list) and len(info) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in info)):
            return None
        seq, key = info[0], bool(info[1])
        last = self.next_seq.get(sender, -1) - 1
        if seq == last and seq > 0 and sender in self.copies and set(tensors) <= set(self.copies[sender]):
            # the message applied last, presented again (a re-sent copy, or an update a node behind
            # used ahead of its round and uses again in it): the copy it made, applied once
            return {k: self.copies[sender][k] for k in tensors}
        if not key and seq < self.next_seq.get(sender, -1):
            return None  # a copy of a message already applied (re-sent after an outage): the copy stays
        if key and 0 < seq < self.next_seq.get(sender, -1) and sender in self.copies:
            # a message already applied, re-sent as a keyframe to a peer that may have restarted
            # (``Outbox.as_keyframe``), that arrived after the sender's next difference: applying
            # it would rewind the copy and break the stream.  A restarted sender starts at seq 0
            return None
        if key:
            copy = {k: np.array(v, copy=True) for k, v in tensors.items()}
        else:
            old = self.copies.get(sender)
            if old is None or self.next_seq.get(sender) != seq or not set(tensors) <= set(old):
                self.copies.pop(sender, None)
                self.gaps += 1
                return None
            copy = _apply(old, tensors)
        self.copies[sender] = copy
        self.next_seq[sender] = seq + 1
        return {k: copy[k] for k in tensors}

    def forget(self, sender: str) -> None:
        """Drop a neighbour's copy (it left)."""
        self.copies.pop(sender, None)
        self.next_seq.pop(sender, None)

    # -- consensus ------------------------------------------------------------------------
    def own_copy(self, names: Any = None) -> Tensors:
        """x̂_i (restricted to ``names``). Raises RuntimeError before the first send."""
        if self.own is None:
            raise RuntimeError("ChocoGossip.own_copy() before the first outgoing()")
        return {k: self.own[k] for k in (names if names is not None else self.own)}

    def mix(self, x: Mapping[str, np.ndarray], mixed_copies: Mapping[str, np.ndarray]) -> Tensors:
        """Alg. 2 line 8 with the algorithm's mixing rule: ``x + γ (A(x̂) − x̂_i)``.

        Args:
            x: the exact own model.
            mixed_copies: the algorithm's aggregation applied to ``[x̂_i] + [x̂_j …]``.

        Non-float tensors (counters) take the mixed value.
        """
        own = self.own_copy()
        out = {}
        for k, v in x.items():
            if _is_float(v) and k in mixed_copies and k in own:
                out[k] = (np.asarray(v, np.float32) + self.gamma * (mixed_copies[k] - own[k])).astype(np.asarray(v).dtype)
            else:
                out[k] = np.asarray(mixed_copies.get(k, v))
        return out


def _apply(copy: Mapping[str, np.ndarray], q: Mapping[str, np.ndarray]) -> Tensors:
    """x̂ + q for float tensors (non-float tensors are replaced)."""
    out = dict(copy)
    for k, v in q.items():
        out[k] = (copy[k] + v).astype(np.float32) if _is_float(v) and k in copy else np.array(v, copy=True)
    return out
