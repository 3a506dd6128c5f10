"""``combo``: the Combo baseline of Def-KT (seed 004 Algorithm 3; Hu et al. 2019).

Same rounds and pairs as ``defkt`` (:mod:`dfl_agent.algorithms.protocols.pairs`, rounds mode
only).  The flattened parameter vector is split into two halves
(:func:`dfl_agent.learning.transfer.flatten_segment`).  In a pair (s → r):

- r sends the first half of its model w at the start of the round;
- s trains M epochs (w̃) and sends the second half of w̃;
- r replaces its second half by ``N_s/(N_s+N_r)·w̃_2 + N_r/(N_s+N_r)·w_2``;
- s replaces its first half by ``N_s/(N_s+N_r)·w̃_1 + N_r/(N_s+N_r)·w_1`` and keeps w̃.

Each side gives up at ``t0 + receive_timeout`` (or when the peer leaves) and keeps
its own model (the sender: its trained w̃).  The pair exchanges one model's worth
of parameters, like Def-KT and FullAvg.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dfl_agent.algorithms.base import Traits, register
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.pairs import PairAlgorithm, PairOptions
from dfl_agent.learning.params import load_numpy, model_to_numpy
from dfl_agent.learning.transfer import average_segment, flatten_segment
from dfl_agent.privacy import policy as dp_policy


@register
class Combo(PairAlgorithm):
    """Combo (seed 004 Algorithm 3); deployable model = the local model."""

    name = "combo"
    traits = Traits("pairs", same_architecture=True, dp=dp_policy.DPSupport({
        "defkt.model": ("dp-sgd", "segments of a DP-trained model"), "defkt.model samples": dp_policy.SAMPLES,
        "defkt.model schedule": ("public", "fingerprint of the shared pair schedule")}))
    Options = PairOptions

    def _check_segment(self, msg: Message, expected: int) -> str | None:
        seg = msg.tensors.get("segment")
        if set(msg.tensors) != {"segment"} or seg is None or seg.ndim != 1 or seg.shape[0] != expected \
                or seg.dtype != np.float32:
            return f"incompatible: segment tensor must be float32 ({expected},)"
        samples = msg.meta.get("samples")
        if not isinstance(samples, (int, float)) or isinstance(samples, bool) or not samples > 0:
            return "bad_meta: samples"
        return self.check_schedule(msg)

    def _message(self, t: int, tensors: dict, which: int) -> Message:
        vec = flatten_segment(tensors, which)
        return Message(self.kind(f"seg{which}"), t, {"segment": vec},
                       meta={"samples": self.samples, "schedule": self.fingerprint})

    async def act_as_receiver(self, t: int, sender: str, deadline: float) -> dict[str, Any]:
        own = model_to_numpy(self.model)
        await self.ctx.send(sender, self._message(t, own, 1))
        expected = flatten_segment(own, 2).shape[0]
        msg = await self.await_from(self.kind("seg2"), t, sender, deadline, lambda m: self._check_segment(m, expected))
        if msg is None:
            return {"fused": False, "neighbours": 1}
        with self.divergence_guard("aggregation") as guard:  # a non-finite average is undone
            load_numpy(self.model, average_segment(own, 2, msg.tensors["segment"], self.samples, msg.meta["samples"]))
        return {"fused": not guard.diverged, "neighbours": 1}

    async def act_as_sender(self, t: int, receiver: str, deadline: float) -> dict[str, Any]:
        w_tilde, stats = await self.train_copy()
        mine = model_to_numpy(w_tilde)
        await self.ctx.send(receiver, self._message(t, mine, 2))
        self.model = w_tilde
        expected = flatten_segment(mine, 1).shape[0]
        msg = await self.await_from(self.kind("seg1"), t, receiver, deadline,
                                    lambda m: self._check_segment(m, expected))
        fused = msg is not None
        if msg is not None:
            with self.divergence_guard("aggregation") as guard:  # a non-finite average is undone
                load_numpy(self.model, average_segment(mine, 1, msg.tensors["segment"], self.samples,
                                                       msg.meta["samples"]))
            fused = not guard.diverged
        return {"train_loss": stats["loss"], "fused": fused, "neighbours": 1}
