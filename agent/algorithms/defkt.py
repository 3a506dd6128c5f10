"""``defkt``: decentralized federated learning via mutual knowledge transfer (seed 004).

Def-KT (Li, Li, Varshney; Algorithm 1).  Per round, Q senders train M local epochs
(Eq. 1) and send their model w̃ to Q distinct receivers; each receiver runs E epochs
of two-way mutual knowledge transfer between w̃ and its own model w on its own data
(Eq. 2-8, :func:`dfl_agent.learning.transfer.mutual_transfer`) and stores w̃ after the
transfer as its local model.  The sender keeps its trained w̃ (``sender_keeps``).

Modes (see :mod:`dfl_agent.algorithms.pairing` for the protocols):

- ``rounds``: the paper's rounds; the pairs come from a seeded schedule every node
  computes itself over the nodes it believes live, and each receiver's small
  ``done`` message ends the round for everybody; every wait has a deadline.
- ``gossip``: no global rounds; each node, every ``gossip_interval`` s, fuses the
  models queued in its inbox, trains M epochs and pushes to one random live peer,
  which queues (bounded) or declines; a declined or unanswered push goes to another
  peer.

Options (``dfl_agent.algorithms.pairing.PushOptions`` plus): ``E`` transfer epochs
(default 1, the paper's), ``temperature`` of the KL terms (1 = the paper).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from dfl_agent.algorithms.base import register
from dfl_agent.algorithms.pairing import PushAlgorithm, PushOptions
from dfl_agent.learning.params import load_numpy
from dfl_agent.learning.transfer import mutual_transfer


@dataclasses.dataclass
class DefKTOptions(PushOptions):
    """Options of ``defkt`` (see :class:`~dfl_agent.algorithms.pairing.PushOptions` for the rest).

    Attributes:
        E: passes of mutual knowledge transfer over the receiver's data (paper: 1).
        temperature: τ of the KL terms (1 = the paper; τ ≠ 1 scales KL by τ²).
    """

    E: int = 1
    temperature: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.E < 1:
            raise ValueError(f"E must be >= 1, got {self.E}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@register
class DefKT(PushAlgorithm):
    """Def-KT (seed 004 Algorithm 1); deployable model = the local model."""

    name = "defkt"
    Options = DefKTOptions

    def fuse(self, incoming: dict, samples: float) -> dict[str, Any]:
        """Receiver's model fusion (Algorithm 1, lines 8-16): E epochs of mutual
        knowledge transfer between w̃ (``incoming``) and w (``self.model``) on the
        receiver's training split; then w̃ becomes the local model."""
        d, ctx = self.ctx.data, self.ctx
        w_tilde = copy.deepcopy(self.model)
        load_numpy(w_tilde, incoming)
        stats = mutual_transfer(w_tilde, self.model, d.train_x, d.train_y, ctx.train, ctx.rng,
                                epochs=self.options.E, temperature=self.options.temperature, device=ctx.device)
        self.model = w_tilde  # "Store w̃ as the local model" (Algorithm 1, line 16)
        return {"transfer_ce": stats["ce_incoming"], "transfer_kl": stats["kl_incoming"]}
